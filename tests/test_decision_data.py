"""The decision scenario generator: determinism, the gold rule (re-derived here independently),
label balance, targets that parse as decisions, and the dataset files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modellab.decision_data import (
    LETTERS,
    Scenario,
    generate,
    kev_target,
    label_counts,
    laya_target,
    render_prompt,
    score_decision,
    write_dataset,
)
from shared.decision import parse_decision

RISK_RANK = {"low": 0, "medium": 1, "high": 2}


@pytest.fixture(scope="module")
def scenarios() -> list[Scenario]:
    return generate(2000, seed=7)


def brute_force_feasible(s: Scenario) -> list[str]:
    d = s.to_dict()
    names = []
    for o in d["options"]:
        if d["budget"] is not None and o["cost"] > d["budget"]:
            continue
        if d["max_risk"] is not None and RISK_RANK[o["risk"]] > RISK_RANK[d["max_risk"]]:
            continue
        if d["deadline"] is not None and o["days"] > d["deadline"]:
            continue
        names.append(o["name"])
    return names


def beats(objective: str, a: dict, b: dict) -> bool:
    """Whether option `a` is strictly better than `b` on the objective."""
    if objective == "lowest cost":
        return a["cost"] < b["cost"]
    if objective == "shortest time":
        return a["days"] < b["days"]
    if objective == "highest quality":
        return a["quality"] > b["quality"]
    assert objective == "lowest risk"
    return RISK_RANK[a["risk"]] < RISK_RANK[b["risk"]]


def test_deterministic_for_a_seed_and_different_across_seeds() -> None:
    a = [s.to_dict() for s in generate(200, seed=1)]
    assert a == [s.to_dict() for s in generate(200, seed=1)]
    assert a != [s.to_dict() for s in generate(200, seed=2)]


def test_scenario_shape(scenarios: list[Scenario]) -> None:
    for s in scenarios:
        assert 2 <= len(s.options) <= 5
        assert [o.name for o in s.options] == list(LETTERS[: len(s.options)])
        assert 1 <= sum(c is not None for c in (s.budget, s.max_risk, s.deadline)) <= 3
        for o in s.options:
            assert 10 <= o.cost <= 99 and 1 <= o.days <= 30 and 1 <= o.quality <= 9
            assert o.risk in RISK_RANK
        # Cost, days and quality never tie inside a scenario (documented: only risk ties).
        for attr in ("cost", "days", "quality"):
            assert len({getattr(o, attr) for o in s.options}) == len(s.options)


def test_gold_rule_matches_brute_force(scenarios: list[Scenario]) -> None:
    for s in scenarios:
        kept = brute_force_feasible(s)
        options = {o["name"]: o for o in s.to_dict()["options"]}
        if not kept:
            assert s.label == "none"
            continue
        assert s.label in kept
        chosen = options[s.label]
        for name in kept:
            assert not beats(s.objective, options[name], chosen)
            # Ties (only possible on risk) go to the earlier letter.
            if name < s.label:
                assert beats(s.objective, chosen, options[name])


def test_round_trip_and_scoring(scenarios: list[Scenario]) -> None:
    for s in scenarios[:200]:
        again = Scenario.from_dict(json.loads(json.dumps(s.to_dict())))
        assert again == s and again.label == s.label
        assert score_decision(again, s.label)
        wrong = "none" if s.label != "none" else "A"
        assert not score_decision(again, wrong)


def test_label_distribution(scenarios: list[Scenario]) -> None:
    counts = label_counts(scenarios)
    assert sum(counts.values()) == 2000
    assert abs(counts["none"] / 2000 - 0.15) < 0.03
    for letter in "ABC":
        assert counts[letter] / 2000 > 0.12, counts
    for letter in "DE":
        assert counts[letter] / 2000 > 0.03, counts

    shifted = label_counts(generate(2000, seed=7, none_share=0.4))
    assert abs(shifted["none"] / 2000 - 0.4) < 0.03


def objective_value(s: Scenario, name: str) -> str:
    o = next(o for o in s.to_dict()["options"] if o["name"] == name)
    field = {"lowest cost": "cost", "shortest time": "days", "highest quality": "quality", "lowest risk": "risk"}
    return str(o[field[s.objective]])


def test_targets_parse_to_the_label(scenarios: list[Scenario]) -> None:
    for s in scenarios:
        kept = [f"{name} {objective_value(s, name)}" for name in brute_force_feasible(s)]
        laya = laya_target(s)
        assert json.loads(laya) == {"options": kept, "decision": s.label}
        assert parse_decision(laya)["decision"] == s.label

        kev = kev_target(s)
        parsed = parse_decision(kev)
        assert parsed is not None and parsed["decision"] == s.label
        assert parsed["options"] == kept
        assert parsed["rationale"] and parsed["risks"]
        lines = kev.splitlines()
        # One line per option, in order, then the comparison, then the JSON.
        assert len(lines) == len(s.options) + 2
        for o, line in zip(s.options, lines):
            assert line.startswith(f"{o.name}: ")
            assert line.endswith("-> keep" if o.name in brute_force_feasible(s) else "-> drop")
        if kept:
            assert lines[-2] == f"{s.objective}: {', '.join(kept)} -> {s.label}"


def test_prompt_is_regular(scenarios: list[Scenario]) -> None:
    for s in scenarios[:200]:
        p = render_prompt(s)
        assert p.startswith("Options: ") and p.endswith(f"Objective: {s.objective}.")
        for o in s.options:
            assert f"{o.name} cost {o.cost} risk {o.risk} days {o.days} quality {o.quality}" in p


def test_write_dataset(tmp_path: Path) -> None:
    paths = write_dataset(tmp_path, n_train=600, n_val=100, n_test=200, seed=3)
    rows = {}
    for adapter in ("kev", "laya"):
        for split, n in (("train", 600), ("val", 100), ("test", 200)):
            path = tmp_path / adapter / f"{split}.jsonl"
            assert paths[f"{adapter}/{split}"] == path
            records = [json.loads(line) for line in path.read_text().splitlines()]
            assert len(records) == n
            for r in records:
                assert set(r) == {"prompt", "completion", "label"}
                assert parse_decision(r["completion"])["decision"] == r["label"]
            rows[adapter, split] = records

    for adapter in ("kev", "laya"):
        prompts = {split: {r["prompt"] for r in rows[adapter, split]} for split in ("train", "val", "test")}
        assert len(prompts["test"]) == 200
        assert not prompts["test"] & prompts["train"]
        assert not prompts["val"] & prompts["train"]
        assert not prompts["test"] & prompts["val"]
    # Both adapters see the same prompts and labels.
    assert [(r["prompt"], r["label"]) for r in rows["kev", "test"]] == [
        (r["prompt"], r["label"]) for r in rows["laya", "test"]
    ]

    test_rows = [json.loads(line) for line in paths["test_scenarios"].read_text().splitlines()]
    assert len(test_rows) == 200
    assert len({r["id"] for r in test_rows}) == 200
    for r, laya in zip(test_rows, rows["laya", "test"]):
        assert set(r) == {"id", "scenario", "label"}
        s = Scenario.from_dict(r["scenario"])
        assert s.label == r["label"] == laya["label"]
        assert render_prompt(s) == laya["prompt"]

    val_rows = [json.loads(line) for line in paths["val_scenarios"].read_text().splitlines()]
    assert [render_prompt(Scenario.from_dict(r["scenario"])) for r in val_rows] == [
        r["prompt"] for r in rows["laya", "val"]]

    assert sum(label_counts(rows["laya", "train"]).values()) == 600
    # Same seed, same files.
    again = write_dataset(tmp_path / "again", n_train=600, n_val=100, n_test=200, seed=3)
    assert again["kev/train"].read_text() == paths["kev/train"].read_text()


def test_questions_in_plain_words_offer_their_named_options_and_keep_the_rule(tmp_path: Path) -> None:
    from modellab.decision_data import write_questions
    from shared.decision import offered_options

    path = write_questions(tmp_path / "questions.jsonl", 60, seed=4)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 60 and path.read_text() == write_questions(tmp_path / "again.jsonl", 60, seed=4).read_text()
    for row in rows:
        scenario = Scenario.from_dict(row["scenario"])
        names = [o.name for o in scenario.options]
        question = render_prompt(scenario)
        assert 2 <= len(names) <= 4 and not set(names) & set("ABCDE")  # named, not lettered
        assert offered_options(question) == names  # what the decision grammar will allow, besides "none"
        assert row["label"] == scenario.label in [*names, "none"]
        assert question.endswith(f"Options: {', '.join(names)}.") and "cost" not in question


def test_training_questions_are_never_the_held_out_ones(tmp_path: Path) -> None:
    from modellab.decision_data import HELD_OUT_QUESTIONS, held_out_questions

    paths = write_dataset(tmp_path, n_train=800, n_val=100, n_test=100, seed=0, question_share=0.5)
    held_out = {render_prompt(s) for s in held_out_questions(HELD_OUT_QUESTIONS, seed=0)}
    for split in ("train", "val"):
        rows = [json.loads(line) for line in paths[f"laya/{split}"].read_text().splitlines()]
        questions = [r for r in rows if not r["prompt"].startswith("Options: ")]
        assert 0.35 * len(rows) < len(questions) < 0.65 * len(rows)
        assert not {r["prompt"] for r in questions} & held_out
        # A question's answer names its options, never the letters of the scenario format.
        for r in questions:
            assert r["label"] == "none" or f"{r['label']}:" in r["prompt"]
    test_prompts = [json.loads(line)["prompt"] for line in paths["laya/test"].read_text().splitlines()]
    assert all(p.startswith("Options: ") for p in test_prompts)
    with pytest.raises(ValueError, match="at most 1000"):
        held_out_questions(HELD_OUT_QUESTIONS + 1, seed=0)


def test_the_data_command_writes_held_out_splits_that_do_not_depend_on_the_training_count(tmp_path: Path) -> None:
    """`kevlaya models data --train 0` writes the validation and test scenarios a full build draws: how the shipped
    `models/demo/val_scenarios.jsonl` is written again without the 40,000 training prompts."""
    import subprocess
    import sys

    def data(out: Path, train: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cli", "models", "data", "--out", str(out), "--train",
                               str(train), "--val", "30", "--test", "40", "--seed", "5"], capture_output=True,
                              text=True, timeout=120)

    small, large = data(tmp_path / "small", 0), data(tmp_path / "large", 200)
    assert small.returncode == 0 and large.returncode == 0, small.stderr + large.stderr
    for name in ("val_scenarios.jsonl", "test_scenarios.jsonl"):
        assert (tmp_path / "small" / name).read_text() == (tmp_path / "large" / name).read_text()
    assert len((tmp_path / "small" / "val_scenarios.jsonl").read_text().splitlines()) == 30
    assert len((tmp_path / "large" / "laya" / "train.jsonl").read_text().splitlines()) == 200
    assert "val_scenarios" in small.stdout
    refused = data(tmp_path / "bad", -1)
    assert refused.returncode == 2 and "--train" in refused.stderr and "Traceback" not in refused.stderr
