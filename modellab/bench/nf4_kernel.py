"""The NF4 kernel against bitsandbytes' path, one projection at a time: each linear layer shape of a model, random
NF4 weights (double quantization, as the worker loads them), 1 to 64 rows, median time of many runs with CUDA
events, and the error against bitsandbytes' own product. Prints a table last; `--out` keeps the JSON.

    python -m modellab.bench.nf4_kernel --shape qwen2.5-3b --out modellab/bench/results/nf4-kernel.json
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from modellab.bench.cli import SHAPES


def projections(shape: str) -> dict[str, tuple[int, int]]:
    """(out, in) of each matmul of one decoder layer of `shape` as the decoder runs it: q/k/v joined, o, gate/up
    joined, down (worker/decoder/kernels/fused_projections.py)."""
    from modellab.model_factory import SHAPES as CONFIGS

    config = CONFIGS[shape][1]
    hidden, intermediate = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = head_dim * config.get("num_key_value_heads", config["num_attention_heads"])
    return {"q_proj+k_proj+v_proj": (hidden + 2 * kv, hidden), "o_proj": (hidden, hidden),
            "gate_proj+up_proj": (2 * intermediate, hidden), "down_proj": (hidden, intermediate)}


def _graph_ms(run, repeats: int) -> float:  # noqa: ANN001
    """GPU milliseconds of one `run`, captured `repeats` times in one CUDA graph as the decode step runs (no launch
    cost from Python); the median of ten replays."""
    import torch

    from worker.decoder.graph_step import captured

    (graph, _), _ = captured(lambda: [run() for _ in range(repeats)], None)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / repeats)
    return statistics.median(times)


# Tried by --sweep at each row count: column tiles, scale blocks an iteration, the product transposed or not, even and
# odd columns apart or joined; then warps and stages, and half or twice `plan`'s ranges of k, around the best.
SHAPE_SWEEP = [dict(block_n=n, sub=s, swap=w, pairwise=p) for n in (32, 64, 128) for s in (1, 2)
               for w in (False, True) for p in (False, True)]
RUN_SWEEP = [dict(num_warps=w, num_stages=s) for w, s in ((4, 2), (4, 3), (4, 4), (8, 3), (8, 4), (2, 3))]


def main(
    shape: Annotated[str, typer.Option(help=f"model shape: {', '.join(SHAPES)}")] = "qwen2.5-3b",
    rows: Annotated[str, typer.Option(help="comma-separated row counts")] = "1,8,16,32,64",
    repeats: Annotated[int, typer.Option(min=1, help="products per captured graph")] = 20,
    sweep: Annotated[bool, typer.Option(help="also time other tiles and warps at each row count (about 30 s a "
                                              "count on the 3B shape)")] = False,
    out: Annotated[Optional[Path], typer.Option(help="write the results here as JSON")] = None,
) -> None:
    """Time the NF4 kernel and bitsandbytes' 4-bit matmul on every projection shape of one decoder layer, each
    captured as a CUDA graph."""
    import torch

    if shape not in SHAPES or shape == "tiny":
        raise typer.BadParameter(f"must be one of {', '.join(s for s in SHAPES if s != 'tiny')}",
                                 param_hint="--shape")
    from worker.decoder.kernels.nf4_matmul import MAX_ROWS, Launch, Nf4Weight, nf4_matmul, plan

    try:
        counts = [int(r) for r in rows.split(",") if r.strip()]
    except ValueError:
        raise typer.BadParameter("a comma-separated list of row counts, e.g. 1,8,32", param_hint="--rows") from None
    if not counts or min(counts) < 1 or max(counts) > MAX_ROWS:
        raise typer.BadParameter(f"row counts from 1 to {MAX_ROWS}", param_hint="--rows")
    if not torch.cuda.is_available():
        raise typer.BadParameter("the kernel runs on CUDA: no CUDA device here", param_hint="--shape")
    import bitsandbytes as bnb
    results, swept = [], []
    for name, (out_features, in_features) in projections(shape).items():
        layer = bnb.nn.Linear4bit(in_features, out_features, bias=False, compute_dtype=torch.float16,
                                  compress_statistics=True, quant_type="nf4")
        layer.weight = bnb.nn.Params4bit(torch.randn(out_features, in_features, dtype=torch.float16) * 0.02,
                                         requires_grad=False, compress_statistics=True, quant_type="nf4")
        layer = layer.cuda()
        weight, packed = Nf4Weight.of(layer), layer.weight
        state = packed.quant_state
        for count in counts:
            x = torch.randn(count, in_features, device="cuda", dtype=torch.float16)
            with torch.inference_mode():
                theirs = bnb.matmul_4bit(x, packed, quant_state=state)
                ours = nf4_matmul(x, weight)
                error = ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()).item()
                bnb_ms = _graph_ms(lambda: bnb.matmul_4bit(x, packed, quant_state=state), repeats)
                kernel_ms = _graph_ms(lambda: nf4_matmul(x, weight), repeats)
                launch = plan(count, weight, x.device)
                tree = dataclasses.replace(launch, permute=False)  # the decode by a tree of selects, same tiles
                tree_ms = _graph_ms(lambda: nf4_matmul(x, weight, launch=tree), repeats)
            results.append({"projection": name, "out": out_features, "in": in_features, "rows": count,
                            "bitsandbytes_ms": bnb_ms, "kernel_ms": kernel_ms, "speedup": bnb_ms / kernel_ms,
                            "tree_decode_ms": tree_ms, "launch": dataclasses.asdict(launch),
                            "kernel_gb_per_s": weight.packed.numel() / kernel_ms / 1e6, "relative_error": error})
        for count in counts if sweep else ():
            x = torch.randn(count, in_features, device="cuda", dtype=torch.float16)

            def timed(launch: Launch) -> float:
                with torch.inference_mode():
                    ms = _graph_ms(lambda: nf4_matmul(x, weight, launch=launch), repeats)
                swept.append({"projection": name, "rows": count, "launch": dataclasses.asdict(launch),
                              "kernel_ms": ms})
                typer.echo(f"swept {name}, {count} rows: {ms:.4f} ms {dataclasses.asdict(launch)}")  # kept if cut
                return ms

            best = min((dataclasses.replace(plan(count, weight, x.device), **tiles) for tiles in SHAPE_SWEEP),
                       key=timed)
            best = min((dataclasses.replace(best, **run) for run in RUN_SWEEP), key=timed)
            for split in {max(1, best.split // 2), best.split * 2}:
                timed(dataclasses.replace(best, split=split))
        torch.cuda.empty_cache()
    command = shlex.join(["python", "-m", "modellab.bench.nf4_kernel", *sys.argv[1:]])
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"command": command, "shape": shape, "gpu": torch.cuda.get_device_name(0),
                                   "versions": {"torch": torch.__version__, "bitsandbytes": bnb.__version__},
                                   "results": results, "sweep": swept}, indent=2) + "\n")
    typer.echo(f"{command}\n{shape} on {torch.cuda.get_device_name(0)}: GPU ms per product, captured as a graph")
    typer.echo("| matmul (out × in) | rows | bitsandbytes | kernel (k ranges) | speedup | decoded by a tree "
               "| kernel GB/s (packed) | error |")
    typer.echo("|---|---|---|---|---|---|---|---|")
    for r in results:
        typer.echo(f"| {r['projection']} ({r['out']} × {r['in']}) | {r['rows']} | {r['bitsandbytes_ms']:.4f} | "
                   f"{r['kernel_ms']:.4f} ({r['launch']['split']}) | {r['speedup']:.2f}× | {r['tree_decode_ms']:.4f} | "
                   f"{r['kernel_gb_per_s']:.0f} | {r['relative_error']:.1e} |")

    if swept:
        typer.echo("\nsweep: the fastest tiles per projection and row count (ms; as planned for comparison)")
        for r in results:
            best = min((s for s in swept if s["projection"] == r["projection"] and s["rows"] == r["rows"]),
                       key=lambda s: s["kernel_ms"])
            typer.echo(f"  {r['projection']}, {r['rows']} rows: {best['kernel_ms']:.4f} with {best['launch']}; "
                       f"planned {r['kernel_ms']:.4f}")


if __name__ == "__main__":
    typer.run(main)
