"""Seeded decision scenarios for training and evaluating the tiny Kev and Laya adapters.

A scenario lists 2-5 options ("A".."E"), each with integer cost (k), a risk level, duration in days
and quality 1-9; 1-3 constraints (budget = max cost, max risk, deadline = max days); and one objective.
The gold decision is the option that meets every constraint and is best on the objective, or "none"
when no option meets them all.

Ties: cost, days and quality are drawn without replacement inside a scenario, so they never tie;
risk has only three levels, so "lowest risk" ties are broken by taking the earlier letter.

The wording is deliberately short and regular (plain integers, fixed phrases, fixed order) because the
models trained on it have a few million parameters and read bytes.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shared.settings import ADAPTERS

LETTERS = ("A", "B", "C", "D", "E")
NONE = "none"
LABELS = (*LETTERS, NONE)
RISKS = ("low", "medium", "high")
OBJECTIVES = ("lowest cost", "shortest time", "highest quality", "lowest risk")
SPLITS = ("train", "val", "test")

COST_RANGE = (10, 99)
DAYS_RANGE = (1, 30)
QUALITY_RANGE = (1, 9)
BUDGET_RANGE = (20, 90)
DEADLINE_RANGE = (4, 26)

# Kev's short rationale for a chosen option, per objective.
_RATIONALE = {
    "lowest cost": "cheapest feasible",
    "shortest time": "fastest feasible",
    "highest quality": "best quality feasible",
    "lowest risk": "safest feasible",
}


@dataclass(frozen=True)
class Option:
    name: str
    cost: int
    risk: str
    days: int
    quality: int


@dataclass(frozen=True)
class Scenario:
    options: tuple[Option, ...]
    objective: str
    budget: int | None = None
    max_risk: str | None = None
    deadline: int | None = None
    question: str | None = None  # the plain words it is asked in, when not the scenario format (render_question)
    min_quality: int | None = None  # plain-words questions only (modellab/prose_questions.py): "at least 4 stars"

    @property
    def label(self) -> str:
        return gold(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "options": [asdict(o) for o in self.options],
            "objective": self.objective,
            "budget": self.budget,
            "max_risk": self.max_risk,
            "deadline": self.deadline,
            **({"question": self.question} if self.question is not None else {}),
            **({"min_quality": self.min_quality} if self.min_quality is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Scenario:
        return cls(
            options=tuple(Option(**o) for o in data["options"]),
            objective=data["objective"],
            budget=data.get("budget"),
            max_risk=data.get("max_risk"),
            deadline=data.get("deadline"),
            question=data.get("question"),
            min_quality=data.get("min_quality"),
        )


def _checks(s: Scenario, o: Option) -> list[str]:
    """The constraint checks of `o`, in prompt order, up to and including the first failure."""
    checks: list[str] = []
    if s.budget is not None:
        ok = o.cost <= s.budget
        checks.append(f"cost {o.cost}{'<=' if ok else '>'}{s.budget}")
        if not ok:
            return checks
    if s.max_risk is not None:
        ok = RISKS.index(o.risk) <= RISKS.index(s.max_risk)
        checks.append(f"risk {o.risk}{'<=' if ok else '>'}{s.max_risk}")
        if not ok:
            return checks
    if s.deadline is not None:
        ok = o.days <= s.deadline
        checks.append(f"days {o.days}{'<=' if ok else '>'}{s.deadline}")
    return checks


def feasible(s: Scenario, o: Option) -> bool:
    return (
        (s.budget is None or o.cost <= s.budget)
        and (s.max_risk is None or RISKS.index(o.risk) <= RISKS.index(s.max_risk))
        and (s.deadline is None or o.days <= s.deadline)
        and (s.min_quality is None or o.quality >= s.min_quality)
    )


def _kept(s: Scenario) -> list[Option]:
    return [o for o in s.options if feasible(s, o)]


def objective_key(objective: str, o: Option) -> int:
    """Smaller is better for every objective, so one `min` ranks them all."""
    if objective == "lowest cost":
        return o.cost
    if objective == "shortest time":
        return o.days
    if objective == "highest quality":
        return -o.quality
    if objective == "lowest risk":
        return RISKS.index(o.risk)
    raise ValueError(f"unknown objective {objective!r}")


def _objective_value(objective: str, o: Option) -> str:
    return {"lowest cost": str(o.cost), "shortest time": str(o.days),
            "highest quality": str(o.quality), "lowest risk": o.risk}[objective]


def gold(s: Scenario) -> str:
    kept = _kept(s)
    if not kept:
        return NONE
    # min returns the first minimum, i.e. the earlier letter on a tie.
    return min(kept, key=lambda o: objective_key(s.objective, o)).name


def score_decision(s: Scenario, decision: str) -> bool:
    return decision.strip().lower() == gold(s).lower()


def render_prompt(s: Scenario) -> str:
    if s.question is not None:
        return s.question
    options = "; ".join(f"{o.name} cost {o.cost} risk {o.risk} days {o.days} quality {o.quality}" for o in s.options)
    constraints = []
    if s.budget is not None:
        constraints.append(f"budget {s.budget}")
    if s.max_risk is not None:
        constraints.append(f"max risk {s.max_risk}")
    if s.deadline is not None:
        constraints.append(f"deadline {s.deadline}")
    return f"Options: {options}. Constraints: {', '.join(constraints)}. Objective: {s.objective}."


def _kept_values(s: Scenario, kept: list[Option]) -> list[str]:
    """The answer's "options" field: each option that meets every constraint, with its value on the objective."""
    return [f"{o.name} {_objective_value(s.objective, o)}" for o in kept]


def laya_target(s: Scenario) -> str:
    """One short JSON object. The kept options come first: they are the only scratch space a one-line answer
    has, and a small model that must eliminate and compare inside the single decision token often cannot."""
    return json.dumps({"options": _kept_values(s, _kept(s)), "decision": gold(s)})


def kev_target(s: Scenario) -> str:
    lines = []
    for o in s.options:
        lines.append(f"{o.name}: {', '.join(_checks(s, o))} -> {'keep' if feasible(s, o) else 'drop'}")
    kept = _kept(s)
    label = gold(s)
    if kept:
        lines.append(f"{s.objective}: {', '.join(_kept_values(s, kept))} -> {label}")
        chosen = next(o for o in kept if o.name == label)
        answer = {"decision": label, "rationale": _RATIONALE[s.objective],
                  "options": _kept_values(s, kept), "risks": [f"risk {chosen.risk}"]}
    else:
        lines.append(f"no option kept -> {NONE}")
        answer = {"decision": NONE, "rationale": "every option fails a constraint",
                  "options": [], "risks": ["no option meets all constraints"]}
    lines.append(json.dumps(answer))
    return "\n".join(lines)


def _random_scenario(rng: random.Random, k: int) -> Scenario:
    costs = rng.sample(range(COST_RANGE[0], COST_RANGE[1] + 1), k)
    days = rng.sample(range(DAYS_RANGE[0], DAYS_RANGE[1] + 1), k)
    quality = rng.sample(range(QUALITY_RANGE[0], QUALITY_RANGE[1] + 1), k)
    options = tuple(
        Option(LETTERS[i], costs[i], rng.choice(RISKS), days[i], quality[i]) for i in range(k)
    )
    kinds = rng.sample(("budget", "max_risk", "deadline"), rng.randint(1, 3))
    return Scenario(
        options=options,
        objective=rng.choice(OBJECTIVES),
        # "max risk high" would constrain nothing, so only low/medium are drawn.
        max_risk=rng.choice(RISKS[:2]) if "max_risk" in kinds else None,
        budget=rng.randint(*BUDGET_RANGE) if "budget" in kinds else None,
        deadline=rng.randint(*DEADLINE_RANGE) if "deadline" in kinds else None,
    )


def sample_scenario(rng: random.Random, none_share: float = 0.15) -> Scenario:
    """One scenario whose gold label is drawn first, then met by rejection sampling.

    The option count k is drawn with weight k (more options, more to reason about; later letters get
    more mass), then the label is "none" with probability `none_share`, else a uniform letter among
    the k. Uniform within each k means the option count says nothing about which letter wins."""
    if not 0.0 <= none_share <= 1.0:
        raise ValueError("none_share must be within [0, 1]")
    k = rng.choices((2, 3, 4, 5), weights=(2, 3, 4, 5))[0]
    target = NONE if rng.random() < none_share else LETTERS[rng.randrange(k)]
    while True:
        s = _random_scenario(rng, k)
        if gold(s) == target:
            return s


def generate(n: int, seed: int, none_share: float = 0.15) -> list[Scenario]:
    rng = random.Random(seed)
    return [sample_scenario(rng, none_share) for _ in range(n)]


def label_counts(records: Iterable[Scenario | Mapping[str, Any]]) -> dict[str, int]:
    """Gold label counts (the letter labels always present, zeros included; a question's named option counted
    under its name) of scenarios or JSONL records."""
    counts = dict.fromkeys(LABELS, 0)
    for r in records:
        label = r.label if isinstance(r, Scenario) else r["label"]
        counts[label] = counts.get(label, 0) + 1
    return counts


# Out-of-format questions: the same decisions asked in plain words, with named options. Each theme names up to five
# options and says what its cost, days and quality are in.
THEMES = (
    {"topic": "how to get from Paris to Berlin", "names": ("train", "flight", "bus", "car", "ferry"),
     "cost": "euros", "days": "hours", "quality": "comfort"},
    {"topic": "a vendor to build our billing system", "names": ("Acme", "Globex", "Initech", "Umbrella", "Hooli"),
     "cost": "thousand dollars", "days": "weeks", "quality": "quality"},
    {"topic": "where to hold the team offsite", "names": ("Lyon", "Porto", "Krakow", "Ghent", "Turin"),
     "cost": "hundred euros a head", "days": "hours of travel", "quality": "rating"},
    {"topic": "a laptop for the new hire", "names": ("ThinkPad", "MacBook", "XPS", "Framework", "Surface"),
     "cost": "tens of dollars", "days": "days to deliver", "quality": "review score"},
)
_OBJECTIVE_WORDS = {"lowest cost": "the cheapest", "shortest time": "the fastest", "highest quality": "the best",
                    "lowest risk": "the safest"}


def render_question(s: Scenario, theme: Mapping[str, Any]) -> str:
    """`s` (its options already named from `theme`) as a question in plain words, ending with its `Options:`
    line, the form a person would type."""
    sentences = [f"I need to choose {theme['topic']}."]
    for o in s.options:
        sentences.append(f"{o.name}: {o.cost} {theme['cost']}, {o.days} {theme['days']}, {o.risk} risk, "
                         f"{theme['quality']} {o.quality} out of 9.")
    if s.budget is not None:
        sentences.append(f"I can spend at most {s.budget} {theme['cost']}.")
    if s.max_risk is not None:
        sentences.append(f"I accept at most {s.max_risk} risk.")
    if s.deadline is not None:
        sentences.append(f"It must take at most {s.deadline} {theme['days']}.")
    sentences.append(f"I want {_OBJECTIVE_WORDS[s.objective]} option that meets all of that; if none does, say none.")
    sentences.append(f"Options: {', '.join(o.name for o in s.options)}.")
    return " ".join(sentences)


def sample_question(rng: random.Random) -> Scenario:
    """A scenario of 2-4 options named after a random theme, asked in plain words."""
    theme = rng.choice(THEMES)
    while True:
        s = sample_scenario(rng)
        if len(s.options) <= 4:
            break
    names = rng.sample(theme["names"], len(s.options))
    named = Scenario(options=tuple(Option(n, o.cost, o.risk, o.days, o.quality) for n, o in zip(names, s.options)),
                     objective=s.objective, budget=s.budget, max_risk=s.max_risk, deadline=s.deadline)
    return dataclasses.replace(named, question=render_question(named, theme))


# The held-out questions are the first ones of their own stream; training never draws any of this many.
HELD_OUT_QUESTIONS = 1_000


def held_out_questions(n: int, seed: int) -> list[Scenario]:
    if not 0 <= n <= HELD_OUT_QUESTIONS:
        raise ValueError(f"at most {HELD_OUT_QUESTIONS} held-out questions can be drawn, not {n}")
    rng = random.Random(f"{seed}/questions")
    return [sample_question(rng) for _ in range(n)]


def write_questions(path: Path, n: int, seed: int) -> Path:
    """`n` out-of-format questions as JSONL in the test scenarios' format (`kevlaya eval --scenarios` reads it)."""
    _write_jsonl(path, ({"id": f"question-{i:05d}", "scenario": s.to_dict(), "label": s.label}
                        for i, s in enumerate(held_out_questions(n, seed))))
    return path


def _write_jsonl(path: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_dataset(
    out_dir: Path, n_train: int, n_val: int, n_test: int, seed: int, none_share: float = 0.15,
    question_share: float = 0.0,
) -> dict[str, Path]:
    """Write `<adapter>/<split>.jsonl` for both adapters, and `val_scenarios.jsonl` and `test_scenarios.jsonl`.

    Each split draws from its own sub-stream of `seed`; a prompt already used by an earlier split
    (test first, then val, then train) is redrawn, so no evaluation prompt is ever trained on. A share
    `question_share` of the train and val prompts are questions in plain words (`sample_question`), none of
    them one of the held-out questions; the test split stays in the scenario format.
    Returns the written paths keyed "<adapter>/<split>", "val_scenarios" and "test_scenarios"."""
    if not 0.0 <= question_share <= 1.0:
        raise ValueError("question_share must be within [0, 1]")
    out_dir = Path(out_dir)
    seen = {render_prompt(s) for s in held_out_questions(HELD_OUT_QUESTIONS, seed)} if question_share else set()
    splits: dict[str, list[Scenario]] = {}
    for split, n in (("test", n_test), ("val", n_val), ("train", n_train)):
        rng = random.Random(f"{seed}/{split}")
        share = 0.0 if split == "test" else question_share
        chosen: list[Scenario] = []
        while len(chosen) < n:
            s = sample_question(rng) if share and rng.random() < share else sample_scenario(rng, none_share)
            prompt = render_prompt(s)
            if prompt not in seen:
                seen.add(prompt)
                chosen.append(s)
        splits[split] = chosen

    targets = {"kev": kev_target, "laya": laya_target}
    paths: dict[str, Path] = {}
    for adapter in ADAPTERS:
        for split in SPLITS:
            path = out_dir / adapter / f"{split}.jsonl"
            _write_jsonl(path, ({"prompt": render_prompt(s), "completion": targets[adapter](s), "label": s.label}
                                for s in splits[split]))
            paths[f"{adapter}/{split}"] = path
    for split in ("val", "test"):  # for `kevlaya models calibrate` and `kevlaya eval`
        path = out_dir / f"{split}_scenarios.jsonl"
        _write_jsonl(path, ({"id": f"{split}-{i:05d}", "scenario": s.to_dict(), "label": s.label}
                            for i, s in enumerate(splits[split])))
        paths[f"{split}_scenarios"] = path
    return paths
