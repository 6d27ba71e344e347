"""Server-Sent Events as the benchmarks' and the tests' clients read them, fed one line at a time, so any HTTP
client (aiohttp, httpx) shares one parser; and the text such a client builds from the job's events."""

from __future__ import annotations

import json
from typing import Any


class SseParser:
    """Events of `GET /v1/jobs/{id}/events`: {"id", "event", "data"} with the data parsed as JSON. Comments and
    blocks without an event name (the opening `retry:`) are skipped."""

    def __init__(self) -> None:
        self._event: dict[str, Any] = {}

    def feed(self, line: str) -> dict[str, Any] | None:
        """One line, its newline removed; returns the event a blank line completes, else None."""
        if not line:
            event, self._event = self._event, {}
            return event if "event" in event else None
        if not line.startswith(":"):
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            self._event[name] = json.loads(value) if name == "data" else value
        return None


def streamed_text(events: list[dict[str, Any]]) -> str:
    """The text a client of the job's events builds: deltas appended, a `running` status restarting it, a `resync`
    setting it to the stored job's (none while the job runs)."""
    text = ""
    for event in events:
        if event["event"] == "resync":
            text = ((event["data"]["job"].get("result") or {}).get("text")) or ""
        elif event["event"] == "status" and event["data"]["status"] == "running":
            text = ""
        elif event["event"] == "delta":
            text += event["data"]["text"]
    return text
