"""Plain-words decision questions (modellab/prose_questions.py): the gold rule re-derived from the question's own
figures, held-out domains and phrasings that training never sees, answers the serving grammar accepts, and the
dataset command."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from modellab import prose_questions as pq
from shared.decision import parse_decision

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def train() -> list[pq.Question]:
    return list(pq.questions(1500, seed=3, split="train"))


@pytest.fixture(scope="module")
def test() -> list[pq.Question]:
    return list(pq.questions(600, seed=3, split="test"))


def brute_force_label(f: pq.Facts) -> str:
    """The gold decision from first principles: meet the limit, then best on the objective, else none."""
    order = {"low": 0, "medium": 1, "high": 2}

    def value(attribute: str, name: str) -> int:
        v = f.values[attribute][name]
        return order[v] if attribute == "risk" else v

    kept = []
    for name in f.names:
        if f.limit is not None:
            attribute, threshold = f.limit
            t = order[threshold] if attribute == "risk" else threshold
            if (value(attribute, name) > t) if attribute in ("price", "time", "risk") else (value(attribute, name) < t):
                continue
        kept.append(name)
    if not kept:
        return "none"
    sign = 1 if f.objective in ("price", "time", "risk") else -1
    return min(kept, key=lambda n: sign * value(f.objective, n))


def test_the_gold_decision_is_the_best_option_within_the_limit(train, test):
    for q in train + test:
        assert q.label == brute_force_label(q.facts) == q.scenario.label


def test_every_option_and_every_figure_the_rule_uses_is_in_the_question(train):
    for q in train[:400]:
        for name in q.facts.names:
            assert name in q.text
        used = {q.facts.objective} | ({q.facts.limit[0]} if q.facts.limit else set())
        for attribute in used - {"risk"}:
            for name in q.facts.names:
                extra = q.facts.extra.get(name, 0) if attribute == "time" else 0  # "1 h plus 2 h of airport time"
                value = q.facts.values[attribute][name] - extra
                # training also writes decimals ("4.5 stars", 45 in tenths) and thousands with a comma ("$1,400")
                assert pq._number(q.facts, attribute, value) in q.text or f"{value:,}" in q.text


def test_no_objective_ties_and_a_small_share_of_none(train):
    for q in train:
        if q.label != "none":
            best = q.facts.rank(q.label)
            assert sum(q.facts.rank(n) == best for n in q.facts.kept) == 1
    none_share = sum(q.label == "none" for q in train) / len(train)
    assert 0.02 < none_share < 0.12
    assert sum(q.facts.limit is not None for q in train) / len(train) > 0.4


def test_held_out_questions_come_from_domains_and_phrasings_training_never_sees(train, test):
    held_topics = {d.topic for d in pq.HELD_OUT_DOMAINS}
    train_topics = {d.topic for d in pq.TRAIN_DOMAINS + pq.READING_DOMAINS}  # reading domains: training only
    assert not held_topics & train_topics
    assert {q.facts.domain.topic for q in test} <= held_topics
    assert {q.facts.domain.topic for q in train} <= train_topics
    held_sentences = [s for phrasing in (pq.INTROS, *pq.OBJECTIVES.values(), *pq.LIMITS.values())
                      for s in phrasing.held_out]
    stems = [re.escape(s.split("{")[0]) for s in held_sentences if len(s.split("{")[0]) > 8]
    pattern = re.compile("|".join(stems))
    assert not any(pattern.search(q.text) for q in train), "a held-out phrasing reached training"
    assert sum(bool(pattern.search(q.text)) for q in test) > len(test) // 5
    assert not any(q.text.startswith("Here is what I found") or "First there is" in q.text for q in train)


def test_validation_questions_come_from_domains_neither_trained_nor_evaluated_on():
    calibration = {d.topic for d in pq.CALIBRATION_DOMAINS}
    others = {d.topic for d in pq.TRAIN_DOMAINS + pq.READING_DOMAINS + pq.HELD_OUT_DOMAINS}
    assert calibration and not calibration & others
    assert {q.facts.domain.topic for q in pq.questions(300, seed=0, split="val")} == calibration


def test_each_split_is_repeatable_and_the_splits_differ():
    first = [q.text for q in pq.questions(50, seed=9, split="val")]
    assert first == [q.text for q in pq.questions(50, seed=9, split="val")]
    assert not set(first) & {q.text for q in pq.questions(50, seed=9, split="train")}


def test_the_answers_decide_the_label_and_fit_the_serving_grammar(train):
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from shared.grammar import decision_grammar
    from worker.decoder.grammar import RowGrammars

    base = ROOT / "models" / "demo" / "base"
    tokenizer = AutoTokenizer.from_pretrained(base)
    rows = RowGrammars(tokenizer, AutoConfig.from_pretrained(base).vocab_size, (tokenizer.eos_token_id,), 1,
                       torch.device("cpu"))

    def accepts(grammar: str, text: str) -> bool:
        matcher = rows.matcher(grammar)
        return all(matcher.consume_token(t) for t in tokenizer.encode(text)) and matcher.is_accepting()

    for q in train[:60]:
        laya, kev = pq.laya_answer(q.facts), pq.kev_answer(q.facts)
        assert parse_decision(laya)["decision"] == q.label
        assert parse_decision(kev)["decision"] == q.label
        assert accepts(decision_grammar(q.facts.names, analysis=False), laya), laya
        assert accepts(decision_grammar(q.facts.names, analysis=True), kev), kev


def test_laya_names_every_option_then_scans_the_kept_ones_one_comparison_at_a_time(train):
    for q in train[:300]:
        answer = json.loads(pq.laya_answer(q.facts))
        items = [entry.split(": ", 1) for entry in answer["options"]]
        assert [name for name, _ in items] == q.facts.names
        assert [name for name, said in items if not said.endswith("-> drop")] == q.facts.kept
        kept = [said for name, said in items if not said.endswith("-> drop")]
        winners = [said.rsplit(" -> ", 1)[1] for said in kept[1:]]
        assert answer["decision"] == (winners[-1] if winners else q.facts.kept[0] if kept else "none")


def test_every_comparison_says_which_way_the_objective_goes(train):
    for q in train[:300]:
        wins = "lower wins" if q.facts.objective in ("price", "time", "risk") else "higher wins"
        comparisons = [line for line in pq.kev_answer(q.facts).splitlines()[1:] if "wins" in line]
        assert all(wins in line for line in comparisons)
        assert len(comparisons) == max(len(q.facts.kept) - 1, 0)


def test_the_prose_data_command_writes_training_and_held_out_files(tmp_path):
    done = subprocess.run([sys.executable, "-m", "cli", "models", "prose-data", "--out", str(tmp_path),
                           "--train", "40", "--templated", "10", "--val", "5", "--test", "7",
                           "--tool-calls", "0"],  # the decision data alone (tool requests: tests/test_tool_questions.py)
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for adapter in ("kev", "laya"):
        rows = [json.loads(line) for line in (tmp_path / adapter / "train.jsonl").read_text().splitlines()]
        assert len(rows) == 50
        assert {r["label"] for r in rows} <= {"A", "B", "C", "D", "E", "none"}  # the winner's place, for balance
        assert all(parse_decision(r["completion"]) is not None for r in rows)
    tests = [json.loads(line) for line in (tmp_path / "test_questions.jsonl").read_text().splitlines()]
    assert len(tests) == 7 and all(t["scenario"]["question"] for t in tests)
    assert len((tmp_path / "val_scenarios.jsonl").read_text().splitlines()) == 5
