"""The second half of a row-selected LoRA product as one kernel: `output += (shrunk * row_mask) @ B.T`.

worker/decoder/row_lora.py computes each LoRA layer as a shrink (`x @ A_all.T`), a row mask that keeps each
row's own adapter's rank block, and an expand added into the base output: three kernels, 432 of a 3B model's decode
step. The mask only zeroes a few columns of a narrow matrix, so it costs a launch for almost no work; here the
expand reads the shrunk columns, masks them and adds the product into the output in one Triton kernel. Served on
CUDA (`RowLoRA(masked_expand=True)`, the slot decoder's default there); the benchmark's `unfused_lora` pair is the
other side. The products are fp16 with float32 sums, added into the output and rounded once, as cuBLAS does.
"""

from __future__ import annotations

import functools

import torch

from worker.decoder.triton_kernels import runs, triton_available

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _masked_expand_kernel(shrunk_ptr, mask_ptr, b_ptr, out_ptr, M, N, R, WIDTH, TOKENS,
                              stride_shrunk, stride_mask, stride_b, stride_out,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
        # out[m, n] += sum_r shrunk[m, r] * mask[m // TOKENS, r % WIDTH] * b[n, r]: shrunk rows are a row's tokens
        # in turn, and its columns several layers' rank blocks side by side, each taking the same mask
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rr = tl.arange(0, BLOCK_R)
        rows, cols, ranks = rm < M, rn < N, rr < R
        shrunk = tl.load(shrunk_ptr + rm[:, None] * stride_shrunk + rr[None, :], mask=rows[:, None] & ranks[None, :],
                         other=0.0)
        keep = tl.load(mask_ptr + (rm // TOKENS)[:, None] * stride_mask + (rr % WIDTH)[None, :],
                       mask=rows[:, None] & ranks[None, :], other=0.0)
        b = tl.load(b_ptr + rn[:, None] * stride_b + rr[None, :], mask=cols[:, None] & ranks[None, :], other=0.0)
        delta = tl.dot((shrunk * keep).to(b.dtype), tl.trans(b))
        target = out_ptr + rm[:, None] * stride_out + rn[None, :]
        both = rows[:, None] & cols[None, :]
        base = tl.load(target, mask=both, other=0.0).to(tl.float32)
        tl.store(target, (base + delta).to(out_ptr.dtype.element_ty), mask=both)


def masked_expand(output: torch.Tensor, shrunk: torch.Tensor, mask: torch.Tensor, b: torch.Tensor) -> None:
    """`output` (rows × tokens × out) plus `(shrunk * mask) @ b.T`, in place: `shrunk` is (rows × tokens × R) with R
    some number of rank blocks of `mask`'s width, `mask` (rows × 1 × width) each row's 0/1 rank mask, `b` (out × R)."""
    rows, width = mask.shape[0], mask.shape[-1]
    flat_out, flat_shrunk = output.view(-1, output.shape[-1]), shrunk.reshape(-1, shrunk.shape[-1])
    m, n, r = flat_out.shape[0], flat_out.shape[1], flat_shrunk.shape[1]
    if flat_shrunk.shape[0] != m or m % rows or r % width or b.shape != (n, r):
        raise ValueError(f"shapes do not fit: output {tuple(output.shape)}, shrunk {tuple(shrunk.shape)}, mask "
                         f"{tuple(mask.shape)}, b {tuple(b.shape)}")
    mask2d = mask.reshape(rows, width)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_r = max(16, triton.next_power_of_2(r))
    block_n = 64 if block_r <= 64 else 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _masked_expand_kernel[grid](flat_shrunk, mask2d, b, flat_out, m, n, r, width, m // rows, flat_shrunk.stride(0),
                                mask2d.stride(0), b.stride(0), flat_out.stride(0), BLOCK_M=block_m,
                                BLOCK_N=block_n, BLOCK_R=block_r)


@functools.cache
def runs_on(device: torch.device) -> bool:
    """Whether the kernel builds and runs on `device` (worker/decoder/triton_kernels.py), tried once."""
    def trial(device: torch.device) -> None:
        zeros = torch.zeros(1, 1, 16, device=device, dtype=torch.float16)
        masked_expand(zeros, zeros.clone(), zeros.clone(), torch.zeros(16, 16, device=device, dtype=torch.float16))

    return runs(trial, device, "LoRA expand kernel", "each LoRA product's mask and expand run as two operations")


def takes(output: torch.Tensor, shrunk: torch.Tensor, mask: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the kernel computes this product: one CUDA device and dtype, contiguous rows, a mask row per row."""
    return (triton_available() and output.is_cuda and output.dtype == shrunk.dtype == mask.dtype == b.dtype
            and output.is_contiguous() and shrunk.stride(-1) == 1 and b.stride(-1) == 1 and mask.is_contiguous()
            and output.dim() == shrunk.dim() == mask.dim() == 3 and mask.shape[0] == output.shape[0]
            and mask.shape[1] == 1 and len({output.device, shrunk.device, mask.device, b.device}) == 1)
