"""The `auto` cascade, decision confidence, and the OpenAI-compatible endpoint with the official client."""

from __future__ import annotations

import uuid

import pytest
from openai import OpenAI

from modellab.decision_data import generate, render_prompt
from shared.decision import find_decision
from shared.lifecycle import JobOutcome
from shared.settings import DEMO_MODEL_DIR, Settings
from tests.conftest import start_worker, submit, wait_finished
from worker.generation import GenerationResult
from worker.ledger.cascade import needs_escalation
from worker.ledger.outcomes import job_outcome


def result_for(text: str, token_texts: list[str], logprobs: list[float]) -> GenerationResult:
    spans, position = [], 0
    for piece in token_texts:
        spans.append((position, position + len(piece)))
        position += len(piece)
    assert "".join(token_texts) == text
    return GenerationResult(job_id=uuid.uuid4(), text=text, prompt_tokens=5, completion_tokens=len(token_texts),
                            prefill_ms=1.0, decode_ms=2.0, token_ids=list(range(len(token_texts))),
                            token_logprobs=logprobs, token_spans=spans)


def outcome(text: str, tokens: list[str], logprobs: list[float], output: str = "decision") -> JobOutcome:
    return job_outcome(result_for(text, tokens, logprobs), output)


def test_confidence_is_the_probability_of_the_decision_tokens_not_the_written_number():
    tokens = ['{"decision": "', "B", '", "confidence": 0.99}']
    result = outcome("".join(tokens), tokens, [-0.01, -0.5, -0.02])
    assert result.status == "succeeded"
    assert result.decision["decision"] == "B"
    # exp(-0.01 - 0.5): the object's tokens through "B"; not the written 0.99, nor the tokens after the decision
    assert result.decision["confidence"] == pytest.approx(0.6005, abs=1e-4)


def test_confidence_counts_the_fields_written_before_the_decision_but_not_the_analysis():
    tokens = ["A: cost 3<=5 -> keep\n", '{"options": ["', "A 3", '"], "decision": "', "A", '"}']
    result = outcome("".join(tokens), tokens, [-2.0, -0.01, -0.3, -0.01, -0.1, -0.01])
    assert result.decision["options"] == ["A 3"]
    assert result.decision["confidence"] == pytest.approx(0.6570, abs=1e-4)  # exp(-0.42): the analysis line is out


def test_unparsable_answers_fail_as_invalid_output_unless_text_was_asked_for():
    failed = outcome("I think B", ["I think", " B"], [-1.0, -1.0])
    assert failed.status == "failed" and failed.error_code == "invalid_output" and failed.result_text == "I think B"
    text = outcome("I think B", ["I think", " B"], [-1.0, -1.0], output="text")
    assert text.status == "succeeded" and text.decision is None


def test_a_decision_naming_an_option_the_job_does_not_offer_is_no_decision():
    """Under the decision grammar none can be written; free text can name anything, and its object then counts as
    no decision: a text job keeps the text alone, and an unsure `auto` head escalates."""
    def answer(label: str, output: str) -> JobOutcome:
        tokens = ['{"decision": "', label, '"}']
        return job_outcome(result_for("".join(tokens), tokens, [-0.1, -0.2, -0.1]), output, choices=["train", "flight"])

    for label in ("flight", "none"):
        assert answer(label, "text").decision["decision"] == label
    text = answer("car", "text")
    assert text.status == "succeeded" and text.decision is None and text.result_text == '{"decision": "car"}'
    assert needs_escalation(text, Settings(_env_file=None).cascade.threshold)
    assert answer("car", "decision").error_code == "invalid_output"


@pytest.mark.parametrize(
    ("laya", "escalate"),
    [
        (JobOutcome(status="succeeded", decision={"decision": "A", "confidence": 0.95}), False),
        (JobOutcome(status="succeeded", decision={"decision": "A", "confidence": 0.5}), True),
        (JobOutcome(status="succeeded", decision=None, result_text="noise"), True),
        (JobOutcome(status="failed", error_code="invalid_output", result_text="noise"), True),
    ],
)
def test_escalation_rule(laya, escalate):
    assert needs_escalation(laya, Settings(_env_file=None).cascade.threshold) is escalate


@pytest.mark.integration
def test_an_unsure_laya_escalates_to_kev_and_the_parent_returns_kevs_answer(env, api, start_process):
    start_worker(start_process, env, api)
    job_id = submit(api, "auto", "Options: A cost 10; B cost 20. Objective: lowest cost.", max_new_tokens=6)
    [job] = wait_finished(api, [job_id])
    assert job["status"] == "succeeded" and job["requested_adapter"] == "auto"
    laya, kev = job["cascade"]  # random weights never give a valid decision, so Laya always escalates
    assert laya["adapter"] == "laya" and kev["adapter"] == "kev" and kev["status"] == "succeeded"
    assert job["result"]["text"] == kev["result"]["text"]
    kev_job = api.get(f"/v1/jobs/{kev['id']}").json()
    assert "max_new_tokens" not in kev_job["params"]  # Kev is not held to the limit given for Laya
    assert job["tokens"]["completion"] == laya["tokens"]["completion"] + kev["tokens"]["completion"]
    assert job["timings"]["total_ms"] >= kev["timings"]["total_ms"]
    assert job["timings"]["total_ms"] >= job["timings"]["ttft_ms"] > kev["timings"]["ttft_ms"] > 0
    # the Kev stage cannot be cancelled on its own, and the stages are jobs of their own
    assert api.delete(f"/v1/jobs/{kev['id']}").status_code == 409
    assert api.get(f"/v1/jobs/{laya['id']}").json()["parent_job_id"] == job_id


def forced_decision(label: str) -> dict:
    """A response format under which the only answer is `{"decision": label}`: what the model writes is known."""
    schema = {"type": "object", "properties": {"decision": {"enum": [label]}}, "required": ["decision"],
              "additionalProperties": False}
    return {"type": "json_schema", "json_schema": {"name": "d", "schema": schema}}


# Any decision Laya writes is sure enough, so an `auto` job escalates exactly when her answer holds none.
@pytest.mark.integration
@pytest.mark.parametrize("env", [{"KEVLAYA_CASCADE__THRESHOLD": "0"}], indirect=True)
def test_auto_says_who_answered_in_the_job_and_the_chat_completion(env, api, start_process):
    start_worker(start_process, env, api)
    question = "Train or flight to Berlin? Options: train, flight"
    confident = submit(api, "auto", question, max_new_tokens=80, response_format=forced_decision("train"))
    unsure = submit(api, "auto", question, max_new_tokens=6)  # noise: no decision, so Kev answers
    kev, laya = submit(api, "kev", question, max_new_tokens=6), submit(api, "laya", question, max_new_tokens=6)
    confident_job, escalated, kev_job, laya_job = wait_finished(api, [confident, unsure, kev, laya])

    assert confident_job["status"] == "succeeded" and confident_job["cascade"] is None
    assert confident_job["result"]["decision"]["decision"] == "train"
    assert (confident_job["requested_adapter"], confident_job["answered_by"]) == ("auto", "laya")
    assert escalated["status"] == "succeeded" and [s["adapter"] for s in escalated["cascade"]] == ["laya", "kev"]
    assert (escalated["requested_adapter"], escalated["answered_by"]) == ("auto", "kev")
    assert (kev_job["answered_by"], laya_job["answered_by"]) == ("kev", "laya")  # a role's own job: itself
    stage_laya, stage_kev = (api.get(f"/v1/jobs/{s['id']}").json() for s in escalated["cascade"])
    assert (stage_laya["answered_by"], stage_kev["answered_by"]) == ("laya", "kev")
    listed = {j["id"]: j["answered_by"] for j in api.get("/v1/jobs", params={"adapter": "auto"}).json()["jobs"]}
    assert listed == {confident: "laya", unsure: "kev"}

    client = OpenAI(base_url=f"http://127.0.0.1:{env['KEVLAYA_API__PORT']}/v1", api_key=env["KEVLAYA_API__KEY"],
                    max_retries=0, timeout=60)
    messages = [{"role": "user", "content": question}]
    sure = client.chat.completions.create(model="auto", max_tokens=80, temperature=0, messages=messages,
                                          response_format=forced_decision("flight"))
    assert sure.model == "auto" and sure.model_extra["kevlaya"]["answered_by"] == "laya"
    assert sure.model_extra["kevlaya"]["decision"]["decision"] == "flight"
    by_kev = client.chat.completions.create(model="auto", max_tokens=6, temperature=0, messages=messages)
    assert by_kev.model == "auto" and by_kev.model_extra["kevlaya"]["answered_by"] == "kev"
    assert api.get(f"/v1/jobs/{by_kev.model_extra['kevlaya']['job_id']}").json()["answered_by"] == "kev"
    streamed = list(client.chat.completions.create(model="auto", max_tokens=6, temperature=0, messages=messages,
                                                   stream=True))
    assert streamed[-1].model_extra["kevlaya"]["answered_by"] == "kev"  # the last chunk, with the finish reason
    assert streamed[-1].choices[0].finish_reason is not None


@pytest.mark.integration
@pytest.mark.parametrize("env", [{f"KEVLAYA_{name}": str(DEMO_MODEL_DIR.resolve() / part) for name, part in
                                  (("MODEL__BASE", "base"), ("KEV__PATH", "kev"), ("LAYA__PATH", "laya"))}],
                         indirect=True)
def test_a_role_answers_chat_as_itself_under_its_grammar(env, api, start_process):
    """A chat answer is the role's own: Laya's decision object, Kev's analysis then his decision, under the role's
    grammar with `kevlaya.decision` filled; any `response_format` (`text` too) asks for another form; a `max_tokens`
    that ends the answer early is OpenAI's "length" with the text so far, not an error."""
    start_worker(start_process, env, api)
    client = OpenAI(base_url=f"http://127.0.0.1:{env['KEVLAYA_API__PORT']}/v1", api_key=env["KEVLAYA_API__KEY"],
                    max_retries=0, timeout=60)
    scenario = generate(1, seed=5)[0]
    labels = [*(o.name for o in scenario.options), "none"]
    messages = [{"role": "user", "content": render_prompt(scenario)}]
    for model, opens_with_analysis in (("laya", False), ("kev", True)):
        answer = client.chat.completions.create(model=model, temperature=0, messages=messages)
        text, extra = answer.choices[0].message.content, answer.model_extra["kevlaya"]
        found = find_decision(text)
        assert answer.choices[0].finish_reason == "stop" and found is not None, text
        assert (found.span[0] > 0) is opens_with_analysis, text
        assert extra["decision"]["decision"] == found.value["decision"] in labels
        assert 0 <= extra["decision"]["confidence"] <= 1
        assert api.get(f"/v1/jobs/{extra['job_id']}").json()["params"]["output"] == "decision"

    free = client.chat.completions.create(model="laya", temperature=0, messages=messages, max_tokens=12,
                                          response_format={"type": "text"})
    assert api.get(f"/v1/jobs/{free.model_extra['kevlaya']['job_id']}").json()["params"]["output"] == "text"

    short = client.chat.completions.create(model="kev", temperature=0, messages=messages, max_tokens=5)
    assert short.choices[0].finish_reason == "length" and short.choices[0].message.content
    assert short.model_extra["kevlaya"]["decision"] is None and short.usage.completion_tokens == 5
    streamed = list(client.chat.completions.create(model="kev", temperature=0, messages=messages, max_tokens=5,
                                                   stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == short.choices[0].message.content
    assert streamed[-1].choices[0].finish_reason == "length"


@pytest.mark.integration
def test_the_official_openai_client_gets_answers_from_each_model(env, api, start_process):
    start_worker(start_process, env, api)
    client = OpenAI(base_url=f"http://127.0.0.1:{env['KEVLAYA_API__PORT']}/v1", api_key=env["KEVLAYA_API__KEY"],
                    max_retries=0, timeout=60)
    for model in ("kev", "laya", "auto"):
        completion = client.chat.completions.create(
            model=model, max_tokens=6, temperature=0,
            messages=[{"role": "user", "content": "Options: A cost 10; B cost 20. Objective: lowest cost."}],
        )
        assert completion.model == model
        assert isinstance(completion.choices[0].message.content, str)
        assert completion.choices[0].finish_reason in ("stop", "length")
        assert completion.usage.completion_tokens >= 1 and completion.usage.prompt_tokens > 0
    with pytest.raises(Exception) as refused:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert refused.value.status_code == 422 and "model" in str(refused.value)


@pytest.mark.integration
def test_a_text_job_reports_only_a_decision_its_question_offers(env, api, start_process):
    """The worker holds a text answer's decision to the options on the question's `Options:` line. Each answer is
    written under a schema that allows one decision, so what the model writes is known."""
    import json

    start_worker(start_process, env, api)

    def forced(label: str) -> str:
        schema = {"type": "object", "properties": {"decision": {"enum": [label]}}, "required": ["decision"],
                  "additionalProperties": False}
        return submit(api, "kev", "Train or flight to Berlin? Options: train, flight", max_new_tokens=80,
                      response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": schema}})

    car, flight = wait_finished(api, [forced("car"), forced("flight")])
    assert car["status"] == flight["status"] == "succeeded"
    assert json.loads(car["result"]["text"]) == {"decision": "car"} and car["result"]["decision"] is None
    assert flight["result"]["decision"]["decision"] == "flight"


@pytest.mark.integration
def test_the_official_openai_client_gets_schema_answers_stop_cuts_and_logprobs(env, api, start_process):
    import json

    import jsonschema

    start_worker(start_process, env, api)
    client = OpenAI(base_url=f"http://127.0.0.1:{env['KEVLAYA_API__PORT']}/v1", api_key=env["KEVLAYA_API__KEY"],
                    max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Train or flight to Berlin?"}]
    schema = {"type": "object", "properties": {"mode": {"enum": ["train", "flight"]}, "direct": {"type": "boolean"}},
              "required": ["mode", "direct"], "additionalProperties": False}
    for model in ("kev", "laya"):
        # random weights, and still an answer that validates
        answer = client.chat.completions.create(
            model=model, messages=messages, max_completion_tokens=60, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "trip", "strict": True, "schema": schema}})
        assert answer.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(answer.choices[0].message.content), schema)

    free = client.chat.completions.create(model="kev", messages=messages, max_completion_tokens=30, temperature=0,
                                          logprobs=True, top_logprobs=2)
    text = free.choices[0].message.content
    entries = free.choices[0].logprobs.content
    assert len(entries) == free.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in entries)
    assert all(e.logprob <= 0 and e.top_logprobs[0].logprob >= e.logprob for e in entries)
    stop = text[10:14]
    cut = client.chat.completions.create(model="kev", messages=messages, max_completion_tokens=30, temperature=0,
                                         stop=[stop])
    assert cut.choices[0].message.content == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].logprobs is None
    with pytest.raises(Exception) as refused:
        client.chat.completions.create(model="kev", messages=messages, logit_bias={"5": 3})
    assert refused.value.status_code == 422 and "logit_bias" in str(refused.value)
