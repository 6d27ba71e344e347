"""From a stored job to what the model is asked, and from what the model wrote back to the stored outcome: the
job's result, or, for an unsure `auto` head, its Kev stage (docs/architecture.md §3, §9)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy.orm import Session

from shared import lifecycle
from shared.calibration import Calibration, adapter_calibration
from shared.lifecycle import JobOutcome
from shared.models import Job, JobStatus, Priority
from shared.queue import QueueUnavailable, publish_wakeup
from shared.schemas import answer_grammar, job_choices, model_messages, stop_strings, to_messages
from shared.settings import Settings
from worker.generation import GenerationRequest, GenerationResult
from worker.ledger.cascade import escalate, is_cascade_head, needs_escalation
from worker.ledger.outcomes import job_outcome

log = logging.getLogger("kevlaya.worker")


def generation_request(job: Job, settings: Settings) -> GenerationRequest:
    """What the model is asked for a stored job: its adapter's system prompt and defaults, its own params."""
    profile = settings.adapter_profile(job.adapter)  # type: ignore[arg-type]
    params = job.params
    messages = model_messages(job.input, params, profile.system_prompt)
    return GenerationRequest(
        job_id=job.id, adapter=job.adapter, messages=messages,
        max_new_tokens=params.get("max_new_tokens", profile.max_new_tokens),
        temperature=params.get("temperature", profile.temperature),
        top_p=params.get("top_p", profile.top_p),
        seed=params.get("seed"),
        grammar=answer_grammar(params, messages, profile.analysis),
        stop=stop_strings(params.get("stop")),
        top_logprobs=params.get("top_logprobs", 0) if params.get("logprobs") else None,
        background=job.priority == Priority.BATCH,
        chose_max_new_tokens="max_new_tokens" in params,
    )


def failed(code: str, message: str) -> JobOutcome:
    """The outcome of a job that fails before or outside the model, with its code."""
    return JobOutcome(status=JobStatus.FAILED, error_code=code, error_message=message)


def unreadable(exc: Exception) -> JobOutcome:
    """A stored job this worker cannot turn into a request fails alone."""
    return failed("invalid_input", f"the stored job cannot be read: {exc.__class__.__name__}: {exc}")


@dataclass(frozen=True)
class Settled:
    outcome: JobOutcome  # what the job's result means (for an escalated head: Laya's stage)
    stored: bool  # False when this worker no longer held the lease: the result was discarded
    escalated: Job | None  # the Kev stage queued for an unsure `auto` head


def settle_job(session: Session, job: Job, group_id: uuid.UUID, result: GenerationResult | JobOutcome,
               settings: Settings, versions: Mapping[str, str],
               calibrations: Mapping[str, Calibration] | None = None) -> Settled:
    """Store what became of one job of claim group `group_id`; `versions`: each adapter's version (sha256) its
    group ran on, stored with an answer its weights wrote; `calibrations`: that version's calibration, which
    settles it (else the configured adapter's)."""
    if isinstance(result, JobOutcome):
        outcome = result
    else:
        calibration = (calibrations or {}).get(job.adapter) or adapter_calibration(
            settings.adapter_profile(job.adapter).path)  # type: ignore[arg-type]
        outcome = job_outcome(result, job.params.get("output", "decision"), calibration,
                              job_choices(job.params, to_messages(job.input)))
        outcome.adapter_version = versions.get(job.adapter)
    # Tool calls are Laya's to make (the executor): an `auto` job with tools takes her answer.
    if isinstance(result, GenerationResult) and is_cascade_head(job) and job.params.get("output") != "tool_calls" \
            and needs_escalation(outcome, settings.cascade.threshold):
        child = escalate(session, job, group_id, outcome)
        return Settled(outcome, child is not None, child)
    return Settled(outcome, lifecycle.finish(session, job, group_id, outcome), None)  # also settles an `auto` parent


def announce_escalations(children: list[Job]) -> None:
    for child in children:
        log.info("job %s: Laya was unsure, escalated to Kev as job %s", child.parent_job_id, child.id)
        try:
            publish_wakeup(child.id, child.adapter)
        except QueueUnavailable:
            pass  # a drain or the sweeper picks it up from the database anyway
