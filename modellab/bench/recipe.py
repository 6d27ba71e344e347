"""The recipe's scheme, the baseline every speed claim is measured against: one job at a time on the same NF4
base with both PEFT adapters loaded, `set_adapter` then `generate`, nothing batched."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from modellab.bench.workload import BenchJob
from modellab.reference import ReferenceRuntime


def _synchronize(runtime: ReferenceRuntime) -> None:
    if runtime.device == "cuda":
        torch.cuda.synchronize()


def run_job(runtime: ReferenceRuntime, job: BenchJob) -> float:
    """Seconds for one job: switch to its adapter, generate exactly its tokens (greedy)."""
    _synchronize(runtime)
    started = time.perf_counter()
    runtime.model.set_adapter(job.adapter)
    encoded = runtime.tokenizer.apply_chat_template(
        job.messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
    ).to(runtime.model.device)
    with torch.inference_mode():
        runtime.model.generate(**encoded, max_new_tokens=job.max_new_tokens, min_new_tokens=job.max_new_tokens,
                               do_sample=False, pad_token_id=runtime.pad_id)
    _synchronize(runtime)
    return time.perf_counter() - started


def time_recipe(runtime: ReferenceRuntime, jobs: list[BenchJob], per_adapter: int) -> dict[str, Any]:
    """Time the first `per_adapter` jobs of each adapter, then scale to the whole workload: one job at a time
    takes the same time whatever else is queued, so the mean per adapter is all that matters."""
    run_job(runtime, jobs[0])  # warm-up: first-call allocations and kernel selection are not the scheme's cost
    seconds: dict[str, list[float]] = {}
    for job in jobs:
        if len(seconds.setdefault(job.adapter, [])) < per_adapter:
            seconds[job.adapter].append(run_job(runtime, job))
    mean = {adapter: statistics.fmean(values) for adapter, values in seconds.items()}
    total = sum(mean[job.adapter] for job in jobs)
    return {
        "jobs_per_s": len(jobs) / total,
        "scaled_total_s": total,
        "timed_jobs": sum(len(v) for v in seconds.values()),
        "mean_job_s": mean,
        "method": f"timed {per_adapter} job(s) per adapter one at a time (set_adapter + generate, batch 1), "
                  f"scaled to the {len(jobs)}-job workload by each adapter's mean",
    }
