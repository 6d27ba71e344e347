"""Steps of the latency rows alone (`SlotDecoder(latency_adapters=...)`, KEVLAYA_ENGINE_LATENCY_STEPS), on the
shipped demo model: after each step of every row, the Laya rows step once more by themselves, the Kev rows
getting a hole at that column; every answer is still `generate`'s."""

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


def test_latency_rows_step_alone_between_shared_steps_and_every_answer_is_generates(
        runtime: ReferenceRuntime, decoder) -> None:  # noqa: F811
    kevs = [request("kev", PROMPTS[0], 40), request("kev", PROMPTS[1], 30)]
    layas = [request("laya", PROMPTS[2], 12), request("laya", PROMPTS[3], 10)]
    late = request("kev", PROMPTS[4], 20)  # joins after holes were made: the holes before it are not its own
    everything = [*kevs, *layas, late]
    expected = _expected(runtime, everything)
    made = decoder(slots=6, window=256, latency_adapters=["laya"])
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


def test_a_row_beside_takes_only_the_holes_its_window_has_room_for(runtime: ReferenceRuntime,  # noqa: F811
                                                                     decoder) -> None:  # noqa: F811
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
    made = decoder(slots=4, window=window, latency_adapters=["laya"], ignore_eos=True)
    turns, alone = made._alone_turn, []
    made._alone_turn = lambda kept, pending: alone.append(turns(kept, pending)) or alone[-1]
    done = {r.job_id: r for r in made.prefill([kev, laya])}
    while made.rows:
        done.update({r.job_id: r for r in made.step()})
    assert sum(alone) == 1
    assert_same_answers(expected, [done[kev.job_id], done[laya.job_id]])


@pytest.mark.parametrize("static_steps, graphs", [(True, False), (False, True)])
def test_latency_steps_are_refused_with_static_steps(decoder, static_steps: bool, graphs: bool) -> None:  # noqa: F811
    with pytest.raises(ValueError, match="eager steps"):
        decoder(slots=2, window=64, latency_adapters=["laya"], static_steps=static_steps, graphs=graphs)
