"""The optimisation loop shared by pretraining and adapters: clipping, NaN/Inf rollback, progress bar."""

from __future__ import annotations

import copy
import logging
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from modellab.training.config import CLIP_NORM, IGNORE_INDEX, TrainingDiverged, TrainReport

log = logging.getLogger("kevlaya.training")


@dataclass
class LoopSettings:
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


def _lr_at(step: int, s: LoopSettings) -> float:
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


def completion_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The causal LM loss (mean over labelled tokens, as the model's own), with the vocabulary projection applied
    only to the positions that predict a label. An adapter sample's prompt is most of its tokens: projecting every
    position onto a 49k vocabulary made the logits the largest tensor of a step (8 GiB at 64 rows of 700)."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PeftModel, or the model
    hidden = causal_lm.get_decoder()(input_ids=batch["input_ids"],
                                     attention_mask=batch["attention_mask"]).last_hidden_state
    targets = batch["labels"][:, 1:]
    predicting = targets != IGNORE_INDEX
    logits = causal_lm.get_output_embeddings()(hidden[:, :-1][predicting])
    return torch.nn.functional.cross_entropy(logits.float(), targets[predicting])


def run_loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
              batches: Iterator[dict[str, torch.Tensor]], device: torch.device, s: LoopSettings) -> _LoopResult:
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
                # bf16 matmuls on CUDA: 135M-parameter training in fp32 left the card mostly idle
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                    loss = completion_loss(model, batch)
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


def make_report(result: _LoopResult, steps: int, samples: int, device: str, **extra: Any) -> TrainReport:
    first, last = _window_means(result.losses)
    return TrainReport(
        steps=steps, first_loss=first, last_loss=last, rollbacks=len(result.rollbacks), final_lr=result.final_lr,
        seconds=result.seconds, tokens=result.tokens,
        tokens_per_second=result.tokens / max(result.seconds, 1e-9), samples=samples, device=device, **extra,
    )


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    return torch.Generator().manual_seed(seed)
