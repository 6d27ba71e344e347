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
    is swapped where the head ends (worker/decoder/slot_decoder.py). Each listed option's name is a run of the
    question's own words (`question_names`), so a small model cannot misspell one into an option nobody offered."""

    analysis: bool
    question: str  # the user's words

    @property
    def head(self) -> str:
        return _options_head(self.analysis, tuple(question_names(self.question)))

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


MAX_NAME_WORDS = 4  # "Smith & Sons Ltd": longer option names are rare, and each word more multiplies the names
_EDGE_PUNCTUATION = "\"'([{,.;:!?)]}"
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def question_names(question: str) -> list[str]:
    """What an option may be called: every run of 1 to MAX_NAME_WORDS consecutive words of the question, without
    the punctuation around it ("Dr. Lopez", "Disney+", "Mama's", "Smith & Sons")."""
    words = question.split()
    names = (" ".join(words[i:i + n]).strip(_EDGE_PUNCTUATION)
             for n in range(1, MAX_NAME_WORDS + 1) for i in range(len(words) - n + 1))
    return [name for name in dict.fromkeys(names)
            if name and ": " not in name and not any(c in name for c in '"\\/') and name.isprintable()]


def _literal(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


@functools.lru_cache(maxsize=256)
def _options_head(analysis: bool, names: tuple[str, ...]) -> str:
    start = 'start: ANALYSIS? options\nANALYSIS: ' + ANALYSIS_LINES if analysis else "start: options"
    # one terminal per item, a name of the question's then what the answer says of it: no lexer ambiguity
    name = "|".join(_literal(n) for n in sorted(names, key=len, reverse=True)) if names else '[^"\\\\:\\x00-\\x1f]+'
    item = f'/"({name})(: [^"\\\\\\x00-\\x1f]*)?"/'
    return LLMatcher.grammar_from_lark(
        f'{start}\noptions: "{{\\"options\\": [" (ITEM (", " ITEM)*)? "], \\"decision\\":"\nITEM: {item}\n')


def option_names(items: list[str]) -> list[str]:
    """The names an answer's `options` list gives: each item up to its first ": " ("train: 40" names "train"), or
    the whole item where it has none."""
    names = (item.split(": ", 1)[0].strip() for item in items)
    return [name for name in dict.fromkeys(names) if name]


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")  # not allOf: its parts' properties add up
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
# an object that says how extra keys go, or whose properties other parts may add to, stays as it is
_EXTRA_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf",
               "$ref", "if", "dependentSchemas")


def closed(schema: Any) -> Any:
    """`schema` with every object that names its properties, and says nothing of others, closed to others
    (`additionalProperties: false`), as OpenAI's strict mode asks and xgrammar's strict mode does. JSON Schema
    admits any extra key by default, and so would the grammar: a model may then write keys no client asked for,
    and random weights write one until max_tokens. An answer under the closed schema is valid under the open one."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if key in out:
            out[key] = closed(out[key])
    if isinstance(out.get("properties"), dict) and not any(key in out for key in _EXTRA_KEYS):
        out["additionalProperties"] = False
    return out


def json_grammar(schema: dict[str, Any] | None) -> str:
    """Any JSON object (`schema` None: OpenAI's `json_object`), or one that validates against `schema` (`closed`).
    Raises GrammarError for a schema the library cannot enforce exactly."""
    schema = {"type": "object"} if schema is None else closed(schema)
    grammar = LLMatcher.grammar_from_json_schema(json.dumps({**schema, "x-guidance": COMPACT_JSON}))
    check(grammar)
    return grammar


def check(grammar: str) -> None:
    problem = LLMatcher.validate_grammar(grammar)
    if problem:
        raise GrammarError(f"cannot be enforced here: {problem.strip()}")


# -- tool calls ---------------------------------------------------------------------------------------------------

# A tool call as the model writes it (Hermes' format, which Qwen2.5, Hermes and SmolLM3 were trained on): a JSON
# object `{"name", "arguments"}` between these tags, several calls one after the other, a newline between them.
TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_CALL_SEPARATOR = "<tool_call>\n", "\n</tool_call>", "\n"
MAX_TOOL_CALLS = 8  # calls in one answer with parallel_tool_calls: a random or looping model still ends
_REF_ROOTS = ("#/$defs/", "#/definitions/")


def tool_call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """One function's call `{"name": name, "arguments": {...}}`, the arguments under its parameters' schema. The
    parameters' definitions move to the root, where their `$ref`s point."""
    definitions = {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}
    # the arguments are an object, also where the schema leaves its type out
    arguments = closed({"type": "object", **{key: value for key, value in parameters.items()
                                             if key not in definitions and key != "$schema"}})
    definitions = {key: {name: closed(sub) for name, sub in value.items()} for key, value in definitions.items()}
    _check_refs(arguments)
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False, **definitions,
            "x-guidance": COMPACT_JSON}


def _check_refs(schema: Any) -> None:
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str) and not ref.startswith(_REF_ROOTS):
                raise GrammarError(f"cannot be enforced here: $ref {ref!r} (only #/$defs/... and #/definitions/...)")
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def tool_calls_grammar(functions: dict[str, dict[str, Any]], parallel: bool,
                       otherwise: str | dict[str, Any] | None) -> str:
    """An answer of tool calls, each naming one of `functions` (name: parameters' schema) with arguments valid
    under its schema: one call, or with `parallel` up to MAX_TOOL_CALLS. `otherwise` is what the answer may be
    instead of calls: None (nothing: a call is required), "text" (free text that does not open a call) or a JSON
    schema (the answer's response_format)."""
    literal = json.dumps
    rules = [f"call: {literal(TOOL_CALL_OPEN)} ({' | '.join(f'f{i}' for i in range(len(functions)))}) "
             f"{literal(TOOL_CALL_CLOSE)}",
             f"calls: call ({literal(TOOL_CALL_SEPARATOR)} call){{0,{MAX_TOOL_CALLS - 1}}}" if parallel
             else "calls: call"]
    rules += [f"f{i}: %json {json.dumps(tool_call_schema(name, parameters))}"
              for i, (name, parameters) in enumerate(functions.items())]
    if otherwise is None:
        start = "start: calls"
    elif otherwise == "text":
        start = f"start: calls | TEXT\nTEXT: /(.|\\n)+/ & ~/{re.escape(TOOL_CALL_OPEN.strip())}(.|\\n)*/"
    else:
        start = f"start: calls | answer\nanswer: %json {json.dumps({**otherwise, 'x-guidance': COMPACT_JSON})}"
    built = LLMatcher.grammar_from_lark("\n".join([start, *rules]) + "\n")
    check(built)
    return built
