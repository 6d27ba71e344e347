"""Server-Sent Events as the API writes them: one event's text, the heartbeat a quiet stream sends, and the headers
that keep proxies from buffering a stream."""

from __future__ import annotations

import json
from typing import Any

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # and no proxy buffering it
HEARTBEAT = ": keep-alive\n\n"


def sse(event: str | None, data: Any, event_id: str | None = None) -> str:
    """One event. The data is one line of JSON (JSON escapes every newline), so no field can end the event."""
    lines = [f"id: {event_id}"] if event_id else []
    if event:
        lines.append(f"event: {event}")
    lines.append("data: " + (data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))))
    return "\n".join(lines) + "\n\n"
