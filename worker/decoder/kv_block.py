"""The key/value block of the slot decoder: one preallocated block of `slots × window` tokens per layer.

Rows live in slots 0..n-1 (kept contiguous, so a step runs on a prefix of the block) and share one timeline of
columns: every row's last cached token is at column `t - 1`, so one decode step writes every row's new token at
column `t`. A row admitted later is prefilled right-aligned to end at `t - 1`; the columns before its `start` are
masked out. A prompt block whose passes run between decode steps is written aside, in the top slots, and
placed on the timeline when its last pass has run. When `t` reaches the window's end the block is shifted left
by the oldest row's start (docs/architecture.md §14). Nothing is allocated after construction, so memory use is
known before the first job.

The block may store keys and values in fp8 (`KEVLAYA_ENGINE__KV_DTYPE=fp8`, one byte an element) while the model
computes in its own dtype: a write casts down, a read casts the rows' read range back up, one layer at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

# KEVLAYA_ENGINE__KV_DTYPE: the block's storage dtype (None: the compute dtype).
STORAGE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": torch.float8_e4m3fn}


@dataclass
class View:
    """What the next forward pass reads and writes: rows `rows`, writes columns [write_lo, write_hi), reads
    columns [read_lo, write_hi). A static pass (`column` set) writes the columns that tensor holds and reads the
    whole window, or a static step the first `columns`: no shape or Python number changes between passes of one
    shape, so the pass can be a CUDA graph. A static step's rows are `rows`; a static prefill pass's are the slots
    `slots` holds (they start anywhere)."""

    rows: slice = field(default_factory=lambda: slice(0, 0))
    read_lo: int = 0
    write_lo: int = 0
    write_hi: int = 0
    column: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    columns: int | None = None  # a static step reads columns [0, columns) (None: the whole window)


class SlotLayer(CacheLayerMixin):
    """One layer's block, seen through the shared `View`."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, view: View):
        super().__init__()
        self.keys, self.values, self.view = keys, values, view
        self.device, self.is_initialized = keys.device, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # allocated up front

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        v = self.view
        if v.slots is not None:
            write_slots(self.keys, v.slots, v.column, key_states)
            write_slots(self.values, v.slots, v.column, value_states)
            keys, values = self.keys.index_select(0, v.slots), self.values.index_select(0, v.slots)
        elif v.column is not None:
            keys, values = self.keys[v.rows, :, :v.columns], self.values[v.rows, :, :v.columns]
            write_column(keys, v.column, key_states)
            write_column(values, v.column, value_states)
        else:
            self.keys[v.rows, :, v.write_lo:v.write_hi] = stored(key_states, self.keys.dtype)
            self.values[v.rows, :, v.write_lo:v.write_hi] = stored(value_states, self.values.dtype)
            keys, values = self.keys[v.rows, :, v.read_lo:v.write_hi], self.values[v.rows, :, v.read_lo:v.write_hi]
        # the compute dtype: no copy when the block stores in it
        return keys.to(key_states.dtype), values.to(value_states.dtype)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.view.column is not None:
            return self.view.columns or self.keys.shape[2], 0
        return self.view.write_hi - self.view.read_lo, self.view.read_lo

    def get_seq_length(self) -> int:
        return self.view.write_hi

    def get_max_length(self) -> int:
        return self.keys.shape[2]


def stored(states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`states` in the block's storage dtype, saturated at its largest finite value: older torch versions cast
    anything beyond fp8's range to NaN, which would break the row."""
    if states.dtype == dtype:
        return states
    largest = torch.finfo(dtype).max
    return states.clamp(-largest, largest).to(dtype)


def write_column(block: torch.Tensor, column: torch.Tensor, states: torch.Tensor) -> None:
    """Write `states` into `block` at the column index `column` holds (the captured step's write)."""
    if block.dtype == states.dtype:
        block.index_copy_(2, column, states)
    else:  # index_copy_ has no float8 kernel on the CPU: copy the bytes
        block.view(torch.uint8).index_copy_(2, column, stored(states, block.dtype).view(torch.uint8))


def write_slots(block: torch.Tensor, slots: torch.Tensor, columns: torch.Tensor, states: torch.Tensor) -> None:
    """Write `states` (slots × heads × columns × dim) into `block` at those slots and columns (a captured prefill
    pass's write)."""
    target, values = block.transpose(1, 2), stored(states, block.dtype).transpose(1, 2)
    if block.dtype != states.dtype:  # no float8 indexing kernels on the CPU: move the bytes
        target, values = target.view(torch.uint8), values.view(torch.uint8)
    target.index_put_((slots[:, None], columns[None, :]), values)


def kv_shape(config: object) -> tuple[int, int, int]:
    """(layers, key/value heads, head dimension) of a decoder config; refuses what one block cannot hold."""
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"layers of kinds {sorted(kinds)}: the slot cache holds full-attention layers only")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


class KVBlock:
    """`dtype`: what the block stores (the compute dtype, or fp8); reads come back in the compute dtype."""

    def __init__(self, config: object, slots: int, window: int, dtype: torch.dtype, device: torch.device):
        layers, kv_heads, head_dim = kv_shape(config)
        self.slots, self.window = slots, window
        self.view = View()
        shape = (slots, kv_heads, window, head_dim)
        self.layers = [SlotLayer(torch.zeros(shape, dtype=dtype, device=device),
                                 torch.zeros(shape, dtype=dtype, device=device), self.view) for _ in range(layers)]
        self.cache = Cache(layers=self.layers)  # what the model's forward pass receives
        self.t = 0  # the column the next decode step writes

    def shift(self, slots: slice, lo: int, hi: int, by: int) -> None:
        """Move columns [lo, hi) of the rows in `slots` by `by` columns (either way)."""
        if by == 0 or slots.stop <= slots.start or hi <= lo:
            return
        for layer in self.layers:
            for block in (layer.keys, layer.values):
                block[slots, :, lo + by:hi + by] = block[slots, :, lo:hi].clone()

    def place(self, sources: slice, targets: slice, lo: int, hi: int, by: int) -> None:
        """Copy columns [lo, hi) of the slots `sources` to columns [lo + by, hi + by) of the slots `targets`: a
        prompt block prefilled aside joins the rows in flight (docs/architecture.md §14)."""
        if sources == targets and by == 0:
            return
        apart = targets.stop <= sources.start or sources.stop <= targets.start  # no copy of the columns needed
        for layer in self.layers:
            for block in (layer.keys, layer.values):
                columns = block[sources, :, lo:hi]
                block[targets, :, lo + by:hi + by] = columns if apart else columns.clone()

    def move_row(self, source: int, target: int, lo: int, hi: int) -> None:
        """Copy a row's cached columns [lo, hi) into another slot (to keep rows contiguous)."""
        for layer in self.layers:
            layer.keys[target, :, lo:hi] = layer.keys[source, :, lo:hi]
            layer.values[target, :, lo:hi] = layer.values[source, :, lo:hi]
