"""The NF4 kernel's arithmetic on the CPU: the reference dequantization against bitsandbytes' own, and the Triton
kernel itself, run by Triton's interpreter, against the reference (the GPU suite runs the compiled kernel)."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.interpreted import run_interpreted
from worker.decoder.kernels.nf4_matmul import Nf4Weight, dequantize_reference


def nf4_linear(out_features: int, in_features: int, nested: bool, seed: int = 0, bias: bool = True):  # noqa: ANN201
    """A bitsandbytes Linear4bit holding an NF4 weight quantized on the CPU, as a checkpoint's would be."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    packed, state = F.quantize_4bit(weight.half(), blocksize=64, compress_statistics=nested, quant_type="nf4")
    layer = bnb.nn.Linear4bit(in_features, out_features, bias=bias, compute_dtype=torch.float16,
                              compress_statistics=nested, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, bnb_quantized=True,
                                     quant_type="nf4")
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(out_features, generator=generator).half(), requires_grad=False)
    return layer


@pytest.mark.parametrize("nested", [True, False], ids=["double-quant", "fp32-absmax"])
def test_the_reference_dequantizes_as_bitsandbytes_does(nested: bool) -> None:
    import bitsandbytes.functional as F

    layer = nf4_linear(96, 320, nested)
    weight = Nf4Weight.of(layer)
    assert weight is not None and weight.nested is nested and weight.standard
    theirs = F.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
    ours = dequantize_reference(weight)
    # bitsandbytes returns fp16: ours, in fp32, agrees to fp16's rounding
    assert torch.allclose(ours, theirs, rtol=1e-3, atol=1e-4), (ours - theirs).abs().max()
    assert ours.abs().max() > 0


def test_a_layer_that_is_not_nf4_is_left_alone() -> None:
    import bitsandbytes as bnb

    assert Nf4Weight.of(torch.nn.Linear(64, 8)) is None
    fp4 = bnb.nn.Linear4bit(64, 8, quant_type="fp4")
    import bitsandbytes.functional as F

    packed, state = F.quantize_4bit(torch.randn(8, 64).half(), blocksize=64, quant_type="fp4")
    fp4.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, bnb_quantized=True,
                                   quant_type="fp4")
    assert Nf4Weight.of(fp4) is None


@pytest.mark.parametrize("nested", [True, False], ids=["double-quant", "fp32-absmax"])
def test_a_prefill_through_an_nf4_layer_dequantizes_its_weight_a_slice_at_a_time(nested: bool,
                                                                                 monkeypatch) -> None:  # noqa: ANN001
    """More rows than the kernel takes (a prefill) dequantize the weight into fp16 first: at most
    DEQUANTIZED_SLICE_BYTES of it at a time (here 32 of 96 rows), with the product bitsandbytes' to rounding. The
    whole weight would stay in a captured prefill's memory pool: 86 MiB for a 7B model's down_proj."""
    import bitsandbytes.functional as bnbf

    from worker.decoder.kernels import nf4_matmul

    layer = nf4_linear(96, 320, nested)
    x = torch.randn(3, 24, 320).half()  # 72 rows: more than the kernel's MAX_ROWS
    expected = torch.nn.functional.linear(x.float(), bnbf.dequantize_4bit(layer.weight.data,
                                          layer.weight.quant_state).float(), layer.bias.float())
    monkeypatch.setattr(nf4_matmul, "DEQUANTIZED_SLICE_BYTES", 32 * 320 * 2)
    dequantize, sliced = bnbf.dequantize_4bit, []

    def dequantized(packed, quant_state=None, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        out = dequantize(packed, quant_state, *args, **kwargs)
        sliced.append(tuple(out.shape))
        return out

    monkeypatch.setattr(bnbf, "dequantize_4bit", dequantized)
    forward = nf4_matmul._forward_with(Nf4Weight.of(layer), type(layer).forward)
    with torch.no_grad():
        got = forward(layer, x)
    assert sliced == [(32, 320)] * 3
    assert got.shape == (3, 24, 96) and got.dtype == torch.float16
    assert torch.allclose(got.float(), expected, rtol=1e-2, atol=1e-2), (got.float() - expected).abs().max()


INTERPRETED = textwrap.dedent("""
    import dataclasses
    import torch
    from tests.test_nf4_matmul import nf4_linear
    from worker.decoder.kernels.nf4_matmul import Nf4Weight, dequantize_reference, nf4_matmul, plan

    worst = 0.0
    for nested in (True, False):
        # columns that fill no tile exactly, and inputs of one and of several 128-column tiles
        for out_features, in_features, bias in ((40, 64, True), (96, 320, False), (33, 256, True)):
            layer = nf4_linear(out_features, in_features, nested, seed=out_features, bias=bias)
            weight = Nf4Weight.of(layer)
            reference = dequantize_reference(weight)
            for rows in (1, 17, 40):
                x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).half()
                expected = x.float() @ reference.T + (layer.bias.float() if bias else 0)
                # k in one range, and in ranges summed apart (more ranges than scale blocks: some are empty, and
                # a range's last iteration runs past its end); values from the select tree or the table; the
                # product transposed or not; even and odd columns apart or joined
                for split, sub, tree, swap, pairwise in ((1, 2, True, False, False), (2, 1, True, True, False),
                                                         (4, 2, False, False, True), (3, 4, False, True, True),
                                                         (8, 2, True, True, True)):
                    launch = dataclasses.replace(plan(rows, weight, x.device), block_n=32, split=split, sub=sub,
                                                 tree=tree, swap=swap, pairwise=pairwise)
                    got = nf4_matmul(x, weight, layer.bias if bias else None, launch=launch)
                    assert got.dtype == torch.float16 and got.shape == expected.shape
                    worst = max(worst, ((got.float() - expected).abs().max() / expected.abs().max()).item())

    # the probe's trial (both scale layouts) runs where the kernel does: here, Triton's interpreter
    from worker.decoder.kernels.nf4_matmul import runs_on
    assert runs_on(torch.device("cpu"))
    print(f"worst relative error {worst:.2e}")
""")


def test_the_kernel_run_by_tritons_interpreter_multiplies_as_the_reference_does() -> None:
    done = run_interpreted(INTERPRETED)
    assert done.returncode == 0, done.stderr[-4000:]
    worst = float(done.stdout.split("worst relative error")[1])
    # fp16 products summed in fp32: the error of fp16 inputs, far below a wrong nibble or scale (~10 %)
    assert worst < 2e-3, done.stdout


def test_the_byte_permute_decode_picks_each_codes_nf4_value() -> None:
    """The PTX of the permute decode (the GPU suite runs it compiled), emulated instruction by instruction: every
    byte value in every position of a word gives its two codes' fp16 NF4 values, high code first."""
    from worker.decoder.kernels.nf4_matmul import NF4_VALUES, permute_asm, ptx_emulated

    asm, values = permute_asm(), NF4_VALUES.half()
    generator = torch.Generator().manual_seed(0)
    for byte in range(256):
        for position in range(4):
            word = int(torch.randint(0, 2**32, (1,), generator=generator, dtype=torch.int64))
            word = (word & ~(0xFF << (8 * position))) | (byte << (8 * position))
            registers = ptx_emulated(asm, word)
            halves = torch.tensor([(r >> shift) & 0xFFFF for r in registers for shift in (0, 16)],
                                  dtype=torch.int32).to(torch.int16).view(torch.float16)
            codes = [(word >> (8 * i)) & 0xFF for i in range(4)]
            expected = values[[c >> 4 for c in codes] + [c & 15 for c in codes]]
            assert torch.equal(halves, expected), (hex(word), halves, expected)
