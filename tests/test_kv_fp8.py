"""The fp8 key/value cache (`KEVLAYA_ENGINE__KV_DTYPE=fp8`) on the shipped demo model: it holds one byte an element,
and greedy answers agree with the compute-dtype cache's; `auto` changes nothing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pydantic
import pytest
import torch

from modellab.evaluation import Evaluator, load_scenarios
from modellab.reference import ReferenceRuntime
from shared.settings import Settings
from tests.test_decoder import mixed_requests
from worker.decoder.kv_block import KVBlock, kv_shape
from worker.decoder.options import DecoderOptions
from worker.decoder.slot_decoder import SlotDecoder
from worker.engine.build import build_decoder
from worker.engine.offline import run_to_end
from worker.generation import GenerationRequest, GenerationResult
from worker.ledger.outcomes import job_outcome
from worker.memory import kv_bytes_per_token

FP8 = torch.float8_e4m3fn
SCENARIOS = Path(__file__).resolve().parents[1] / "models" / "demo" / "test_scenarios.jsonl"
HELD_OUT = 48  # scenarios, each asked of Kev and of Laya
NEW_TOKENS = 160  # more than any of these answers takes, so every decision closes


@pytest.fixture(scope="module")
def runtime() -> ReferenceRuntime:
    return ReferenceRuntime.load(Settings(_env_file=None, model={"device": "cpu"}))


def answers(runtime: ReferenceRuntime, requests: list[GenerationRequest], slots: int, window: int,
            prefill_tokens: int | None = None, **options: object) -> list[GenerationResult]:
    """`requests` run through a decoder of their own (one decoder at a time holds a model's LoRA)."""
    decoder = SlotDecoder(runtime.model, runtime.tokenizer, ["kev", "laya"], slots=slots, window=window,
                          eos_ids=runtime.eos_ids, options=DecoderOptions(**options))
    try:
        return run_to_end(decoder, requests, prefill_tokens)
    finally:
        decoder.close()


def block_bytes(block: KVBlock) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in block.layers)


def agreeing_prefix(expected: list[int], got: list[int]) -> int:
    """Tokens that match position by position until the first divergence."""
    return next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))


def decision(result: GenerationResult) -> str | None:
    return (job_outcome(result, "decision").decision or {}).get("decision")


def test_an_fp8_block_holds_one_byte_an_element_as_the_budget_counts(runtime: ReferenceRuntime) -> None:
    config = runtime.model.config
    decoder = SlotDecoder(runtime.model, runtime.tokenizer, ["kev", "laya"], slots=4, window=256,
                          eos_ids=runtime.eos_ids, options=DecoderOptions(kv_dtype=FP8))
    try:
        block = decoder.kv
    finally:
        decoder.close()
    assert {t.dtype for layer in block.layers for t in (layer.keys, layer.values)} == {FP8}
    for dtype, ratio in ((torch.float16, 2), (torch.float32, 4)):
        assert block_bytes(block) * ratio == block_bytes(KVBlock(config, 4, 256, dtype, torch.device("cpu")))
    assert block_bytes(block) == 4 * 256 * kv_bytes_per_token(*kv_shape(config), dtype_bytes=1)


def test_greedy_answers_with_an_fp8_cache_agree_with_the_compute_dtype_cache(runtime: ReferenceRuntime) -> None:
    """Held-out scenarios asked as `kevlaya eval` asks them (decision grammar, greedy), to both adapters."""
    settings = Settings(_env_file=None, model={"device": "cpu"})
    evaluator = Evaluator(runtime.loaded, settings)
    requests = [dataclasses.replace(evaluator._request(adapter, scenario, constrained=True), max_new_tokens=NEW_TOKENS)
                for adapter in ("kev", "laya") for _, scenario in load_scenarios(SCENARIOS, limit=HELD_OUT)]
    expected = answers(runtime, requests, 32, 320)
    got = answers(runtime, requests, 32, 320, kv_dtype=FP8)
    assert all(r.finish_reason == "stop" for r in expected)  # complete answers: their decisions can be compared
    agreeing = sum(agreeing_prefix(want.token_ids, have.token_ids) for want, have in zip(expected, got))
    tokens = sum(len(want.token_ids) for want in expected)
    identical = sum(want.token_ids == have.token_ids for want, have in zip(expected, got))
    same_decisions = sum(decision(want) == decision(have) for want, have in zip(expected, got))
    print(f"fp8 key/value cache against fp32 on {len(requests)} held-out jobs: token agreement {agreeing}/{tokens} "
          f"= {agreeing / tokens:.2%}, identical answers {identical}/{len(requests)}, same decision "
          f"{same_decisions}/{len(requests)}")
    assert agreeing / tokens >= 0.99
    assert same_decisions / len(requests) >= 0.99


@pytest.mark.parametrize("slots, window", [(3, 256), (2, 96)], ids=["refilled", "compacted"])
def test_fp8_static_steps_answer_as_its_eager_steps(runtime: ReferenceRuntime, slots: int, window: int) -> None:
    """The captured step's write (a column index) and the block's shifts and row moves work on fp8."""
    requests = mixed_requests()
    eager = answers(runtime, requests, slots, window, kv_dtype=FP8)
    static = answers(runtime, requests, slots, window, kv_dtype=FP8, static_steps=True)
    assert [r.token_ids for r in static] == [r.token_ids for r in eager]


def test_auto_is_the_decoder_built_without_a_storage_dtype(runtime: ReferenceRuntime) -> None:
    settings = Settings(_env_file=None, model={"device": "cpu"},
                        engine={"max_batch": 4, "window_tokens": 256, "kv_dtype": "auto"})
    requests = mixed_requests()
    built = build_decoder(runtime.loaded, settings)
    try:
        assert built.kv.layers[0].keys.dtype == torch.float32
        slots, got = built.kv.slots, run_to_end(built, requests, settings.engine.prefill_tokens)
    finally:
        built.close()
    expected = answers(runtime, requests, slots, 256, texts=False, prefill_tokens=settings.engine.prefill_tokens)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert [r.token_logprobs for r in got] == [r.token_logprobs for r in expected]


def test_fp8_reaches_the_worker_decoder_from_the_settings(runtime: ReferenceRuntime) -> None:
    settings = Settings(_env_file=None, model={"device": "cpu"},
                        engine={"max_batch": 4, "window_tokens": 256, "kv_dtype": "fp8"})
    built = build_decoder(runtime.loaded, settings)
    try:
        assert built.kv.layers[0].keys.dtype == built.kv.layers[0].values.dtype == FP8
    finally:
        built.close()


def test_an_unknown_kv_dtype_is_refused_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEVLAYA_ENGINE__KV_DTYPE", "fp9")
    with pytest.raises(pydantic.ValidationError, match=r"engine\.kv_dtype"):
        Settings(_env_file=None)
