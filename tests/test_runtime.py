"""The model runtime on a tiny random-weight model: adapters, batching modes, per-row limits and failure handling."""

from __future__ import annotations

import math
import re
import shutil
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft.tuners.lora.model import _adapter_names_pre_forward_hook

from modellab.model_factory import build_random_model
from shared.manifest import MANIFEST_NAME, verify_manifest, write_manifest
from shared.settings import Settings
from worker.runtime import (
    AdapterRuntime,
    BatchOutcome,
    GenerationRequest,
    is_out_of_memory,
    remove_stale_peft_hooks,
)

PROMPTS = ["Pick a laptop under 900 EUR.", "Train or plane to Lyon?", "Hire Ana or Ben?", "Rent or buy?"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_random_model(tmp_path_factory.mktemp("runtime-model"), "tiny", seed=0)


def make_settings(dirs: dict[str, Path], **paths: str) -> Settings:
    def profile(name: str) -> dict[str, object]:  # a dict, so it validates as whichever profile class the field has
        return dict(path=paths.get(name, str(dirs[name])), max_new_tokens=8, temperature=0.0,
                    system_prompt=f"You are {name}.")

    return Settings(_env_file=None, base_model=paths.get("base", str(dirs["base"])), kev=profile("kev"),
                    laya=profile("laya"), device="cpu", verify_manifests=True)


@pytest.fixture(scope="module")
def runtime(model_dirs: dict[str, Path]) -> AdapterRuntime:
    return AdapterRuntime.load(make_settings(model_dirs))


def request(adapter: str, prompt: str = PROMPTS[0], *, max_new_tokens: int = 8, temperature: float = 0.0,
            seed: int | None = None) -> GenerationRequest:
    messages = [{"role": "system", "content": f"You are {adapter}."}, {"role": "user", "content": prompt}]
    return GenerationRequest(job_id=uuid.uuid4(), adapter=adapter, messages=messages, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_p=0.9, seed=seed)


def leftover_peft_hooks(model: torch.nn.Module) -> int:
    return sum(
        getattr(hook, "func", None) is _adapter_names_pre_forward_hook
        for module in model.modules() for hook in module._forward_pre_hooks.values()
    )


def texts(outcome: BatchOutcome) -> list[str | None]:
    return [r.text for r in outcome.results]


# -- manifests ---------------------------------------------------------------------------------------------------


def test_manifest_round_trip_and_problems(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"\x00" * 3_000_000)  # more than one hashing chunk
    (tmp_path / "sub" / "config.json").write_text("{}")
    manifest = write_manifest(tmp_path)

    lines = manifest.read_text().splitlines()
    assert [line.split("  ")[1] for line in lines] == ["sub/config.json", "weights.bin"]
    assert all(len(line.split("  ")[0]) == 64 for line in lines)
    assert verify_manifest(tmp_path) == []

    with (tmp_path / "weights.bin").open("ab") as f:
        f.write(b"\x01")
    (tmp_path / "stray.txt").write_text("x")
    (tmp_path / "sub" / "config.json").unlink()
    problems = verify_manifest(tmp_path)
    assert "checksum mismatch for weights.bin" in problems
    assert "missing file sub/config.json" in problems
    assert any("extra file stray.txt" in p for p in problems)

    (tmp_path / MANIFEST_NAME).unlink()
    assert verify_manifest(tmp_path) == [f"{tmp_path} has no {MANIFEST_NAME}"]
    assert "does not exist" in verify_manifest(tmp_path / "nowhere")[0]


def test_factory_is_deterministic_and_complete(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    again = build_random_model(tmp_path, "tiny", seed=0)
    for name in ("base", "kev", "laya"):
        assert verify_manifest(model_dirs[name]) == []
    assert (again["base"] / "model.safetensors").read_bytes() == (model_dirs["base"] / "model.safetensors").read_bytes()
    for name in ("kev", "laya"):
        weights = "adapter_model.safetensors"
        assert (again[name] / weights).read_bytes() == (model_dirs[name] / weights).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "kev", "laya"]


def test_factory_replaces_a_model_built_in_the_same_place(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    build_random_model(tmp_path, "tiny", seed=0, adapters={"kev": (4, 8), "laya": (4, 8)})
    again = build_random_model(tmp_path, "tiny", seed=0)
    assert sorted(p.name for p in again["kev"].iterdir()) == sorted(p.name for p in model_dirs["kev"].iterdir())
    for name in ("base", "kev", "laya"):
        assert verify_manifest(again[name]) == []
    settings = make_settings(model_dirs, base=str(again["base"]), kev=str(again["kev"]), laya=str(again["laya"]))
    assert AdapterRuntime.load(settings).adapters == {"kev", "laya"}  # rank 16 again, not the first build's 4


# -- behaviour ---------------------------------------------------------------------------------------------------


def test_runtime_loads_both_adapters(runtime: AdapterRuntime) -> None:
    assert runtime.device == "cpu"
    assert runtime.adapters == {"kev", "laya"}
    assert runtime.unavailable == {}
    assert runtime.tokenizer.padding_side == "left"


def test_adapters_change_the_output(runtime: AdapterRuntime) -> None:
    kev, laya = runtime.run_batch([request("kev", max_new_tokens=10), request("laya", max_new_tokens=10)]).results
    assert kev.error_code is None and laya.error_code is None
    assert kev.text != laya.text

    messages = request("kev").messages
    encoded = runtime.tokenizer.apply_chat_template([messages], add_generation_prompt=True, return_dict=True,
                                                    return_tensors="pt")
    with torch.inference_mode(), runtime.model.disable_adapter():
        output = runtime.model.generate(**encoded, max_new_tokens=10, do_sample=False,
                                        pad_token_id=runtime.pad_id, eos_token_id=runtime.eos_ids)
    base_text = runtime.tokenizer.decode(output[0, encoded["input_ids"].shape[1]:], skip_special_tokens=True)
    assert base_text not in (kev.text, laya.text)


def test_mixed_batch_matches_grouped_batches(runtime: AdapterRuntime) -> None:
    requests = [request(adapter, prompt) for adapter, prompt in zip(["kev", "laya", "kev", "laya"], PROMPTS)]
    grouped = runtime.run_batch(requests)
    mixed = runtime.run_batch(requests, mixed=True)

    assert all(r.error_code is None for r in grouped.results + mixed.results)
    assert [r.job_id for r in grouped.results] == [r.job_id for r in requests]
    assert texts(grouped) == texts(mixed)
    assert [r.completion_tokens for r in grouped.results] == [r.completion_tokens for r in mixed.results]
    assert grouped.switch_ms > 0 and mixed.switch_ms == 0
    assert grouped.peak_vram_bytes is None
    assert mixed.tokens == sum(r.completion_tokens for r in mixed.results)
    assert mixed.prefill_ms > 0 and mixed.decode_ms > 0


def test_active_adapter_tracks_switches(runtime: AdapterRuntime) -> None:
    runtime.run_batch([request("laya")])
    assert runtime.active_adapter == "laya"
    again = runtime.run_batch([request("laya")])
    assert again.switch_ms == 0


def test_per_row_max_new_tokens(runtime: AdapterRuntime) -> None:
    limits = [3, 20, 7, 1]
    outcome = runtime.run_batch([request("kev", p, max_new_tokens=n) for p, n in zip(PROMPTS, limits)])
    counts = [r.completion_tokens for r in outcome.results]
    assert all(0 < c <= n for c, n in zip(counts, limits)), counts
    assert counts[0] <= 3 and counts[3] == 1
    assert max(counts) > 3, "the longest row must not be cut at another row's limit"
    assert all(r.prompt_tokens > 0 for r in outcome.results)


def test_timings_are_each_jobs_own(model_dirs: dict[str, Path]) -> None:
    """A row's decode time ends at its own last token, and a later group's first token comes after an earlier
    group's whole run: per-job figures, not the batch's copied to every row."""
    runtime = AdapterRuntime.load(make_settings(model_dirs).model_copy(update={"ignore_eos": True}))
    short, long, other = runtime.run_batch([
        request("kev", PROMPTS[0], max_new_tokens=2), request("kev", PROMPTS[1], max_new_tokens=40),
        request("laya", PROMPTS[2], max_new_tokens=4),
    ]).results
    assert [short.completion_tokens, long.completion_tokens, other.completion_tokens] == [2, 40, 4]
    assert 0 <= short.decode_ms < long.decode_ms
    assert 0 < short.first_token_ms == long.first_token_ms  # one forward pass, one first token
    assert other.first_token_ms > long.first_token_ms + long.decode_ms  # laya ran after kev's group


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_ignore_eos_generates_exactly_max_new_tokens(model_dirs: dict[str, Path], ignore_eos: bool) -> None:
    """The benchmark setting: with EOS made the model's favourite token, rows still run to their own limit."""
    runtime = AdapterRuntime.load(make_settings(model_dirs).model_copy(update={"ignore_eos": ignore_eos}))
    eos = runtime.eos_ids[0]

    def favour_eos(_module: torch.nn.Module, _inputs: object, logits: torch.Tensor) -> torch.Tensor:
        logits[..., eos] += 100.0
        return logits

    handle = runtime.model.get_output_embeddings().register_forward_hook(favour_eos)
    try:
        outcome = runtime.run_batch([request("kev", p, max_new_tokens=n) for p, n in zip(PROMPTS, [5, 9, 1, 13])])
    finally:
        handle.remove()
    counts = [r.completion_tokens for r in outcome.results]
    assert counts == ([5, 9, 1, 13] if ignore_eos else [1, 1, 1, 1])
    assert all((eos not in r.token_ids) == ignore_eos for r in outcome.results)

def test_token_logprobs_are_the_models_own_probabilities(runtime: AdapterRuntime) -> None:
    """Each completion token's log-probability equals what a plain forward pass over prompt + completion
    gives, also when sampling at temperature > 0 (they come from raw logits, before temperature/top-p)."""
    req = request("laya", PROMPTS[1], max_new_tokens=12, temperature=0.7, seed=3)
    result = runtime.run_batch([req]).results[0]
    assert len(result.token_logprobs) == len(result.token_spans) == len(result.token_ids) == result.completion_tokens
    assert result.token_spans[-1][1] == len(result.text)

    prompt = runtime.tokenizer.apply_chat_template([req.messages], add_generation_prompt=True, return_dict=True,
                                                   return_tensors="pt")["input_ids"]
    ids = torch.tensor(result.token_ids)
    with torch.inference_mode():
        logits = runtime.model(torch.cat([prompt, ids[None]], dim=1)).logits[0, prompt.shape[1] - 1:-1]
    expected = torch.log_softmax(logits.float(), -1).gather(1, ids[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(result.token_logprobs), expected, atol=1e-4)
    assert result.span_probability(0, len(result.text)) == pytest.approx(math.exp(sum(result.token_logprobs)))
    assert result.span_probability(len(result.text), len(result.text) + 5) is None


def test_seeded_sampling_is_reproducible(runtime: AdapterRuntime) -> None:
    first = runtime.run_batch([request("kev", temperature=1.0, seed=7, max_new_tokens=12)])
    second = runtime.run_batch([request("kev", temperature=1.0, seed=7, max_new_tokens=12)])
    assert texts(first) == texts(second)


# -- failures ----------------------------------------------------------------------------------------------------


def test_tampered_adapter_is_unavailable(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    copy = tmp_path / "laya"
    shutil.copytree(model_dirs["laya"], copy)
    with (copy / "adapter_model.safetensors").open("ab") as f:
        f.write(b"\x00")
    runtime = AdapterRuntime.load(make_settings(model_dirs, laya=str(copy)))

    assert set(runtime.unavailable) == {"laya"}
    assert "checksum mismatch for adapter_model.safetensors" in runtime.unavailable["laya"]
    kev, laya = runtime.run_batch([request("kev"), request("laya")], mixed=True).results
    assert kev.error_code is None and kev.text is not None
    assert laya.error_code == "adapter_unavailable" and laya.text is None
    assert "checksum mismatch" in laya.error_message


@pytest.mark.parametrize("broken", ["kev", "laya"])
def test_adapter_that_fails_to_load_leaves_no_trace(runtime: AdapterRuntime, model_dirs: dict[str, Path],
                                                    tmp_path: Path, broken: str) -> None:
    """An adapter with a valid manifest but the wrong shapes (say, trained for another base) is refused, and
    its half-loaded layers do not leak into the other adapter's output."""
    copy = tmp_path / broken
    shutil.copytree(model_dirs[broken], copy)
    config = copy / "adapter_config.json"
    config.write_text(re.sub(r'"r": \d+', '"r": 4', config.read_text()))
    write_manifest(copy)
    damaged = AdapterRuntime.load(make_settings(model_dirs, **{broken: str(copy)}))

    other = "laya" if broken == "kev" else "kev"
    assert set(damaged.unavailable) == {broken} and "size mismatch" in damaged.unavailable[broken]
    assert damaged.adapters == {other} and damaged.active_adapter == other
    requests = [request(other, p) for p in PROMPTS[:2]] + [request(broken)]
    outcome = damaged.run_batch(requests)
    assert outcome.results[2].error_code == "adapter_unavailable"
    assert texts(outcome)[:2] == texts(runtime.run_batch(requests[:2]))


def test_missing_adapters_and_unknown_names_are_refused(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    runtime = AdapterRuntime.load(make_settings(model_dirs, kev=str(tmp_path / "no-kev"), laya=str(tmp_path / "no")))
    assert set(runtime.unavailable) == {"kev", "laya"}
    results = runtime.run_batch([request("kev"), request("laya"), request("base")]).results
    assert [r.error_code for r in results] == ["adapter_unavailable"] * 3
    assert "unknown adapter 'base'" in results[2].error_message


def test_bad_base_refuses_to_load(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    base = tmp_path / "base"
    shutil.copytree(model_dirs["base"], base)
    (base / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match=r"base model .* checksum mismatch for config.json"):
        AdapterRuntime.load(make_settings(model_dirs, base=str(base)))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_nan_logits_fail_only_their_row(runtime: AdapterRuntime, temperature: float) -> None:
    requests = [request("kev", p, temperature=temperature, seed=3) for p in PROMPTS[:3]]
    clean = runtime.run_batch(requests)

    def poison_row_1(module: torch.nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        output[1] = float("nan")
        return output

    before = runtime.numerical_errors
    handle = runtime.model.get_base_model().lm_head.register_forward_hook(poison_row_1)
    try:
        outcome = runtime.run_batch(requests)
    finally:
        handle.remove()

    bad = outcome.results[1]
    assert bad.error_code == "numerical_error" and "non-finite" in bad.error_message
    assert bad.completion_tokens == 1  # stopped at once with EOS
    assert [r.error_code for r in outcome.results[::2]] == [None, None]
    assert texts(outcome)[::2] == texts(clean)[::2]
    assert runtime.numerical_errors == before + 1


def oom_when(condition: Callable[[torch.Tensor], bool]) -> Callable[..., None]:
    """A pre-forward hook for the embedding layer that raises CUDA's OOM error when `condition(input_ids)`."""

    def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if condition(args[0]):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected by the test)")

    return hook


@pytest.mark.parametrize("mixed", [False, True])
def test_oom_splits_the_batch_until_it_fits(runtime: AdapterRuntime, mixed: bool) -> None:
    requests = [request(adapter, prompt) for adapter, prompt in zip(["kev", "laya", "laya", "kev"], PROMPTS)]
    alone = [runtime.run_batch([r]).results[0].text for r in requests]

    embed = runtime.model.get_input_embeddings()
    handle = embed.register_forward_pre_hook(oom_when(lambda ids: ids.shape[0] > 1))
    try:
        outcome = runtime.run_batch(requests, mixed=mixed)
    finally:
        handle.remove()

    assert [r.error_code for r in outcome.results] == [None] * 4
    assert texts(outcome) == alone
    assert leftover_peft_hooks(runtime.model) == 0
    assert texts(runtime.run_batch(requests)) == texts(runtime.run_batch(requests, mixed=True))


def test_retry_does_not_keep_the_failed_attempt_alive(runtime: AdapterRuntime) -> None:
    """Seen on a 6 GiB-capped H200: retrying inside the `except` block kept the failed attempt's activations
    referenced by the traceback, so even single jobs ran out of memory."""
    failed_activations: list[weakref.ref] = []
    alive_at_retry: list[bool] = []

    def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        alive_at_retry.extend(ref() is not None for ref in failed_activations)
        if args[0].shape[0] > 1:
            activation = torch.empty(1024)  # stands for the attempt's activations
            failed_activations.append(weakref.ref(activation))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected by the test)")

    handle = runtime.model.get_input_embeddings().register_forward_pre_hook(hook)
    try:
        outcome = runtime.run_batch([request("kev", p) for p in PROMPTS[:2]], mixed=True)
    finally:
        handle.remove()
    assert [r.error_code for r in outcome.results] == [None, None]
    assert failed_activations and alive_at_retry and not any(alive_at_retry)


def test_a_job_that_never_fits_fails_alone(runtime: AdapterRuntime) -> None:
    requests = [request("kev"), request("laya", "x" * 400), request("kev", PROMPTS[1]), request("laya", PROMPTS[2])]
    handle = runtime.model.get_input_embeddings().register_forward_pre_hook(oom_when(lambda ids: ids.shape[1] > 300))
    try:
        outcome = runtime.run_batch(requests, mixed=True)
    finally:
        handle.remove()

    assert [r.error_code for r in outcome.results] == [None, "out_of_memory", None, None]
    assert outcome.results[1].prompt_tokens > 300
    assert "even when run alone" in outcome.results[1].error_message
    assert leftover_peft_hooks(runtime.model) == 0


def test_failed_mixed_generate_leaves_peft_hooks_that_are_removed(runtime: AdapterRuntime) -> None:
    """Pins peft issue #3475 on the installed version: the reason `remove_stale_peft_hooks` exists."""
    encoded = runtime.tokenizer.apply_chat_template([request("kev").messages] * 2, add_generation_prompt=True,
                                                    return_dict=True, return_tensors="pt", padding=True)
    handle = runtime.model.get_input_embeddings().register_forward_pre_hook(oom_when(lambda ids: True))
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError), torch.inference_mode():
            runtime.model.generate(**encoded, max_new_tokens=2, adapter_names=["kev", "laya"])
    finally:
        handle.remove()
    leaked = leftover_peft_hooks(runtime.model)
    assert leaked > 0, "peft no longer leaks hooks on failure; the workaround may be dropped"
    assert remove_stale_peft_hooks(runtime.model) == leaked
    assert leftover_peft_hooks(runtime.model) == 0


def test_out_of_memory_detection() -> None:
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_nf4_base_serves_both_adapters_on_the_cpu(model_dirs: dict[str, Path]) -> None:
    """The NF4 path (bitsandbytes Linear4bit, double quant) is the same code the GPU runs; bitsandbytes'
    CPU backend lets it run here."""
    import bitsandbytes as bnb

    settings = make_settings(model_dirs).model_copy(update={"quantization": "nf4"})
    quantized = AdapterRuntime.load(settings)
    layers = [m for m in quantized.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and all(m.weight.quant_type == "nf4" for m in layers)
    outcome = quantized.run_batch([request("kev"), request("laya")])
    assert all(r.error_code is None and r.completion_tokens > 0 for r in outcome.results)
    assert quantized.adapters == {"kev", "laya"}


def test_the_celery_parent_never_imports_torch() -> None:
    """The worker's model is loaded in a forked child; a parent that imported torch (bitsandbytes, imported by
    PEFT, initialises CUDA on import) would leave every child with "Cannot re-initialize CUDA in forked
    subprocess"."""
    import subprocess
    import sys

    code = "import sys, worker.tasks; print(sorted({'torch', 'peft', 'bitsandbytes'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_job_that_cannot_be_encoded_or_run_fails_alone_as_invalid_input(runtime: AdapterRuntime) -> None:
    """Encoded per request before batching: a lone surrogate, a prompt over the context or a temperature that
    overflows sampling fails that job alone (`invalid_input`), never the batch it was claimed with."""
    context = runtime.model.config.max_position_embeddings
    good = request("laya", PROMPTS[0])
    surrogate = request("laya", "pick \ud800 one")
    too_long = request("laya", PROMPTS[1], max_new_tokens=context)
    overflowing = request("laya", PROMPTS[2], temperature=1e-45, seed=1)
    outcome = runtime.run_batch([good, surrogate, too_long, overflowing])
    by_id = {r.job_id: r for r in outcome.results}
    assert by_id[good.job_id].error_code is None and by_id[good.job_id].completion_tokens > 0
    for bad, words in ((surrogate, "tokenized"), (too_long, "context"), (overflowing, "temperature")):
        assert by_id[bad.job_id].error_code == "invalid_input", by_id[bad.job_id]
        assert words in by_id[bad.job_id].error_message


def test_old_model_libraries_are_refused_at_start_up_with_what_to_install(runtime: AdapterRuntime) -> None:
    from worker.library_features import missing_library_features

    assert missing_library_features(tokenizer=runtime.tokenizer) == []  # the installed releases have everything

    class OldPeftModel:
        def set_adapter(self, adapter_name): ...  # noqa: ANN001, ANN201

    class OldTokenizer:  # takes the option through **kwargs and ignores it, as older transformers did
        eos_token, eos_token_id = runtime.tokenizer.eos_token, runtime.tokenizer.eos_token_id

        def apply_chat_template(self, conversation, **kwargs):  # noqa: ANN001, ANN003, ANN201
            kwargs.pop("sanitize_control_tokens", None)
            return runtime.tokenizer.apply_chat_template(conversation, **kwargs)

    missing = missing_library_features(peft_model=OldPeftModel, tokenizer=OldTokenizer())
    assert len(missing) == 2
    assert "set_adapter(inference_mode" in missing[0] and "peft>=" in missing[0]
    assert "sanitize_control_tokens" in missing[1] and "transformers>=" in missing[1]
