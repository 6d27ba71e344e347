"""How a slot decoder computes, in one object: the worker builds it from its settings
(worker/engine/build.py: `decoder_options`), the benchmark's A/B pairs change one field of it
(`dataclasses.replace(options, fused_norms=False)`, modellab/bench/run.py), tests name what they compare.

Plain data: no torch at import (a dtype is only named in the type hints)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DecoderOptions:
    """The served decoder's variants. `None` on a kernel: served where it was measured to pay (on CUDA, and only
    where its kernel builds and runs; worker/decoder/kernels/triton_kernels.py), else not."""

    # steps and prefill passes captured as CUDA graphs and replayed (KEVLAYA_ENGINE__CUDA_GRAPHS, on CUDA)
    graphs: bool = False
    # the captured path's fixed shapes, run eagerly (what the CPU tests check of it); implied by `graphs`
    static_steps: bool = False
    # KEVLAYA_ENGINE__KV_DTYPE: the key/value block's storage dtype (None: the compute dtype)
    kv_dtype: torch.dtype | None = None
    # KEVLAYA_ENGINE__PREFILL_CHUNK_TOKENS: the padded tokens one forward pass of a prefill takes at most
    prefill_chunk_tokens: int | None = None
    # benchmarks (KEVLAYA_ENGINE__IGNORE_EOS): end-of-sequence tokens never chosen, so every row writes its
    # max_new_tokens
    ignore_eos: bool = False
    # False: results carry token ids and log-probabilities only, and the caller makes their text on its own thread
    # (the worker's result writer: a text costs milliseconds a row, which every row in flight would wait for)
    texts: bool = True
    # -- the benchmark's A/B pairs (modellab/bench/pairs.py): each the served way, or the way it replaced --
    fused_projections: bool = True  # q/k/v and gate/up each as one matmul and one LoRA product
    fused_norms: bool | None = None  # RMSNorm as PyTorch's one operator (None: on CUDA)
    fused_rotary: bool | None = None  # the rotary embedding as one Triton kernel (None: on CUDA)
    fused_lora: bool | None = None  # a LoRA product's row mask and expand as one Triton kernel (None: on CUDA)
    nf4_kernel: bool | None = None  # NF4 matmuls of 2 to 64 rows as one Triton kernel (None: on CUDA)
    static_prefill: bool = True  # with static steps, fixed-shape prefill passes (captured with them)
    launch_ahead: bool = True  # each step launched before the host reads the one before
    column_buckets: int | None = None  # static steps also read the window's first half, quarter...; None: 3 on CUDA
    lora_dtype: torch.dtype | None = None  # the LoRA products' dtype (None: the compute dtype)
    # each adapter's rank block at least this wide, so a version up to that rank is copied in place at run time
    # (KEVLAYA_MODEL__ADAPTER_MAX_RANK; 0: each adapter's own rank)
    lora_min_rank: int = 0
    # rank blocks kept for roles loaded at run time under new names (KEVLAYA_MODEL__SPARE_ROLES)
    spare_adapters: int = 0
