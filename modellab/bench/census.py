"""A kernel census of one decode step: what the GPU runs, by class, from the PyTorch profiler.

Each kernel is attributed to the operator that launched it and the named ranges that operator ran in (the LoRA
products and bitsandbytes' 4-bit matmuls run inside ranges while the census profiles), so a LoRA product is told
from the LM head although both are plain GEMMs. The steps must run eager (no CUDA graph), since a graph's
kernels are replayed without their operators. Prefill is taken out as in profile.py: the same rows once for one
token, once for `steps` more. Off CUDA the census counts CPU operators' own time instead, by the same classes.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import re
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from modellab.bench.profile import Run
from worker.generation import GenerationRequest

CLASSES = ("nf4_matmul", "lora", "attention", "other_gemm", "norm_rotary_elementwise", "other")
_ATTENTION = re.compile(r"fmha|flash|attention|softmax|sdpa|scaled_dot_product", re.I)
_GEMM = re.compile(r"gemm|gemv|nvjet|cutlass|xmma|splitk|cublas|\bmm\b|aten::(mm|bmm|addmm|matmul|linear)$", re.I)
_ELEMENTWISE = re.compile(r"elementwise|vectorized|unrolled|reduce|copy|cat|index|fill|rotary|aten::", re.I)


LORA_RANGE, NF4_RANGE = "kevlaya.row_lora", "kevlaya.nf4_matmul"
_REGIONS = {"lora": LORA_RANGE, "nf4_matmul": NF4_RANGE}


def kernel_class(name: str, frames: list[str]) -> str:
    """The class of a kernel (or CPU operator) `name` launched from within Python `frames`."""
    where = " ".join(frames)
    if _REGIONS["lora"] in where or "masked_expand" in name:  # the LoRA expand kernel (worker/decoder/kernels/lora_expand.py)
        return "lora"
    if _REGIONS["nf4_matmul"] in where or re.search(r"4bit|dequantize|nf4", name, re.I):
        return "nf4_matmul"
    if _ATTENTION.search(name):
        return "attention"
    if _GEMM.search(name):
        return "other_gemm"  # the LM head, and any projection a maintained kernel does not cover
    if _ELEMENTWISE.search(name):
        return "norm_rotary_elementwise"
    return "other"


class _Regions:
    """The time spans of the named ranges, so an operator is placed by when it ran as well as by its recorded
    parents."""

    def __init__(self, events: list) -> None:  # noqa: ANN001 (profiler FunctionEvents)
        self.spans: dict[str, tuple[list[float], list[float]]] = {}
        for kind, marker in _REGIONS.items():
            merged: list[list[float]] = []
            for start, end in sorted((e.time_range.start, e.time_range.end) for e in events if marker in e.name):
                if merged and start <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], end)
                else:
                    merged.append([start, end])
            self.spans[kind] = ([m[0] for m in merged], [m[1] for m in merged])

    def around(self, t: float) -> list[str]:
        found = []
        for kind, (starts, ends) in self.spans.items():
            i = bisect.bisect_right(starts, t) - 1
            if i >= 0 and t <= ends[i]:
                found.append(_REGIONS[kind])
        return found


@contextlib.contextmanager
def _ranges() -> Iterator[None]:
    """Name the LoRA products and the 4-bit matmuls (bitsandbytes' and the NF4 kernel's) as profiler ranges while
    the census runs."""
    from worker.decoder.kernels.nf4_matmul import Nf4Kernels
    from worker.decoder.kernels.row_lora import RowLoRA

    RowLoRA.profile_label = LORA_RANGE
    Nf4Kernels.profile_label = NF4_RANGE
    try:
        import bitsandbytes
    except ImportError:
        bitsandbytes = None
    matmul = getattr(bitsandbytes, "matmul_4bit", None)
    if matmul is not None:
        def labelled(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(NF4_RANGE):
                return matmul(*args, **kwargs)
        bitsandbytes.matmul_4bit = labelled
    try:
        yield
    finally:
        RowLoRA.profile_label = Nf4Kernels.profile_label = None
        if matmul is not None:
            bitsandbytes.matmul_4bit = matmul


def _frames(event, regions: _Regions) -> list[str]:  # noqa: ANN001 (a profiler FunctionEvent)
    """The ranges an operator ran within: its recorded parents, and the named ranges its start falls in."""
    frames = []
    parent = event.cpu_parent
    while parent is not None:
        frames.append(parent.name)
        parent = parent.cpu_parent
    return frames + regions.around(event.time_range.start)


Profiled = tuple[dict[str, tuple[int, float]], Counter, dict[str, tuple[int, float]]]


def _profile(run: Run, requests: list[GenerationRequest], cuda: bool) -> Profiled:
    """Per class: (kernels, microseconds) of running `requests` to the end; the unclassed kernels by name; and the
    norm/rotary/elementwise class's kernels by name, (kernels, microseconds)."""
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with _ranges(), profile(activities=activities, acc_events=True) as prof:
        run(requests)
        if cuda:
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    regions = _Regions(events)
    counts: Counter[str] = Counter()
    micros: Counter[str] = Counter()
    unclassed: Counter[str] = Counter()
    elementwise: dict[str, list[float]] = {}
    launches = [(event, [(k.name, k.duration) for k in event.kernels] if cuda else []) for event in events]
    if cuda:
        # Kernels no operator launched (Triton's, launched from Python) are linked to no CPU event: they are
        # counted by name, as what the GPU ran beyond the operators' kernels, with no frames.
        ran, spent = Counter(), Counter()
        for kernel in prof.events():
            # the named ranges are mirrored on the GPU's timeline as annotations, not kernels
            if kernel.device_type == torch.autograd.DeviceType.CUDA and kernel.name not in _REGIONS.values():
                ran[kernel.name] += 1
                spent[kernel.name] += kernel.time_range.elapsed_us()
        linked = Counter(name for _, kernels in launches for name, _ in kernels)
        launches.append((None, [(name, spent[name] / ran[name]) for name in ran
                                for _ in range(ran[name] - linked[name])]))
    for event, kernels in launches:
        if cuda:
            launched = kernels
        elif event.name.startswith("aten::") and event.self_cpu_time_total > 0:
            launched = [(event.name, event.self_cpu_time_total)]
        else:
            continue
        frames = _frames(event, regions) if launched and event is not None else []
        for name, duration in launched:
            kind = kernel_class(name, frames)
            counts[kind] += 1
            micros[kind] += duration
            if kind == "other":
                unclassed[name[:80]] += 1
            elif kind == "norm_rotary_elementwise":
                tally = elementwise.setdefault(name[:100], [0, 0.0])
                tally[0] += 1
                tally[1] += duration
    return ({kind: (counts[kind], micros[kind]) for kind in CLASSES}, unclassed,
            {name: (n, us) for name, (n, us) in elementwise.items()})


def kernel_census(run: Run, device: str, requests: list[GenerationRequest], steps: int = 4) -> dict:
    """Kernels and milliseconds per decode step of `requests` run together by `run`, by class, with totals."""
    cuda = device == "cuda"
    requests = [dataclasses.replace(r, max_new_tokens=steps + 1) for r in requests]
    run(requests)  # warm-up
    one, _, one_elementwise = _profile(run, [dataclasses.replace(r, max_new_tokens=1) for r in requests], cuda)
    full, unclassed, elementwise = _profile(run, requests, cuda)

    def per_step(full: tuple[int, float], one: tuple[int, float]) -> dict[str, float]:
        return {"kernels_per_step": (full[0] - one[0]) / steps, "ms_per_step": (full[1] - one[1]) / steps / 1000}

    classes = {kind: per_step(full[kind], one[kind]) for kind in CLASSES}
    by_name = {name: per_step(tally, one_elementwise.get(name, (0, 0.0))) for name, tally in elementwise.items()}
    return {"rows": len(requests), "steps": steps, "what": "CUDA kernels" if cuda else "CPU operators (own time)",
            "classes": classes,
            "kernels_per_step": sum(c["kernels_per_step"] for c in classes.values()),
            "ms_per_step": sum(c["ms_per_step"] for c in classes.values()),
            "unclassed": unclassed.most_common(8),
            # what the norm/rotary/elementwise class is made of: the next fusions' candidates
            "elementwise_by_time": sorted(([name, f["kernels_per_step"], f["ms_per_step"]] for name, f in by_name.items()
                                           if f["kernels_per_step"] > 0), key=lambda x: -x[2])[:12],
            "python_profiler_left_on": sys.getprofile() is not None}
