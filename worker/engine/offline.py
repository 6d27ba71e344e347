"""Requests run to the end on a slot decoder without the queue: the tests', the benchmark's and the evaluation's
driver. It admits in request order as slots free up, each prefill within the serving loop's prefill budget
(`prefill_group`), and steps otherwise; the serving loop's other rules (roles, pacing, prefills between steps) need
a queue and are its scheduler's (worker/engine/scheduler.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.engine.scheduler import prefill_group
from worker.generation import GenerationRequest, GenerationResult

if TYPE_CHECKING:  # torch is imported only in the worker child
    from worker.decoder.slot_decoder import SlotDecoder


def run_to_end(decoder: SlotDecoder, requests: list[GenerationRequest],
               prefill_tokens: int | None = None) -> list[GenerationResult]:
    """Every request to the end, results in request order; `prefill_tokens`: the padded tokens one prefill takes
    at most (KEVLAYA_ENGINE__PREFILL_TOKENS; None: every free slot at once)."""
    import torch

    from worker.model.tokens import encode_chats

    waiting, done = list(requests), {}
    lengths = encode_chats(decoder.tokenizer, waiting, torch.device("cpu"))["attention_mask"].sum(1).tolist()
    while waiting or decoder.rows:
        if waiting and decoder.free:
            count = prefill_group(lengths, decoder.free, prefill_tokens)
            batch, waiting, lengths = waiting[:count], waiting[count:], lengths[count:]
            finished = decoder.prefill(batch)
        else:
            finished = decoder.step()
        done.update({r.job_id: r for r in finished})
    return [done[r.job_id] for r in requests]
