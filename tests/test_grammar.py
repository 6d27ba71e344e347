"""Answers by construction: per-row grammars in the slot decoder (decisions limited to the options offered, JSON
schemas), stop strings and per-token log-probabilities, on the shipped demo model and on random weights; and the
parameters the API honours or refuses."""

from __future__ import annotations

import itertools
import json
import random
import uuid

import jsonschema
import pytest
import torch
from fastapi.testclient import TestClient

from modellab.decision_data import LETTERS, generate, render_prompt
from modellab.reference import ReferenceRuntime
from shared import grammar
from shared.decision import find_decision, offered_options
from shared.schemas import answer_grammar
from shared.settings import Settings
from tests.conftest import AUTH
from worker.decoder.grammar import RowGrammars
from worker.decoder.slot_decoder import SlotDecoder
from worker.engine.offline import run_to_end
from worker.generation import GenerationRequest
from worker.ledger.outcomes import job_outcome
from worker.model.tokens import decode_with_spans

SETTINGS = Settings(_env_file=None, model={"device": "cpu"})
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1},
                   "mode": {"enum": ["train", "flight"]}},
    "required": ["city", "days", "mode"], "additionalProperties": False,
}


@pytest.fixture(scope="module")
def demo() -> ReferenceRuntime:
    return ReferenceRuntime.load(SETTINGS)


@pytest.fixture(scope="module")
def random_weights(tmp_path_factory: pytest.TempPathFactory) -> ReferenceRuntime:
    from modellab.model_factory import build_random_model

    paths = build_random_model(tmp_path_factory.mktemp("random"), "tiny", seed=1)
    return ReferenceRuntime.load(Settings(_env_file=None, model={"device": "cpu", "base": str(paths["base"])},
                                          kev={"path": str(paths["kev"])}, laya={"path": str(paths["laya"])}))


def decoder_of(runtime: ReferenceRuntime, slots: int = 4) -> SlotDecoder:
    return SlotDecoder(runtime.model, runtime.tokenizer, ["kev", "laya"], slots=slots, window=1024,
                       eos_ids=runtime.eos_ids)


def run(runtime: ReferenceRuntime, requests: list[GenerationRequest], slots: int = 4) -> list:
    decoder = decoder_of(runtime, slots)
    try:
        return run_to_end(decoder, requests)
    finally:
        decoder.close()


def decision_request(adapter: str, question: str, *, choices: list[str] | None = None, max_new_tokens: int | None = None,
                     constrained: bool = True, **options: object) -> GenerationRequest:
    profile = SETTINGS.adapter_profile(adapter)
    messages = [{"role": "system", "content": profile.system_prompt}, {"role": "user", "content": question}]
    params = {"output": "decision", **({"choices": choices} if choices else {})}
    return GenerationRequest(
        job_id=uuid.uuid4(), adapter=adapter, messages=messages,
        max_new_tokens=max_new_tokens or profile.max_new_tokens, top_p=1.0,
        grammar=answer_grammar(params, messages, profile.analysis) if constrained else None,
        **{"temperature": 0.0, "seed": None, **options})


def text_request(adapter: str, prompt: str, max_new_tokens: int, *, temperature: float = 0.0, seed: int | None = None,
                 **options: object) -> GenerationRequest:
    return GenerationRequest(job_id=uuid.uuid4(), adapter=adapter, messages=[{"role": "user", "content": prompt}],
                             max_new_tokens=max_new_tokens, temperature=temperature, top_p=1.0, seed=seed, **options)


# -- the options a question offers -----------------------------------------------------------------------------


@pytest.mark.parametrize(("question", "labels"), [
    (render_prompt(generate(1, seed=3)[0]), list(LETTERS[:len(generate(1, seed=3)[0].options)])),
    ("Train or plane to Berlin? Options: train, flight. The train takes 8 hours.", ["train", "flight"]),
    ("Where to?\noptions: Lyon, Nantes, or Lille\nThanks", ["Lyon", "Nantes", "Lille"]),
    ("Should we ship on Friday?", None),
])
def test_the_options_a_question_lists_are_its_labels(question, labels):
    assert offered_options(question) == labels


def test_kevs_analysis_cannot_hold_an_object_that_would_pass_for_the_decision(demo):
    """Seen on plain-word questions: Kev wrote `{"decision": "A"}` inside an analysis line, and that object, naming no
    option offered, was taken for the decision. Analysis lines hold no "{", so the first "{" opens the decision."""
    import llguidance

    rows = demo_grammars(demo)
    decision = grammar.decision_grammar(["train", "flight"], analysis=True)

    def accepts(text: str) -> bool:
        matcher = rows.matcher(decision)
        return all(matcher.consume_token(t) for t in demo.tokenizer.encode(text)) and matcher.is_accepting()

    assert accepts('train: 8 hours -> keep\n{"decision": "train"}')
    assert not accepts('train: see {"decision": "A"} -> keep\n{"decision": "train"}')
    assert not accepts('{"decision": "A"}')
    assert isinstance(rows.matcher(decision), llguidance.LLMatcher)


def demo_grammars(runtime: ReferenceRuntime):  # noqa: ANN201
    from worker.decoder.grammar import RowGrammars

    return RowGrammars(runtime.tokenizer, runtime.model.config.vocab_size, runtime.eos_ids, 1, torch.device("cpu"))


# -- the decoder -----------------------------------------------------------------------------------------------


def test_a_constrained_row_leaves_the_free_rows_beside_it_as_they_are_alone(demo):
    scenarios = generate(3, seed=11)
    free = [decision_request(("kev", "laya")[i % 2], render_prompt(s), constrained=False, max_new_tokens=30)
            for i, s in enumerate(scenarios)]
    alone = run(demo, free)
    constrained = [text_request("kev", "Pick a vendor: A is cheap, B is reliable.", 40, grammar=grammar.json_grammar(SCHEMA)),
                   decision_request("laya", render_prompt(scenarios[0]), choices=["Z", "Q"])]
    together = run(demo, [constrained[0], *free, constrained[1]], slots=5)
    for want, have in zip(alone, together[1:4], strict=True):
        assert have.token_ids == want.token_ids and have.token_logprobs == pytest.approx(want.token_logprobs, abs=1e-5)


def test_decisions_name_only_the_options_offered(demo):
    scenarios = [s for s in generate(40, seed=7) if s.label in LETTERS][:4]
    requests = []
    for i, scenario in enumerate(scenarios):
        # Offer every option but the right one: the model's own answer is not allowed.
        others = [o.name for o in scenario.options if o.name != scenario.label]
        requests.append(decision_request(("kev", "laya")[i % 2], render_prompt(scenario), choices=others))
    for request, scenario, result in zip(requests, scenarios, run(demo, requests), strict=True):
        outcome = job_outcome(result, "decision")
        assert outcome.status == "succeeded", (outcome.error_code, result.text)
        assert outcome.decision["decision"] in [o.name for o in scenario.options if o.name != scenario.label] + ["none"]
        assert result.finish_reason == "stop"


def test_without_offered_options_a_decision_names_one_its_own_answer_lists(demo):
    """Where the question lists no options, the decision is held to the names of those the answer lists, and those
    names to runs of the question's words."""
    questions = ["Should I take the train or fly to Lyon? The train costs 40 EUR, the flight 90 EUR. Cheapest wins.",
                 "Pick a laptop: Vega is 900 USD rated 4/5, Orion is 1200 USD rated 5/5. I want the best rated."]
    requests = [decision_request(adapter, question, max_new_tokens=160, temperature=1.0, seed=seed)
                for adapter in ("kev", "laya") for question in questions for seed in range(3)]
    results = run(demo, requests, slots=12)
    finished = [r for r in results if r.finish_reason == "stop"]
    assert len(finished) > len(results) / 2, [r.text for r in results]
    asked = {r.job_id: r.messages[-1]["content"] for r in requests}
    for result in finished:
        found = find_decision(result.text)
        assert found is not None, result.text
        listed = grammar.option_names(found.value.get("options", []))
        assert found.value["decision"] in [*listed, "none"], result.text
        assert all(name in asked[result.job_id] for name in listed), result.text  # names are the question's words


def test_an_unconstrained_demo_answer_is_the_same_under_its_grammar_with_the_same_confidence(demo):
    scenarios = generate(4, seed=21)
    requests = [decision_request(("kev", "laya")[i % 2], render_prompt(s), constrained=c)
                for c in (False, True) for i, s in enumerate(scenarios)]
    results = run(demo, requests, slots=8)
    for free, constrained in zip(results[:4], results[4:], strict=True):
        # The grammar ends the row when its object closes, one token before the model's end of sequence.
        assert free.token_ids[:-1] == constrained.token_ids and free.token_ids[-1] in demo.eos_ids
        free_outcome, constrained_outcome = job_outcome(free, "decision"), job_outcome(constrained, "decision")
        assert constrained_outcome.decision == free_outcome.decision


def test_a_json_schema_holds_on_random_weights(random_weights):
    """Random weights want almost every token the schema masks: the answer still validates, or ran out of tokens."""
    json_grammar = grammar.json_grammar(SCHEMA)
    requests = [text_request(("kev", "laya")[i % 2], f"Plan trip {i}.", 120, grammar=json_grammar,
                             temperature=1.0, seed=i) for i in range(8)]
    results = run(random_weights, requests, slots=8)
    finished = [r for r in results if r.finish_reason == "stop"]
    assert finished, "no answer closed its object within 120 tokens"
    for result in finished:
        jsonschema.validate(json.loads(result.text), SCHEMA)
    for result in results:
        assert result.text.startswith("{")


def test_a_decision_that_runs_out_of_tokens_fails_with_length_and_keeps_its_text(demo):
    [result] = run(demo, [decision_request("kev", render_prompt(generate(1, seed=2)[0]), max_new_tokens=12)])
    outcome = job_outcome(result, "decision")
    assert (outcome.status, outcome.error_code, outcome.finish_reason) == ("failed", "length", "length")
    assert outcome.result_text and len(result.token_ids) == 12


def test_a_stop_string_that_spans_tokens_cuts_the_answer_before_it(demo):
    prompt = render_prompt(generate(1, seed=5)[0])
    [free] = run(demo, [text_request("kev", prompt, 60)])
    # A stop string that starts inside one token and ends inside a later one.
    start = free.token_spans[3][0] + 1
    stop = free.text[start:free.token_spans[5][1] - 1]
    assert len(stop) >= 2 and stop not in free.text[:start]
    [cut] = run(demo, [text_request("kev", prompt, 60, stop=["never written", stop])])
    assert cut.text == free.text[:start] and cut.stop == stop and cut.finish_reason == "stop"
    assert len(cut.token_ids) < len(free.token_ids)


def test_a_token_adds_to_the_live_text_the_bytes_it_adds_to_the_stored_text(demo):
    """Special tokens and ids past the tokenizer (a model's padded vocabulary) add nothing, as the stored text skips
    them: the library names such an id `<[id]>`, which the stream then published and the stop strings searched."""
    tokenizer = demo.tokenizer
    grammars = RowGrammars(tokenizer, len(tokenizer) + 8, demo.eos_ids, 2, torch.device("cpu"))
    for token in range(len(tokenizer) + 8):
        text = tokenizer.decode([token], skip_special_tokens=True)
        if "\ufffd" not in text:  # a byte-level token that ends inside a character has no text of its own
            assert grammars.token_bytes(token) == text.encode(), token
    assert grammars.token_bytes(len(tokenizer) + 3) == b"" and grammars.token_bytes(demo.eos_ids[0]) == b""


def test_a_row_without_a_grammar_allows_every_token_where_a_constrained_row_was(demo):
    grammars = RowGrammars(demo.tokenizer, len(demo.tokenizer), demo.eos_ids, 2, torch.device("cpu"))
    json_grammar = grammar.json_grammar(SCHEMA)
    first = grammars.allowed([grammars.matcher(json_grammar), None])
    assert first[1].all() and not first[0].all()
    second = grammars.allowed([None, grammars.matcher(json_grammar)])
    assert second[0].all() and torch.equal(second[1], first[0])


def test_token_spans_are_those_of_decoding_each_prefix(demo):
    """A token's span ends where the text of the tokens up to it ends (never before the last one's)."""
    tokenizer, rng = demo.tokenizer, random.Random(0)
    words = tokenizer.encode('Kev: café naïve 日本語 🙂 {"decision": "B"}')
    for _ in range(50):
        tokens = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(0, 30))] + words[:rng.randint(0, 20)]
        rng.shuffle(tokens)
        ends = [len(tokenizer.decode(tokens[:end], skip_special_tokens=True)) for end in range(1, len(tokens) + 1)]
        text, spans = decode_with_spans(tokenizer, tokens)
        assert text == tokenizer.decode(tokens, skip_special_tokens=True)
        assert [b for _a, b in spans] == list(itertools.accumulate(ends, max))
        assert [a for a, _b in spans] == [0] + [b for _a, b in spans[:-1]]


def test_log_probabilities_are_the_models_own_with_the_likeliest_alternatives(demo):
    prompt = render_prompt(generate(1, seed=9)[0])
    [result] = run(demo, [text_request("laya", prompt, 20, top_logprobs=3)])
    assert len(result.logprobs) == len(result.token_ids)
    for entry, logprob in zip(result.logprobs, result.token_logprobs, strict=True):
        assert entry["logprob"] == pytest.approx(logprob)
        alternatives = [a["logprob"] for a in entry["top_logprobs"]]
        assert len(alternatives) == 3 and alternatives == sorted(alternatives, reverse=True)
        # greedy: the chosen token is the likeliest
        assert entry["token"] == entry["top_logprobs"][0]["token"] and entry["logprob"] == pytest.approx(alternatives[0])
    assert "".join(e["token"] for e in result.logprobs).replace("<|endoftext|>", "") == result.text


def test_the_reference_runtime_refuses_what_it_cannot_honour(demo):
    with pytest.raises(ValueError, match="grammars"):
        demo.run_batch([decision_request("laya", "Options: A, B.")])


# -- the API ---------------------------------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "Options: train, flight."}]


@pytest.mark.parametrize(("params", "field"), [
    ({"output": "text", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "dependentSchemas": {"a": {}}}}}},
     "params.response_format.json_schema.schema"),
    ({"output": "text", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "format": "no-such-format"}}}},
     "params.response_format.json_schema.schema"),
    ({"output": "text", "response_format": {"type": "json_schema"}}, "params.response_format"),
    ({"response_format": {"type": "json_object"}}, "params.response_format"),
    ({"stop": "\n"}, "params.stop"),
    ({"output": "text", "stop": ["a", "b", "c", "d", "e"]}, "params.stop"),
    ({"output": "text", "stop": [""]}, "params.stop.0"),
    ({"output": "text", "choices": ["A"]}, "params.choices"),
    ({"choices": ["A", "A"]}, "params.choices"),
    ({"choices": ["  "]}, "params.choices.0"),
    ({"top_logprobs": 2}, "params.top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "params.top_logprobs"),
])
def test_job_parameters_that_cannot_be_honoured_are_refused_naming_them(client: TestClient, params, field):
    response = client.post("/v1/jobs", headers=AUTH, json={"adapter": "laya", "input": "Options: A, B.",
                                                           "params": params})
    assert response.status_code == 422, response.text
    assert f"{field}:" in response.json()["error"]["message"], response.json()


@pytest.mark.parametrize(("extra", "field"), [
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"presence_penalty": -1}, "presence_penalty"),
    ({"n": 2}, "n"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"service_tier": "auto"}, "service_tier"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                     "dependentSchemas": {}}}}},
     "response_format.json_schema.schema"),
])
def test_chat_parameters_that_cannot_be_honoured_are_refused_naming_them(client: TestClient, extra, field):
    response = client.post("/v1/chat/completions", headers=AUTH, json={"model": "laya", "messages": MESSAGES, **extra})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["message"].startswith(f"{field}:"), response.json()


@pytest.fixture
def quick_chat(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEVLAYA_LIMITS__CHAT_TIMEOUT_S", "0.2")  # read when `client` builds the app


def test_chat_parameters_become_the_jobs_own(quick_chat, client: TestClient):
    """Chat waits for its job; the job it stored carries every parameter it honours (no worker runs here, so the
    request times out and the job stays queued)."""
    from shared.db import session_scope
    from shared.models import Job

    body = {"model": "kev", "messages": MESSAGES, "stop": ["\n"], "logprobs": True, "top_logprobs": 2,
            "max_completion_tokens": 9, "max_tokens": 30, "seed": 4, "user": "u-17", "metadata": {"team": "ops"},
            "frequency_penalty": 0, "response_format": {"type": "json_schema", "json_schema": {
                "name": "trip", "strict": True, "schema": SCHEMA}}}
    response = client.post("/v1/chat/completions", headers=AUTH, json=body)
    assert response.status_code == 504, response.text
    with session_scope() as session:
        job = session.query(Job).order_by(Job.created_at.desc()).first()
        params, metadata = job.params, job.meta
    assert params["stop"] == ["\n"] and params["logprobs"] is True and params["top_logprobs"] == 2
    assert params["max_new_tokens"] == 9 and params["seed"] == 4 and params["output"] == "text"
    assert params["response_format"]["json_schema"]["schema"] == SCHEMA
    assert metadata == {"team": "ops", "user": "u-17"}
