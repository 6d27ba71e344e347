"""The model on a tiny random-weight model: manifests, loading (adapters refused with a reason), and the reference
runtime (`generate`) that the slot decoder is compared against: per-row limits, log-probabilities, broken logits."""

from __future__ import annotations

import json
import math
import re
import shutil
import uuid
from pathlib import Path

import pytest
import torch

from modellab.model_factory import build_random_model
from modellab.reference import ReferenceRun, ReferenceRuntime
from shared.base_match import record_base
from shared.manifest import MANIFEST_NAME, verify_manifest, write_manifest
from shared.settings import Settings
from worker.generation import GenerationRequest

PROMPTS = ["Pick a laptop under 900 EUR.", "Train or plane to Lyon?", "Hire Ana or Ben?", "Rent or buy?"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_random_model(tmp_path_factory.mktemp("runtime-model"), "tiny", seed=0)


def make_settings(dirs: dict[str, Path], **paths: str) -> Settings:
    def profile(name: str) -> dict[str, object]:  # a dict, so it validates as whichever profile class the field has
        return dict(path=paths.get(name, str(dirs[name])), max_new_tokens=8, temperature=0.0,
                    system_prompt=f"You are {name}.")

    return Settings(_env_file=None,
                    model={"base": paths.get("base", str(dirs["base"])), "device": "cpu", "verify_manifests": True},
                    kev=profile("kev"), laya=profile("laya"))


@pytest.fixture(scope="module")
def runtime(model_dirs: dict[str, Path]) -> ReferenceRuntime:
    return ReferenceRuntime.load(make_settings(model_dirs))


def request(adapter: str, prompt: str = PROMPTS[0], *, max_new_tokens: int = 8, temperature: float = 0.0,
            seed: int | None = None) -> GenerationRequest:
    messages = [{"role": "system", "content": f"You are {adapter}."}, {"role": "user", "content": prompt}]
    return GenerationRequest(job_id=uuid.uuid4(), adapter=adapter, messages=messages, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_p=0.9, seed=seed)


def texts(outcome: ReferenceRun) -> list[str | None]:
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
    assert ReferenceRuntime.load(settings).adapters == {"kev", "laya"}  # rank 16 again, not the first build's 4


# -- behaviour ---------------------------------------------------------------------------------------------------


def test_runtime_loads_both_adapters(runtime: ReferenceRuntime) -> None:
    assert runtime.device == "cpu"
    assert runtime.adapters == {"kev", "laya"}
    assert runtime.loaded.unavailable == {}
    assert runtime.tokenizer.padding_side == "left"


def test_models_load_without_hub_kernels(runtime: ReferenceRuntime, model_dirs: dict[str, Path]) -> None:
    """transformers kernelizes a loaded model by default, which fetches kernels from the Hub: the worker and
    the trainer serve offline and with their own fused operators, so each loads with it off."""
    from modellab.training.adapters import _load_trainable_base

    assert runtime.model.get_base_model().use_kernels is False
    assert _load_trainable_base(model_dirs["base"], "cpu", gradient_checkpointing=False, nf4=False).use_kernels is False


@pytest.mark.parametrize("saved", [torch.float32, torch.float16], ids=["saved-fp32", "saved-fp16"])
def test_adapters_are_served_in_the_models_compute_dtype(model_dirs: dict[str, Path], tmp_path: Path,
                                                         monkeypatch, saved: torch.dtype) -> None:  # noqa: ANN001
    """PEFT upcasts adapters to float32 beside a 16-bit base (for training): served on CUDA (fp16) they would hold
    twice their memory, 0.22 GiB for a 7B model's. Here the CPU stands in for CUDA's dtype; an adapter saved in
    either dtype ends in it, and the base is untouched."""
    from safetensors.torch import load_file, save_file

    from worker.model import loading

    dirs = {name: tmp_path / name for name in ("kev", "laya")}
    for name, target in dirs.items():
        shutil.copytree(model_dirs[name], target)
        weights = target / "adapter_model.safetensors"
        save_file({k: v.to(saved) for k, v in load_file(weights).items()}, weights)
    monkeypatch.setattr(loading, "compute_dtype", lambda device: torch.float16)
    settings = make_settings(model_dirs, kev=str(dirs["kev"]), laya=str(dirs["laya"]))
    loaded = loading.load_model(settings.updated(model={"verify_manifests": False}))
    assert loaded.unavailable == {}
    dtypes = {name: p.dtype for name, p in loaded.model.named_parameters()}
    assert {d for name, d in dtypes.items() if ".lora_" in name} == {torch.float16}
    assert {d for name, d in dtypes.items() if ".lora_" not in name} == {torch.float16}  # the base, as loaded


def test_adapters_change_the_output(runtime: ReferenceRuntime) -> None:
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


def test_per_row_max_new_tokens(runtime: ReferenceRuntime) -> None:
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
    runtime = ReferenceRuntime.load(make_settings(model_dirs).updated(engine={"ignore_eos": True}))
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
    runtime = ReferenceRuntime.load(make_settings(model_dirs).updated(engine={"ignore_eos": ignore_eos}))
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

def test_token_logprobs_are_the_models_own_probabilities(runtime: ReferenceRuntime) -> None:
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


def test_seeded_sampling_is_reproducible(runtime: ReferenceRuntime) -> None:
    first = runtime.run_batch([request("kev", temperature=1.0, seed=7, max_new_tokens=12)])
    second = runtime.run_batch([request("kev", temperature=1.0, seed=7, max_new_tokens=12)])
    assert texts(first) == texts(second)


# -- failures ----------------------------------------------------------------------------------------------------


def test_tampered_adapter_is_unavailable(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    copy = tmp_path / "laya"
    shutil.copytree(model_dirs["laya"], copy)
    with (copy / "adapter_model.safetensors").open("ab") as f:
        f.write(b"\x00")
    runtime = ReferenceRuntime.load(make_settings(model_dirs, laya=str(copy)))

    assert set(runtime.loaded.unavailable) == {"laya"} and runtime.adapters == {"kev"}
    assert "checksum mismatch for adapter_model.safetensors" in runtime.loaded.refusal("laya")
    [kev] = runtime.run_batch([request("kev")]).results
    assert kev.error_code is None and kev.text is not None


@pytest.mark.parametrize("broken", ["kev", "laya"])
def test_adapter_that_fails_to_load_leaves_no_trace(runtime: ReferenceRuntime, model_dirs: dict[str, Path],
                                                    tmp_path: Path, broken: str) -> None:
    """An adapter with a valid manifest but the wrong shapes (say, trained for another base) is refused, and
    its half-loaded layers do not leak into the other adapter's output."""
    copy = tmp_path / broken
    shutil.copytree(model_dirs[broken], copy)
    config = copy / "adapter_config.json"
    config.write_text(re.sub(r'"r": \d+', '"r": 4', config.read_text()))
    write_manifest(copy)
    damaged = ReferenceRuntime.load(make_settings(model_dirs, **{broken: str(copy)}))

    other = "laya" if broken == "kev" else "kev"
    assert set(damaged.loaded.unavailable) == {broken} and "size mismatch" in damaged.loaded.refusal(broken)
    assert damaged.adapters == {other}
    requests = [request(other, p) for p in PROMPTS[:2]]
    assert texts(damaged.run_batch(requests)) == texts(runtime.run_batch(requests))


def test_an_adapter_made_for_another_base_of_the_same_shapes_is_refused_and_the_other_still_served(
        model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Same shapes, another tokenizer (two tokens' ids swapped): PEFT loads such an adapter without a word, and it
    would answer noise. Its BASE.json says which base it was made for."""
    base = tmp_path / "base"
    shutil.copytree(model_dirs["base"], base)
    tokenizer = json.loads((base / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (base / "tokenizer.json").write_text(json.dumps(tokenizer))
    write_manifest(base)
    kev = tmp_path / "kev"  # made again for the new base: served
    shutil.copytree(model_dirs["kev"], kev)
    record_base(kev, base)
    write_manifest(kev)

    runtime = ReferenceRuntime.load(make_settings(model_dirs, base=str(base), kev=str(kev)))
    assert set(runtime.loaded.unavailable) == {"laya"} and runtime.adapters == {"kev"}
    assert "for another base" in runtime.loaded.refusal("laya") and "tokenizer" in runtime.loaded.refusal("laya")
    [answer] = runtime.run_batch([request("kev")]).results
    assert answer.error_code is None and answer.text is not None


def test_a_manifest_from_another_build_refuses_its_adapter_naming_the_files(model_dirs: dict[str, Path],
                                                                             tmp_path: Path) -> None:
    laya = tmp_path / "laya"
    shutil.copytree(model_dirs["laya"], laya)
    shutil.copy(model_dirs["kev"] / "MANIFEST.sha256", laya / "MANIFEST.sha256")
    runtime = ReferenceRuntime.load(make_settings(model_dirs, laya=str(laya)))
    assert set(runtime.loaded.unavailable) == {"laya"} and runtime.adapters == {"kev"}
    assert "checksum mismatch for adapter_model.safetensors" in runtime.loaded.refusal("laya")


def test_missing_adapters_and_unknown_names_are_refused(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    runtime = ReferenceRuntime.load(make_settings(model_dirs, kev=str(tmp_path / "no-kev"), laya=str(tmp_path / "no")))
    assert set(runtime.loaded.unavailable) == {"kev", "laya"} and runtime.adapters == set()
    assert all("failed verification" in runtime.loaded.refusal(name) for name in ("kev", "laya"))
    assert "unknown adapter 'base'" in runtime.loaded.refusal("base")


def test_bad_base_refuses_to_load(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    base = tmp_path / "base"
    shutil.copytree(model_dirs["base"], base)
    (base / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match=r"base model .* checksum mismatch for config.json"):
        ReferenceRuntime.load(make_settings(model_dirs, base=str(base)))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_nan_logits_fail_only_their_row(runtime: ReferenceRuntime, temperature: float) -> None:
    requests = [request("kev", p, temperature=temperature, seed=3) for p in PROMPTS[:3]]
    clean = runtime.run_batch(requests)

    def poison_row_1(module: torch.nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        output[1] = float("nan")
        return output

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


def test_out_of_memory_detection() -> None:
    from worker.memory import is_out_of_memory

    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))


CUDNN_FAILURE = ("Expected mha_graph.execute(handle, variant_pack, workspace_ptr.get()).is_good() to be true, but "
                 "got false.")  # what cuDNN's attention raised on an H200 another process had filled


@pytest.mark.parametrize("free", [0, 8 * 2**30], ids=["card-full", "room-left"])
def test_a_gpu_library_failing_on_a_full_card_is_out_of_memory(monkeypatch, free: int) -> None:  # noqa: ANN001
    """cuDNN and cuBLAS report a failed allocation of their own as a failed call: on a full card it is memory
    (the job goes back to the queue); with room left it is a bug, and must show."""
    import worker.memory
    from worker.memory import is_out_of_memory

    monkeypatch.setattr(worker.memory, "device_free_bytes", lambda: free)
    assert is_out_of_memory(RuntimeError(CUDNN_FAILURE)) is (free == 0)
    assert is_out_of_memory(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")) is (free == 0)
    assert not is_out_of_memory(RuntimeError("shape mismatch"))  # not a library's call, whatever the card holds


def test_nf4_base_serves_both_adapters_on_the_cpu(model_dirs: dict[str, Path]) -> None:
    """The NF4 path (bitsandbytes Linear4bit, double quant) is the same code the GPU runs; bitsandbytes'
    CPU backend lets it run here."""
    import bitsandbytes as bnb

    settings = make_settings(model_dirs).updated(model={"quantization": "nf4"})
    quantized = ReferenceRuntime.load(settings)
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


def test_a_job_that_cannot_be_encoded_or_run_is_refused_with_the_reason(runtime: ReferenceRuntime) -> None:
    """Checked per request before it takes a slot: a lone surrogate, a prompt over the context or a temperature
    that overflows sampling is refused with a reason (the engine fails that job alone as `invalid_input`)."""
    context = runtime.model.config.max_position_embeddings
    tokens, problem = runtime.loaded.check(request("laya", PROMPTS[0]))
    assert tokens > 0 and problem is None
    for bad, words in ((request("laya", "pick \ud800 one"), "tokenized"),
                       (request("laya", PROMPTS[1], max_new_tokens=context), "context"),
                       (request("laya", PROMPTS[2], temperature=1e-45, seed=1), "temperature")):
        assert words in runtime.loaded.check(bad)[1]


def test_old_model_libraries_are_refused_at_start_up_with_what_to_install(runtime: ReferenceRuntime) -> None:
    from worker.model.library_features import missing_library_features

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
