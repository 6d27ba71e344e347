"""The VRAM budget, in one place (docs/architecture.md §5): the process cap, how many slots the budget holds (by
arithmetic, then measured), and what an out-of-memory gives back. torch is imported only where CUDA is used: the
Celery parent imports this module too."""

from __future__ import annotations

import gc
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.decoder.slot_decoder import SlotDecoder

log = logging.getLogger("kevlaya.worker")
GIB = 2**30


def cap_process_memory(budget_gb: float) -> None:
    """On a GPU with more memory than the budget, cap this process to it, so a 6 GB card is emulated on a bigger
    one and over-budget work fails in testing as it would on the real card. And keep the attention's memory
    inside what the allocator holds: cuDNN's attention builds and loads a new plan for each new prompt shape,
    with memory taken from the card outside the allocator, which fails once another process filled the card;
    the flash and memory-efficient kernels are loaded once and use the allocator's memory."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    if budget_gb * GIB < total:
        torch.cuda.set_per_process_memory_fraction(budget_gb * GIB / total, 0)
    torch.backends.cuda.enable_cudnn_sdp(False)


# Less than this free on the card for anyone: the card is full.
CARD_FULL_BYTES = 256 * 2**20
# How long a job that ran out of memory on a card another process filled waits before it is claimed again.
CARD_FULL_PAUSE_S = 1.0
_GPU_LIBRARY = re.compile(r"cudnn|cublas|mha_graph|CUDA error", re.IGNORECASE)


def device_free_bytes() -> int | None:
    """What the card has free for any process; None off CUDA."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.mem_get_info()[0]


def reserved_bytes() -> int:
    """What this process's allocator holds on the card."""
    import torch

    return torch.cuda.memory_reserved() if torch.cuda.is_available() else 0


def card_full() -> bool:
    free = device_free_bytes()
    return free is not None and free < CARD_FULL_BYTES


def memory_taken_elsewhere(budget_bytes: int) -> bool:
    """The card is full while this process holds well under its budget: another process took the memory, so a
    job that ran out of it could run here later."""
    return card_full() and reserved_bytes() + CARD_FULL_BYTES < budget_bytes


def is_out_of_memory(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, torch.cuda.OutOfMemoryError) or (isinstance(exc, RuntimeError) and "out of memory" in str(exc)):
        return True
    # cuDNN and cuBLAS report a failed allocation of their own as a failed call (cuDNN's attention: "Expected
    # mha_graph.execute(...) to be true"); on a full card that is memory too.
    return isinstance(exc, RuntimeError) and bool(_GPU_LIBRARY.search(str(exc))) and card_full()


def after_step_out_of_memory(rows: int) -> tuple[int, int]:
    """A step of `rows` ran out of memory: (how many of the newest rows go back to the queue, the rows admitted
    from now on). Half go back, and one row fewer than were in flight is admitted from then on."""
    return max(1, rows // 2), max(1, rows - 1)


def alone_out_of_memory(max_new_tokens: int) -> str:
    """Why a job that ran out of memory with no other row beside it fails (it would never fit)."""
    return (f"out of memory even when run alone (max_new_tokens {max_new_tokens}, within the "
            "KEVLAYA_ENGINE__VRAM_BUDGET_GB budget); shorten the input or lower max_new_tokens")


def after_prefill_out_of_memory(rows: int) -> int:
    """A prefill beside `rows` in flight ran out of memory: its rows go back, and no more than `rows` are admitted
    from now on (at least one)."""
    return max(1, rows)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Keys and values of one token in every layer, as the block stores them (`dtype_bytes`: 2 for fp16, 1 for
    fp8). An fp8 block is read back in the compute dtype one layer at a time: those temporaries are workspace."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class SlotBudget:
    budget_bytes: int  # what this process may use (KEVLAYA_ENGINE__VRAM_BUDGET_GB)
    resident_bytes: int  # the weights and adapters, measured after loading
    workspace_bytes: int  # activations of one step (an fp8 cache's read, cast up), kept free beside the cache
    kv_per_token: int
    window: int  # tokens one slot holds

    @property
    def per_slot(self) -> int:
        return self.kv_per_token * self.window

    def slots(self, most: int) -> int:
        """Slots that fit (at most `most`); 0 when not even one does."""
        spare = self.budget_bytes - self.resident_bytes - self.workspace_bytes
        return max(0, min(most, spare // self.per_slot))

    def costs_a_slot(self, extra_bytes: int, most: int) -> bool:
        """Whether `extra_bytes` more resident memory (e.g. NF4 scales kept decoded) would leave fewer slots."""
        return replace(self, resident_bytes=self.resident_bytes + extra_bytes).slots(most) < self.slots(most)

    def after_measuring(self, slots: int, peak_bytes: int | None) -> int:
        """The slots to build after `slots` measured a peak of `peak_bytes` (None: they ran out of memory): the
        same when the peak fits the budget, else fewer — what the measured workspace leaves room for, and at
        least one fewer, so sizing ends."""
        if peak_bytes is None:
            return slots - 1
        if peak_bytes <= self.budget_bytes:
            return slots
        measured = replace(self, workspace_bytes=peak_bytes - self.resident_bytes - slots * self.per_slot)
        return min(slots - 1, measured.slots(slots))

    def explain(self, most: int) -> str:
        gib = GIB
        return (f"{self.slots(most)} slot(s) of {self.window} tokens ({self.per_slot / gib:.3f} GiB each): budget "
                f"{self.budget_bytes / gib:.2f} GiB − resident {self.resident_bytes / gib:.2f} GiB − workspace "
                f"{self.workspace_bytes / gib:.2f} GiB")


def fit_slots(build: Callable[[int], SlotDecoder], budget: SlotBudget, wanted: int,
              prefill_tokens: int) -> SlotDecoder:
    """The decoder with the most slots (at most `wanted`) whose measured peak fits the budget: sized first from the
    arithmetic, then built (graphs captured), the largest prefill the engine runs (`prefill_tokens` padded, whole
    windows) run into it, and rebuilt with fewer slots while the peak the allocator reserved is over the budget."""
    import torch

    slots = budget.slots(wanted)
    log.info("slot decoder: %s", budget.explain(wanted))
    while slots > 0:
        built, peak = _measured(build, slots, prefill_tokens)
        fewer = budget.after_measuring(slots, peak)
        if fewer == slots:
            log.info("slot decoder: %d slot(s); measured peak %.2f GiB of the %.2f GiB budget (workspace %.2f GiB)",
                     slots, peak / GIB, budget.budget_bytes / GIB,
                     (peak - budget.resident_bytes - slots * budget.per_slot) / GIB)
            return built
        log.warning("slot decoder: %d slot(s) %s the %.2f GiB budget; trying %d", slots,
                    "ran out of memory within" if peak is None else f"peaked at {peak / GIB:.2f} GiB over",
                    budget.budget_bytes / GIB, fewer)
        if built is not None:
            built.close()
        del built
        gc.collect()  # the decoder and its graphs hold each other: free their memory before the next build
        torch.cuda.empty_cache()
        slots = fewer
    raise RuntimeError(f"the VRAM budget holds no slot: {budget.explain(wanted)}; lower "
                       "KEVLAYA_ENGINE__WINDOW_TOKENS or KEVLAYA_ENGINE__PREFILL_TOKENS, or raise "
                       "KEVLAYA_ENGINE__VRAM_BUDGET_GB")


def _measured(build: Callable[[int], SlotDecoder], slots: int,
              prefill_tokens: int) -> tuple[SlotDecoder | None, int | None]:
    """A decoder of `slots` and the peak memory it reserved with the largest prefill done; (None, None) when that
    ran out of memory."""
    import torch

    torch.cuda.reset_peak_memory_stats()
    built = None
    try:
        built = build(slots)
        built.throwaway_prefill(rows=-(-max(prefill_tokens, built.window) // built.window), width=built.window)
        torch.cuda.synchronize()
        return built, torch.cuda.max_memory_reserved()
    except Exception as exc:
        if built is not None:
            built.close()  # the model gets its PEFT path back whatever happened
        if not is_out_of_memory(exc):
            raise
        return None, None
