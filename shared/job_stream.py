"""A job's live events: one Redis stream per job (docs/architecture.md §3, Stream), written by the worker that runs
it and read by the API's `/v1/jobs/{id}/events` and streamed chat completions. The SQL row stays the truth; the
stream is a bounded view of it that expires after the job ends.

Entries, in order (each an `event` name and its JSON `data`):
    status  {"status": "running", "attempt": n, "stage": "laya"|"kev"|None}   the text restarts from ""
    status  {"status": "queued", "attempt": n}                                 given back to the queue
    status  {"status": "escalated", "stage": "kev", "job_id": child}           an `auto` job's Kev stage follows
    delta   {"text": "...", "tokens": n}                                       new text; tokens so far this run
A delta whose text starts its run's also has a field FIRST_TOKEN_AT beside `data`, never sent to clients: when the
worker made the run's first token (epoch seconds), so the benchmark can measure the stream's delay.
The end of a job is not an entry: readers learn it from the "job finished" notice (shared.notify) and answer
with the stored row.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

RUNNING, QUEUED, ESCALATED = "running", "queued", "escalated"
FIRST_TOKEN_AT = "first_token_at"


def stream_key(job_id: uuid.UUID | str) -> str:
    return f"kevlaya:job:{job_id}:events"


def entry(event: str, **data: Any) -> dict[str, str]:
    return {"event": event, "data": json.dumps(data, separators=(",", ":"))}


def read_entry(fields: dict[bytes, bytes]) -> tuple[str, dict[str, Any]]:
    return fields[b"event"].decode(), json.loads(fields[b"data"])


def entry_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id ("<ms>-<seq>") as a sortable pair; "0" or "0-0" is before every entry."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def is_entry_id(text: str) -> bool:
    ms, dash, seq = text.partition("-")
    return ms.isdigit() and len(ms) <= 20 and (not dash or (seq.isdigit() and len(seq) <= 20))
