"""The benchmark's outputs: the results JSON, a PNG (throughput, Laya latency, memory over time) and a table."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from modellab.bench.load import percentile
from modellab.bench.pairs import PAIRS


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "—" if value is None else format(value, spec)


def _grammar(engine: dict[str, Any], key: str, spec: str, name: str = "decision_grammar") -> str:
    pairs = engine.get(name)
    if not pairs:
        return "—"
    return f"{pairs['free'][key]:{spec}} / {pairs['grammar'][key]:{spec}} ({pairs[key + '_vs_free']:.2f}×)"


def _streaming(engine: dict[str, Any]) -> str:
    streaming = engine.get("streaming")
    if not streaming:
        return "—"
    return f"{streaming['jobs_per_s_vs_free']:.3f}×, {streaming['step_ms_vs_free']:.3f}×"


def _steps_under_load(engine: dict[str, Any]) -> str:
    phases = engine.get("engine_phases_under_kev_load") or {}
    steps = (phases.get("steps") or phases.get("steps_shared") or {}).get("count", "—")  # steps_shared: older runs
    mean = [_fmt((phases.get(phase) or {}).get("mean_ms")) for phase in ("step", "wait")]
    return f"{steps} / {mean[0]} / {mean[1]}"


def _laya_parts(engine: dict[str, Any], when: str) -> str:
    """A Laya job's two parts: its first token (the wait for a slot and a prefill) and each later token (a step)."""
    first, later = engine.get(f"laya_ttft_ms_{when}"), engine.get(f"laya_ms_per_later_token_{when}")
    if not first or not later:
        return "—"
    return f"{_fmt(percentile(first, 95), '.0f')} / {_fmt(percentile(later, 50), '.2f')}"


def _first_delta(engine: dict[str, Any], figure: str = "first_delta_ms") -> str:
    delay = (engine.get("streaming") or {}).get(figure)
    if not delay or not delay.get("samples"):
        return "—"
    return " / ".join(_fmt(delay[key], ".1f") for key in ("p50", "p95", "max"))


def table(result: dict[str, Any]) -> str:
    seed, engines = result["seed_scheme"], {"service": result["service"]}
    names = list(engines)

    def row(label: str, recipe: str, cell: Callable[[dict[str, Any]], str]) -> tuple[str, ...]:
        return (label, recipe, *(cell(engines[name]) if "jobs_per_s" in engines[name] else "—" for name in names))

    rows = [
        row(f"jobs/s ({result['workload']['jobs']}-job interleaved workload)", _fmt(seed["jobs_per_s"], ".3f"),
            lambda e: _fmt(e["jobs_per_s"], ".3f")),
        row("speedup vs the recipe's scheme", "1.0×", lambda e: f"{e['speedup_vs_seed']:.1f}×"),
        row("speedup vs the peer (transformers CB; its jobs/s)", _fmt((result.get("peer") or {}).get("jobs_per_s"),
                                                                        ".3f"),
            lambda e: _fmt(e.get("speedup_vs_peer"), ".2f") + "×"),
        row(f"decode step ms, {_rows(result)} Kev rows (A/B pairs: {', '.join(_pairs(result))})", "",
            lambda e: f"{_fmt((e.get('profile') or {}).get('step_ms'))} ("
                      + "; ".join(_fmt(((e.get(pair) or {}).get('profile') or {}).get('step_ms'))
                                  for pair in _pairs(result)) + ")"),
        row(f"prefill of {_rows(result)} Kev prompts ms, captured / eager passes", "",
            lambda e: f"{_fmt((e.get('profile') or {}).get('prefill_ms_unprofiled'), '.1f')} / "
                      f"{_fmt(((e.get('eager_prefill') or {}).get('profile') or {}).get('prefill_ms_unprofiled'), '.1f')}"),
        row("decode step ms without the profiler (A/B pairs) / of it launching the graph", "",
            lambda e: f"{_fmt((e.get('profile') or {}).get('step_ms_unprofiled'))} ("
                      + "; ".join(_fmt(((e.get(pair) or {}).get('profile') or {}).get('step_ms_unprofiled'))
                                  for pair in _pairs(result)) + ") / "
                      f"{_fmt((e.get('profile') or {}).get('replay_launch_ms_per_step'))}"),
        row("Laya p50 / p95 ms, idle worker", "",
            lambda e: f"{_fmt(e.get('laya_p50_ms_idle'), '.0f')} / {_fmt(e.get('laya_p95_ms_idle'), '.0f')}"),
        row("Laya p50 / p95 ms, under Kev load", "",
            lambda e: f"{_fmt(e.get('laya_p50_ms_under_kev_load'), '.0f')} / "
                      f"{_fmt(e.get('laya_p95_ms_under_kev_load'), '.0f')}"),
        row("Laya first token p95 / ms per later token p50, idle", "", lambda e: _laya_parts(e, "idle")),
        row("Laya first token p95 / ms per later token p50, under Kev load", "",
            lambda e: _laya_parts(e, "under_kev_load")),
        row("decode steps under Kev load: count / mean ms / of it waiting for the GPU", "",
            _steps_under_load),
        row("GPU busy during decode", _fmt((seed.get("profile") or {}).get("busy_fraction"), ".1%"),
            lambda e: _fmt(e["gpu_busy_fraction"], ".1%")),
        row("peak allocated GiB", "", lambda e: _fmt(e["peak_allocated_gib"])),
        row("slots / jobs in flight at most", "", lambda e: f"{e.get('slots', '—')} / {e.get('most_in_flight', '—')}"),
        row("OOM events / failed jobs", "", lambda e: f"{e['oom_events']} / {e['failed_jobs']}"),
        row("claim groups / mean size", "", lambda e: f"{e['claim_groups']} / {e['mean_group_size']:.1f}"),
        row("decode step ms, free / decision grammar", "", lambda e: _grammar(e, "step_ms", ".2f")),
        row("jobs/s, free / decision grammar", "", lambda e: _grammar(e, "jobs_per_s", ".2f")),
        row("decode step ms, free / a forced tool call", "",
            lambda e: _grammar(e, "step_ms", ".2f", "tool_call_grammar")),
        row("SSE client per job vs none: jobs/s, step ms", "", _streaming),
        row("first delta after first token ms p50 / p95 / max", "", _first_delta),
        row("  of first deltas carrying the first token alone", "",
            lambda engine: _first_delta(engine, "first_delta_ms_first_token_alone")),
    ]
    loads = [f["load"] for f in next(iter(engines.values())).get("fit", [])]
    for index, load in enumerate(loads):
        def fit(e: dict[str, Any], index: int = index) -> str:
            f = e.get("fit", [])[index] if len(e.get("fit", [])) > index else None
            return "—" if f is None else (f"{f['jobs_per_s']:.3f}, {_fmt(f['peak_allocated_gib'])}, "
                                          f"{f.get('most_in_flight', '—')}, {f['oom_events']}, {f['failed_jobs']}")
        rows.append(row(f"fit, load {load}: jobs/s, peak GiB, in flight, OOM, failed", "", fit))
    width = max(len(r[0]) for r in rows)
    lines = [f"{result['shape']} on {result['gpu']}, cap {result['vram_budget_gb']} GiB",
             f"{'':<{width}}  {'recipe':>10}" + "".join(f"  {name:>22}" for name in names)]
    lines += [f"{r[0]:<{width}}  {r[1]:>10}" + "".join(f"  {cell:>22}" for cell in r[2:]) for r in rows]
    return "\n".join(lines + census_table(result["service"]))


def _pairs(result: dict[str, Any]) -> list[str]:
    """The A/B pairs a run measured (modellab/bench/pairs.py; older runs: the pairs of their day)."""
    return [name for name in dict.fromkeys(("lora_fp32", "unfused", "fused_norms", "nf4_kernel", *PAIRS))
            if name in result["service"] and name != "eager_prefill"] or ["none"]


def _rows(result: dict[str, Any]) -> str:
    return str((result["service"].get("census") or result["service"].get("profile") or {}).get("rows", "—"))


def _censuses(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The censuses of the served decode step and of each A/B comparison, by label; a comparison that failed left
    only its error and is left out."""
    found = {"as served": service.get("census"),
             "LoRA in fp32": (service.get("lora_fp32") or {}).get("census"),
             "one per projection": (service.get("unfused") or {}).get("census"),
             "RMSNorm fused": (service.get("fused_norms") or {}).get("census"),
             "RMSNorm unfused": (service.get("unfused_norms") or {}).get("census"),
             "NF4 Triton kernel": (service.get("nf4_kernel") or {}).get("census"),
             "unfused rotary": (service.get("unfused_rotary") or {}).get("census"),
             "unfused LoRA": (service.get("unfused_lora") or {}).get("census"),
             "bitsandbytes NF4": (service.get("bitsandbytes_nf4") or {}).get("census")}
    return {label: census for label, census in found.items() if census and "classes" in census}


def census_table(service: dict[str, Any]) -> list[str]:
    """Per decode step, by kernel class: kernels and milliseconds, as served and in each A/B comparison."""
    censuses = _censuses(service)
    if "as served" not in censuses:
        return []
    census = censuses["as served"]
    lines = ["", f"census of one {census['rows']}-row decode step ({census['what']}, eager): kernels, ms",
             f"  {'':<26}" + "".join(f"{label:>19}" for label in censuses)]
    for kind in [*census["classes"], "total"]:
        def cell(c: dict[str, Any]) -> str:
            figures = c if kind == "total" else c["classes"][kind]
            return f"{figures['kernels_per_step']:>9.0f} {figures['ms_per_step']:>8.2f}"
        lines.append(f"  {kind:<26}" + " ".join(cell(c) for c in censuses.values()))
    return lines


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = {name: e for name, e in {"service": result["service"]}.items() if "jobs_per_s" in e}
    fig, (throughput, latency, memory, kernels) = plt.subplots(1, 4, figsize=(20, 4.2))
    fig.suptitle(f"kevlaya bench: {result['shape']} on {result['gpu']}, cap {result['vram_budget_gb']} GiB")
    throughput.bar(["recipe\n(one at a time)", *engines],
                   [result["seed_scheme"]["jobs_per_s"], *(e["jobs_per_s"] for e in engines.values())],
                   color=["#999999", "#3366cc", "#cc6633"][:len(engines) + 1])
    throughput.set_ylabel("jobs/s")
    throughput.set_title("throughput (" + ", ".join(f"{n} {e['speedup_vs_seed']:.1f}×" for n, e in engines.items())
                         + ")")
    boxes, labels = [], []
    for name, e in engines.items():
        boxes += [e.get("laya_ms_idle", []), e.get("laya_ms_under_kev_load", [])]
        labels += [f"{name}\nidle", f"{name}\nKev load"]
    latency.boxplot(boxes)
    latency.set_xticks(range(1, len(labels) + 1), labels)
    latency.set_ylabel("Laya end-to-end ms")
    latency.set_title("Laya latency")
    for name, e in engines.items():
        points = e.get("memory_over_time", [])
        memory.plot([p["t_s"] for p in points], [p["peak_allocated_gib"] for p in points], marker=".", label=name)
    memory.axhline(result["vram_budget_gb"], color="red", linestyle="--", label="cap")
    memory.set_ylim(0, result["vram_budget_gb"] * 1.1)
    memory.set_xlabel("seconds into the service run")
    memory.set_ylabel("peak allocated per claim group, GiB")
    memory.set_title("memory over time")
    memory.legend()
    _plot_census(kernels, result["service"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_census(axes: Any, service: dict[str, Any]) -> None:
    """Stacked milliseconds per decode step by kernel class, as served and in each A/B comparison."""
    bars = _censuses(service)
    axes.set_title("kernel census of one decode step")
    if not bars:
        return
    bottom = [0.0] * len(bars)
    for kind in next(iter(bars.values()))["classes"]:
        heights = [census["classes"][kind]["ms_per_step"] for census in bars.values()]
        axes.bar([textwrap.fill(label, 12) for label in bars], heights, bottom=bottom, label=kind)
        bottom = [b + h for b, h in zip(bottom, heights)]
    axes.set_ylabel("ms per step (kernel time)" if "CUDA" in next(iter(bars.values()))["what"] else "ms per step (CPU)")
    axes.legend(fontsize="small")


def write_json(result: dict[str, Any], path: Path) -> None:
    """Written whole to a temporary file first, so a run killed mid-write never leaves a truncated file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.tmp")
    partial.write_text(json.dumps(result, indent=2, default=str) + "\n")
    partial.replace(path)
