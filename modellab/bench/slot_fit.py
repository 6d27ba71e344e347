"""How many key/value slots the worker's sizing gives a model shape under a VRAM cap, for each key/value storage
dtype and prefill chunk: `build_decoder` exactly as the worker runs it (graphs captured, the largest prefill
measured), on a random-weight model of the shape. Prints a table last; `--out` keeps the JSON.

    python -m modellab.bench.slot_fit --shape llama-2-7b --out modellab/bench/results/slot-fit.json
"""

from __future__ import annotations

import gc
import json
import logging
import shlex
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from modellab.bench.cli import SHAPES
from modellab.presets import ALL_LINEAR

if TYPE_CHECKING:
    from worker.model.loading import LoadedModel

GIB = 2**30
WHOLE = 1 << 20  # a chunk no prompt block reaches: one forward pass per prefill, as before chunking


def loaded_random_model(shape: str, vram_budget_gb: float, max_batch: int,
                        window_tokens: int) -> tuple[LoadedModel, dict[str, Any]]:
    """A random-weight model of `shape` (adapters on every linear layer) loaded as the worker loads it, and the
    settings it was loaded with (keyword arguments of Settings)."""
    import torch

    from modellab.model_factory import build_random_model
    from shared.settings import Settings
    from worker.model.loading import load_model

    if shape not in SHAPES:
        raise typer.BadParameter(f"must be one of {', '.join(SHAPES)}", param_hint="--shape")
    if not torch.cuda.is_available():
        raise typer.BadParameter("this measures CUDA memory: no CUDA device here", param_hint="--shape")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    paths = build_random_model(Path(tempfile.mkdtemp(prefix="kevlaya-random-")), shape, dtype=torch.float16,
                               device="cuda", target_modules=ALL_LINEAR)
    gc.collect()
    torch.cuda.empty_cache()
    base = dict(_env_file=None, model={"base": str(paths["base"]), "device": "cuda", "verify_manifests": False},
                kev={"path": str(paths["kev"])}, laya={"path": str(paths["laya"])},
                engine={"vram_budget_gb": vram_budget_gb, "max_batch": max_batch, "window_tokens": window_tokens})
    return load_model(Settings(**base)), base


def main(
    shape: Annotated[str, typer.Option(help=f"model shape, random weights: {', '.join(SHAPES)}")] = "llama-2-7b",
    vram_budget_gb: Annotated[float, typer.Option(help="KEVLAYA_ENGINE__VRAM_BUDGET_GB (5.5: a 6 GB card)")] = 5.5,
    window_tokens: Annotated[int, typer.Option(help="KEVLAYA_ENGINE__WINDOW_TOKENS: tokens one slot holds")] = 1024,
    max_batch: Annotated[int, typer.Option(
        help="KEVLAYA_ENGINE__MAX_BATCH: the slots asked for (plus Laya's reserved)")] = 16,
    chunks: Annotated[str, typer.Option(help="comma-separated KEVLAYA_ENGINE__PREFILL_CHUNK_TOKENS to try; 0: one "
                                             "forward pass per prefill")] = "0,512,256",
    out: Annotated[Optional[Path], typer.Option(help="write the results here as JSON")] = None,
) -> None:
    """Size the worker's decoder for every (key/value dtype, prefill chunk) pair on one loaded model."""
    import torch

    from shared.settings import Settings
    from worker.engine.build import build_decoder

    try:
        chunk_list = [int(c) for c in chunks.split(",") if c.strip()]
    except ValueError:
        raise typer.BadParameter("a comma-separated list of token counts, e.g. 0,512", param_hint="--chunks") from None
    loaded, base = loaded_random_model(shape, vram_budget_gb, max_batch, window_tokens)
    resident = torch.cuda.memory_allocated()
    rows = []
    for kv_dtype in ("auto", "fp8"):
        for chunk in chunk_list:
            settings = Settings(**{**base, "engine": {**base["engine"], "kv_dtype": kv_dtype,
                                                      "prefill_chunk_tokens": chunk or WHOLE}})
            torch.cuda.reset_peak_memory_stats()
            decoder = build_decoder(loaded, settings)
            rows.append({"kv_dtype": kv_dtype, "prefill_chunk_tokens": chunk or None, "slots": decoder.kv.slots,
                         "peak_gib": round(torch.cuda.max_memory_reserved() / GIB, 3)})
            decoder.close()
            del decoder
            gc.collect()
            torch.cuda.empty_cache()
    result = {"command": shlex.join(["python", "-m", "modellab.bench.slot_fit", *sys.argv[1:]]), "shape": shape,
              "gpu": torch.cuda.get_device_name(0), "vram_budget_gb": vram_budget_gb, "window_tokens": window_tokens,
              "resident_gib": round(resident / GIB, 3),
              "rows": rows}
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    typer.echo(f"{shape}, {window_tokens}-token slots under {vram_budget_gb} GiB on {result['gpu']}")
    typer.echo("| key/value dtype | prefill chunk | slots | peak reserved while sizing, GiB |")
    typer.echo("|---|---|---|---|")
    for row in rows:
        typer.echo(f"| {row['kv_dtype']} | {row['prefill_chunk_tokens'] or 'whole'} | {row['slots']} | "
                   f"{row['peak_gib']:.2f} |")


if __name__ == "__main__":
    typer.run(main)
