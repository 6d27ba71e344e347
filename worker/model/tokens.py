"""The tokenizer side of generation, for the decoder and the reference runtime: chats to token ids, whether a
request can run at all, and token ids back to text with each token's character span."""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers import BatchEncoding, PreTrainedTokenizerBase

from shared.schemas import MIN_TEMPERATURE
from worker.generation import GenerationRequest

if TYPE_CHECKING:  # the Celery parent imports this module (through worker.engine) and must not import torch
    import torch


def encode_chats(tokenizer: PreTrainedTokenizerBase, requests: list[GenerationRequest],
                 device: torch.device) -> BatchEncoding:
    """Left-padded prompts (the tokenizer is set up that way). Control tokens inside message content are encoded
    as text, so a user cannot forge role markers."""
    return tokenizer.apply_chat_template(
        [r.messages for r in requests], add_generation_prompt=True, tokenize=True, return_dict=True,
        padding=True, return_tensors="pt", sanitize_control_tokens=True,
    ).to(device)


def check_request(tokenizer: PreTrainedTokenizerBase, context: int | None, request: GenerationRequest,
                  device: torch.device) -> tuple[int, str | None]:
    """The request's prompt tokens (0 when it cannot be encoded), and why it cannot run or fit the context, or
    None. Checked per request, so a bad job fails alone instead of failing the rows it would have run with."""
    if 0 < request.temperature < MIN_TEMPERATURE:  # sampling would divide the logits into inf/NaN
        return 0, f"temperature {request.temperature} is below the minimum of {MIN_TEMPERATURE} (0 = greedy)"
    try:
        prompt_tokens = int(encode_chats(tokenizer, [request], device)["attention_mask"].sum())
    except Exception as exc:
        return 0, f"the input cannot be tokenized: {exc.__class__.__name__}: {exc}"
    if context is not None and prompt_tokens + request.max_new_tokens > context:
        return prompt_tokens, (f"the prompt is {prompt_tokens} tokens; with max_new_tokens {request.max_new_tokens} "
                               f"that is over the model's context of {context} tokens")
    return prompt_tokens, None


def decode_with_spans(tokenizer: PreTrainedTokenizerBase, tokens: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """The text of `tokens` and the character span of each token in it (decoding prefixes, because a byte-level
    token can end inside a multi-byte character)."""
    spans, previous = [], 0
    for end in range(1, len(tokens) + 1):
        length = len(tokenizer.decode(tokens[:end], skip_special_tokens=True))
        spans.append((previous, max(previous, length)))
        previous = max(previous, length)
    return tokenizer.decode(tokens, skip_special_tokens=True), spans
