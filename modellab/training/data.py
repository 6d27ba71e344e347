"""Training data: JSONL validation with line numbers, chat-format encoding (with a record's function tools as the
server puts them in the system prompt), overlong filter, label balancing."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase

from modellab.training.config import IGNORE_INDEX, DataError
from shared.decision import offered_options
from shared.grammar import MAX_TOOL_CALLS, TOOL_CALL_OPEN
from shared.schemas import JobParams, model_messages
from shared.tools import leading_calls, offered_functions

log = logging.getLogger("kevlaya.training")


@dataclass(frozen=True)
class Sample:
    prompt: str
    completion: str
    label: str | None
    line: int
    tools: dict[str, Any] | None = None  # the job params of a request offering tools (`tool_job_params`)


TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")


class ToolsFieldError(ValueError):
    """A record's `tools` field the API would refuse, naming the part at fault (`tools.tools.0.function.name`)."""

    def __init__(self, field: str, message: str):
        super().__init__(f'field "{field}": {message}')


def tool_job_params(value: Any) -> dict[str, Any]:
    """A record's `tools` field (`{"tools", "tool_choice"?, "parallel_tool_calls"?}`, a chat request's tool
    fields) as the job params the API stores for such a request (output `tool_calls`): what the worker builds the
    prompt and the grammar from. Checked as the API checks them; ToolsFieldError names the part at fault."""
    if not isinstance(value, dict):
        raise ToolsFieldError("tools", f"must be an object {{tools, tool_choice?, parallel_tool_calls?}}, not "
                              f"{type(value).__name__}")
    if unknown := sorted(set(value) - set(TOOL_FIELDS)):
        raise ToolsFieldError(f"tools.{unknown[0]}", f"not a tool field (only {', '.join(TOOL_FIELDS)})")
    if "tools" not in value:
        raise ToolsFieldError("tools.tools", "is missing")
    try:
        params = JobParams.model_validate({"output": "tool_calls", **value})
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise ToolsFieldError(f"tools.{where}" if where else "tools", error["msg"]) from None
    return params.model_dump(exclude_none=True)


def _tool_completion_problem(completion: str, params: dict[str, Any]) -> str | None:
    """Why a completion is no answer the tools' grammar would let the model write, or None: calls naming offered
    functions (one at most without parallel calls), calls alone where tool_choice forces one."""
    calls, end = leading_calls(completion)
    forced = (params.get("tool_choice") or "auto") != "auto"
    if not calls and forced:
        return "tool_choice forces a call: the completion must be calls in the wire format"
    if not calls:  # text, which may not open a call
        return "opens a call it does not complete" if completion.startswith(TOOL_CALL_OPEN.strip()) else None
    if end != len(completion):
        return "must be calls alone in the wire format (shared/tools.py call_text), nothing after them"
    offered = offered_functions(params)
    if stray := [name for name, _ in calls if name not in offered]:
        return f"calls {stray[0]!r}, which tool_choice and tools do not offer"
    most = MAX_TOOL_CALLS if params.get("parallel_tool_calls") is not False else 1
    if len(calls) > most:
        return f"makes {len(calls)} calls; at most {most} here"
    return None


def _field_problem(record: dict[str, Any], name: str, required: bool) -> str | None:
    if name not in record:
        return f'field "{name}" is missing' if required else None
    value = record[name]
    if not isinstance(value, str):
        return f'field "{name}" must be a string, not {type(value).__name__}'
    if not value.strip():
        return f'field "{name}" is empty'
    return None


def read_samples(path: Path) -> list[Sample]:
    """Every record of a JSONL file `{"prompt", "completion", "label"?, "tools"?}`; raises DataError listing all
    problems. `tools` (a chat request's `tools`, `tool_choice` and `parallel_tool_calls`) is checked as the API
    checks them, and the completion against it (calls of offered functions, calls alone where a call is forced).

    Lines are decoded one by one, so a bad byte is reported on its own line rather than failing the file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(path, [f"{path}: cannot be read ({exc.strerror or exc})"]) from exc
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the final newline ends the last record; it does not start an empty one
    samples: list[Sample] = []
    problems: list[str] = []
    for number, raw_line in enumerate(lines, start=1):
        where = f"{path}:{number}"
        try:
            text = raw_line.removesuffix(b"\r").decode("utf-8")
        except UnicodeDecodeError as exc:
            problems.append(f"{where}: not valid UTF-8 (bad byte at column {exc.start + 1})")
            continue
        if not text.strip():
            problems.append(f"{where}: empty line")
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            problems.append(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})")
            continue
        if not isinstance(record, dict):
            problems.append(f"{where}: expected a JSON object, got {type(record).__name__}")
            continue
        found = [p for name, required in (("prompt", True), ("completion", True), ("label", False))
                 if (p := _field_problem(record, name, required))]
        tools = None
        if "tools" in record:
            try:
                tools = tool_job_params(record["tools"])
            except ToolsFieldError as exc:
                found.append(str(exc))
            else:
                if not found and (problem := _tool_completion_problem(record["completion"], tools)):
                    found.append(f'field "completion": {problem}')
        problems.extend(f"{where}: {p}" for p in found)
        if not found:
            samples.append(Sample(record["prompt"], record["completion"], record.get("label"), number, tools))
    if not samples and not problems:
        problems.append(f"{path}: no records")
    if problems:
        raise DataError(path, problems)
    return samples


def chat_messages(system_prompt: str, prompt: str, tools: dict[str, Any] | None = None) -> list[dict[str, str]]:
    """The role's system prompt, then the prompt. With `tools` (job params, `tool_job_params`) the messages the
    worker builds for such a job (shared/schemas.py `model_messages`: the tools block after the system prompt)."""
    if tools is not None:
        return model_messages(prompt, tools, system_prompt)
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": prompt}]


@dataclass(frozen=True)
class Encoded:
    input_ids: list[int]
    labels: list[int]  # IGNORE_INDEX over the prompt, the token ids over the completion and its EOS
    label: str | None  # the class it is balanced in (`balance_class`)


def balance_class(prompt: str, label: str | None) -> str | None:
    """An offered option is balanced by its place on the prompt's `Options:` line, as the letter of that place,
    so the named options of plain-word questions share the classes of the scenario format's letters (which map
    to themselves); any other label ("none") is its own class."""
    offered = offered_options(prompt) if label is not None else None
    if offered and label in offered and offered.index(label) < 26:
        return chr(ord("A") + offered.index(label))
    return label


def encode_samples(tokenizer: PreTrainedTokenizerBase, samples: Sequence[Sample], system_prompt: str,
                   chunk: int = 1024) -> list[Encoded]:
    """Token ids exactly as served: the chat template with the generation prompt (and a sample's tools in the
    system message, as the worker puts them), then completion + EOS."""
    encoded: list[Encoded] = []
    for start in range(0, len(samples), chunk):
        part = samples[start:start + chunk]
        prompts = tokenizer.apply_chat_template(
            [chat_messages(system_prompt, s.prompt, s.tools) for s in part], add_generation_prompt=True, tokenize=True,
            return_dict=True, sanitize_control_tokens=True,
        )["input_ids"]
        completions = tokenizer([s.completion for s in part], add_special_tokens=False)["input_ids"]
        for sample, prompt_ids, completion_ids in zip(part, prompts, completions, strict=True):
            target = [*completion_ids, tokenizer.eos_token_id]
            encoded.append(Encoded([*prompt_ids, *target], [IGNORE_INDEX] * len(prompt_ids) + target,
                                   balance_class(sample.prompt, sample.label)))
    return encoded


def balance_by_label(examples: list[Encoded], seed: int) -> tuple[list[Encoded], dict[str, int], dict[str, int]]:
    """Oversample every label up to the most frequent one's count; returns (examples, counts before, after).

    Each minority label is repeated whole as often as fits, the remainder drawn without replacement, so no
    example is repeated twice more than another of its label. Unlabelled data is returned unchanged."""
    groups: dict[str, list[Encoded]] = {}
    for example in examples:
        groups.setdefault(example.label if example.label is not None else "", []).append(example)
    before = {label: len(group) for label, group in sorted(groups.items())}
    if "" in groups:
        if len(groups) > 1:
            log.warning("%d sample(s) have no label: not balancing by label", len(groups[""]))
        return examples, before, dict(before)
    rng = random.Random(seed)
    target = max(before.values())
    balanced: list[Encoded] = []
    for label in sorted(groups):
        group = groups[label]
        whole, rest = divmod(target, len(group))
        balanced.extend(group * whole)
        balanced.extend(rng.sample(group, rest))
    after = {label: target for label in sorted(groups)}
    return balanced, before, after


def _collate(examples: Sequence[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors: training reads whole sequences, so padding after the text needs no position care."""
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[row, :n] = torch.tensor(e.input_ids)
        labels[row, :n] = torch.tensor(e.labels)
        attention[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


# Batches are formed among this many batches' worth of shuffled examples, each of similar lengths.
LENGTH_GROUP_BATCHES = 32


def example_batches(examples: list[Encoded], batch_size: int, pad_id: int,
                    generator: torch.Generator) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches, every example once an epoch, reshuffled every epoch by the seeded generator.

    A batch is padded to its longest sample, so each is cut from examples of similar length: the epoch's
    shuffled order is sorted by length within groups of LENGTH_GROUP_BATCHES batches, and the batches are then
    shuffled again, so lengths do not follow one another through the epoch."""
    while True:
        order = torch.randperm(len(examples), generator=generator).tolist()
        group = batch_size * LENGTH_GROUP_BATCHES
        batches: list[list[int]] = []
        for start in range(0, len(order), group):
            by_length = sorted(order[start:start + group], key=lambda i: len(examples[i].input_ids))
            batches.extend(by_length[at:at + batch_size] for at in range(0, len(by_length), batch_size))
        for index in torch.randperm(len(batches), generator=generator).tolist():
            yield _collate([examples[i] for i in batches[index]], pad_id)


def block_batches(blocks: torch.Tensor, batch_size: int,
                   generator: torch.Generator) -> Iterator[dict[str, torch.Tensor]]:
    while True:
        order = torch.randperm(len(blocks), generator=generator)
        for start in range(0, len(order), batch_size):
            chunk = blocks[order[start:start + batch_size]]
            yield {"input_ids": chunk, "attention_mask": torch.ones_like(chunk), "labels": chunk}
