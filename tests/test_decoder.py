"""The slot decoder on the shipped demo model: the same answers as the reference runtime's per-adapter `generate`, with
Kev and Laya rows in the same steps, slots refilled while other rows decode, and per-row sampling."""

from __future__ import annotations

import uuid

import pytest
import torch
import transformers.models.llama.modeling_llama as modeling_llama

from modellab.reference import ReferenceRuntime
from shared.settings import Settings
from worker.decoder.graph_step import MIN_COLUMNS
from worker.decoder.kernels.fused_rotary import NAME, FusedRotary
from worker.decoder.options import DecoderOptions
from worker.decoder.sampling import RowSampling, choose, nucleus
from worker.decoder.slot_decoder import SlotDecoder
from worker.engine.offline import run_to_end
from worker.generation import GenerationRequest, GenerationResult
from worker.memory import after_step_out_of_memory

PROMPTS = [
    "Should we ship on Friday?",
    "Pick a vendor: A is cheap, B is reliable. Budget is tight.",
    "Hire now or wait a quarter?",
    "Refactor or rewrite the billing module? The team is small and the deadline is in March.",
    "Train or plane to Lyon?",
]


@pytest.fixture(scope="module")
def runtime() -> ReferenceRuntime:
    return ReferenceRuntime.load(Settings(_env_file=None, model={"device": "cpu"}))


@pytest.fixture
def decoder(runtime: ReferenceRuntime):  # noqa: ANN201
    def make(slots: int = 4, window: int = 256, **options: object) -> SlotDecoder:
        made = SlotDecoder(runtime.model, runtime.tokenizer, ["kev", "laya"], slots=slots, window=window,
                           eos_ids=runtime.eos_ids, options=DecoderOptions(**options))
        decoders.append(made)
        return made

    decoders: list[SlotDecoder] = []
    yield make
    for made in decoders:
        made.close()  # the runtime's PEFT path must work again for the next test


def request(adapter: str, prompt: str, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
            seed: int | None = None) -> GenerationRequest:
    return GenerationRequest(job_id=uuid.uuid4(), adapter=adapter, messages=[{"role": "user", "content": prompt}],
                             max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)


def mixed_requests() -> list[GenerationRequest]:
    lengths = [40, 12, 64, 8, 30, 50, 20, 10, 33, 5]
    return [request(("kev", "laya")[i % 2], PROMPTS[i % len(PROMPTS)], n) for i, n in enumerate(lengths)]


def assert_same_answers(expected: list[GenerationResult], got: list[GenerationResult]) -> None:
    for want, have in zip(expected, got, strict=True):
        assert have.error_code is None, have.error_message
        assert have.token_ids == want.token_ids, (want.text, have.text)
        assert have.text == want.text
        assert have.token_logprobs == pytest.approx(want.token_logprobs, abs=1e-4)
        assert have.prompt_tokens == want.prompt_tokens


@pytest.mark.parametrize("static_steps", [False, True], ids=["eager-steps", "static-steps"])
@pytest.mark.parametrize("slots, window", [(10, 256), (3, 256), (2, 96)], ids=["all-at-once", "refilled", "compacted"])
def test_greedy_answers_equal_per_adapter_generate(runtime: ReferenceRuntime, decoder, slots: int, window: int,
                                                   static_steps: bool) -> None:
    """Both adapters share every step; with fewer slots than jobs queued jobs take freed slots mid-run, and with a
    window barely above the longest job the block is shifted right for long prompts and compacted left. Static
    steps (the shape a CUDA graph replays: whole window, rows padded to a bucket) give the same answers."""
    requests = mixed_requests()
    expected = [runtime.run_batch([r]).results[0] for r in requests]  # each job alone, on its own adapter
    assert {len(r.token_ids) for r in expected} != {expected[0].completion_tokens}  # lengths really differ
    assert_same_answers(expected, run_to_end(decoder(slots, window, static_steps=static_steps), requests))


@pytest.mark.parametrize("slots, window", [(3, 256), (2, 128)], ids=["refilled", "compacted"])
def test_static_steps_that_read_part_of_the_window_answer_as_generate(runtime: ReferenceRuntime, decoder,
                                                                       slots: int, window: int) -> None:
    """`column_buckets`: a static step reads only the window's first half or quarter when every row fits there,
    and the decoder compacts the block when its next column reaches such a size; the answers stay generate's."""
    requests = mixed_requests()
    expected = [runtime.run_batch([r]).results[0] for r in requests]
    static = decoder(slots, window, static_steps=True, column_buckets=3)
    assert static._static.widths == [w for w in (window // 4, window // 2, window) if w >= MIN_COLUMNS]
    widths, forward = [], static._static._forward
    static._static._forward = lambda bucket, width: widths.append(width) or forward(bucket, width)
    assert_same_answers(expected, run_to_end(static, requests))
    assert min(widths) < window and len(set(widths)) > 1  # steps read less than the window, in several sizes


def test_run_to_end_prefills_within_the_prefill_budget_as_the_serving_loop_does(runtime: ReferenceRuntime,
                                                                               decoder) -> None:
    """`run_to_end` (tests, the benchmark's profile, the evaluation) keeps the serving loop's prefill budget: a
    decoder's `run` once prefilled every free slot at once and ran out of memory where serving did not."""
    requests = mixed_requests()[:8]
    expected = [runtime.run_batch([r]).results[0] for r in requests]  # before a decoder takes PEFT's path over
    budgeted = decoder(slots=8, window=256)
    blocks: list[int] = []
    prefill = budgeted.prefill

    def recorded(batch: list[GenerationRequest], *args: object) -> list[GenerationResult]:
        width = runtime.tokenizer.apply_chat_template([r.messages for r in batch], add_generation_prompt=True,
                                                      tokenize=True, padding=True, return_dict=True,
                                                      return_tensors="pt")["input_ids"].shape[1]
        blocks.append(len(batch) * width)
        return prefill(batch, *args)

    budgeted.prefill = recorded
    assert_same_answers(expected, run_to_end(budgeted, requests, prefill_tokens=120))
    assert len(blocks) > 1 and max(blocks) <= 120, blocks


@pytest.mark.parametrize("static_steps", [False, True], ids=["eager-steps", "static-steps"])
def test_a_prefill_in_chunks_answers_as_one_pass_and_no_pass_exceeds_the_chunk(runtime: ReferenceRuntime, decoder,
                                                                              static_steps: bool) -> None:
    """KEVLAYA_ENGINE__PREFILL_CHUNK_TOKENS: a prompt block wider than the chunk runs as several forward passes, each
    attending to what the earlier ones cached; the answers are those of `generate`, and the largest pass (what a
    prefill's activation memory scales with) is the chunk, also for the throwaway prefill measured at start."""
    requests = mixed_requests()
    expected = [runtime.run_batch([r]).results[0] for r in requests]
    chunked = decoder(slots=4, window=256, prefill_chunk_tokens=16, static_steps=static_steps)
    passes: list[tuple[int, int]] = []
    hook = runtime.model.register_forward_pre_hook(
        lambda _module, _args, kwargs: passes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        assert_same_answers(expected, run_to_end(chunked, requests))
        prefills = [shape for shape in passes if shape[1] > 1]  # decode steps pass one column
        assert prefills and max(rows * columns for rows, columns in prefills) <= 16, prefills
        assert len(prefills) > len(requests) / 4  # prompts of 20-odd tokens: more than one pass per prefill
        passes.clear()
        chunked.throwaway_prefill(rows=2, width=200)
        assert len(passes) >= 200 // 8 and max(r * c for r, c in passes) <= 16
    finally:
        hook.remove()


def test_the_throwaway_prefill_measured_at_start_leaves_no_trace(runtime: ReferenceRuntime, decoder) -> None:
    """The worker runs its largest prefill into an empty decoder to measure memory; the jobs after it get the
    same answers as without it, and every slot is free."""
    requests = mixed_requests()[:4]
    expected = [runtime.run_batch([r]).results[0] for r in requests]
    measured = decoder(slots=4, window=256, static_steps=True)
    measured.throwaway_prefill(rows=9, width=999)  # clamped to the slots and the window
    assert measured.free == 4 and not measured.rows
    assert_same_answers(expected, run_to_end(measured, requests))
    measured.close()  # one decoder on a model at a time
    busy = decoder(slots=2)
    busy.prefill(requests[:1])
    with pytest.raises(ValueError, match="no rows in flight"):
        busy.throwaway_prefill(rows=1, width=16)


def test_rms_norms_as_one_operator_answer_as_generate_does(runtime: ReferenceRuntime, decoder) -> None:
    """The benchmark's `fused_norms` pair: PyTorch's `rms_norm` in place of transformers' formula differs only in
    rounding, so on the CPU (float32) the answers are generate's; closing gives each norm its own forward back."""
    requests = mixed_requests()[:6]
    expected = [runtime.run_batch([r]).results[0] for r in requests]
    fused = decoder(slots=3, window=256, static_steps=True, fused_norms=True)
    norms = fused.norms._norms
    assert len(norms) == 2 * runtime.model.config.num_hidden_layers + 1  # two per layer, and the final one
    assert_same_answers(expected, run_to_end(fused, requests))
    fused.close()
    assert all("forward" not in vars(norm) for norm in norms)


def test_installed_by_decoders_it_stays_until_the_last_one_removes_it(runtime: ReferenceRuntime) -> None:
    """The modeling module's function is replaced while any decoder holds it, and given back after the last;
    on the CPU the replacement hands every call to transformers' own, so answers are generate's."""
    pytest.importorskip("triton", reason="the kernel is Triton's; without it nothing is installed")
    original = getattr(modeling_llama, NAME)
    first, second = FusedRotary(runtime.model), FusedRotary(runtime.model)
    assert first.installed and getattr(modeling_llama, NAME).original is original
    first.remove()
    assert getattr(modeling_llama, NAME) is not original  # the second still holds it
    second.remove()
    second.remove()  # twice is harmless
    assert getattr(modeling_llama, NAME) is original


def test_a_decoder_with_its_cuda_kernels_asked_for_answers_as_generate_on_the_cpu(runtime: ReferenceRuntime,
                                                                                   decoder) -> None:
    """The rotary and LoRA-expand kernels compute on CUDA only: asked for on the CPU, every call they cannot take
    goes to the operations they replace, and the answers are generate's."""
    pytest.importorskip("triton", reason="the kernel is Triton's; without it nothing is installed")
    requests = mixed_requests()[:4]
    expected = [runtime.run_batch([r]).results[0] for r in requests]
    fused = decoder(slots=2, window=256, static_steps=True, fused_rotary=True, fused_lora=True)
    assert fused.rotary.installed and fused.lora.masked_expand
    assert_same_answers(expected, run_to_end(fused, requests))
    fused.close()
    assert not hasattr(getattr(modeling_llama, NAME), "original")


def test_a_model_serves_one_decoder_at_a_time(runtime: ReferenceRuntime, decoder) -> None:
    """Each decoder's LoRA hooks add its rows' deltas: a second one on the same model would add its deltas to the
    first one's rows. It is refused; and closing the first again must not undo the next one's."""
    job = request("kev", PROMPTS[1], 12)
    expected = runtime.run_batch([job]).results
    first = decoder(slots=2)
    with pytest.raises(RuntimeError, match="close that decoder first"):
        decoder(slots=2)
    first.close()
    second = decoder(slots=2)
    first.close()
    assert_same_answers(expected, run_to_end(second, [job]))


def test_a_freed_slot_is_taken_while_a_long_row_decodes(runtime: ReferenceRuntime, decoder) -> None:
    long, short, queued = request("kev", PROMPTS[3], 60), request("laya", PROMPTS[0], 3), request("laya", PROMPTS[2], 4)
    expected = {r.job_id: runtime.run_batch([r]).results[0] for r in (long, short, queued)}
    engine = decoder(slots=2)
    done = {r.job_id: r for r in engine.prefill([long, short])}
    while short.job_id not in done:
        done.update({r.job_id: r for r in engine.step()})
    assert engine.free == 1 and long.job_id not in done  # the short row left; the long one still decodes
    done.update({r.job_id: r for r in engine.prefill([queued])})
    while queued.job_id not in done:
        done.update({r.job_id: r for r in engine.step()})
    assert long.job_id not in done  # the queued job came and went while the long one kept going
    while engine.rows:
        done.update({r.job_id: r for r in engine.step()})
    assert_same_answers([expected[r.job_id] for r in (long, short, queued)],
                        [done[r.job_id] for r in (long, short, queued)])


def test_a_seeded_job_samples_as_it_would_alone(runtime: ReferenceRuntime, decoder) -> None:
    """Rows with other temperatures, top-p and seeds (and unseeded ones) share its steps; its tokens are the ones
    `generate` draws for it alone with the same seed."""
    seeded = request("laya", PROMPTS[1], 24, temperature=0.8, top_p=0.9, seed=7)
    mates = [request("kev", PROMPTS[0], 30, temperature=1.2, top_p=0.95, seed=1),
             request("laya", PROMPTS[2], 16, temperature=0.5),
             request("kev", PROMPTS[4], 20)]
    alone = runtime.run_batch([seeded]).results[0]
    together = run_to_end(decoder(slots=4), [mates[0], seeded, *mates[1:]])[1]
    assert together.token_ids == alone.token_ids
    assert together.token_logprobs == pytest.approx(alone.token_logprobs, abs=1e-4)


def test_a_row_with_broken_logits_fails_alone(runtime: ReferenceRuntime, decoder) -> None:
    requests = [request("kev", PROMPTS[0], 12), request("laya", PROMPTS[1], 12), request("kev", PROMPTS[2], 12)]
    clean = [runtime.run_batch([r]).results[0] for r in requests]
    engine = decoder(slots=3)
    calls = 0

    def poison_second_row_from_step_3(module: torch.nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls >= 3 and output.shape[0] == 3:
            output[1] = float("nan")
        return output

    handle = runtime.model.get_base_model().lm_head.register_forward_hook(poison_second_row_from_step_3)
    try:
        results = run_to_end(engine, requests)
    finally:
        handle.remove()
    assert results[1].error_code == "numerical_error" and results[1].completion_tokens == 2
    assert results[1].token_ids == clean[1].token_ids[:2]  # its partial text is kept
    assert_same_answers([clean[0], clean[2]], [results[0], results[2]])


def test_out_of_memory_gives_back_the_newest_rows_and_admits_fewer(runtime: ReferenceRuntime, decoder) -> None:
    first = [request("kev", PROMPTS[0], 30), request("laya", PROMPTS[1], 30)]
    later = [request("kev", PROMPTS[2], 30), request("laya", PROMPTS[3], 30)]
    expected = [runtime.run_batch([r]).results[0] for r in first]
    engine = decoder(slots=4)
    engine.prefill(first)
    engine.step()
    engine.prefill(later)
    count, engine.limit = after_step_out_of_memory(len(engine.rows))
    given_back = engine.drop_newest(count)
    assert {r.job_id for r in given_back} == {r.job_id for r in later}
    assert [row.request.job_id for row in engine.rows] == [r.job_id for r in first]
    assert engine.limit == 3 and engine.free == 1
    done = {}
    while engine.rows:
        done.update({r.job_id: r for r in engine.step()})
    assert_same_answers(expected, [done[r.job_id] for r in first])


def test_a_row_that_cannot_fit_the_window_is_refused_before_anything_runs(decoder) -> None:
    engine = decoder(slots=2, window=48)
    with pytest.raises(ValueError, match="window of 48"):
        engine.prefill([request("kev", PROMPTS[3], 40)])
    assert engine.rows == [] and engine.free == 2


def test_nucleus_and_greedy_choice() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]))
    kept = nucleus(logits[:1], 0.7)
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]
    greedy = RowSampling.create(0.0, 1.0, None, torch.device("cpu"))
    choice = choose(logits, [greedy, greedy], banned=[3]).read()
    assert choice.tokens == [0, 2] and choice.broken == [False, False]
    assert choice.logprobs == pytest.approx([math_log(0.5), math_log(0.3)])


def math_log(x: float) -> float:
    return float(torch.log(torch.tensor(x)))


def test_the_next_step_is_launched_before_the_host_reads_this_ones_tokens(runtime: ReferenceRuntime,
                                                                          decoder) -> None:
    """While the host reads a step's tokens (grammars, stop strings, results, the engine's work), the GPU already
    computes the next step: a step's tokens are read after the next forward pass was launched. None is launched
    for rows that all end by length with this step's token."""
    from worker.decoder import sampling

    jobs = [request("kev", PROMPTS[0], 4), request("laya", PROMPTS[1], 4)]
    expected = [runtime.run_batch([r]).results[0] for r in jobs]
    engine = decoder(slots=4)
    passes, read_after = [], []
    hook = runtime.model.register_forward_hook(lambda *_: passes.append(1))
    real_read = sampling.Chosen.read

    def read(chosen):  # noqa: ANN001, ANN202
        read_after.append(len(passes))
        return real_read(chosen)

    try:
        sampling.Chosen.read = read
        done = {r.job_id: r for r in engine.prefill(jobs)}
        while engine.rows:
            done.update({r.job_id: r for r in engine.step()})
    finally:
        sampling.Chosen.read = real_read
        hook.remove()
    assert_same_answers(expected, [done[r.job_id] for r in jobs])
    # the prefill's tokens are read at once (pass 1); step k's after pass k + 2 was launched, but the last step's
    # rows all end by length: nothing is launched after pass 4 (4 tokens: the prefill's and three steps')
    assert read_after == [1, 3, 4, 4]
    assert len(passes) == 4


def test_a_step_launched_ahead_that_fails_runs_again_with_the_next_call(runtime: ReferenceRuntime, decoder) -> None:
    """A launch ahead that raises loses nothing: the rows take this step's tokens, the next call launches the step
    again from them, and the answers are those of `generate`. A failure that persists raises there."""
    jobs = [request("kev", PROMPTS[0], 12), request("laya", PROMPTS[1], 12)]
    expected = [runtime.run_batch([r]).results[0] for r in jobs]
    engine = decoder(slots=4)
    forward, calls = engine._forward, []

    def failing_once(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        if len(calls) == 4:  # the prefill, two steps, then the third step's launch ahead
            raise RuntimeError("a launch that fails")
        return forward(*args, **kwargs)

    engine._forward = failing_once
    done = {r.job_id: r for r in engine.prefill(jobs)}
    while engine.rows:
        done.update({r.job_id: r for r in engine.step()})
    assert len(calls) > 4
    assert_same_answers(expected, [done[r.job_id] for r in jobs])

    engine._forward = forward
    engine.prefill([request("kev", PROMPTS[2], 12)])
    engine._forward = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("a launch that keeps failing"))
    with pytest.raises(RuntimeError, match="keeps failing"):
        while engine.rows:
            engine.step()
