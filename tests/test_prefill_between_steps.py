"""A prefill whose passes run between decode steps (`SlotDecoder.begin_prefill` / `prefill_pass`), on the shipped
demo model: rows decoding advance between its passes, a whole prefill may go in between, the key/value block may
shift or compact under it, and every answer is still `generate`'s."""

from __future__ import annotations

import pytest
import torch

from modellab.reference import ReferenceRuntime
from tests.test_decoder import (  # noqa: F401 (fixtures)
    PROMPTS,
    assert_same_answers,
    decoder,
    request,
    runtime,
)
from worker.decoder.slot_decoder import SlotDecoder
from worker.engine.offline import run_to_end
from worker.generation import GenerationRequest, GenerationResult


def _to_the_end(made: SlotDecoder, done: dict) -> None:
    while made.rows or made.prefilling:
        if made.prefilling:
            done.update({r.job_id: r for r in made.prefill_pass()})
        done.update({r.job_id: r for r in made.step()})


def _expected(reference: ReferenceRuntime, requests: list[GenerationRequest]) -> list[GenerationResult]:
    return [reference.run_batch([r]).results[0] for r in requests]  # each job alone, on its own adapter


@pytest.mark.parametrize("static_steps", [False, True], ids=["eager-steps", "static-steps"])
def test_a_prefill_between_steps_answers_as_generate_while_rows_decode_and_a_laya_job_goes_first(
        runtime: ReferenceRuntime, decoder, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        static_steps: bool) -> None:
    monkeypatch.setattr("worker.decoder.graph_prefill.PREFILL_COLUMNS", 8)  # several passes per prompt
    decoding = request("kev", PROMPTS[0], 40)
    waves = [request("laya", PROMPTS[2], 12), request("kev", PROMPTS[4], 20)]
    layas = [request("laya", PROMPTS[3], 10), request("laya", PROMPTS[1], 6), request("laya", PROMPTS[0], 8)]
    everything = [decoding, *waves, *layas]
    expected = _expected(runtime, everything)
    made = decoder(slots=6, window=256, static_steps=static_steps, prefill_chunk_tokens=32)
    done = {r.job_id: r for r in made.prefill([decoding])}
    made.step()
    made.begin_prefill(waves)
    assert made.free == 6 - 1 - 2  # its rows hold their slots while its passes run
    passes, tokens_before = 0, len(made.rows[0].tokens)
    while made.prefilling:
        done.update({r.job_id: r for r in made.prefill_pass()})
        passes += 1
        if passes == 1:  # latency jobs go in whole between two passes, over the columns the block wrote; three
            done.update({r.job_id: r for r in made.prefill(layas)})  # rows need a padding row, and no slot is free
        done.update({r.job_id: r for r in made.step()})
    assert passes >= 2
    assert len(made.rows[0].tokens) >= tokens_before + passes  # the decoding row got a token per pass
    _to_the_end(made, done)
    assert_same_answers(expected, [done[r.job_id] for r in everything])


@pytest.mark.parametrize("static_steps, column_buckets, kv_dtype", [
    (False, 1, None), (True, 1, None), (True, 3, None), (True, 1, torch.float8_e4m3fn)],
    ids=["eager-steps", "static-steps", "static-column-buckets", "static-steps-fp8-cache"])
def test_the_block_compacts_and_shifts_with_a_prefill_under_way(runtime: ReferenceRuntime, decoder,  # noqa: F811
                                                               monkeypatch: pytest.MonkeyPatch, static_steps: bool,
                                                               column_buckets: int, kv_dtype: torch.dtype) -> None:
    """A window barely above the longest job: the timeline reaches its end while a prefill is under way (which
    then joins before the block compacts), and a whole prefill of a longer prompt shifts the rows and the block
    under way to the right; answers stay those of whole prefills (every row writes its max_new_tokens, past the
    end of sequence, so the steps run long enough)."""
    monkeypatch.setattr("worker.decoder.graph_prefill.PREFILL_COLUMNS", 8)
    short = request("laya", PROMPTS[4], 116)  # 12 prompt tokens: the whole window, decoded past its end
    aside = [request("kev", PROMPTS[0], 30), request("laya", PROMPTS[2], 25)]
    wide = request("kev", PROMPTS[3], 8)
    everything = [short, *aside, wide]
    options = dict(slots=4, window=128, static_steps=static_steps, prefill_chunk_tokens=8,
                   column_buckets=column_buckets, ignore_eos=True, kv_dtype=kv_dtype)
    whole = decoder(**options)
    expected = run_to_end(whole, everything)
    whole.close()
    made = decoder(**options)
    done = {r.job_id: r for r in made.prefill([short])}
    made.begin_prefill(aside)
    lo = made.prefilling.lo
    done.update({r.job_id: r for r in made.prefill([wide])})  # wider than the timeline so far
    assert made.prefilling.lo > lo  # the block under way moved right with the rows
    done.update({r.job_id: r for r in made.prefill_pass()})
    compacted_under_way, joined_at = 0, None
    while made.prefilling and made.rows:  # steps only: the timeline reaches the window's end
        t = made.kv.t
        done.update({r.job_id: r for r in made.step()})
        compacted_under_way += made.kv.t < t and made.prefilling is not None
        if made.prefilling is None:
            joined_at = t
    assert joined_at is not None and joined_at >= made.window - 1  # the step ran its passes left, then compacted
    assert compacted_under_way == (column_buckets > 1)  # at half the window, the block under way moved left too
    _to_the_end(made, done)
    assert_same_answers(expected, [done[r.job_id] for r in everything])


def test_a_prefill_under_way_can_be_given_up_and_its_slots_come_back(runtime: ReferenceRuntime,  # noqa: F811
                                                                      decoder) -> None:  # noqa: F811
    decoding, aside = request("kev", PROMPTS[0], 20), [request("kev", PROMPTS[1], 5), request("laya", PROMPTS[2], 5)]
    expected = _expected(runtime, [decoding])
    made = decoder(slots=4, window=256, prefill_chunk_tokens=8)
    done = {r.job_id: r for r in made.prefill([decoding])}
    made.begin_prefill(aside)
    made.prefill_pass()
    with pytest.raises(ValueError, match="already under way"):
        made.begin_prefill(aside)
    assert made.free == 1
    assert [r.job_id for r in made.cancel_prefill()] == [r.job_id for r in aside]
    assert made.free == 3 and made.prefilling is None
    _to_the_end(made, done)
    assert_same_answers(expected, [done[decoding.job_id]])


def test_a_pass_pads_only_into_slots_still_free_after_a_whole_prefill_between_two_of_its_row_groups(
        runtime: ReferenceRuntime, decoder, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Seven prompts in passes of at most four rows: a column range runs as a group of four, then three padded to
    four. Laya jobs prefilled whole between the two groups take the last free slots, so the second group must
    not pad into them (it goes as two and one): the Laya rows' cached columns stay theirs, and every answer is
    still `generate`'s."""
    monkeypatch.setattr("worker.decoder.graph_prefill.PREFILL_COLUMNS", 8)
    decoding = request("kev", PROMPTS[0], 30)
    aside = [request(("kev", "laya")[i % 2], PROMPTS[i % len(PROMPTS)], 6 + i) for i in range(7)]
    layas = [request("laya", PROMPTS[3], 12), request("laya", PROMPTS[2], 9)]
    everything = [decoding, *aside, *layas]
    expected = _expected(runtime, everything)
    made = decoder(slots=10, window=256, static_steps=True, prefill_chunk_tokens=32)  # passes of 1, 2 or 4 rows
    done = {r.job_id: r for r in made.prefill([decoding])}
    made.begin_prefill(aside)
    done.update({r.job_id: r for r in made.prefill_pass()})  # the first column range's first group of four
    done.update({r.job_id: r for r in made.prefill(layas)})
    assert made.free == 0
    keys = made.kv.layers[0].keys
    laya_rows = slice(1, 3)
    starts = [row.start for row in made.rows[laya_rows]]
    cached = [keys[slot, :, start:made.kv.t].clone() for slot, start in zip(range(1, 3), starts)]
    done.update({r.job_id: r for r in made.prefill_pass()})  # the same column range's other three rows
    for slot, start, before in zip(range(1, 3), starts, cached):
        assert torch.equal(keys[slot, :, start:start + before.shape[1]], before)
    _to_the_end(made, done)
    assert_same_answers(expected, [done[r.job_id] for r in everything])
