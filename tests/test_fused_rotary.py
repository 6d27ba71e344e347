"""The rotary kernel (worker/decoder/kernels/fused_rotary.py) run by Triton's interpreter on the CPU against transformers'
own `apply_rotary_pos_emb` (tests/test_decoder.py installs it under a decoder; the GPU suite runs the compiled kernel
under captured steps)."""

from __future__ import annotations

import textwrap

import pytest

from tests.interpreted import run_interpreted

INTERPRETED = textwrap.dedent("""
    import torch
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb
    from worker.decoder.kernels.fused_rotary import rotary, takes

    for dtype in (torch.float32, torch.float16):
        # a decode step's one token and a prefill's several; head counts that are and are not powers of two
        for batch, q_heads, k_heads, seq, dim in ((3, 16, 2, 1, 128), (2, 8, 4, 5, 32), (1, 6, 3, 7, 64)):
            generator = torch.Generator().manual_seed(batch * seq)
            # queries and keys as the joined q/k/v projection gives them: strided views into one output
            joined = torch.randn(batch, seq, (q_heads + 2 * k_heads) * dim, generator=generator).to(dtype)
            q, k, _ = joined.split([q_heads * dim, k_heads * dim, k_heads * dim], dim=-1)
            q = q.view(batch, seq, -1, dim).transpose(1, 2)
            k = k.view(batch, seq, -1, dim).transpose(1, 2)
            angles = torch.randn(batch, seq, dim // 2, generator=generator) * 3
            cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)
            assert takes(q, k, cos, sin, 1)
            expected = apply_rotary_pos_emb(q.float(), k.float(), cos.float(), sin.float())
            got = rotary(q, k, cos, sin)
            for e, g, source in zip(expected, got, (q, k)):
                assert g.shape == source.shape and g.dtype == dtype and g.is_contiguous()
                error = (g.float() - e).abs().max().item()
                # float32: the same arithmetic; float16: one rounding of values up to about 4 (a unit in the last
                # place there is 0.002), where a wrong half or sign would be off by the values themselves
                assert error <= (1e-6 if dtype == torch.float32 else 4e-3), (dtype, batch, seq, error)
    x = torch.randn(1, 2, 3, 24)  # a half dimension of 12 is not a power of two: left to transformers
    assert not takes(x, x, torch.randn(1, 3, 24), torch.randn(1, 3, 24), 1)
    print("agreed")
""")


def test_the_kernel_run_by_tritons_interpreter_rotates_as_transformers_does() -> None:
    done = run_interpreted(INTERPRETED)
    assert done.returncode == 0 and "agreed" in done.stdout, done.stderr[-4000:]


def test_where_the_kernels_cannot_run_the_decoder_is_told_so_and_they_are_not_used(caplog) -> None:
    """Triton builds each kernel's launcher with the machine's C compiler on first use, so a machine without one
    (a slim image), or without a device Triton drives, fails there: the probe says no, once, with the reason in
    the log, and the decoder then serves through the operations the kernels replace. Here the CPU is such a
    device (no interpreter: Triton finds no GPU driver)."""
    pytest.importorskip("triton", reason="without Triton the probe says no before trying")
    import torch

    from worker.decoder.kernels import fused_rotary, lora_expand, nf4_matmul

    cpu = torch.device("cpu")
    for module in (fused_rotary, lora_expand, nf4_matmul):
        module.runs_on.cache_clear()
        with caplog.at_level("WARNING", logger="kevlaya.decoder"):
            assert module.runs_on(cpu) is False
        assert f"does not run on {cpu}" in caplog.text
        caplog.clear()
        assert module.runs_on(cpu) is False and not caplog.text  # tried once
