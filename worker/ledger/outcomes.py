"""What a generation means for its job: success with a decision, or which failure (docs/architecture.md §6, §9)."""

from __future__ import annotations

from shared.calibration import Calibration
from shared.decision import FoundDecision, find_decision
from shared.grammar import NONE
from shared.lifecycle import JobOutcome
from shared.models import JobStatus
from worker.generation import GenerationResult


def stored_text(text: str) -> str:
    """The text as a job stores it (and its stream shows it): PostgreSQL refuses NUL."""
    return text.replace("\x00", "\ufffd")


def decision_probability(result: GenerationResult, found: FoundDecision | None = None) -> float | None:
    """The probability the model gave to writing its decision object up to the decision's value: the span starts
    at the object, so fields written before the decision (Laya's kept options) count too. None without one."""
    found = found or find_decision(result.text or "")
    return result.span_probability(*found.span) if found is not None else None


def job_outcome(result: GenerationResult, output: str, calibration: Calibration = Calibration(),
                choices: list[str] | None = None) -> JobOutcome:
    """`output` is the job's format: "decision" requires a valid decision object, "text" does not. `calibration` is
    the adapter's (shared/calibration.py). `choices`: the options the job offers (shared/schemas.py: job_choices);
    an object that names another is no decision (the grammar writes none such; free text can)."""
    text = stored_text(result.text) if result.text is not None else None
    timings = dict(prefill_ms=result.prefill_ms, decode_ms=result.decode_ms,
                   first_token_ms=result.first_token_ms, finish_reason=result.finish_reason, logprobs=result.logprobs,
                   prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens)
    if result.error_code:
        return JobOutcome(status=JobStatus.FAILED, result_text=text, error_code=result.error_code,
                          error_message=result.error_message, **timings)
    found = find_decision(result.text or "") if output != "tool_calls" else None  # a call's arguments are no decision
    if found is not None and choices is not None and found.value["decision"] not in (*choices, NONE):
        found = None
    decision = None
    if found is not None:
        # The confidence is the model's own probability of its decision, never a number it wrote, mapped by the
        # adapter's calibration to how often such answers are right.
        decision = {k: v for k, v in found.value.items() if k != "confidence"}
        probability = decision_probability(result, found)
        if probability is not None:
            decision["confidence"] = round(calibration.confidence(probability), 4)
    if decision is None and output == "decision":
        if result.finish_reason == "length":  # the grammar guarantees the object, given the tokens to close it
            return JobOutcome(status=JobStatus.FAILED, result_text=text, error_code="length",
                              error_message=f"max_new_tokens ({result.completion_tokens}) ran out before the decision "
                              "object closed; the partial text is kept", **timings)
        return JobOutcome(status=JobStatus.FAILED, result_text=text, error_code="invalid_output",
                          error_message="the answer holds no valid JSON decision object; the raw text is kept",
                          **timings)
    return JobOutcome(status=JobStatus.SUCCEEDED, result_text=text, decision=decision, **timings)
