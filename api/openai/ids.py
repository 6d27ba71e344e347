"""Public ids as OpenAI writes them: a prefix for the kind of object (`file-`, `batch_`, `resp_`) and the row's UUID in
hex; the rows keep plain UUIDs."""

from __future__ import annotations

import re
import uuid

_ID = re.compile(r"[0-9a-f]{32}")


def public_id(prefix: str, value: uuid.UUID) -> str:
    return f"{prefix}{value.hex}"


def parse_id(prefix: str, value: str) -> uuid.UUID | None:
    """The row id behind a public id; None for anything this service did not issue."""
    if value.startswith(prefix) and _ID.fullmatch(value[len(prefix):]):
        return uuid.UUID(hex=value[len(prefix):])
    return None
