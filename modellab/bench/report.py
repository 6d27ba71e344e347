"""The benchmark's outputs: the results JSON, a PNG (throughput, Laya latency, memory over time) and a table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "—" if value is None else format(value, spec)


def table(result: dict[str, Any]) -> str:
    seed, service = result["seed_scheme"], result["service"]
    rows = [
        (f"jobs/s ({result['workload']['jobs']}-job interleaved workload)", _fmt(seed["jobs_per_s"], ".3f"), _fmt(service["jobs_per_s"], ".3f")),
        ("speedup vs the recipe's scheme", "1.0×", f"{result['speedup_vs_seed']:.1f}×"),
        ("Laya p50 / p95 ms, idle worker", "", f"{_fmt(service['laya_p50_ms_idle'], '.0f')} / "
                                               f"{_fmt(service['laya_p95_ms_idle'], '.0f')}"),
        ("Laya p50 / p95 ms, under Kev load", "", f"{_fmt(service['laya_p50_ms_under_kev_load'], '.0f')} / "
                                                  f"{_fmt(service['laya_p95_ms_under_kev_load'], '.0f')}"),
        ("GPU busy during decode", _fmt((seed.get("profile") or {}).get("busy_fraction"), ".1%"),
         _fmt(service["gpu_busy_fraction"], ".1%")),
        ("peak allocated GiB", "", _fmt(service["peak_allocated_gib"])),
        ("OOM events / failed jobs", "", f"{service['oom_events']} / {service['failed_jobs']}"),
        ("batches / mean size / switches", "", f"{service['batches']} / {service['mean_batch_size']:.1f} / "
                                               f"{service['switches']}"),
    ]
    rows += [(f"fit, load {f['load']}: jobs/s, peak GiB, OOM, failed", "",
              f"{f['jobs_per_s']:.3f}, {_fmt(f['peak_allocated_gib'])}, {f['oom_events']}, {f['failed_jobs']}")
             for f in service.get("fit", [])]
    width = max(len(r[0]) for r in rows)
    lines = [f"{result['shape']} on {result['gpu']}, cap {result['vram_budget_gb']} GiB",
             f"{'':<{width}}  {'recipe':>10}  {'service':>22}"]
    lines += [f"{name:<{width}}  {a:>10}  {b:>22}" for name, a, b in rows]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    service = result["service"]
    fig, (throughput, latency, memory) = plt.subplots(1, 3, figsize=(15, 4.2))
    fig.suptitle(f"kevlaya bench: {result['shape']} on {result['gpu']}, cap {result['vram_budget_gb']} GiB")
    throughput.bar(["recipe (one at a time)", "service"], [result["seed_scheme"]["jobs_per_s"], service["jobs_per_s"]],
                   color=["#999999", "#3366cc"])
    throughput.set_ylabel("jobs/s")
    throughput.set_title(f"throughput ({result['speedup_vs_seed']:.1f}×)")
    latency.boxplot([service["laya_ms_idle"], service["laya_ms_under_kev_load"]])
    latency.set_xticks([1, 2], ["idle worker", "under Kev load"])
    latency.set_ylabel("Laya end-to-end ms")
    latency.set_title("Laya latency")
    points = service["memory_over_time"]
    memory.plot([p["t_s"] for p in points], [p["peak_allocated_gib"] for p in points], marker=".")
    memory.axhline(result["vram_budget_gb"], color="red", linestyle="--", label="cap")
    memory.set_ylim(0, result["vram_budget_gb"] * 1.1)
    memory.set_xlabel("seconds into the service run")
    memory.set_ylabel("peak allocated per batch, GiB")
    memory.set_title("memory over time")
    memory.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(result: dict[str, Any], path: Path) -> None:
    """Written whole to a temporary file first, so a run killed mid-write never leaves a truncated file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.tmp")
    partial.write_text(json.dumps(result, indent=2, default=str) + "\n")
    partial.replace(path)
