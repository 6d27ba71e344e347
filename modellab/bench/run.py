"""The benchmark's phases, in order: build the model, time the recipe's scheme and profile the decoder in this
process, then drive the whole service (throughput, Laya latency idle and under Kev load, growing-load fit), so
the recipe and the service are compared within one run."""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import os
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from modellab.bench.census import kernel_census
from modellab.bench.load import percentile
from modellab.bench.pairs import DEFAULT_PAIRS, PAIRS, SAME_KERNEL_PAIRS
from modellab.bench.peer import peer_phase
from modellab.bench.profile import decode_busy_fraction
from modellab.bench.recipe import time_recipe
from modellab.bench.service import BatchRow, JobRow, Service
from modellab.bench.stream_phase import stream_pairs
from modellab.bench.workload import BenchJob, make_jobs
from modellab.model_factory import build_random_model
from modellab.presets import ALL_LINEAR
from modellab.reference import ReferenceRuntime
from shared.schemas import answer_grammar
from shared.settings import Settings
from worker.decoder.options import DecoderOptions
from worker.generation import GenerationRequest
from worker.model.loading import resolve_device

log = logging.getLogger("kevlaya.bench")

# The DecoderOptions fields each A/B pair changes on the served decoder (modellab/bench/pairs.py says what each is).
PAIR_OPTIONS: dict[str, dict[str, Any]] = {
    "lora_fp32": {"lora_dtype": torch.float32},
    "unfused": {"fused_projections": False},
    "unfused_norms": {"fused_norms": False},
    "unfused_rotary": {"fused_rotary": False},
    "unfused_lora": {"fused_lora": False},
    "whole_window": {"column_buckets": 1},
    "bitsandbytes_nf4": {"nf4_kernel": False},
    "eager_prefill": {"static_prefill": False},
    "step_by_step": {"launch_ahead": False},
}


@dataclass
class BenchConfig:
    shape: str
    workdir: Path
    device: str = "auto"
    vram_budget_gb: float = 5.5
    seed: int = 0
    jobs: int = 64
    prompt_tokens: tuple[int, int] = (200, 256)
    new_tokens: dict[str, int] = field(default_factory=lambda: {"kev": 128, "laya": 32})
    recipe_per_adapter: int = 2
    latency_samples: int = 8
    fit_loads: tuple[int, ...] = ()
    max_batch: int = 16
    redis_url: str | None = None
    cuda_graphs: bool = True  # capture the decode step on CUDA
    kv_dtype: str = "auto"  # KEVLAYA_ENGINE__KV_DTYPE: the key/value cache's storage, the compute dtype or fp8
    window_tokens: int | None = None  # KEVLAYA_ENGINE__WINDOW_TOKENS; None: the service's default
    prefill_tokens: int | None = None  # KEVLAYA_ENGINE__PREFILL_TOKENS; None: the service's default
    prefill_between_steps: bool = True  # KEVLAYA_ENGINE__PREFILL_BETWEEN_STEPS
    lora_targets: tuple[str, ...] = ALL_LINEAR  # the layers the random adapters cover (the demo model: every one)
    peer: bool = True  # time transformers' continuous batching on the same model and jobs
    census: bool = True  # the kernel census of the decode step and, on CUDA, the A/B pairs
    pairs: tuple[str, ...] = DEFAULT_PAIRS  # which A/B pairs (PAIRS)
    pair_rounds: int = 4  # runs of each side of the grammar and streaming comparisons, alternately
    stream_jobs: int = 32  # Kev jobs run with no client and with an SSE client each (0: no streaming phase)


def _seconds(rows: list[JobRow]) -> float:
    """From the first job's creation to the last one's end; at least from the first start, which the worker
    stamped as it did the ends: creation is the API's reading of the database's clock, which may lie a little
    after the worker's (shared/clock.py), and a short run could otherwise come out negative."""
    end = max(r.finished_at for r in rows)
    return max(end - min(r.created_at for r in rows), end - min(r.started_at or end for r in rows)).total_seconds()


def most_in_flight(rows: list[JobRow]) -> int:
    """The most jobs running at one moment, from their start and finish times (a continuous engine's job starts
    when it takes a slot)."""
    events = sorted([(r.started_at, 1) for r in rows if r.started_at and r.finished_at]
                    + [(r.finished_at, -1) for r in rows if r.started_at and r.finished_at])  # ends before starts
    running = most = 0
    for _, change in events:
        running += change
        most = max(most, running)
    return most


def group_figures(groups: list[BatchRow], rows: list[JobRow]) -> dict[str, Any]:
    """What the worker did for `rows`: claim groups (jobs claimed together), memory, out-of-memory failures."""
    peaks = [b.peak_vram_bytes for b in groups if b.peak_vram_bytes is not None]
    return {
        "claim_groups": len(groups),
        "mean_group_size": statistics.fmean(b.size for b in groups) if groups else 0.0,
        "peak_allocated_gib": max(peaks) / 2**30 if peaks else None,
        "most_in_flight": most_in_flight(rows),
        "oom_events": sum(r.error_code == "out_of_memory" for r in rows),
        "failed_jobs": sum(r.status != "succeeded" for r in rows),
    }


def _requests(jobs: list[BenchJob]) -> list[GenerationRequest]:
    import uuid

    return [GenerationRequest(job_id=uuid.uuid4(), adapter=j.adapter, messages=j.messages,
                              max_new_tokens=j.max_new_tokens, temperature=0.0, top_p=1.0, seed=None) for j in jobs]


def _decoder_phase(runtime: ReferenceRuntime, settings: Settings, config: BenchConfig,
                   kev: list[GenerationRequest]) -> dict[str, Any]:
    """The slot decoder alone on a full Kev batch, built as the worker builds it: GPU busy share, step and prefill
    time (captured, as served), the same under the decision grammar, the A/B pairs of `config.pairs` (CUDA;
    modellab/bench/pairs.py), and a kernel census of eager steps of each that changes the step."""
    from worker.decoder.slot_decoder import SlotDecoder
    from worker.engine.build import build_decoder, decoder_options
    from worker.engine.offline import run_to_end

    settings = settings.updated(engine={"cuda_graphs": config.cuda_graphs})
    budget = settings.engine.prefill_tokens
    decoder = build_decoder(runtime.loaded, settings)
    try:
        run = functools.partial(run_to_end, decoder, prefill_tokens=budget)
        profile = decode_busy_fraction(run, runtime.device, kev)
        window = decoder.window
        if profile is not None:
            # The same rows under the decision grammar: masks computed while the GPU runs leave its busy share be.
            constrained = [dataclasses.replace(r, grammar=answer_grammar({"output": "decision"}, r.messages, True))
                           for r in kev]
            profile["decision_grammar"] = decode_busy_fraction(run, runtime.device, constrained)
    finally:
        decoder.close()
        del decoder
        _free_cache()  # its key/value block and graphs, before the pairs' decoders are built
    figures: dict[str, Any] = {"profile": profile}
    if not config.census:
        return figures
    loaded = runtime.loaded
    served = dataclasses.replace(decoder_options(settings, runtime.device), texts=False)  # as build_decoder's
    # Captured steps first, each pair and the served step again after them, then the censuses: the profiler's
    # Python tracing is the dearest thing here and nothing timed runs after it.
    variants: dict[str, tuple[DecoderOptions, int, Callable[..., Any]]] = {}  # options, prefill budget, measure
    if runtime.device == "cuda":
        for pair in config.pairs:
            # lora_fp32: one prompt per prefill, since a full group's fp32 products do not fit under the cap
            variants[pair] = (dataclasses.replace(served, **PAIR_OPTIONS[pair]),
                              window if pair == "lora_fp32" else budget, decode_busy_fraction)
        variants["profile_again"] = (served, budget, decode_busy_fraction)
    eager = dataclasses.replace(served, graphs=False)  # a census counts the kernels of eager decode steps
    variants["census"] = (eager, budget, kernel_census)
    if runtime.device == "cuda":
        for pair in config.pairs:
            if pair not in SAME_KERNEL_PAIRS:
                variants[f"census_{pair}"] = (dataclasses.replace(eager, **PAIR_OPTIONS[pair]), budget, kernel_census)
    for name, (options, prefill_tokens, measure) in variants.items():
        # as many slots as rows: the fp32 products need more memory than the sizing left spare under the cap
        decoder = SlotDecoder(loaded.model, loaded.tokenizer, sorted(loaded.adapters), slots=len(kev), window=window,
                              eos_ids=loaded.eos_ids, options=options)
        try:
            run = functools.partial(run_to_end, decoder, prefill_tokens=prefill_tokens)
            figures[name] = _recorded(name, functools.partial(measure, run, runtime.device, kev))
        finally:
            decoder.close()
            del decoder
        _free_cache()
    return figures


def _recorded(name: str, measure: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
    """A comparison's figures, or the error that stopped it: the run's own figures do not depend on it, and a run
    on a lent GPU is too dear to lose to one."""
    try:
        return measure()
    except Exception as exc:
        log.exception("%s failed; the run goes on without it", name)
        return {"error": f"{type(exc).__name__}: {exc}"}


def _free_cache() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def runtime_phase(config: BenchConfig, settings: Settings, jobs: list[BenchJob]) -> dict[str, Any]:
    """The recipe's scheme, the peer and the profiler, in this process, on the model the worker also loads: batch
    1 through `generate` for the recipe, transformers' continuous batching for the peer, a full Kev batch through
    the slot decoder, as the worker builds it."""
    runtime = ReferenceRuntime.load(settings)
    try:
        recipe = time_recipe(runtime, jobs, config.recipe_per_adapter)
        log.info("recipe's scheme: %.3f jobs/s (%s)", recipe["jobs_per_s"], recipe["method"])
        kev = _requests([j for j in jobs if j.adapter == "kev"][:config.max_batch])
        recipe["profile"] = decode_busy_fraction(runtime.run_batch, runtime.device, kev[:1])
        peer = _recorded("peer", functools.partial(peer_phase, runtime, jobs)) if config.peer else None
        if peer and "jobs_per_s" in peer:
            log.info("peer (transformers' continuous batching): %.3f jobs/s", peer["jobs_per_s"])
        _free_cache()
        decoder = _decoder_phase(runtime, settings, config, kev)
        log.info("GPU busy during decode: batch 1 %s; %d Kev rows %s", recipe["profile"], len(kev),
                 decoder["profile"])
    finally:
        del runtime
        _free_cache()
    return {"recipe": recipe, "peer": peer, **decoder}


class KevLoad:
    """Keeps the worker busy: tops the queue up with Kev jobs so at least `depth` are always unfinished."""

    def __init__(self, service: Service, job: BenchJob, depth: int):
        self.service, self.job, self.depth = service, job, depth
        self.ids: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._feed, name="kev-load", daemon=True)

    def __enter__(self) -> KevLoad:
        self.ids += self.service.submit([self.job.body()] * self.depth)
        self._thread.start()
        return self

    def _feed(self) -> None:
        while not self._stop.wait(0.5):
            missing = self.depth - self.service.pending(self.ids)
            if missing > 0:
                self.ids += self.service.submit([self.job.body()] * missing)

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for job_id in self.ids:  # what never started is cancelled, so the next phase starts on an idle worker
            self.service.client.post(f"/v1/jobs/{job_id}/cancel")  # 409 for the others: they stay
        self.service.wait(self.ids)


def laya_latencies(service: Service, jobs: list[BenchJob], rng: random.Random, figures: dict[str, Any],
                   when: str) -> None:
    """Laya jobs one at a time (each submitted after the previous finished, after a short random pause); their
    end-to-end p50 / p95, each one's queue wait (submission to claim) and time to first token, and the time each of
    its later tokens took (what a step shared with Kev rows costs it) go in `figures`."""
    rows = []
    for job in jobs:
        time.sleep(rng.uniform(0.2, 1.0))
        [row] = service.wait([service.submit_one(job.body())])
        if row.status != "succeeded":
            raise RuntimeError(f"a Laya latency job failed: {row.error_code}")
        rows.append(row)
    latencies = [row.total_ms for row in rows]
    figures.update({f"laya_p50_ms_{when}": percentile(latencies, 50), f"laya_p95_ms_{when}": percentile(latencies, 95),
                    f"laya_ms_{when}": latencies, f"laya_queue_ms_{when}": [row.queue_ms for row in rows],
                    f"laya_ttft_ms_{when}": [row.ttft_ms for row in rows],
                    f"laya_ms_per_later_token_{when}": [(row.total_ms - row.ttft_ms) / (row.completion_tokens - 1)
                                                        for row in rows if row.completion_tokens > 1]})


def engine_phases(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Where the continuous engine's time went between two readings of its phase totals: per phase, how often,
    the mean milliseconds and the total seconds."""
    figures = {}
    for phase, (count, seconds) in after.items():
        count, seconds = count - before.get(phase, (0, 0))[0], seconds - before.get(phase, (0, 0))[1]
        figures[phase] = {"count": int(count), "mean_ms": seconds * 1000 / count if count and seconds else None,
                          "total_s": seconds}
    return figures


def _memory(service: Service, since: datetime) -> list[dict[str, Any]]:
    return [{"t_s": (b.started_at - since).total_seconds(), "peak_allocated_gib": b.peak_vram_bytes / 2**30,
             "size": b.size, "adapters": b.adapters}
            for b in service.batches(since=since) if b.peak_vram_bytes is not None]


GRAMMAR_RUNS: dict[str, Callable[[BenchJob], dict[str, Any]]] = {
    "text": BenchJob.body, "decision": lambda job: job.body("decision"),
    "text_beside_tools": BenchJob.body_beside_tools, "tool_calls": lambda job: job.body("tool_calls")}


def grammar_pairs(service: Service, jobs: list[BenchJob], rounds: int = 2) -> dict[str, dict[str, Any]]:
    """The workload again, free and with every row under the decision grammar; then free and with every row forced
    to call the workload's tool, from the same prompt (the tools in it); in turn, `rounds` of each, so a warm-up or
    a drift favours none. Lengths stay exact: a completed grammar starts over while end-of-sequence is ignored.
    Random weights close few decision objects or calls in that time, so most constrained jobs end `length`."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in GRAMMAR_RUNS}
    for _ in range(rounds):
        for name, body in GRAMMAR_RUNS.items():
            phases = service.engine_phases()
            rows = service.wait(service.submit([body(j) for j in jobs]))
            runs[name].append({"jobs_per_s": len(rows) / _seconds(rows),
                               "step_ms": engine_phases(phases, service.engine_phases())["step"]["mean_ms"],
                               "length_failures": sum(r.error_code == "length" for r in rows)})
    mean = {name: {key: statistics.fmean(run[key] for run in done) for key in ("jobs_per_s", "step_ms")}
            for name, done in runs.items()}
    return {pair: {"free": mean[free], "grammar": mean[constrained],
                   "runs": {free: runs[free], constrained: runs[constrained]},
                   "jobs_per_s_vs_free": mean[constrained]["jobs_per_s"] / mean[free]["jobs_per_s"],
                   "step_ms_vs_free": mean[constrained]["step_ms"] / mean[free]["step_ms"]}
            for pair, free, constrained in (("decision_grammar", "text", "decision"),
                                            ("tool_call_grammar", "text_beside_tools", "tool_calls"))}


def service_phase(config: BenchConfig, env: dict[str, str], jobs: list[BenchJob], laya_jobs: list[BenchJob],
                  fit_jobs: dict[int, list[BenchJob]], figures: dict[str, Any], save: Callable[[], None],
                  stream_jobs: list[BenchJob] | None = None) -> None:
    """Fills `figures` phase by phase and calls `save` after each, so a run cut short keeps what it measured."""
    rng = random.Random(config.seed)
    env = {**env, "KEVLAYA_ENGINE__CUDA_GRAPHS": str(config.cuda_graphs).lower()}
    with Service(config.workdir / "service", env, config.redis_url) as service:
        service.wait(service.submit([jobs[0].body(), jobs[1].body()]))  # warm-up, as the recipe had
        started = service.batches()[-1].started_at
        phases = service.engine_phases()
        rows = service.wait(service.submit([j.body() for j in jobs]))
        groups = [b for b in service.batches(since=started) if b.id in {r.batch_id for r in rows}]
        figures.update(jobs_per_s=len(rows) / _seconds(rows), **group_figures(groups, rows),
                       memory_over_time=_memory(service, started),
                       engine_phases=engine_phases(phases, service.engine_phases()))
        figures["slots"] = service.worker_status().get("slots")  # as the worker sized them at start
        log.info("service: %.3f jobs/s, %d claim groups", figures["jobs_per_s"], len(groups))
        save()

        figures.update(grammar_pairs(service, jobs, config.pair_rounds))
        log.info("service under the decision grammar: %s; forced to call a tool: %s",
                 figures["decision_grammar"], figures["tool_call_grammar"])
        save()

        if stream_jobs:
            figures["streaming"] = stream_pairs(service, stream_jobs, config.pair_rounds)
            log.info("service streaming to SSE clients: %s", {k: v for k, v in figures["streaming"].items()
                                                              if k not in ("runs", "first_delta_method")})
            save()

        laya_latencies(service, laya_jobs, rng, figures, "idle")
        save()
        kev = next(j for j in jobs if j.adapter == "kev")
        with KevLoad(service, kev, depth=2 * config.max_batch):
            time.sleep(2.0)  # let the first Kev rows start
            phases = service.engine_phases()
            laya_latencies(service, laya_jobs, rng, figures, "under_kev_load")
            figures["engine_phases_under_kev_load"] = engine_phases(phases, service.engine_phases())
            save()

        figures["fit"] = []
        for load, load_jobs in fit_jobs.items():
            since = service.batches()[-1].started_at
            fit_rows = service.wait(service.submit([j.body() for j in load_jobs]))
            fit_groups = [b for b in service.batches(since=since) if b.id in {r.batch_id for r in fit_rows}]
            figures["fit"].append({"load": load, "jobs_per_s": len(fit_rows) / _seconds(fit_rows),
                                   **group_figures(fit_groups, fit_rows)})
            log.info("fit at load %d: %s", load, figures["fit"][-1])
            save()
        figures["memory_over_time"] = _memory(service, started)


def run_bench(config: BenchConfig, save: Callable[[dict[str, Any]], None] = lambda _result: None) -> dict[str, Any]:
    """The whole benchmark; `save` gets the result so far after every phase (`complete` is False until the end)."""
    device = resolve_device(config.device)
    started = time.perf_counter()
    model_dir = config.workdir / "model"
    dtype = torch.float16 if device == "cuda" else torch.float32
    paths = build_random_model(model_dir, config.shape, seed=config.seed, dtype=dtype, device=device,
                               target_modules=config.lora_targets)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    log.info("built a random-weight %s model in %.1fs", config.shape, time.perf_counter() - started)

    env = {"KEVLAYA_MODEL__BASE": str(paths["base"]), "KEVLAYA_KEV__PATH": str(paths["kev"]),
           "KEVLAYA_LAYA__PATH": str(paths["laya"]), "KEVLAYA_MODEL__DEVICE": device,
           "KEVLAYA_ENGINE__VRAM_BUDGET_GB": str(config.vram_budget_gb), "KEVLAYA_ENGINE__IGNORE_EOS": "true",
           "KEVLAYA_ENGINE__MAX_BATCH": str(config.max_batch), "KEVLAYA_ENGINE__KV_DTYPE": config.kv_dtype,
           # random weights from this run: hashing gigabytes again would only slow the start
           "KEVLAYA_MODEL__VERIFY_MANIFESTS": "false"}
    window = {} if config.window_tokens is None else {"window_tokens": config.window_tokens}
    if window:
        env["KEVLAYA_ENGINE__WINDOW_TOKENS"] = str(config.window_tokens)
    if config.prefill_tokens is not None:
        env["KEVLAYA_ENGINE__PREFILL_TOKENS"] = str(config.prefill_tokens)
    env["KEVLAYA_ENGINE__PREFILL_BETWEEN_STEPS"] = str(config.prefill_between_steps).lower()
    settings = Settings(_env_file=None,
                        model={"base": env["KEVLAYA_MODEL__BASE"], "device": device, "verify_manifests": False},
                        kev={"path": env["KEVLAYA_KEV__PATH"]}, laya={"path": env["KEVLAYA_LAYA__PATH"]},
                        engine={"vram_budget_gb": config.vram_budget_gb, "ignore_eos": True,
                                "max_batch": config.max_batch, "kv_dtype": config.kv_dtype, **window})
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(paths["base"])
    workload = dict(settings=settings, seed=config.seed, new_tokens=config.new_tokens)
    jobs = make_jobs(tokenizer, count=config.jobs, prompt_tokens=config.prompt_tokens, **workload)
    laya_jobs = make_jobs(tokenizer, count=config.latency_samples, prompt_tokens=config.prompt_tokens,
                          adapters=("laya",), **{**workload, "seed": config.seed + 1})
    fit_jobs = {load: make_jobs(tokenizer, count=load, prompt_tokens=(256, 256), **{
        **workload, "seed": config.seed + 2, "new_tokens": {"kev": 128, "laya": 128}}) for load in config.fit_loads}
    stream_jobs = make_jobs(tokenizer, count=config.stream_jobs, prompt_tokens=config.prompt_tokens,
                            adapters=("kev",), **{**workload, "seed": config.seed + 3})

    result: dict[str, Any] = {
        "complete": False,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "shape": config.shape,
        "device": device,
        "vram_budget_gb": config.vram_budget_gb,
        "versions": _versions(),
        "workload": {"jobs": config.jobs, "prompt_tokens": list(config.prompt_tokens),
                     "new_tokens": config.new_tokens, "greedy": True, "exact_lengths": True, "seed": config.seed,
                     "latency_samples": config.latency_samples, "fit_loads": list(config.fit_loads),
                     "max_batch": config.max_batch, "window_tokens": settings.engine.window_tokens,
                     "lora_targets": list(config.lora_targets),
                     "prefill_tokens": config.prefill_tokens or settings.engine.prefill_tokens,
                     "prefill_between_steps": config.prefill_between_steps,
                     "prompt_tokens_seen": [min(j.prompt_tokens for j in jobs), max(j.prompt_tokens for j in jobs)]},
        "gpu_busy_method": "PyTorch profiler: CUDA kernel time over wall time of 16 decode steps (prefill removed "
                           "by a one-token run), in the bench process on the same model code and cap; the service "
                           "= a full Kev batch (max_batch rows) through the slot decoder, seed = batch 1 through "
                           "generate (modellab/reference.py)",
        "cuda_graphs": config.cuda_graphs,
        "kv_dtype": config.kv_dtype,
        # service settings from the environment, which the service's processes inherit, and the engine's settings
        # as the service reads them (defaults included)
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("KEVLAYA_")},
        "engine_settings": settings.engine.model_dump(),
    }
    measured = runtime_phase(config, settings, jobs)
    result["seed_scheme"] = measured["recipe"]
    result["peer"] = measured["peer"]
    result["service"] = service = {"gpu_busy_fraction": (measured["profile"] or {}).get("busy_fraction"),
                                   "profile": measured["profile"], "census": measured.get("census")}
    for pair in PAIRS:  # the A/B pairs: the same decoder with one thing changed (PAIRS)
        if pair in measured:
            service[pair] = {"profile": measured[pair], "census": measured.get(f"census_{pair}")}
    if "profile_again" in measured:
        service["profile_again"] = measured["profile_again"]  # the served step again, after the pairs

    def checkpoint() -> None:
        if "jobs_per_s" in service:
            service["speedup_vs_seed"] = service["jobs_per_s"] / result["seed_scheme"]["jobs_per_s"]
            if "jobs_per_s" in (result["peer"] or {}):
                service["speedup_vs_peer"] = service["jobs_per_s"] / result["peer"]["jobs_per_s"]
        result["speedup_vs_seed"] = service.get("speedup_vs_seed")
        result["speedup_vs_peer"] = service.get("speedup_vs_peer")
        result["bench_seconds"] = time.perf_counter() - started
        save(result)

    checkpoint()
    service_phase(config, env, jobs, laya_jobs, fit_jobs, service, checkpoint, stream_jobs)
    result["complete"] = True
    checkpoint()
    return result


def _versions() -> dict[str, str]:
    import peft
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}
    try:
        import bitsandbytes

        versions["bitsandbytes"] = bitsandbytes.__version__
    except ImportError:
        pass
    return versions
