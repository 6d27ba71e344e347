"""The decision object every adapter answers with (docs/architecture.md §9), and how it is found in raw text."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

_DECISION_VALUE = re.compile(r'"decision"\s*:\s*("(?:[^"\\]|\\.)*")')


class Decision(BaseModel):
    model_config = ConfigDict(extra="allow")

    decision: str = Field(min_length=1)
    confidence: float | None = Field(default=None, ge=0, le=1)
    rationale: str | None = None
    options: list[Any] | None = None
    risks: list[Any] | None = None


@dataclass(frozen=True)
class FoundDecision:
    value: dict[str, Any]
    # Characters of the text from the object's "{" through the decision's value (without its closing quote):
    # what the model wrote to reach its decision.
    span: tuple[int, int]


def find_decision(text: str) -> FoundDecision | None:
    """The first JSON object in `text` that is a valid decision, with where its decision value stands.

    Kev writes its analysis before the JSON, so the object is searched for rather than expected first."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict):
            try:
                decision = Decision.model_validate(value).model_dump(exclude_none=True)
            except ValidationError:
                decision = None
            match = _DECISION_VALUE.search(text, start, end)
            if decision is not None and match is not None:
                return FoundDecision(decision, (start, match.end(1) - 1))
        start = text.find("{", start + 1)
    return None


def parse_decision(text: str) -> dict[str, Any] | None:
    found = find_decision(text)
    return found.value if found else None
