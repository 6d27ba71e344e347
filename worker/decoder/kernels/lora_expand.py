"""The second half of a row-selected LoRA product as one kernel: `output += (shrunk * row_mask) @ B.T`.

worker/decoder/kernels/row_lora.py computes each LoRA layer as a shrink (`x @ A_all.T`), a row mask that keeps each
row's own adapter's rank block, and an expand added into the base output: three kernels, 432 of a 3B model's decode
step. The mask only zeroes a few columns of a narrow matrix, so it costs a launch for almost no work; here the
expand reads the shrunk columns, masks them and adds the product into the output in one Triton kernel. Served on
CUDA (`RowLoRA(masked_expand=True)`, the slot decoder's default there); the benchmark's `unfused_lora` pair is the
other side. The products are fp16 with float32 sums, added into the output and rounded once, as cuBLAS does.

Joined projections (worker/decoder/kernels/fused_projections.py) shrink once for all their members: `shrunk` then holds
one rank block per member side by side, and each output column tile reads its own member's block, so the expand's
B stays as compact as a single layer's (out × width), not block-diagonal.
"""

from __future__ import annotations

import functools

import torch

from worker.decoder.kernels.triton_kernels import runs, triton_available

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _masked_expand_kernel(shrunk_ptr, mask_ptr, b_ptr, out_ptr, M, N, WIDTH, TOKENS, SECOND, THIRD,
                              stride_shrunk, stride_mask, stride_b, stride_out,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
        # out[m, n] += sum_r shrunk[m, k * WIDTH + r] * mask[m // TOKENS, r] * b[n, r]: shrunk rows are a row's
        # tokens in turn; k is the rank block of column n's projection (from column SECOND on block 1, from THIRD
        # block 2), one per tile, since no tile straddles a boundary
        first = tl.program_id(1) * BLOCK_N
        block = (first >= SECOND).to(tl.int32) + (first >= THIRD).to(tl.int32)
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = first + tl.arange(0, BLOCK_N)
        rr = tl.arange(0, BLOCK_R)
        rows, cols, ranks = rm < M, rn < N, rr < WIDTH
        shrunk = tl.load(shrunk_ptr + rm[:, None] * stride_shrunk + block * WIDTH + rr[None, :],
                         mask=rows[:, None] & ranks[None, :], other=0.0)
        keep = tl.load(mask_ptr + (rm // TOKENS)[:, None] * stride_mask + rr[None, :],
                       mask=rows[:, None] & ranks[None, :], other=0.0)
        b = tl.load(b_ptr + rn[:, None] * stride_b + rr[None, :], mask=cols[:, None] & ranks[None, :], other=0.0)
        delta = tl.dot((shrunk * keep).to(b.dtype), tl.trans(b))
        target = out_ptr + rm[:, None] * stride_out + rn[None, :]
        both = rows[:, None] & cols[None, :]
        base = tl.load(target, mask=both, other=0.0).to(tl.float32)
        tl.store(target, (base + delta).to(out_ptr.dtype.element_ty), mask=both)


def _column_tile(boundaries: tuple[int, ...], block_r: int) -> int | None:
    """The widest column tile no boundary falls inside (None: a boundary not a multiple of 16)."""
    widest = 64 if block_r <= 64 else 32
    return next((tile for tile in (64, 32, 16) if tile <= widest and all(s % tile == 0 for s in boundaries)), None)


def masked_expand(output: torch.Tensor, shrunk: torch.Tensor, mask: torch.Tensor, b: torch.Tensor,
                  boundaries: tuple[int, ...] = ()) -> None:
    """`output` (rows × tokens × out) plus each row's `(shrunk * mask) @ b.T`, in place: `mask` (rows × 1 × width)
    is each row's 0/1 rank mask, `b` (out × width) the expand. `shrunk` (rows × tokens × blocks·width) holds one
    rank block per projection of a joined group: the output columns from `boundaries[k - 1]` on take block k (at
    most three blocks; boundaries multiples of 16)."""
    rows, width = mask.shape[0], mask.shape[-1]
    flat_out, flat_shrunk = output.view(-1, output.shape[-1]), shrunk.reshape(-1, shrunk.shape[-1])
    m, n, r = flat_out.shape[0], flat_out.shape[1], flat_shrunk.shape[1]
    block_r = max(16, triton.next_power_of_2(width))
    tile = _column_tile(boundaries, block_r)
    ordered = list(boundaries) == sorted(set(boundaries)) and all(0 < s < n for s in boundaries)
    if (flat_shrunk.shape[0] != m or m % rows or r != (len(boundaries) + 1) * width or b.shape != (n, width)
            or len(boundaries) > 2 or not ordered or tile is None):
        raise ValueError(f"shapes do not fit: output {tuple(output.shape)}, shrunk {tuple(shrunk.shape)}, mask "
                         f"{tuple(mask.shape)}, b {tuple(b.shape)}, boundaries {boundaries}")
    mask2d = mask.reshape(rows, width)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    second, third = (*boundaries, n, n)[:2]
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, tile))
    _masked_expand_kernel[grid](flat_shrunk, mask2d, b, flat_out, m, n, width, m // rows, second, third,
                                flat_shrunk.stride(0), mask2d.stride(0), b.stride(0), flat_out.stride(0),
                                BLOCK_M=block_m, BLOCK_N=tile, BLOCK_R=block_r)


@functools.cache
def runs_on(device: torch.device) -> bool:
    """Whether the kernel builds and runs on `device` (worker/decoder/kernels/triton_kernels.py), tried once."""
    def trial(device: torch.device) -> None:
        zeros = torch.zeros(1, 1, 16, device=device, dtype=torch.float16)
        masked_expand(zeros, zeros.clone(), zeros.clone(), torch.zeros(16, 16, device=device, dtype=torch.float16))

    return runs(trial, device, "LoRA expand kernel", "each LoRA product's mask and expand run as two operations")


def takes(output: torch.Tensor, shrunk: torch.Tensor, mask: torch.Tensor, b: torch.Tensor,
          boundaries: tuple[int, ...] = ()) -> bool:
    """Whether the kernel computes this product: one CUDA device and dtype, contiguous rows, a mask row per row,
    at most three rank blocks with boundaries on multiples of 16."""
    return (triton_available() and output.is_cuda and output.dtype == shrunk.dtype == mask.dtype == b.dtype
            and output.is_contiguous() and shrunk.stride(-1) == 1 and b.stride(-1) == 1 and mask.is_contiguous()
            and output.dim() == shrunk.dim() == mask.dim() == 3 and mask.shape[0] == output.shape[0]
            and mask.shape[1] == 1 and len({output.device, shrunk.device, mask.device, b.device}) == 1
            and len(boundaries) <= 2 and all(s % 16 == 0 for s in boundaries))
