"""The decision object every adapter answers with (docs/architecture.md §9), and how it is found in raw text."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

_DECISION_VALUE = re.compile(r'"decision"\s*:\s*("(?:[^"\\]|\\.)*")')
# "Options: ..." at the start of a line or sentence, up to the end of its sentence or line.
_OPTIONS_LINE = re.compile(r"(?:^|(?<=[.:?!]\s))options:\s*(?P<items>.+?)\s*(?:\.(?=\s)|\.?$)",
                           re.IGNORECASE | re.MULTILINE)
_LEADING_CONJUNCTION = re.compile(r"^(?:or|and)\s+", re.IGNORECASE)


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


def offered_options(text: str) -> list[str] | None:
    """The option labels a question lists on an `Options:` line, or None when it lists none.

    Items separated by ";" are described options (the scenario format: "A cost 12 risk low ...; B ..."): each label
    is the item's first word. Items separated by commas are the labels themselves ("Options: train, flight")."""
    match = _OPTIONS_LINE.search(text)
    if match is None:
        return None
    items = match["items"]
    if ";" in items:
        labels = [item.split()[0] for item in items.split(";") if item.split()]
    else:
        labels = [_LEADING_CONJUNCTION.sub("", item.strip()) for item in items.split(",")]
    labels = [*dict.fromkeys(label for label in labels if label)]
    return labels or None


def parse_decision(text: str) -> dict[str, Any] | None:
    found = find_decision(text)
    return found.value if found else None
