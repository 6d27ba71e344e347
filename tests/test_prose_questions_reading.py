"""The training split's reading practice (modellab/prose_questions.py): amounts where more is better in many units,
limits met exactly on their bound, decimals, thousands and prices without a currency; answers that read an equal
value as a pass; and the evaluation splits pinned byte for byte: test unchanged from before the practice was added,
validation as it is drawn from the calibration domains."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from modellab import decision_data as dd
from modellab import prose_questions as pq
from shared.decision import parse_decision
from shared.grammar import option_names, question_names

ROOT = Path(__file__).resolve().parents[1]

# sha256 of `write_questions(path, 400, seed=0, split=...)`: the files the shipped adapters were calibrated (val, from
# the calibration domains) and evaluated (test, unchanged since the first round) on, models/smollm2/.
SPLIT_DIGESTS = {
    "test": "301cfbd0d28fd816b0644a15c932ed6a440ff81dee41d5be745b97b2408051d1",
    "val": "5d373d37363958bdeebef7135d6617594c43fea9cfe55c25abd9b624a59ab02f",
}
SHIPPED = {"test": ROOT / "models" / "smollm2" / "test_questions.jsonl",
           "val": ROOT / "models" / "smollm2" / "val_scenarios.jsonl"}


@pytest.fixture(scope="module")
def train() -> list[pq.Question]:
    return list(pq.questions(4000, seed=0, split="train"))


def numeric_on_bound(q: pq.Question) -> list[str]:
    return [] if q.facts.limit is None or q.facts.limit[0] == "risk" else q.facts.on_bound


def more_is_better_amount(q: pq.Question) -> bool:
    f = q.facts
    return f.objective == "amount" or (f.limit is not None and f.limit[0] == "amount")


@pytest.mark.parametrize("split", ["test", "val"])
def test_the_evaluation_splits_are_pinned_byte_for_byte(split, tmp_path):
    path = pq.write_questions(tmp_path / f"{split}.jsonl", 400, seed=0, split=split)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == SPLIT_DIGESTS[split]
    assert digest == hashlib.sha256(SHIPPED[split].read_bytes()).hexdigest()


def test_the_evaluation_splits_draw_none_of_the_reading_practice():
    stems = [re.escape(s.split("{")[0]) for pool in pq.READING_LIMITS.values() for s in pool
             if len(s.split("{")[0]) > 8]
    stems += [re.escape(s) for s in pq.READING_TIME_GOALS if s not in pq.OBJECTIVES["time"].train]
    pattern = re.compile("|".join(stems))
    for split in ("val", "test"):
        for q in pq.questions(300, seed=0, split=split):
            assert q.facts.domain not in pq.READING_DOMAINS
            assert not q.facts.scale and not q.facts.money_bare
            assert not pattern.search(q.text), q.text


def test_more_is_better_amounts_are_well_covered_in_many_units(train):
    amounts = [q for q in train if more_is_better_amount(q)]
    assert 0.30 < len(amounts) / len(train) < 0.45  # 14 % before
    units = Counter(q.facts.domain.amount[1] for q in amounts)
    assert len(units) >= 15
    for unit in ("lumens", "% a year", "km", "miles", "hours a week", "Mbps", "weeks", "seats", "GB"):
        assert units[unit] > 20, unit
    assert sum(q.facts.objective == "amount" for q in train) / len(train) > 0.18
    assert sum(q.facts.limit is not None and q.facts.limit[0] == "amount" for q in train) / len(train) > 0.10
    goals = {g for d in pq.READING_DOMAINS for g in d.goals}
    assert sum(any(g in q.text for g in goals) for q in amounts) > len(amounts) // 4


def test_a_quarter_of_training_questions_have_an_option_exactly_on_the_limit(train):
    on_bound = [q for q in train if numeric_on_bound(q)]
    assert 0.20 < len(on_bound) / len(train) < 0.30  # none before
    assert Counter(q.facts.limit[0] for q in on_bound).keys() == {"price", "time", "rating", "amount"}
    wins = sum(q.label in numeric_on_bound(q) for q in on_bound) / len(on_bound)
    assert 0.6 < wins < 0.9  # usually the option on the bound wins, but not always: no "pick the bound" shortcut
    ways = ("at least", "no less than", "minimum of", "no more than", "up to", "at most", "within", "or less",
            "or more", "max.")
    for way in ways:
        assert any(way in q.text.lower() for q in on_bound), way


def test_options_on_the_bound_are_feasible_and_can_be_gold(train):
    gold_on_bound = 0
    for q in train:
        scenario = q.scenario
        for name in numeric_on_bound(q):
            option = next(o for o in scenario.options if o.name == name)
            assert dd.feasible(scenario, option)
            assert q.facts.ok(name)
        assert dd.gold(scenario) == q.label
        gold_on_bound += q.label in numeric_on_bound(q)
    assert gold_on_bound > 400


def test_the_answers_say_an_option_on_the_bound_meets_the_limit(train):
    for q in [q for q in train if numeric_on_bound(q)][:400]:
        f = q.facts
        attribute, threshold = f.limit
        sign = "<=" if attribute in ("price", "time") else ">="
        said = pq._number(f, attribute, threshold)
        laya = json.loads(pq.laya_answer(f))
        kev = pq.kev_answer(f).splitlines()
        assert kev[0].endswith(f"Limit: {pq._limit_words(f)}.")
        assert (" at most " if sign == "<=" else " at least ") in kev[0]
        for name in f.on_bound:
            assert f"{name}: " in kev[f.names.index(name) + 1]
            assert kev[f.names.index(name) + 1].endswith(f"; {said} {sign} {said} -> keep")
            entry = laya["options"][f.names.index(name)]
            assert entry.startswith(f"{name}: ") and not entry.endswith("-> drop")
        assert laya["decision"] == parse_decision(pq.kev_answer(f))["decision"] == q.label
        if q.label in f.on_bound:
            assert kev[-2] == f"Best: {q.label}"


def reading_domain(topic: str) -> pq.Domain:
    return next(d for d in pq.READING_DOMAINS if d.topic == topic)


def _facts(domain: pq.Domain, values: dict, objective: str, limit: tuple) -> pq.Facts:
    names = list(next(iter(values.values())))
    return pq.Facts(domain, names, values, {}, list(values), objective, limit)


@pytest.mark.parametrize("domain, values, objective, limit, line, gold", [
    # "a projector of at least 3000 lumens, cheapest": the one at 3000 is kept and wins
    (reading_domain("a projector for the meeting room"), {"price": {"Epson": 900, "BenQ": 1200, "Optoma": 700},
                                                          "amount": {"Epson": 3000, "BenQ": 4000, "Optoma": 2500}},
     "price", ("amount", 3000), "Epson: 900 USD, 3000 lumens; 3000 >= 3000 -> keep", "Epson"),
    # "no more than 300": 300 is within budget
    (pq.TRAIN_DOMAINS[2], {"rating": {"ThinkPad": 4, "MacBook": 5, "XPS": 3},
                           "price": {"ThinkPad": 300, "MacBook": 900, "XPS": 250}},
     "rating", ("price", 300), "ThinkPad: 4/5, 300 USD; 300 <= 300 -> keep", "ThinkPad"),
    # "within 2 hours": 2 h is in time
    (pq.TRAIN_DOMAINS[0], {"price": {"train": 40, "bus": 15, "car": 60},
                           "time": {"train": 2, "bus": 5, "car": 1}},
     "price", ("time", 2), "train: 40 EUR, 2 h; 2 <= 2 -> keep", "train"),
])
def test_an_equal_value_reads_as_a_pass(domain, values, objective, limit, line, gold):
    f = _facts(domain, values, objective, limit)
    assert f.label == gold and f.scenario("question").label == gold
    assert line in pq.kev_answer(f).splitlines()
    laya = json.loads(pq.laya_answer(f))
    assert laya["decision"] == gold and not any(e.startswith(f"{gold}:") and "drop" in e for e in laya["options"])


def test_decimals_are_said_and_compared_as_the_question_says_them():
    # a web host priced in USD with an uptime of two decimals (the test's own domain: uptime is a topic of the
    # people's questions, which training never sees)
    host = pq.Domain("a web host for the shop", ("Linode", "OVH", "Vultr"), ("USD", 5, 120, 1), None,
                     amount=("uptime", "%", 9900, 9999, 1), scale=2, says=("has {v} uptime",), goals=("Best uptime.",))
    f = _facts(host, {"amount": {"Linode": 9995, "OVH": 9990, "Vultr": 9950}, "price": {"Linode": 90, "OVH": 40,
                                                                                      "Vultr": 20}},
               "price", ("amount", 9990))
    f.scale = {"amount": 2}
    kev = pq.kev_answer(f)
    assert "Limit: uptime at least 99.9%." in kev
    assert "OVH: 40 USD, 99.9%; 99.9 >= 99.9 -> keep" in kev
    assert "Vultr: 20 USD, 99.5%; 99.5 < 99.9 -> drop" in kev
    assert f.label == "OVH" == f.scenario("q").label


def test_decimals_thousands_and_bare_prices_appear_in_training(train):
    assert 0.08 < sum("rating" in q.facts.scale for q in train) / len(train) < 0.2
    assert sum("amount" in q.facts.scale for q in train) > 100  # interest in percent
    assert 0.05 < sum(q.facts.money_bare for q in train) / len(train) < 0.15
    assert sum(bool(re.search(r"\d,\d{3}", q.text)) for q in train) > 400
    for q in [q for q in train if q.facts.money_bare][:200]:  # no currency in the question, none in Kev's lines
        assert not re.search(r"\d (EUR|USD|GBP|kUSD)\b", pq.kev_answer(q.facts))


def test_reading_questions_name_their_options_in_words_the_grammar_can_hold(train):
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

    picked = [q for q in train if q.facts.domain in pq.READING_DOMAINS or q.facts.scale or numeric_on_bound(q)]
    for q in picked[:300]:
        laya = pq.laya_answer(q.facts)
        names = question_names(q.text)
        assert set(option_names(json.loads(laya)["options"])) <= set(names)
    for q in picked[:40]:
        laya, kev = pq.laya_answer(q.facts), pq.kev_answer(q.facts)
        assert accepts(decision_grammar(q.facts.names, analysis=False), laya), laya
        assert accepts(decision_grammar(q.facts.names, analysis=True), kev), kev


def test_the_templated_checks_read_an_equal_value_as_a_pass():
    s = dd.Scenario(options=(dd.Option("A", 40, "low", 5, 3), dd.Option("B", 30, "medium", 9, 4)),
                    objective="shortest time", budget=40, max_risk="medium", deadline=5)
    assert dd.kev_target(s).splitlines()[0] == "A: cost 40<=40, risk low<=medium, days 5<=5 -> keep"
    assert dd.gold(s) == "A"
