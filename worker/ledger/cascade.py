"""The `auto` cascade (docs/architecture.md §9): Laya answers first; an invalid or unsure answer goes to Kev.

An escalated `auto` job ends up with two children: a finished record of Laya's stage and the Kev job.
The parent waits (running, without a lease, so expiry never re-queues it); whatever final state the Kev
stage reaches settles it (`shared.lifecycle.settle_parent`), and its `answered_by` says kev."""

from __future__ import annotations

import uuid

from sqlalchemy.orm import Session

from shared import lifecycle, usage
from shared.clock import db_now, elapsed_ms
from shared.lifecycle import JobOutcome
from shared.models import Job, JobStatus


def is_cascade_head(job: Job) -> bool:
    return job.requested_adapter == "auto" and job.parent_job_id is None


def needs_escalation(outcome: JobOutcome, threshold: float) -> bool:
    if outcome.status != JobStatus.SUCCEEDED or outcome.decision is None:
        return True  # no valid decision from Laya
    confidence = outcome.decision.get("confidence")
    return confidence is None or confidence < threshold


def escalate(session: Session, parent: Job, group_id: uuid.UUID, laya: JobOutcome) -> Job | None:
    """Record Laya's stage and queue Kev; None when this claim group no longer holds the parent's lease."""
    held = lifecycle.escalate(session, parent, group_id)
    if not held:
        return None
    now = db_now(session)
    stage = Job(
        adapter="laya", requested_adapter="laya", answered_by="laya", status=laya.status, input=parent.input,
        params=parent.params, parent_job_id=parent.id, api_key_id=parent.api_key_id, batch_id=group_id,
        attempts=parent.attempts,
        created_at=parent.created_at, started_at=parent.started_at, finished_at=now,
        result_text=laya.result_text, decision=laya.decision, error_code=laya.error_code,
        error_message=laya.error_message, adapter_version=laya.adapter_version, prefill_ms=laya.prefill_ms,
        decode_ms=laya.decode_ms, prompt_tokens=laya.prompt_tokens, completion_tokens=laya.completion_tokens,
        queue_ms=elapsed_ms(parent.started_at, parent.created_at),
        total_ms=elapsed_ms(now, parent.created_at),
    )
    # Kev writes long analyses: a token limit chosen for Laya's short answer would cut it off.
    kev = Job(
        adapter="kev", requested_adapter="kev", status=JobStatus.QUEUED, input=parent.input,
        params={k: v for k, v in parent.params.items() if k != "max_new_tokens"},
        parent_job_id=parent.id, api_key_id=parent.api_key_id, created_at=now, priority=parent.priority,
    )
    for row in (stage, kev):  # each stage stores the request again, and Laya's its outcome
        row.stored_bytes = usage.request_bytes({"input": row.input, "params": row.params}) + usage.result_bytes(
            vars(row))
        usage.charge(session, row.api_key_id, row.stored_bytes)
    session.add_all([stage, kev])
    session.flush()
    return kev
