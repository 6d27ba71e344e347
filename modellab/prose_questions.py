"""Decision questions in plain words, as people ask them, for training and evaluating Kev and Laya on a real base.

A question names two to four options by words, gives each option's figures in any order and in the units of its
domain (prices in euros, dollars or pounds, times in minutes, hours, days or weeks, ratings in stars or out of ten,
amounts such as storage or seats, and risk levels), says its objective in one of many ways (cheapest, fastest, best
rated, most of something, least risk), may add a limit that rules options out (often the otherwise best one), and
may mention facts that do not matter. The gold decision is the option that meets the limit and is best on the
objective, or "none" when no option meets it.

Evaluation questions come only from domains training never sees, and half of their sentence shapes, objective and
limit phrasings are held out as well, so the figures measure reading, not recall (`split="test"`).

The training split alone (`split="train"`) adds reading practice for what the trained roles misread on questions
people wrote (models/smollm2/people_questions.jsonl), in domains other than theirs: READING_DOMAINS, whose amount
is a rate or quantity where more is better, in many units (miles of range, weeks on a charge, hours a week, Mbps,
seats, mAh, lumens, kWh a year, cubic metres, % interest ...), said in each domain's words ("puts out 3000
lumens", "Longest range, please."); about 36 % of training questions have such an amount as their objective or
limit (14 % before). A limit comes more often, and about 30 % of
the questions have an option exactly on a price, time, rating or amount limit ("at least 4" and 4, "no more than
300" and 300, "within 2 h" and 2 h): it meets the limit (`Facts.ok` and `feasible` compare inclusively, the answers
write `4 >= 4 -> keep`), and it is usually, not always, the winner. Limits are said in more inclusive ways ("no less
than", "a minimum of", "up to", "at most", "within", "max."), some ratings and amounts have decimals ("4.5 stars",
"99.95%"), some prices have no currency ("quotes 1800") or a thousands comma ("$1,400"), and some asides name a
figure that does not count ("Money isn't an issue."). Test questions draw exactly as before, through the same random
stream, so their file is byte-identical to the one earlier figures were measured on (tests/test_prose_questions_reading.py
holds its digest). Validation questions, which calibrate the roles' confidence, come from CALIBRATION_DOMAINS, never
trained on nor evaluated on: confidence is fitted where a role reads a domain for the first time, as it does a
person's question.

Each question is stored as a `Scenario` (modellab/decision_data.py): price in `cost`, time in `days`, a rating or
an amount in `quality` (higher is better; a figure with decimals as an integer of its smallest step, 4.5 stars as 45,
99.95 % as 9995), and the risk level in `risk`, so `kevlaya eval` scores it as any other.
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
    # Training's reading domains (READING_DOMAINS) only: how the amount is said of an option ("prints {v}", {v} being
    # the figure and its unit), how its objective is said ("I want the most pages a minute."), and its decimals
    # (uptime 9995 with scale 2 is "99.95%"; the scenario's quality stays the integer).
    says: tuple[str, ...] = ()
    goals: tuple[str, ...] = ()
    scale: int = 0


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

# Never trained on nor evaluated on: the validation split (`kevlaya models calibrate`) comes from these alone, so a
# role's confidence is calibrated on domains it has not seen, as people's questions are; calibrated on training's
# domains, it was fitted to how often a role is right where it was trained (second and third rounds: ECE 0.05-0.07
# there, 0.08-0.18 on the held-out domains).
CALIBRATION_DOMAINS = (
    Domain("a car rental for the holiday", ("Hertz", "Avis", "Sixt", "Europcar", "Enterprise"), ("EUR", 90, 900, 10),
           ("min", 5, 60, 5), rating=5, risk="hidden fees", verb="is a shuttle ride of"),
    Domain("a web hosting plan", ("Hetzner", "OVH", "DigitalOcean", "Linode", "Vultr"), ("USD", 3, 120, 1),
           ("h", 1, 24, 1), rating=10, amount=("bandwidth", "TB", 1, 20, 1), risk="downtime", verb="is set up in"),
    Domain("a language school for Spanish", ("Cervantes", "Babel", "Hola Academy", "Lingua", "Don Quijote"),
           ("EUR", 120, 1500, 20), ("weeks", 4, 24, 1), rating=5, amount=("lessons", "lessons a week", 2, 10, 1)),
    Domain("a dentist for the crown", ("Smile Clinic", "Dr. Weber", "DentaCare", "Bright Teeth", "City Dental"),
           ("EUR", 300, 1500, 25), ("days", 1, 30, 1), rating=5, risk="complication", verb="can see me in"),
    Domain("a coworking space", ("WeWork", "Spaces", "Mindspace", "Regus", "The Hub"), ("EUR", 150, 700, 10),
           ("min", 5, 50, 5), rating=10, amount=("desks", "desks", 1, 20, 1), verb="is a ride of"),
    Domain("a translation agency for the manual", ("Lingo", "TransPerfect", "Welocalize", "Alpha Words", "Babelfish"),
           ("GBP", 200, 3000, 50), ("days", 1, 15, 1), rating=10, risk="errors", verb="delivers in"),
)

# Training only (split "train"): domains whose amount is a rate or quantity where more is better, in many units, some
# of them units of time (weeks on a charge, hours a week) or percentages (interest), the figures the roles most often
# took for a time or a price. Never in the validation or test split, and none of the topics of the questions people
# wrote (models/smollm2/people_questions.jsonl: printers, uptime, e-bikes, laptop batteries, coffee machines, robot
# vacuums), which stay a test of reading that training never saw.
READING_DOMAINS = (
    Domain("a used electric car", ("Leaf", "Zoe", "Kona", "e-Golf", "Ioniq"), ("GBP", 8000, 30000, 500), None,
           rating=10, amount=("range", "miles", 100, 300, 10), risk="battery wear",
           says=("goes {v} on a full charge", "has a range of {v}", "does {v} per charge"),
           goals=("Longest range, please.", "I want to go as far as possible on one charge.",
                  "Range is what I care about.")),
    Domain("an internet plan for the flat", ("FastNet", "Hyperoptic", "Starlink", "Sky", "Plusnet"), ("GBP", 20, 90, 1),
           ("days", 1, 21, 1), rating=5, amount=("download speed", "Mbps", 50, 1000, 50), verb="is installed in",
           says=("gives {v}", "offers {v} download", "downloads at {v}", "with {v} download speed"),
           goals=("I want the fastest download speed.", "Download speed matters most.", "Give me the most Mbps.",
                  "The highest download speed, please.")),
    Domain("a van for the business", ("Transit", "Sprinter", "Vivaro", "Ducato", "Master"), ("EUR", 18000, 60000, 500),
           ("weeks", 1, 16, 1), rating=10, amount=("load space", "cubic metres", 4, 20, 1), risk="breakdown",
           verb="arrives in", says=("carries {v}", "has {v} of load space", "with {v} of load space"),
           goals=("I want the most load space.", "The biggest load space, please.", "Load space matters most.")),
    Domain("a coach for the school trip", ("BlueLine", "Coachway", "Star Tours", "Redline", "Alpine Coaches"),
           ("EUR", 400, 3000, 50), ("h", 1, 8, 1), rating=5, amount=("seats", "seats", 20, 80, 1), risk="delay",
           says=("has {v}", "offers {v}", "comes with {v}"),
           goals=("We need the most seats.", "Most seats wins.", "The biggest coach, please.")),
    Domain("a phone for my mother", ("Pixel", "Moto G", "Nokia G", "Redmi", "Fairphone"), ("EUR", 150, 900, 10),
           ("days", 1, 10, 1), rating=5, amount=("battery", "mAh", 3000, 6000, 100), verb="arrives in",
           says=("has a {v} battery", "comes with a {v} battery", "with a {v} battery"),
           goals=("I want the biggest battery.", "Battery size matters most.", "Pick the one with the most mAh.")),
    Domain("an e-reader", ("Kindle", "Kobo", "PocketBook", "Tolino", "Boox"), ("EUR", 80, 400, 10), None, rating=5,
           amount=("battery life", "weeks", 2, 12, 1),
           says=("lasts {v} on a charge", "runs {v} per charge", "has {v} of battery life"),
           goals=("I want the longest battery life.", "It should last as long as possible on a charge.",
                  "Battery life matters most.")),
    Domain("a solar installer for the roof", ("SunPower", "Enpal", "Otovo", "Solarwatt", "Svea Solar"),
           ("EUR", 6000, 20000, 250), ("weeks", 2, 20, 1), rating=10,
           amount=("yearly output", "kWh a year", 3000, 12000, 250), risk="delay", verb="installs in",
           says=("produces {v}", "yields {v}", "generates {v}"),
           goals=("I want the most kWh a year.", "The highest yearly output, please.", "Output is what counts.")),
    Domain("a fixed-term deposit", ("Marcus", "Zopa", "Raisin", "Moneybox", "Atom"), ("EUR", 0, 0, 1), None, rating=5,
           amount=("interest", "% a year", 50, 450, 5), risk="default", scale=2,
           says=("pays {v}", "offers {v}", "earns {v}", "with an interest of {v}"),
           goals=("I want the highest interest.", "Best rate, please.", "The most interest wins.",
                  "Which pays the most?")),
    Domain("a language course before the move", ("Babbel", "Berlitz", "Busuu", "Preply", "italki"),
           ("EUR", 50, 3000, 50), ("months", 2, 18, 1), rating=5, amount=("tutoring", "hours a week", 1, 10, 1),
           says=("gives {v} of tutoring", "includes {v} of tutoring", "with {v} of tutoring"),
           goals=("I want the most tutoring hours.", "As many hours a week as possible.",
                  "Tutoring time matters most.")),
    Domain("a projector for the meeting room", ("Epson", "BenQ", "Optoma", "ViewSonic", "Acer"), ("USD", 300, 2000, 25),
           ("days", 1, 10, 1), rating=10, amount=("brightness", "lumens", 2000, 6000, 100), verb="arrives in",
           says=("gives {v}", "puts out {v}", "has a brightness of {v}"),
           goals=("The brightest one, please.", "I want the most lumens.", "Brightness matters most.")),
)

# -- how figures are said ------------------------------------------------------------------------------------------

_MONEY = {
    "EUR": ("€{v}", "{v} EUR", "{v} euros"),
    "USD": ("${v}", "{v} USD", "{v} dollars"),
    "GBP": ("£{v}", "{v} GBP", "{v} pounds"),
    "kUSD": ("${v}k", "{v}k USD", "{v} thousand dollars"),
}
_TIME = {"min": ("{v} min", "{v} minutes"), "h": ("{v} h", "{v} hours"), "days": ("{v} days",),
         "weeks": ("{v} weeks",), "months": ("{v} months",)}  # months: training's reading domains only
_TIME_SHORT = {"min": "min", "h": "h", "days": "days", "weeks": "weeks", "months": "months"}
_RATING = {5: ("{v} stars", "{v}/5", "{v} out of 5"), 10: ("{v}/10", "{v} out of 10")}


@dataclass
class Wording:
    """The forms one question uses, drawn once so that its figures are said consistently."""

    money: str
    time: str
    rating: str
    extra_time_share: float
    grouped: bool = False  # training only: thousands written "1,400"

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
    # Training only (`_draw_reading_facts`): decimals an attribute's integers are said with (a rating of 45 with
    # scale 1 is "4.5"), and prices said without their currency ("quotes 1800").
    scale: dict[str, int] = field(default_factory=dict)
    money_bare: bool = False

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

    @property
    def on_bound(self) -> list[str]:
        """The options whose figure equals the limit's threshold ("at least 4" and 4): they meet it."""
        if self.limit is None:
            return []
        attribute, threshold = self.limit
        return [n for n in self.names if self.values[attribute][n] == threshold]

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


# -- training's reading practice -----------------------------------------------------------------------------------
# The training split alone draws its facts here (`sample`), so the validation and test splits keep every draw they
# made before (their files are byte-identical; tests/test_prose_questions_reading.py holds their digests).

READING_DOMAIN_SHARE = 0.45  # of training questions from READING_DOMAINS, the rest from TRAIN_DOMAINS
READING_LIMIT_SHARE = 0.7  # of training questions with a limit, where a second figure is shown (validation: 0.6)
BOUND_SHARE = 0.4  # of numeric limits set exactly on one option's figure, which meets it ("at least 4" and 4)
BOUND_WINS_SHARE = 0.7  # of those, the option on the bound wins (else it is kept and loses to another)
DECIMAL_RATING_SHARE = 0.3  # of rated training questions whose ratings have a decimal ("4.5 stars")
BARE_MONEY_SHARE = 0.15  # of training questions whose prices carry no currency ("quotes 1800")
GROUPED_SHARE = 0.3  # of training questions that write thousands with a comma ("$1,400")


def _draw_reading_facts(rng: random.Random, d: Domain) -> Facts:
    """`_draw_facts` for the training split: a reading domain always shows its amount (usually in place of its
    rating), ratings sometimes have a decimal, a limit comes more often and half the time sits on an option's
    figure (`_bound_limit`)."""
    k = rng.choices((2, 3, 4), weights=(3, 4, 3))[0]
    names = rng.sample(d.names, k)
    available = [a for a in ATTRIBUTES if {"price": d.money[2] > 0, "time": d.time is not None,
                                           "rating": d.rating is not None, "amount": d.amount is not None,
                                           "risk": d.risk is not None}[a]]
    if "rating" in available and "amount" in available:
        available.remove("rating" if rng.random() < (0.8 if d.says else 0.5) else "amount")
    shown = rng.sample(available, min(len(available), rng.choice((2, 2, 3))))
    if d.says and "amount" in available and "amount" not in shown:
        shown[rng.randrange(len(shown))] = "amount"
    values: dict[str, dict[str, Any]] = {}
    extra: dict[str, int] = {}
    scale: dict[str, int] = {}
    for a in shown:
        if a == "price":
            _, low, high, step = d.money
            values[a] = dict(zip(names, _distinct(rng, low, high, step, k)))
        elif a == "time":
            unit, low, high, step = d.time
            values[a] = dict(zip(names, _distinct(rng, low, high, step, k)))
        elif a == "rating":
            if rng.random() < DECIMAL_RATING_SHARE:  # tenths: 45 is "4.5"
                scale[a] = 1
                values[a] = dict(zip(names, _distinct(rng, 4 * d.rating, 10 * d.rating, 1, k)))
            else:
                values[a] = dict(zip(names, _distinct(rng, 1, d.rating, 1, k)))
        elif a == "amount":
            _, _, low, high, step = d.amount
            values[a] = dict(zip(names, _distinct(rng, low, high, step, k)))
            if d.scale:
                scale[a] = d.scale
        else:
            values[a] = {n: rng.choice(RISKS) for n in names}
    if "time" in values and d.extra_time:
        for n in names:
            if rng.random() < 0.35 and values["time"][n] > d.time[1]:
                extra[n] = rng.randint(1, values["time"][n] - d.time[1])
    objective = rng.choice(shown)
    limit = None
    others = [a for a in shown if a != objective]
    if others and rng.random() < READING_LIMIT_SHARE:
        attribute = rng.choice(others)
        if attribute != "risk" and rng.random() < BOUND_SHARE:
            limit = _bound_limit(rng, attribute, values, names, objective)
        else:
            limit = _draw_limit(rng, attribute, values, names, objective)
    money_bare = "price" in shown and rng.random() < BARE_MONEY_SHARE
    return Facts(d, names, values, extra, shown, objective, limit, scale, money_bare)


def _bound_limit(rng: random.Random, attribute: str, values: dict[str, dict[str, Any]], names: list[str],
                 objective: str) -> tuple[str, Any]:
    """A threshold equal to one option's figure on `attribute` (inclusive: that option meets it). Most often that
    option is then the winner and the limit rules out a better one, so reading "at least 4" with a 4 as a failure
    gives a wrong decision."""
    lower_is_better = attribute in _LOWER_IS_BETTER

    def rank(n: str) -> int:
        v = values[objective][n]
        v = RISKS.index(v) if objective == "risk" else v
        return v if objective in _LOWER_IS_BETTER else -v

    def kept_at(threshold: int) -> list[str]:
        return [n for n in names if (values[attribute][n] <= threshold if lower_is_better
                                     else values[attribute][n] >= threshold)]

    wins = [n for n in names if min(kept_at(values[attribute][n]), key=rank) == n]
    deciding = [n for n in wins if len(kept_at(values[attribute][n])) < len(names)]
    losing = [n for n in names if n not in wins]  # on the bound, kept, and beaten by another kept option
    on = rng.choice(deciding or wins) if rng.random() < BOUND_WINS_SHARE or not losing else rng.choice(losing)
    return attribute, values[attribute][on]


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
# Training only: more inclusive ways to say a limit ("no less than", "up to", "within", ...), a figure on the bound
# meeting it. {v} is the figure with its unit; amount phrasings that name the {noun} are left out where the unit is
# the noun ("seats").
READING_LIMITS = {
    "price": ("No more than {v}, please.", "I can pay up to {v}.", "It can cost at most {v}.", "{v} max.",
              "It must not go over {v}.", "Up to {v} is fine.", "The price can be {v} at most.", "My limit is {v}."),
    "time": ("No more than {v}.", "It has to be within {v}.", "Up to {v} is fine.", "{v} at most.",
             "{v} or less, please.", "It can't take longer than {v}.", "Within {v} is what I need."),
    "rating": ("No less than {v}.", "It must be rated {v} or better.", "A rating of at least {v} is a must.",
               "Minimum rating: {v}.", "At least {v}, please."),
    "amount": ("It needs at least {v}.", "No less than {v}, please.", "A minimum of {v} is required.",
               "{v} or more is a must.", "Anything under {v} is not enough.", "We need at least {v}.",
               "It has to reach at least {v}.", "{Noun} must be at least {v}.", "I need {noun} of no less than {v}.",
               "{Noun}: {v} at the very least."),
}
READING_TIME_GOALS = ("I care most about time.", "Time is what counts for me.", "I need it as soon as possible.",
                      "The sooner, the better.", "The shortest wait wins.")
DISTRACTORS = ("My friend likes {x}.", "{x} has a nicer website.", "It might rain on Tuesday.",
               "{x} was recommended on a forum.", "I used {x} once, years ago.", "My manager has no preference.",
               "The deadline for deciding is Friday.", "{x} sends a newsletter every week.")


def _number(f: Facts, attribute: str, value: Any) -> str:
    """A figure's number as the question and the answers write it: the integer, or with its decimals where the
    question has them (`Facts.scale`: 9995 is "99.95", 45 is "4.5", 40 is "4")."""
    scale = f.scale.get(attribute, 0)
    if not scale or not isinstance(value, int):
        return str(value)
    whole, part = divmod(value, 10 ** scale)
    return f"{whole}.{part:0{scale}d}".rstrip("0").rstrip(".")


def _with_unit(number: str, unit: str) -> str:
    """"99.95%", "30 pages a minute": a percent sign joins its number."""
    return f"{number}{unit}" if unit.startswith("%") else f"{number} {unit}"


def _said(f: Facts, w: Wording, attribute: str, value: Any) -> str:
    """A figure in the question's words: "€1,400", "4.5 stars", "99.95%", "3 h"."""
    d = f.domain
    if attribute == "price":
        return w.money.format(v=f"{value:,}" if w.grouped else value)
    if attribute == "time":
        return w.time.format(v=value)
    if attribute == "rating":
        return w.rating.format(v=_number(f, attribute, value))
    if attribute == "amount":
        number = f"{value:,}" if w.grouped and not f.scale.get(attribute) else _number(f, attribute, value)
        return _with_unit(number, d.amount[1]) if d.amount else number
    return str(value)


def _figure(f: Facts, w: Wording, attribute: str, name: str, rng: random.Random) -> str:
    """One option's figure in the question's words, e.g. "costs €40", "takes 1 h plus 2 h of airport time"."""
    d, value = f.domain, f.values[attribute][name]
    if attribute == "price":
        return rng.choice(("costs {m}", "is {m}", "for {m}", "at {m}", "priced at {m}")).format(
            m=_said(f, w, attribute, value)) if value else "is free"
    if attribute == "time":
        if name in f.extra:
            base = w.time.format(v=value - f.extra[name])
            return f"{d.verb} {base} plus {w.time.format(v=f.extra[name])} {d.extra_time}"
        return f"{d.verb} {w.time.format(v=value)}"
    if attribute == "rating":
        return rng.choice(("rated {r}", "has {r}", "with reviews of {r}", "scores {r}")).format(
            r=_said(f, w, attribute, value))
    if attribute == "amount":
        if d.says:  # training's reading domains: "prints 30 pages a minute"
            return rng.choice(d.says).format(v=_said(f, w, attribute, value))
        noun, unit = d.amount[0], d.amount[1]
        number = _said(f, w, attribute, value).removesuffix(f" {unit}")
        return rng.choice(("has {v} {u} of {n}", "offers {v} {u} of {n}", "with {v} {u} of {n}")).format(
            v=number, u=unit, n=noun) if unit != noun else f"has {number} {unit}"
    return rng.choice(("{l} risk", "a {l} risk of {what}", "{l} {what} risk")).format(l=value, what=d.risk)


def _figures(f: Facts, w: Wording, name: str, rng: random.Random, shuffle: bool) -> list[str]:
    order = rng.sample(f.shown, len(f.shown)) if shuffle else f.shown
    return [_figure(f, w, a, name, rng) for a in order]


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _limit_sentence(f: Facts, w: Wording, rng: random.Random, held_out: bool, reading: bool = False) -> str:
    if f.limit is None:
        return ""
    attribute, threshold = f.limit
    if attribute == "risk":
        return LIMITS[f"risk_{threshold}"].pick(rng, held_out)
    said = _said(f, w, attribute, threshold)
    noun = f.domain.amount[0] if f.domain.amount else ""
    if reading:  # training: the inclusive phrasings too; a reading domain's amount only in its own words
        pool = list(READING_LIMITS[attribute])
        if attribute == "amount" and noun == f.domain.amount[1]:
            pool = [p for p in pool if "oun}" not in p]
        if not (attribute == "amount" and (f.domain.says or noun == f.domain.amount[1])):
            pool += LIMITS[attribute].train
        return rng.choice(pool).format(v=said, noun=noun, Noun=noun.capitalize())
    return LIMITS[attribute].pick(rng, held_out).format(v=said, noun=noun)


def _objective_sentence(f: Facts, rng: random.Random, held_out: bool, reading: bool = False) -> str:
    noun = f.domain.amount[0] if f.domain.amount else ""
    if reading and f.objective == "amount" and f.domain.goals:  # "I want the most pages a minute."
        return rng.choice(f.domain.goals)
    if reading and f.objective == "time" and f.domain.says:  # not "fastest" where the amount may be a speed
        return rng.choice(READING_TIME_GOALS)
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


def _reading_distractors(f: Facts) -> tuple[str, ...]:
    """Training only: asides about a figure the decision must ignore ("X has the best reviews, whatever."), said
    only where that figure is neither the objective nor the limit, and naming the option they are true of when the
    question gives the figure."""
    limited = f.limit[0] if f.limit else None
    v = f.values

    def named(attribute: str, best: bool) -> str:  # "{x}" (any option) where the question does not say
        if attribute not in v:
            return "{x}"
        return (min if best == (attribute == "price") else max)(f.names, key=lambda n: v[attribute][n]).replace(
            "{", "{{").replace("}", "}}")

    extra = []
    if f.objective != "rating" and limited != "rating":
        extra += [f"{named('rating', False)} has awful reviews, but that is not what I am asking.",
                  f"{named('rating', True)} has the best reviews, whatever."]
    if f.objective != "price" and limited != "price":
        extra += ["Money isn't an issue.", f"{named('price', True)} is the cheapest, but that doesn't matter."]
    return DISTRACTORS + tuple(extra)


def render(f: Facts, rng: random.Random, held_out: bool, reading: bool = False) -> str:
    """The question in words: intro, options, limit, objective (sometimes first), a distractor, an Options line.
    `reading` (the training split alone) adds the training-only wordings: thousands with commas, prices without a
    currency, inclusive limit phrasings, a reading domain's own goals, asides about figures that do not count."""
    w = Wording.draw(rng, f.domain)
    if reading:
        w.grouped = rng.random() < GROUPED_SHARE
        if f.money_bare:
            w.money = "{v}"
    shape = rng.choice(HELD_OUT_SHAPES if held_out and rng.random() < 0.5 else SHAPES)
    intro = INTROS.pick(rng, held_out and rng.random() < 0.5).format(topic=f.domain.topic)
    body = shape(f, w, rng)
    hold = held_out and rng.random() < 0.5
    limit = _limit_sentence(f, w, rng, hold, reading)
    objective = _objective_sentence(f, rng, hold, reading)
    distractors = _reading_distractors(f) if reading else DISTRACTORS
    distractor = rng.choice(distractors).format(x=rng.choice(f.names)) if rng.random() < 0.35 else ""
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
        if f.money_bare:  # the question gave no currency: the answer adds none
            return str(value)
        return f"{value} {'kUSD' if d.money[0] == 'kUSD' else d.money[0]}"
    if attribute == "time":
        unit = _TIME_SHORT[d.time[0]]
        if name in f.extra:
            return f"{value - f.extra[name]} {unit} + {f.extra[name]} {unit} = {value} {unit}"
        return f"{value} {unit}"
    if attribute == "rating":
        return f"{_number(f, attribute, value)}/{d.rating}"
    if attribute == "amount":
        return _with_unit(_number(f, attribute, value), d.amount[1])
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
    unit = {"price": lambda: "" if f.money_bare else f.domain.money[0],
            "time": lambda: _TIME_SHORT[f.domain.time[0]],
            "rating": lambda: f"/{f.domain.rating}", "amount": lambda: f.domain.amount[1]}[attribute]()
    sep = "" if attribute == "rating" or unit.startswith("%") else " "
    word = "at most" if attribute in _LOWER_IS_BETTER else "at least"
    name = f.domain.amount[0] if attribute == "amount" else attribute
    return f"{name} {word} {_number(f, attribute, threshold)}{sep}{unit}".rstrip(" ")


def _bare(f: Facts, attribute: str, name: str) -> str:
    """A value as the answers compare it: the number alone (with the question's decimals), or the risk level."""
    return _number(f, attribute, f.values[attribute][name])


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
    """The limit checked on one option: `32 > 30 -> drop`, `medium <= medium -> keep`; a figure on the bound meets
    the limit (`4 >= 4 -> keep`, `300 <= 300 -> keep`)."""
    attribute, threshold = f.limit
    value = _bare(f, attribute, name)
    ok = f.ok(name)
    sign = ("<=" if ok else ">") if attribute in _LOWER_IS_BETTER else (">=" if ok else "<")
    return f"{value} {sign} {_number(f, attribute, threshold)} -> {'keep' if ok else 'drop'}"


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
    """One question of `split`: train from the training domains and phrasings; val from the calibration domains
    in training's phrasings; test from the held-out domains, with half of its phrasings held out too. Ties on the
    objective are redrawn (a person could not say which is meant), as is "none" beyond its share."""
    held_out = split == "test"
    reading = split == "train"  # training's reading practice; validation and test draw as they always did
    domains = {"test": HELD_OUT_DOMAINS, "val": CALIBRATION_DOMAINS}.get(split, TRAIN_DOMAINS)
    while True:
        if reading:
            facts = _draw_reading_facts(rng, rng.choice(READING_DOMAINS if rng.random() < READING_DOMAIN_SHARE
                                                        else TRAIN_DOMAINS))
        else:
            facts = _draw_facts(rng, rng.choice(domains))
        kept = facts.kept
        if not kept and rng.random() > none_share / 0.1:  # "none" comes up about 10 % of the time unchecked
            continue
        if kept and sum(facts.rank(n) == facts.rank(facts.label) for n in kept) > 1:
            continue
        question = Question(facts, render(facts, rng, held_out, reading))
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
    `val_scenarios.jsonl` (the calibration domains; for `kevlaya models calibrate`) and `test_questions.jsonl` (held-out
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
