"""Choosing each row's next token with that row's own settings, in one step shared by rows of any settings.

The arithmetic is the one `generate` uses (logits in float32, divided by the temperature, the top-k filter that
`generate` applies by default, the nucleus filter on the ascending sort, softmax, one multinomial draw), so a seeded job draws the same tokens as it would alone: each
seeded row has its own generator, and its batch-mates never consume its random numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RowSampling:
    temperature: float  # 0 = greedy
    top_p: float
    seed: int | None
    generator: torch.Generator | None = field(default=None, repr=False)

    @classmethod
    def create(cls, temperature: float, top_p: float, seed: int | None, device: torch.device) -> RowSampling:
        generator = None
        if temperature > 0 and seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(seed)
        return cls(temperature, top_p, seed, generator)


@dataclass
class Choice:
    tokens: list[int]
    logprobs: list[float]  # log p(chosen token) under the model's raw distribution (before temperature/top-p)
    broken: list[bool]  # the row's logits were NaN / +inf / all -inf: its sequence must stop
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # per row, its `top` likeliest (id, log p)


def broken_rows(logits: torch.Tensor) -> torch.Tensor:
    """-inf alone is legitimate (a masked token); NaN, +inf or nothing left to pick is not."""
    return torch.isnan(logits).any(-1) | torch.isposinf(logits).any(-1) | torch.isneginf(logits).all(-1)


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the `k` highest scores (ties at the k-th included), as `generate` does."""
    if k <= 0 or k >= scores.shape[-1]:
        return scores
    kth = torch.topk(scores, k)[0][..., -1, None]
    return scores.masked_fill(scores < kth, float("-inf"))


def nucleus(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches `top_p` (at least one)."""
    if top_p >= 1.0:
        return scores
    sorted_scores, order = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1:] = False
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return scores.masked_fill(remove, float("-inf"))


@dataclass
class Chosen:
    """A choice still on the device: `read` brings it to the host. Its copies start at once, so a caller may
    launch more GPU work (the next step) before reading, and the read waits only for the choice itself."""

    tokens: torch.Tensor  # rows, on the device
    logprobs: torch.Tensor
    broken: torch.Tensor
    top: tuple[torch.Tensor, torch.Tensor] | None  # (log p, ids) of each row's likeliest tokens, when asked
    _host: tuple[torch.Tensor, ...] = ()
    _copied: torch.cuda.Event | None = None

    def __post_init__(self) -> None:
        parts = (self.tokens, self.logprobs, self.broken, *(self.top or ()))
        if self.tokens.device.type == "cuda":
            self._host = tuple(part.to("cpu", non_blocking=True) for part in parts)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._host = parts

    def tokens_for(self, tokens: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
        """`tokens` (on the device) with each slot whose source is ≥ 0 taking the chosen token at that index."""
        if not self.tokens.numel():
            return tokens
        return torch.where(sources >= 0, self.tokens.index_select(0, sources.clamp(min=0)), tokens)

    def read(self) -> Choice:
        if self._copied is not None:
            self._copied.synchronize()
        tokens, logprobs, broken, *top = self._host
        likeliest = []
        if top:
            values, ids = top
            likeliest = [list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]
        return Choice(tokens.tolist(), logprobs.tolist(), broken.tolist(), likeliest)


def choose(logits: torch.Tensor, rows: list[RowSampling], *, k: int = 0,
           banned: torch.Tensor | list[int] | None = None, allowed: torch.Tensor | None = None,
           top: int = 0) -> Chosen:
    """One token per row of `logits` (rows × vocabulary); sampled rows keep only their `k` best tokens (0: all).
    `allowed` (rows × vocabulary, from the rows' grammars) masks each row's logits before its temperature, top-k and
    top-p. `banned` tokens are never chosen (benchmarks use it to keep rows from ending early). Neither changes the
    reported log-probabilities: they are the model's own, so a grammar cannot inflate a confidence. `top` > 0: each
    row's `top` likeliest tokens under that same distribution are reported too."""
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    broken = broken_rows(logits)
    # A broken row still gets a token (discarded by the caller): sanitise it so sampling cannot fail on NaN.
    logits = torch.where(broken[:, None], torch.zeros_like(logits), logits)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    if banned is not None and len(banned):
        # a tensor on the logits' device: no copy from the host, which would wait for the GPU
        banned = torch.as_tensor(banned, device=logits.device)
        logits = logits.index_fill(1, banned, float("-inf"))
    tokens = logits.argmax(dim=-1)
    for row, sampling in enumerate(rows):
        if sampling.temperature > 0:
            scores = nucleus(top_k(logits[row:row + 1] / sampling.temperature, k), sampling.top_p)
            probs = scores.softmax(dim=-1)
            tokens[row] = torch.multinomial(probs, num_samples=1, generator=sampling.generator)[0, 0]
    chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
    return Chosen(tokens, chosen, broken, tuple(raw_logprobs.topk(top, dim=-1)) if top else None)
