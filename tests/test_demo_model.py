"""The shipped demo model: its files are what the build wrote, and its adapters do the real work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modellab.evaluation import Evaluator, load_scenarios, summarize
from shared.manifest import verify_manifest
from shared.settings import Settings
from worker.model.loading import load_model

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"


@pytest.mark.parametrize("part", [".", "base", "kev", "laya"])
def test_demo_manifests_verify(part):
    assert verify_manifest(DEMO / part) == []


def test_build_record_names_its_command_and_size_budget():
    build = json.loads((DEMO / "BUILD.json").read_text())
    assert build["command"].startswith("kevlaya models build-demo")
    assert sum(build["bytes"].values()) <= 25 * 2**20  # base + both adapters small enough to commit


@pytest.fixture(scope="module")
def evaluator() -> Evaluator:
    settings = Settings(_env_file=None, model={"base": str(DEMO / "base"), "device": "cpu"},
                        kev={"path": str(DEMO / "kev")}, laya={"path": str(DEMO / "laya")})
    return Evaluator(load_model(settings), settings, batch_size=8)


def test_adapters_decide_where_the_bare_base_cannot(evaluator):
    scenarios = load_scenarios(DEMO / "test_scenarios.jsonl", limit=16)
    base, laya, kev = (summarize(m, evaluator.answers(m, scenarios, progress=False)) for m in ("base", "laya", "kev"))
    assert laya.valid_json_rate == 1.0 and kev.valid_json_rate == 1.0
    assert kev.accuracy >= 0.9 and laya.accuracy >= 0.6
    assert base.accuracy < 0.3 < min(laya.accuracy, kev.accuracy)
    assert all(0 < a.confidence <= 1 for a in laya.answers)


def test_a_build_with_questions_pretrains_the_base_on_every_token_the_adapters_write(tmp_path: Path):
    """Questions name their options (train, Acme...), and the adapters write those names where the scenario format
    has letters: at a line's start in Kev's analysis and inside JSON strings. A base that only ever read the names
    in prose has untrained embeddings for those token forms, which no LoRA can fix (8.5 % of the completion tokens
    were such before the base's documents drew named options too)."""
    from modellab import decision_data as dd
    from modellab import demo_model as dm

    paths = dd.write_dataset(tmp_path, n_train=400, n_val=16, n_test=16, seed=0, question_share=0.5)
    texts, chats = dm.pretraining_corpus(6_000, seed=0, question_share=0.5)
    tokenizer = dm._tokenizer_for(dm.FULL, texts, chats)
    coverage = dm.token_coverage(tokenizer, dm._documents(tokenizer, texts, chats, seed=0), paths)
    assert coverage["completion_token_types"] > 250
    assert coverage["unseen_token_types"] == 0, coverage
