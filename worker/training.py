"""Training: LoRA/QLoRA decision adapters (`train_adapter`) and full-parameter pretraining of a small base
(`pretrain_base`), sharing one optimisation loop with gradient clipping, NaN/Inf rollback and a progress bar.

On CUDA an adapter is trained QLoRA-style: the base is loaded 4-bit NF4 and the optimiser is bitsandbytes'
paged 8-bit AdamW. On the CPU the base stays in full precision with torch's AdamW. Either way only the LoRA
weights are saved, so an adapter trained on the NF4 base also loads on the unquantized one.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import random
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from shared.decision import parse_decision
from shared.manifest import MANIFEST_NAME, write_manifest
from shared.settings import KevProfile, LayaProfile
from worker.runtime import resolve_device

log = logging.getLogger("kevlaya.training")

ADAPTERS = ("kev", "laya")
IGNORE_INDEX = -100  # label value the loss skips (prompt and padding tokens)
CLIP_NORM = 1.0
MAX_LISTED_PROBLEMS = 50
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
OUTPUT_FILES = frozenset({*ADAPTER_FILES, "training.json", MANIFEST_NAME})


# -- configuration and report -----------------------------------------------------------------------------------


def preset(adapter: str) -> dict[str, Any]:
    """The recipe's defaults for `adapter` (DESIGN §10) plus its serving system prompt."""
    if adapter == "kev":
        return {"r": 16, "alpha": 32, "lr": 1e-4, "system_prompt": KevProfile().system_prompt}
    if adapter == "laya":
        return {"r": 8, "alpha": 16, "lr": 2e-4, "system_prompt": LayaProfile().system_prompt}
    raise ValueError(f"unknown adapter {adapter!r}; choose one of {', '.join(ADAPTERS)}")


@dataclass
class TrainConfig:
    """One adapter training run. `preset(adapter)` gives r, alpha, lr and the system prompt."""

    base_model: Path
    data_file: Path
    output_dir: Path
    adapter: str
    system_prompt: str
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    lr: float = 1e-4
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    epochs: float = 1.0
    max_steps: int | None = None  # when set, overrides epochs
    batch_size: int = 16
    grad_accum: int = 1
    max_seq_tokens: int = 512
    warmup_steps: int = 20
    weight_decay: float = 0.0
    balance_labels: bool = True
    seed: int = 0
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    gradient_checkpointing: bool = False  # saves activation memory on big bases at the cost of a second forward
    eval_file: Path | None = None
    eval_samples: int = 256
    eval_batch_size: int = 64
    log_every: int = 10
    checkpoint_every: int = 50
    max_rollbacks: int = 5
    progress: bool = True
    # Test/diagnostic knob: make the loss of this (1-based) step NaN, to exercise the rollback path.
    inject_nan_at_step: int | None = None

    def __post_init__(self) -> None:
        self.base_model, self.data_file, self.output_dir = (
            Path(self.base_model), Path(self.data_file), Path(self.output_dir))
        self.eval_file = Path(self.eval_file) if self.eval_file is not None else None
        self.target_modules = tuple(self.target_modules)
        problems = []
        if self.adapter not in ADAPTERS:
            problems.append(f"adapter must be one of {', '.join(ADAPTERS)}, not {self.adapter!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            problems.append(f"device must be auto, cpu or cuda, not {self.device!r}")
        for name in ("r", "alpha", "batch_size", "grad_accum", "max_seq_tokens", "log_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1")
        if self.lr <= 0 or self.epochs <= 0 or (self.max_steps is not None and self.max_steps < 1):
            problems.append("lr, epochs and max_steps must be positive")
        if not 0 <= self.dropout < 1:
            problems.append("dropout must be within [0, 1)")
        if not self.target_modules:
            problems.append("target_modules must name at least one module")
        if problems:
            raise ValueError("; ".join(problems))

    def to_json(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v
                for k, v in asdict(self).items()}


@dataclass
class PretrainConfig:
    """Full-parameter next-token pretraining over packed text."""

    seq_len: int = 256
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.1
    epochs: float = 1.0
    max_steps: int | None = None
    warmup_steps: int = 100
    seed: int = 0
    device: str = "auto"
    log_every: int = 50
    checkpoint_every: int = 200
    max_rollbacks: int = 5
    progress: bool = True
    inject_nan_at_step: int | None = None  # test/diagnostic knob, as in TrainConfig


@dataclass
class TrainReport:
    steps: int
    first_loss: float  # mean of the first few steps' losses
    last_loss: float  # mean of the last few steps' losses
    rollbacks: int
    final_lr: float
    seconds: float  # adapters: the whole run, loading and evaluation included
    tokens: int  # non-padding tokens processed
    tokens_per_second: float
    samples: int  # training examples after filtering and resampling
    filtered: int = 0  # samples dropped for being longer than max_seq_tokens
    labels_before: dict[str, int] = field(default_factory=dict)
    labels_after: dict[str, int] = field(default_factory=dict)
    eval: dict[str, Any] | None = None
    device: str = "cpu"
    quantized: bool = False

    def summary(self) -> str:
        lines = [
            (f"steps {self.steps} on {self.device}{' (NF4 base)' if self.quantized else ''} in {self.seconds:.1f}s "
             f"({self.tokens_per_second:,.0f} tokens/s)"),
            (f"loss {self.first_loss:.4f} -> {self.last_loss:.4f}; rollbacks {self.rollbacks}; "
             f"final lr {self.final_lr:.2e}"),
            f"samples {self.samples}; overlong filtered {self.filtered}",
        ]
        if self.labels_before:
            lines.append(f"labels before {self.labels_before}")
            lines.append(f"labels after  {self.labels_after}")
        if self.eval:
            lines.append(f"eval on {self.eval['n']}: valid JSON {self.eval['valid_rate']:.1%}, "
                         f"accuracy {self.eval['accuracy']:.1%}")
        return "\n".join(lines)


class DataError(ValueError):
    """A training file with problems; `problems` lists them as `<file>:<line>: <what>`."""

    def __init__(self, path: Path, problems: list[str]):
        self.path, self.problems = path, problems
        shown = problems[:MAX_LISTED_PROBLEMS]
        more = f"\n... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        super().__init__(f"{path}: {len(problems)} problem(s):\n" + "\n".join(shown) + more)


class TrainingDiverged(RuntimeError):
    """The loss stayed non-finite after the allowed number of rollbacks."""


# -- data -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    prompt: str
    completion: str
    label: str | None
    line: int


def _field_problem(record: dict[str, Any], name: str, required: bool) -> str | None:
    if name not in record:
        return f'field "{name}" is missing' if required else None
    value = record[name]
    if not isinstance(value, str):
        return f'field "{name}" must be a string, not {type(value).__name__}'
    if not value.strip():
        return f'field "{name}" is empty'
    return None


def read_samples(path: Path) -> list[Sample]:
    """Every record of a JSONL file `{"prompt", "completion", "label"?}`; raises DataError listing all problems.

    Lines are decoded one by one, so a bad byte is reported on its own line rather than failing the file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(path, [f"{path}: cannot be read ({exc.strerror or exc})"]) from exc
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the final newline ends the last record; it does not start an empty one
    samples: list[Sample] = []
    problems: list[str] = []
    for number, raw_line in enumerate(lines, start=1):
        where = f"{path}:{number}"
        try:
            text = raw_line.removesuffix(b"\r").decode("utf-8")
        except UnicodeDecodeError as exc:
            problems.append(f"{where}: not valid UTF-8 (bad byte at column {exc.start + 1})")
            continue
        if not text.strip():
            problems.append(f"{where}: empty line")
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            problems.append(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})")
            continue
        if not isinstance(record, dict):
            problems.append(f"{where}: expected a JSON object, got {type(record).__name__}")
            continue
        found = [p for name, required in (("prompt", True), ("completion", True), ("label", False))
                 if (p := _field_problem(record, name, required))]
        problems.extend(f"{where}: {p}" for p in found)
        if not found:
            samples.append(Sample(record["prompt"], record["completion"], record.get("label"), number))
    if not samples and not problems:
        problems.append(f"{path}: no records")
    if problems:
        raise DataError(path, problems)
    return samples


def chat_messages(system_prompt: str, prompt: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": prompt}]


@dataclass(frozen=True)
class Encoded:
    input_ids: list[int]
    labels: list[int]  # IGNORE_INDEX over the prompt, the token ids over the completion and its EOS
    label: str | None


def encode_samples(tokenizer: PreTrainedTokenizerBase, samples: Sequence[Sample], system_prompt: str,
                   chunk: int = 1024) -> list[Encoded]:
    """Token ids exactly as served: the chat template with the generation prompt, then completion + EOS."""
    encoded: list[Encoded] = []
    for start in range(0, len(samples), chunk):
        part = samples[start:start + chunk]
        prompts = tokenizer.apply_chat_template(
            [chat_messages(system_prompt, s.prompt) for s in part], add_generation_prompt=True, tokenize=True,
            return_dict=True, sanitize_control_tokens=True,
        )["input_ids"]
        completions = tokenizer([s.completion for s in part], add_special_tokens=False)["input_ids"]
        for sample, prompt_ids, completion_ids in zip(part, prompts, completions, strict=True):
            target = [*completion_ids, tokenizer.eos_token_id]
            encoded.append(Encoded([*prompt_ids, *target], [IGNORE_INDEX] * len(prompt_ids) + target, sample.label))
    return encoded


def balance_by_label(examples: list[Encoded], seed: int) -> tuple[list[Encoded], dict[str, int], dict[str, int]]:
    """Oversample every label up to the most frequent one's count; returns (examples, counts before, after).

    Each minority label is repeated whole as often as fits, the remainder drawn without replacement, so no
    example is repeated twice more than another of its label. Unlabelled data is returned unchanged."""
    groups: dict[str, list[Encoded]] = {}
    for example in examples:
        groups.setdefault(example.label if example.label is not None else "", []).append(example)
    before = {label: len(group) for label, group in sorted(groups.items())}
    if "" in groups:
        if len(groups) > 1:
            log.warning("%d sample(s) have no label: not balancing by label", len(groups[""]))
        return examples, before, dict(before)
    rng = random.Random(seed)
    target = max(before.values())
    balanced: list[Encoded] = []
    for label in sorted(groups):
        group = groups[label]
        whole, rest = divmod(target, len(group))
        balanced.extend(group * whole)
        balanced.extend(rng.sample(group, rest))
    after = {label: target for label in sorted(groups)}
    return balanced, before, after


def _collate(examples: Sequence[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors: training reads whole sequences, so padding after the text needs no position care."""
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[row, :n] = torch.tensor(e.input_ids)
        labels[row, :n] = torch.tensor(e.labels)
        attention[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def _example_batches(examples: list[Encoded], batch_size: int, pad_id: int,
                     generator: torch.Generator) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches, reshuffled every epoch by the seeded generator."""
    while True:
        order = torch.randperm(len(examples), generator=generator).tolist()
        for start in range(0, len(order), batch_size):
            yield _collate([examples[i] for i in order[start:start + batch_size]], pad_id)


def _block_batches(blocks: torch.Tensor, batch_size: int,
                   generator: torch.Generator) -> Iterator[dict[str, torch.Tensor]]:
    while True:
        order = torch.randperm(len(blocks), generator=generator)
        for start in range(0, len(order), batch_size):
            chunk = blocks[order[start:start + batch_size]]
            yield {"input_ids": chunk, "attention_mask": torch.ones_like(chunk), "labels": chunk}


# -- the shared optimisation loop -------------------------------------------------------------------------------


@dataclass
class _LoopSettings:
    lr: float
    total_steps: int
    grad_accum: int
    warmup_steps: int
    checkpoint_every: int
    log_every: int
    max_rollbacks: int
    inject_nan_at_step: int | None
    progress: bool
    desc: str
    min_lr_ratio: float = 0.1  # cosine decays to this share of the peak, not to zero


@dataclass
class _LoopResult:
    losses: list[float]  # one per applied step
    rollbacks: list[dict[str, Any]]
    tokens: int
    seconds: float
    final_lr: float


def _lr_at(step: int, s: _LoopSettings) -> float:
    """Linear warm-up, then cosine decay; `step` is 1-based."""
    if step <= s.warmup_steps:
        return s.lr * step / s.warmup_steps
    progress = min(1.0, (step - s.warmup_steps) / max(1, s.total_steps - s.warmup_steps))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _copy_value(value: Any) -> Any:
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else copy.deepcopy(value)


class _Snapshot:
    """An in-memory (CPU) copy of the trainable weights and their optimiser state at one step."""

    def __init__(self, step: int, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer):
        self.step = step
        self.weights = [p.detach().to("cpu", copy=True) for p in params]
        self.states = [{k: _copy_value(v) for k, v in optimizer.state.get(p, {}).items()} for p in params]

    def restore(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            for p, saved in zip(params, self.weights, strict=True):
                p.copy_(saved)
        for p, saved in zip(params, self.states, strict=True):
            if not saved:
                optimizer.state.pop(p, None)  # no state yet at the snapshot: the optimiser re-initialises it
                continue
            state = optimizer.state[p]
            for key, value in saved.items():
                current = state.get(key)
                same_shape = isinstance(current, torch.Tensor) and current.shape == getattr(value, "shape", None)
                if isinstance(value, torch.Tensor) and same_shape:
                    current.copy_(value)  # in place: keeps bitsandbytes' paged buffers where they are
                else:
                    state[key] = value.to(p.device) if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _run_loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
              batches: Iterator[dict[str, torch.Tensor]], device: torch.device, s: _LoopSettings) -> _LoopResult:
    """Optimise for `s.total_steps` steps; a non-finite loss or gradient rolls back to the last snapshot.

    After a rollback the learning rate is halved for the rest of the run and the data stream goes on (the
    batches that led to the failure are not replayed). More than `s.max_rollbacks` rollbacks raise."""
    model.train()
    snapshot = _Snapshot(0, params, optimizer)
    losses: list[float] = []
    rollbacks: list[dict[str, Any]] = []
    lr_scale, lr, tokens, smoothed = 1.0, 0.0, 0, float("nan")
    started = time.perf_counter()
    bar = tqdm(total=s.total_steps, desc=s.desc, unit="step", disable=not s.progress, dynamic_ncols=True)
    try:
        for step in range(1, s.total_steps + 1):
            lr = _lr_at(step, s) * lr_scale
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            step_loss, step_tokens, finite = 0.0, 0, True
            for _ in range(s.grad_accum):
                batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
                loss = model(**batch).loss
                if step == s.inject_nan_at_step:
                    loss = loss * float("nan")
                value = loss.item()
                if not math.isfinite(value):
                    finite = False
                    break
                (loss / s.grad_accum).backward()
                step_loss += value / s.grad_accum
                step_tokens += int(batch["attention_mask"].sum())
            if finite:
                finite = math.isfinite(float(torch.nn.utils.clip_grad_norm_(params, CLIP_NORM)))
            if not finite:
                optimizer.zero_grad(set_to_none=True)
                snapshot.restore(params, optimizer)
                lr_scale /= 2
                rollbacks.append({"step": step, "restored_step": snapshot.step, "lr_scale": lr_scale})
                log.warning("non-finite loss or gradient at step %d: rolled back to step %d, learning rate x%g",
                            step, snapshot.step, lr_scale)
                if len(rollbacks) > s.max_rollbacks:
                    raise TrainingDiverged(
                        f"loss still non-finite at step {step} after {s.max_rollbacks} rollbacks "
                        f"(learning rate now x{lr_scale:g}); lower the learning rate or check the data")
                bar.update(1)
                continue
            optimizer.step()
            losses.append(step_loss)
            tokens += step_tokens
            smoothed = step_loss if math.isnan(smoothed) else 0.9 * smoothed + 0.1 * step_loss
            if step % s.checkpoint_every == 0:
                snapshot = _Snapshot(step, params, optimizer)
            bar.set_postfix(loss=f"{smoothed:.4f}", lr=f"{lr:.2e}", refresh=False)
            bar.update(1)
            if step % s.log_every == 0 or step == s.total_steps:
                elapsed = time.perf_counter() - started
                log.info("%s step %d/%d loss %.4f lr %.2e %.0f tokens/s", s.desc, step, s.total_steps,
                         smoothed, lr, tokens / max(elapsed, 1e-9))
    finally:
        bar.close()
    return _LoopResult(losses, rollbacks, tokens, time.perf_counter() - started, lr)


def _window_means(losses: list[float]) -> tuple[float, float]:
    if not losses:
        return float("nan"), float("nan")
    window = max(1, min(20, len(losses) // 5))
    return sum(losses[:window]) / window, sum(losses[-window:]) / window


def _report(result: _LoopResult, steps: int, samples: int, device: str, **extra: Any) -> TrainReport:
    first, last = _window_means(result.losses)
    return TrainReport(
        steps=steps, first_loss=first, last_loss=last, rollbacks=len(result.rollbacks), final_lr=result.final_lr,
        seconds=result.seconds, tokens=result.tokens,
        tokens_per_second=result.tokens / max(result.seconds, 1e-9), samples=samples, device=device, **extra,
    )


def _seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    return torch.Generator().manual_seed(seed)


# -- full-parameter pretraining ---------------------------------------------------------------------------------


def pack_texts(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], seq_len: int) -> torch.Tensor:
    """All texts, each ended by EOS, concatenated and cut into (n_blocks, seq_len) blocks (the tail is dropped)."""
    ids: list[int] = []
    for start in range(0, len(texts), 4096):
        for row in tokenizer(list(texts[start:start + 4096]), add_special_tokens=False)["input_ids"]:
            ids.extend(row)
            ids.append(tokenizer.eos_token_id)
    n_blocks = len(ids) // seq_len
    if n_blocks == 0:
        raise ValueError(f"the texts hold {len(ids)} tokens, fewer than one block of {seq_len}")
    return torch.tensor(ids[:n_blocks * seq_len], dtype=torch.long).view(n_blocks, seq_len)


def pretrain_base(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: Sequence[str],
                  config: PretrainConfig) -> TrainReport:
    """Train every weight of `model` in place on next-token prediction over `texts`, packed into blocks.

    Full precision (TF32 matmuls on CUDA): the model is small, so speed is bound by kernel launches, not math."""
    device = resolve_device(config.device)
    generator = _seed_everything(config.seed)
    blocks = pack_texts(tokenizer, texts, config.seq_len)
    total = config.max_steps or math.ceil(config.epochs * len(blocks) / config.batch_size)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]  # no weight decay on norms
    rest = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=config.lr, betas=(0.9, 0.95), fused=device == "cuda",
    )
    log.info("pretraining %.2fM parameters on %s: %d blocks of %d tokens, %d steps of %d blocks",
             sum(p.numel() for p in params) / 1e6, device, len(blocks), config.seq_len, total, config.batch_size)
    settings = _LoopSettings(
        lr=config.lr, total_steps=total, grad_accum=1, warmup_steps=min(config.warmup_steps, max(1, total // 10)),
        checkpoint_every=config.checkpoint_every, log_every=config.log_every, max_rollbacks=config.max_rollbacks,
        inject_nan_at_step=config.inject_nan_at_step, progress=config.progress, desc="pretrain",
    )
    result = _run_loop(model, optimizer, params, _block_batches(blocks, config.batch_size, generator),
                       torch.device(device), settings)
    model.eval()
    return _report(result, total, len(blocks), device)


# -- adapters ---------------------------------------------------------------------------------------------------


def _load_trainable_base(path: Path, device: str, gradient_checkpointing: bool) -> PreTrainedModel:
    if device == "cpu":
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float16,
    )
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, dtype=torch.float16,
                                                 device_map={"": 0})
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)


def _optimizer(params: list[torch.nn.Parameter], device: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    if device == "cpu":
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
    generator = _seed_everything(config.seed)

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

    model = _load_trainable_base(config.base_model, device, config.gradient_checkpointing)
    quantized = device == "cuda"
    lora = LoraConfig(r=config.r, lora_alpha=config.alpha, lora_dropout=config.dropout,
                      target_modules=list(config.target_modules), task_type="CAUSAL_LM")
    torch.manual_seed(config.seed)  # LoRA A's initialisation
    model = get_peft_model(model, lora)  # adapter "default": PEFT saves it at the top level
    if device == "cpu":
        model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = _optimizer(params, device, config.lr, config.weight_decay)
    per_step = config.batch_size * config.grad_accum
    total = config.max_steps or math.ceil(config.epochs * len(examples) / per_step)
    log.info("training %s adapter (r=%d, alpha=%d, %s; %d trainable parameters) on %s: %d examples, %d steps",
             config.adapter, config.r, config.alpha, ",".join(config.target_modules),
             sum(p.numel() for p in params), device, len(examples), total)
    settings = _LoopSettings(
        lr=config.lr, total_steps=total, grad_accum=config.grad_accum,
        warmup_steps=min(config.warmup_steps, max(1, total // 10)), checkpoint_every=config.checkpoint_every,
        log_every=config.log_every, max_rollbacks=config.max_rollbacks,
        inject_nan_at_step=config.inject_nan_at_step, progress=config.progress, desc=f"train {config.adapter}",
    )
    batches = _example_batches(examples, config.batch_size, tokenizer.pad_token_id, generator)
    run_on = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")  # where device_map put the base
    result = _run_loop(model, optimizer, params, batches, run_on, settings)
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

    report = _report(result, total, len(examples), device, filtered=filtered, labels_before=before,
                     labels_after=after, eval=scores, quantized=quantized)
    report.seconds = time.perf_counter() - started  # the whole run, loading and evaluation included
    _save_adapter(model, config.output_dir)
    record = {
        "config": config.to_json(), "report": asdict(report), "losses": result.losses,
        "rollbacks": result.rollbacks, "train_seconds": result.seconds,
        "versions": {"torch": torch.__version__, "transformers": _version("transformers"), "peft": _version("peft")},
    }
    (config.output_dir / "training.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    write_manifest(config.output_dir)  # last: it covers every file written above
    return report


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


# -- decision scoring -------------------------------------------------------------------------------------------


def score_decisions(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, samples: Sequence[Sample],
                    system_prompt: str, *, max_new_tokens: int, batch_size: int = 64) -> dict[str, Any]:
    """Greedy answers to labelled samples: the share that parse as a decision and the share that match the label.

    A quick check for training runs, batched with left padding through plain `generate`; the evaluation
    harness measures the served models in depth."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    tokenizer.padding_side = "left"
    valid = correct = 0
    try:
        for start in range(0, len(samples), batch_size):
            part = samples[start:start + batch_size]
            encoded = tokenizer.apply_chat_template(
                [chat_messages(system_prompt, s.prompt) for s in part], add_generation_prompt=True, tokenize=True,
                return_dict=True, padding=True, return_tensors="pt", sanitize_control_tokens=True,
            ).to(device)
            with torch.inference_mode():
                output = model.generate(
                    input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"], do_sample=False,
                    max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                )
            texts = tokenizer.batch_decode(output[:, encoded["input_ids"].shape[1]:], skip_special_tokens=True)
            for sample, text in zip(part, texts, strict=True):
                decision = parse_decision(text)
                valid += decision is not None
                correct += decision is not None and decision["decision"] == sample.label
    finally:
        model.train(was_training)
    n = len(samples)
    return {"n": n, "valid_rate": valid / n if n else 0.0, "accuracy": correct / n if n else 0.0}
