"""Is every `tool_choice` mode enforced? Sends `--calls` chat completions per mode (`auto`, `none`, `required`, and a
named function, each of the tools named in turn) through the official `openai` SDK to a running service, offering
the same four function tools of varied JSON schemas (enums, a nested object, bounded integers, a bounded array,
a pattern, required and optional fields), and checks each answer:

- `required` and named: finish_reason `tool_calls`, no content, one or more calls, each naming a function offered
  (the named one when named) with arguments that are a JSON object valid under that function's schema (jsonschema);
- `none`: no tool call, the content a string;
- `auto`: either such calls, or text that does not open a call (a call cut short and handed back as text fails).

Writes the per-mode counts, the failures (the first few of each mode, whole), the exact command and the machine to
`--out`; exits 1 when any answer failed.

    python -m modellab.tool_choice_check --base-url http://127.0.0.1:8000/v1 --api-key "$KEY" --calls 200 \
        --model laya --out results.json

`--open-schemas` leaves `additionalProperties` out of the tools' object schemas (as LangChain's function tools and
most hand-written schemas do): JSON Schema then admits any extra key, and so does the grammar.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

# -- the tools ------------------------------------------------------------------------------------------------------

# Compact (the tools are in the system prompt), and every string, number and array bounded, so that no valid call
# is longer than about 140 bytes: 8 calls fit in 1,200 tokens on a tokenizer of a token a byte.
WEATHER = {"type": "object",
           "properties": {"city": {"enum": ["Paris", "Rome", "Oslo", "Lima"]}, "unit": {"enum": ["C", "F"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit"], "additionalProperties": False}
BOOKING = {"type": "object",
           "properties": {"place": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                          "party": {"type": "integer", "minimum": 1, "maximum": 12},
                          "at": {"type": "object",
                                 "properties": {"day": {"enum": ["fri", "sat", "sun"]},
                                                "hour": {"type": "integer", "minimum": 11, "maximum": 23}},
                                 "required": ["day", "hour"], "additionalProperties": False}},
           "required": ["place", "party", "at"], "additionalProperties": False}
PAYMENT = {"type": "object",
           "properties": {"cents": {"type": "integer", "minimum": 1, "maximum": 99999}, "cur": {"enum": ["EUR", "USD"]},
                          "urgent": {"type": "boolean"}},
           "required": ["cents", "cur", "urgent"], "additionalProperties": False}
TICKET = {"type": "object",
          "properties": {"title": {"type": "string", "minLength": 1, "maxLength": 8},
                         "tags": {"type": "array", "items": {"enum": ["bug", "ui"]}, "maxItems": 2}},
          "required": ["title"], "additionalProperties": False}
FUNCTIONS = {
    "weather": ("Forecast.", WEATHER),
    "book": ("Book a table.", BOOKING),
    "pay": ("Pay the payee.", PAYMENT),
    "ticket": ("File an issue.", TICKET),
}
PROMPTS = [
    "What will the weather be in Oslo for the next three days?",
    "Book a table for four at Chez Anna on Friday at 20:30.",
    "Send 25 euros to my landlord, it is urgent.",
    "The login button does nothing on mobile, please file it.",
    "Is it warm in Lima right now, in fahrenheit?",
    "Dinner for two on Sunday, 19:00, at Luigi, please.",
    "Pay the plumber 140 dollars, not urgent.",
    "Hello! What can you do for me?",
]
MODES = ("auto", "none", "required", "named")


def open_schema(schema: Any) -> Any:
    """`schema` without `additionalProperties` anywhere."""
    if isinstance(schema, dict):
        return {key: open_schema(value) for key, value in schema.items() if key != "additionalProperties"}
    if isinstance(schema, list):
        return [open_schema(item) for item in schema]
    return schema


def tools(open_schemas: bool = False) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": name, "description": description,
                                              "parameters": open_schema(schema) if open_schemas
                                              else copy.deepcopy(schema)}}
            for name, (description, schema) in FUNCTIONS.items()]


# -- one answer's check ---------------------------------------------------------------------------------------------

CALL_MARKUP = "<tool_call>"  # the service's own wire format for a call (shared/grammar.py): never a client's text


def call_problems(choice: Any, schemas: dict[str, dict[str, Any]], named: str | None) -> list[str]:
    """What is wrong with an answer of calls (empty: nothing)."""
    import jsonschema

    problems = []
    if choice.finish_reason != "tool_calls":
        problems.append(f"finish_reason {choice.finish_reason!r}, not 'tool_calls'")
    if choice.message.content not in (None, ""):
        problems.append(f"content beside the calls: {choice.message.content[:200]!r}")
    for call in choice.message.tool_calls or []:
        name = call.function.name
        if name not in schemas:
            problems.append(f"calls {name!r}, not a function offered")
            continue
        if named is not None and name != named:
            problems.append(f"calls {name!r}, not the named {named!r}")
        try:
            arguments = json.loads(call.function.arguments)
            jsonschema.validate(arguments, schemas[name])
        except (ValueError, jsonschema.ValidationError) as exc:
            problems.append(f"{name} arguments {call.function.arguments[:200]!r}: {str(exc).splitlines()[0]}")
    return problems


def check_answer(mode: str, answer: Any, schemas: dict[str, dict[str, Any]], named: str | None) -> dict[str, Any]:
    """The answer's verdict: `ok`, its kind (`calls` or `text`), the problems, and what it held."""
    choice = answer.choices[0]
    calls = choice.message.tool_calls or []
    verdict = {"finish_reason": choice.finish_reason, "calls": [c.function.name for c in calls],
               "completion_tokens": answer.usage.completion_tokens if answer.usage else None}
    if calls:
        verdict["kind"] = "calls"
        problems = call_problems(choice, schemas, named)
        if mode == "none":
            problems.insert(0, "a tool call under tool_choice 'none'")
    else:
        verdict["kind"] = "text"
        content = choice.message.content
        if mode in ("required", "named"):
            problems = [f"no tool call (finish_reason {choice.finish_reason!r}, content {str(content)[:200]!r})"]
        elif not isinstance(content, str):
            problems = [f"content {content!r} is not text"]
        elif content.lstrip().startswith(CALL_MARKUP):
            problems = [f"a call cut short, handed back as text (finish_reason {choice.finish_reason!r}): "
                        f"{content[:200]!r}"]
        else:
            problems = []
    verdict["ok"], verdict["problems"] = not problems, problems
    return verdict


# -- the run --------------------------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "cores": usable, "system": platform.platform(), "python": platform.python_version()}


def run_checks(base_url: str, api_key: str, calls: int, model: str, modes: list[str], max_tokens: int,
               temperature: float, concurrency: int, open_schemas: bool, timeout_s: float,
               echo: Any = print) -> dict[str, Any]:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s)
    offered = tools(open_schemas)
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in offered}
    names = list(schemas)

    def one(mode: str, i: int) -> dict[str, Any]:
        named = names[i % len(names)] if mode == "named" else None
        choice = {"type": "function", "function": {"name": named}} if named else mode
        started = time.perf_counter()
        try:
            answer = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], tools=offered,
                tool_choice=choice, max_tokens=max_tokens, temperature=temperature, seed=i)
        except openai.OpenAIError as exc:
            return {"ok": False, "kind": "error", "problems": [f"{type(exc).__name__}: {str(exc)[:300]}"],
                    "calls": [], "finish_reason": None, "seconds": time.perf_counter() - started}
        verdict = check_answer(mode, answer, schemas, named)
        verdict["seconds"] = time.perf_counter() - started
        if not verdict["ok"]:  # the whole answer, to see what went wrong
            verdict["answer"] = answer.model_dump(mode="json", exclude={"usage"})
        return verdict

    per_mode: dict[str, Any] = {}
    with ThreadPoolExecutor(concurrency) as pool:
        for mode in modes:
            started = time.perf_counter()
            verdicts = list(pool.map(lambda i: one(mode, i), range(calls)))  # noqa: B023
            wall = time.perf_counter() - started
            valid = sum(v["ok"] for v in verdicts)
            per_mode[mode] = {
                "calls": calls, "valid": valid, "invalid": calls - valid, "valid_percent": round(100 * valid / calls, 2),
                "answers": dict(Counter(v["kind"] for v in verdicts)),
                "finish_reasons": dict(Counter(str(v["finish_reason"]) for v in verdicts)),
                "functions_called": dict(Counter(name for v in verdicts for name in v["calls"])),
                "calls_per_answer": {str(k): n for k, n in sorted(Counter(len(v["calls"]) for v in verdicts).items())},
                "completion_tokens_max": max((v.get("completion_tokens") or 0 for v in verdicts), default=0),
                "latency_s": {"median": round(statistics.median(v["seconds"] for v in verdicts), 3),
                              "max": round(max(v["seconds"] for v in verdicts), 3)},
                "wall_s": round(wall, 1),
                "failures": [{"call": i, **{k: v[k] for k in ("kind", "problems", "answer") if k in v}}
                             for i, v in enumerate(verdicts) if not v["ok"]][:5],
            }
            echo(f"{mode:>8}: {valid}/{calls} valid ({per_mode[mode]['valid_percent']} %), "
                 f"answers {per_mode[mode]['answers']}, finish {per_mode[mode]['finish_reasons']}, {wall:.0f} s")
    return {"tools": offered, "modes": per_mode}


def main(
    base_url: Annotated[str, typer.Option(help="the service's OpenAI base URL")] = "http://127.0.0.1:8000/v1",
    api_key: Annotated[Optional[str], typer.Option(
        envvar="KEVLAYA_API__KEY", show_envvar=True, help="an API key (default: KEVLAYA_API__KEY, else the one "
        "`kevlaya run` keeps in .kevlaya/api_key)")] = None,
    calls: Annotated[int, typer.Option(min=1, help="chat completions per mode")] = 200,
    model: Annotated[str, typer.Option(help="the model asked for: laya, kev or auto")] = "laya",
    modes: Annotated[str, typer.Option(help="comma-separated, of auto, none, required, named")] = ",".join(MODES),
    max_tokens: Annotated[int, typer.Option(min=1, help="max_tokens of each call: enough for the most calls an "
                                            "answer may hold (8) on the model's tokenizer")] = 512,
    temperature: Annotated[float, typer.Option(min=0, max=2, help="each call's temperature; its seed is its "
                                               "number, so a run repeats")] = 1.0,
    concurrency: Annotated[int, typer.Option(min=1, help="calls in flight at once")] = 8,
    open_schemas: Annotated[bool, typer.Option(help="leave additionalProperties out of the tools' schemas")] = False,
    timeout_s: Annotated[float, typer.Option(help="each call's client timeout")] = 300.0,
    label: Annotated[Optional[str], typer.Option(help="what is served (the base model, the machine), kept in "
                                                 "the results")] = None,
    out: Annotated[Optional[Path], typer.Option(help="write the results here as JSON")] = None,
) -> None:
    """Send --calls chat completions per tool_choice mode and check each answer; exit 1 if any failed."""
    chosen = [mode.strip() for mode in modes.split(",") if mode.strip()]
    if not chosen or set(chosen) - set(MODES):
        raise typer.BadParameter(f"a comma-separated list of {', '.join(MODES)}", param_hint="--modes")
    if api_key is None:
        kept = Path(".kevlaya/api_key")
        if not kept.is_file():
            raise typer.BadParameter("no key: pass --api-key or set KEVLAYA_API__KEY", param_hint="--api-key")
        api_key = kept.read_text().strip()
    import openai

    started = datetime.now(timezone.utc)
    results = run_checks(base_url, api_key, calls, model, chosen, max_tokens, temperature, concurrency,
                         open_schemas, timeout_s, echo=typer.echo)
    report = {
        "command": shlex.join(["python", "-m", "modellab.tool_choice_check", *_masked(sys.argv[1:])]),
        "started": started.isoformat(timespec="seconds"), "base_url": base_url, "model": model, "label": label,
        "calls_per_mode": calls, "max_tokens": max_tokens, "temperature": temperature, "concurrency": concurrency,
        "open_schemas": open_schemas, "client_machine": machine(), "openai_sdk": openai.__version__,
        "all_valid": all(m["invalid"] == 0 for m in results["modes"].values()),
        **results,
    }
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    if not report["all_valid"]:
        raise typer.Exit(1)


def _masked(args: list[str]) -> list[str]:
    """The command line with the key's value HIDDEN."""
    masked, hide = [], False
    for arg in args:
        masked.append("HIDDEN" if hide else "--api-key=HIDDEN" if arg.startswith("--api-key=") else arg)
        hide = arg == "--api-key"
    return masked


if __name__ == "__main__":
    typer.run(main)
