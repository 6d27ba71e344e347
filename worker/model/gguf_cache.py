"""A GGUF base read once into a Hugging Face directory (safetensors weights, config, tokenizer): later starts load
that directory and skip the dequantisation. The file is checked before it is read, so an architecture or a tensor
type transformers cannot serve is refused at start with a message naming it (docs/architecture.md §10)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from shared.base_source import SOURCE_RECORD, BaseSourceError, cache_is_built, file_sha256, gguf_cache_dir
from shared.manifest import write_manifest

log = logging.getLogger("kevlaya.runtime")


def _field(reader, key: str) -> str | None:  # noqa: ANN001
    field = reader.fields.get(key)
    return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8", "replace")


def check_gguf(path: Path) -> str:
    """The file's architecture, or BaseSourceError naming what transformers cannot read in it."""
    import gguf
    from gguf.quants import _type_traits as dequantizable  # the types gguf-py can turn back into floats
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # a truncated or foreign file
        raise BaseSourceError(f"base {path}: not a readable GGUF file ({exc.__class__.__name__}: {exc})") from exc
    architecture = _field(reader, "general.architecture")
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        raise BaseSourceError(f"base {path}: GGUF architecture {architecture!r} is not one transformers reads "
                              f"({', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})")
    plain = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
    unreadable = sorted({t.tensor_type.name for t in reader.tensors
                         if t.tensor_type not in plain and t.tensor_type not in dequantizable})
    if unreadable:
        raise BaseSourceError(f"base {path}: GGUF tensor type(s) {', '.join(unreadable)} cannot be dequantized")
    return architecture


def build_gguf_cache(gguf_path: Path, cache_root: Path) -> Path:
    """The cache directory of `gguf_path`, written first if it is not there yet. Written whole into a temporary
    directory beside it and renamed into place, so a crash leaves no half cache and two builders do not mix."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import GgufConfig

    gguf_path = Path(gguf_path)
    target = gguf_cache_dir(gguf_path, cache_root)
    if cache_is_built(target):
        return target
    architecture = check_gguf(gguf_path)
    started = time.perf_counter()
    log.info("reading GGUF base %s (%s) into %s, once", gguf_path, architecture, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        where, name = gguf_path.parent, gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        # Plain float weights, not transformers' packed GGUF kernels: the service quantizes to NF4 itself on CUDA.
        model = AutoModelForCausalLM.from_pretrained(
            where, gguf_file=name, dtype=torch.float32, use_kernels=False,
            quantization_config=GgufConfig(dequantize=True))
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        del model
        (work / SOURCE_RECORD).write_text(json.dumps(
            {"file": name, "sha256": file_sha256(gguf_path), "architecture": architecture}, indent=2) + "\n",
            encoding="utf-8")
        write_manifest(work)
        os.chmod(work, 0o755)  # mkdtemp makes it 0700
        try:
            work.rename(target)
        except OSError:  # another process finished first: its copy serves
            if not cache_is_built(target):
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("GGUF base cached in %s in %.1fs", target, time.perf_counter() - started)
    return target
