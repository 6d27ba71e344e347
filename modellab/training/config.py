"""Training configuration (`TrainConfig`, `PretrainConfig`) and the report a run returns. Presets: `modellab/presets.py`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from modellab.presets import LORA_PRESETS
from shared.base_match import BASE_RECORD
from shared.manifest import MANIFEST_NAME
from shared.settings import ADAPTERS

IGNORE_INDEX = -100  # label value the loss skips (prompt and padding tokens)
CLIP_NORM = 1.0
MAX_LISTED_PROBLEMS = 50
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
OUTPUT_FILES = frozenset({*ADAPTER_FILES, "training.json", BASE_RECORD, MANIFEST_NAME})


@dataclass
class TrainConfig:
    """One adapter training run. `modellab.presets.preset(adapter)` gives r, alpha, lr and the system prompt."""

    base_model: Path
    data_file: Path
    output_dir: Path
    adapter: str
    system_prompt: str
    r: int = LORA_PRESETS["kev"].r  # the defaults are Kev's preset
    alpha: int = LORA_PRESETS["kev"].alpha
    dropout: float = 0.05
    lr: float = LORA_PRESETS["kev"].lr
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
    quantization: str = "auto"  # on CUDA: "auto"/"nf4" trains on an NF4 base (QLoRA), "none" on the full-precision one
    save_dtype: str = "float32"  # the adapter's weights as written: "float16" halves the file
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
