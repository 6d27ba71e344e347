"""The benchmark's jobs: fixed by a seed, so both schemes and every run see the same prompts and lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from shared.settings import Settings
from shared.tools import with_tools

WORDS = ("option", "cost", "risk", "low", "medium", "high", "days", "quality", "budget", "constraint", "choose",
         "supplier", "deadline", "team", "plan", "A", "B", "C", "D", "12", "40", "25", "7", "and", "or", "with")


@dataclass(frozen=True)
class BenchJob:
    adapter: str
    messages: list[dict[str, str]]
    max_new_tokens: int
    prompt_tokens: int  # of the chat-templated prompt, as the worker will count it

    def body(self, output: str = "text") -> dict[str, Any]:
        """The job as `POST /v1/jobs` takes it: greedy; raw text, under the decision grammar (`decision`), or a
        forced call of one of `TOOLS` (`tool_calls`)."""
        params: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "temperature": 0, "output": output}
        if output == "tool_calls":
            params.update(TOOL_PARAMS)
        return {"adapter": self.adapter, "input": {"messages": self.messages}, "params": params}

    def body_beside_tools(self) -> dict[str, Any]:
        """Free text from the prompt a forced tool call sees (the tools in its system message), so the two differ
        only by the grammar."""
        body = self.body()
        body["input"]["messages"] = with_tools(self.messages, {"output": "tool_calls", **TOOL_PARAMS})
        return body


# What an agent offers: a function with an enumerated, a bounded and a formatted argument, so the tool-call
# grammar's masks cost what they cost in use.
TOOLS = [{"type": "function", "function": {"name": "book_trip", "description": "Book a trip.", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["mode", "date"], "properties": {
        "mode": {"type": "string", "enum": ["train", "flight", "bus"]},
        "date": {"type": "string", "format": "date"},
        "seats": {"type": "integer", "minimum": 1, "maximum": 9}}}}}]
TOOL_PARAMS: dict[str, Any] = {"tools": TOOLS, "tool_choice": "required"}


def prompt_length(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> int:
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"])


def sized_messages(tokenizer: PreTrainedTokenizerBase, system_prompt: str, target: int,
                   rng: random.Random) -> list[dict[str, str]]:
    """A system prompt and a user message of random words whose templated prompt is `target` tokens or just under."""
    words: list[str] = []
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": ""}]
    while True:
        words.append(rng.choice(WORDS))
        messages[1]["content"] = " ".join(words)
        if prompt_length(tokenizer, messages) > target:
            break
    while prompt_length(tokenizer, messages) > target and len(messages[1]["content"]) > 1:
        messages[1]["content"] = messages[1]["content"][:-1]
    if prompt_length(tokenizer, messages) > target:
        raise ValueError(f"a prompt of {target} tokens cannot hold the system prompt and a user message; "
                         "raise the prompt length")
    return messages


def make_jobs(tokenizer: PreTrainedTokenizerBase, settings: Settings, *, count: int, seed: int,
              prompt_tokens: tuple[int, int], new_tokens: dict[str, int],
              adapters: tuple[str, ...] = ("kev", "laya")) -> list[BenchJob]:
    """`count` jobs cycling through `adapters` (kev, laya, kev, ...), prompts drawn from `prompt_tokens`."""
    rng = random.Random(seed)
    jobs = []
    for index in range(count):
        adapter = adapters[index % len(adapters)]
        system = settings.adapter_profile(adapter).system_prompt  # type: ignore[arg-type]
        messages = sized_messages(tokenizer, system, rng.randint(*prompt_tokens), rng)
        jobs.append(BenchJob(adapter, messages, new_tokens[adapter], prompt_length(tokenizer, messages)))
    return jobs
