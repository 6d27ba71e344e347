"""The tokenizer side of generation, for the decoder and the reference runtime: chats to token ids, whether a
request can run at all, and token ids back to text with each token's character span."""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers import BatchEncoding, PreTrainedTokenizerBase

from shared.schemas import MIN_TEMPERATURE
from worker.generation import GenerationRequest, GenerationResult

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
    prefixes = [tokens[:end] for end in range(1, len(tokens) + 1)]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not tokenizer.clean_up_tokenization_spaces:
        # what `decode` does for such a tokenizer, in one call that leaves the interpreter's lock to the threads
        # beside it (the result writer runs this while the decode loop launches steps)
        texts = backend.decode_batch(prefixes, skip_special_tokens=True)
    else:
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in prefixes]
    spans, previous = [], 0
    for text in texts:
        spans.append((previous, max(previous, len(text))))
        previous = max(previous, len(text))
    return (texts[-1] if texts else ""), spans  # the whole text is the last prefix's


def result_text(tokenizer: PreTrainedTokenizerBase, result: GenerationResult) -> None:
    """Give `result` its text and token spans, cut before the stop string it ended on (OpenAI's `stop`: the
    string itself is not part of the answer), and its per-token log-probabilities when they were asked for."""
    text, spans = decode_with_spans(tokenizer, result.token_ids)
    kept = len(result.token_ids)
    if result.stop is not None and (cut := text.find(result.stop)) != -1:
        text, spans = text[:cut], [(min(a, cut), min(b, cut)) for a, b in spans]
        kept = next((i for i, (start, _end) in enumerate(spans) if start >= cut), kept)
    result.text, result.token_spans = text, spans
    if result.top_logprobs is not None:
        result.logprobs = [
            {**_token_entry(tokenizer, token, logprob),
             "top_logprobs": [_token_entry(tokenizer, other, p) for other, p in alternatives]}
            for token, logprob, alternatives in zip(result.token_ids[:kept], result.token_logprobs,
                                                    result.top_logprobs)
        ]


def _token_entry(tokenizer: PreTrainedTokenizerBase, token: int, logprob: float) -> dict:
    """One token as OpenAI reports it: its text, its log-probability, and its UTF-8 bytes (a token can hold part of
    a character, so its text alone cannot always be joined back)."""
    text = tokenizer.decode([token], skip_special_tokens=False)
    # -9999 stands for "never" (OpenAI's convention): JSON has no -Infinity.
    return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode("utf-8", errors="replace"))}
