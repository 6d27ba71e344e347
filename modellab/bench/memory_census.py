"""Where the worker's workspace goes: the decoder built as the worker builds it (`build_decoder`: weights joined,
graphs captured, the largest prefill run) on a random-weight model of a shape, with PyTorch's allocator recording
every allocation. Prints what the memory pools reserve at the end, and the allocations alive at the moment the most
were, summed by the source line that made them (the first line in `worker/` or `modellab/`, and the library line
under it). `--out` keeps the JSON. CUDA only.

    python -m modellab.bench.memory_census --shape llama-2-7b --vram-budget-gb 8 --out memory-census-7b.json

The budget defaults to more than a 6 GB card's, so that the slots asked for are built and the census sees them
(slot_fit says how many a budget holds).
"""

from __future__ import annotations

import collections
import json
import shlex
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

MIB = 2**20
OURS = ("/worker/", "/modellab/")


def source(frames: list[dict[str, Any]]) -> str:
    """Where an allocation was made: the first frame in the project's code, then the first in a library's."""
    def short(frame: dict[str, Any] | None) -> str:
        if frame is None:
            return "?"
        parts = frame["filename"].split("/")
        return f"{'/'.join(parts[-2:])}:{frame['line']} {frame['name']}"

    ours = next((f for f in frames if any(part in f["filename"] for part in OURS)), None)
    library = next((f for f in frames if "site-packages" in f["filename"] or "/torch/" in f["filename"]),
                   frames[0] if frames else None)
    return f"{short(ours)} <- {short(library)}"


def live_at_peak(trace: Iterable[dict[str, Any]]) -> tuple[int, list[tuple[int, list[dict[str, Any]]]]]:
    """The most bytes alive at once over an allocator trace (allocations made while it recorded), and the
    (size, frames) of each allocation alive then."""
    events = list(trace)
    live: dict[int, int] = {}
    total = peak = 0
    peak_at = -1
    for index, event in enumerate(events):
        if event["action"] == "alloc":
            live[event["addr"]] = event["size"]
            total += event["size"]
            if total > peak:
                peak, peak_at = total, index
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])
    alive: dict[int, tuple[int, list[dict[str, Any]]]] = {}
    for event in events[:peak_at + 1]:
        if event["action"] == "alloc":
            alive[event["addr"]] = (event["size"], event.get("frames", []))
        elif event["action"] == "free_completed":
            alive.pop(event["addr"], None)
    return peak, list(alive.values())


def by_source(allocations: Iterable[tuple[int, list[dict[str, Any]]]], top: int) -> list[dict[str, Any]]:
    """The allocations summed by `source`, largest first, at most `top` rows."""
    size, count = collections.Counter(), collections.Counter()
    for nbytes, frames in allocations:
        where = source(frames)
        size[where] += nbytes
        count[where] += 1
    return [{"where": w, "mib": round(b / MIB, 1), "allocations": count[w]} for w, b in size.most_common(top)]


def pools(segments: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each memory pool's segments: reserved and allocated MiB (pool (0, 0) is the general one, the others belong
    to captured graphs)."""
    totals: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for segment in segments:
        row = totals[str(tuple(segment.get("segment_pool_id") or (0, 0)))]
        row[0] += segment["total_size"]
        row[1] += segment["allocated_size"]
        row[2] += 1
    return [{"pool": pool, "segments": n, "reserved_mib": round(reserved / MIB, 1),
             "allocated_mib": round(used / MIB, 1)}
            for pool, (reserved, used, n) in sorted(totals.items(), key=lambda item: -item[1][0])]


def main(
    shape: Annotated[str, typer.Option(help="model shape, random weights (modellab.bench.cli.SHAPES)")]
    = "llama-2-7b",
    vram_budget_gb: Annotated[float, typer.Option(help="KEVLAYA_ENGINE__VRAM_BUDGET_GB while building")] = 8.0,
    max_batch: Annotated[int, typer.Option(help="KEVLAYA_ENGINE__MAX_BATCH: the slots built (no slot reserved)")] = 4,
    window_tokens: Annotated[int, typer.Option(help="KEVLAYA_ENGINE__WINDOW_TOKENS")] = 1024,
    kv_dtype: Annotated[str, typer.Option(help="KEVLAYA_ENGINE__KV_DTYPE: auto or fp8")] = "fp8",
    prefill_chunk_tokens: Annotated[int, typer.Option(help="KEVLAYA_ENGINE__PREFILL_CHUNK_TOKENS")] = 512,
    top: Annotated[int, typer.Option(help="rows of the table of allocations by source line")] = 20,
    out: Annotated[Optional[Path], typer.Option(help="write the results here as JSON")] = None,
) -> None:
    """Build the worker's decoder on a random model of `shape` and say where its memory goes."""
    import torch

    from modellab.bench.slot_fit import loaded_random_model
    from shared.settings import Settings
    from worker.engine.build import build_decoder

    if kv_dtype not in ("auto", "fp8"):
        raise typer.BadParameter("auto or fp8", param_hint="--kv-dtype")
    loaded, base = loaded_random_model(shape, vram_budget_gb, max_batch, window_tokens)
    settings = Settings(**{**base, "laya": {**base["laya"], "reserved_slots": 0}, "engine": {
        **base["engine"], "kv_dtype": kv_dtype, "prefill_chunk_tokens": prefill_chunk_tokens}})
    resident = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    torch.cuda.reset_peak_memory_stats()
    decoder = build_decoder(loaded, settings)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, alive = live_at_peak(snapshot["device_traces"][0])
    result = {
        "command": shlex.join(["python", "-m", "modellab.bench.memory_census", *sys.argv[1:]]), "shape": shape,
        "gpu": torch.cuda.get_device_name(0), "slots": decoder.kv.slots,
        "resident_after_load_gib": round(resident / 2**30, 3),
        "allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 3),
        "reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 3),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3),
        "peak_allocated_while_building_mib": round(peak / MIB, 1),
        "pools": pools(snapshot["segments"]),
        "at_peak_by_source": by_source(alive, top),
    }
    decoder.close()
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    typer.echo(f"{shape}: {result['slots']} slots; resident after load {result['resident_after_load_gib']} GiB, "
               f"after building: allocated {result['allocated_gib']}, reserved {result['reserved_gib']}, peak "
               f"reserved {result['peak_reserved_gib']} GiB")
    typer.echo("| pool | segments | reserved MiB | allocated MiB |\n|---|---|---|---|")
    for row in result["pools"]:
        typer.echo(f"| {row['pool']} | {row['segments']} | {row['reserved_mib']} | {row['allocated_mib']} |")
    typer.echo(f"allocated while building, at its peak ({result['peak_allocated_while_building_mib']} MiB):")
    typer.echo("| MiB | allocations | made at <- library |\n|---|---|---|")
    for row in result["at_peak_by_source"]:
        typer.echo(f"| {row['mib']} | {row['allocations']} | {row['where']} |")


if __name__ == "__main__":
    typer.run(main)
