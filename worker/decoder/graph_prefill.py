"""The prefill with fixed shapes, so it can be captured as CUDA graphs and replayed (docs/architecture.md §14).

A prompt block (rows × columns, left-padded) goes through in passes of `columns` columns each (PREFILL_COLUMNS,
at most the chunk budget), for a bucket of rows (1, 2, 4, ...). A pass writes its rows' keys and values at the
slots and columns that buffers name, and reads the whole window, so neither the rows' slots nor the block's place
on the timeline is part of its shape, and decode steps may run between two passes. On CUDA each bucket is
captured once and replayed: an eager prefill pass launches thousands of kernels, one at a time from Python.
Elsewhere the same passes run eagerly (the CPU tests).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator

import torch

from worker.decoder.graph_step import captured
from worker.decoder.kernels.row_lora import NO_ADAPTER
from worker.decoder.state import ModelState, PromptBlock

log = logging.getLogger("kevlaya.decoder")

# Prompt columns a pass takes: prompts are padded to a multiple of it, so it trades padding against passes.
PREFILL_COLUMNS = 128


class CapturedPrefill:
    """One decoder's fixed-shape prefill passes over the model state it is given, one graph per bucket of rows
    when `capture` (CUDA), else run eagerly; `chunk_tokens`: the padded tokens one pass takes at most
    (KEVLAYA_ENGINE__PREFILL_CHUNK_TOKENS; None: a pass of every slot's row); `pool`: the memory pool of the
    decoder's captured steps, which these graphs share."""

    def __init__(self, state: ModelState, capture: bool, chunk_tokens: int | None = None, pool: tuple | None = None):
        self.state = state
        slots, window, device = state.kv.slots, state.kv.window, state.device
        budget = chunk_tokens or slots * PREFILL_COLUMNS
        self.columns = min(PREFILL_COLUMNS, window, budget)
        most = max(1, min(slots, budget // self.columns))  # rows × columns within the chunk budget
        self.buckets = [2**i for i in range(most.bit_length()) if 2**i <= most]
        top = self.buckets[-1]
        self.ids = torch.zeros(top, self.columns, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, self.columns, dtype=torch.long, device=device)
        self.mask = torch.zeros(top, 1, self.columns, window, dtype=torch.bool, device=device)
        self.slots = torch.zeros(top, dtype=torch.long, device=device)
        self.written = torch.zeros(self.columns, dtype=torch.long, device=device)  # the columns a pass writes
        self.adapters = state.lora.new_buffer(top)
        self.own = torch.eye(self.columns, dtype=torch.bool, device=device)  # a padding row attends to itself
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = pool
        if capture:
            self._capture()

    def width(self, width: int) -> int | None:
        """The padded width a prompt block of `width` columns takes here (a multiple of the pass's columns), or
        None when that is over the window (the block then runs eagerly)."""
        padded = -(-width // self.columns) * self.columns
        return padded if padded <= self.state.kv.window else None

    def _forward(self, bucket: int) -> torch.Tensor:
        view = self.state.kv.view
        view.slots, view.column = self.slots[:bucket], self.written
        self.state.lora.mask = self.adapters[:bucket]
        try:
            return self.state.logits(self.ids[:bucket], self.mask[:bucket], self.positions[:bucket])
        finally:
            view.slots = view.column = None

    def _capture(self) -> None:
        """One graph per bucket, captured on an empty decoder (its writes land in free slots)."""
        if self.state.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.mask[:, 0, :, :self.columns] = self.own
        self.written.copy_(torch.arange(self.columns))
        reserved = torch.cuda.memory_reserved()
        for bucket in self.buckets:
            self.graphs[bucket], self.pool = captured(functools.partial(self._forward, bucket), self.pool)
        # what its graphs hold for good, beside the decode step's in the shared pool (the worker's workspace)
        log.info("captured the prefill for %s rows of %d columns (memory reserved: %+.0f MiB)",
                 ", ".join(map(str, self.buckets)), self.columns, (torch.cuda.memory_reserved() - reserved) / 2**20)

    def piece(self, rows: int, spare: int) -> tuple[int, int]:
        """(rows, bucket) of the next pass for `rows` prompts left: the smallest bucket that holds them, its padding
        rows in the `spare` free slots; where too few are free, the largest bucket that needs none."""
        bucket = next((b for b in self.buckets if b >= rows), self.buckets[-1])
        if bucket - min(bucket, rows) > spare:
            bucket = max(b for b in self.buckets if b <= rows)
        return min(bucket, rows), bucket

    def passes(self, block: PromptBlock, spare: Callable[[], list[int]]) -> Iterator[None]:
        """Prefill `block` (its width a multiple of the pass's columns), one pass per item, and set its logits
        after the last. Column ranges go in order; within one, rows go in buckets whose padding rows write into
        the free slots `spare` names at that time (passes of other work may run between two items)."""
        rows, width = block.ids.shape
        for a in range(0, width, self.columns):
            b = a + self.columns
            logits, done = [], 0
            while done < rows:
                # looked up at each pass: a whole prefill between two may have taken free slots
                free = spare()
                count, bucket = self.piece(rows - done, len(free))
                part = slice(done, done + count)
                slots = list(range(block.slots.start, block.slots.stop))[part] + free[:bucket - count]
                self.slots[:bucket].copy_(torch.tensor(slots))
                self.state.lora.select_in_place(block.adapters[part] + [NO_ADAPTER] * (bucket - count),
                                                self.adapters[:bucket])
                lo = block.lo  # read at each pass: the block moves when the key/value block shifts
                self.ids[:bucket].zero_()
                self.ids[:count].copy_(block.ids[part, a:b])
                self.positions[:bucket].zero_()
                self.positions[:count].copy_(block.positions[part, a:b])
                self.mask[:bucket].zero_()
                self.mask[:count, 0, :, lo:lo + b].copy_(block.allowed[part, a:b, :b])
                self.mask[count:bucket, 0, :, lo + a:lo + b] = self.own
                self.written.copy_(torch.arange(lo + a, lo + b))
                if bucket in self.graphs:
                    graph, output = self.graphs[bucket]
                    graph.replay()
                else:
                    output = self._forward(bucket)
                done += count
                if b == width:
                    logits.append(output[:count].clone())  # the next bucket's replay may reuse its memory
                    if done == rows:
                        block.logits = torch.cat(logits)
                yield
