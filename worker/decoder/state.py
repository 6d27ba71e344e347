"""What the slot decoder holds, as plain data its parts share: the model with its key/value block and per-row LoRA
(`ModelState`), a row in flight (`Row`) and a block of prompts being prefilled (`PromptBlock`). The captured step
and prefill (graph_step.py, graph_prefill.py) are handed a `ModelState` and the blocks to run; they never see the
decoder (tests/test_layout.py: no import cycle in worker/)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from peft import PeftModel

from worker.decoder.kernels.row_lora import RowLoRA
from worker.decoder.kv_block import KVBlock
from worker.decoder.sampling import RowSampling
from worker.generation import GenerationRequest


@dataclass(frozen=True, eq=False)
class ModelState:
    """The model a decoder runs, its key/value block (every pass reads and writes it through `kv.view`) and its
    per-row LoRA (whose row mask a pass sets), on one device."""

    model: PeftModel
    kv: KVBlock
    lora: RowLoRA
    device: torch.device

    def logits(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One forward pass through the key/value block as its view says: each row's last logits."""
        with torch.inference_mode():
            output = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=self.kv.cache,
                                use_cache=True, logits_to_keep=1)
        return output.logits[:, -1]


@dataclass
class Row:
    request: GenerationRequest
    adapter: int  # index into the decoder's adapters
    sampling: RowSampling
    prompt_tokens: int
    admitted_at: float  # perf_counter when it was handed in (its time to first token counts from here)
    order: int  # admission order: an out-of-memory step gives back the newest rows first
    start: int = 0  # first cache column of this row
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prefill_ms: float = 0.0
    first_token_at: float | None = None
    last_token_at: float | None = None
    broken_after: int | None = None  # generated tokens before its logits went non-finite
    matcher: Any = None  # llguidance.LLMatcher of the row's grammar, or None: free
    past_head: bool = False  # an OwnOptionsDecision grammar's head is written and its rest is the row's matcher
    text_bytes: bytearray = field(default_factory=bytearray)  # what it wrote so far, while it has stop strings
    stopped_by: str | None = None  # the stop string it ended on
    ended: bool = False  # it ended (end of sequence, grammar complete, stop string) rather than ran out of tokens
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, when its request asks


@dataclass
class PromptBlock:
    """Prompts being prefilled: rows × width tokens, left-padded, written at the slots `slots` (consecutive) and
    the columns [lo, lo + width), which move when the key/value block shifts. Its rows join the rows in flight
    once its last pass has run (`logits` set): placed to end at the column before `t`."""

    rows: list[Row]  # none for the throwaway prefill
    adapters: list[int]  # each row's
    slots: slice
    ids: torch.Tensor
    allowed: torch.Tensor  # rows × width × width: where each column may look
    positions: torch.Tensor
    lo: int
    started: float  # perf_counter of its first pass
    passes: Iterator[None] = iter(())  # runs one forward pass per item
    logits: torch.Tensor | None = None  # each row's last logits, once the last pass has run

    @property
    def end(self) -> int:
        return self.lo + self.ids.shape[1]
