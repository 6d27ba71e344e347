"""How many rows the continuous engine may hold, from memory arithmetic instead of out-of-memory discovery
(docs/architecture.md §14). Pure: plain numbers in, plain numbers out."""

from __future__ import annotations

from dataclasses import dataclass, replace


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Keys and values of one token in every layer."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class SlotBudget:
    budget_bytes: int  # what this process may use (KEVLAYA_VRAM_BUDGET_GB)
    resident_bytes: int  # the weights and adapters, measured after loading
    workspace_bytes: int  # activations of one step, kept free beside the cache
    kv_per_token: int
    window: int  # tokens one slot holds

    @property
    def per_slot(self) -> int:
        return self.kv_per_token * self.window

    def slots(self, most: int) -> int:
        """Slots that fit (at most `most`); 0 when not even one does."""
        spare = self.budget_bytes - self.resident_bytes - self.workspace_bytes
        return max(0, min(most, spare // self.per_slot))

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
        gib = 2**30
        return (f"{self.slots(most)} slot(s) of {self.window} tokens ({self.per_slot / gib:.3f} GiB each): budget "
                f"{self.budget_bytes / gib:.2f} GiB − resident {self.resident_bytes / gib:.2f} GiB − workspace "
                f"{self.workspace_bytes / gib:.2f} GiB")
