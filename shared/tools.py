"""Function tools as the model sees them and writes them (docs/architecture.md §9, Tool calls): the tools in the
system prompt, a conversation's earlier calls and results as plain chat turns, and the calls read back out of an
answer. Plain data (stored params and input), so the API's prompt budget and the worker build the same text."""

from __future__ import annotations

import json
import re
from typing import Any

from shared.grammar import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TOOL_CALL_SEPARATOR

TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>\n", "\n</tool_response>"
DEFAULT_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def parameters_of(function: dict[str, Any]) -> dict[str, Any]:
    """A function's arguments schema: its `parameters`, an empty object where it has none (OpenAI's rule)."""
    return function.get("parameters") or DEFAULT_PARAMETERS


def offered_functions(params: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The functions an answer may call (name: parameters' schema): every tool, or the one tool_choice names."""
    functions = {tool["function"]["name"]: parameters_of(tool["function"]) for tool in params["tools"]}
    choice = params.get("tool_choice") or "auto"
    return {choice["function"]["name"]: functions[choice["function"]["name"]]} if isinstance(choice, dict) \
        else functions


def call_text(name: str, arguments: dict[str, Any]) -> str:
    """One call in the wire format the grammar enforces."""
    return f"{TOOL_CALL_OPEN}{_compact({'name': name, 'arguments': arguments})}{TOOL_CALL_CLOSE}"


def tools_prompt(params: dict[str, Any]) -> str:
    """What the system prompt says of the tools: each function as a line of JSON, how a call is written, and what
    tool_choice and parallel_tool_calls ask."""
    choice = params.get("tool_choice") or "auto"
    lines = [_compact({key: tool["function"][key] for key in ("name", "description", "parameters")
                       if key in tool["function"]}) for tool in params["tools"]]
    if isinstance(choice, dict):
        ask = f"Call {choice['function']['name']}."
    elif choice == "required":
        ask = "Answer with function calls only."
    else:
        ask = "Answer in text, or call functions where they help."
    many = "One call per block; several blocks for several calls." if params.get("parallel_tool_calls") is not False \
        else "One call at most."
    return "\n".join(["# Tools", "<tools>", *lines, "</tools>",
                      f"To call a function, answer {TOOL_CALL_OPEN}{{\"name\": <function>, \"arguments\": "
                      f"<arguments object>}}{TOOL_CALL_CLOSE}", f"{ask} {many}"])


def with_tools(messages: list[dict[str, str]], params: dict[str, Any]) -> list[dict[str, str]]:
    """`messages` (the system prompt already first, where there is one) with the tools in the system message."""
    if params.get("output") != "tool_calls":
        return messages
    tools = tools_prompt(params)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{tools}"}, *messages[1:]]
    return [{"role": "system", "content": tools}, *messages]


def chat_turns(stored: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Stored messages as the plain turns every chat template takes (none of the bases' templates has tool
    roles): a message's `name` comes before its text (`ana: ...`); an assistant's calls become its text in the
    wire format, after its content; the results of a turn's calls become one user turn of `<tool_response>`
    blocks, each `{"name", "content"}`."""
    turns: list[dict[str, str]] = []
    names: dict[str, str] = {}  # call id: function name, from the assistant turns so far
    after_result = False  # the last turn holds tool results: the next result joins it
    for message in stored:
        role, content = message["role"], message.get("content")
        if content and message.get("name"):
            content = f"{message['name']}: {content}"
        if role == "tool":
            block = (f"{TOOL_RESPONSE_OPEN}{_compact({'name': names.get(message['tool_call_id'], ''), 'content': content})}"
                     f"{TOOL_RESPONSE_CLOSE}")
            if after_result:
                turns[-1]["content"] += f"\n{block}"
            else:
                turns.append({"role": "user", "content": block})
            after_result = True
            continue
        if role == "assistant" and message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                names[call["id"]] = call["function"]["name"]
                calls.append(call_text(call["function"]["name"], json.loads(call["function"]["arguments"])))
            content = "\n".join([*([content] if content else []), TOOL_CALL_SEPARATOR.join(calls)])
        elif not isinstance(content, str):  # a stored row the API would not have taken: the job's input is at fault
            raise ValueError(f"a {role!r} message without text content")
        turns.append({"role": role, "content": content})
        after_result = False
    return turns


def leading_calls(text: str) -> tuple[list[tuple[str, dict[str, Any]]], int]:
    """The complete calls an answer opens with, as (name, arguments), and where the last of them ends: the whole
    text for an answer of calls alone, less for calls that max_tokens cut short (or that a stream has not finished
    writing), 0 for text."""
    decoder, calls, at, end = json.JSONDecoder(), [], 0, 0
    while text.startswith(TOOL_CALL_OPEN, at):
        try:
            value, at = decoder.raw_decode(text, at + len(TOOL_CALL_OPEN))
        except json.JSONDecodeError:
            break
        if not (isinstance(value, dict) and isinstance(value.get("name"), str)
                and isinstance(value.get("arguments"), dict) and text.startswith(TOOL_CALL_CLOSE, at)):
            break
        calls.append((value["name"], value["arguments"]))
        at = end = at + len(TOOL_CALL_CLOSE)
        if not text.startswith(TOOL_CALL_SEPARATOR, at):
            break
        at += len(TOOL_CALL_SEPARATOR)
    return calls, end


_CUT_CALL = re.compile(r'\{"name": "((?:[^"\\]|\\.)*)", "arguments": (.*)', re.DOTALL)


def cut_call(text: str) -> tuple[str, str] | None:
    """A call that max_tokens cut short, as the text after an answer's complete calls holds it: its name and its
    arguments so far (OpenAI hands such a call back with `finish_reason: "length"`); None where the name itself was
    cut, or the text opens no call."""
    match = _CUT_CALL.match(text.removeprefix(TOOL_CALL_OPEN)) if text.startswith(TOOL_CALL_OPEN) else None
    return (json.loads(f'"{match[1]}"'), match[2]) if match else None


def may_open_call(text: str) -> bool:
    """Whether an answer written so far is, or may still become, calls (a stream holds such text back)."""
    return text.startswith(TOOL_CALL_OPEN) or TOOL_CALL_OPEN.startswith(text)
