"""Loading the model: the base (NF4 on CUDA, under the VRAM budget) with every adapter that verifies and loads,
and its tokenizer. The engine serves what is loaded through its slot decoder; `modellab/reference.py` through
`generate`."""

from __future__ import annotations

import gc
import logging
import math
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from shared.adapter_identity import AdapterIdentity, describe_adapter
from shared.base_match import base_mismatch
from shared.base_source import base_directory, is_gguf, locate
from shared.calibration import CalibrationError, adapter_calibration
from shared.manifest import verify_manifest
from shared.settings import ADAPTERS, Settings
from worker.generation import GenerationRequest
from worker.memory import cap_process_memory
from worker.model.gguf_cache import build_gguf_cache
from worker.model.library_features import require_library_features
from worker.model.quantization import nf4_config
from worker.model.tokens import check_request

log = logging.getLogger("kevlaya.runtime")


@dataclass
class LoadedModel:
    """The base with every adapter that loaded: what the worker serves, and what it refuses and why."""

    model: torch.nn.Module  # a PeftModel holding the adapters that loaded, or the bare base when none did
    tokenizer: PreTrainedTokenizerBase  # left padding, a pad token
    device: str
    unavailable: dict[str, str]  # adapter -> why it is not served
    versions: dict[str, AdapterIdentity] = field(default_factory=dict)  # of each adapter served

    @cached_property  # read on every step (reservations, refusals); what loaded does not change
    def adapters(self) -> set[str]:
        loaded = set(self.model.peft_config) if isinstance(self.model, PeftModel) else set()
        return loaded - self.unavailable.keys()

    @cached_property
    def eos_ids(self) -> list[int]:
        """Every token that ends an answer; the tokenizer's first (it is the one forced onto a broken row)."""
        eos = self.model.generation_config.eos_token_id
        ids = [self.tokenizer.eos_token_id, *([eos] if isinstance(eos, int) else eos or [])]
        return list(dict.fromkeys(i for i in ids if i is not None))

    @property
    def context(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def refusal(self, adapter: str) -> str | None:
        """Why `adapter` cannot be served, or None; never fall back to the bare base model."""
        if adapter in self.adapters:
            return None
        if adapter in self.unavailable:
            return self.unavailable[adapter]
        return f"unknown adapter {adapter!r}; this worker serves {', '.join(sorted(self.adapters)) or 'none'}"

    def check(self, request: GenerationRequest) -> tuple[int, str | None]:
        """The request's prompt tokens, and why it cannot run on this model (or None)."""
        return check_request(self.tokenizer, self.context, request, torch.device("cpu"))


def resolve_device(setting: str) -> str:
    """`auto` → cuda when torch sees a GPU, else cpu; asking for cuda without one is an error."""
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device is 'cuda' but torch sees no CUDA device")
    return setting


# `auto` quantizes a base on CUDA from this size up: below it, its fp16 weights take at most 2 GB, which a 6 GB card
# holds beside its cache, and NF4 costs a small model much of its accuracy (results README: SmolLM2-135M).
NF4_FROM_PARAMETERS = 1_000_000_000


def base_parameters(path: str | Path) -> int:
    """The parameters of a base directory's safetensors weights, read from their headers (no tensor is loaded)."""
    total = 0
    for file in Path(path).glob("*.safetensors"):
        with safe_open(file, framework="pt") as weights:
            total += sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    return total


def uses_nf4(device: str, quantization: str, parameters: int) -> bool:
    """`auto` is NF4 on CUDA for a base of `NF4_FROM_PARAMETERS` or more, else full precision (always on the CPU);
    `nf4` / `none` force one or the other."""
    return quantization == "nf4" or (quantization == "auto" and device == "cuda"
                                     and parameters >= NF4_FROM_PARAMETERS)


def load_causal_lm(path: str | Path, **kwargs: object) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained` as every part of the project loads a model: without transformers'
    default kernelizing, which fetches kernels from the Hub (the project runs offline, with its own operators)."""
    return AutoModelForCausalLM.from_pretrained(path, use_kernels=False, **kwargs)


def compute_dtype(device: str) -> torch.dtype:
    """The dtype the model computes in: fp16 on CUDA (NF4's compute dtype too), fp32 on the CPU."""
    return torch.float16 if device == "cuda" else torch.float32


def load_base(path: str, device: str, vram_budget_gb: float, quantization: str = "auto") -> PreTrainedModel:
    nf4 = uses_nf4(device, quantization, base_parameters(path))
    dtype = compute_dtype(device)
    placement = {"": 0} if device == "cuda" else {"": "cpu"}
    if device == "cuda":
        cap_process_memory(vram_budget_gb)
    if not nf4:
        return load_causal_lm(path, dtype=dtype, device_map=placement)
    return load_causal_lm(path, quantization_config=nf4_config(dtype), dtype=dtype, device_map=placement)


def adapters_to(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every LoRA weight of `model` in `dtype`. PEFT loads adapters in float32 beside a 16-bit base (for training);
    served, they compute in the model's dtype and hold half the memory (0.22 GiB in float32 for a 7B model's
    adapters on every linear layer, nearly a 6 GB card's slot)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_" in name and parameter.dtype != dtype:
                parameter.data = parameter.data.to(dtype)


def prepare_base(settings: Settings) -> str:
    """The directory the base is served from; a GGUF base is read into its cache first, if it is not there yet."""
    source = locate(settings.model.base)
    if source.is_file() and is_gguf(source):
        return str(build_gguf_cache(source, settings.model.cache_dir))
    return str(base_directory(settings.model.base, settings.model.cache_dir))


def load_model(settings: Settings) -> LoadedModel:
    """The base and every adapter of `settings`; an adapter that fails verification or loading is refused (and
    said why), never replaced by the bare base model."""
    started = time.perf_counter()
    device = resolve_device(settings.model.device)
    base = prepare_base(settings)
    if settings.model.verify_manifests and (problems := verify_manifest(Path(base))):
        raise RuntimeError(f"base model {base} failed verification: {'; '.join(problems)}")
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.padding_side = "left"  # decoder-only generation: prompts end where the new tokens start
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    require_library_features(tokenizer)
    model: torch.nn.Module = load_base(base, device, settings.engine.vram_budget_gb, settings.model.quantization)
    log.info("loaded base model %s on %s in %.1fs", base, device, time.perf_counter() - started)

    unavailable: dict[str, str] = {}
    versions: dict[str, AdapterIdentity] = {}
    for name in ADAPTERS:
        path = settings.adapter_profile(name).path
        if settings.model.verify_manifests and (problems := verify_manifest(Path(path))):
            unavailable[name] = f"adapter {name} ({path}) failed verification: {'; '.join(problems)}"
            log.error("%s; it will not be served", unavailable[name])
            continue
        if reason := base_mismatch(Path(path), Path(base)):
            unavailable[name] = f"adapter {name} ({path}) is for another base: {reason}"
            log.error("%s; it will not be served", unavailable[name])
            continue
        try:  # read now, so a broken calibration file refuses the adapter at start, not each job at settle
            calibration = adapter_calibration(path)
        except CalibrationError as exc:
            unavailable[name] = f"adapter {name} ({path}) has a broken calibration: {exc}"
            log.error("%s; it will not be served", unavailable[name])
            continue
        try:  # its version, which every job it answers records
            identity = describe_adapter(name, Path(path), settings.model.base)
        except (OSError, ValueError) as exc:
            unavailable[name] = f"adapter {name} ({path}) cannot be identified: {exc}"
            log.error("%s; it will not be served", unavailable[name])
            continue
        adapter_started = time.perf_counter()
        try:
            if isinstance(model, PeftModel):  # as saved, not upcast to float32 first (adapters_to, below)
                model.load_adapter(path, adapter_name=name, autocast_adapter_dtype=False)
            else:
                model = PeftModel.from_pretrained(model, path, adapter_name=name, autocast_adapter_dtype=False)
        except Exception as exc:  # e.g. trained for another base: refuse the adapter, keep the worker
            unavailable[name] = f"adapter {name} ({path}) failed to load: {exc.__class__.__name__}: {exc}"
            log.exception("%s; it will not be served", unavailable[name])
            # PEFT injects the LoRA layers before loading their weights, so a failed load leaves a
            # half-initialised adapter in the model: remove it, or start again from a clean base.
            if isinstance(model, PeftModel):
                if name in model.peft_config:
                    model.delete_adapter(name)
            else:
                model = None
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
                model = load_base(base, device, settings.engine.vram_budget_gb, settings.model.quantization)
            continue
        versions[name] = identity
        log.info("loaded adapter %s version %s (rank %s) from %s in %.2fs (confidence %s)", name,
                 identity.sha256, identity.rank, path, time.perf_counter() - adapter_started, calibration.describe())
    adapters_to(model, compute_dtype(device))
    model.eval()
    if device == "cuda":
        torch.cuda.empty_cache()  # once after loading, never per job
        log.info("resident after load: %.2f GiB", torch.cuda.memory_allocated() / 2**30)
    log.info("runtime ready on %s in %.1fs; unavailable adapters: %s",
             device, time.perf_counter() - started, ", ".join(unavailable) or "none")
    return LoadedModel(model, tokenizer, device, unavailable, versions)

