"""Prompt tokens at submit time: a job whose prompt and new tokens cannot fit the model's context is refused
with 422 instead of failing later on the worker.

The prompt is counted as the worker will build it (shared/schemas.py `model_messages`): the adapter's system prompt
and the tools in it, the chat template, control tokens in user text encoded as text. Only the tokenizer is loaded
(through transformers' tokenizers backend, which does not import torch: the API process never does,
docs/architecture.md §2)."""

from __future__ import annotations

import functools
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from api.http.errors import ApiError
from shared.base_source import base_directory, locate
from shared.schemas import JobCreate, model_messages
from shared.settings import Adapter, Settings

log = logging.getLogger("kevlaya.api")

# Tokens a tokenizer may add per message beyond one per byte of ASCII text (a SentencePiece word-start marker).
_SLACK_PER_MESSAGE = 8
_PROBE = "probe text"

# Config keys under which Hugging Face model configs give the context length, most common first.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


@dataclass(frozen=True)
class FieldNames:
    """How the request being checked names its fields (jobs and chat completions differ)."""

    input: str = "input"
    max_new_tokens: str = "params.max_new_tokens"
    adapter: str = "adapter"


JOB_FIELDS = FieldNames()


def context_length(config: dict) -> int | None:
    for section in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            if isinstance(section.get(key), int):
                return section[key]
    return None


class PromptBudget:
    def __init__(self, tokenizer, context_tokens: int, settings: Settings):  # noqa: ANN001
        self.tokenizer, self.settings = tokenizer, settings
        # Each job gets a slot of KEVLAYA_ENGINE__WINDOW_TOKENS: a job over it never runs.
        window = settings.engine.window_tokens
        if window < context_tokens:
            self.context_tokens, self.limit_name = window, "the worker's window (KEVLAYA_ENGINE__WINDOW_TOKENS) of"
        else:
            self.context_tokens, self.limit_name = context_tokens, "the model's context of"
        # The Rust tokenizer's settings are toggled per call; concurrent calls from the thread pool must not
        # interleave ("Already borrowed").
        self._lock = threading.Lock()
        self._frame_bytes = functools.lru_cache(maxsize=512)(self._measure_frame)

    @classmethod
    def load(cls, settings: Settings) -> PromptBudget | None:
        """The base model's tokenizer and context length, or None (logged) when they cannot be read."""
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        base = settings.model.base
        try:
            directory = base_directory(base, settings.model.cache_dir)
            if not directory.is_dir():  # a GGUF base the worker has not cached yet: read the file itself (slower)
                return cls._from_gguf(locate(base), settings)
            config = json.loads((directory / "config.json").read_text())
            context = context_length(config)
            if context is None:
                raise ValueError(f"config.json has none of {', '.join(_CONTEXT_KEYS)}")
            tokenizer = TokenizersBackend.from_pretrained(directory)
        except Exception as exc:
            log.error("prompt tokens are not checked at submit time: cannot read the tokenizer or config of %s "
                      "(%s: %s); over-long jobs will fail on the worker with invalid_input",
                      base, exc.__class__.__name__, exc)
            return None
        log.info("prompt budget: %s, context %d tokens", base, context)
        return cls(tokenizer, context, settings)

    @classmethod
    def _from_gguf(cls, gguf: Path, settings: Settings) -> PromptBudget:
        from transformers import AutoConfig
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        log.info("prompt budget: reading the tokenizer from %s (its cache is not built yet)", gguf)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).to_dict()
        tokenizer = TokenizersBackend.from_pretrained(gguf.parent, gguf_file=gguf.name)
        return cls(tokenizer, context_length(config), settings)

    def prompt_tokens(self, messages: list[dict[str, str]]) -> int:
        with self._lock:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False, sanitize_control_tokens=True)
        return len(ids)

    def surely_within(self, messages: list[dict[str, str]], room: int) -> bool:
        """Whether the prompt is sure to take at most `room` tokens, from a bound instead of the tokenizer (which
        costs more than the rest of a submit): ASCII text never takes more than a token per byte, so the prompt
        takes at most the bytes of its template frame (measured once per shape) plus its texts' bytes, plus a
        little per message. False means "count it" (non-ASCII text, or a template that does not insert texts
        as they are)."""
        if not all(m["content"].isascii() for m in messages):
            return False
        frame = self._frame_bytes(tuple((m["role"], m["content"] if m["role"] == "system" else "") for m in messages))
        if frame is None:
            return False
        texts = sum(len(m["content"]) for m in messages if m["role"] != "system")
        return frame + texts + _SLACK_PER_MESSAGE * len(messages) <= room

    def _render(self, shape: tuple[tuple[str, str], ...], text: str) -> str:
        messages = [{"role": role, "content": content if role == "system" else text} for role, content in shape]
        with self._lock:  # control tokens in texts would count as text: at most a token per byte still
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def _measure_frame(self, shape: tuple[tuple[str, str], ...]) -> int | None:
        """Bytes of the rendered prompt around its non-system texts, or None when the template does not insert
        each of them once as it is (then the bound would not hold)."""
        try:
            empty = len(self._render(shape, "").encode())
            with_probe = len(self._render(shape, _PROBE).encode())
        except Exception:  # a shape the template refuses is counted exactly, and refused there with its reason
            return None
        texts = sum(role != "system" for role, _ in shape)
        return empty if with_probe == empty + texts * len(_PROBE) else None

    def stages(self, request: JobCreate) -> list[tuple[Adapter, int, bool]]:
        """(adapter, max_new_tokens, whether the job chose it) for every adapter the job may run on."""
        chosen = request.params.max_new_tokens
        if request.adapter == "auto" and request.params.output == "tool_calls":  # Laya's calls are never escalated
            return [("laya", chosen or self.settings.laya.max_new_tokens, chosen is not None)]
        if request.adapter == "auto":
            # The cascade's Kev stage drops the job's max_new_tokens and takes Kev's default (worker/cascade.py).
            return [("laya", chosen or self.settings.laya.max_new_tokens, chosen is not None),
                    ("kev", self.settings.kev.max_new_tokens, False)]
        adapter: Adapter = request.adapter
        return [(adapter, chosen or self.settings.adapter_profile(adapter).max_new_tokens, chosen is not None)]

    def check(self, request: JobCreate, field_prefix: str = "", names: FieldNames = JOB_FIELDS) -> None:
        """A max_new_tokens the job chose must fit beside its prompt; a role's default shrinks to what is left
        (the worker does the same, worker/engine/loop.py), so only a prompt that leaves no room is refused."""
        for adapter, new_tokens, chosen in self.stages(request):
            profile = self.settings.adapter_profile(adapter)
            stored_input = request.input if isinstance(request.input, str) else request.input.model_dump()
            messages = model_messages(stored_input, request.params.model_dump(exclude_none=True),
                                      profile.system_prompt)
            needed = new_tokens if chosen else 1
            if self.surely_within(messages, self.context_tokens - needed):
                continue
            prompt = self.prompt_tokens(messages)
            if prompt + needed <= self.context_tokens:
                continue
            room = self.context_tokens - prompt
            over = (f"with {names.max_new_tokens} {new_tokens} that is {prompt + new_tokens}, over" if chosen
                    else "that leaves no room for an answer within")
            raise ApiError(
                422, "invalid_request",
                f"{field_prefix}{names.input}: the prompt is {prompt} tokens with {adapter.capitalize()}'s system "
                f"prompt; {over} {self.limit_name} {self.context_tokens} tokens"
                + (f" (at most {room} new tokens would fit)" if room > 0 else ""),
            )
