"""The fixed-shape prefill (worker/decoder/graph_prefill.py) on the shipped demo model, run eagerly on the CPU: the
shapes a CUDA graph replays, with the answers of `generate`."""

from __future__ import annotations

import pytest

from modellab.reference import ReferenceRuntime
from tests.test_decoder import assert_same_answers, decoder, mixed_requests, runtime  # noqa: F401 (fixtures)
from worker.decoder.graph_prefill import CapturedPrefill
from worker.engine.offline import run_to_end


@pytest.mark.parametrize("slots, prefill_tokens", [(5, 100), (3, None)], ids=["padded-rows", "split-rows"])
def test_a_static_prefill_runs_only_fixed_shapes_and_answers_as_generate(runtime: ReferenceRuntime,  # noqa: F811
                                                                         decoder,  # noqa: F811
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         slots: int, prefill_tokens: int | None) -> None:
    """Prompts of different lengths are padded to whole passes; rows go in buckets, padded with rows written into
    free slots (three rows of five slots), or split where no slot is free to pad into (three rows of three);
    rows already decoding are left as they were."""
    monkeypatch.setattr("worker.decoder.graph_prefill.PREFILL_COLUMNS", 32)  # prompts of 20-odd tokens: 1-2 passes
    requests = mixed_requests()
    expected = [runtime.run_batch([r]).results[0] for r in requests]
    static = decoder(slots=slots, window=256, static_steps=True, prefill_chunk_tokens=4 * 32)
    prefill = static._static_prefill
    assert prefill.columns == 32 and prefill.buckets == [1, 2, 4][:slots.bit_length()]
    passes: list[tuple[int, int]] = []
    pieces: list[tuple[int, int]] = []  # (rows, bucket) of each pass
    piece = prefill.piece
    prefill.piece = lambda rows, spare: pieces.append(piece(rows, spare)) or pieces[-1]
    hook = runtime.model.register_forward_pre_hook(
        lambda _module, _args, kwargs: passes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        assert_same_answers(expected, run_to_end(static, requests, prefill_tokens))
    finally:
        hook.remove()
    prefills = {shape for shape in passes if shape[1] > 1}  # decode steps pass one column
    assert prefills and prefills <= {(bucket, 32) for bucket in prefill.buckets}, prefills
    if prefill_tokens:
        assert (3, 4) in pieces  # three rows and a padding row in a free slot
    else:
        assert (3, 4) not in pieces and ((2, 2), (1, 1)) in zip(pieces, pieces[1:])  # no free slot: two passes


def test_an_eager_prefill_beside_static_steps_answers_the_same(runtime: ReferenceRuntime,  # noqa: F811
                                                               decoder) -> None:  # noqa: F811
    """`static_prefill=False` (the benchmark's A/B pair) keeps one eager pass per prompt block."""
    requests = mixed_requests()[:4]
    expected = [runtime.run_batch([r]).results[0] for r in requests]
    eager = decoder(slots=4, window=256, static_steps=True, static_prefill=False)
    assert eager._static_prefill is None
    assert_same_answers(expected, run_to_end(eager, requests))


@pytest.mark.parametrize("rows, spare, pieces", [
    (4, 0, [(4, 4)]), (3, 1, [(3, 4)]), (3, 0, [(2, 2), (1, 1)]), (7, 0, [(4, 4), (2, 2), (1, 1)]),
    (5, 3, [(5, 8)]), (5, 2, [(4, 4), (1, 1)]), (9, 20, [(8, 8), (1, 1)]), (20, 0, [(8, 8), (8, 8), (4, 4)]),
])
def test_rows_go_in_buckets_padded_into_free_slots_or_split(rows: int, spare: int,
                                                            pieces: list[tuple[int, int]]) -> None:
    prefill = CapturedPrefill.__new__(CapturedPrefill)
    prefill.buckets = [1, 2, 4, 8]
    got, left = [], rows
    while left:
        got.append(prefill.piece(left, spare))
        left -= got[-1][0]
    assert got == pieces
    assert sum(count for count, _ in pieces) == rows
