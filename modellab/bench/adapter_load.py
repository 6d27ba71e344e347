"""How long a worker takes to load an adapter at run time (docs/architecture.md §10): a role under a new name into
its spare block, and a reload of Laya in place, each through the worker's own switch (`AdapterSwitcher.switch`:
read and check the files, copy the weights into the per-row LoRA, record the version), on a served model.

    python -m modellab.bench.adapter_load --shape qwen2.5-3b --device cuda --out results/adapter-load.json
    python -m modellab.bench.adapter_load --shape demo        # the shipped demo model, on the CPU

`--shape demo` serves models/demo and loads a copy of its Laya; any other shape builds a random-weight model of that
shape with three adapters on every linear layer (rank 16), as the benchmark does."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from shared.settings import DEMO_MODEL_DIR


def _models(shape: str, workdir: Path, device: str) -> dict[str, Path]:
    if shape == "demo":
        paths = {name: DEMO_MODEL_DIR / name for name in ("base", "kev", "laya")}
        paths["mira"] = Path(shutil.copytree(paths["laya"], workdir / "mira"))
        return paths
    import torch

    from modellab.model_factory import build_random_model
    from modellab.presets import ALL_LINEAR

    return build_random_model(workdir, shape, dtype=torch.float16 if device == "cuda" else torch.float32,
                              device=device, adapters={"kev": (16, 32), "laya": (16, 32), "mira": (16, 32)},
                              target_modules=ALL_LINEAR)


def measure(shape: str, device: str, repeats: int, vram_budget_gb: float) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="kevlaya-adapter-load-"))
    database = f"sqlite:///{workdir / 'kevlaya.db'}"
    os.environ["KEVLAYA_DATABASE__URL"] = database  # the switch records each version it loads
    from shared.migrate import upgrade

    upgrade(database)
    paths = _models(shape, workdir, device)

    import torch

    from shared.adapter_assignments import Desired
    from shared.manifest import adapter_sha256
    from shared.settings import Settings
    from worker.engine.adapters import AdapterSwitcher
    from worker.engine.build import build_decoder
    from worker.model.loading import load_model

    settings = Settings(_env_file=None, database={"url": database},
                        model={"base": str(paths["base"]), "device": device, "spare_roles": 1},
                        kev={"path": str(paths["kev"])}, laya={"path": str(paths["laya"])},
                        engine={"vram_budget_gb": vram_budget_gb, "max_batch": 8})
    loaded = load_model(settings)
    decoder = build_decoder(loaded, settings)
    switcher = AdapterSwitcher(loaded, settings)
    generation = 0

    def switch(role: str, path: Path | None, unloaded: bool = False) -> float:
        nonlocal generation
        generation += 1
        switcher.pending[role] = Desired(role, str(path) if path else None,
                                         None if unloaded else adapter_sha256(path), unloaded, generation)
        started = time.perf_counter()
        switcher.switch(role, decoder.lora)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        if role in switcher.blocked:
            raise RuntimeError(switcher.blocked[role])
        return seconds

    new_role, reload = [], []
    for _ in range(repeats):
        new_role.append(switch("mira", paths["mira"]))
        assert "mira" in decoder.lora.adapters and "mira" in loaded.adapters
        switch("mira", None, unloaded=True)  # gives the block back for the next round
        reload.append(switch("laya", paths["mira" if len(reload) % 2 == 0 else "laya"]))
    result = {
        "shape": shape, "device": device,
        "card": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "adapter_bytes": (Path(paths["mira"]) / "adapter_model.safetensors").stat().st_size,
        "new_role_s": {"median": statistics.median(new_role), "max": max(new_role), "all": new_role},
        "reload_s": {"median": statistics.median(reload), "max": max(reload), "all": reload},
        "command": f"python -m modellab.bench.adapter_load --shape {shape} --device {device} --repeats {repeats}",
    }
    decoder.close()
    shutil.rmtree(workdir, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="demo", help="`demo` (models/demo) or a random-weight shape "
                        "(modellab/model_factory.py SHAPES: qwen2.5-3b, llama-2-7b, ...)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--repeats", type=int, default=5, help="loads of each kind; the median is reported")
    parser.add_argument("--vram-budget-gb", type=float, default=5.5)
    parser.add_argument("--out", type=Path, help="also write the result here (JSON)")
    args = parser.parse_args()
    result = measure(args.shape, args.device, args.repeats, args.vram_budget_gb)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    print(f"| {result['card']} | {result['shape']} | new role {result['new_role_s']['median']:.3f} s | "
          f"reload {result['reload_s']['median']:.3f} s |")


if __name__ == "__main__":
    main()
