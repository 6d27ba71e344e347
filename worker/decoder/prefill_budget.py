"""How many waiting jobs one prefill takes: its padded block (jobs × longest prompt) sets its time and memory.
Plain arithmetic, shared by the decoder's own `run` and the serving loop's policy."""

from __future__ import annotations


def prefill_group(prompt_tokens: list[int], free: int, budget_tokens: int | None) -> int:
    """How many of these jobs (in order, by prompt tokens) one prefill takes: at most `free`, and the padded block
    (jobs × longest prompt) within `budget_tokens` (None: no bound), the size that sets a prefill's time and
    memory; the first job always goes."""
    taken, longest = 0, 0
    for tokens in prompt_tokens[:free]:
        longest = max(longest, tokens)
        if taken and budget_tokens is not None and (taken + 1) * longest > budget_tokens:
            break
        taken += 1
    return taken
