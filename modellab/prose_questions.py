"""Decision questions in plain words, as people ask them, for training and evaluating Kev and Laya on a real base.

A question names two to four options by words, gives each option's figures in any order and in the units of its
domain (prices in euros, dollars or pounds, times in minutes, hours, days or weeks, ratings in stars or out of ten,
amounts such as storage or seats, and risk levels), says its objective in one of many ways (cheapest, fastest, best
rated, most of something, least risk), may add a limit that rules options out (often the otherwise best one), and
may mention facts that do not matter. The gold decision is the option that meets the limit and is best on the
objective, or "none" when no option meets it.

Evaluation questions come only from domains training never sees, and half of their sentence shapes, objective and
limit phrasings are held out as well, so the figures measure reading, not recall (`split="test"`).

Each question is stored as a `Scenario` (modellab/decision_data.py): price in `cost`, time in `days`, a rating or
an amount in `quality` (higher is better), and the risk level in `risk`, so `kevlaya eval` scores it as any other.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modellab.decision_data import (
    LETTERS,
    NONE,
    RISKS,
    Option,
    Scenario,
    feasible,
    gold,
    kev_target,
    laya_target,
    render_prompt,
    sample_scenario,
)

# -- domains -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Domain:
    topic: str  # "how to get to Lyon": follows "I need to choose" / "Help me pick"
    names: tuple[str, ...]
    money: tuple[str, int, int, int]  # currency (EUR, USD, GBP, kUSD), low, high, step
    time: tuple[str, int, int, int] | None  # unit (min, h, days, weeks), low, high, step
    rating: int | None = None  # the top of the rating scale (5 or 10), if options are rated
    amount: tuple[str, str, int, int, int] | None = None  # noun, unit, low, high, step: "storage", "GB", ...
    risk: str | None = None  # what could go wrong: "delay", "failure"
    extra_time: str | None = None  # a time added to some options: "of airport time"
    verb: str = "takes"  # how a time is said: "takes", "arrives in", "needs"


TRAIN_DOMAINS = (
    Domain("how to get to Lyon", ("train", "flight", "bus", "car", "ferry"), ("EUR", 15, 180, 5), ("h", 1, 9, 1),
           rating=5, risk="delay", extra_time="of airport time"),
    Domain("a vendor to build our billing system", ("Acme", "Globex", "Initech", "Umbrella", "Hooli"),
           ("kUSD", 20, 240, 5), ("weeks", 2, 30, 1), rating=10, risk="delivery"),
    Domain("a laptop for the new hire", ("ThinkPad", "MacBook", "XPS", "Framework", "Surface"),
           ("USD", 600, 2600, 50), ("days", 1, 21, 1), rating=5, amount=("storage", "GB", 128, 2048, 128),
           verb="arrives in"),
    Domain("a venue for the team offsite", ("Porto", "Krakow", "Ghent", "Turin", "Seville"), ("EUR", 900, 9000, 100),
           ("h", 1, 12, 1), rating=10, amount=("capacity", "people", 20, 200, 10), risk="cancellation"),
    Domain("a hotel for the conference", ("Hilton", "Ibis", "Novotel", "Marriott", "Mercure"), ("EUR", 60, 420, 10),
           ("min", 5, 60, 5), rating=5, verb="is a walk of"),
    Domain("a cloud provider for our backups", ("AWS", "Azure", "GCP", "Backblaze", "Wasabi"), ("USD", 20, 400, 5),
           ("h", 1, 48, 1), rating=10, amount=("storage", "TB", 1, 50, 1), risk="outage", verb="restores in"),
    Domain("a phone plan", ("Vodafone", "Orange", "Lebara", "Tesco", "Giffgaff"), ("GBP", 5, 60, 1), None,
           rating=5, amount=("data", "GB", 5, 200, 5)),
    Domain("a flat to rent", ("Elm Street", "Harbour View", "Old Town", "Riverside", "Park Lane"),
           ("EUR", 600, 2600, 50), ("min", 10, 90, 5), rating=10, amount=("space", "square metres", 30, 120, 5),
           verb="is a commute of"),
    Domain("a contractor to fix the roof", ("Smith & Sons", "RoofPro", "TopCover", "Brightwell", "Apex"),
           ("GBP", 800, 9000, 100), ("days", 1, 20, 1), rating=5, risk="overrun"),
    Domain("a supplier of steel parts", ("Nordmetal", "Ferro", "SteelCo", "Ironside", "Baltic Forge"),
           ("kUSD", 10, 150, 5), ("weeks", 1, 16, 1), rating=10, risk="quality"),
    Domain("a car to buy", ("Corolla", "Golf", "Civic", "Model 3", "Octavia"), ("EUR", 14000, 52000, 500), None,
           rating=10, amount=("range", "km", 300, 900, 25), risk="breakdown"),
    Domain("an online course on data science", ("Coursera", "Udemy", "edX", "DataCamp", "Udacity"),
           ("USD", 20, 900, 10), ("weeks", 2, 26, 1), rating=5),
    Domain("a delivery service for our parcels", ("DHL", "UPS", "FedEx", "DPD", "GLS"), ("EUR", 4, 60, 1),
           ("days", 1, 10, 1), rating=5, risk="loss", verb="delivers in"),
    Domain("a restaurant for the team dinner", ("Luigi's", "Sakura", "El Toro", "Le Petit", "Spice Route"),
           ("EUR", 20, 140, 5), ("min", 5, 60, 5), rating=5, amount=("seats", "seats", 10, 80, 2),
           verb="is a drive of"),
    Domain("a database for the new app", ("PostgreSQL", "MySQL", "MongoDB", "Cassandra", "DynamoDB"),
           ("USD", 0, 900, 25), ("weeks", 1, 12, 1), rating=10, risk="migration", verb="needs setup of"),
    Domain("a job offer to accept", ("Northwind", "Contoso", "Fabrikam", "Tailspin", "Litware"),
           ("EUR", 0, 0, 1), ("min", 10, 90, 5), rating=10, amount=("salary", "thousand euros a year", 38, 120, 1),
           verb="is a commute of"),
    Domain("a gym to join", ("FitZone", "PureGym", "Iron Temple", "CityFit", "Anytime"), ("EUR", 15, 90, 1),
           ("min", 5, 45, 5), rating=5, verb="is a walk of"),
    Domain("an insurance plan for the house", ("Allianz", "AXA", "Aviva", "Zurich", "Generali"),
           ("EUR", 150, 1800, 25), None, rating=10, amount=("cover", "thousand euros", 100, 900, 25),
           risk="claim refusal"),
)

# Never trained on: the evaluation's questions come from these alone.
HELD_OUT_DOMAINS = (
    Domain("a wedding photographer", ("Lumen Studio", "Anna Berg", "Pixel & Co", "Marco Ricci", "Goldlight"),
           ("EUR", 800, 4500, 50), ("weeks", 1, 12, 1), rating=5, risk="no-show", verb="delivers the photos in"),
    Domain("a daycare for our son", ("Little Steps", "Sunflower", "Kinderhaus", "Bright Start", "Tiny Town"),
           ("EUR", 300, 1600, 25), ("min", 5, 45, 5), rating=10, amount=("opening", "hours a day", 6, 12, 1),
           verb="is a drive of"),
    Domain("an electricity tariff", ("Octopus", "EDF", "E.ON", "Ovo", "Bulb"), ("GBP", 60, 220, 1), None,
           rating=5, risk="price rise"),
    Domain("a printing shop for the flyers", ("PrintHub", "InkWorks", "CopyCat", "Papyrus", "QuickPrint"),
           ("EUR", 40, 600, 10), ("days", 1, 14, 1), rating=5, amount=("copies", "copies", 500, 5000, 250),
           risk="misprint", verb="prints in"),
    Domain("a hiking route for Saturday", ("Ridge Trail", "Lake Loop", "Pine Path", "Summit Way", "Valley Walk"),
           ("EUR", 0, 0, 1), ("h", 2, 9, 1), rating=10, amount=("views", "viewpoints", 1, 12, 1), risk="injury"),
    Domain("a moving company", ("Movers Inc", "BoxBros", "SwiftMove", "CarryAll", "Two Men"), ("USD", 400, 4000, 50),
           ("days", 1, 10, 1), rating=5, risk="damage", verb="needs"),
)

# -- how figures are said ------------------------------------------------------------------------------------------

_MONEY = {
    "EUR": ("€{v}", "{v} EUR", "{v} euros"),
    "USD": ("${v}", "{v} USD", "{v} dollars"),
    "GBP": ("£{v}", "{v} GBP", "{v} pounds"),
    "kUSD": ("${v}k", "{v}k USD", "{v} thousand dollars"),
}
_TIME = {"min": ("{v} min", "{v} minutes"), "h": ("{v} h", "{v} hours"), "days": ("{v} days",),
         "weeks": ("{v} weeks",)}
_TIME_SHORT = {"min": "min", "h": "h", "days": "days", "weeks": "weeks"}
_RATING = {5: ("{v} stars", "{v}/5", "{v} out of 5"), 10: ("{v}/10", "{v} out of 10")}


@dataclass
class Wording:
    """The forms one question uses, drawn once so that its figures are said consistently."""

    money: str
    time: str
    rating: str
    extra_time_share: float

    @classmethod
    def draw(cls, rng: random.Random, d: Domain) -> Wording:
        return cls(money=rng.choice(_MONEY[d.money[0]]), time=rng.choice(_TIME[d.time[0]]) if d.time else "",
                   rating=rng.choice(_RATING[d.rating]) if d.rating else "",
                   extra_time_share=0.35 if d.extra_time else 0.0)


# -- a question's content ------------------------------------------------------------------------------------------

ATTRIBUTES = ("price", "time", "rating", "amount", "risk")
_LOWER_IS_BETTER = {"price", "time", "risk"}


@dataclass
class Facts:
    domain: Domain
    names: list[str]
    values: dict[str, dict[str, Any]]  # attribute -> option name -> value (risk: a level)
    extra: dict[str, int]  # option -> the added time (`extra_time`), part of its time value
    shown: list[str]  # the attributes the question gives, in its order
    objective: str
    limit: tuple[str, Any] | None  # (attribute, threshold): price/time at most, rating/amount at least, risk at most

    def ok(self, name: str) -> bool:
        if self.limit is None:
            return True
        attribute, threshold = self.limit
        value = self.values[attribute][name]
        if attribute == "risk":
            return RISKS.index(value) <= RISKS.index(threshold)
        return value <= threshold if attribute in _LOWER_IS_BETTER else value >= threshold

    def rank(self, name: str) -> int:
        value = self.values[self.objective][name]
        value = RISKS.index(value) if self.objective == "risk" else value
        return value if self.objective in _LOWER_IS_BETTER else -value

    @property
    def kept(self) -> list[str]:
        return [n for n in self.names if self.ok(n)]

    @property
    def label(self) -> str:
        kept = self.kept
        return min(kept, key=self.rank) if kept else NONE

    def scenario(self, question: str) -> Scenario:
        """As a `Scenario` whose gold is this question's (checked by `sample`)."""
        v = self.values
        options = tuple(Option(n, v["price"][n] if "price" in v else 0, v["risk"][n] if "risk" in v else "low",
                               v["time"][n] if "time" in v else 0,
                               v[self.quality_attribute][n] if self.quality_attribute else 0) for n in self.names)
        objective = {"price": "lowest cost", "time": "shortest time", "rating": "highest quality",
                     "amount": "highest quality", "risk": "lowest risk"}[self.objective]
        limit = dict.fromkeys(("budget", "max_risk", "deadline", "min_quality"))
        if self.limit is not None:
            attribute, threshold = self.limit
            limit[{"price": "budget", "time": "deadline", "risk": "max_risk", "rating": "min_quality",
                   "amount": "min_quality"}[attribute]] = threshold
        return Scenario(options=options, objective=objective, question=question, **limit)

    @property
    def quality_attribute(self) -> str | None:
        return next((a for a in ("rating", "amount") if a in self.values), None)


def _distinct(rng: random.Random, low: int, high: int, step: int, k: int) -> list[int]:
    return [low + step * i for i in rng.sample(range((high - low) // step + 1), k)]


def _draw_facts(rng: random.Random, d: Domain) -> Facts:
    k = rng.choices((2, 3, 4), weights=(3, 4, 3))[0]
    names = rng.sample(d.names, k)
    available = [a for a in ATTRIBUTES if {"price": d.money[2] > 0, "time": d.time is not None,
                                           "rating": d.rating is not None, "amount": d.amount is not None,
                                           "risk": d.risk is not None}[a]]
    if "rating" in available and "amount" in available:  # one "higher is better" figure a question, at most
        available.remove(rng.choice(("rating", "amount")))
    shown = rng.sample(available, min(len(available), rng.choice((2, 2, 3))))
    values: dict[str, dict[str, Any]] = {}
    extra: dict[str, int] = {}
    for a in shown:
        if a == "price":
            _, low, high, step = d.money
            values[a] = dict(zip(names, _distinct(rng, low, high, step, k)))
        elif a == "time":
            unit, low, high, step = d.time
            values[a] = dict(zip(names, _distinct(rng, low, high, step, k)))
        elif a == "rating":
            values[a] = dict(zip(names, _distinct(rng, 1, d.rating, 1, k)))
        elif a == "amount":
            _, _, low, high, step = d.amount
            values[a] = dict(zip(names, _distinct(rng, low, high, step, k)))
        else:
            values[a] = {n: rng.choice(RISKS) for n in names}
    if "time" in values and d.extra_time:
        for n in names:
            if rng.random() < 0.35 and values["time"][n] > d.time[1]:
                extra[n] = rng.randint(1, values["time"][n] - d.time[1])
    objective = rng.choice(shown)
    limit = None
    others = [a for a in shown if a != objective]
    if others and rng.random() < 0.6:
        limit = _draw_limit(rng, rng.choice(others), values, names, objective)
    return Facts(d, names, values, extra, shown, objective, limit)


def _draw_limit(rng: random.Random, attribute: str, values: dict[str, dict[str, Any]], names: list[str],
                objective: str) -> tuple[str, Any] | None:
    """A threshold on `attribute` that no option sits on; most often it rules out the option that would win
    without it, so the limit must be read."""
    if attribute == "risk":
        levels = set(values["risk"].values())
        if levels == {"low"}:
            return None
        return "risk", rng.choice(("low", "medium")) if "high" in levels else "low"
    ordered = sorted(values[attribute].values())
    lower_is_better = attribute in _LOWER_IS_BETTER
    cuts = [(a + b) // 2 for a, b in zip(ordered, ordered[1:]) if b - a > 1]
    if not cuts:
        return None
    best = min(names, key=lambda n: values[objective][n] if objective in _LOWER_IS_BETTER and objective != "risk"
               else (RISKS.index(values[objective][n]) if objective == "risk" else -values[objective][n]))
    ruling_out = [c for c in cuts if (values[attribute][best] > c if lower_is_better else values[attribute][best] < c)]
    cut = rng.choice(ruling_out) if ruling_out and rng.random() < 0.7 else rng.choice(cuts)
    if rng.random() < 0.06:  # sometimes nothing meets it
        cut = ordered[0] - 1 if lower_is_better else ordered[-1] + 1
        if cut < 0:
            return None
    return attribute, cut


# -- saying it -----------------------------------------------------------------------------------------------------


@dataclass
class Phrasing:
    """The sentence pools a question draws from; `held_out` ones are never trained on."""

    train: tuple[str, ...]
    held_out: tuple[str, ...] = field(default=())

    def pick(self, rng: random.Random, held_out: bool) -> str:
        pool = self.held_out if held_out and self.held_out else self.train
        return rng.choice(pool)


INTROS = Phrasing(("I need to choose {topic}.", "Help me pick {topic}.", "We are deciding on {topic}.",
                   "I'm looking at {topic}.", "Which one should I go for? It's about {topic}.", ""),
                  ("Quick question about {topic}.", "Trying to settle on {topic} today."))
OBJECTIVES = {
    "price": Phrasing(("I care most about cost.", "I want the cheapest.", "Money is tight, so price matters most.",
                       "Which is the least expensive?", "Keep the cost as low as possible.",
                       "I want to pay as little as possible.", "Go for the lowest price."),
                      ("The lower the bill, the better.", "I'd like to spend the least.")),
    "time": Phrasing(("I care most about time.", "Which is fastest?", "I'm in a hurry.", "Speed matters most.",
                      "I want the quickest one.", "Time is what counts for me."),
                     ("I want it done soonest.", "The shorter, the better.")),
    "rating": Phrasing(("I want the best rated.", "Quality matters most.", "Pick the highest rated one.",
                        "I want the best one.", "Reviews are what I care about."),
                       ("I want the nicest one.", "Go for the top reviews.")),
    "amount": Phrasing(("I want the most {noun}.", "More {noun} is what matters.", "As much {noun} as possible.",
                        "I care most about {noun}."),
                       ("The more {noun}, the better.", "{Noun} is my priority.")),
    "risk": Phrasing(("I want the safest option.", "Least risk, please.", "I can't afford surprises, so risk "
                      "matters most.", "Which is the least risky?", "Pick the lowest risk."),
                     ("I'd rather play it safe.", "Avoid risk as much as you can.")),
}
LIMITS = {
    "price": Phrasing(("I can't spend more than {v}.", "My budget is {v}.", "It has to cost {v} or less.",
                       "Anything over {v} is too expensive."), ("{v} is the most I can pay.",)),
    "time": Phrasing(("It must take at most {v}.", "I need it within {v}.", "Anything longer than {v} won't work."),
                     ("I only have {v}.",)),
    "rating": Phrasing(("It should be rated at least {v}.", "Nothing rated below {v}."), ("I won't go under {v}.",)),
    "amount": Phrasing(("I need at least {v} of {noun}.", "Less than {v} of {noun} is not enough."),
                       ("{v} of {noun} is the minimum.",)),
    "risk_low": Phrasing(("I can only accept low risk.", "It has to be low risk."), ("Only low risk will do.",)),
    "risk_medium": Phrasing(("High risk is not acceptable.", "Nothing with high risk."),
                            ("I can't take a high risk here.",)),
}
DISTRACTORS = ("My friend likes {x}.", "{x} has a nicer website.", "It might rain on Tuesday.",
               "{x} was recommended on a forum.", "I used {x} once, years ago.", "My manager has no preference.",
               "The deadline for deciding is Friday.", "{x} sends a newsletter every week.")


def _figure(f: Facts, w: Wording, attribute: str, name: str, rng: random.Random) -> str:
    """One option's figure in the question's words, e.g. "costs €40", "takes 1 h plus 2 h of airport time"."""
    d, value = f.domain, f.values[attribute][name]
    if attribute == "price":
        return rng.choice(("costs {m}", "is {m}", "for {m}", "at {m}", "priced at {m}")).format(
            m=w.money.format(v=value)) if value else "is free"
    if attribute == "time":
        if name in f.extra:
            base = w.time.format(v=value - f.extra[name])
            return f"{d.verb} {base} plus {w.time.format(v=f.extra[name])} {d.extra_time}"
        return f"{d.verb} {w.time.format(v=value)}"
    if attribute == "rating":
        return rng.choice(("rated {r}", "has {r}", "with reviews of {r}", "scores {r}")).format(
            r=w.rating.format(v=value))
    if attribute == "amount":
        noun, unit = d.amount[0], d.amount[1]
        return rng.choice(("has {v} {u} of {n}", "offers {v} {u} of {n}", "with {v} {u} of {n}")).format(
            v=value, u=unit, n=noun) if unit != noun else f"has {value} {unit}"
    return rng.choice(("{l} risk", "a {l} risk of {what}", "{l} {what} risk")).format(l=value, what=d.risk)


def _figures(f: Facts, w: Wording, name: str, rng: random.Random, shuffle: bool) -> list[str]:
    order = rng.sample(f.shown, len(f.shown)) if shuffle else f.shown
    return [_figure(f, w, a, name, rng) for a in order]


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _limit_sentence(f: Facts, w: Wording, rng: random.Random, held_out: bool) -> str:
    if f.limit is None:
        return ""
    attribute, threshold = f.limit
    if attribute == "risk":
        return LIMITS[f"risk_{threshold}"].pick(rng, held_out)
    said = {"price": lambda v: w.money.format(v=v), "time": lambda v: w.time.format(v=v),
            "rating": lambda v: w.rating.format(v=v),
            "amount": lambda v: f"{v} {f.domain.amount[1]}" if f.domain.amount else str(v)}[attribute](threshold)
    return LIMITS[attribute].pick(rng, held_out).format(v=said, noun=f.domain.amount[0] if f.domain.amount else "")


def _objective_sentence(f: Facts, rng: random.Random, held_out: bool) -> str:
    noun = f.domain.amount[0] if f.domain.amount else ""
    return OBJECTIVES[f.objective].pick(rng, held_out).format(noun=noun, Noun=noun.capitalize())


# Sentence shapes: each lays out the options; the last two are held out.
def _shape_sentences(f: Facts, w: Wording, rng: random.Random) -> str:
    shuffle = rng.random() < 0.3
    return " ".join(f"{'The ' if rng.random() < 0.2 else ''}{n} {_join(_figures(f, w, n, rng, shuffle))}."
                    for n in f.names)


def _shape_bullets(f: Facts, w: Wording, rng: random.Random) -> str:
    return "\n" + "\n".join(f"- {n}: {', '.join(_figures(f, w, n, rng, False))}" for n in f.names) + "\n"


def _shape_either(f: Facts, w: Wording, rng: random.Random) -> str:
    listed = _join(f.names).replace(" and ", " or ")
    return f"Should I go with {listed}? " + "; ".join(
        f"{n} {_join(_figures(f, w, n, rng, False))}" for n in f.names) + "."


def _shape_brackets(f: Facts, w: Wording, rng: random.Random) -> str:
    return "I'm choosing between " + _join([f"{n} ({', '.join(_figures(f, w, n, rng, False))})"
                                            for n in f.names]) + "."


def _shape_found(f: Facts, w: Wording, rng: random.Random) -> str:
    return "Here is what I found. " + " ".join(
        f"{n}: {'; '.join(_figures(f, w, n, rng, True))}." for n in f.names)


def _shape_then(f: Facts, w: Wording, rng: random.Random) -> str:
    first, *rest = f.names
    parts = [f"First there is {first}, which {_join(_figures(f, w, first, rng, False))}."]
    parts += [f"Then {n}, which {_join(_figures(f, w, n, rng, True))}." for n in rest]
    return " ".join(parts)


SHAPES: tuple[Callable[[Facts, Wording, random.Random], str], ...] = (
    _shape_sentences, _shape_bullets, _shape_either, _shape_brackets)
HELD_OUT_SHAPES = (_shape_found, _shape_then)


def render(f: Facts, rng: random.Random, held_out: bool) -> str:
    """The question in words: intro, options, limit, objective (sometimes first), a distractor, an Options line."""
    w = Wording.draw(rng, f.domain)
    shape = rng.choice(HELD_OUT_SHAPES if held_out and rng.random() < 0.5 else SHAPES)
    intro = INTROS.pick(rng, held_out and rng.random() < 0.5).format(topic=f.domain.topic)
    body = shape(f, w, rng)
    hold = held_out and rng.random() < 0.5
    limit = _limit_sentence(f, w, rng, hold)
    objective = _objective_sentence(f, rng, hold)
    distractor = rng.choice(DISTRACTORS).format(x=rng.choice(f.names)) if rng.random() < 0.35 else ""
    parts = [objective, intro, body, limit] if rng.random() < 0.25 else [intro, body, limit, objective]
    if distractor:
        parts.insert(rng.randint(1, len(parts)), distractor)
    if rng.random() < 0.25:
        parts.append(f"Options: {', '.join(f.names)}.")
    return " ".join(p.strip(" ") for p in parts if p).replace(" \n", "\n").replace("\n ", "\n").strip()


# -- the roles' answers --------------------------------------------------------------------------------------------

_GOALS = {"price": "lowest price", "time": "shortest time", "rating": "highest rating", "risk": "lowest risk"}


def _goal(f: Facts) -> str:
    return _GOALS.get(f.objective) or f"most {f.domain.amount[0]}"


def _wins(f: Facts) -> str:
    """Which way the objective's comparison goes, written beside every comparison: a small model that reads the
    sign right still picks the wrong side when the direction is only in the question."""
    return "lower wins" if f.objective in _LOWER_IS_BETTER else "higher wins"


def _value(f: Facts, attribute: str, name: str) -> str:
    """A figure as the answers write it: number and short unit."""
    value, d = f.values[attribute][name], f.domain
    if attribute == "price":
        return f"{value} {'kUSD' if d.money[0] == 'kUSD' else d.money[0]}"
    if attribute == "time":
        unit = _TIME_SHORT[d.time[0]]
        if name in f.extra:
            return f"{value - f.extra[name]} {unit} + {f.extra[name]} {unit} = {value} {unit}"
        return f"{value} {unit}"
    if attribute == "rating":
        return f"{value}/{d.rating}"
    if attribute == "amount":
        return f"{value} {d.amount[1]}"
    return f"{value} risk"


def _item(f: Facts, name: str) -> str:
    """An option as the answers' `options` list names it: `train: 40`. The name is what comes before ": ", the
    decision is held to those names when the question lists no options (shared/grammar.py)."""
    return f"{name}: {_bare(f, f.objective, name)}"


def _limit_words(f: Facts) -> str:
    if f.limit is None:
        return "none"
    attribute, threshold = f.limit
    if attribute == "risk":
        return f"risk at most {threshold}"
    unit = {"price": lambda: f.domain.money[0], "time": lambda: _TIME_SHORT[f.domain.time[0]],
            "rating": lambda: f"/{f.domain.rating}", "amount": lambda: f.domain.amount[1]}[attribute]()
    sep = "" if attribute == "rating" else " "
    word = "at most" if attribute in _LOWER_IS_BETTER else "at least"
    name = f.domain.amount[0] if attribute == "amount" else attribute
    return f"{name} {word} {threshold}{sep}{unit}"


def _bare(f: Facts, attribute: str, name: str) -> str:
    """A value as the answers compare it: the number alone, or the risk level."""
    return str(f.values[attribute][name])


def _sign(f: Facts, attribute: str, left: str, right: str) -> str:
    """How two values of `attribute` compare: `<`, `=` or `>` (risk levels by their order)."""
    def level(name: str) -> Any:
        value = f.values[attribute][name]
        return RISKS.index(value) if attribute == "risk" else value
    a, b = level(left), level(right)
    return "<" if a < b else ">" if a > b else "="


def _scan(f: Facts) -> list[tuple[str, str | None]]:
    """The kept options in the question's order, each with the best option before it (None for the first). One
    comparison of two values at a time, which a small model reads far more reliably than the best of several."""
    steps, best = [], None
    for n in f.kept:
        steps.append((n, best))
        best = n if best is None or f.rank(n) < f.rank(best) else best
    return steps


def _compared(f: Facts, name: str, best: str | None) -> str:
    """One option against the best so far, the sign then the direction then the winner:
    `5 < 8, higher wins -> Harbour View`; the first kept option is only its value."""
    value = _bare(f, f.objective, name)
    if best is None:
        return value
    winner = name if f.rank(name) < f.rank(best) else best
    return f"{value} {_sign(f, f.objective, name, best)} {_bare(f, f.objective, best)}, {_wins(f)} -> {winner}"


def _check(f: Facts, name: str) -> str:
    """The limit checked on one option: `32 > 30 -> drop`, `medium <= medium -> keep`."""
    attribute, threshold = f.limit
    value = _bare(f, attribute, name)
    ok = f.ok(name)
    sign = ("<=" if ok else ">") if attribute in _LOWER_IS_BETTER else (">=" if ok else "<")
    return f"{value} {sign} {threshold} -> {'keep' if ok else 'drop'}"


def laya_answer(f: Facts) -> str:
    """Every option in the question's order: one that fails the limit with its check (`2300 > 2200 -> drop`), a
    kept one against the best so far; then the decision, the last winner."""
    scan = dict(_scan(f))
    options = [f"{n}: {_compared(f, n, scan[n]) if f.ok(n) else _check(f, n)}" for n in f.names]
    return json.dumps({"options": options, "decision": f.label})


def kev_answer(f: Facts) -> str:
    """The goal and limit, each option's figures and its limit check, a running comparison of the kept ones, the
    decision object (the kept options first, as Laya writes it)."""
    lines = [f"Goal: {_goal(f)} ({_wins(f)}). Limit: {_limit_words(f)}."]
    relevant = [f.objective] + ([f.limit[0]] if f.limit and f.limit[0] != f.objective else [])
    for n in f.names:
        figures = ", ".join(_value(f, a, n) for a in relevant)
        lines.append(f"{n}: {figures}" + (f"; {_check(f, n)}" if f.limit else ""))
    kept = f.kept
    if kept:
        for n, best in _scan(f):
            lines.append(f"{n} {_compared(f, n, best)}" if best else f"{n} {_bare(f, f.objective, n)} -> best so far")
        lines.append(f"Best: {f.label}")
        answer = {"options": [_item(f, n) for n in kept], "decision": f.label,
                  "rationale": f"{_goal(f)} within the limit" if f.limit else _goal(f)}
    else:
        lines.append(f"No option meets the limit -> {NONE}")
        answer = {"options": [], "decision": NONE, "rationale": "no option meets the limit"}
    lines.append(json.dumps(answer))
    return "\n".join(lines)


# -- sampling and files --------------------------------------------------------------------------------------------

SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class Question:
    facts: Facts
    text: str

    @property
    def label(self) -> str:
        return self.facts.label

    @property
    def scenario(self) -> Scenario:
        return self.facts.scenario(self.text)


def sample(rng: random.Random, split: str, none_share: float = 0.06) -> Question:
    """One question of `split`: train and val from the training domains and phrasings; test from the held-out
    domains, with half of its phrasings held out too. Ties on the objective are redrawn (a person could not say
    which is meant), as is "none" beyond its share."""
    held_out = split == "test"
    domains = HELD_OUT_DOMAINS if held_out else TRAIN_DOMAINS
    while True:
        facts = _draw_facts(rng, rng.choice(domains))
        kept = facts.kept
        if not kept and rng.random() > none_share / 0.1:  # "none" comes up about 10 % of the time unchecked
            continue
        if kept and sum(facts.rank(n) == facts.rank(facts.label) for n in kept) > 1:
            continue
        question = Question(facts, render(facts, rng, held_out))
        scenario = question.scenario
        if gold(scenario) != question.label or any(feasible(scenario, o) != facts.ok(o.name)
                                                    for o in scenario.options):
            raise AssertionError(f"scenario and question disagree on {question.text!r}")
        return question


def questions(n: int, seed: int, split: str) -> Iterator[Question]:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}")
    rng = random.Random(f"{seed}/prose/{split}")
    seen: set[str] = set()
    made = 0
    while made < n:
        q = sample(rng, split)
        if q.text not in seen:
            seen.add(q.text)
            made += 1
            yield q


def write_questions(path: Path, n: int, seed: int, split: str = "test") -> Path:
    """Questions as scenario rows (`{"id", "scenario", "label"}`, what `kevlaya eval --scenarios` reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for i, q in enumerate(questions(n, seed, split)):
            out.write(json.dumps({"id": f"prose-{split}-{i:05d}", "scenario": q.scenario.to_dict(),
                                  "label": q.label}) + "\n")
    return path


def write_training_data(out_dir: Path, n: int, seed: int, split: str = "train") -> dict[str, Path]:
    """`<adapter>/<split>.jsonl` (`{"prompt", "completion", "label"}`) of `n` questions for both roles."""
    chosen = list(questions(n, seed, split))
    paths = {}
    for adapter, answer in (("kev", kev_answer), ("laya", laya_answer)):
        path = Path(out_dir) / adapter / f"{split}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as out:
            for q in chosen:
                out.write(json.dumps({"prompt": q.text, "completion": answer(q.facts), "label": q.label}) + "\n")
        paths[adapter] = path
    return paths


def position_label(q: Question) -> str:
    """The winner's place in the question as a letter (or "none"): training balances by it, so no place is
    favoured, across plain-words questions and templated scenarios alike."""
    return NONE if q.label == NONE else LETTERS[q.facts.names.index(q.label)]


def write_dataset(out_dir: Path, n_train: int, n_templated: int, n_val: int, n_test: int, seed: int
                  ) -> dict[str, Path]:
    """The roles' training data on a real base: plain-words questions mixed with templated scenarios.

    Writes `<adapter>/train.jsonl` (records `{"prompt", "completion", "label"}`, the label being the winner's place),
    `val_scenarios.jsonl` (training domains; for `kevlaya models calibrate`) and `test_questions.jsonl` (held-out
    domains and phrasings; for `kevlaya eval`). Templated scenarios come from their own generator's train split."""
    out_dir = Path(out_dir)
    rows: dict[str, list[dict[str, str]]] = {"kev": [], "laya": []}
    for q in questions(n_train, seed, "train"):
        rows["kev"].append({"prompt": q.text, "completion": kev_answer(q.facts), "label": position_label(q)})
        rows["laya"].append({"prompt": q.text, "completion": laya_answer(q.facts), "label": position_label(q)})
    templated_rng = random.Random(f"{seed}/train")  # decision_data's train stream: never its test prompts
    for _ in range(n_templated):
        s = sample_scenario(templated_rng)
        rows["kev"].append({"prompt": render_prompt(s), "completion": kev_target(s), "label": s.label})
        rows["laya"].append({"prompt": render_prompt(s), "completion": laya_target(s), "label": s.label})
    paths: dict[str, Path] = {}
    for adapter, records in rows.items():
        random.Random(f"{seed}/{adapter}").shuffle(records)
        path = out_dir / adapter / "train.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        paths[f"{adapter}/train"] = path
    paths["val_scenarios"] = write_questions(out_dir / "val_scenarios.jsonl", n_val, seed, "val")
    paths["test_questions"] = write_questions(out_dir / "test_questions.jsonl", n_test, seed, "test")
    return paths
