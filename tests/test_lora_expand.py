"""The LoRA masked-expand kernel (worker/decoder/kernels/lora_expand.py) run by Triton's interpreter on the CPU against the
three operations it replaces in worker/decoder/kernels/row_lora.py (the GPU suite runs it compiled, under the decoder)."""

from __future__ import annotations

import textwrap

from tests.interpreted import run_interpreted

INTERPRETED = textwrap.dedent("""
    import torch
    from worker.decoder.kernels.lora_expand import masked_expand

    generator = torch.Generator().manual_seed(0)
    # a decode step (one token a row) and a prefill pass (several); one layer's rank block, and joined projections'
    # blocks side by side, each member's columns expanding from its own; rows with each adapter and with none; more
    # rows and columns than one tile holds, and boundaries that take narrower tiles
    for dtype in (torch.float32, torch.float16):
        for rows, tokens, boundaries, out in ((5, 1, (), 70), (3, 7, (16, 48), 80), (40, 1, (64,), 130)):
            width = 24  # Kev's 16 and Laya's 8
            table = torch.zeros(3, width)
            table[0, :16], table[1, 16:] = 1, 1
            mask = table[torch.arange(rows) % 3][:, None, :].to(dtype)
            blocks = len(boundaries) + 1
            shrunk = torch.randn(rows, tokens, blocks * width, generator=generator).to(dtype)
            b = torch.randn(out, width, generator=generator).to(dtype)
            output = torch.randn(rows, tokens, out, generator=generator).to(dtype)
            masked = shrunk.float().unflatten(-1, (blocks, width)) * mask.float().unsqueeze(-2)
            block_of = torch.bucketize(torch.arange(out), torch.tensor(boundaries, dtype=torch.long), right=True)
            expected = output.float() + (masked[..., block_of, :] * b.float()).sum(-1)
            masked_expand(output, shrunk, mask, b, boundaries)
            error = ((output.float() - expected).abs().max() / expected.abs().max()).item()
            # float32: the same sums in another order; float16: the inputs' and one result's rounding, where a
            # wrong mask or block would move the result by whole products
            assert error < (1e-5 if dtype == torch.float32 else 2e-3), (dtype, rows, tokens, boundaries, error)
    for shapes in [(torch.zeros(2, 1, 8), torch.zeros(2, 1, 20), torch.zeros(2, 1, 24), torch.zeros(8, 24), ()),
                   (torch.zeros(2, 1, 40), torch.zeros(2, 1, 48), torch.zeros(2, 1, 24), torch.zeros(40, 24), (20,))]:
        try:
            masked_expand(*shapes)
        except ValueError as exc:
            assert "do not fit" in str(exc)
        else:
            raise AssertionError(f"shapes that do not fit were taken: {shapes[-1]}")
    print("agreed")
""")


def test_the_kernel_run_by_tritons_interpreter_masks_and_expands_each_members_rank_block() -> None:
    done = run_interpreted(INTERPRETED)
    assert done.returncode == 0 and "agreed" in done.stdout, done.stderr[-4000:]
