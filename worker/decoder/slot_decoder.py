"""Iteration-level batching: the unit of work is one decode step over every row in flight, whatever its adapter
and sampling settings. Between steps new requests are prefilled into free slots; a row that finishes leaves at
once and its slot is free for the next step (docs/architecture.md §14).

The decoder executes and decides nothing about who goes next: the engine's scheduler (worker/engine/scheduler.py)
chooses which requests to prefill, whole or a pass at a time, and when to step; the engine records what comes out.
No database or Celery here.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from peft import PeftModel
from transformers import PreTrainedTokenizerBase

from shared.grammar import OwnOptionsDecision, first_part
from worker.decoder.grammar import RowGrammars
from worker.decoder.graph_prefill import CapturedPrefill
from worker.decoder.graph_step import CapturedStep
from worker.decoder.kernels import lora_expand
from worker.decoder.kernels.fused_norms import FusedNorms
from worker.decoder.kernels.fused_projections import FusedProjections
from worker.decoder.kernels.fused_rotary import FusedRotary
from worker.decoder.kernels.fused_rotary import runs_on as fused_rotary_runs_on
from worker.decoder.kernels.nf4_matmul import Nf4Kernels, nf4_layers
from worker.decoder.kernels.nf4_matmul import runs_on as nf4_runs_on
from worker.decoder.kernels.row_lora import NO_ADAPTER, RowLoRA
from worker.decoder.kv_block import KVBlock
from worker.decoder.options import DecoderOptions
from worker.decoder.sampling import Choice, Chosen, RowSampling, choose
from worker.decoder.state import ModelState, PromptBlock, Row
from worker.generation import GenerationRequest, GenerationResult, numerical_error
from worker.model.tokens import encode_chats, result_text

GENERATE_DEFAULT_TOP_K = 50

log = logging.getLogger("kevlaya.decoder")


# the window sizes a captured step on CUDA reads: all of it, half, a quarter (modellab/bench/results/README.md)
COLUMN_BUCKETS = 3


def _served(wanted: bool | None, device: torch.device,
            runs_on: Callable[[torch.device], bool] | None = None) -> bool:
    """Whether a fused operation the decoder serves on CUDA by default (`wanted` None) is used here: on CUDA only
    where its kernel builds and runs (`runs_on`, tried once per device; worker/decoder/kernels/triton_kernels.py)."""
    use = device.type == "cuda" if wanted is None else wanted
    return use and (runs_on is None or device.type != "cuda" or runs_on(device))


@dataclass
class Launched:
    """A step launched and not yet chosen from: its logits, row i's in row i, for the rows as they were then
    (None: a slot that ran idle)."""

    logits: torch.Tensor
    rows: list[Row | None]


class SlotDecoder:
    """Up to `slots` rows in flight on one model; each row attends over at most `window` tokens (prompt plus
    new tokens). The model is a PeftModel holding `adapters`; while the decoder exists their LoRA is applied
    per row (RowLoRA), not through PEFT's active adapter. `options` says how it computes (DecoderOptions; the
    worker's come from its settings, worker/engine/build.py)."""

    def __init__(self, model: PeftModel, tokenizer: PreTrainedTokenizerBase, adapters: list[str], *, slots: int,
                 window: int, eos_ids: list[int], options: DecoderOptions = DecoderOptions()):
        self.model, self.tokenizer, self.adapters = model, tokenizer, list(adapters)
        self.options = options
        self.steps = 0  # decode steps launched
        self.waited_s = 0.0  # host seconds spent waiting for steps' tokens: near none when the host is the bound
        self.eos_ids, self.ignore_eos = list(eos_ids), options.ignore_eos
        # `generate` keeps the model's top-k (transformers' default: 50) when sampling; so does this decoder.
        self.top_k = getattr(model.generation_config, "top_k", None) or GENERATE_DEFAULT_TOP_K
        parameter = next(model.parameters())
        self.device = parameter.device
        dtype = model.config.dtype if isinstance(model.config.dtype, torch.dtype) else torch.float16
        if self.device.type == "cpu":
            dtype = torch.float32
        self._banned = torch.tensor(self.eos_ids, device=self.device) if self.ignore_eos and self.eos_ids else None
        # the cache may store in another dtype (fp8); attention still reads it in `dtype`
        self.kv = KVBlock(model.config, slots, window, options.kv_dtype or dtype, self.device)
        self.attention = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
        if self.attention not in ("sdpa", "eager"):
            raise ValueError(f"attention implementation {self.attention!r}: the decoder builds sdpa/eager masks")
        self.grammars = RowGrammars(tokenizer, model.config.vocab_size, self.eos_ids, slots, self.device)
        self.rows: list[Row] = []  # row i lives in slot i
        # The next step, launched before the host read the tokens of the one before (`step`), or None
        self._ahead: Launched | None = None
        # The prefill whose passes run between decode steps (`begin_prefill`), or None; its rows hold the top slots.
        self.prefilling: PromptBlock | None = None
        self.limit = slots  # rows admitted at most; the engine lowers it after an out-of-memory (worker/memory.py)
        self._order = itertools.count()
        self.static = options.static_steps or options.graphs
        # The LoRA products in the compute dtype, like the rest of the step; on CUDA each product's row mask and
        # expand as one kernel
        masked_expand = _served(options.fused_lora, self.device, lora_expand.runs_on)
        self.lora = RowLoRA(model, self.adapters, options.lora_dtype or dtype, masked_expand=masked_expand,
                            min_rank=options.lora_min_rank, spare=options.spare_adapters)
        self.adapters = self.lora.adapters  # one list: a role that takes a spare block is a row's adapter at once
        self.state = ModelState(model, self.kv, self.lora, self.device)  # what the captured step and prefill run on
        self.fused: FusedProjections | None = None
        # RMSNorm as PyTorch's one operator where that was measured (on CUDA); the CPU keeps transformers'
        # formula, whose greedy answers the shipped model's tests hold token for token
        self.norms: FusedNorms | None = None
        # the rotary embedding of queries and keys as one kernel, likewise (it computes only on CUDA)
        self.rotary: FusedRotary | None = None
        # NF4 matmuls of 2 to 64 rows as one Triton kernel, likewise (bitsandbytes' dequantize-then-GEMM otherwise)
        self.nf4: Nf4Kernels | None = None
        nf4 = nf4_layers(model)
        # Static steps come with fixed-shape prefill passes, captured with them.
        self._static_prefill: CapturedPrefill | None = None
        try:
            if options.fused_projections:
                self.fused = FusedProjections(model, self.lora)
            if _served(options.fused_norms, self.device):
                self.norms = FusedNorms(model)
            if _served(options.fused_rotary, self.device, fused_rotary_runs_on):
                self.rotary = FusedRotary(model)
            if nf4 and _served(options.nf4_kernel, self.device, nf4_runs_on):  # before the steps are captured
                self.nf4 = Nf4Kernels(nf4)
            if self.static:
                if self.attention != "sdpa":
                    raise ValueError("static decode steps need sdpa attention")
                # column_buckets > 1: static steps also read only the window's first half, quarter, ... when
                # that holds every row (CapturedStep); 1 reads the whole window. None: COLUMN_BUCKETS on CUDA.
                column_buckets = options.column_buckets
                if column_buckets is None:
                    column_buckets = COLUMN_BUCKETS if self.device.type == "cuda" else 1
                self._static = CapturedStep(self.state, capture=options.graphs, column_buckets=column_buckets)
                if options.static_prefill:
                    self._static_prefill = CapturedPrefill(self.state, capture=options.graphs,
                                                           chunk_tokens=options.prefill_chunk_tokens,
                                                           pool=self._static.pool)
        except BaseException:
            self.close()  # a decoder that failed to build leaves the model as it found it
            raise

    @property
    def window(self) -> int:
        return self.kv.window

    @property
    def free(self) -> int:
        return max(0, self.limit - len(self.rows) - (len(self.prefilling.rows) if self.prefilling else 0))

    def close(self) -> None:
        """Give the model back its own projections and PEFT adapters (the decoder's cache is freed with it)."""
        if self.norms is not None:
            self.norms.remove()
        if self.rotary is not None:
            self.rotary.remove()
        if self.nf4 is not None:
            self.nf4.remove()
        if self.fused is not None:
            self.fused.remove()
        self.lora.remove()

    # -- prefill -----------------------------------------------------------------------------------------------

    def fits(self, prompt_tokens: int, max_new_tokens: int) -> bool:
        """Whether a row of this size can ever run here: its prompt and new tokens within one slot's window."""
        return prompt_tokens + max_new_tokens <= self.window

    def prefill(self, requests: list[GenerationRequest], admitted_at: float | None = None) -> list[GenerationResult]:
        """Prefill `requests` (at most `free`, each known to fit) into free slots, every pass now; returns the rows
        that are already finished (a one-token answer or broken logits). Raises on a model failure, slots
        unchanged. A prefill under way (`begin_prefill`) waits meanwhile."""
        if not requests:
            return []
        first = len(self.rows)
        block = self._block(requests, admitted_at, slice(first, first + len(requests)))
        self._run(block)
        return self._join(block)

    def begin_prefill(self, requests: list[GenerationRequest], admitted_at: float | None = None) -> None:
        """Start prefilling `requests` (as `prefill` takes them) in passes that run between decode steps, one per
        `prefill_pass`: rows decoding wait one pass, not the whole prefill, and a `prefill` (a Laya job) may go in
        between. Its rows hold the top slots meanwhile and take no part in the steps."""
        if self.prefilling is not None:
            raise ValueError("a prefill is already under way")
        if requests:
            self.prefilling = self._block(requests, admitted_at, slice(self.kv.slots - len(requests), self.kv.slots))

    def prefill_pass(self) -> list[GenerationResult]:
        """Run the next pass of the prefill under way; after its last, its rows join the rows in flight and those
        already finished are returned. Raises on a model failure: the prefill is then still under way, and
        `cancel_prefill` gives its requests back."""
        block = self.prefilling
        if block is None:
            return []
        next(block.passes)
        if block.logits is None:
            return []
        self.prefilling = None
        return self._join(block)

    def cancel_prefill(self) -> list[GenerationRequest]:
        """Give up the prefill under way (what its passes wrote is lost); returns its requests."""
        block, self.prefilling = self.prefilling, None
        return [row.request for row in block.rows] if block else []

    def _block(self, requests: list[GenerationRequest], admitted_at: float | None, slots: slice) -> PromptBlock:
        """The requests' prompt block, to be written at `slots`; raises before anything changes when one cannot
        fit."""
        if len(requests) > self.free:
            raise ValueError(f"{len(requests)} requests for {self.free} free slots")
        admitted_at = time.perf_counter() if admitted_at is None else admitted_at
        encoded = encode_chats(self.tokenizer, requests, self.device)
        ids, present = encoded["input_ids"], encoded["attention_mask"]
        lengths = present.sum(1).tolist()
        for request, length in zip(requests, lengths):
            if not self.fits(length, request.max_new_tokens):
                raise ValueError(f"job {request.job_id}: {length} prompt tokens + {request.max_new_tokens} new "
                                 f"tokens exceed the decoder's window of {self.window}")
        matchers = [self.grammars.matcher(first_part(r.grammar)) if r.grammar else None for r in requests]
        ids, present = self._padded(ids, present)
        self._make_room(ids.shape[1])
        t = self.kv.t
        rows = [Row(request=r, adapter=self.adapters.index(r.adapter),
                    sampling=RowSampling.create(r.temperature, r.top_p, r.seed, self.device),
                    prompt_tokens=int(length), admitted_at=admitted_at, order=next(self._order),
                    start=t - int(length), matcher=matcher)
                for r, length, matcher in zip(requests, lengths, matchers)]
        return self._prompt_block(rows, [row.adapter for row in rows], slots, ids, present)

    def _prompt_block(self, rows: list[Row], adapters: list[int], slots: slice, ids: torch.Tensor,
                      present: torch.Tensor) -> PromptBlock:
        """A block of left-padded prompts (`present`: 0 on padding) that ends at column `t - 1`."""
        width = ids.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        allowed = causal[None] & present.bool()[:, None, :]
        allowed |= torch.eye(width, dtype=torch.bool, device=self.device)  # padding attends to itself, not NaN
        positions = (present.cumsum(1) - 1).clamp(min=0)
        block = PromptBlock(rows, adapters, slots, ids, allowed, positions, lo=self.kv.t - width,
                            started=time.perf_counter())
        block.passes = self._passes(block)
        return block

    def _join(self, block: PromptBlock) -> list[GenerationResult]:
        """Place a block whose passes have all run to end at column `t - 1` in the slots after the rows in flight,
        and choose its rows' first tokens."""
        first, by = len(self.rows), self.kv.t - block.end
        self.kv.place(block.slots, slice(first, first + len(block.rows)), block.lo, block.end, by)
        prefill_ms = (time.perf_counter() - block.started) * 1000
        for row in block.rows:
            row.start += by
            row.prefill_ms = prefill_ms
        self.rows.extend(block.rows)
        return self._advance(block.rows, self._choose(block.rows, block.logits).read())

    def _make_room(self, width: int) -> None:
        """Make `t` at least `width` (a prompt block of that width ends at `t - 1`), shifting rows right."""
        if not self.rows and self.prefilling is None:
            self.kv.t = width
            return
        self._shift(max(0, width - self.kv.t))
        self.kv.t = max(self.kv.t, width)

    def _shift(self, by: int) -> None:
        """Move every row in flight and the prefill under way `by` columns along the timeline (either way)."""
        if by == 0:
            return
        if self.rows:  # leftwards, a row's columns before -by are those of a row that ends: they are dropped
            self.kv.shift(slice(0, len(self.rows)), max(min(r.start for r in self.rows), -by), self.kv.t, by)
        if self.prefilling is not None:
            block = self.prefilling
            self.kv.shift(block.slots, block.lo, block.end, by)
            block.lo += by
        for row in self.rows + (self.prefilling.rows if self.prefilling else []):
            row.start += by

    def _padded(self, ids: torch.Tensor, present: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A prompt block left-padded to the width the static prefill passes take, where it has one."""
        width = self._static_prefill.width(ids.shape[1]) if self._static_prefill else None
        if width is None or width == ids.shape[1]:
            return ids, present
        pad = (width - ids.shape[1], 0)
        return torch.nn.functional.pad(ids, pad), torch.nn.functional.pad(present, pad)

    def _passes(self, block: PromptBlock) -> Iterator[None]:
        """The block's forward passes, one per item; the last sets its logits."""
        width = block.ids.shape[1]
        if self._static_prefill and self._static_prefill.width(width) == width:
            yield from self._static_prefill.passes(block, lambda: self._spare(block))
            return
        # In chunks of columns, each attending to the cache the chunks before it wrote: a forward pass's
        # activations are bounded by the chunk, not by the prompt block (worker/memory.py measures the largest).
        rows = block.ids.shape[0]
        chunk = self.options.prefill_chunk_tokens
        columns = max(1, chunk // rows) if chunk else width
        for a in range(0, width, columns):
            b = min(a + columns, width)
            view = self.kv.view  # set at each pass: decode steps between passes set it too
            view.rows, view.read_lo, view.write_lo, view.write_hi = block.slots, block.lo, block.lo + a, block.lo + b
            logits = self._forward(block.ids[:, a:b], block.allowed[:, a:b, :b], block.positions[:, a:b],
                                   block.adapters)
            if b == width:
                block.logits = logits
            yield

    @staticmethod
    def _run(block: PromptBlock) -> None:
        """Run every pass left of `block`: its logits are then set."""
        while block.logits is None:
            next(block.passes)

    def _spare(self, block: PromptBlock) -> list[int]:
        """Free slots a static prefill pass of `block` may pad its rows into: neither rows in flight nor a block."""
        taken = set(range(self.kv.slots)[block.slots])
        if self.prefilling is not None:
            taken |= set(range(self.kv.slots)[self.prefilling.slots])
        return [slot for slot in range(len(self.rows), self.kv.slots) if slot not in taken]

    def throwaway_prefill(self, rows: int, width: int) -> None:
        """Prefill `rows` × `width` placeholder tokens (both adapters) into an empty decoder and forget them: the
        largest prefill the engine runs, so the worker can measure its memory at start (worker/memory.py: fit_slots)."""
        if self.rows or self.prefilling is not None:
            raise ValueError("a throwaway prefill needs a decoder with no rows in flight")
        rows, width = min(rows, self.kv.slots), min(width, self.window)
        ids = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        ids, present = self._padded(ids, torch.ones_like(ids))
        self._make_room(ids.shape[1])
        self._run(self._prompt_block([], [i % len(self.adapters) for i in range(rows)], slice(0, rows), ids, present))

    # -- decoding ----------------------------------------------------------------------------------------------

    def step(self, meanwhile: Callable[[], object] | None = None) -> list[GenerationResult]:
        """One new token for every row in flight; returns the rows that finished with it. `meanwhile` runs once
        the step is launched, before its logits are read: on CUDA, host work (the engine's claims) while the GPU
        computes. It must not change the rows.

        The step after this one is launched as soon as this one's tokens are chosen on the device, before the host
        reads them: the GPU computes it while the host does this step's bookkeeping (grammars, stop strings,
        results) and whatever its caller does before the next call. A row that finishes here took part in that
        launch for nothing; a row admitted meanwhile joins the launch after."""
        if not self.rows:
            self._ahead = None
            return []
        # A block under way must be on the timeline before the block is compacted at the window's end: its first
        # column may be the one that compaction would free.
        joined = self._finish_prefill() if self.prefilling and self.kv.t + 1 >= self.window else []
        launched, self._ahead = self._ahead or self._launch(), None
        if meanwhile is not None:
            meanwhile()
        # the rows of the launch still in flight (a prefill may have retired some), with their logits
        in_flight = {id(row) for row in self.rows}
        picked = [(i, row) for i, row in enumerate(launched.rows) if row is not None and id(row) in in_flight]
        rows, index = [row for _, row in picked], [i for i, _ in picked]
        logits = launched.logits[:len(index)] if index == list(range(len(index))) else launched.logits[index]
        chosen = self._choose(rows, logits)
        going_on = [row for row in rows if len(row.tokens) + 1 < row.request.max_new_tokens]
        if self.options.launch_ahead and (going_on or len(rows) < len(self.rows)):
            try:
                self._ahead = self._launch(chosen, rows)
            except Exception as exc:  # nothing is lost: the next call launches it again, and raises there
                log.warning("the step launched ahead failed (%s: %s); it runs again with the next call",
                            exc.__class__.__name__, exc)
        started = time.perf_counter()
        choice = chosen.read()  # the GPU's tokens of the launched step: the host waits here for what it still computes
        self.waited_s += time.perf_counter() - started
        return joined + self._advance(rows, choice)

    def _finish_prefill(self) -> list[GenerationResult]:
        """Run every pass left of the prefill under way; its rows join."""
        self._run(self.prefilling)  # a pass that raises leaves it under way, for `cancel_prefill`
        block, self.prefilling = self.prefilling, None
        return self._join(block)

    def _launch(self, chosen: Chosen | None = None, chosen_rows: list[Row] = ()) -> Launched:
        """Launch one step over the rows in flight. A row's input is its last token; for `chosen_rows`, the token
        `chosen` holds for it on the device, not yet read (such a row that ends by length with it runs idle)."""
        pending = {id(row): i for i, row in enumerate(chosen_rows)}
        ends = {id(row) for row in chosen_rows if len(row.tokens) + 1 >= row.request.max_new_tokens}
        slots = [None if id(row) in ends else row for row in self.rows]
        kept = [row for row in slots if row is not None]
        if self.kv.t == self.window:
            self._compact(kept)
        elif self.static and self.kv.t in self._static.widths and kept and self._oldest(kept) > 0:
            self._compact(kept)  # back under the columns this step would read next: fewer read, every step
        t = self.kv.t
        # a slot's input: its row's last token, or the index of its token among the chosen ones (-1: none)
        tokens = [row.tokens[-1] if row is not None and id(row) not in pending else 0 for row in slots]
        sources = [pending.get(id(row), -1) if row is not None else -1 for row in slots]
        # a row's new token sits at position prompt + tokens so far - 1; a pending token is one more
        positions = [0 if row is None else row.prompt_tokens + len(row.tokens) - (id(row) not in pending)
                     for row in slots]
        starts = [t if row is None else row.start for row in slots]
        adapters = [NO_ADAPTER if row is None else row.adapter for row in slots]
        if self.static:
            logits = self._static.run(tokens, sources, positions, starts, adapters, chosen)
        else:
            ids = torch.tensor(tokens, device=self.device)
            if chosen is not None:
                ids = chosen.tokens_for(ids, torch.tensor(sources, device=self.device))
            lo, n = min(starts), len(slots)
            columns = torch.arange(lo, t + 1, device=self.device)
            allowed = (columns[None, :] >= torch.tensor(starts, device=self.device)[:, None])[:, None, :]
            view = self.kv.view
            view.rows, view.read_lo, view.write_lo, view.write_hi = slice(0, n), lo, t, t + 1
            logits = self._forward(ids[:, None], allowed, torch.tensor(positions, device=self.device)[:, None],
                                   adapters)
        self.steps += 1
        self.kv.t = t + 1
        return Launched(logits, slots)

    def _forward(self, ids: torch.Tensor, allowed: torch.Tensor, positions: torch.Tensor,
                 adapters: list[int]) -> torch.Tensor:
        """Logits of each row's last position. `allowed`: rows × queries × keys, True where attention may look."""
        mask = allowed[:, None]
        if self.attention == "eager":  # eager attention adds its mask to the scores
            mask = torch.zeros(mask.shape, device=self.device).masked_fill(~mask, torch.finfo(torch.float32).min)
        self.lora.select(adapters)
        return self.state.logits(ids, mask, positions)

    def _choose(self, rows: list[Row], logits: torch.Tensor) -> Chosen:
        """Each row's next token from its logits, chosen on the device. The grammars' masks are computed here,
        after the step was launched and before its logits are read, so on CUDA the CPU works while the GPU runs."""
        allowed = self.grammars.allowed([row.matcher for row in rows])
        top = max((row.request.top_logprobs or 0 for row in rows), default=0)
        return choose(logits, [row.sampling for row in rows], k=self.top_k, banned=self._banned, allowed=allowed,
                      top=top)

    def _advance(self, rows: list[Row], choice: Choice) -> list[GenerationResult]:
        """Give each of `rows` its token from `choice`; retire the rows that finished."""
        now = time.perf_counter()
        finished = []
        for i, (row, token, logprob, broken) in enumerate(zip(rows, choice.tokens, choice.logprobs, choice.broken)):
            if broken:
                row.broken_after = len(row.tokens)
            else:
                row.tokens.append(token)
                row.logprobs.append(logprob)
                if row.request.top_logprobs is not None:
                    row.top_logprobs.append(choice.top[i][:row.request.top_logprobs] if choice.top else [])
                row.first_token_at = row.first_token_at or now
                row.last_token_at = now
                row.ended = (token in self.eos_ids and not self.ignore_eos) or self._ends(row, token)
            if broken or row.ended or len(row.tokens) >= row.request.max_new_tokens:
                finished.append(row)
        results = [self._result(row) for row in finished]
        for row in sorted(finished, key=lambda r: self.rows.index(r), reverse=True):
            self._retire(self.rows.index(row))
        return results

    def _ends(self, row: Row, token: int) -> bool:
        """Whether `token` completes the row's grammar or one of its stop strings."""
        complete = row.matcher is not None and self.grammars.advance(row.matcher, token)
        if complete and isinstance(row.request.grammar, OwnOptionsDecision) and not row.past_head:
            # the options are written: the decision is held to their names from here on
            written = b"".join(self.grammars.token_bytes(t) for t in row.tokens).decode("utf-8", "replace")
            row.matcher = self.grammars.matcher(row.request.grammar.rest(written))
            row.past_head, complete = True, False
        if complete and self.ignore_eos:  # benchmarks: every row writes exactly its max_new_tokens, constrained
            row.matcher.reset()
            complete = False
        if row.request.stop:
            new = self.grammars.token_bytes(token)
            row.text_bytes += new
            row.stopped_by = next((s for s in row.request.stop  # only where a match could newly end
                                   if s.encode() in row.text_bytes[-(len(s.encode()) + len(new)):]), None)
        return complete or row.stopped_by is not None

    def _retire(self, slot: int) -> None:
        """Free `slot`, moving the last row into it so rows stay contiguous."""
        last = len(self.rows) - 1
        if slot != last:
            moved = self.rows[last]
            self.kv.move_row(last, slot, moved.start, self.kv.t)
            self.rows[slot] = moved
        self.rows.pop()

    def _compact(self, kept: list[Row]) -> None:
        """Shift every row left by the oldest kept row's start, freeing columns at the end of the window (a row
        not kept ends with the token it has pending: its columns no longer matter). A block under way shifts
        with them."""
        by = self._oldest(kept)
        assert by > 0, "a row longer than the window was admitted"
        self._shift(-by)
        self.kv.t -= by

    def _oldest(self, kept: list[Row]) -> int:
        """The first column that rows `kept` and a block under way still need."""
        return min([row.start for row in kept] + ([self.prefilling.lo] if self.prefilling else []))

    # -- giving rows back -------------------------------------------------------------------------------------

    def drop_newest(self, count: int) -> list[GenerationRequest]:
        """Drop the `count` most recently admitted rows (their work is lost, they are not failed); returns their
        requests, to go back in the queue. A step launched ahead stays: the rows kept take their tokens from it."""
        return self._drop(sorted(self.rows, key=lambda r: r.order, reverse=True)[:count])

    def clear(self) -> list[GenerationRequest]:
        """Drop every row in flight (after a failed step); returns their requests."""
        self._ahead = None
        return self._drop(list(self.rows))

    def _drop(self, rows: list[Row]) -> list[GenerationRequest]:
        for row in sorted(rows, key=lambda r: self.rows.index(r), reverse=True):
            self._retire(self.rows.index(row))
        return [row.request for row in rows]

    # -- results -----------------------------------------------------------------------------------------------

    def _result(self, row: Row) -> GenerationResult:
        result = GenerationResult(
            job_id=row.request.job_id, text=None, prompt_tokens=row.prompt_tokens,
            completion_tokens=len(row.tokens), prefill_ms=row.prefill_ms,
            decode_ms=((row.last_token_at or 0) - (row.first_token_at or 0)) * 1000,
            first_token_ms=((row.first_token_at or time.perf_counter()) - row.admitted_at) * 1000,
            first_token_at=row.first_token_at,
            token_ids=list(row.tokens), token_logprobs=list(row.logprobs),
            finish_reason="stop" if row.ended else "length", stop=row.stopped_by,
            top_logprobs=list(row.top_logprobs) if row.request.top_logprobs is not None else None,
        )
        if self.options.texts:
            result_text(self.tokenizer, result)
        if row.broken_after is not None:
            numerical_error(result, row.broken_after)
        return result
