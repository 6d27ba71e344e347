"""Per-row grammars: a row may carry an llguidance matcher of its own grammar (shared/grammar.py), and each step
the tokens its grammar allows are computed for every such row at once, on the CPU, while the GPU runs the step.

Rows without a grammar allow every token, so constrained and free rows share one step and one sampling call.
"""

from __future__ import annotations

from collections import OrderedDict
from weakref import WeakKeyDictionary

import llguidance
import llguidance.hf
import torch
from llguidance.torch import fill_next_token_bitmask_par, get_bitmask_shape
from transformers import PreTrainedTokenizerBase

BITS = 32  # tokens per bitmask word
COMPILED_KEPT = 256  # distinct grammars kept compiled (decision grammars repeat: one per set of choices)


_TOKENIZERS: WeakKeyDictionary[PreTrainedTokenizerBase, dict[tuple, llguidance.LLTokenizer]] = WeakKeyDictionary()


def grammar_tokenizer(tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                      eos_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """The library's view of a tokenizer, built once per tokenizer (milliseconds for a small vocabulary, up to a
    second for 150k tokens): the worker builds several decoders at start while it sizes its slots, and no job's
    prefill should wait for it."""
    built = _TOKENIZERS.setdefault(tokenizer, {})
    if (vocab_size, eos_ids) not in built:
        built[vocab_size, eos_ids] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))
    return built[vocab_size, eos_ids]


class RowGrammars:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: list[int], slots: int,
                 device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self.tokenizer = grammar_tokenizer(tokenizer, vocab_size, tuple(eos_ids))
        self.executor = llguidance.LLExecutor()
        # A compiled grammar, kept at its start with its lexer warmed by one mask: a new row gets a copy (a fraction
        # of a millisecond) instead of a compile (a millisecond or more, and a cold first mask).
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        # Filled by the library's threads; pinned on CUDA so its copy to the GPU does not wait on the host.
        self.words = torch.full(get_bitmask_shape(slots, vocab_size), -1, dtype=torch.int32,
                                pin_memory=device.type == "cuda")
        self.bit = torch.arange(BITS, dtype=torch.int32, device=device)
        self._bytes: dict[int, bytes] = {}

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A matcher of `grammar` at its start, for one row."""
        pristine = self._compiled.get(grammar)
        if pristine is None:
            pristine = llguidance.LLMatcher(self.tokenizer, grammar)
            if pristine.is_error():
                raise ValueError(f"the answer's grammar cannot be compiled: {pristine.get_error()}")
            pristine.compute_bitmask()  # warms the lexer every copy shares; the matcher stays at its start
            self._compiled[grammar] = pristine
            if len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(grammar)
        return pristine.deep_copy()

    def allowed(self, matchers: list[llguidance.LLMatcher | None]) -> torch.Tensor | None:
        """rows × vocabulary, True where the row's grammar allows the token (every token for a row without one);
        None when no row has a grammar."""
        pairs = [(matcher, row) for row, matcher in enumerate(matchers) if matcher is not None]
        if not pairs:
            return None
        words = self.words[:len(matchers)]
        if len(pairs) < len(matchers):  # the library writes the rows it is given; the others allow every token
            words[[row for row, matcher in enumerate(matchers) if matcher is None]] = -1
        fill_next_token_bitmask_par(self.executor, pairs, words)
        on_device = words.to(self.device, non_blocking=True)
        return ((on_device[:, :, None] >> self.bit) & 1).bool().flatten(1)[:, :self.vocab_size]

    @staticmethod
    def advance(matcher: llguidance.LLMatcher, token: int) -> bool:
        """Feed the chosen token to the row's matcher; True when its grammar is complete (the row ends)."""
        if not matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused a token it allowed: {matcher.get_error()}")
        return matcher.is_stopped()

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token adds to the answer's text (a stop string is searched in bytes: a token can end inside a
        character). A special token adds none, as the stored text skips it; so does an id past the tokenizer's
        vocabulary, which the library names `<[id]>`."""
        if token not in self._bytes:
            self._bytes[token] = b"" if self.tokenizer.is_special_token(token) else self.tokenizer.decode_bytes([token])
        return self._bytes[token]
