"""The cursors of `GET /v1/jobs`: a page's last job as an opaque string, and back into its keyset position."""

from __future__ import annotations

import base64
import json
import uuid
from datetime import datetime

from shared.models import Job


def encode_cursor(job: Job) -> str:
    raw = json.dumps([job.created_at.isoformat(), str(job.id)]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, uuid.UUID]:
    """Raises ValueError on anything that is not a cursor this API issued."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at, job_id = json.loads(raw)
        return datetime.fromisoformat(created_at), uuid.UUID(job_id)
    except Exception as exc:
        raise ValueError("cursor is not one returned by this API") from exc
