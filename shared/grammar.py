"""What a job's answer is constrained to, as an llguidance grammar (docs/architecture.md §9).

Grammars are built from plain data (no tokenizer, no torch), so the API can refuse one at submit, naming what the
library cannot enforce, and the worker compiles the same text once per row (worker/decoder/grammar.py).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher

NONE = "none"  # every decision may be "none": no option offered meets the question

# Decisions and JSON answers are written compactly, as `json.dumps` writes them (the demo adapters were trained on
# that): a model cannot stall in whitespace, and a client parses the result either way.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# A free-text analysis before the decision (Kev): lines without "{", so the first "{" of the answer opens the
# decision object (and no object written inside the analysis can be taken for the decision).
ANALYSIS_LINES = r"/([^{\n]+\n)+/"


class GrammarError(ValueError):
    """A schema the grammar library cannot enforce; the message names the feature."""


def decision_schema(choices: list[str] | None) -> dict[str, Any]:
    """The decision object (shared/decision.py `Decision`) as a JSON schema. Two key orders are allowed, the two the
    adapters write: the kept options first (Laya's scratch space), or the decision first (Kev). No `confidence`: the
    service computes it from the model's own probabilities, so a model cannot write one."""
    decision: dict[str, Any] = ({"enum": [*dict.fromkeys([*choices, NONE])]} if choices
                                else {"type": "string", "minLength": 1})
    strings = {"type": "array", "items": {"type": "string"}}
    orders = (("options", "decision", "rationale", "risks"), ("decision", "rationale", "options", "risks"))
    fields = {"decision": decision, "rationale": {"type": "string"}, "options": strings, "risks": strings}
    return {"anyOf": [{"type": "object", "properties": {name: fields[name] for name in order},
                       "required": ["decision"], "additionalProperties": False} for order in orders]}


def decision_grammar(choices: list[str] | None, analysis: bool) -> str:
    """A decision object naming one of `choices` (or any string when None), after free analysis lines when
    `analysis` (the object alone otherwise)."""
    schema = json.dumps({**decision_schema(choices), "x-guidance": COMPACT_JSON})
    if not analysis:
        return LLMatcher.grammar_from_json_schema(schema)
    return LLMatcher.grammar_from_lark(f"start: ANALYSIS? decision\nANALYSIS: {ANALYSIS_LINES}\n"
                                       f"decision: %json {schema}\n")


_STRING = json.dumps({"type": "string", "x-guidance": COMPACT_JSON})
_STRINGS = json.dumps({"type": "array", "items": {"type": "string"}, "x-guidance": COMPACT_JSON})


@dataclass(frozen=True)
class OwnOptionsDecision:
    """A decision held to the options its own answer lists, for a question that names none the service can read:
    the answer's head is generated under `head` (the analysis lines when `analysis`, then the object's `options`
    list, through `"decision":`); `rest(head_text)` is then the grammar of the remainder, the decision one of
    the names that list gives (or "none"). A grammar cannot refer back to what it generated, so the row's grammar
    is swapped where the head ends (worker/decoder/slot_decoder.py)."""

    analysis: bool

    @property
    def head(self) -> str:
        return _options_head(self.analysis)

    @staticmethod
    def rest(head_text: str) -> str:
        names = option_names(json.loads(head_text[head_text.index("{"):] + ' ""}')["options"])
        decision = json.dumps({"enum": [*dict.fromkeys([*names, NONE])], "x-guidance": COMPACT_JSON})
        return LLMatcher.grammar_from_lark(
            f'start: " " decision rationale? risks? "}}"\ndecision: %json {decision}\n'
            f'rationale: ", \\"rationale\\": " %json {_STRING}\nrisks: ", \\"risks\\": " %json {_STRINGS}\n')


def first_part(grammar: str | OwnOptionsDecision) -> str:
    """The grammar a row starts under."""
    return grammar.head if isinstance(grammar, OwnOptionsDecision) else grammar


@functools.cache
def _options_head(analysis: bool) -> str:
    start = 'start: ANALYSIS? options\nANALYSIS: ' + ANALYSIS_LINES if analysis else "start: options"
    return LLMatcher.grammar_from_lark(
        f'{start}\noptions: "{{\\"options\\": [" (item (", " item)*)? "], \\"decision\\":"\nitem: %json {_STRING}\n')


def option_names(items: list[str]) -> list[str]:
    """The names an answer's `options` list gives: each item up to its first ": " ("train: 40" names "train"); an
    item without one names itself and each leading run of its words ("train 40": "train", "train 40")."""
    names = []
    for item in items:
        if ": " in item:
            names.append(item.split(": ", 1)[0].strip())
        else:
            words = item.split()
            names.extend(" ".join(words[:k]) for k in range(1, len(words) + 1))
    return [name for name in dict.fromkeys(names) if name and not re.fullmatch(r"\W*", name)]


def json_grammar(schema: dict[str, Any] | None) -> str:
    """Any JSON object (`schema` None: OpenAI's `json_object`), or one that validates against `schema`. Raises
    GrammarError for a schema the library cannot enforce exactly."""
    schema = {"type": "object"} if schema is None else schema
    grammar = LLMatcher.grammar_from_json_schema(json.dumps({**schema, "x-guidance": COMPACT_JSON}))
    check(grammar)
    return grammar


def check(grammar: str) -> None:
    problem = LLMatcher.validate_grammar(grammar)
    if problem:
        raise GrammarError(f"cannot be enforced here: {problem.strip()}")
