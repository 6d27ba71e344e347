"""Tool-use requests in plain words (modellab/tool_questions.py) and what is built on them: the generator is
repeatable, its splits share no tool domain and no held-out phrasing, and every gold call is valid under its tool's
schema and said in the request; a training record reads back and renders exactly the prompt the API and worker
build for the same chat request; a bad `tools` field is refused naming its line and field; the scoring of
`kevlaya eval-tools`, and the command end to end on the tiny model."""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch
from transformers import AutoTokenizer

from api.jobs.submission import new_job
from api.openai.chat.schemas import ChatRequest
from modellab import tool_questions as tq
from modellab.prose_questions import write_dataset
from modellab.tool_evaluation import ToolAnswer, ToolItem, by_choice, load_tool_items, score_answer
from modellab.training import IGNORE_INDEX, DataError, encode_samples, read_samples
from shared.grammar import TOOL_CALL_SEPARATOR
from shared.models import ApiKey
from shared.schemas import answer_grammar, model_messages
from shared.settings import DEMO_MODEL_DIR, get_settings
from shared.tools import call_text, offered_functions
from worker.ledger.settle import generation_request
from worker.model.tokens import encode_chats

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def train() -> list[tq.ToolQuestion]:
    return list(tq.questions(1500, seed=5, split="train"))


@pytest.fixture(scope="module")
def test() -> list[tq.ToolQuestion]:
    return list(tq.questions(400, seed=5, split="test"))


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR / "base")


def choice_of(q: tq.ToolQuestion) -> str:
    return "named" if isinstance(q.tool_choice, dict) else q.tool_choice


# -- the generator -------------------------------------------------------------------------------------------------


def test_the_generator_is_repeatable_per_seed_and_differs_between_seeds():
    def items(seed: int) -> list[tuple]:
        return [(q.request, q.params, q.completion, q.label) for q in tq.questions(200, seed=seed, split="train")]

    assert items(7) == items(7)
    assert items(7) != items(8)
    assert [q.request for q in tq.questions(50, 7, "test")] == [q.request for q in tq.questions(50, 7, "test")]


def test_train_and_test_share_no_tool_domain_and_no_held_out_phrasing(train, test):
    assert all(not q.domains & tq.HELD_OUT_DOMAINS for q in train)
    assert all(q.domains <= tq.HELD_OUT_DOMAINS for q in test)
    assert not {f.name for q in train for f in q.functions} & {f.name for q in test for f in q.functions}
    held_out = {text for pool in (tq.OPENERS, tq.CLOSERS, tq.ASIDES, tq.DATES, tq.TIMES, tq.TIMES_ON_THE_HOUR,
                                  tq.TIMES_AT_HALF_PAST, tq.MONEY, tq.JOINS) for text in pool.held_out}
    assert not any(set(q.phrasings) & held_out for q in train)
    assert sum(bool(set(q.phrasings) & held_out) for q in test) > len(test) / 4  # about half of each pool's picks
    # the requests no tool answers are split too, and no test request is a training one
    assert not any(chat in q.request for q in train for chat in tq.CHAT["test"])
    assert any(chat in q.request for q in test for chat in tq.CHAT["test"])
    assert not {q.request for q in test} & {q.request for q in train}


def test_the_mix_has_every_tool_choice_parallel_calls_no_call_and_two_to_five_tools(train):
    choices = [choice_of(q) for q in train]
    assert choices.count("auto") > len(train) / 2 and choices.count("required") > 100 and choices.count("named") > 80
    assert 0.05 < sum(not q.calls for q in train) / len(train) < 0.2
    assert all(choice_of(q) == "auto" for q in train if not q.calls)  # "no call" only where text is allowed
    assert sum(len(q.calls) == 2 for q in train) > 50
    assert {len(q.functions) for q in train} == {2, 3, 4, 5}
    assert {q.parallel_tool_calls for q in train} == {None, True, False}
    assert {q.label for q in train} <= {*"ABCDE", "none"}


def _said(value: object, request: str) -> bool:
    """A number as the request may say it: digits (with a thousands comma or cents) or words."""
    forms = {str(value), f"{value:,}", f"{value:.2f}"} if isinstance(value, (int, float)) else {str(value)}
    if isinstance(value, int) and value < 10_000:
        forms.add(tq.in_words(value))
    forms |= {1: {"just for me", "for myself"}, 2: {"the two of us"}}.get(value, set())  # people counted by words
    return any(re.search(rf"(?<![\w.]){re.escape(form)}(?![\w])", request) for form in forms)


def test_every_gold_call_is_valid_under_its_tools_schema_and_taken_from_the_request(train, test):
    checker = jsonschema.FormatChecker()
    durations = {"minutes", "duration_minutes", "max_minutes", "days", "nights"}  # "an hour and a half", "a week"
    for q in train + test:
        offered = offered_functions({"output": "tool_calls", **q.params})
        if choice_of(q) != "auto":
            assert q.calls
        if q.parallel_tool_calls is False:
            assert len(q.calls) <= 1
        for name, arguments in q.calls:
            jsonschema.validate(arguments, offered[name], format_checker=checker)
            schema = offered[name]["properties"]
            for key, value in arguments.items():
                if isinstance(value, str) and "enum" not in schema[key] and "format" not in schema[key] \
                        and key not in ("time", "start_time"):
                    assert value in q.request, (key, value, q.request)
                elif isinstance(value, (int, float)) and key not in durations:
                    assert _said(value, q.request), (key, value, q.request)
                elif schema[key].get("format") == "date":
                    assert str(datetime.date.fromisoformat(value).year) in q.request, q.request


# -- the completion is the grammar's text --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def accepts(tokenizer):  # noqa: ANN001, ANN201
    """Whether a grammar takes a whole text, tokenized by the demo model's tokenizer."""
    library = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[tokenizer.eos_token_id])

    def accepts(built: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(library, built)
        return (all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
                and matcher.is_accepting())

    return accepts


def test_the_completion_is_the_calls_in_the_wire_format_and_the_served_grammar_takes_it(train, test, accepts):
    for q in train[:60] + test[:60]:
        params = {"output": "tool_calls", **q.params}
        grammar = answer_grammar(params, model_messages(q.request, params, "You are Laya."), analysis=False)
        assert accepts(grammar, q.completion), q.completion
        if q.calls:
            assert q.completion == TOOL_CALL_SEPARATOR.join(call_text(n, a) for n, a in q.calls)
        else:
            assert q.completion == tq.NO_CALL_REPLY


# -- training records ----------------------------------------------------------------------------------------------


def served_request(record: dict, adapter: str):  # noqa: ANN201
    """The worker's generation request for the chat request a record stands for, built by the API's and the
    worker's own code: chat request -> stored job -> generation request."""
    chat = ChatRequest.model_validate({"model": adapter, "messages": [{"role": "user", "content": record["prompt"]}],
                                       **record["tools"]})
    job = new_job(chat.to_job(), ApiKey(id=uuid.uuid4()), datetime.datetime.now(datetime.UTC))
    return generation_request(job, get_settings())


def test_a_training_record_reads_back_and_encodes_as_the_worker_builds_the_same_request(tmp_path, tokenizer):
    write_dataset(tmp_path, n_train=6, n_templated=4, n_val=1, n_test=1, seed=2)
    tq.add_to_training(tmp_path, 40, seed=2)
    records = [json.loads(line) for line in (tmp_path / "laya" / "train.jsonl").read_text().splitlines()]
    samples = read_samples(tmp_path / "laya" / "train.jsonl")
    assert len(samples) == len(records) == 50 and sum("tools" in r for r in records) == 40
    settings = get_settings()
    system_prompt = settings.laya.system_prompt
    for record, sample, encoded in zip(records, samples, encode_samples(tokenizer, samples, system_prompt),
                                       strict=True):
        if "tools" not in record:
            assert sample.tools is None
            continue
        served = served_request(record, "laya")
        ids = encode_chats(tokenizer, [served], torch.device("cpu"))["input_ids"][0].tolist()
        completion = tokenizer(record["completion"], add_special_tokens=False)["input_ids"]
        assert encoded.input_ids == [*ids, *completion, tokenizer.eos_token_id]
        assert encoded.labels == [IGNORE_INDEX] * len(ids) + [*completion, tokenizer.eos_token_id]
        assert served.messages[0]["content"].startswith(f"{system_prompt}\n\n# Tools\n")
        assert encoded.label == record["label"]  # balanced by the called tool's place, as decisions by the option's


def test_no_tool_requests_leave_the_training_files_as_they_are(tmp_path):
    paths = write_dataset(tmp_path, n_train=6, n_templated=4, n_val=1, n_test=1, seed=2)
    before = {name: path.read_bytes() for name, path in paths.items()}
    assert tq.add_to_training(tmp_path, 0, seed=2) == {}
    assert {name: path.read_bytes() for name, path in paths.items()} == before
    tq.add_to_training(tmp_path, 30, seed=2)
    lines = (tmp_path / "kev" / "train.jsonl").read_text().splitlines()
    assert sorted(line for line in lines if '"tools"' not in line) == sorted(before["kev/train"].decode().splitlines())


def _tool_record(**changes: object) -> dict:
    q = next(q for q in tq.questions(20, seed=1, split="train") if q.calls and choice_of(q) == "auto")
    return {**tq.training_record(q), **changes}


GOOD = _tool_record()
WEATHER = [tq.GET_WEATHER.tool]


@pytest.mark.parametrize(("record", "named"), [
    ({**GOOD, "tools": [WEATHER]}, 'field "tools": must be an object'),
    ({**GOOD, "tools": {**GOOD["tools"], "temperature": 0}}, 'field "tools.temperature": not a tool field'),
    ({**GOOD, "tools": {"tool_choice": "auto"}}, 'field "tools.tools": is missing'),
    ({**GOOD, "tools": {"tools": [{"type": "function", "function": {"name": "get weather"}}]}},
     'field "tools.tools.0.function.name"'),
    ({**GOOD, "tools": {"tools": WEATHER, "tool_choice": {"type": "function", "function": {"name": "x"}}}},
     'field "tools.tool_choice"'),
    ({**GOOD, "tools": {"tools": WEATHER, "parallel_tool_calls": "yes"}}, 'field "tools.parallel_tool_calls"'),
    ({**GOOD, "tools": {"tools": WEATHER, "tool_choice": "none"}}, 'field "tools": '),
    ({**GOOD, "tools": {"tools": WEATHER}, "completion": call_text("book_flight", {})},
     'field "completion": calls \'book_flight\''),
    ({**GOOD, "tools": {"tools": WEATHER, "tool_choice": "required"}, "completion": "It is sunny."},
     'field "completion": tool_choice forces a call'),
    ({**GOOD, "tools": {"tools": WEATHER}, "completion": '<tool_call>\n{"name": "get_weather"'},
     'field "completion": opens a call it does not complete'),
    ({**GOOD, "tools": {"tools": WEATHER, "parallel_tool_calls": False},
      "completion": "\n".join([call_text("get_weather", {"city": "Oslo"})] * 2)}, 'field "completion": makes 2 calls'),
])
def test_a_bad_tools_field_is_refused_naming_its_line_and_field(tmp_path, record: dict, named: str):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(GOOD) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(DataError) as caught:
        read_samples(data)
    [problem] = caught.value.problems
    assert problem.startswith(f"{data}:2: ") and named in problem, problem


def test_the_prose_data_command_mixes_tool_requests_in_and_writes_the_held_out_ones(tmp_path):
    done = subprocess.run([sys.executable, "-m", "cli", "models", "prose-data", "--out", str(tmp_path), "--train", "20",
                           "--templated", "5", "--val", "3", "--test", "3", "--tool-calls", "30", "--tool-test", "6"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for adapter in ("kev", "laya"):
        samples = read_samples(tmp_path / adapter / "train.jsonl")
        assert len(samples) == 55 and sum(s.tools is not None for s in samples) == 30
    items = load_tool_items(tmp_path / "test_tool_questions.jsonl")
    assert len(items) == 6 and all({f["function"]["name"] for f in i.params["tools"]} <= set(tq.FUNCTIONS)
                                   for i in items)


# -- the evaluation ------------------------------------------------------------------------------------------------


def _items(questions: list[tq.ToolQuestion]) -> list[ToolItem]:
    return [ToolItem.from_row(tq.eval_row(q, f"t{i}")) for i, q in enumerate(questions)]


def _answer(item: ToolItem, text: str) -> ToolAnswer:
    return ToolAnswer(id=item.id, choice=item.choice, text=text, **score_answer(item, text),
                      expected=[{"name": name, "arguments": arguments} for name, arguments in item.calls],
                      finish_reason="stop", error_code=None, completion_tokens=1, latency_ms=1.0)


def test_scoring_gives_gold_answers_every_point_and_a_wrong_function_none(test):
    items = _items(test)
    gold = [_answer(item, q.completion) for item, q in zip(items, test, strict=True)]
    for name, summary in by_choice(gold).items():
        assert summary["right"] == summary["right_function"] == summary["exact_arguments"] == 1.0, name
        assert summary["valid_arguments"] == 1.0
    assert by_choice(gold)["auto"]["no_call"] == 1.0
    # a call of another offered function with the gold arguments: never right, and no call where one was due
    wrong = []
    for item, q in zip(items, test, strict=True):
        if q.calls:
            other = next((f.name for f in q.functions if f.name not in {n for n, _ in q.calls}), "no_such_tool")
            wrong.append(_answer(item, call_text(other, q.calls[0][1])))
        else:
            wrong.append(_answer(item, call_text(q.functions[0].name, {})))
    summary = by_choice(wrong)["all"]
    assert summary["right"] == summary["right_function"] == summary["exact_arguments"] == summary["no_call"] == 0.0
    assert summary["valid_arguments"] < 1.0  # the gold arguments rarely fit another function's schema


def test_scoring_takes_parallel_calls_in_any_order_and_counts_a_wrong_argument(test):
    q = next(q for q in test if len(q.calls) == 2 and q.calls[0] != q.calls[1])
    [item] = _items([q])
    swapped = TOOL_CALL_SEPARATOR.join(call_text(n, a) for n, a in reversed(q.calls))
    assert score_answer(item, swapped)["exact_arguments"] is True
    (name, arguments), second = q.calls
    changed = {**arguments, next(iter(arguments)): "somewhere else"}
    scored = score_answer(item, TOOL_CALL_SEPARATOR.join([call_text(name, changed), call_text(*second)]))
    assert scored["right_function"] is True and scored["exact_arguments"] is False
    only_one = score_answer(item, call_text(name, arguments))
    assert only_one["right_function"] is False and only_one["right"] is False
    text = score_answer(item, "I cannot help with that.")
    assert text["right"] is False and text["valid_arguments"] is None and text["no_call"] is None


def test_eval_tools_runs_end_to_end_on_the_tiny_model(tiny_model, tmp_path, test):
    # the tiny model's tokenizer is a byte a token: the shortest prompts, one of each kind
    short = sorted(test, key=lambda q: len(json.dumps(q.params)) + len(q.request))
    picked = [next(q for q in short if choice_of(q) == kind and bool(q.calls) == calls)
              for kind, calls in (("auto", True), ("auto", False), ("required", True), ("named", True))]
    questions = tmp_path / "tools.jsonl"
    questions.write_text("".join(json.dumps(tq.eval_row(q, f"t{i}")) + "\n" for i, q in enumerate(picked)))
    env = {**os.environ, "KEVLAYA_MODEL__BASE": str(tiny_model["base"]), "KEVLAYA_KEV__PATH": str(tiny_model["kev"]),
           "KEVLAYA_LAYA__PATH": str(tiny_model["laya"]), "KEVLAYA_MODEL__DEVICE": "cpu",
           "KEVLAYA_ENGINE__WINDOW_TOKENS": "2048"}
    out = tmp_path / "results"
    run = subprocess.run([sys.executable, "-m", "cli", "eval-tools", "--questions", str(questions), "--out", str(out),
                          "--batch-size", "4", "--max-new-tokens", "160"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "tool_choice" in run.stdout and "laya" in run.stdout and "kev" in run.stdout
    report = json.loads((out / "results.json").read_text())
    assert report["command"].startswith("kevlaya eval-tools") and report["questions"] == 4
    for role in ("laya", "kev"):
        answers = report["answers"][role]
        assert [a["choice"] for a in answers] == ["auto", "auto", "required", "named"]
        groups = report["roles"][role]
        assert groups["all"]["n"] == 4 and groups["auto"]["n"] == 2 and groups["named"]["calls_expected"] == 1
        assert groups["all"]["right"] == sum(a["right"] for a in answers) / 4
        for summary in groups.values():
            for key in ("right", "right_function", "exact_arguments", "no_call"):
                assert summary[key] is None or 0.0 <= summary[key] <= 1.0
            # random weights write anything, but under the tools' grammar every complete call is valid
            assert summary["valid_arguments"] in (None, 1.0)
        # a forced call is a call: the grammar allows nothing else (unless max_new_tokens cut it)
        assert all(a["calls"] or a["finish_reason"] == "length" for a in answers[2:])


def test_eval_tools_refuses_a_file_that_is_not_tool_questions_in_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "a", "request": "hi", "tools": {"tools": "weather"}, "calls": []}) + "\n")
    run = subprocess.run([sys.executable, "-m", "cli", "eval-tools", "--questions", str(bad), "--out",
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "bad.jsonl:1: not a tool question row" in run.stderr
    assert 'field "tools.tools"' in run.stderr and "Traceback" not in run.stderr
