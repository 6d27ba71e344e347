"""The decode step with fixed shapes, so it can be captured as CUDA graphs and replayed (docs/architecture.md §14).

Inputs live in preallocated buffers, the whole window is read, and rows are padded to a bucket (1, 2, 4, ...
slots) with idle rows that attend only to their own new column. On CUDA each bucket is captured once and
replayed, so a step costs one launch instead of thousands; elsewhere the same step runs eagerly (the CPU tests
use it)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from worker.decoder.kernels.row_lora import NO_ADAPTER
from worker.decoder.state import ModelState

if TYPE_CHECKING:
    from worker.decoder.sampling import Chosen

log = logging.getLogger("kevlaya.decoder")

_capture_stream: torch.cuda.Stream | None = None
MIN_COLUMNS = 64  # the fewest columns a step reads: fewer would save little and cost a graph more per row bucket


def capture_stream() -> torch.cuda.Stream:
    """One stream for every warm-up and capture in this process: cuBLAS keeps a workspace (32 MiB on Hopper) per
    stream it has run on, for good, so a new stream per bucket or per rebuilt decoder would pile them up."""
    global _capture_stream
    if _capture_stream is None:
        _capture_stream = torch.cuda.Stream()
    return _capture_stream


def captured(forward: Callable[[], torch.Tensor], pool: tuple | None) -> tuple[tuple[torch.cuda.CUDAGraph,
                                                                                   torch.Tensor], tuple]:
    """`forward` warmed up and captured as a graph in `pool` (None: a new one); returns (graph, its output) and
    the pool. Graphs that share a pool run one at a time: each one's output is read before the next replays."""
    side = capture_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=side):
        output = forward()
    return (graph, output), graph.pool()


class CapturedStep:
    """One decoder's fixed-shape step over the model state it is given (sdpa attention), one graph per bucket when
    `capture` (CUDA), else run eagerly.

    A bucket is a number of rows and a number of columns read: the whole window, or with `column_buckets` = k
    also its half, quarter, ... (k sizes in all, none under MIN_COLUMNS). A step reads the smallest that holds
    its column `t`: columns before it are the rows' own or masked, so a step over short rows reads less of the
    block. The decoder keeps `t` low by compacting when it reaches a size (SlotDecoder._launch): it reads `widths`."""

    def __init__(self, state: ModelState, capture: bool, column_buckets: int = 1):
        self.state = state
        slots, window, device = state.kv.slots, state.kv.window, state.device
        self.buckets = sorted({min(2**i, slots) for i in range(slots.bit_length() + 1)})
        self.widths = sorted({window >> i for i in range(column_buckets) if window >> i >= min(MIN_COLUMNS, window)})
        # per slot: input token, index of its token in the chosen ones (-1: none), position, first column, adapter
        self.inputs = torch.zeros(slots, 5, dtype=torch.long, device=device)
        cuda = device.type == "cuda"
        self.staged = [torch.zeros(slots, 5, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self.copied = [torch.cuda.Event(), torch.cuda.Event()] if cuda else None
        self.turn = 0
        self.ids = torch.zeros(slots, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(slots, 1, dtype=torch.long, device=device)
        self.mask = torch.zeros(slots, 1, 1, window, dtype=torch.bool, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.columns = torch.arange(window, device=device)
        self.adapters = state.lora.new_buffer(slots)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (rows, columns)
        self.logits: torch.Tensor | None = None  # where a replayed step's logits are kept until read
        self.pool = None  # the graphs' memory pool, which the captured prefill shares
        if capture:
            self._capture()

    def _forward(self, bucket: int, width: int) -> torch.Tensor:
        view = self.state.kv.view
        view.rows, view.column, view.columns = slice(0, bucket), self.column, width
        self.state.lora.mask = self.adapters[:bucket]
        try:
            return self.state.logits(self.ids[:bucket], self.mask[:bucket, ..., :width], self.positions[:bucket])
        finally:
            view.column = view.columns = None

    def _capture(self) -> None:
        """One graph per bucket, sharing one memory pool; captured on idle rows (nothing is in flight yet)."""
        if self.state.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.mask[:, 0, 0, 0] = True
        reserved = torch.cuda.memory_reserved()
        for bucket in self.buckets:
            for width in self.widths:
                self.graphs[bucket, width], self.pool = captured(functools.partial(self._forward, bucket, width),
                                                                 self.pool)
        output = self.graphs[self.buckets[-1], self.widths[-1]][1]
        self.logits = torch.empty(self.buckets[-1], *output.shape[1:], dtype=output.dtype, device=output.device)
        log.info("captured the decode step for %s rows, reading %s columns (memory reserved: %+.0f MiB)",
                 ", ".join(map(str, self.buckets)), ", ".join(map(str, self.widths)),
                 (torch.cuda.memory_reserved() - reserved) / 2**20)

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def width(self, t: int) -> int:
        """The columns a step that writes column `t` reads."""
        return next(w for w in self.widths if w > t)

    def run(self, tokens: list[int], sources: list[int], positions: list[int], starts: list[int],
            adapters: list[int], chosen: Chosen | None) -> torch.Tensor:
        """The logits of one step over slots 0..n-1, from the smallest bucket that holds them. A slot's input
        token is `tokens[i]`, or where `sources[i]` ≥ 0 the token `chosen` holds on the device at that index;
        then its position, first column and adapter. The host's inputs go in one copy from pinned memory, which
        does not wait for the GPU: the step is queued behind the one in flight."""
        t, n = self.state.kv.t, len(tokens)
        bucket, width = self.bucket(n), self.width(t)
        padding = bucket - n
        staged = self._staging()
        staged[:bucket] = torch.tensor([tokens + [0] * padding, sources + [-1] * padding, positions + [0] * padding,
                                        starts + [t] * padding, adapters + [NO_ADAPTER] * padding]).T
        inputs = self.inputs[:bucket]
        inputs.copy_(staged[:bucket], non_blocking=True)
        if self.copied is not None:
            self.copied[self.turn].record()
        token, source, position, start, adapter = inputs.T
        if chosen is not None:
            token = chosen.tokens_for(token, source)
        self.ids[:bucket, 0].copy_(token)
        self.positions[:bucket, 0].copy_(position)
        self.mask[:bucket, 0, 0] = (self.columns >= start[:, None]) & (self.columns <= t)
        self.column.fill_(t)
        self.state.lora.select_on_device(adapter, self.adapters[:bucket])
        if (bucket, width) in self.graphs:
            graph, output = self.graphs[bucket, width]
            graph.replay()
            # Out of the graphs' pool: the step is read after the next call's work, and a captured prefill
            # replayed meanwhile reuses that pool.
            logits = self.logits[:bucket]
            logits.copy_(output)
        else:
            logits = self._forward(bucket, width)
        return logits[:n]

    def _staging(self) -> torch.Tensor:
        """The next of two pinned staging buffers, once the copy out of it two steps ago is done (the host
        rewrites it while the GPU may still be behind)."""
        self.turn = 1 - self.turn
        if self.copied is not None:
            self.copied[self.turn].synchronize()
        return self.staged[self.turn]
