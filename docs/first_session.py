"""The README's first session: plain-words questions to Kev, Laya and auto through the official `openai` SDK.

Run it against `make run` from the project's directory (it reads the API key `make run` wrote):
    .venv/bin/python docs/first_session.py [--base-url http://127.0.0.1:8000/v1]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from openai import OpenAI

TRAIN_OR_FLY = ("Should I take the train or fly to Lyon? The train takes 2 h and costs 40 EUR; the flight takes 1 h "
                "plus 2 h of airport time and costs 90 EUR. I care most about cost.")
PRINTERS = ("I need a printer for the office and speed matters most. The Brother prints 30 pages a minute for "
            "180 USD, the HP 40 pages a minute for 240 USD, the Canon 20 pages a minute for 150 USD. My budget "
            "is 200 USD.")
CHAT_TOOLS = ("Which chat tool should my team use? Slack costs 8 USD a seat and is rated 4.5/5, Teams costs 4 USD "
              "and is rated 4/5, Discord is free and rated 3.5/5. We want the cheapest one rated at least 4/5.")
DINNER = "Pizza at 12 EUR with a 20 minute wait, or sushi at 25 EUR with a 5 minute wait? I'm starving: fastest."
CHOICE = {"type": "object", "properties": {"choice": {"enum": ["pizza", "sushi"]}, "reason": {"type": "string"}},
          "required": ["choice", "reason"], "additionalProperties": False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the API's /v1 address")
    parser.add_argument("--key-file", type=Path, default=Path(".kevlaya/api_key"), help="where `make run` kept the key")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.key_file.read_text().strip())

    for model, question in (("laya", TRAIN_OR_FLY), ("kev", TRAIN_OR_FLY), ("auto", TRAIN_OR_FLY),
                            ("laya", CHAT_TOOLS)):
        started = time.perf_counter()
        answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}])
        extra = answer.model_extra["kevlaya"]
        print(f"--- {model} ({time.perf_counter() - started:.1f} s, answered by {extra['answered_by']})")
        print(answer.choices[0].message.content)
        print("decision:", json.dumps(extra["decision"]))

    print("--- kev, streamed")
    for chunk in client.chat.completions.create(model="kev", stream=True,
                                                messages=[{"role": "user", "content": PRINTERS}]):
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()

    print("--- laya, json_schema")
    answer = client.chat.completions.create(
        model="laya", messages=[{"role": "user", "content": DINNER}],
        response_format={"type": "json_schema", "json_schema": {"name": "choice", "schema": CHOICE}})
    print(answer.choices[0].message.content)


if __name__ == "__main__":
    main()
