"""The decision object every adapter answers with (DESIGN §9), and how it is found in raw text."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class Decision(BaseModel):
    model_config = ConfigDict(extra="allow")

    decision: str = Field(min_length=1)
    confidence: float | None = Field(default=None, ge=0, le=1)
    rationale: str | None = None
    options: list[Any] | None = None
    risks: list[Any] | None = None


def parse_decision(text: str) -> dict[str, Any] | None:
    """The first JSON object in `text` that is a valid decision, or None.

    Kev writes its analysis before the JSON, so the object is searched for rather than expected first."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            value, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict):
            try:
                return Decision.model_validate(value).model_dump(exclude_none=True)
            except ValidationError:
                pass
        start = text.find("{", start + 1)
    return None
