"""What the engine hands the decoder and gets back: plain data, no torch, so the Celery parent process and the
job ledger can use it without initialising CUDA before the worker child is forked."""

from __future__ import annotations

import logging
import math
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.grammar import OwnOptionsDecision

log = logging.getLogger("kevlaya.decoder")


@dataclass
class GenerationRequest:
    job_id: uuid.UUID
    adapter: str  # "kev" | "laya"
    messages: list[dict[str, str]]  # [{role, content}], system message already included by the caller
    max_new_tokens: int
    temperature: float  # 0 = greedy
    top_p: float
    seed: int | None
    grammar: str | OwnOptionsDecision | None = None  # what the answer must follow (shared/grammar.py); None: free
    stop: list[str] = field(default_factory=list)  # the answer ends before the first of these strings
    top_logprobs: int | None = None  # None: no log-probabilities asked for; else the alternatives per token
    background: bool = False  # a line of a file batch: never in a reserved slot, never paces other prefills
    # False: max_new_tokens is the role's default, which shrinks to what the window leaves after the prompt
    chose_max_new_tokens: bool = True


@dataclass
class GenerationResult:
    job_id: uuid.UUID
    text: str | None
    prompt_tokens: int
    completion_tokens: int
    prefill_ms: float  # the prefill of the forward passes this row shared
    decode_ms: float  # this row's own decode: from its first token to its last
    error_code: str | None = None  # "numerical_error" | "out_of_memory" | "adapter_unavailable" | "invalid_input" | None
    error_message: str | None = None
    # The model's own log-probability of each completion token (raw logits, before temperature/top-p),
    # and the character span each token covers in `text`: a span's probability is a calibrated confidence.
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    token_spans: list[tuple[int, int]] = field(default_factory=list)
    first_token_ms: float | None = None  # from when the row was handed to the decoder to its first token
    first_token_at: float | None = None  # time.perf_counter() when its first token was chosen (live streams)
    # "stop": it ended (end of sequence, its grammar complete, or a stop string); "length": max_new_tokens ran out.
    finish_reason: str = "stop"
    stop: str | None = None  # the stop string it ended on: the text is cut before it
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, the most likely (id, log p): when asked
    logprobs: list[dict] | None = None  # OpenAI's per-token entries for the text, made with it (tokens.result_text)

    def span_probability(self, start: int, end: int) -> float | None:
        """Probability the model gave to the tokens that produced text[start:end], or None if unknown."""
        overlapping = [lp for lp, (a, b) in zip(self.token_logprobs, self.token_spans) if a < end and b > start]
        return math.exp(sum(overlapping)) if overlapping else None


def numerical_error(result: GenerationResult, generated: int) -> None:
    """Mark `result` as stopped by broken logits (NaN/Inf) after `generated` tokens; its partial text is kept."""
    result.error_code = "numerical_error"
    result.error_message = (f"non-finite logits (NaN/Inf) after {generated} generated token(s); the sequence was "
                            "stopped and its partial text kept")
    log.error("job %s: %s", result.job_id, result.error_message)
