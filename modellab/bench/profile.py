"""How busy the GPU is during decode, from the PyTorch profiler: CUDA kernel time over wall time.

Prefill is taken out by profiling the same requests twice, once generating one token (prefill only) and
once generating all of them: decode busy = (kernels_all - kernels_one) / (wall_all - wall_one). Each run is
repeated and its least time kept: a difference of two single runs turns a stall in the one-token run into a
decode that looks faster than its own kernels (a busy fraction over 100 %)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from worker.generation import GenerationRequest

Run = Callable[[list[GenerationRequest]], object]  # runs requests to the end: run_batch, or a decoder's run


def _kernels_and_wall(run: Run, requests: list[GenerationRequest]) -> tuple[float, float]:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        started = time.perf_counter()
        run(requests)
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        raise RuntimeError("the profiler recorded no CUDA kernels; the busy fraction cannot be measured")
    return sum(e.time_range.elapsed_us() for e in kernels) / 1e6, wall


def _unprofiled(run: Run, requests: list[GenerationRequest]) -> tuple[float, float]:
    """Wall seconds of `run` without the profiler, and the seconds the host spent inside CUDA graph replays (the
    launch of a captured step: its cost grows with the graph's kernels)."""
    replay, in_replay = torch.cuda.CUDAGraph.replay, [0.0]

    def timed(graph: torch.cuda.CUDAGraph) -> None:
        started = time.perf_counter()
        replay(graph)
        in_replay[0] += time.perf_counter() - started

    torch.cuda.synchronize()
    torch.cuda.CUDAGraph.replay = timed
    try:
        started = time.perf_counter()
        run(requests)
        torch.cuda.synchronize()
        return time.perf_counter() - started, in_replay[0]
    finally:
        torch.cuda.CUDAGraph.replay = replay


def decode_busy_fraction(run: Run, device: str, requests: list[GenerationRequest], steps: int = 16,
                         repeats: int = 3) -> dict[str, float] | None:
    """GPU busy fraction of `steps` decode steps of `requests` run together by `run`; None off CUDA.

    Every decode step of a batch does the same work, so a few steps stand for all of them (the profiler's
    bookkeeping would otherwise cost more than the run). The one-token and the whole runs alternate, `repeats`
    times each, so that a drift of the machine's speed reaches both."""
    if device != "cuda":
        return None
    requests = [dataclasses.replace(r, max_new_tokens=steps + 1) for r in requests]
    prefill_only = [dataclasses.replace(r, max_new_tokens=1) for r in requests]
    run(requests)  # warm-up, of both runs: a cold one-token run would make decode look faster than it is
    run(prefill_only)
    profiled = [(_kernels_and_wall(run, prefill_only), _kernels_and_wall(run, requests)) for _ in range(repeats)]
    plain = [(_unprofiled(run, prefill_only), _unprofiled(run, requests)) for _ in range(repeats)]
    return {"rows": len(requests), **decode_figures(profiled, plain, steps)}


def decode_figures(profiled: list[tuple[tuple[float, float], tuple[float, float]]],
                   plain: list[tuple[tuple[float, float], tuple[float, float]]], steps: int) -> dict[str, float]:
    """The figures of `decode_busy_fraction` from repeated runs: `profiled`, ((kernel s, wall s) of the one-token
    run, the same of the whole run) per repeat; `plain`, ((wall s, replay s) of each) without the profiler. Each
    quantity is its least over the repeats: a run is only ever slowed down."""
    def least(runs: tuple[tuple[float, float], ...]) -> tuple[float, float]:
        return min(first for first, _ in runs), min(second for _, second in runs)

    one, whole = zip(*profiled)
    (kernels_one, wall_one), (kernels_all, wall_all) = least(one), least(whole)
    decode_wall, decode_kernels = wall_all - wall_one, kernels_all - kernels_one
    plain_one_runs, plain_whole_runs = zip(*plain)
    (plain_one, replay_one), (plain_all, replay_all) = least(plain_one_runs), least(plain_whole_runs)
    return {
        "busy_fraction": decode_kernels / decode_wall,
        "step_ms": decode_wall / steps * 1000,
        "kernel_ms_per_step": decode_kernels / steps * 1000,
        # the same steps with no profiler attached, and the host's time launching each captured step
        "step_ms_unprofiled": (plain_all - plain_one) / steps * 1000,
        "replay_launch_ms_per_step": (replay_all - replay_one) / steps * 1000,
        # the prefill of every row (and its first token), without the profiler, and its kernel time
        "prefill_ms_unprofiled": plain_one * 1000,
        "prefill_kernel_ms": kernels_one * 1000,
    }
