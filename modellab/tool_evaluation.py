"""`kevlaya eval-tools`: which function Kev and Laya call, with what arguments, on held-out tool requests in plain
words (modellab/tool_questions.py), through the worker's slot decoder under the tools' grammar the server enforces.

Each request becomes the job the chat API would store for it (the request as the user's message, its tools,
`tool_choice` and `parallel_tool_calls`), and its generation request is built by the worker's own code
(`worker/ledger/settle.py` `generation_request`): the role's system prompt with the tools block, the grammar of
`shared/schemas.py` `answer_grammar`. Decoding is greedy, so results repeat. An `auto` job with tools takes Laya's
answer (it is never escalated), so `auto` scores as Laya.

Per role and per `tool_choice` (auto, required, named, and all together):
- right function: of the requests that call for calls, the share whose calls name exactly the gold functions;
- exact arguments: the share whose calls are exactly the gold calls (name and arguments; parallel calls in any
  order);
- valid arguments: of the answers that made calls, the share whose every call names an offered function with
  arguments valid under its schema (jsonschema, formats checked): the grammar's guarantee, checked independently;
- no call: of the requests no offered tool answers (`auto`), the share answered without a call;
- right: right function, or no call where none was due, over all requests.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from modellab.evaluation import slot_decoder
from modellab.training.data import ToolsFieldError, tool_job_params
from shared.models import Job, Priority
from shared.settings import Settings
from shared.tools import leading_calls, offered_functions
from worker.engine.offline import run_to_end
from worker.generation import GenerationRequest, GenerationResult
from worker.ledger.settle import generation_request
from worker.model.loading import LoadedModel

if TYPE_CHECKING:
    from worker.decoder.slot_decoder import SlotDecoder

ROLES = ("laya", "kev")
CHOICES = ("auto", "required", "named")
# A client's max_tokens for these jobs: the longest gold answer (two calls) is under 160 SmolLM2 tokens, and a
# role's own default (Kev's 512) would leave a tools prompt no room in the default 1,024-token window.
MAX_NEW_TOKENS = 256


@dataclass(frozen=True)
class ToolItem:
    """One held-out request: its id, its words, the job params the API stores for it (its `tools` field checked
    and turned by `tool_job_params`) and the gold calls (empty: no call)."""

    id: str
    request: str
    params: dict[str, Any]
    calls: list[tuple[str, dict[str, Any]]]

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> ToolItem:
        return cls(str(row["id"]), str(row["request"]), tool_job_params(row["tools"]),
                   [(str(call["name"]), dict(call["arguments"])) for call in row["calls"]])

    @property
    def choice(self) -> str:
        choice = self.params.get("tool_choice") or "auto"
        return "named" if isinstance(choice, dict) else choice


def load_tool_items(path: Path, limit: int | None = None) -> list[ToolItem]:
    """The first `limit` (all: None) rows of a tool questions JSONL (`kevlaya models prose-data` writes
    `test_tool_questions.jsonl`). Raises ValueError naming the file and line of the first row that is not one."""
    items: list[ToolItem] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if limit is not None and len(items) == limit:
            break
        if not line.strip():
            continue
        try:
            items.append(ToolItem.from_row(json.loads(line)))
        except (ValueError, KeyError, TypeError) as exc:  # ToolsFieldError is a ValueError
            why = str(exc) if isinstance(exc, ToolsFieldError) else f"{exc.__class__.__name__}: {exc}"
            raise ValueError(f"{path}:{number}: not a tool question row (a JSON object with `id`, `request`, "
                             f"`tools` and `calls`): {why}") from exc
    if not items:
        raise ValueError(f"{path}: no tool questions")
    return items


# -- scoring -------------------------------------------------------------------------------------------------------


def _same_calls(made: list[tuple[str, dict[str, Any]]], gold: list[tuple[str, dict[str, Any]]]) -> bool:
    """The same calls in any order (each gold call matched once; 25 and 25.0 are the same number)."""
    left = list(made)
    for call in gold:
        if call not in left:
            return False
        left.remove(call)
    return not left


def _valid(calls: list[tuple[str, dict[str, Any]]], params: dict[str, Any]) -> bool:
    """Every call names a function offered (tool_choice's one, where it names one) with arguments valid under its
    schema, formats included."""
    import jsonschema  # the evaluation's own check, independent of the grammar that wrote the calls

    functions = offered_functions(params)
    checker = jsonschema.FormatChecker()
    for name, arguments in calls:
        if name not in functions:
            return False
        try:
            jsonschema.validate(arguments, functions[name], format_checker=checker)
        except jsonschema.ValidationError:
            return False
    return True


def score_answer(item: ToolItem, text: str) -> dict[str, Any]:
    """How an answer's text does on `item`: the calls it opens with, and each score (None where it does not
    apply: right function and exact arguments for a request that calls for calls, no call for one that does not,
    valid arguments for an answer with calls)."""
    calls, _ = leading_calls(text)
    expects_calls = bool(item.calls)
    right_function = sorted(n for n, _ in calls) == sorted(n for n, _ in item.calls) if expects_calls else None
    no_call = None if expects_calls else not calls
    return {
        "calls": [{"name": name, "arguments": arguments} for name, arguments in calls],
        "right_function": right_function,
        "exact_arguments": _same_calls(calls, item.calls) if expects_calls else None,
        "valid_arguments": _valid(calls, item.params) if calls else None,
        "no_call": no_call,
        "right": bool(right_function if expects_calls else no_call),
    }


@dataclass
class ToolAnswer:
    """One request answered by one role."""

    id: str
    choice: str  # auto, required or named
    expected: list[dict[str, Any]]  # the gold calls
    calls: list[dict[str, Any]]  # the calls the answer opens with
    text: str
    right: bool
    right_function: bool | None
    exact_arguments: bool | None
    valid_arguments: bool | None
    no_call: bool | None
    finish_reason: str
    error_code: str | None
    completion_tokens: int
    latency_ms: float


def _share(values: list[bool | None]) -> float | None:
    counted = [v for v in values if v is not None]
    return sum(counted) / len(counted) if counted else None


def summarize(answers: list[ToolAnswer]) -> dict[str, Any]:
    """The scores of a group of answers (shares over the answers each applies to; None where none does)."""
    return {
        "n": len(answers),
        "calls_expected": sum(bool(a.expected) for a in answers),
        "right": _share([a.right for a in answers]),
        "right_function": _share([a.right_function for a in answers]),
        "exact_arguments": _share([a.exact_arguments for a in answers]),
        "valid_arguments": _share([a.valid_arguments for a in answers]),
        "no_call": _share([a.no_call for a in answers]),
        "failures": dict(Counter(a.error_code or "length" for a in answers
                                 if a.error_code or a.finish_reason == "length")),
        "mean_completion_tokens": statistics.fmean(a.completion_tokens for a in answers),
        "mean_latency_ms": statistics.fmean(a.latency_ms for a in answers),
    }


def by_choice(answers: list[ToolAnswer]) -> dict[str, dict[str, Any]]:
    """`all`, then each tool_choice the answers have."""
    groups = {"all": answers, **{c: [a for a in answers if a.choice == c] for c in CHOICES}}
    return {name: summarize(group) for name, group in groups.items() if group}


# -- running -------------------------------------------------------------------------------------------------------


def tool_request(item: ToolItem, role: str, settings: Settings, max_new_tokens: int) -> GenerationRequest:
    """The worker's generation request for the job the chat API would store for `item` (greedy)."""
    job = Job(id=uuid.uuid4(), adapter=role, requested_adapter=role, priority=Priority.INTERACTIVE,
              input={"messages": [{"role": "user", "content": item.request}]},
              params={**item.params, "max_new_tokens": max_new_tokens, "temperature": 0.0})
    return generation_request(job, settings)


def answer_items(role: str, items: list[ToolItem], settings: Settings,
                 run: Callable[[list[GenerationRequest]], list[GenerationResult]], batch_size: int,
                 max_new_tokens: int = MAX_NEW_TOKENS, progress: bool = True) -> list[ToolAnswer]:
    """Every item answered by `role` through `run`, `batch_size` at a time (a batch's wall time is the latency of
    each job in it), and scored."""
    requests = [tool_request(item, role, settings, max_new_tokens) for item in items]
    answers: list[ToolAnswer] = []
    for start in tqdm(range(0, len(items), batch_size), desc=f"eval-tools {role}", unit="batch",
                      disable=not progress):
        began = time.perf_counter()
        results = run(requests[start:start + batch_size])
        latency_ms = (time.perf_counter() - began) * 1000
        for item, result in zip(items[start:start + batch_size], results, strict=True):
            text = result.text or ""
            answers.append(ToolAnswer(
                id=item.id, choice=item.choice,
                expected=[{"name": name, "arguments": arguments} for name, arguments in item.calls], text=text,
                **score_answer(item, text), finish_reason=result.finish_reason, error_code=result.error_code,
                completion_tokens=result.completion_tokens, latency_ms=latency_ms))
    return answers


def run_fitting(loaded: LoadedModel, decoder: SlotDecoder, requests: list[GenerationRequest],
                prefill_tokens: int | None) -> list[GenerationResult]:
    """The requests run to the end, except those the worker would fail alone (`invalid_input`: a prompt that
    cannot be encoded, or with max_new_tokens over the decoder's window), as its engine checks them."""
    results: dict[uuid.UUID, GenerationResult] = {}
    fitting = []
    for request in requests:
        tokens, problem = loaded.check(request)
        if problem is None and not decoder.fits(tokens, request.max_new_tokens):
            problem = (f"the prompt is {tokens} tokens; with max_new_tokens {request.max_new_tokens} that is over "
                       f"the window of {decoder.window} tokens (KEVLAYA_ENGINE__WINDOW_TOKENS)")
        if problem is None:
            fitting.append(request)
        else:
            results[request.job_id] = GenerationResult(
                job_id=request.job_id, text="", prompt_tokens=tokens, completion_tokens=0, prefill_ms=0.0,
                decode_ms=0.0, error_code="invalid_input", error_message=problem)
    if fitting:
        results.update((r.job_id, r) for r in run_to_end(decoder, fitting, prefill_tokens=prefill_tokens))
    return [results[request.job_id] for request in requests]


def run_tool_evaluation(loaded: LoadedModel, settings: Settings, items: list[ToolItem],
                        roles: tuple[str, ...] = ROLES, batch_size: int = 1,
                        max_new_tokens: int = MAX_NEW_TOKENS, progress: bool = True) -> dict[str, Any]:
    """Each role's answers to `items` through the worker's decoder, scored per tool_choice."""
    answers: dict[str, list[ToolAnswer]] = {}
    for role in roles:
        decoder = slot_decoder(loaded, settings, batch_size)
        try:
            def run(chunk: list[GenerationRequest]) -> list[GenerationResult]:
                return run_fitting(loaded, decoder, chunk, settings.engine.prefill_tokens)

            answers[role] = answer_items(role, items, settings, run, batch_size, max_new_tokens, progress)
        finally:
            decoder.close()
    return {
        "questions": len(items),
        "batch_size": batch_size,
        "max_new_tokens": max_new_tokens,
        "device": loaded.device,
        "roles": {role: by_choice(role_answers) for role, role_answers in answers.items()},
        "answers": {role: [asdict(a) for a in role_answers] for role, role_answers in answers.items()},
    }


def table(report: dict[str, Any]) -> str:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.1%}"

    lines = [f"{'role':<5} {'tool_choice':<11} {'n':>5} {'right':>7} {'function':>9} {'arguments':>10} "
             f"{'valid':>7} {'no call':>8} {'tokens':>7}  failures"]
    for role, groups in report["roles"].items():
        for choice, r in groups.items():
            failures = ", ".join(f"{code} {n}" for code, n in r["failures"].items()) or "-"
            lines.append(f"{role:<5} {choice:<11} {r['n']:>5} {cell(r['right']):>7} {cell(r['right_function']):>9} "
                         f"{cell(r['exact_arguments']):>10} {cell(r['valid_arguments']):>7} "
                         f"{cell(r['no_call']):>8} {r['mean_completion_tokens']:>7.1f}  {failures}")
    return "\n".join(lines)
