"""The CUDA path on a real GPU: the NF4 (bitsandbytes) base with both adapters, under a 6 GB card's cap.

Run with `pytest -m gpu` on a machine with CUDA; everywhere else these tests are skipped (there is nothing to run
them on). The model is the shipped demo model, or a random-weight model of the Qwen2.5-1.5B shape."""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import uuid
from pathlib import Path

import pytest
import torch

from modellab.decision_data import render_prompt
from modellab.evaluation import load_scenarios
from modellab.reference import ReferenceRuntime
from shared.decision import find_decision
from shared.settings import Settings
from tests.conftest import AUTH, free_port, start_worker, submit, wait_finished, wait_until
from worker.decoder.options import DecoderOptions
from worker.engine.offline import run_to_end
from worker.generation import GenerationRequest

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module", autouse=True)
def nf4_whatever_the_size():
    """Every model here is served NF4, the small ones too (`auto` keeps a base under 1 B parameters in fp16): this
    suite is about the NF4 path. Workers it starts inherit the setting."""
    before = os.environ.get("KEVLAYA_MODEL__QUANTIZATION")
    os.environ["KEVLAYA_MODEL__QUANTIZATION"] = "nf4"
    yield
    if before is None:
        del os.environ["KEVLAYA_MODEL__QUANTIZATION"]
    else:
        os.environ["KEVLAYA_MODEL__QUANTIZATION"] = before

CAP_GB = 5.5  # what a 6 GB card leaves PyTorch after the CUDA context
DEMO = Path("models/demo")


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def prewarmed() -> None:
    """Workers here start as fresh processes, not forked from the prewarmed server (tests/prewarmed.py): forked
    from a process with threads, a CUDA worker hung before its model loaded on the H200."""
    return None


@pytest.fixture(scope="module")
def demo() -> ReferenceRuntime:
    runtime = ReferenceRuntime.load(Settings(_env_file=None, model={"device": "cuda"},
                                             engine={"vram_budget_gb": CAP_GB}))
    yield runtime
    del runtime
    _free()


def scenario_requests(settings: Settings, adapters: list[str]) -> list[GenerationRequest]:
    scenarios = load_scenarios(DEMO / "test_scenarios.jsonl", len(adapters))
    requests = []
    for adapter, (_, scenario) in zip(adapters, scenarios):
        profile = settings.adapter_profile(adapter)
        requests.append(GenerationRequest(
            job_id=uuid.uuid4(), adapter=adapter, max_new_tokens=profile.max_new_tokens, temperature=0.0, top_p=1.0,
            seed=None, messages=[{"role": "system", "content": profile.system_prompt},
                                 {"role": "user", "content": render_prompt(scenario)}]))
    return requests


def test_demo_model_serves_both_adapters_on_an_nf4_base(demo: ReferenceRuntime) -> None:
    import bitsandbytes as bnb

    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in demo.model.modules()) > 0
    assert demo.adapters == {"kev", "laya"}
    torch.cuda.reset_peak_memory_stats()
    outcome = demo.run_batch(scenario_requests(Settings(_env_file=None), ["kev", "laya"] * 3))
    assert [r.error_code for r in outcome.results] == [None] * 6
    assert all(find_decision(r.text) is not None for r in outcome.results), [r.text for r in outcome.results]
    assert torch.cuda.max_memory_allocated() < CAP_GB * 2**30


def test_a_step_captured_with_one_adapter_mix_replays_right_with_another(demo: ReferenceRuntime) -> None:
    """The graphs are captured once, on idle rows; the row mask is a tensor, so replaying them with all-Kev rows,
    then all-Laya rows, then a mix gives each job its own adapter's `generate` answer (fp16: one may differ)."""
    from worker.decoder.slot_decoder import SlotDecoder

    mixes = [scenario_requests(Settings(_env_file=None), mix)
             for mix in (["kev"] * 4, ["laya"] * 4, ["laya", "kev", "kev", "laya"])]
    # the reference first: while a decoder exists, the model's own LoRA path is off
    answers = [[demo.run_batch([r]).results[0] for r in requests] for requests in mixes]
    decoder = SlotDecoder(demo.model, demo.tokenizer, ["kev", "laya"], slots=4, window=1024, eos_ids=demo.eos_ids,
                          options=DecoderOptions(graphs=True))
    try:
        for requests, expected in zip(mixes, answers):
            mix = [r.adapter for r in requests]
            got = run_to_end(decoder, requests)
            agree = sum(g.token_ids == e.token_ids for g, e in zip(got, expected))
            assert agree >= len(requests) - 1, (mix, [(e.text, g.text) for g, e in zip(got, expected)])
    finally:
        decoder.close()


def test_nan_is_contained_to_its_row(demo: ReferenceRuntime) -> None:
    requests = scenario_requests(Settings(_env_file=None), ["laya"] * 3)
    clean = demo.run_batch(requests)

    def poison_row_1(_module: torch.nn.Module, _args: object, output: torch.Tensor) -> torch.Tensor:
        output[1] = float("nan")
        return output

    handle = demo.model.get_base_model().lm_head.register_forward_hook(poison_row_1)
    try:
        outcome = demo.run_batch(requests)
    finally:
        handle.remove()
    assert [r.error_code for r in outcome.results] == [None, "numerical_error", None]
    assert [r.token_ids for r in outcome.results[::2]] == [r.token_ids for r in clean.results[::2]]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> ReferenceRuntime:
    from modellab.model_factory import build_random_model

    paths = build_random_model(tmp_path_factory.mktemp("qwen"), "qwen2.5-1.5b", dtype=torch.float16, device="cuda")
    _free()
    settings = Settings(_env_file=None, model={"device": "cuda", "base": str(paths["base"]), "verify_manifests": False},
                        engine={"vram_budget_gb": CAP_GB, "ignore_eos": True}, kev={"path": str(paths["kev"])},
                        laya={"path": str(paths["laya"])})
    runtime = ReferenceRuntime.load(settings)
    yield runtime
    del runtime
    _free()


def long_requests(count: int, prompt_chars: int, new_tokens: int) -> list[GenerationRequest]:
    # the random model's tokenizer is one token per byte
    return [GenerationRequest(job_id=uuid.uuid4(), adapter=("kev", "laya")[i % 2], max_new_tokens=new_tokens,
                              temperature=0.0, top_p=1.0, seed=None,
                              messages=[{"role": "user", "content": f"{i} " + "x" * prompt_chars}])
            for i in range(count)]


def test_a_real_shape_stays_under_the_cap(qwen: ReferenceRuntime) -> None:
    from worker.engine.build import build_decoder

    settings = Settings(_env_file=None, model={"device": "cuda"},
                        engine={"vram_budget_gb": CAP_GB, "max_batch": 16, "ignore_eos": True})
    decoder = build_decoder(qwen.loaded, settings)
    try:
        got = run_to_end(decoder, long_requests(16, 250, 64), settings.engine.prefill_tokens)
        assert [r.completion_tokens for r in got] == [64] * 16
        assert torch.cuda.max_memory_reserved() <= CAP_GB * 2**30
    finally:
        decoder.close()
        del decoder
        _free()


def test_a_real_out_of_memory_is_recognised_and_the_decoder_still_serves(qwen: ReferenceRuntime) -> None:
    """A prefill too big for what is left of the card runs out of memory for real: the engine's test for it
    recognises the error, and the same decoder then serves jobs that fit."""
    from worker.decoder.slot_decoder import SlotDecoder
    from worker.memory import is_out_of_memory

    decoder = SlotDecoder(qwen.model, qwen.tokenizer, ["kev", "laya"], slots=16, window=2048, eos_ids=qwen.eos_ids,
                          options=DecoderOptions(ignore_eos=True))
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated() + 0.25 * 2**30) / total, 0)
    try:
        with pytest.raises(Exception) as raised:
            decoder.prefill(long_requests(16, 1500, 4))
        assert is_out_of_memory(raised.value)
        del raised
        _free()
    finally:
        torch.cuda.set_per_process_memory_fraction(CAP_GB * 2**30 / total, 0)
    try:
        assert decoder.rows == []
        assert [r.completion_tokens for r in run_to_end(decoder, long_requests(2, 100, 4))] == [4, 4]
    finally:
        decoder.close()
        del decoder
        _free()


# -- the worker as a process on the GPU ----------------------------------------------------------------------

@pytest.fixture
def database_url(tmp_path: Path) -> str:  # SQLite only: the GPU machine has no PostgreSQL, and this is about CUDA
    from shared.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'kevlaya.db'}"
    upgrade(url)
    return url


@pytest.fixture
def env(worker_env: dict[str, str]) -> dict[str, str]:
    return {**worker_env, "KEVLAYA_API__PORT": str(free_port()), "KEVLAYA_MODEL__DEVICE": "cuda",
            "KEVLAYA_ENGINE__VRAM_BUDGET_GB": str(CAP_GB), "KEVLAYA_ENGINE__IGNORE_EOS": "true"}


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def test_the_worker_recovers_after_its_child_is_killed(env, api, start_process) -> None:  # noqa: ANN001
    worker = start_worker(start_process, env, api)
    [child] = _children(worker.process.pid)
    ids = [submit(api, ("kev", "laya")[i % 2], f"question {i}", max_new_tokens=400) for i in range(8)]
    wait_until(lambda: any(api.get(f"/v1/jobs/{i}").json()["status"] == "running" for i in ids), 60,
               what="a running batch")
    os.kill(child, signal.SIGKILL)
    jobs = wait_finished(api, ids, timeout=300)
    assert [j["status"] for j in jobs] == ["succeeded"] * 8
    assert max(j["attempts"] for j in jobs) == 2  # the killed batch ran again, once
    new_children = _children(worker.process.pid)
    assert new_children and child not in new_children
    assert api.get("/readyz", headers=AUTH).status_code == 200


@pytest.mark.parametrize("graphs, fused", [(False, False), (True, False), (True, True)],
                         ids=["eager-steps", "cuda-graphs", "cuda-graphs-fused-norms-rotary-lora-nf4"])
def test_the_slot_decoder_on_nf4_answers_as_generate_does(demo: ReferenceRuntime, graphs: bool, fused: bool) -> None:
    """The slot decoder on the NF4 base: Kev and Laya rows in the same steps, captured or not, with RMSNorm as one
    operator, the rotary embedding, each LoRA product's mask and expand and the NF4 matmuls as one kernel each (as
    served on CUDA) or not, and captured steps that read only part of the window, give the per-adapter `generate` answers
    (greedy; fp16, so one answer in eight may part at a near tie)."""
    from worker.decoder.slot_decoder import SlotDecoder

    requests = scenario_requests(Settings(_env_file=None), ["kev", "laya"] * 4)
    expected = [demo.run_batch([r]).results[0] for r in requests]
    decoder = SlotDecoder(demo.model, demo.tokenizer, ["kev", "laya"], slots=4, window=1024, eos_ids=demo.eos_ids,
                          options=DecoderOptions(graphs=graphs, fused_norms=fused, fused_rotary=fused,
                                                 fused_lora=fused, nf4_kernel=fused))
    try:
        assert (decoder.rotary is not None and decoder.rotary.installed) is fused
        assert decoder.lora.masked_expand is fused and (decoder.nf4 is not None) is fused
        got = run_to_end(decoder, requests)
    finally:
        decoder.close()
    agree = sum(g.token_ids == e.token_ids for g, e in zip(got, expected))
    assert agree >= len(requests) - 1, [(e.text, g.text) for g, e in zip(got, expected) if g.token_ids != e.token_ids]
    assert all(g.error_code is None for g in got)


def test_captured_steps_reading_part_of_the_window_answer_as_steps_reading_all_of_it(demo: ReferenceRuntime) -> None:
    """Captured steps that read only the window's first quarter or half while the rows fit there (as served on
    CUDA), the block compacted at those sizes, answer as steps that read the whole window; every row writes 300
    tokens, so the steps read more than one size."""
    from worker.decoder.slot_decoder import SlotDecoder

    requests = [dataclasses.replace(r, max_new_tokens=300)
                for r in scenario_requests(Settings(_env_file=None), ["kev", "laya"] * 4)]

    def answers(column_buckets: int) -> tuple[list, list[int]]:
        decoder = SlotDecoder(demo.model, demo.tokenizer, ["kev", "laya"], slots=4, window=1024, eos_ids=demo.eos_ids,
                              options=DecoderOptions(graphs=True, ignore_eos=True, column_buckets=column_buckets))
        widths: list[int] = []
        width = decoder._static.width
        decoder._static.width = lambda t: widths.append(width(t)) or widths[-1]
        try:
            return run_to_end(decoder, requests), widths
        finally:
            decoder.close()

    (whole, whole_widths), (parts, widths) = answers(1), answers(3)
    assert set(whole_widths) == {1024} and len(set(widths)) > 1 and min(widths) == 256, sorted(set(widths))
    assert all(g.error_code is None for g in parts)
    agree = sum(p.token_ids == w.token_ids for p, w in zip(parts, whole))
    assert agree >= len(requests) - 1, [(w.text, p.text) for p, w in zip(parts, whole) if p.token_ids != w.token_ids]


def test_the_rotary_kernel_on_cuda_rotates_as_transformers_does() -> None:
    """worker/decoder/kernels/fused_rotary.py compiled: on a 3B model's heads (16 query, 2 key/value, 128 wide), for a
    decode step's rows and a prefill's tokens, its queries and keys are transformers' to within one rounding."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    from worker.decoder.kernels.fused_rotary import rotary, takes

    for dtype in (torch.float16, torch.bfloat16):
        for batch, seq in ((32, 1), (4, 200)):
            joined = torch.randn(batch, seq, 20 * 128, device="cuda", dtype=dtype)
            q, k, _ = joined.split([16 * 128, 2 * 128, 2 * 128], dim=-1)
            q, k = q.view(batch, seq, -1, 128).transpose(1, 2), k.view(batch, seq, -1, 128).transpose(1, 2)
            angles = torch.randn(1, seq, 64, device="cuda") * 100
            cos, sin = (f(torch.cat([angles, angles], -1)).to(dtype) for f in (torch.cos, torch.sin))
            assert takes(q, k, cos, sin, 1)
            expected = apply_rotary_pos_emb(q.float(), k.float(), cos.float(), sin.float())
            for e, g in zip(expected, rotary(q, k, cos, sin)):
                # one rounding of values below about 6: 2^-8 of them in bfloat16
                assert (g.float() - e).abs().max().item() <= 6 * torch.finfo(dtype).eps, (dtype, batch, seq)


def test_the_lora_expand_kernel_on_cuda_adds_as_the_three_operations_do() -> None:
    """worker/decoder/kernels/lora_expand.py compiled: a 3B layer's joined q/k/v and gate/up LoRA expands (Kev r16, Laya
    r8; each member's columns from its own rank block), for a step's rows and a prefill pass's tokens, add into the
    output what mask-then-matmul adds, to within fp16 rounding."""
    from worker.decoder.kernels.lora_expand import masked_expand, takes

    width, table = 24, torch.zeros(3, 24, device="cuda", dtype=torch.float16)
    table[0, :16], table[1, 16:] = 1, 1
    for rows, tokens, boundaries, out in ((32, 1, (2048, 2304), 2560), (36, 1, (11008,), 22016), (4, 128, (), 2048)):
        mask = table[torch.arange(rows, device="cuda") % 3][:, None, :]
        blocks = len(boundaries) + 1
        shrunk = torch.randn(rows, tokens, blocks * width, device="cuda", dtype=torch.float16)
        b = torch.randn(out, width, device="cuda", dtype=torch.float16) * 0.1
        output = torch.randn(rows, tokens, out, device="cuda", dtype=torch.float16)
        assert takes(output, shrunk, mask, b, boundaries)
        masked = shrunk.unflatten(-1, (blocks, width)) * mask.unsqueeze(-2)
        expected = output.clone()
        for k, (first, last) in enumerate(zip((0, *boundaries), (*boundaries, out))):
            expected[..., first:last] += masked[..., k, :] @ b[first:last].T
        masked_expand(output, shrunk, mask, b, boundaries)
        error = (output.float() - expected.float()).abs().max() / expected.float().abs().max()
        assert error.item() < 2e-3, (rows, tokens, boundaries, error.item())


def assert_agree(expected: list, got: list, what: str) -> None:
    """Greedy answers agree on at least 99 % of their tokens, counting each answer up to its first difference."""
    total = sum(len(e.token_ids) for e in expected)
    agreeing = sum(next((i for i, (a, b) in enumerate(zip(e.token_ids, g.token_ids)) if a != b),
                        min(len(e.token_ids), len(g.token_ids))) for e, g in zip(expected, got))
    identical = sum(e.token_ids == g.token_ids for e, g in zip(expected, got))
    print(f"{what}: {agreeing}/{total} tokens agree ({agreeing / total:.2%}), {identical}/{len(got)} answers "
          "identical")
    assert agreeing >= 0.99 * total


def test_an_fp8_cache_on_nf4_with_captured_steps_agrees_with_the_fp16_cache(demo: ReferenceRuntime) -> None:
    """`KEVLAYA_ENGINE__KV_DTYPE=fp8` on CUDA: the block holds float8 at half the bytes, captured steps write and
    read it, prefills in chunks of 64 tokens write it, and greedy answers agree with those of the fp16 cache and
    whole prefills on at least 99 % of their tokens."""
    from worker.decoder.slot_decoder import SlotDecoder

    requests = scenario_requests(Settings(_env_file=None), ["kev", "laya"] * 16)

    def answers(kv_dtype: torch.dtype | None, chunk: int | None = None) -> tuple[list, int]:
        decoder = SlotDecoder(demo.model, demo.tokenizer, ["kev", "laya"], slots=8, window=1024, eos_ids=demo.eos_ids,
                              options=DecoderOptions(graphs=True, kv_dtype=kv_dtype, prefill_chunk_tokens=chunk))
        try:
            block = sum(layer.keys.nbytes + layer.values.nbytes for layer in decoder.kv.layers)
            return run_to_end(decoder, requests), block
        finally:
            decoder.close()
            del decoder
            _free()

    (fp16, fp16_bytes), (fp8, fp8_bytes) = answers(None), answers(torch.float8_e4m3fn, chunk=64)
    assert fp8_bytes * 2 == fp16_bytes
    assert all(g.error_code is None for g in fp8)
    assert_agree(fp16, fp8, "fp8 cache and 64-token prefill chunks against fp16 and whole prefills on NF4, "
                 "captured steps")


def test_prefills_between_captured_steps_agree_with_whole_prefills(demo: ReferenceRuntime) -> None:
    """Prompt blocks prefilled in captured passes of 128 columns between captured steps (`begin_prefill`,
    `prefill_pass`), with Laya prompts prefilled whole in between and the block moved into place when its last
    pass has run: greedy answers agree with whole prefills on at least 99 % of their tokens. Blocks of up to
    seven prompts in passes of at most four rows: a column range runs as four rows and three padded to four,
    and a Laya prompt prefilled whole between the two takes free slots the second must not pad into."""
    from worker.decoder.slot_decoder import SlotDecoder

    requests = scenario_requests(Settings(_env_file=None), ["kev", "kev", "laya"] * 5)

    def between_steps(decoder: SlotDecoder) -> list:
        kevs, layas, done = [r for r in requests if r.adapter == "kev"], [r for r in requests if r.adapter == "laya"], {}
        while kevs or layas or decoder.rows or decoder.prefilling:
            if layas and decoder.free and (decoder.prefilling or not decoder.rows or not kevs):
                # a Laya job goes whole, before the block's next pass
                done.update({r.job_id: r for r in decoder.prefill([layas.pop(0)])})
            elif kevs and decoder.free and not decoder.prefilling:
                batch = kevs[:min(decoder.free, 7)]
                del kevs[:len(batch)]
                if decoder.rows:
                    decoder.begin_prefill(batch)
                else:
                    done.update({r.job_id: r for r in decoder.prefill(batch)})
            if decoder.prefilling:
                done.update({r.job_id: r for r in decoder.prefill_pass()})
            done.update({r.job_id: r for r in decoder.step()})
        return [done[r.job_id] for r in requests]

    def answers(run: object) -> list:
        decoder = SlotDecoder(demo.model, demo.tokenizer, ["kev", "laya"], slots=12, window=1024, eos_ids=demo.eos_ids,
                              options=DecoderOptions(graphs=True, prefill_chunk_tokens=512))
        try:
            return run(decoder)
        finally:
            decoder.close()
            del decoder
            _free()

    whole, aside = answers(lambda decoder: run_to_end(decoder, requests)), answers(between_steps)
    assert all(g.error_code is None for g in aside)
    assert_agree(whole, aside, "prefills between captured steps against whole prefills on NF4")


@pytest.mark.parametrize("decoded_scales", [True, False], ids=["scales-kept-decoded", "scales-decoded-per-call"])
def test_joined_projections_on_nf4_with_captured_steps_agree_with_one_matmul_each(demo: ReferenceRuntime,
                                                                                  decoded_scales: bool) -> None:
    """q/k/v and gate/up joined (one LoRA product per group; NF4 scales kept decoded, or decoded inside the
    captured step) under captured steps with Kev and Laya rows mixed: greedy answers agree with one matmul per
    projection on at least 99 % of their tokens (fp16 GEMMs of another width may round differently), and the
    model's own layers compute as before afterwards."""
    from worker.decoder.kernels.fused_projections import join_weights
    from worker.decoder.slot_decoder import SlotDecoder

    requests = scenario_requests(Settings(_env_file=None), ["kev", "laya"] * 16)
    before = demo.run_batch(requests[:2]).results
    join_weights(demo.model, decoded_scales=decoded_scales)

    def answers(fused: bool) -> list:
        decoder = SlotDecoder(demo.model, demo.tokenizer, ["kev", "laya"], slots=8, window=1024, eos_ids=demo.eos_ids,
                              options=DecoderOptions(graphs=True, fused_projections=fused))
        try:
            if fused:
                assert decoder.fused.groups == 2 * demo.model.config.num_hidden_layers
            return run_to_end(decoder, requests)
        finally:
            decoder.close()
            del decoder
            _free()

    unfused, fused = answers(False), answers(True)
    assert all(g.error_code is None for g in fused)
    assert_agree(unfused, fused, "joined q/k/v and gate/up against one matmul per projection on NF4, captured steps")
    assert [r.token_ids for r in demo.run_batch(requests[:2]).results] == [r.token_ids for r in before]


def test_the_slot_decoder_is_sized_by_its_measured_peak(demo: ReferenceRuntime) -> None:
    """A workspace estimate of 0 and a budget 16 slots short of what 64 slots were measured to need: the worker
    measures its graphs and its largest prefill, takes slots away, and real jobs then stay within the budget."""
    from worker.decoder.kv_block import kv_shape
    from worker.engine.build import build_decoder
    from worker.memory import kv_bytes_per_token

    def settings(budget_gb: float) -> Settings:
        return Settings(_env_file=None, model={"device": "cuda"}, laya={"reserved_slots": 0},
                        engine={"vram_budget_gb": budget_gb, "max_batch": 64, "workspace_gb": 0,
                                "window_tokens": 1024, "cuda_graphs": True})

    _free()
    per_slot = kv_bytes_per_token(*kv_shape(demo.model.config), dtype_bytes=2) * 1024
    torch.cuda.reset_peak_memory_stats()  # what the worker measures: the build (graphs captured) and the prefill
    roomy = build_decoder(demo.loaded, settings(CAP_GB))
    assert roomy.kv.slots == 64
    roomy.throwaway_prefill(rows=2, width=1024)
    needed = torch.cuda.max_memory_reserved()
    roomy.close()
    del roomy
    _free()

    budget = needed - 16 * per_slot
    decoder = build_decoder(demo.loaded, settings(budget / 2**30))
    try:
        assert 1 <= decoder.kv.slots < 64
        torch.cuda.reset_peak_memory_stats()
        decoder.throwaway_prefill(rows=2, width=1024)
        got = run_to_end(decoder, scenario_requests(Settings(_env_file=None), ["kev", "laya"] * 4),
                         settings(budget / 2**30).engine.prefill_tokens)
        assert all(g.error_code is None for g in got)
        assert torch.cuda.max_memory_reserved() <= budget
    finally:
        decoder.close()
        del decoder
        _free()


def test_a_rebuilt_decoder_leaves_no_memory_behind(demo: ReferenceRuntime) -> None:
    """Sizing may build the decoder several times: each closed decoder gives back all it took. (cuBLAS keeps a
    workspace per stream for good, so captures share one stream instead of taking a new one per bucket.)"""
    from worker.decoder.slot_decoder import SlotDecoder

    def build_and_close() -> int:
        decoder = SlotDecoder(demo.model, demo.tokenizer, ["kev", "laya"], slots=16, window=1024, eos_ids=demo.eos_ids,
                              options=DecoderOptions(graphs=True))
        decoder.throwaway_prefill(rows=2, width=1024)
        decoder.close()
        del decoder
        _free()
        return torch.cuda.memory_allocated()

    first = build_and_close()
    assert build_and_close() == first == build_and_close()


def test_constrained_and_free_rows_share_captured_steps_on_nf4(demo: ReferenceRuntime) -> None:
    """Captured steps with grammar rows beside free rows: every decision names an option offered (here: not the
    model's own answer), a JSON-schema row validates, and the free rows answer as they do alone."""
    import json

    from shared import grammar
    from shared.schemas import answer_grammar
    from worker.decoder.slot_decoder import SlotDecoder

    settings = Settings(_env_file=None)
    free = scenario_requests(settings, ["kev", "laya"] * 2)
    scenarios = load_scenarios(DEMO / "test_scenarios.jsonl", 4)
    constrained = []
    for request, (_, scenario) in zip(free, scenarios):
        others = [o.name for o in scenario.options if o.name != scenario.label] or ["A"]
        constrained.append(GenerationRequest(
            job_id=uuid.uuid4(), adapter=request.adapter, messages=request.messages, max_new_tokens=request.max_new_tokens,
            temperature=0.0, top_p=1.0, seed=None,
            grammar=answer_grammar({"output": "decision", "choices": others}, request.messages,
                                   settings.adapter_profile(request.adapter).analysis)))
    schema = {"type": "object", "properties": {"pick": {"enum": ["A", "B"]}, "sure": {"type": "boolean"}},
              "required": ["pick", "sure"], "additionalProperties": False}
    shaped = GenerationRequest(job_id=uuid.uuid4(), adapter="laya", messages=free[1].messages, max_new_tokens=40,
                               temperature=0.0, top_p=1.0, seed=None, grammar=grammar.json_grammar(schema))

    def run(requests: list[GenerationRequest]) -> list:
        decoder = SlotDecoder(demo.model, demo.tokenizer, ["kev", "laya"], slots=len(requests), window=1024,
                              eos_ids=demo.eos_ids, options=DecoderOptions(graphs=True))
        try:
            return run_to_end(decoder, requests)
        finally:
            decoder.close()

    alone = run(free)
    together = run([*free, *constrained, shaped])
    assert sum(a.token_ids == t.token_ids for a, t in zip(alone, together[:4])) >= 3  # fp16: one may differ
    for request, (_, scenario), result in zip(constrained, scenarios, together[4:8]):
        found = find_decision(demo.tokenizer.decode(result.token_ids, skip_special_tokens=True))
        assert found is not None and result.finish_reason == "stop", result.text
        assert found.value["decision"] != scenario.label or scenario.label == "none"
    answer = json.loads(demo.tokenizer.decode(together[8].token_ids, skip_special_tokens=True))
    assert set(answer) == {"pick", "sure"} and answer["pick"] in ("A", "B") and isinstance(answer["sure"], bool)


HOG = """
import sys, torch
held, chunk = [], 1 << 30
while chunk >= 1 << 20:  # take every byte the driver will give, in halving chunks
    try:
        held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError:
        chunk //= 2
print(torch.cuda.mem_get_info()[0], flush=True)
sys.stdin.read()  # hold it until the test closes our stdin
"""


def test_memory_taken_by_another_process_after_sizing_fails_no_job(env, api, start_process) -> None:  # noqa: ANN001
    """Once the worker has sized its slots (and reserved what its largest prefill and its captured steps need),
    another process takes every byte left on the card: the worker keeps serving, and no job fails."""
    import subprocess
    import sys

    worker = start_worker(start_process, env, api)
    hog = subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        left = int(hog.stdout.readline())
        assert left < 64 * 2**20, f"{left} bytes still free on the card"
        prompts = [render_prompt(s) for _, s in load_scenarios(DEMO / "test_scenarios.jsonl", 32)]
        ids = [submit(api, adapter, prompt, max_new_tokens=64)
               for adapter, prompt in zip(["kev", "laya"] * 16, prompts)]
        try:
            jobs = wait_finished(api, ids, timeout=180)
        except Exception as exc:  # a job put back for ever: say why from the worker's log
            raise AssertionError(f"{exc}\n{worker.output()[-6000:]}") from exc
        failed = [(j["status"], j.get("error")) for j in jobs if j["status"] != "succeeded"]
        assert not failed, (failed, worker.output()[-4000:])
    finally:
        hog.stdin.close()
        hog.wait(timeout=60)


def test_the_nf4_kernel_multiplies_every_layer_as_bitsandbytes_and_answers_agree(demo: ReferenceRuntime,
                                                                                  qwen: ReferenceRuntime) -> None:
    """The Triton NF4 kernel (worker/decoder/kernels/nf4_matmul.py): on every NF4 layer of the demo model and of a real shape,
    its product for 1 to 64 rows, the values decoded by byte permutes or by a tree of selects, is bitsandbytes'
    (fp16 rounding); the decoder (captured steps) serves its matmuls of 2 rows or more through it, with answers that are those through
    bitsandbytes on at least 99 % of the tokens, and closing gives bitsandbytes' path back."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    from worker.decoder.kernels import nf4_matmul as kernel_module
    from worker.decoder.kernels.nf4_matmul import Nf4Kernels, Nf4Weight, nf4_matmul, plan
    from worker.decoder.slot_decoder import SlotDecoder

    worst, layers = 0.0, 0
    for runtime in (demo, qwen):
        for module in runtime.model.modules():
            if not isinstance(module, bnb.nn.Linear4bit):
                continue
            weight = Nf4Weight.of(module)
            if weight is None:  # a shape the kernel leaves to bitsandbytes
                continue
            dense = F.dequantize_4bit(module.weight.data, module.weight.quant_state).float()
            bias = None if module.bias is None else module.bias.half()
            for rows in (1, 7, 32, 64):
                x = torch.randn(rows, weight.in_features, device="cuda", dtype=torch.float16)
                expected = x.float() @ dense.T + (0 if bias is None else bias.float())
                launch = plan(rows, weight, x.device)
                assert launch.permute is weight.standard
                for decode in {launch, dataclasses.replace(launch, permute=False)}:  # byte permutes, select tree
                    got = nf4_matmul(x, weight, bias, launch=decode).float()
                    worst = max(worst, ((got - expected).abs().max() / expected.abs().max()).item())
            layers += 1
    print(f"NF4 kernel against bitsandbytes' dequantized weight, {layers} layers: worst relative error {worst:.2e}")
    assert layers > 0 and worst < 5e-3

    requests = scenario_requests(Settings(_env_file=None), ["kev", "laya"] * 16)
    calls = []
    real = kernel_module.nf4_matmul

    def answers(with_kernel: bool) -> list:
        calls.clear()
        decoder = SlotDecoder(demo.model, demo.tokenizer, ["kev", "laya"], slots=8, window=1024, eos_ids=demo.eos_ids,
                              options=DecoderOptions(graphs=True, nf4_kernel=with_kernel))
        try:
            assert (decoder.nf4 is not None) is with_kernel
            return run_to_end(decoder, requests)
        finally:
            decoder.close()
            del decoder
            _free()
            # the joined projections and the others, never for one row (bitsandbytes' GEMV is faster there)
            assert bool(calls) is with_kernel and all(rows >= 2 for rows in calls), sorted(set(calls))

    kernel_module.nf4_matmul = lambda x, *args, **kwargs: calls.append(x.numel() // x.shape[-1]) or real(x, *args,
                                                                                                          **kwargs)
    try:
        theirs, ours = answers(False), answers(True)
    finally:
        kernel_module.nf4_matmul = real
    assert Nf4Kernels.holders == 0  # closed: bitsandbytes' own forward again
    assert not any("forward" in vars(m) for m in demo.model.modules())
    assert all(g.error_code is None for g in ours)
    assert_agree(theirs, ours, "NF4 kernel against bitsandbytes on the demo model, captured steps")
