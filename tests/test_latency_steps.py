"""Steps of the latency rows alone (`SlotDecoder(latency_adapters=...)`, KEVLAYA_ENGINE__LATENCY_STEPS), on the
shipped demo model: after each step of every row, the Laya rows step once more by themselves, the Kev rows
getting a hole at that column; every answer is still `generate`'s, with eager steps and with static ones (the
steps CUDA graphs capture, run eagerly here)."""

from __future__ import annotations

import pytest

from modellab.reference import ReferenceRuntime
from tests.test_decoder import (  # noqa: F401 (fixtures)
    PROMPTS,
    assert_same_answers,
    decoder,
    request,
    runtime,
)
from worker.decoder.slot_decoder import SlotDecoder
from worker.generation import GenerationRequest, GenerationResult


def _expected(reference: ReferenceRuntime, requests: list[GenerationRequest]) -> list[GenerationResult]:
    return [reference.run_batch([r]).results[0] for r in requests]  # each job alone, on its own adapter


def _to_the_end(made: SlotDecoder, done: dict) -> None:
    while made.rows:
        done.update({r.job_id: r for r in made.step()})


STEPS = pytest.mark.parametrize("static_steps", [False, True], ids=["eager-steps", "static-steps"])


@STEPS
def test_latency_rows_step_alone_between_shared_steps_and_every_answer_is_generates(
        runtime: ReferenceRuntime, decoder, static_steps: bool) -> None:  # noqa: F811
    kevs = [request("kev", PROMPTS[0], 40), request("kev", PROMPTS[1], 30)]
    # three: a static step alone pads to four rows, its spare row writing in a Kev row's hole
    layas = [request("laya", PROMPTS[2], 12), request("laya", PROMPTS[3], 10), request("laya", PROMPTS[1], 14)]
    late = request("kev", PROMPTS[4], 20)  # joins after holes were made: the holes before it are not its own
    everything = [*kevs, *layas, late]
    expected = _expected(runtime, everything)
    made = decoder(slots=6, window=256, latency_adapters=["laya"], static_steps=static_steps)
    done = {r.job_id: r for r in made.prefill([*kevs, *layas])}
    for _ in range(4):
        done.update({r.job_id: r for r in made.step()})
    kev_tokens = len(made.rows[0].tokens)
    laya_tokens = min(len(row.tokens) for row in made.rows if row.request.adapter == "laya")
    assert laya_tokens > kev_tokens  # the Laya rows took steps of their own
    assert made.skipped.any()
    done.update({r.job_id: r for r in made.prefill([late])})
    _to_the_end(made, done)
    assert_same_answers(expected, [done[r.job_id] for r in everything])


@STEPS
def test_a_row_beside_takes_only_the_holes_its_window_has_room_for(runtime: ReferenceRuntime,  # noqa: F811
                                                                     decoder, static_steps: bool) -> None:  # noqa: F811
    """A Kev row whose prompt and new tokens leave one column of its window unused takes one hole, not more: the
    Laya row beside it then steps with it only. Every row writes its max_new_tokens (past the end of sequence),
    so the Kev row fills its window to the last column; the answers are those of a decoder without such steps."""
    window = 96
    plain = decoder(slots=4, window=window, ignore_eos=True)
    prompt = plain.prefill([request("kev", PROMPTS[0], 1)])[0].prompt_tokens
    kev = request("kev", PROMPTS[0], window - prompt)  # its last token is never fed: one column to spare
    laya = request("laya", PROMPTS[2], 8)
    expected = plain.run([kev, laya])
    plain.close()
    made = decoder(slots=4, window=window, latency_adapters=["laya"], ignore_eos=True, static_steps=static_steps)
    turns, alone = made._alone_turn, []
    made._alone_turn = lambda kept, pending: alone.append(turns(kept, pending)) or alone[-1]
    done = {r.job_id: r for r in made.prefill([kev, laya])}
    while made.rows:
        done.update({r.job_id: r for r in made.step()})
    assert sum(alone) == 1
    assert_same_answers(expected, [done[kev.job_id], done[laya.job_id]])


@STEPS
def test_latency_rows_beyond_latency_rows_step_with_the_others_only(runtime: ReferenceRuntime,  # noqa: F811
                                                                     decoder, static_steps: bool) -> None:  # noqa: F811
    """`latency_rows` bounds the rows a step alone takes (a captured step has graphs up to it): with more latency
    rows than that in flight they take no step of their own until enough have finished, and every answer is still
    `generate`'s."""
    kev = request("kev", PROMPTS[0], 30)
    layas = [request("laya", PROMPTS[2], 6), request("laya", PROMPTS[3], 16)]
    expected = _expected(runtime, [kev, *layas])
    made = decoder(slots=4, window=256, latency_adapters=["laya"], latency_rows=1, static_steps=static_steps)
    turns, alone = made._alone_turn, []
    made._alone_turn = lambda kept, pending: alone.append(
        (turns(kept, pending), sum(made._is_latency(row) for row in kept))) or alone[-1][0]
    done = {r.job_id: r for r in made.prefill([kev, *layas])}
    _to_the_end(made, done)
    assert all(rows <= 1 for took, rows in alone if took)
    assert any(took for took, _ in alone)  # once the short Laya row finished, the other stepped alone
    assert_same_answers(expected, [done[r.job_id] for r in (kev, *layas)])


def test_a_static_step_alone_pads_past_the_rows_into_a_prefill_under_way_and_every_answer_holds(
        runtime: ReferenceRuntime, decoder, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Five Laya rows and one Kev row: a static step alone pads to eight rows, its spare rows writing column `t`
    of the Kev row (a hole) and of the two top slots, where a Kev prompt block is being prefilled between steps
    (its columns end before `t`). The block's rows then join, and every answer is still `generate`'s."""
    monkeypatch.setattr("worker.decoder.graph_prefill.PREFILL_COLUMNS", 8)  # several passes per prompt
    kev = request("kev", PROMPTS[0], 30)
    layas = [request("laya", PROMPTS[i % len(PROMPTS)], 10 + i) for i in range(5)]
    block = [request("kev", PROMPTS[1], 12), request("kev", PROMPTS[3], 14)]
    expected = _expected(runtime, [kev, *layas, *block])
    made = decoder(slots=8, window=256, latency_adapters=["laya"], static_steps=True)
    padded = []
    run = made._static.run
    made._static.run = lambda *args, alone=None: (alone and padded.append(len(alone))) or run(*args, alone=alone)
    done = {r.job_id: r for r in made.prefill([kev, *layas])}
    done.update({r.job_id: r for r in made.step()})
    made.begin_prefill(block)
    while made.prefilling:
        done.update({r.job_id: r for r in made.step()})
        done.update({r.job_id: r for r in made.prefill_pass()})
    assert 5 in padded  # a step alone of five rows ran while the block was under way
    _to_the_end(made, done)
    assert_same_answers(expected, [done[r.job_id] for r in (kev, *layas, *block)])


def test_the_bench_times_kev_and_laya_rows_decoding_together_and_counts_the_steps_of_each_kind(
        decoder) -> None:  # noqa: F811
    """modellab.bench.latency_steps: with latency steps the Laya rows' tokens come from shared and alone steps,
    Kev's from shared ones only; without, every step is shared and both roles gain a token a step."""
    from modellab.bench.latency_steps import mixed_decode

    kevs = [request("kev", PROMPTS[i], 40) for i in range(3)]
    laya = [request("laya", PROMPTS[3], 9)]
    made = decoder(slots=4, window=256, ignore_eos=True)
    shared_only = mixed_decode(made, kevs, laya, warm_steps=2)
    made.close()
    assert shared_only["steps"] == {"shared": shared_only["steps"]["shared"], "alone": 0}
    assert shared_only["steps"]["shared"] >= 8  # Laya's 8 tokens after its first, one a step (and one ahead)
    with_alone = mixed_decode(decoder(slots=4, window=256, ignore_eos=True, latency_adapters=["laya"]), kevs, laya,
                              warm_steps=2)
    assert with_alone["steps"]["alone"] >= 3 and with_alone["steps"]["shared"] >= 4
    # Kev rows took only the shared steps: fewer tokens over the same Laya span, so each cost more of its wall
    assert with_alone["ms_per_kev_token"] / with_alone["ms_per_laya_token"] > \
        shared_only["ms_per_kev_token"] / shared_only["ms_per_laya_token"]
    assert all(d["wall_ms"] > 0 and d["kev_rows"] == 3 and d["laya_rows"] == 1 for d in (shared_only, with_alone))
    assert shared_only["gpu_ms"] == with_alone["gpu_ms"] == {}  # GPU times of captured steps: CUDA only
