"""Tool-use requests in plain words, as people write them, for training and evaluating which function Kev and Laya
call and with what arguments (docs/architecture.md §9, Tool calls).

An item offers two to five OpenAI function tools from a pool of tool domains (weather, flights, trains, a restaurant
table, payments, calendar events, email and chat messages, unit and currency conversion, support tickets, reminders,
stocks, the smart home, ...), each with a JSON schema of its parameters (enums, bounded integers, strings, dates and
times, optional fields, `additionalProperties: false`), and a request that clearly calls for one of them, sometimes
for two calls at once ("the weather in Paris and in Rome"), or, under `tool_choice: auto`, for none of them (a
question no tool answers, or a task of a tool not offered). The gold calls' arguments are taken from the request's
own words: figures in digits or in words, dates and times in many formats, enum values by a synonym ("in
fahrenheit", "on the terrace"), names and texts as written.

What a role learns to answer is the exact text the serving grammar enforces: the calls in the wire format
(`shared.tools.call_text`, joined by `TOOL_CALL_SEPARATOR`), the end of sequence after them (training adds it, as to
every completion). Where no tool fits, both roles answer one short plain sentence, `NO_CALL_REPLY`: under
`tool_choice: auto` the grammar takes any text that does not open a call, a role's decision object would answer a
question nobody asked, and a fixed sentence says honestly what happened. Kev answers as Laya does: the grammar lets
no analysis line come before a call.

Evaluation items come only from tool domains training never sees (every tool they offer, and the requests no tool
answers), and half of their domain-free phrasings (openers, closings, asides, how dates, times and money are
written, how two requests are joined) are held out as well (`split="test"`), so the figures measure reading, not
recall.
"""

from __future__ import annotations

import datetime
import json
import random
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from shared.grammar import TOOL_CALL_SEPARATOR
from shared.tools import call_text

NO_CALL_REPLY = "None of the tools offered can do that, so I am not calling any."
NONE = "none"  # the label of an item that calls nothing
LETTERS = string.ascii_uppercase
SPLITS = ("train", "val", "test")

# -- how things are said -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phrasing:
    """A pool of domain-free phrasings; the `held_out` ones are never trained on."""

    train: tuple[str, ...]
    held_out: tuple[str, ...] = ()


OPENERS = Phrasing(("Hi!", "Hello.", "Hey there.", "Good morning!", "Quick one:", "Could you help me out?",
                    "I need a hand with something."),
                   ("Morning!", "Sorry to bother you.", "Right, next thing:"))
CLOSERS = Phrasing(("Thanks!", "Thank you so much.", "Cheers.", "Much appreciated.", "Thanks in advance!",
                    "As soon as you can, please."),
                   ("You're a star.", "Many thanks!", "Ta."))
ASIDES = Phrasing(("I'm on my phone, sorry for typos.", "It's been a crazy week.", "My boss is waiting on this.",
                   "The kids are finally asleep.", "Long day at work.", "My battery is at 9 percent.",
                   "We moved here 3 years ago."),
                  ("Coffee number four today.", "Our dog just knocked over a plant.", "I'm typing this on the bus.",
                   "I have a meeting in 20 minutes."))
DATES = Phrasing(("{day} {Month} {year}", "{Month} {day}, {year}", "{iso}", "{Weekday} {day} {Month} {year}"),
                 ("the {nth} of {Month} {year}", "{Mon} {day} {year}", "{Weekday}, {Month} {nth} {year}"))
TIMES = Phrasing(("{HH}:{MM}", "{h}:{MM} {ap}", "{h}:{MM}{ap}"), ("{h}.{MM} {period}", "{HH}h{MM}"))
TIMES_ON_THE_HOUR = Phrasing(("{h} {ap}", "{h}{ap}"), ("{h} o'clock {period}",))
TIMES_AT_HALF_PAST = Phrasing(("{h}:30 {ap}",), ("half past {h_words} {period}",))
MONEY = Phrasing(("{sym}{v}", "{v} {word}", "{v} {code}"), ("{code} {v}", "{v}{sym}"))
JOINS = Phrasing(("{a} {b}", "{a}\n{b}", "Two things. {a} {b}", "First: {a} Then: {b}"),
                 ("{a} And another thing: {b}", "- {a}\n- {b}", "{a} While you're at it: {b}"))
# Requests no tool answers: like a domain, the test split has its own.
CHAT = {
    "train": ("What's the capital of Australia?", "Tell me a joke about cats.", "Can you explain what a black hole is?",
              "Thanks, that's all for today!", "Write a haiku about the sea.", "What does \"serendipity\" mean?",
              "Who wrote Pride and Prejudice?", "Hi! How are you today?",
              "Summarise the plot of Hamlet in two sentences.", "Give me three tips for sleeping better.",
              "What's a good name for a goldfish?", "Is a tomato a fruit or a vegetable?",
              "How many legs does a spider have?", "Recommend a good book for a long flight.",
              "What's the difference between a virus and a bacterium?",
              "Help me come up with a toast for my sister's wedding."),
    "test": ("Why is the sky blue?", "What rhymes with orange?", "Explain photosynthesis to a ten-year-old.",
             "Can you help me write a birthday card for my dad?", "Good morning! Just saying hello.",
             "List three famous painters from Spain.", "What's the plural of cactus?", "How long do cats usually live?",
             "Give me a fun fact about octopuses.", "Who painted the Mona Lisa?"),
}

MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
         "seventeen eighteen nineteen").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
# code: (symbol or "", word)
CURRENCIES = {"EUR": ("€", "euros"), "USD": ("$", "dollars"), "GBP": ("£", "pounds"), "CHF": ("", "Swiss francs"),
              "JPY": ("¥", "yen")}


def in_words(n: int) -> str:
    """A whole number from 0 to 9,999 in English words: 42 -> "forty-two"."""
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else "-" + _ONES[n % 10])
    if n < 1000:
        return _ONES[n // 100] + " hundred" + ("" if n % 100 == 0 else " and " + in_words(n % 100))
    return in_words(n // 1000) + " thousand" + ("" if n % 1000 == 0 else " " + in_words(n % 1000))


def ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


class Say:
    """How one item says things: its random stream, whether it may take held-out phrasings (the test split, half
    of the time for each), and the pooled phrasings it took (what the split test checks)."""

    def __init__(self, rng: random.Random, held_out: bool):
        self.rng, self.held_out, self.used = rng, held_out, []

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def choice(self, items: Any) -> Any:
        return self.rng.choice(items)

    def pick(self, pool: Phrasing) -> str:
        held = self.held_out and bool(pool.held_out) and self.chance(0.5)
        text = self.choice(pool.held_out if held else pool.train)
        self.used.append(text)
        return text

    def number(self, n: int) -> str:
        """A count in digits, or in words now and then."""
        return in_words(n) if (n <= 20 and self.chance(0.3)) or (n <= 100 and self.chance(0.1)) else str(n)

    def date(self, day: datetime.date) -> str:
        return self.pick(DATES).format(day=day.day, nth=ordinal(day.day), Month=MONTHS[day.month - 1],
                                       Mon=MONTHS[day.month - 1][:3], year=day.year, iso=day.isoformat(),
                                       Weekday=WEEKDAYS[day.weekday()])

    def time(self, hour: int, minute: int) -> str:
        pool = (TIMES_ON_THE_HOUR if minute == 0 and self.chance(0.5) else
                TIMES_AT_HALF_PAST if minute == 30 and self.chance(0.3) else TIMES)
        h = hour % 12 or 12
        period = "in the morning" if hour < 12 else "in the afternoon" if hour < 18 else "in the evening"
        return self.pick(pool).format(HH=f"{hour:02d}", MM=f"{minute:02d}", h=h, h_words=in_words(h),
                                      ap="am" if hour < 12 else "pm", period=period)

    def money(self, amount: float, code: str) -> str:
        symbol, word = CURRENCIES[code]
        template = self.pick(MONEY)
        if "{sym}" in template and not symbol:
            template = "{v} {code}"
        if isinstance(amount, int) or amount == int(amount):
            whole = int(amount)
            value = (in_words(whole) if template == "{v} {word}" and whole <= 100 and self.chance(0.25)
                     else f"{whole:,}" if whole >= 1000 and self.chance(0.5) else str(whole))
        else:
            value = f"{amount:.2f}"
        return template.format(sym=symbol, v=value, word=word, code=code)


# -- the tools -----------------------------------------------------------------------------------------------------

# Compact: every tool is a line of the system prompt, and five must leave a 135M model's 1,024-token window room
# for the request and the answer (no property descriptions where the name says it; enums without their type).
DATE = {"type": "string", "format": "date"}
TIME = {"type": "string", "pattern": "^\\d\\d:\\d\\d$"}


def _string(description: str | None = None, **more: Any) -> dict[str, Any]:
    return {"type": "string", **({"description": description} if description else {}), **more}


def _enum(*values: str) -> dict[str, Any]:
    return {"enum": list(values)}


def _integer(low: int, high: int, description: str | None = None) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high, **({"description": description} if description else {})}


@dataclass
class Drawn:
    """One call's arguments and the words its request says them in (`slots`, filled into the templates); the
    optional arguments it mentions, in the order they are said."""

    arguments: dict[str, Any] = field(default_factory=dict)
    slots: dict[str, str] = field(default_factory=dict)
    mentioned: list[str] = field(default_factory=list)

    def put(self, name: str, value: Any, words: str | None = None, **more_slots: str) -> None:
        self.arguments[name] = value
        self.slots[name] = str(value) if words is None else words
        self.slots.update(more_slots)

    def mention(self, name: str, value: Any, words: str) -> None:
        self.put(name, value, words)
        self.mentioned.append(name)


@dataclass(frozen=True, eq=False)  # told apart by identity: one object per function
class Function:
    """A function tool and how people ask for it. `requests` are templates with a `{slot}` for every required
    argument; `terse` the same, typed in a hurry; `mentions` say an optional argument, inline (starting lower-case
    or with a bracket: put before the request's final mark) or as a sentence of their own; `pairs` ask for two
    calls of it at once (`{slot}` and `{slot2}`). `free_text`: arguments said as open text, which nothing may follow
    on their line (a closing "Thanks!" would read as part of the message)."""

    name: str
    description: str
    domain: str
    family: str  # functions of a family are near misses for each other: the hard distractors
    properties: dict[str, dict[str, Any]]
    required: tuple[str, ...]
    draw: Callable[[Say, bool], Drawn]  # (say, plain: no optional arguments) -> arguments and their words
    requests: tuple[str, ...]
    terse: tuple[str, ...] = ()
    mentions: dict[str, tuple[str, ...]] = field(default_factory=dict)
    pairs: tuple[str, ...] = ()
    free_text: tuple[str, ...] = ()

    @cached_property
    def tool(self) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "properties": self.properties, "required": list(self.required),
                           "additionalProperties": False}}}

    @cached_property
    def size(self) -> int:
        """Characters of its line in the system prompt."""
        return len(json.dumps(self.tool["function"], ensure_ascii=False, separators=(", ", ": ")))

    def call(self, drawn: Drawn) -> tuple[str, dict[str, Any]]:
        """The gold call: its arguments in the schema's order, as the model is taught to write them."""
        return self.name, {key: drawn.arguments[key] for key in self.properties if key in drawn.arguments}

    def open_ended(self, template: str) -> bool:
        """Whether a request template ends with open text."""
        return any(template.rstrip(".?!").endswith(f"{{{name}}}") for name in self.free_text)


# value pools, shared by the splits (the functions are not)
STATIONS = ("Paris", "Rome", "Berlin", "Madrid", "Lisbon", "Vienna", "Prague", "Oslo", "Dublin", "Amsterdam", "Zurich",
            "Warsaw", "Copenhagen", "Lyon", "Munich", "Milan", "Porto", "Edinburgh", "Krakow", "Seville", "Budapest",
            "Frankfurt Hbf", "London St Pancras", "Brussels-Midi")
CITIES = (*STATIONS[:21], "Athens", "Helsinki", "New York", "Chicago", "Toronto", "Boston", "Seattle", "Tokyo",
          "Sydney")
PEOPLE = ("Anna", "Marco Rossi", "Priya", "Tom", "Lena Fischer", "Sam", "Olivia", "Jonas", "Fatima", "Mr. Okafor",
          "Chloe", "David Kim", "Mia", "Lucas", "Aisha Khan", "Ben")
PLACES = ("Central Station", "Terminal 2", "Hotel Adlon", "City Hospital", "Baker Street 12", "Old Town Square",
          "Riverside Mall", "Gate 5", "Main Street 40", "the Opera House", "Union Square", "Harbour Bridge")
ROOMS = ("living room", "bedroom", "kitchen", "office", "bathroom", "hallway")


def _day(say: Say) -> datetime.date:
    return datetime.date(2026, 1, 1) + datetime.timedelta(days=say.rng.randrange(730))


def _put_date(say: Say, d: Drawn, name: str) -> None:
    day = _day(say)
    d.put(name, day.isoformat(), say.date(day))


def _put_time(say: Say, d: Drawn, name: str, first: int = 7, last: int = 21) -> None:
    hour, minute = say.rng.randint(first, last), say.choice((0, 0, 15, 30, 30, 45, 10, 20, 40, 50))
    d.put(name, f"{hour:02d}:{minute:02d}", say.time(hour, minute))


def _people(say: Say, n: int, noun: str) -> str:
    """`for 3 passengers`, `for two people`, `just for me`; `noun` is a plural ("guests")."""
    if n == 1:
        return say.choice(("just for me", "for one person", "for myself only", f"for 1 {noun[:-1]}"))
    if n == 2 and say.chance(0.2):
        return "for the two of us"
    return f"for {say.number(n)} {say.choice((noun, 'people'))}"


def _minutes(say: Say, minutes: int) -> str:
    """A duration as people say it: `45 minutes`, `an hour and a half`, `2 hours`."""
    spoken = {30: ("half an hour",), 60: ("an hour", "one hour"), 90: ("an hour and a half", "1.5 hours"),
              120: ("2 hours", "two hours"), 180: ("3 hours",), 45: ("three quarters of an hour",)}
    if minutes in spoken and say.chance(0.6):
        return say.choice(spoken[minutes])
    return f"{say.number(minutes)} minutes"


def _two(say: Say, draw: Callable[[Say, bool], Drawn]) -> tuple[Drawn, Drawn]:
    """Two plain draws of a function with different arguments (a pair request)."""
    first = draw(say, True)
    while (second := draw(say, True)).arguments == first.arguments:
        pass
    return first, second


# ---- training domains


def _weather(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    d.put("city", say.choice(CITIES))
    if not plain and say.chance(0.35):
        unit = say.choice(("celsius", "fahrenheit"))
        d.mention("unit", unit, say.choice({"celsius": ("celsius", "Celsius", "degrees Celsius"),
                                            "fahrenheit": ("fahrenheit", "Fahrenheit", "degrees Fahrenheit")}[unit]))
    return d


UNIT_MENTIONS = ("in {unit}", "Give it to me in {unit}.", "({unit}, please)")
GET_WEATHER = Function(
    "get_weather", "Current weather in a city.", "weather", "info",
    {"city": _string(), "unit": _enum("celsius", "fahrenheit")}, ("city",), _weather,
    ("What's the weather like in {city}?", "How's the weather in {city} right now?",
     "Is it raining in {city} at the moment?", "Can you check the current weather in {city}?",
     "I'm about to head out in {city}. What's it like outside?", "Tell me the weather in {city}, please.",
     "How warm is it in {city} today?"),
    terse=("weather {city}", "{city} weather now"), mentions={"unit": UNIT_MENTIONS},
    pairs=("What's the weather in {city} and in {city2}?", "Weather in {city} and {city2} right now?",
           "Is it raining in {city}? And in {city2}?"))


def _forecast(say: Say, plain: bool) -> Drawn:
    d = _weather(say, plain)
    days = say.rng.randint(2, 10)
    d.put("days", days, say.number(days), days_adj=f"{days}-day")
    return d


GET_FORECAST = Function(
    "get_forecast", "Weather forecast for a city over the next days.", "weather", "info",
    {"city": _string(), "days": _integer(1, 10), "unit": _enum("celsius", "fahrenheit")}, ("city", "days"),
    _forecast,
    ("What's the forecast for {city} for the next {days} days?", "Will it rain in {city} over the next {days} days?",
     "Give me the {days_adj} forecast for {city}.", "I'm going to {city} for {days} days. What will the weather be "
     "like?", "Can you get the weather forecast in {city} for the coming {days} days?"),
    terse=("{city} forecast {days} days", "forecast {city} next {days} days"), mentions={"unit": UNIT_MENTIONS})


def _flight(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    origin, destination = say.rng.sample(CITIES, 2)
    d.put("origin", origin)
    d.put("destination", destination)
    _put_date(say, d, "date")
    n = say.rng.choices(range(1, 10), weights=(5, 5, 3, 3, 1, 1, 1, 1, 1))[0]
    d.put("passengers", n, _people(say, n, "passengers"))
    if not plain and say.chance(0.35):
        cabin = say.choice(("economy", "premium_economy", "business", "first"))
        d.mention("cabin", cabin, say.choice({"economy": ("economy", "economy class"),
                                              "premium_economy": ("premium economy",),
                                              "business": ("business class", "business"),
                                              "first": ("first class",)}[cabin]))
    return d


BOOK_FLIGHT = Function(
    "book_flight", "Book a flight.", "flights", "travel",
    {"origin": _string(), "destination": _string(), "date": DATE,
     "passengers": _integer(1, 9), "cabin": _enum("economy", "premium_economy", "business", "first")},
    ("origin", "destination", "date", "passengers"), _flight,
    ("Book me a flight from {origin} to {destination} on {date} {passengers}.",
     "I need a flight {origin} to {destination} on {date}, {passengers}.",
     "Please book flights from {origin} to {destination} {passengers}, departing {date}.",
     "Can you book a flight to {destination} from {origin} on {date} {passengers}?",
     "We want to fly from {origin} to {destination} on {date}. Book it {passengers}, please."),
    terse=("flight {origin} to {destination} {date} {passengers}",),
    mentions={"cabin": ("in {cabin}", "Make it {cabin}.", "We'd like to fly {cabin}.")})


def _train(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    origin, destination = say.rng.sample(STATIONS, 2)
    d.put("origin", origin)
    d.put("destination", destination)
    _put_date(say, d, "date")
    if not plain and say.chance(0.4):
        _put_time(say, d, "time", 5, 22)
        d.mentioned.append("time")
    if not plain and say.chance(0.35):
        n = say.rng.randint(1, 6)
        d.mention("passengers", n, _people(say, n, "passengers"))
    return d


BOOK_TRAIN = Function(
    "book_train", "Book train tickets.", "trains", "travel",
    {"origin": _string(), "destination": _string(), "date": DATE,
     "time": TIME, "passengers": _integer(1, 9)}, ("origin", "destination", "date"), _train,
    ("Book a train from {origin} to {destination} on {date}.", "I need train tickets {origin} to {destination} for "
     "{date}.", "Can you get me on a train from {origin} to {destination} on {date}?",
     "Reserve seats on the train to {destination} from {origin}, {date}.",
     "I'd like to take the train from {origin} to {destination} on {date}."),
    terse=("train {origin} -> {destination} {date}",),
    mentions={"time": ("leaving at {time}", "departing at {time}", "The train should leave at {time}."),
              "passengers": ("{passengers}", "Book it {passengers}.")})


RESTAURANTS = ("Luigi's", "Sakura", "El Toro", "Le Petit Bistro", "Spice Route", "The Green Fork", "Casa Nova",
               "Noodle Bar 88", "Chez Marie", "Blue Lagoon")


def _table(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    d.put("restaurant", say.choice(RESTAURANTS))
    _put_date(say, d, "date")
    _put_time(say, d, "time", 11, 22)
    n = say.rng.choices(range(1, 13), weights=(1, 6, 3, 5, 2, 3, 1, 2, 1, 1, 1, 1))[0]
    party = (f"for a party of {say.number(n)}" if n > 2 and say.chance(0.25) else
             f"for {say.number(n)}" if n > 1 and say.chance(0.3) else _people(say, n, "guests"))
    d.put("party_size", n, party)
    if not plain and say.chance(0.3):
        seating = say.choice(("indoor", "outdoor"))
        d.mention("seating", seating, say.choice({"indoor": ("inside", "indoors"),
                                                  "outdoor": ("outside", "on the terrace", "outdoors")}[seating]))
    return d


BOOK_TABLE = Function(
    "book_table", "Reserve a table at a restaurant.", "restaurant", "food",
    {"restaurant": _string(), "date": DATE, "time": TIME, "party_size": _integer(1, 20),
     "seating": _enum("indoor", "outdoor")}, ("restaurant", "date", "time", "party_size"), _table,
    ("Book a table at {restaurant} {party_size} on {date} at {time}.",
     "Can you reserve a table {party_size} at {restaurant} for {time} on {date}?",
     "We'd like to eat at {restaurant} on {date} at {time}, {party_size}.",
     "Get us a table {party_size} at {restaurant}, {date} at {time}.",
     "Please make a dinner reservation at {restaurant}: {date}, {time}, {party_size}."),
    terse=("table {restaurant} {date} {time} {party_size}",),
    mentions={"seating": ("{seating} if possible", "We'd like to sit {seating}.")})


NOTES = ("rent", "dinner last night", "the concert tickets", "your half of the taxi", "the birthday gift", "groceries")


def _money(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    d.put("recipient", say.choice(PEOPLE))
    code = say.rng.choices(tuple(CURRENCIES), weights=(4, 3, 3, 1, 1))[0]
    amount: float = say.choice((say.rng.randint(5, 300), say.rng.randint(1, 40) * 50, say.rng.randint(1, 99) + 0.5,
                                say.rng.randint(1, 200) + 0.99))
    if code == "JPY":  # no cents
        amount = int(amount) * 100
    d.put("amount", amount, say.money(amount, code))
    d.put("currency", code)
    if not plain and say.chance(0.35):
        d.mention("note", note := say.choice(NOTES), note)
    return d


SEND_MONEY = Function(
    "send_money", "Send money to a contact.", "payments", "money",
    {"recipient": _string(), "amount": {"type": "number", "minimum": 0.01}, "currency": _enum(*CURRENCIES),
     "note": _string()}, ("recipient", "amount", "currency"), _money,
    ("Send {amount} to {recipient}.", "Pay {recipient} {amount}.", "Can you transfer {amount} to {recipient}?",
     "I owe {recipient} {amount}, please send it.", "Please wire {amount} to {recipient}."),
    terse=("pay {recipient} {amount}", "send {recipient} {amount}"),
    mentions={"note": ("for {note}", "with the note \"{note}\"", "Put \"{note}\" as the note.")})


TITLES = ("Team sync", "Dentist appointment", "Project kickoff", "Lunch with Priya", "Budget review", "Yoga class",
          "Parent-teacher meeting", "Quarterly planning", "Interview with Ben", "Book club")
LOCATIONS = ("Room 4B", "Conference Room A", "Café Central", "Hall 3", "Main Office", "Studio 2")


def _event(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    d.put("title", say.choice(TITLES))
    _put_date(say, d, "date")
    _put_time(say, d, "start_time", 7, 20)
    if not plain and say.chance(0.4):
        minutes = say.choice((15, 30, 45, 60, 60, 90, 120, 180, 25, 50))
        d.mention("duration_minutes", minutes, _minutes(say, minutes))
    if not plain and say.chance(0.3):
        d.mention("location", place := say.choice(LOCATIONS), place)
    return d


CREATE_EVENT = Function(
    "create_event", "Add an event to the user's calendar.", "calendar", "schedule",
    {"title": _string(), "date": DATE, "start_time": TIME, "duration_minutes": _integer(5, 480),
     "location": _string()}, ("title", "date", "start_time"), _event,
    ("Add \"{title}\" to my calendar on {date} at {start_time}.", "Schedule {title} for {date} at {start_time}.",
     "Put a calendar event called {title} on {date}, starting at {start_time}.",
     "Can you block my calendar on {date} at {start_time} for \"{title}\"?",
     "New meeting in my calendar: {title}, {date}, {start_time}."),
    terse=("cal: {title} {date} {start_time}",),
    mentions={"duration_minutes": ("for {duration_minutes}", "It lasts {duration_minutes}."),
              "location": ("in {location}", "Location: {location}.")})


SUBJECTS = ("Quarterly report", "Friday's meeting", "Invoice 2291", "Holiday plans", "Welcome aboard", "Lunch plans")
BODIES = ("The report is ready for your review.", "Can we move the meeting to 3 pm?", "Please find the invoice "
          "attached.", "I'll be out of office next week.", "Looking forward to working with you.",
          "Are you free for lunch tomorrow?")


def _email(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    person = say.choice(PEOPLE).split()[-1].lower().strip(".")
    d.put("to", f"{person}@{say.choice(('example.com', 'acme.org', 'mail.net'))}")
    d.put("subject", say.choice(SUBJECTS))
    d.put("body", say.choice(BODIES))
    return d


SEND_EMAIL = Function(
    "send_email", "Send an email.", "email", "messaging",
    {"to": _string(format="email"), "subject": _string(), "body": _string()},
    ("to", "subject", "body"), _email,
    ("Email {to} with the subject \"{subject}\" and say: {body}",
     "Send an email to {to}. Subject: {subject}. Message: {body}",
     "Can you write to {to}? Subject \"{subject}\", text \"{body}\"",
     "Please mail {to} with subject \"{subject}\" and this message: \"{body}\""),
    terse=("email {to} / {subject} / {body}",), free_text=("body",))


MESSAGES = ("Running 10 minutes late, sorry!", "Dinner is at 8.", "Can you pick up bread on the way home?",
            "Happy birthday!", "The meeting moved to Thursday.", "Call me when you land.", "I'm outside.")


def _message(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    d.put("contact", say.choice(PEOPLE))
    d.put("text", say.choice(MESSAGES))
    if not plain and say.chance(0.35):
        app = say.choice(("sms", "whatsapp", "telegram", "signal"))
        d.mention("app", app, {"sms": say.choice(("SMS", "a text message")), "whatsapp": "WhatsApp",
                               "telegram": "Telegram", "signal": "Signal"}[app])
    return d


SEND_MESSAGE = Function(
    "send_message", "Send a chat message to a contact.", "messaging", "messaging",
    {"contact": _string(), "text": _string(), "app": _enum("sms", "whatsapp", "telegram", "signal")},
    ("contact", "text"), _message,
    ("Text {contact}: {text}", "Send {contact} a message saying \"{text}\"",
     "Message {contact} and tell them \"{text}\"", "Can you let {contact} know: {text}"),
    terse=("msg {contact}: {text}",), mentions={"app": ("Use {app}.", "Send it on {app}.")}, free_text=("text",))


UNITS = {"kilometers": ("km", "kilometers", "kilometres"), "miles": ("miles",), "kilograms": ("kg", "kilos",
         "kilograms"), "pounds": ("pounds", "lbs"), "meters": ("m", "meters", "metres"), "feet": ("feet", "ft"),
         "centimeters": ("cm", "centimetres"), "inches": ("inches",), "liters": ("liters", "litres"),
         "gallons": ("gallons",)}
UNIT_PAIRS = (("kilometers", "miles"), ("kilograms", "pounds"), ("meters", "feet"), ("centimeters", "inches"),
              ("liters", "gallons"))


def _units(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    source, target = say.rng.sample(say.choice(UNIT_PAIRS), 2)
    value: float = say.choice((say.rng.randint(1, 500), round(say.rng.randint(1, 99) + say.rng.randint(1, 9) / 10, 1)))
    d.put("value", value, say.number(value) if isinstance(value, int) else str(value))
    d.put("from_unit", source, say.choice(UNITS[source]))
    d.put("to_unit", target, say.choice([w for w in UNITS[target] if len(w) > 2] or UNITS[target]))
    return d


CONVERT_UNITS = Function(
    "convert_units", "Convert a quantity from one unit to another.", "unit conversion", "conversion",
    {"value": {"type": "number"}, "from_unit": _enum(*UNITS), "to_unit": _enum(*UNITS)},
    ("value", "from_unit", "to_unit"), _units,
    ("How many {to_unit} is {value} {from_unit}?", "Convert {value} {from_unit} to {to_unit}.",
     "What's {value} {from_unit} in {to_unit}?", "I've got {value} {from_unit} here. How much is that in {to_unit}?",
     "Quick conversion: {value} {from_unit} to {to_unit}, please."),
    terse=("{value} {from_unit} to {to_unit}", "{value} {from_unit} in {to_unit}?"))


CURRENCY_WORDS = {"EUR": ("euros", "EUR"), "USD": ("US dollars", "dollars", "USD"),
                  "GBP": ("British pounds", "pounds sterling", "GBP"), "CHF": ("Swiss francs", "CHF"),
                  "JPY": ("yen", "Japanese yen", "JPY")}


def _exchange(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    source, target = say.rng.sample(tuple(CURRENCIES), 2)
    amount = say.choice((say.rng.randint(1, 999), say.rng.randint(1, 50) * 100))
    d.put("amount", amount, say.money(amount, source))
    d.put("from_currency", source)
    d.put("to_currency", target, say.choice(CURRENCY_WORDS[target]))
    return d


CONVERT_CURRENCY = Function(
    "convert_currency", "Convert an amount of money into another currency at today's rate.", "currency conversion",
    "conversion", {"amount": {"type": "number"}, "from_currency": _enum(*CURRENCIES),
                   "to_currency": _enum(*CURRENCIES)}, ("amount", "from_currency", "to_currency"), _exchange,
    ("How much is {amount} in {to_currency}?", "Convert {amount} to {to_currency}.",
     "What's {amount} worth in {to_currency}?", "I have {amount}. How much is that in {to_currency}?",
     "What would {amount} come to in {to_currency} today?"),
    terse=("{amount} to {to_currency}", "{amount} in {to_currency}?"))


TICKETS = ("Login page shows a blank screen", "Invoice PDF won't download", "App crashes when I upload a photo",
           "Password reset email never arrives", "Wrong VAT on my last invoice", "Cannot add a second user")
PRODUCTS = ("Acme Cloud", "PhotoBox", "PayFlow", "MailDesk")


def _ticket(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    d.put("title", say.choice(TICKETS))
    priority = say.choice(("low", "normal", "high", "urgent"))
    said = {"low": ("low priority", "low priority, no rush"), "normal": ("normal priority",),
            "high": ("high priority",), "urgent": ("urgent", "it's urgent")}[priority]
    d.put("priority", priority, say.choice(said),
          priority_adj={"low": "a low-priority", "normal": "a normal-priority", "high": "a high-priority",
                        "urgent": "an urgent"}[priority])
    if not plain and say.chance(0.35):
        d.mention("product", product := say.choice(PRODUCTS), product)
    return d


CREATE_TICKET = Function(
    "create_ticket", "Open a customer support ticket.", "support tickets", "support",
    {"title": _string(), "priority": _enum("low", "normal", "high", "urgent"), "product": _string()},
    ("title", "priority"), _ticket,
    ("Open a support ticket: \"{title}\", {priority}.", "File {priority_adj} ticket saying \"{title}\".",
     "Please raise a ticket about \"{title}\" ({priority}).",
     "Our customer reports \"{title}\". Log it as a ticket, {priority}."),
    terse=("ticket \"{title}\" {priority}",),
    mentions={"product": ("for {product}", "It's about {product}.")})


REMINDERS = ("call the plumber", "buy milk", "renew my passport", "water the plants", "send the invoice",
             "book the car service", "pick up the dry cleaning")


def _reminder(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    d.put("text", say.choice(REMINDERS))
    _put_date(say, d, "date")
    _put_time(say, d, "time", 6, 22)
    return d


SET_REMINDER = Function(
    "set_reminder", "Remind the user of something at a given date and time.", "reminders", "schedule",
    {"text": _string(), "date": DATE, "time": TIME}, ("text", "date", "time"), _reminder,
    ("Remind me to {text} on {date} at {time}.", "Set a reminder for {date} at {time} to {text}.",
     "Can you remind me at {time} on {date} to {text}?", "Don't let me forget to {text}: {date}, {time}."),
    terse=("remind me {date} {time} {text}",))


SYMBOLS = ("AAPL", "MSFT", "TSLA", "NVDA", "AMZN", "GOOGL", "META", "NFLX", "SAP", "ASML", "IBM", "KO")


def _stock(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    d.put("symbol", say.choice(SYMBOLS))
    return d


GET_STOCK_PRICE = Function(
    "get_stock_price", "Latest price of a stock, by its ticker symbol.", "stocks", "money",
    {"symbol": _string(pattern="^[A-Z]{1,5}$")}, ("symbol",), _stock,
    ("What's {symbol} trading at?", "Check the stock price of {symbol}.", "How is {symbol} doing today?",
     "Price of {symbol} shares, please.", "Where is {symbol} stock right now?"),
    terse=("{symbol} price", "quote {symbol}"),
    pairs=("How are {symbol} and {symbol2} doing?", "Prices for {symbol} and {symbol2}, please."))


def _thermostat(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    d.put("room", say.choice(ROOMS))
    degrees = say.rng.randint(10, 30)
    d.put("temperature", degrees, say.number(degrees))
    return d


SET_THERMOSTAT = Function(
    "set_thermostat", "Set a room's thermostat, in degrees Celsius.", "smart home", "home",
    {"room": _enum(*ROOMS), "temperature": _integer(10, 30)}, ("room", "temperature"), _thermostat,
    ("Set the {room} to {temperature} degrees.", "Make it {temperature} degrees in the {room}.",
     "Can you turn the heating in the {room} up to {temperature}?",
     "The {room} is freezing, set it to {temperature} degrees please.", "Thermostat in the {room}: {temperature}."),
    terse=("{room} {temperature} degrees",))


def _lights(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    d.put("room", say.choice(ROOMS))
    state = say.choice(("on", "off"))
    verb = say.choice(("turn", "switch"))
    d.put("state", state, f"{verb} {state}", Switch=f"{verb.capitalize()} {state}")
    if not plain and state == "on" and say.chance(0.4):
        level = say.choice((10, 20, 25, 30, 40, 50, 60, 70, 75, 80))
        d.mention("brightness", level, say.choice((f"{level}%", f"{level} percent")))
    return d


SET_LIGHTS = Function(
    "set_lights", "Turn the lights of a room on or off.", "smart home", "home",
    {"room": _enum(*ROOMS), "state": _enum("on", "off"), "brightness": _integer(0, 100)},
    ("room", "state"), _lights,
    ("{Switch} the lights in the {room}.", "{Switch} the {room} lights, please.", "Can you {state} the {room} "
     "lights?", "Please {state} the light in the {room}."),
    terse=("{room} lights {state}",),
    mentions={"brightness": ("at {brightness}", "Brightness {brightness}.")})


LABELS = ("pasta", "laundry", "pizza", "tea", "parking meter", "eggs")


def _timer(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    minutes = say.choice((1, 2, 3, 5, 8, 10, 12, 15, 20, 25, 30, 40, 45, 60, 90, 120))
    d.put("minutes", minutes, _minutes(say, minutes))
    if not plain and say.chance(0.35):
        d.mention("label", label := say.choice(LABELS), label)
    return d


SET_TIMER = Function(
    "set_timer", "Start a countdown timer.", "timers", "schedule",
    {"minutes": _integer(1, 180), "label": _string()}, ("minutes",), _timer,
    ("Set a timer for {minutes}.", "Timer for {minutes}, please.", "Can you count down {minutes} for me?",
     "Start a countdown of {minutes}."),
    terse=("timer {minutes}",), mentions={"label": ("for the {label}", "Call it \"{label}\".")})


SONGS = {"Adele": ("Hello", "Skyfall"), "Miles Davis": ("So What",), "Daft Punk": ("Get Lucky", "One More Time"),
         "Queen": ("Bohemian Rhapsody",), "Nina Simone": ("Feeling Good",), "Coldplay": ("Yellow", "Fix You"),
         "ABBA": ("Dancing Queen",)}


def _music(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    d.put("artist", artist := say.choice(tuple(SONGS)))
    if not plain and say.chance(0.35):
        d.mention("song", song := say.choice(SONGS[artist]), song)
    return d


PLAY_MUSIC = Function(
    "play_music", "Play music by an artist, optionally a given song.", "music", "home",
    {"artist": _string(), "song": _string()}, ("artist",), _music,
    ("Play something by {artist}.", "Put on some {artist}.", "I want to listen to {artist}.",
     "Can you play {artist} in the living room?"),
    terse=("play {artist}",), mentions={"song": ("starting with \"{song}\"", "Start with \"{song}\".")})


def _taxi(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    pickup, dropoff = say.rng.sample(PLACES, 2)
    d.put("pickup", pickup)
    d.put("dropoff", dropoff)
    if not plain and say.chance(0.35):
        _put_time(say, d, "time", 5, 23)
        d.mentioned.append("time")
    if not plain and say.chance(0.3):
        n = say.rng.randint(1, 6)
        d.mention("passengers", n, _people(say, n, "passengers"))
    return d


BOOK_TAXI = Function(
    "book_taxi", "Book a taxi ride.", "taxi", "travel",
    {"pickup": _string(), "dropoff": _string(), "time": TIME, "passengers": _integer(1, 8)}, ("pickup", "dropoff"),
    _taxi,
    ("Get me a taxi from {pickup} to {dropoff}.", "I need a cab from {pickup} to {dropoff}.",
     "Book a taxi to {dropoff}, pick me up at {pickup}.", "Can you order a ride from {pickup} to {dropoff}?"),
    terse=("taxi {pickup} -> {dropoff}",),
    mentions={"time": ("at {time}", "Pickup at {time}."), "passengers": ("{passengers}", "It's {passengers}.")})


TASKS = ("renew car insurance", "buy a birthday present for Tom", "clean the garage", "order printer ink",
         "fix the bike light", "prepare the slides")


def _task(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    d.put("task", say.choice(TASKS))
    if not plain and say.chance(0.35):
        d.mention("list", kind := say.choice(("work", "personal", "shopping")), kind)
    if not plain and say.chance(0.3):
        _put_date(say, d, "due_date")
        d.mentioned.append("due_date")
    return d


ADD_TASK = Function(
    "add_task", "Add a task to the user's to-do list.", "to-do list", "schedule",
    {"task": _string(), "list": _enum("work", "personal", "shopping"), "due_date": DATE}, ("task",), _task,
    ("Add \"{task}\" to my to-do list.", "New task: {task}.", "Can you add {task} to my tasks?",
     "Put \"{task}\" on my to-do list."),
    terse=("todo: {task}",),
    mentions={"list": ("Put it on the {list} list.", "It's for my {list} list."),
              "due_date": ("due {due_date}", "It's due {due_date}.")})


# ---- held-out domains: only the test split offers them


def _hotel(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    d.put("city", say.choice(CITIES))
    _put_date(say, d, "check_in")
    nights = say.rng.choices(range(1, 15), weights=(3, 4, 4, 3, 2, 1, 2, 1, 1, 1, 1, 1, 1, 1))[0]
    d.put("nights", nights, "one night" if nights == 1 else f"{say.number(nights)} nights")
    guests = say.rng.choices(range(1, 7), weights=(3, 5, 2, 2, 1, 1))[0]
    d.put("guests", guests, _people(say, guests, "guests"))
    if not plain and say.chance(0.35):
        room = say.choice(("single", "double", "suite"))
        d.mention("room_type", room, {"single": "single room", "double": "double room", "suite": "suite"}[room])
    return d


BOOK_HOTEL = Function(
    "book_hotel", "Book a hotel room.", "hotels", "travel",
    {"city": _string(), "check_in": DATE, "nights": _integer(1, 30), "guests": _integer(1, 8),
     "room_type": _enum("single", "double", "suite")}, ("city", "check_in", "nights", "guests"), _hotel,
    ("Book a hotel in {city} for {nights} from {check_in}, {guests}.",
     "I need a hotel room in {city}: check-in {check_in}, {nights}, {guests}.",
     "Could you reserve a hotel in {city}? We arrive on {check_in} and stay {nights}, {guests}.",
     "Find me somewhere to stay in {city} from {check_in}, {nights}, {guests}."),
    terse=("hotel {city} {check_in} {nights} {guests}",),
    mentions={"room_type": ("A {room_type} would be great.", "We'd like a {room_type}.")})


def _car(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    d.put("city", say.choice(CITIES))
    _put_date(say, d, "pickup_date")
    days = say.choice((1, 2, 3, 4, 5, 6, 7, 7, 10, 14))
    said = {1: ("one day", "a day"), 7: ("a week", "7 days"), 14: ("two weeks", "14 days")}
    d.put("days", days, say.choice(said[days]) if days in said else f"{say.number(days)} days")
    if not plain and say.chance(0.35):
        kind = say.choice(("economy", "compact", "suv", "van"))
        d.mention("car_class", kind, {"economy": "an economy car", "compact": "a compact car", "suv": "an SUV",
                                      "van": "a van"}[kind])
    return d


RENT_CAR = Function(
    "rent_car", "Rent a car.", "car rental", "travel",
    {"city": _string(), "pickup_date": DATE, "days": _integer(1, 30), "car_class": _enum("economy", "compact", "suv",
                                                                                          "van")},
    ("city", "pickup_date", "days"), _car,
    ("Rent me a car in {city} from {pickup_date} for {days}.",
     "I need a rental car in {city}, picking it up on {pickup_date}, for {days}.",
     "Can you book a car hire in {city} starting {pickup_date} for {days}?"),
    terse=("car rental {city} {pickup_date} {days}",),
    mentions={"car_class": ("We'd like {car_class}.", "Make it {car_class}.")})


def _directions(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    origin, destination = say.rng.sample(PLACES, 2)
    d.put("origin", origin)
    d.put("destination", destination)
    if not plain and say.chance(0.45):
        mode = say.choice(("driving", "walking", "cycling", "transit"))
        d.mention("mode", mode, say.choice({"driving": ("by car",), "walking": ("on foot",), "cycling": ("by bike",),
                                            "transit": ("by public transport", "by bus")}[mode]))
    return d


GET_DIRECTIONS = Function(
    "get_directions", "Route directions between two places.", "maps", "travel",
    {"origin": _string(), "destination": _string(), "mode": _enum("driving", "walking", "cycling", "transit")},
    ("origin", "destination"), _directions,
    ("How do I get from {origin} to {destination}?", "Directions from {origin} to {destination}, please.",
     "What's the best way to get to {destination} from {origin}?", "Show me the route from {origin} to "
     "{destination}."),
    terse=("route {origin} -> {destination}",), mentions={"mode": ("{mode}", "I'll be travelling {mode}.")})


PHRASES = ("Where is the train station?", "Thank you for your help.", "I would like a coffee, please.",
           "The meeting is cancelled.", "How much does this cost?", "We are running late.")
LANGUAGES = ("French", "German", "Spanish", "Italian", "Portuguese", "Japanese", "Dutch")


def _translate(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    d.put("text", say.choice(PHRASES))
    language = say.choice(LANGUAGES)
    d.put("target_language", language, language if say.chance(0.8) else language.lower())
    return d


TRANSLATE_TEXT = Function(
    "translate_text", "Translate a text into another language.", "translation", "language",
    {"text": _string(), "target_language": _enum(*LANGUAGES)}, ("text", "target_language"), _translate,
    ("Translate \"{text}\" into {target_language}.", "How do you say \"{text}\" in {target_language}?",
     "Can you put this into {target_language}: {text}", "What is \"{text}\" in {target_language}?"),
    terse=("{target_language}: \"{text}\"",), free_text=("text",))


def _tracking_number(say: Say) -> str:
    rng = say.rng
    return say.choice((
        "1Z" + "".join(rng.choice(string.ascii_uppercase + string.digits) for _ in range(16)),
        "".join(rng.choice(string.ascii_uppercase) for _ in range(2)) + "".join(rng.choice(string.digits)
                                                                               for _ in range(9)) + "DE",
        "".join(rng.choice(string.digits) for _ in range(12))))


def _parcel(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    d.put("tracking_number", _tracking_number(say))
    if not plain and say.chance(0.35):
        d.mention("carrier", carrier := say.choice(("DHL", "UPS", "FedEx", "USPS", "DPD")), carrier)
    return d


TRACK_PACKAGE = Function(
    "track_package", "Where a parcel is, by its tracking number.", "shipping", "info",
    {"tracking_number": _string(pattern="^[A-Z0-9]{8,22}$"), "carrier": _enum("DHL", "UPS", "FedEx", "USPS", "DPD")},
    ("tracking_number",), _parcel,
    ("Where is my parcel {tracking_number}?", "Track package {tracking_number}, please.",
     "Any news on shipment {tracking_number}?", "Can you check the delivery status of {tracking_number}?"),
    terse=("track {tracking_number}",), mentions={"carrier": ("({carrier})", "It's coming with {carrier}.")},
    pairs=("Track {tracking_number} and {tracking_number2}.", "Where are my parcels {tracking_number} and "
           "{tracking_number2}?"))


TEAMS = {"Arsenal": ("football",), "Lakers": ("basketball",), "Real Madrid": ("football", "basketball"),
         "Bayern Munich": ("football", "basketball"), "Celtics": ("basketball",), "Ajax": ("football",),
         "Yankees": ("baseball",), "Maple Leafs": ("ice_hockey",), "Juventus": ("football",)}


def _score(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    d.put("team", team := say.choice(tuple(TEAMS)))
    if not plain and say.chance(0.3):
        sport = say.choice(TEAMS[team])
        d.mention("sport", sport, say.choice({"football": ("football", "soccer"), "basketball": ("basketball",),
                                              "ice_hockey": ("ice hockey", "hockey"),
                                              "baseball": ("baseball",)}[sport]))
    return d


GET_MATCH_SCORE = Function(
    "get_match_score", "Result of a team's latest match.", "sports", "info",
    {"team": _string(), "sport": _enum("football", "basketball", "ice_hockey", "baseball")}, ("team",), _score,
    ("What was the score in the last {team} game?", "Did {team} win their last match?", "How did {team} do last "
     "night?", "Give me the latest {team} result."),
    terse=("{team} score",), mentions={"sport": ("({sport})", "I mean {sport}.")},
    pairs=("Scores for {team} and {team2}?", "How did {team} and {team2} do?"))


DISHES = ("lasagne", "pad thai", "banana bread", "chicken curry", "mushroom risotto", "pancakes", "gazpacho")


def _recipe(say: Say, plain: bool) -> Drawn:
    d = Drawn()
    d.put("dish", say.choice(DISHES))
    if not plain and say.chance(0.3):
        diet = say.choice(("vegetarian", "vegan", "gluten_free"))
        d.mention("diet", diet, diet.replace("_", "-"))
    if not plain and say.chance(0.3):
        minutes = say.choice((15, 20, 30, 45, 60))
        d.mention("max_minutes", minutes, _minutes(say, minutes))
    return d


FIND_RECIPE = Function(
    "find_recipe", "Find a recipe for a dish.", "recipes", "food",
    {"dish": _string(), "diet": _enum("vegetarian", "vegan", "gluten_free"), "max_minutes": _integer(5, 240)},
    ("dish",), _recipe,
    ("Find me a recipe for {dish}.", "How do I make {dish}?", "I want to cook {dish} tonight. Any recipe?",
     "Look up a {dish} recipe, please."),
    terse=("recipe {dish}",),
    mentions={"diet": ("It has to be {diet}.", "Something {diet}, please."),
              "max_minutes": ("in under {max_minutes}", "I only have {max_minutes}.")})


TRAIN_FUNCTIONS = (GET_WEATHER, GET_FORECAST, BOOK_FLIGHT, BOOK_TRAIN, BOOK_TABLE, SEND_MONEY, CREATE_EVENT,
                   SEND_EMAIL, SEND_MESSAGE, CONVERT_UNITS, CONVERT_CURRENCY, CREATE_TICKET, SET_REMINDER,
                   GET_STOCK_PRICE, SET_THERMOSTAT, SET_LIGHTS, SET_TIMER, PLAY_MUSIC, BOOK_TAXI, ADD_TASK)
# Never trained on: the evaluation's tools come from these alone.
HELD_OUT_FUNCTIONS = (BOOK_HOTEL, RENT_CAR, GET_DIRECTIONS, TRANSLATE_TEXT, TRACK_PACKAGE, GET_MATCH_SCORE,
                      FIND_RECIPE)
HELD_OUT_DOMAINS = frozenset(f.domain for f in HELD_OUT_FUNCTIONS)
FUNCTIONS = {f.name: f for f in (*TRAIN_FUNCTIONS, *HELD_OUT_FUNCTIONS)}

# -- an item -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolQuestion:
    """One item: the request in words, the tools offered with tool_choice and parallel_tool_calls, the gold calls."""

    request: str
    functions: tuple[Function, ...]  # offered, in the order the prompt lists them
    tool_choice: str | dict[str, Any]  # "auto", "required" or {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool | None  # None: left out (the default, parallel)
    calls: tuple[tuple[str, dict[str, Any]], ...]  # gold; empty: no call
    phrasings: tuple[str, ...]  # the pooled domain-free phrasings it took

    @property
    def params(self) -> dict[str, Any]:
        """The chat request's tool fields: a training record's `tools`, a test row's."""
        return {"tools": [f.tool for f in self.functions], "tool_choice": self.tool_choice,
                **({} if self.parallel_tool_calls is None else {"parallel_tool_calls": self.parallel_tool_calls})}

    @property
    def completion(self) -> str:
        """Exactly what the grammar lets a role write: the calls, or (no call) the plain reply."""
        if not self.calls:
            return NO_CALL_REPLY
        return TOOL_CALL_SEPARATOR.join(call_text(name, arguments) for name, arguments in self.calls)

    @property
    def label(self) -> str:
        """The first call's tool by its place in the list, as a letter (or "none"): training balances by it, so no
        place is favoured, in the same classes as the decisions' option places."""
        if not self.calls:
            return NONE
        return LETTERS[[f.name for f in self.functions].index(self.calls[0][0])]

    @property
    def domains(self) -> set[str]:
        return {f.domain for f in self.functions}


def _inline(text: str, phrase: str) -> str:
    """`phrase` put before the text's final mark (and a closing ", please"): "... in Paris?" + "in fahrenheit" ->
    "... in Paris in fahrenheit?"."""
    end = len(text) - (text[-1:] in (".", "?", "!"))
    if text[:end].endswith(", please"):
        end -= len(", please")
    return f"{text[:end]} {phrase}{text[end:]}"


@dataclass(frozen=True)
class Asked:
    """A request in words, before what people add around it."""

    text: str
    open_ended: bool  # it ends with open text: nothing may follow it
    terse: bool  # typed in a hurry: nothing is added around it


def _request(say: Say, fn: Function, drawn: Drawn, may_be_terse: bool = True) -> Asked:
    """One call asked in words: the template, its optional arguments said inline, then those said as sentences
    (before it, where it ends with open text that a sentence after would read as part of)."""
    terse = may_be_terse and bool(fn.terse) and say.chance(0.12)
    template = say.choice(fn.terse if terse else fn.requests)
    text, open_ended = template.format(**drawn.slots), fn.open_ended(template)
    sentences = []
    for name in drawn.mentioned:
        inline = [m for m in fn.mentions[name] if m[0].islower() or m[0] in "({"]
        whole = [m for m in fn.mentions[name] if m not in inline]
        if inline and not open_ended and (not whole or say.chance(0.5)):
            text = _inline(text, say.choice(inline).format(**drawn.slots))
        else:
            sentences.append(say.choice(whole).format(**drawn.slots))
    parts = [*sentences, text] if open_ended else [text, *sentences]
    return Asked(" ".join(parts), open_ended, terse)


def _pair_request(say: Say, fn: Function) -> tuple[str, list[Drawn]]:
    first, second = _two(say, fn.draw)
    slots = {**first.slots, **{f"{key}2": value for key, value in second.slots.items()}}
    return say.choice(fn.pairs).format(**slots), [first, second]


def _joined(say: Say, asks: list[tuple[Function, Drawn]]) -> tuple[Asked, list[tuple[Function, Drawn]]]:
    """Two requests in one message; one that ends with open text goes last."""
    said = sorted(((_request(say, fn, drawn, may_be_terse=False), (fn, drawn)) for fn, drawn in asks),
                  key=lambda item: item[0].open_ended)  # stable: the open-ended one last
    (first, _), (second, _) = said
    text = say.pick(JOINS).format(a=first.text, b=second.text)
    return Asked(text, second.open_ended, False), [ask for _, ask in said]


def _dressed(say: Say, asked: Asked) -> str:
    """The request with what people add around it: a greeting, an aside, a thank-you (never after open text),
    unless it was typed in a hurry."""
    if asked.terse:
        return asked.text
    parts, open_ended = [asked.text], asked.open_ended
    if say.chance(0.25):
        if open_ended or say.chance(0.5):
            parts.insert(0, say.pick(ASIDES))
        else:
            parts.append(say.pick(ASIDES))
    if say.chance(0.3):
        parts.insert(0, say.pick(OPENERS))
    if not open_ended and say.chance(0.3):
        parts.append(say.pick(CLOSERS))
    text = parts[0]
    for part in parts[1:]:  # a list stays a list: what comes before it gets a line of its own
        text += ("\n" if part.startswith("- ") else " ") + part
    return text


# The most characters of tool lines an item's system prompt lists (about 450 tokens of SmolLM2's): a distractor
# that would pass it is left out, so that the longest prompts fit training's 768 tokens with their answer.
TOOLS_BUDGET_CHARS = 1700


def _tool_set(say: Say, pool: tuple[Function, ...], wanted: list[Function], near: list[Function],
              barred: set[str]) -> list[Function]:
    """`wanted` with distractors, in a random order: often a function of the same domain or family as one of
    `near` (the near misses that need reading), never one of a `barred` domain."""
    chosen = list(dict.fromkeys(wanted))
    count = max(len(chosen), say.rng.choices((2, 3, 4, 5), weights=(4, 3, 2, 1))[0])
    others = [f for f in pool if f not in chosen and f.domain not in barred]

    def fits(f: Function) -> bool:
        return f not in chosen and sum(c.size for c in chosen) + f.size <= TOOLS_BUDGET_CHARS

    for close_to in (lambda f, n: f.domain == n.domain, lambda f, n: f.family == n.family and f.domain != n.domain):
        close = [f for f in others if fits(f) and any(close_to(f, n) for n in near)]
        if close and len(chosen) < count and say.chance(0.5):
            chosen.append(say.choice(close))
    for f in say.rng.sample(others, len(others)):
        if len(chosen) < max(count, 2) and fits(f):
            chosen.append(f)
    say.rng.shuffle(chosen)
    return chosen


def _calls_item(say: Say, pool: tuple[Function, ...], choice: str) -> tuple[str, list[tuple[Function, Drawn]], list[
        Function], bool]:
    """A request for one call (or two, unless a function is named), the functions it calls, and whether it
    asks for two."""
    target = say.choice(pool)
    if choice != "named" and say.chance(0.12):
        if target.pairs and say.chance(0.5):
            text, drawn = _pair_request(say, target)
            return _dressed(say, Asked(text, False, False)), [(target, d) for d in drawn], [target], True
        # two requests that end with open text cannot share a message: one would run into the other
        other = say.choice([f for f in pool if f is not target and not (target.free_text and f.free_text)])
        asked, asks = _joined(say, [(target, target.draw(say, False)), (other, other.draw(say, False))])
        return _dressed(say, asked), asks, [target, other], True
    drawn = target.draw(say, False)
    return _dressed(say, _request(say, target, drawn)), [(target, drawn)], [target], False


def sample(rng: random.Random, split: str) -> ToolQuestion:
    """One item of `split`: train and val from the training domains and phrasings; test from the held-out domains
    alone, with half of its domain-free phrasings held out too."""
    held_out = split == "test"
    pool = HELD_OUT_FUNCTIONS if held_out else TRAIN_FUNCTIONS
    say = Say(rng, held_out)
    choice = rng.choices(("auto", "required", "named"), weights=(70, 18, 12))[0]
    if choice == "auto" and rng.random() < 0.15:  # no tool fits
        if rng.random() < 0.4:
            asked, near, barred = Asked(say.choice(CHAT["test" if held_out else "train"]), False, False), [], set()
        else:  # a task of a tool not offered, nor any of its domain: a near miss of its family may be
            fn = say.choice(pool)
            asked, near, barred = _request(say, fn, fn.draw(say, False)), [fn], {fn.domain}
        functions = _tool_set(say, pool, [], near, barred)
        return ToolQuestion(_dressed(say, asked), tuple(functions), choice, None, (), tuple(say.used))
    text, asks, targets, several = _calls_item(say, pool, choice)
    functions = _tool_set(say, pool, targets, targets, set())
    named = {"type": "function", "function": {"name": targets[0].name}}
    parallel = (rng.choice((None, None, True)) if several
                else rng.choices((None, True, False), weights=(80, 5, 15))[0])
    return ToolQuestion(text, tuple(functions), named if choice == "named" else choice, parallel,
                        tuple(fn.call(drawn) for fn, drawn in asks), tuple(say.used))


def questions(n: int, seed: int, split: str) -> Iterator[ToolQuestion]:
    """`n` distinct items of `split` (a request is repeated only with other tools or another tool_choice)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}")
    rng = random.Random(f"{seed}/tools/{split}")
    seen: set[str] = set()
    made = 0
    while made < n:
        q = sample(rng, split)
        key = json.dumps([q.request, [f.name for f in q.functions], q.tool_choice, q.parallel_tool_calls])
        if key not in seen:
            seen.add(key)
            made += 1
            yield q


# -- files ---------------------------------------------------------------------------------------------------------


def training_record(q: ToolQuestion) -> dict[str, Any]:
    """`{"prompt", "completion", "label", "tools"}`, as `kevlaya train` reads it (modellab/training/data.py)."""
    return {"prompt": q.request, "completion": q.completion, "label": q.label, "tools": q.params}


def eval_row(q: ToolQuestion, row_id: str) -> dict[str, Any]:
    """`{"id", "request", "tools", "calls", "label", "domains"}`, as `kevlaya eval-tools` reads it; `calls` is
    the gold, `[]` for no call."""
    return {"id": row_id, "request": q.request, "tools": q.params,
            "calls": [{"name": name, "arguments": arguments} for name, arguments in q.calls], "label": q.label,
            "domains": sorted(q.domains)}


def write_tool_questions(path: Path, n: int, seed: int, split: str = "test") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for i, q in enumerate(questions(n, seed, split)):
            out.write(json.dumps(eval_row(q, f"tools-{split}-{i:05d}")) + "\n")
    return path


def add_to_training(out_dir: Path, n: int, seed: int, adapters: tuple[str, ...] = ("kev", "laya")) -> dict[str, Path]:
    """`n` training items shuffled into each `<adapter>/train.jsonl` under `out_dir` (the same items for both
    roles: a call is written the same way by either). With `n` 0 the files are left as they are."""
    paths: dict[str, Path] = {}
    if n == 0:
        return paths
    records = [json.dumps(training_record(q)) for q in questions(n, seed, "train")]
    for adapter in adapters:
        path = Path(out_dir) / adapter / "train.jsonl"
        lines = [*path.read_text(encoding="utf-8").splitlines(), *records]
        random.Random(f"{seed}/{adapter}/tools").shuffle(lines)
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        paths[f"{adapter}/train"] = path
    return paths
