"""Rotary position embedding of a layer's queries and keys as one kernel.

transformers applies it as `q * cos + rotate_half(q) * sin` and the same for `k`: ten kernels a layer (a negation,
a concatenation, two products and a sum for each), 360 of a 3B model's decode step, each a few microseconds of
launch for almost no work. Here one Triton program per token rotates every query and key head of it at once, in
float32, rounded once to the model's dtype (transformers rounds after each operation, so greedy answers agree
rather than match bit for bit, as with worker/decoder/kernels/fused_norms.py).

transformers calls the function by its module-level name (`apply_rotary_pos_emb` in `modeling_llama`,
`modeling_qwen2`, ...), so `FusedRotary` puts its own there while a decoder is installed and puts the original
back on `remove()`. Calls it cannot take (the CPU, another dtype or layout) go to the original. Served on CUDA
(the slot decoder's default there); the benchmark's `unfused_rotary` pair is the other side.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch

from worker.decoder.kernels.triton_kernels import runs, triton_available

NAME = "apply_rotary_pos_emb"
# transformers' modeling modules whose function is `q * cos + rotate_half(q) * sin` over the whole head (others
# rotate interleaved pairs or part of a head under the same name)
MODULES = frozenset(f"transformers.models.{name}.modeling_{name}" for name in ("llama", "qwen2", "mistral"))

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _rotate(x_ptr, out_ptr, cos, sin_neg, cos2, sin2, b, s, S, H, stride_b, stride_h, stride_s,
                BLOCK_H: tl.constexpr, HALF: tl.constexpr):
        # one token's heads: out[:half] = x1 * cos1 - x2 * sin1, out[half:] = x2 * cos2 + x1 * sin2
        heads = tl.arange(0, BLOCK_H)[:, None]
        column = tl.arange(0, HALF)[None, :]
        live = heads < H
        source = x_ptr + b * stride_b + heads * stride_h + s * stride_s + column
        x1 = tl.load(source, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(source + HALF, mask=live, other=0.0).to(tl.float32)
        target = out_ptr + ((b * H + heads) * S + s) * (2 * HALF) + column  # contiguous (batch, heads, seq, dim)
        dtype = out_ptr.dtype.element_ty
        tl.store(target, (x1 * cos + x2 * sin_neg).to(dtype), mask=live)
        tl.store(target + HALF, (x2 * cos2 + x1 * sin2).to(dtype), mask=live)

    @triton.jit
    def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, S, HQ, HK,
                       q_stride_b, q_stride_h, q_stride_s, k_stride_b, k_stride_h, k_stride_s,
                       cos_stride_b, cos_stride_s, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                       HALF: tl.constexpr):
        token = tl.program_id(0)
        b, s = token // S, token % S
        column = tl.arange(0, HALF)[None, :]
        angles = b * cos_stride_b + s * cos_stride_s + column
        cos = tl.load(cos_ptr + angles).to(tl.float32)
        sin = tl.load(sin_ptr + angles).to(tl.float32)
        cos2 = tl.load(cos_ptr + angles + HALF).to(tl.float32)
        sin2 = tl.load(sin_ptr + angles + HALF).to(tl.float32)
        _rotate(q_ptr, q_out_ptr, cos, -sin, cos2, sin2, b, s, S, HQ, q_stride_b, q_stride_h, q_stride_s,
                BLOCK_HQ, HALF)
        _rotate(k_ptr, k_out_ptr, cos, -sin, cos2, sin2, b, s, S, HK, k_stride_b, k_stride_h, k_stride_s,
                BLOCK_HK, HALF)


def takes(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int) -> bool:
    """Whether the kernel computes this call: (batch, heads, seq, dim) queries and keys with unit stride in dim,
    (batch, seq, dim) angles, a power-of-two half dimension, one device and dtype."""
    if unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    batch, _, seq, dim = q.shape
    half = dim // 2
    return (k.shape[0] == batch and k.shape[2] == seq and k.shape[3] == dim and dim % 2 == 0
            and half & (half - 1) == 0 and cos.shape[0] in (1, batch) and cos.shape[1:] == (seq, dim)
            and q.stride(3) == k.stride(3) == 1 and cos.stride(2) == sin.stride(2) == 1
            and cos.stride() == sin.stride() and q.dtype == k.dtype
            and len({q.device, k.device, cos.device, sin.device}) == 1)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `apply_rotary_pos_emb(q, k, cos, sin)` as one kernel (`takes` says when it applies)."""
    batch, heads, seq, dim = q.shape
    q_out, k_out = (torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k))
    _rotary_kernel[(batch * seq,)](
        q, k, cos, sin, q_out, k_out, seq, heads, k.shape[1], q.stride(0), q.stride(1), q.stride(2), k.stride(0),
        k.stride(1), k.stride(2), cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1),
        BLOCK_HQ=triton.next_power_of_2(heads), BLOCK_HK=triton.next_power_of_2(k.shape[1]), HALF=dim // 2)
    return q_out, k_out


@functools.cache
def runs_on(device: torch.device) -> bool:
    """Whether the kernel builds and runs on `device` (worker/decoder/kernels/triton_kernels.py), tried once."""
    def trial(device: torch.device) -> None:
        x = torch.zeros(1, 2, 1, 32, device=device, dtype=torch.float16)  # one token, two heads of 32
        rotary(x, x, x[:, 0], x[:, 0])

    return runs(trial, device, "rotary kernel", "the rotary embedding runs as transformers' operations")


def _fused(original: Callable) -> Callable:
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # noqa: ANN001, ANN202 (transformers' signature)
        if q.is_cuda and takes(q, k, cos, sin, unsqueeze_dim):
            return rotary(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.original = original
    apply_rotary_pos_emb.holders = 0  # decoders that installed it
    return apply_rotary_pos_emb


class FusedRotary:
    """Installed on a model by the decoder; `remove()` puts each modeling module's own function back once no
    decoder holds it. The function is the module's, so models of one architecture in this process share it."""

    def __init__(self, model: torch.nn.Module):
        self._modules = []
        if not triton_available():
            return
        names = {type(m).__module__ for m in model.modules() if type(m).__name__.endswith("Attention")}
        for name in sorted(names & MODULES):
            module = sys.modules.get(name)
            current = getattr(module, NAME, None)
            if current is None:
                continue
            if not hasattr(current, "original"):
                current = _fused(current)
                setattr(module, NAME, current)
            current.holders += 1
            self._modules.append(module)

    @property
    def installed(self) -> bool:
        return bool(self._modules)

    def remove(self) -> None:
        for module in self._modules:
            fused = getattr(module, NAME)
            fused.holders -= 1
            if fused.holders == 0:
                setattr(module, NAME, fused.original)
        self._modules.clear()
