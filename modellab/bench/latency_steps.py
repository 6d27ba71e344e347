"""Kev and Laya rows decoding together in the worker's decoder, with steps of the Laya rows alone and without
(KEVLAYA_ENGINE__LATENCY_STEPS), on a random-weight model of a shape: what each role's token costs and the steps
launched of each kind. The decoder by itself, no service: the bench's Laya figures under Kev load minus these are
what the serving loop adds. CUDA only.

    python -m modellab.bench.latency_steps --shape qwen2.5-3b --out latency-steps.json
"""

from __future__ import annotations

import gc
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

if TYPE_CHECKING:
    from worker.decoder.slot_decoder import SlotDecoder
    from worker.generation import GenerationRequest


def _sync(decoder: SlotDecoder) -> None:
    if decoder.device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def mixed_decode(decoder: SlotDecoder, kev: list[GenerationRequest], laya: list[GenerationRequest],
                 warm_steps: int = 8) -> dict[str, Any]:
    """Prefill `kev`, let them decode `warm_steps` steps, then prefill `laya` beside them and step until the Laya
    rows are done: wall milliseconds per Laya token and per Kev token over that span (the Laya rows' tokens after
    their first), and the steps launched of each kind. Every Kev row must outlive the Laya rows."""
    import torch

    from worker.model.tokens import encode_chats

    waiting = list(kev)
    lengths = encode_chats(decoder.tokenizer, waiting, torch.device("cpu"))["attention_mask"].sum(1).tolist()
    while waiting:  # within the prefill budget, as the serving loop
        count = decoder.prefill_count(lengths)
        decoder.prefill(waiting[:count])
        waiting, lengths = waiting[count:], lengths[count:]
    for _ in range(warm_steps):
        decoder.step()
    decoder.prefill(laya)
    laya_ids = {r.job_id for r in laya}
    kev_rows = [row for row in decoder.rows if row.request.job_id not in laya_ids]
    kev_before = sum(len(row.tokens) for row in kev_rows)
    launched = dict(decoder.launched)
    captured = decoder._static if decoder.static and decoder.device.type == "cuda" else None
    if captured is not None:
        captured.timed = {}
    _sync(decoder)
    started = time.perf_counter()
    finished = []
    while any(row.request.job_id in laya_ids for row in decoder.rows):
        finished += decoder.step()
    _sync(decoder)
    wall_ms = (time.perf_counter() - started) * 1000
    if any(result.job_id not in laya_ids for result in finished):
        raise ValueError("a Kev row finished before the Laya rows: give the Kev requests more new tokens")
    kev_tokens = (sum(len(row.tokens) for row in kev_rows) - kev_before) / len(kev_rows)
    laya_tokens = max(r.max_new_tokens for r in laya) - 1
    steps = {kind: decoder.launched[kind] - launched[kind] for kind in launched}
    gpu_ms = {}
    if captured is not None:
        gpu_ms = {f"{rows}x{columns}{' alone' if alone else ''}": statistics.mean(a.elapsed_time(b) for a, b in events)
                  for (rows, columns, alone), events in sorted(captured.timed.items())}
        captured.timed = None
    decoder.clear()
    return {"kev_rows": len(kev), "laya_rows": len(laya), "wall_ms": wall_ms, "steps": steps, "gpu_ms": gpu_ms,
            "ms_per_step": wall_ms / max(1, sum(steps.values())), "ms_per_laya_token": wall_ms / laya_tokens,
            "ms_per_kev_token": wall_ms / kev_tokens if kev_tokens else None}


def main(
    shape: Annotated[str, typer.Option(help="model shape, random weights (modellab.bench.cli.SHAPES)")]
    = "qwen2.5-3b",
    vram_budget_gb: Annotated[float, typer.Option(help="KEVLAYA_ENGINE__VRAM_BUDGET_GB (5.5: a 6 GB card)")] = 5.5,
    max_batch: Annotated[int, typer.Option(
        help="KEVLAYA_ENGINE__MAX_BATCH: the Kev rows (Laya's reserved slots beside)")] = 32,
    laya_rows: Annotated[str, typer.Option(help="comma-separated Laya rows to try beside the Kev rows")] = "1,4",
    prompt_tokens: Annotated[int, typer.Option(help="prompt tokens of every row")] = 256,
    repeats: Annotated[int, typer.Option(help="runs of each case; the table keeps the least time", min=1)] = 3,
    out: Annotated[Optional[Path], typer.Option(help="write the results here as JSON")] = None,
) -> None:
    """Time Kev and Laya rows decoding together, with steps of the Laya rows alone and without."""
    import torch
    from transformers import AutoTokenizer

    from modellab.bench.run import _requests
    from modellab.bench.slot_fit import loaded_random_model
    from modellab.bench.workload import make_jobs
    from shared.settings import Settings
    from worker.engine.loop import build_decoder

    try:
        counts = [int(n) for n in laya_rows.split(",")]
    except ValueError:
        raise typer.BadParameter("comma-separated whole numbers, e.g. 1,4", param_hint="--laya-rows") from None
    if min(counts) < 1:
        raise typer.BadParameter("at least one Laya row", param_hint="--laya-rows")
    loaded, base = loaded_random_model(shape, vram_budget_gb, max_batch, 1024)
    tokenizer = AutoTokenizer.from_pretrained(base["model"]["base"])
    settings = Settings(**{**base, "engine": {**base["engine"], "ignore_eos": True}})
    workload = dict(settings=settings, seed=0, prompt_tokens=(prompt_tokens, prompt_tokens),
                    new_tokens={"kev": 128, "laya": 32})
    kev = _requests(make_jobs(tokenizer, count=max_batch, adapters=("kev",), **workload))
    laya = _requests(make_jobs(tokenizer, count=max(counts), adapters=("laya",), **workload))
    cases = []
    for latency_steps in (False, True):
        decoder = build_decoder(loaded, settings.updated(engine={"latency_steps": latency_steps}))
        try:
            if decoder.free < max_batch + max(counts):
                raise typer.BadParameter(f"the worker's decoder has {decoder.free} slots under the budget, fewer "
                                         f"than {max_batch} Kev rows and {max(counts)} Laya rows",
                                         param_hint="--max-batch")
            for count in counts:
                runs = [mixed_decode(decoder, kev, laya[:count]) for _ in range(repeats)]
                cases.append({"latency_steps": latency_steps, **min(runs, key=lambda r: r["wall_ms"]),
                              "runs": runs})
        finally:
            decoder.close()
            del decoder  # its key/value block and graphs, before the next one is sized under the same budget
            gc.collect()
            torch.cuda.empty_cache()
    result = {"command": shlex.join(["python", "-m", "modellab.bench.latency_steps", *sys.argv[1:]]),
              "shape": shape, "gpu": torch.cuda.get_device_name(0), "cases": cases}
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    typer.echo(f"{shape} on {result['gpu']}: Kev rows {max_batch}, Laya 32 new tokens, least of {repeats}")
    typer.echo("| latency steps | Laya rows | steps shared / alone | ms a step | ms a Laya token | ms a Kev token "
               "| GPU ms a step, by rows × columns |")
    typer.echo("|---|---|---|---|---|---|---|")
    for c in cases:
        shapes = ", ".join(f"{shape}: {ms:.2f}" for shape, ms in c["gpu_ms"].items())
        typer.echo(f"| {'on' if c['latency_steps'] else 'off'} | {c['laya_rows']} | {c['steps']['shared']} / "
                   f"{c['steps']['alone']} | {c['ms_per_step']:.2f} | {c['ms_per_laya_token']:.2f} | "
                   f"{c['ms_per_kev_token']:.2f} | {shapes} |")


if __name__ == "__main__":
    typer.run(main)
