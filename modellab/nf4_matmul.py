"""An experimental NF4 kernel for the decode step's few rows: not used in serving, because it is not yet faster.

bitsandbytes multiplies a 4-bit weight by more than one row as two kernels: it dequantizes the whole weight to
fp16 in memory, then runs an fp16 GEMM over it, about 4.5 bytes of memory traffic a weight. Here one Triton kernel
reads the packed 4-bit weight and its block scales, decodes each tile in registers and multiplies it at once:
0.5 byte a weight. It is correct (tests), but on the H200 it is still several times slower than bitsandbytes'
path, which runs near the card's bandwidth (modellab/bench/results/README.md, nf4-kernel). The benchmark's
decoder phase and `python -m modellab.bench.nf4_kernel` measure it; `install_nf4_kernels` puts it on a model.

The packed format is bitsandbytes' own (the weight is not copied or converted): row-major, two weights a byte,
the even one in the high nibble, one absmax per `blocksize` weights; with double quantization (the default) the
absmaxes are 8-bit codes of a second blockwise quantization plus an offset, decoded in the kernel too.

`dequantize_reference` is the same arithmetic in plain torch, which tests compare with bitsandbytes' own
dequantization on the CPU, and the kernel (Triton's interpreter on the CPU, the real kernel on CUDA) with it.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import types
from dataclasses import dataclass

import torch

log = logging.getLogger("kevlaya.decoder")

# Rows beyond which bitsandbytes' dequantize-then-GEMM is the better path (prefill): its GEMM then reuses each
# dequantized weight over many rows.
MAX_ROWS = 64


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class Nf4Weight:
    """A bitsandbytes 4-bit weight's parts, as the kernel reads them."""

    packed: torch.Tensor  # uint8, (out × in) / 2 bytes
    absmax: torch.Tensor  # float32 per block, or uint8 codes when nested
    code: torch.Tensor  # float32[16]: the 4-bit values
    pairs: torch.Tensor  # int64[256]: per byte, the float32 bits of its high nibble's value, then its low one's
    out_features: int
    in_features: int
    blocksize: int
    nested: bool
    absmax2: torch.Tensor | None = None  # float32 per block of absmax codes
    code2: torch.Tensor | None = None  # float32[256]
    blocksize2: int = 1
    offset: float = 0.0

    @classmethod
    def of(cls, module: torch.nn.Module) -> Nf4Weight | None:
        """The parts of a bitsandbytes Linear4bit holding an NF4 weight, or None for anything else."""
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        if state is None or getattr(state, "quant_type", None) != "nf4":
            return None
        out_features, in_features = state.shape
        if in_features % 64 or in_features % state.blocksize or state.blocksize % 2:
            return None  # the kernel's column tiles are 64 or 128 wide, and a block never straddles two rows
        parts = dict(packed=weight.data.view(-1), code=state.code.float(), pairs=_pairs(state.code),
                     out_features=out_features,
                     in_features=in_features, blocksize=state.blocksize, nested=bool(state.nested))
        if state.nested:
            return cls(absmax=state.absmax, absmax2=state.state2.absmax.float(), code2=state.state2.code.float(),
                       blocksize2=state.state2.blocksize, offset=float(state.offset), **parts)
        return cls(absmax=state.absmax.float(), **parts)


def _pairs(code: torch.Tensor) -> torch.Tensor:
    byte = torch.arange(256, device=code.device)
    bits = [code.float()[nibble].view(torch.int32).long() & 0xFFFFFFFF for nibble in (byte >> 4, byte & 15)]
    return bits[0] | (bits[1] << 32)


def dequantize_reference(weight: Nf4Weight) -> torch.Tensor:
    """The weight as float32 (out × in), by the kernel's arithmetic in plain torch."""
    packed = weight.packed.long()
    codes = torch.stack([packed >> 4, packed & 15], dim=1).view(-1)
    absmax = weight.absmax
    if weight.nested:
        blocks = torch.arange(absmax.numel(), device=absmax.device)
        absmax = weight.code2[absmax.long()] * weight.absmax2[blocks // weight.blocksize2] + weight.offset
    values = weight.code[codes].view(-1, weight.blocksize) * absmax[:, None]
    return values.view(weight.out_features, weight.in_features)


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _nf4_matmul_kernel(x_ptr, packed_ptr, absmax_ptr, code_ptr, pairs_ptr, absmax2_ptr, code2_ptr, bias_ptr,
                           out_ptr,
                           offset, M, N, K, k_per_split, stride_xm, stride_om,
                           BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
                           HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, PAIRS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # out[m, n] = sum_k x[m, k] * w[n, k]. Each weight row's bytes are read contiguously (the tile is n × bytes);
        # a byte's high nibble is an even column and its low nibble the next one, so x is read as its even and odd
        # columns and the weight tile is never interleaved. With SPLIT, each program sums one range of k and adds
        # it into a float32 output.
        BYTES: tl.constexpr = BLOCK_K // 2
        SCALES: tl.constexpr = BLOCK_K // BLOCKSIZE
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(2)
        byte_in_tile = tl.arange(0, BYTES)
        row_in = rm < M
        col_in = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = split * k_per_split
        for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
            byte = tl.load(packed_ptr + (rn[:, None] * K + k0) // 2 + byte_in_tile[None, :], mask=col_in[:, None],
                           other=0).to(tl.int32)
            block = (rn[:, None] * K + k0) // BLOCKSIZE + tl.arange(0, SCALES)[None, :]  # (BLOCK_N, SCALES)
            if NESTED:
                scale_code = tl.load(absmax_ptr + block, mask=col_in[:, None], other=0).to(tl.int32)
                scale = (tl.load(code2_ptr + scale_code) * tl.load(absmax2_ptr + block // BLOCKSIZE2,
                                                                   mask=col_in[:, None], other=0.0) + offset)
            else:
                scale = tl.load(absmax_ptr + block, mask=col_in[:, None], other=0.0)
            scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, SCALES, BLOCKSIZE // 2)),
                               (BLOCK_N, BYTES))
            if PAIRS:  # one load a byte for both of its values
                pair = tl.load(pairs_ptr + byte)
                high = ((pair & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True) * scale).to(tl.float16)
                low = ((pair >> 32).to(tl.int32).to(tl.float32, bitcast=True) * scale).to(tl.float16)
            else:
                high = (tl.load(code_ptr + (byte >> 4)) * scale).to(tl.float16)
                low = (tl.load(code_ptr + (byte & 15)) * scale).to(tl.float16)
            columns = rm[:, None] * stride_xm + k0 + 2 * byte_in_tile[None, :]
            x_even = tl.load(x_ptr + columns, mask=row_in[:, None], other=0.0).to(tl.float16)
            x_odd = tl.load(x_ptr + columns + 1, mask=row_in[:, None], other=0.0).to(tl.float16)
            acc += tl.dot(x_even, tl.trans(high))
            acc += tl.dot(x_odd, tl.trans(low))
        if HAS_BIAS:
            acc += tl.where(split == 0, tl.load(bias_ptr + rn, mask=col_in, other=0.0).to(tl.float32), 0.0)[None, :]
        where = out_ptr + rm[:, None] * stride_om + rn[None, :]
        if SPLIT:
            tl.atomic_add(where, acc, mask=row_in[:, None] & col_in[None, :])
        else:
            tl.store(where, acc.to(out_ptr.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@dataclass(frozen=True)
class Launch:
    block_m: int
    block_n: int
    block_k: int
    split: int  # ranges of k summed apart, each by its own programs
    num_warps: int = 4
    num_stages: int = 3


def plan(rows: int, weight: Nf4Weight, device: torch.device, block_n: int | None = None,
         block_k: int | None = None) -> Launch:
    """Tiles for `rows` rows (`block_n` and `block_k` given: those) and the ranges of k that fill the GPU."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    # Narrow column tiles: a decode step's GEMM is a few rows by thousands of columns, and a memory-bound kernel
    # needs programs on every multiprocessor. A tile's k is whole absmax blocks and divides the input.
    block_n = block_n or (16 if weight.out_features <= 4096 else 32)
    block_k = block_k or next(k for k in (256, 128, 64, weight.blocksize)
                              if k % weight.blocksize == 0 and weight.in_features % k == 0)
    # Then k in ranges (a power of two, each at least four tiles long) until about two programs run per
    # multiprocessor: a weight with few column tiles and a long k (down_proj) would otherwise leave most idle.
    programs = -(-weight.out_features // block_n) * -(-rows // block_m)
    k_tiles, split = weight.in_features // block_k, 1
    while programs * split * 2 <= 2 * _multiprocessors(device) and split * 2 <= k_tiles // 4:
        split *= 2
    return Launch(block_m, block_n, block_k, split)


def nf4_matmul(x: torch.Tensor, weight: Nf4Weight, bias: torch.Tensor | None = None,
               launch: Launch | None = None, pairs: bool = True) -> torch.Tensor:
    """x (… × in, fp16) times the NF4 weight transposed, plus bias: (… × out) in x's dtype. `launch`: tiles and
    ranges of k (default: `plan`'s); `pairs`: decode a byte's two values with one table load (else one each)."""
    flat = x.reshape(-1, weight.in_features).contiguous()
    rows = flat.shape[0]
    launch = launch or plan(rows, weight, x.device)
    block_m, block_n, block_k, split = launch.block_m, launch.block_n, launch.block_k, launch.split
    k_tiles = weight.in_features // block_k
    if split > 1:
        out = torch.zeros(rows, weight.out_features, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(rows, weight.out_features, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(weight.out_features, block_n), triton.cdiv(rows, block_m), split)
    nested = weight.nested
    _nf4_matmul_kernel[grid](
        flat, weight.packed, weight.absmax, weight.code, weight.pairs,
        weight.absmax2 if nested else weight.absmax, weight.code2 if nested else weight.code,
        bias if bias is not None else out, out, weight.offset, rows, weight.out_features, weight.in_features,
        triton.cdiv(k_tiles, split) * block_k, flat.stride(0), out.stride(0), BLOCKSIZE=weight.blocksize,
        BLOCKSIZE2=weight.blocksize2, NESTED=nested, HAS_BIAS=bias is not None, SPLIT=split > 1, PAIRS=pairs,
        BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=launch.num_warps, num_stages=launch.num_stages)
    return out.to(x.dtype).view(*x.shape[:-1], weight.out_features)


class Nf4Kernels:
    """Installed on a model: its NF4 linear layers multiply up to MAX_ROWS rows with the kernel above, more rows
    as before, until `remove()`."""

    # Set by a profiler's user (the benchmark's kernel census): each kernel then runs in a range so named.
    profile_label: str | None = None

    def __init__(self, layers: list[tuple[torch.nn.Module, Nf4Weight]]):
        self.layers = [module for module, _ in layers]
        for module, weight in layers:
            module.forward = types.MethodType(_forward_with(weight, type(module).forward), module)

    def remove(self) -> None:
        for module in self.layers:
            del module.forward  # the class's own forward again
        self.layers.clear()


def install_nf4_kernels(model: torch.nn.Module) -> Nf4Kernels | None:
    """The kernel on every NF4 linear layer of `model` on CUDA computing in fp16; None where there is none, or no
    Triton (bitsandbytes' path then serves, as `KEVLAYA_ENGINE_NF4_KERNEL=bitsandbytes` would)."""
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return None
    layers = [(module, weight) for module in model.modules()
              if isinstance(module, Linear4bit) and module.weight.device.type == "cuda"
              and module.compute_dtype in (None, torch.float16) and (weight := Nf4Weight.of(module)) is not None]
    if not layers:
        return None
    if not triton_available():
        log.warning("Triton is not installed: the NF4 layers multiply through bitsandbytes' dequantize-then-GEMM")
        return None
    log.info("NF4 kernel on %d linear layers for steps of up to %d rows", len(layers), MAX_ROWS)
    return Nf4Kernels(layers)


def _forward_with(weight: Nf4Weight, original):  # noqa: ANN001, ANN202
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // x.shape[-1] > MAX_ROWS or (torch.is_grad_enabled() and x.requires_grad):
            return original(self, x)
        bias = None if self.bias is None else self.bias.to(torch.float16)
        if Nf4Kernels.profile_label is not None:
            with torch.profiler.record_function(Nf4Kernels.profile_label):
                return nf4_matmul(x.to(torch.float16), weight, bias).to(x.dtype)
        return nf4_matmul(x.to(torch.float16), weight, bias).to(x.dtype)

    return forward
