"""The NF4 matmul of the decode step's few rows as one Triton kernel (served on CUDA for 2 to MAX_ROWS rows).

bitsandbytes multiplies a 4-bit weight by more than one row as two kernels: it dequantizes the whole weight to
fp16 in memory, then runs an fp16 GEMM over it, about 4.5 bytes of memory traffic a weight. Here one kernel reads
the packed 4-bit weight and its block scales, decodes each scale block in registers and multiplies it at once:
0.5 byte a weight. Decoding is what bounds it: on CUDA four codes at a time by byte permutes (`permute_asm`, about
4 instructions a weight); elsewhere (Triton's interpreter in the tests) by a tree of selects. At one row
bitsandbytes' fused GEMV is faster, so one row keeps its path (modellab/bench/results/README.md, nf4-kernel).

The packed format is bitsandbytes' own (the weight is not copied or converted): row-major, two weights a byte,
the even one in the high nibble, one absmax per `blocksize` weights; with double quantization (the default) the
absmaxes are 8-bit codes of a second blockwise quantization plus an offset, decoded in the kernel too.

`dequantize_reference` is the same arithmetic in plain torch, which tests compare with bitsandbytes' own
dequantization on the CPU, and the kernel (Triton's interpreter on the CPU, the real kernel on CUDA) with it.
`Nf4Kernels` puts the kernel on a model's NF4 layers while a decoder serves; worker/decoder/kernels/fused_projections.py
calls it for joined projections (`takes`).
"""

from __future__ import annotations

import functools
import logging
import types
from dataclasses import dataclass

import torch

from worker.decoder.kernels.triton_kernels import runs, triton_available

log = logging.getLogger("kevlaya.decoder")

# Rows beyond which bitsandbytes' dequantize-then-GEMM is the better path (prefill): its GEMM then reuses each
# dequantized weight over many rows.
MAX_ROWS = 64
# Rows below which bitsandbytes' fused one-row GEMV is the better path (twice as fast as the kernel at one row).
MIN_ROWS = 2

# A product of more rows than the kernel takes (a prefill) dequantizes the weight to fp16 first: at most this many
# bytes of it at a time, so the largest transient a prefill takes (which a captured prefill's memory pool keeps for
# good) is a slice, not a whole weight (86 MiB for a 7B model's down_proj, a tenth of a 6 GB card's workspace).
DEQUANTIZED_SLICE_BYTES = 16 * 2**20

# bitsandbytes' NF4 table (`bitsandbytes.functional.get_4bit_type("nf4")`), which the kernel's select tree holds
NF4_VALUES = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                           -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                           0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                           0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0])


@dataclass(frozen=True)
class Nf4Weight:
    """A bitsandbytes 4-bit weight's parts, as the kernel reads them."""

    packed: torch.Tensor  # uint8, (out × in) / 2 bytes
    absmax: torch.Tensor  # float32 per block, or uint8 codes when nested
    code: torch.Tensor  # float32[16]: the 4-bit values
    standard: bool  # `code` is NF4_VALUES (the kernel may then decode without loading it)
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
        return cls.from_state(weight.data, getattr(weight, "quant_state", None)) if weight is not None else None

    @classmethod
    def from_state(cls, packed: torch.Tensor, state) -> Nf4Weight | None:  # noqa: ANN001 (bitsandbytes' QuantState)
        """The parts of a packed 4-bit weight and its bitsandbytes quantization state, or None when it is not NF4
        or has scale blocks the kernel cannot read."""
        if state is None or getattr(state, "quant_type", None) != "nf4":
            return None
        out_features, in_features = state.shape
        if in_features % state.blocksize or state.blocksize < 32 or state.blocksize & (state.blocksize - 1):
            return None  # the kernel reads whole scale blocks of 32 columns or more, never across two rows
        parts = dict(packed=packed.view(-1), code=state.code.float(),
                     standard=torch.equal(state.code.float().cpu(), NF4_VALUES),
                     out_features=out_features,
                     in_features=in_features, blocksize=state.blocksize, nested=bool(state.nested))
        if state.nested:
            return cls(absmax=state.absmax, absmax2=state.state2.absmax.float(), code2=state.state2.code.float(),
                       blocksize2=state.state2.blocksize, offset=float(state.offset), **parts)
        return cls(absmax=state.absmax.float(), **parts)


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


def _table_words(values: torch.Tensor) -> tuple[list[int], list[int]]:
    """The 16 values in fp16, as four 32-bit words of their low bytes and four of their high bytes (value i in byte
    i % 4 of word i // 4): what a byte permute picks from."""
    bits = [int(b) & 0xFFFF for b in values.half().view(torch.int16).tolist()]
    low, high = [b & 0xFF for b in bits], [b >> 8 for b in bits]
    return ([sum(t[i + j] << (8 * j) for j in range(4)) for i in range(0, 16, 4)] for t in (low, high))


def permute_asm(values: torch.Tensor = NF4_VALUES) -> str:
    """PTX that decodes one 32-bit word of packed codes (four bytes, the even column's code in each high nibble) into
    the fp16 values of the four high codes ($0, $1) and of the four low ones ($2, $3), two a register, in column
    order. A byte permute (`prmt`) picks four bytes out of eight by four 3-bit selectors at once, so four codes
    take two permutes per byte of the value (codes 0-7 and 8-15, merged by each code's top bit with one `lop3`)
    and two more to interleave low and high bytes: about 4 instructions a weight, against about 20 for the tree of
    selects. `ptx_emulated` runs it on the CPU for the tests."""
    low, high = _table_words(values)
    table = "\n".join(f"mov.b32 {name}{i}, {word:#010x};" for name, words in (("l", low), ("h", high))
                      for i, word in enumerate(words))

    def lookup(first: str, second: str) -> str:
        # `sel` holds four codes as nibbles; `big` gets 0xFF in each byte whose code is 8 or more
        return f"""and.b32 sel7, sel, 0x7777;
shr.b32 top, sel, 3;
and.b32 top, top, 0x1111;
prmt.b32 big, kff, kff, top;
prmt.b32 x0, l0, l1, sel7;
prmt.b32 x1, l2, l3, sel7;
lop3.b32 lob, x0, x1, big, 0xD8;
prmt.b32 x0, h0, h1, sel7;
prmt.b32 x1, h2, h3, sel7;
lop3.b32 hib, x0, x1, big, 0xD8;
prmt.b32 {first}, lob, hib, 0x5140;
prmt.b32 {second}, lob, hib, 0x7362;"""

    def codes(which: str) -> str:
        # the word's four high (or low) codes, one a byte, then as the four nibbles of `sel`
        return f"""{which}
and.b32 w, w, 0x0F0F0F0F;
shr.b32 sel, w, 4;
or.b32 w, w, sel;
prmt.b32 sel, w, w, 0x0020;"""

    return f"""{{
.reg .b32 w, sel, sel7, top, big, x0, x1, lob, hib, kff, l0, l1, l2, l3, h0, h1, h2, h3;
mov.b32 kff, 0x0000FF00;
{table}
{codes("shr.b32 w, $4, 4;")}
{lookup("$0", "$1")}
{codes("mov.b32 w, $4;")}
{lookup("$2", "$3")}
}}"""


def ptx_emulated(asm: str, word: int) -> list[int]:
    """`asm` (permute_asm's instructions only) run on one input word: the four output registers."""
    mask = 0xFFFFFFFF
    regs: dict[str, int] = {"$4": word}

    def value(operand: str) -> int:
        return regs[operand] if operand in regs else int(operand, 0)

    def prmt(a: int, b: int, selector: int) -> int:
        pool = (b << 32) | a
        return sum(((pool >> (8 * ((selector >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))

    def lop3(a: int, b: int, c: int, lut: int) -> int:
        return sum(((lut >> ((((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1))) & 1) << i
                   for i in range(32))

    ops = {"mov": lambda a: a, "and": lambda a, b: a & b, "or": lambda a, b: a | b, "shr": lambda a, b: a >> b,
           "prmt": prmt, "lop3": lop3}
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, operands = line.split(None, 1)
        target, *sources = [o.strip() for o in operands.split(",")]
        regs[target] = ops[op.split(".")[0]](*map(value, sources)) & mask
    return [regs[f"${i}"] for i in range(4)]


if triton_available():
    import triton
    import triton.language as tl

    PERMUTE_ASM = tl.constexpr(permute_asm())

    @triton.jit
    def _nf4_value(codes):
        # NF4's 16 values by the code's bits, as a tree of selects: no memory access (the table-load variant is
        # the other side of the bench's sweep)
        b3, b2, b1, b0 = (codes & 8) != 0, (codes & 4) != 0, (codes & 2) != 0, (codes & 1) != 0
        high = tl.where(b2, tl.where(b1, tl.where(b0, 1.0, 0.7229568362236023),
                                     tl.where(b0, 0.5626170039176941, 0.44070982933044434)),
                        tl.where(b1, tl.where(b0, 0.33791524171829224, 0.24611230194568634),
                                 tl.where(b0, 0.16093020141124725, 0.07958029955625534)))
        low = tl.where(b2, tl.where(b1, tl.where(b0, 0.0, -0.09105003625154495),
                                    tl.where(b0, -0.18477343022823334, -0.28444138169288635)),
                       tl.where(b1, tl.where(b0, -0.39491748809814453, -0.5250730514526367),
                                tl.where(b0, -0.6961928009986877, -1.0)))
        return tl.where(b3, high, low)

    @triton.jit
    def _nf4_decoded(byte, scale, code_ptr, TREE: tl.constexpr):
        """The fp16 weights of 4-bit codes `byte` (BLOCK_N × some columns) times their row's scale: bitsandbytes'
        own rounding (the value times the scale in float32, then rounded once)."""
        if TREE:
            value = _nf4_value(byte.to(tl.int32))
        else:
            value = tl.load(code_ptr + byte.to(tl.int32))
        return (value * scale[:, None]).to(tl.float16)

    @triton.jit
    def _nf4_permuted(byte, scale):
        """The fp16 weights of a byte's high codes (even columns) and low codes (odd columns) times their row's
        scale, the values picked by byte permutes (permute_asm) and scaled in fp16: one rounding more than
        bitsandbytes' (value × scale in float32, rounded once)."""
        high, low = tl.inline_asm_elementwise(PERMUTE_ASM, "=r,=r,=r,=r,r", [byte], dtype=(tl.float16, tl.float16),
                                              is_pure=True, pack=4)
        scale = scale.to(tl.float16)[:, None]
        return high * scale, low * scale

    @triton.jit
    def _nf4_matmul_kernel(x_ptr, packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, bias_ptr, out_ptr,
                           offset, M, N, K, blocks_per_split, stride_xm, stride_om,
                           BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
                           HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, TREE: tl.constexpr, PERMUTE: tl.constexpr,
                           SUB: tl.constexpr,
                           SWAP: tl.constexpr, PAIRWISE: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr):
        # out[m, n] = sum_k x[m, k] * w[n, k], one scale block (BLOCKSIZE columns of k) at a time: the block's bytes
        # are read row by row as they lie (contiguous in k) and decoded with their row's scale. PAIRWISE: a byte's
        # high codes (even columns) and low codes (odd columns) each multiply x's even or odd columns, else they
        # are joined back in column order. SWAP: the product is computed transposed (w @ x.T), the weights being
        # the wide operand. SUB blocks per iteration; program (i, j, s) computes column tile i, row tile j, over the
        # s-th range of scale blocks; with SPLIT the ranges are summed into a float32 output.
        HALF: tl.constexpr = BLOCKSIZE // 2
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        col_in, row_in = rn < N, rm < M
        blocks_per_row = K // BLOCKSIZE
        first = tl.program_id(2) * blocks_per_split
        last = tl.minimum(first + blocks_per_split, blocks_per_row)
        byte_in_block = tl.arange(0, HALF)
        if SWAP:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for b0 in range(first, last, SUB):
            for j in tl.static_range(SUB):
                b = b0 + j
                cols = col_in & (rn * 0 + b < last)  # a range's last iteration may run past its end
                rows = row_in & (rm * 0 + b < last)
                byte = tl.load(packed_ptr + rn[:, None] * (K // 2) + b * HALF + byte_in_block[None, :],
                               mask=cols[:, None], other=0)
                block = rn * blocks_per_row + b
                if NESTED:
                    scale_code = tl.load(absmax_ptr + block, mask=cols, other=0).to(tl.int32)
                    scale = tl.load(code2_ptr + scale_code) * tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=cols,
                                                                      other=0.0) + offset
                else:
                    scale = tl.load(absmax_ptr + block, mask=cols, other=0.0)
                x_row = x_ptr + rm[:, None] * stride_xm + b * BLOCKSIZE
                if PERMUTE:
                    high, low = _nf4_permuted(byte, scale)
                else:
                    high = _nf4_decoded(byte >> 4, scale, code_ptr, TREE)
                    low = _nf4_decoded(byte & 15, scale, code_ptr, TREE)
                if PAIRWISE:
                    x_even = tl.load(x_row + 2 * byte_in_block[None, :], mask=rows[:, None], other=0.0)
                    x_odd = tl.load(x_row + 2 * byte_in_block[None, :] + 1, mask=rows[:, None], other=0.0)
                    if SWAP:
                        acc = tl.dot(high, tl.trans(x_even), acc)
                        acc = tl.dot(low, tl.trans(x_odd), acc)
                    else:
                        acc = tl.dot(x_even, tl.trans(high), acc)
                        acc = tl.dot(x_odd, tl.trans(low), acc)
                else:
                    w = tl.reshape(tl.join(high, low), (BLOCK_N, BLOCKSIZE))
                    x = tl.load(x_row + tl.arange(0, BLOCKSIZE)[None, :], mask=rows[:, None], other=0.0)
                    if SWAP:
                        acc = tl.dot(w, tl.trans(x), acc)
                    else:
                        acc = tl.dot(x, tl.trans(w), acc)
        if SWAP:
            acc = tl.trans(acc)
        if HAS_BIAS:
            acc += tl.where(tl.program_id(2) == 0, tl.load(bias_ptr + rn, mask=col_in, other=0.0).to(tl.float32),
                            0.0)[None, :]
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
    split: int  # ranges of scale blocks summed apart, each by its own programs
    sub: int = 2  # scale blocks an iteration reads
    tree: bool = True  # NF4 values from a tree of selects (else loaded from the 16-value table)
    permute: bool = False  # NF4 values by byte permutes (PTX: CUDA only; tree and table then unused)
    swap: bool = False  # the product computed transposed, the weights as the wide operand
    pairwise: bool = False  # even and odd columns multiplied apart (else a byte's codes joined in column order)
    num_warps: int = 4
    num_stages: int = 3


def plan(rows: int, weight: Nf4Weight, device: torch.device, block_n: int | None = None) -> Launch:
    """Tiles for `rows` rows (`block_n` given: that) and the ranges of k that fill the GPU."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    # The sweep's rule (results README, nf4-permute): the product transposed, one scale block an iteration, narrow
    # column tiles on weights at most 4,096 both ways (more programs on few outputs), wider ones on the rest.
    small = weight.out_features <= 4096 and weight.in_features <= 4096
    block_n = block_n or (32 if small else 64)
    # A memory-bound kernel needs bytes in flight on every multiprocessor: k in ranges (each at least eight scale
    # blocks long) until about two programs run per multiprocessor; the outputs are few and wide, the inputs long.
    programs = -(-weight.out_features // block_n) * -(-rows // block_m)
    blocks, split = weight.in_features // weight.blocksize, 1
    while programs * split < 2 * _multiprocessors(device) and blocks // (split * 2) >= 8:
        split *= 2
    standard = weight.standard  # the tree and the permutes hold NF4's own values; another table is loaded
    return Launch(block_m, block_n, split, sub=1, swap=True, tree=standard, permute=standard and device.type == "cuda")


def nf4_matmul(x: torch.Tensor, weight: Nf4Weight, bias: torch.Tensor | None = None,
               launch: Launch | None = None) -> torch.Tensor:
    """x (… × in, fp16) times the NF4 weight transposed, plus bias: (… × out) in x's dtype. `launch`: tiles and
    ranges of k (default: `plan`'s)."""
    flat = x.reshape(-1, weight.in_features).contiguous()
    rows = flat.shape[0]
    launch = launch or plan(rows, weight, x.device)
    blocks = weight.in_features // weight.blocksize
    split = min(launch.split, blocks)
    if split > 1:
        out = torch.zeros(rows, weight.out_features, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(rows, weight.out_features, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(weight.out_features, launch.block_n), triton.cdiv(rows, launch.block_m), split)
    nested = weight.nested
    _nf4_matmul_kernel[grid](
        flat, weight.packed, weight.absmax, weight.code,
        weight.absmax2 if nested else weight.absmax, weight.code2 if nested else weight.code,
        bias if bias is not None else out, out, weight.offset, rows, weight.out_features, weight.in_features,
        triton.cdiv(blocks, split), flat.stride(0), out.stride(0), BLOCKSIZE=weight.blocksize,
        BLOCKSIZE2=weight.blocksize2, NESTED=nested, HAS_BIAS=bias is not None, SPLIT=split > 1,
        TREE=launch.tree, PERMUTE=launch.permute, SUB=launch.sub, SWAP=launch.swap, PAIRWISE=launch.pairwise, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
        num_warps=launch.num_warps, num_stages=launch.num_stages)
    return out.to(x.dtype).view(*x.shape[:-1], weight.out_features)


def takes(x: torch.Tensor) -> bool:
    """Whether the kernel multiplies `x` (… × in): while a decoder serves it, on CUDA, MIN_ROWS to MAX_ROWS rows,
    no gradient."""
    return (Nf4Kernels.holders > 0 and x.is_cuda and MIN_ROWS <= x.numel() // x.shape[-1] <= MAX_ROWS
            and not (torch.is_grad_enabled() and x.requires_grad))


def decoded_scales(state) -> torch.Tensor:  # noqa: ANN001 (bitsandbytes' QuantState)
    """A 4-bit weight's block scales in float32, as bitsandbytes decodes them before each dequantization."""
    import bitsandbytes.functional as bnbf

    if not state.nested:
        return state.absmax.float()
    return bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset


def sliced_matmul(x: torch.Tensor, packed: torch.Tensor, state, bias: torch.Tensor | None,  # noqa: ANN001
                  compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`x @ W.T + bias` for a bitsandbytes 4-bit weight (`packed`, its QuantState `state`), dequantizing at most
    DEQUANTIZED_SLICE_BYTES of W's rows at a time; the answer is bitsandbytes' (`matmul_4bit`) to rounding."""
    import bitsandbytes
    import bitsandbytes.functional as bnbf

    out_features, in_features = state.shape
    rows = max(1, DEQUANTIZED_SLICE_BYTES // (in_features * state.dtype.itemsize))
    if (rows >= out_features or in_features % state.blocksize or in_features % 2 or packed.dtype != torch.uint8
            or getattr(state, "packing_format_for_cpu", False)):
        return bitsandbytes.matmul_4bit(x.to(compute_dtype or x.dtype), packed, quant_state=state,
                                        bias=bias).to(x.dtype)
    flat, scales, per_row = packed.view(-1), decoded_scales(state), in_features // state.blocksize
    inputs = x.to(compute_dtype or state.dtype)
    parts = []
    for first in range(0, out_features, rows):
        last = min(first + rows, out_features)
        part = bnbf.QuantState(absmax=scales[first * per_row:last * per_row], shape=torch.Size([last - first,
                               in_features]), code=state.code, blocksize=state.blocksize, quant_type=state.quant_type,
                               dtype=state.dtype)
        weight = bnbf.dequantize_4bit(flat[first * in_features // 2:last * in_features // 2], part)
        parts.append(torch.nn.functional.linear(inputs, weight.to(inputs.dtype),
                                                None if bias is None else bias[first:last].to(inputs.dtype)))
    return torch.cat(parts, dim=-1).to(x.dtype)


def kernel_matmul(x: torch.Tensor, weight: Nf4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """`nf4_matmul` in fp16 for `x` of any dtype, in a profiler range when one is named."""
    bias = None if bias is None else bias.to(torch.float16)
    if Nf4Kernels.profile_label is None:
        return nf4_matmul(x.to(torch.float16), weight, bias).to(x.dtype)
    with torch.profiler.record_function(Nf4Kernels.profile_label):
        return nf4_matmul(x.to(torch.float16), weight, bias).to(x.dtype)


class Nf4Kernels:
    """Installed by a decoder on a model's NF4 linear layers (`nf4_layers`): they, and the joined projections
    through `takes`, multiply MIN_ROWS to MAX_ROWS rows with the kernel, other row counts as before. Installs are
    counted per process, as the layers' forwards are patched once: the last `remove()` gives every layer its own
    forward back."""

    # Set by a profiler's user (the benchmark's kernel census): each kernel then runs in a range so named.
    profile_label: str | None = None
    holders = 0  # decoders that serve the kernel
    _patched: list[torch.nn.Module] = []

    def __init__(self, layers: list[tuple[torch.nn.Module, Nf4Weight]]):
        for module, weight in layers:
            if "forward" not in vars(module):
                module.forward = types.MethodType(_forward_with(weight, type(module).forward), module)
                Nf4Kernels._patched.append(module)
        Nf4Kernels.holders += 1
        self.held = True

    def remove(self) -> None:
        if not self.held:
            return
        self.held = False
        Nf4Kernels.holders -= 1
        if Nf4Kernels.holders == 0:
            for module in Nf4Kernels._patched:
                vars(module).pop("forward", None)  # the class's own forward again
            Nf4Kernels._patched.clear()


def nf4_layers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Nf4Weight]]:
    """`model`'s bitsandbytes NF4 linear layers on CUDA computing in fp16, with their weights' parts."""
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return []
    return [(module, weight) for module in model.modules()
            if isinstance(module, Linear4bit) and module.weight.device.type == "cuda"
            and module.compute_dtype in (None, torch.float16) and (weight := Nf4Weight.of(module)) is not None]


def _forward_with(weight: Nf4Weight, original):  # noqa: ANN001, ANN202
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if takes(x):
            return kernel_matmul(x, weight, self.bias)
        if x.numel() == x.shape[-1] or self.weight.quant_state is None:  # one row: bitsandbytes' GEMV
            return original(self, x)
        return sliced_matmul(x, self.weight, self.weight.quant_state, self.bias, self.compute_dtype)

    return forward


@functools.cache
def runs_on(device: torch.device) -> bool:
    """Whether the kernel builds and runs on `device` (worker/decoder/kernels/triton_kernels.py), tried once."""
    def trial(device: torch.device) -> None:
        # both scale layouts the decoder serves: float32 (joined projections) and double-quantized (the others)
        parts = dict(packed=torch.zeros(64 * 64 // 2, dtype=torch.uint8, device=device), code=NF4_VALUES.to(device),
                     standard=True, out_features=64, in_features=64, blocksize=64)
        x = torch.zeros(2, 64, dtype=torch.float16, device=device)
        nf4_matmul(x, Nf4Weight(absmax=torch.ones(64, device=device), nested=False, **parts))
        nf4_matmul(x, Nf4Weight(absmax=torch.zeros(64, dtype=torch.uint8, device=device), nested=True,
                                absmax2=torch.ones(1, device=device), code2=torch.ones(256, device=device),
                                blocksize2=256, **parts))

    return runs(trial, device, "NF4 kernel", "the NF4 matmuls run through bitsandbytes")
