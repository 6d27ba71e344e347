"""`train_adapter`: a Kev or Laya LoRA adapter (QLoRA on CUDA), written with its report and manifest."""

from __future__ import annotations

import json
import logging
import math
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoTokenizer, PreTrainedModel

from modellab.training.config import (
    ADAPTER_FILES,
    OUTPUT_FILES,
    TrainConfig,
    TrainingDiverged,
    TrainReport,
)
from modellab.training.data import (
    balance_by_label,
    encode_samples,
    example_batches,
    read_samples,
)
from modellab.training.loop import LoopSettings, make_report, run_loop, seed_everything
from modellab.training.scoring import score_decisions
from shared.base_match import record_base
from shared.manifest import write_manifest
from worker.model.loading import adapters_to, load_causal_lm, resolve_device
from worker.model.quantization import nf4_config

log = logging.getLogger("kevlaya.training")


def _load_trainable_base(path: Path, device: str, gradient_checkpointing: bool, nf4: bool) -> PreTrainedModel:
    if device == "cpu":
        return load_causal_lm(path, dtype=torch.float32)
    if not nf4:  # the full-precision base on the GPU: adapters that fit the weights the CPU serves exactly
        return load_causal_lm(path, dtype=torch.float32, device_map={"": 0})
    from peft import prepare_model_for_kbit_training

    model = load_causal_lm(path, quantization_config=nf4_config(torch.float16), dtype=torch.float16,
                           device_map={"": 0})
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)


def _optimizer(params: list[torch.nn.Parameter], quantized: bool, lr: float, weight_decay: float
               ) -> torch.optim.Optimizer:
    if not quantized:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    import bitsandbytes as bnb

    return bnb.optim.PagedAdamW8bit(params, lr=lr, weight_decay=weight_decay)


def _check_output_dir(path: Path) -> None:
    """Refuse a directory holding anything but a previous adapter, so a run never mixes into unrelated files."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"output {path} exists and is not a directory")
    if path.is_dir() and (other := sorted(p.name for p in path.iterdir() if p.name not in OUTPUT_FILES)):
        raise ValueError(f"output directory {path} holds other files ({', '.join(other[:5])}); "
                         "choose a new or empty directory")


def _save_adapter(model: torch.nn.Module, output_dir: Path) -> None:
    """Only the adapter's config and weights, at the top level (PEFT would add a model card beside them)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output_dir.parent) as scratch:
        model.save_pretrained(scratch)
        for name in ADAPTER_FILES:
            shutil.move(Path(scratch) / name, output_dir / name)


def train_adapter(config: TrainConfig) -> TrainReport:
    """Train one LoRA adapter on `config.data_file` and write it, `training.json` and a manifest to `output_dir`.

    The data (and the eval file) are validated in full before anything is loaded or written."""
    started = time.perf_counter()
    samples = read_samples(config.data_file)
    eval_samples = read_samples(config.eval_file)[:config.eval_samples] if config.eval_file else []
    _check_output_dir(config.output_dir)
    device = resolve_device(config.device)
    generator = seed_everything(config.seed)

    tokenizer = AutoTokenizer.from_pretrained(config.base_model)
    encoded = encode_samples(tokenizer, samples, config.system_prompt)
    kept = [e for e in encoded if len(e.input_ids) <= config.max_seq_tokens]
    filtered = len(encoded) - len(kept)
    if filtered:
        log.warning("%d of %d sample(s) are longer than %d tokens: left out", filtered, len(encoded),
                    config.max_seq_tokens)
    if not kept:
        raise ValueError(f"every sample is longer than max_seq_tokens={config.max_seq_tokens}")
    if config.balance_labels:
        examples, before, after = balance_by_label(kept, config.seed)
        log.info("labels before resampling %s, after %s", before, after)
    else:
        examples, before, after = kept, {}, {}

    quantized = device == "cuda" and config.quantization != "none"
    model = _load_trainable_base(config.base_model, device, config.gradient_checkpointing, quantized)
    lora = LoraConfig(r=config.r, lora_alpha=config.alpha, lora_dropout=config.dropout,
                      target_modules=list(config.target_modules), task_type="CAUSAL_LM")
    torch.manual_seed(config.seed)  # LoRA A's initialisation
    model = get_peft_model(model, lora)  # adapter "default": PEFT saves it at the top level
    if device == "cpu":
        model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = _optimizer(params, quantized, config.lr, config.weight_decay)
    per_step = config.batch_size * config.grad_accum
    total = config.max_steps or math.ceil(config.epochs * len(examples) / per_step)
    log.info("training %s adapter (r=%d, alpha=%d, %s; %d trainable parameters) on %s: %d examples, %d steps",
             config.adapter, config.r, config.alpha, ",".join(config.target_modules),
             sum(p.numel() for p in params), device, len(examples), total)
    settings = LoopSettings(
        lr=config.lr, total_steps=total, grad_accum=config.grad_accum,
        warmup_steps=min(config.warmup_steps, max(1, total // 10)), checkpoint_every=config.checkpoint_every,
        log_every=config.log_every, max_rollbacks=config.max_rollbacks,
        inject_nan_at_step=config.inject_nan_at_step, progress=config.progress, desc=f"train {config.adapter}",
    )
    batches = example_batches(examples, config.batch_size, tokenizer.pad_token_id, generator)
    run_on = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")  # where device_map put the base
    result = run_loop(model, optimizer, params, batches, run_on, settings)
    for p in params:
        if not torch.isfinite(p).all():
            raise TrainingDiverged("an adapter weight is non-finite after training; nothing was written")

    scores = None
    if eval_samples:
        max_new = max(len(e) for e in tokenizer([s.completion for s in eval_samples],
                                                 add_special_tokens=False)["input_ids"]) + 8
        scores = score_decisions(model, tokenizer, eval_samples, config.system_prompt, max_new_tokens=max_new,
                                 batch_size=config.eval_batch_size)
        log.info("eval on %d samples: valid JSON %.1f%%, accuracy %.1f%%", scores["n"],
                 100 * scores["valid_rate"], 100 * scores["accuracy"])

    report = make_report(result, total, len(examples), device, filtered=filtered, labels_before=before,
                     labels_after=after, eval=scores, quantized=quantized)
    report.seconds = time.perf_counter() - started  # the whole run, loading and evaluation included
    if config.save_dtype != "float32":
        adapters_to(model, getattr(torch, config.save_dtype))
    _save_adapter(model, config.output_dir)
    record = {
        "config": config.to_json(), "report": asdict(report), "losses": result.losses,
        "rollbacks": result.rollbacks, "train_seconds": result.seconds,
        "versions": {"torch": torch.__version__, "transformers": _version("transformers"), "peft": _version("peft")},
    }
    (config.output_dir / "training.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    record_base(config.output_dir, Path(config.base_model))
    write_manifest(config.output_dir)  # last: it covers every file written above
    return report


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)
