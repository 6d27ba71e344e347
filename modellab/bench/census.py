"""A kernel census of one decode step: what the GPU runs, by class, from the PyTorch profiler.

Each kernel is attributed to the operator that launched it and that operator's Python stack, so a LoRA product
is told from the LM head although both are plain GEMMs. The steps must run eager (no CUDA graph), since a graph's
kernels are replayed without their operators. Prefill is taken out as in profile.py: the same rows once for one
token, once for `steps` more. Off CUDA the census counts CPU operators' own time instead, by the same classes.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from modellab.bench.profile import Run
from worker.generation import GenerationRequest

CLASSES = ("nf4_matmul", "lora", "attention", "other_gemm", "norm_rotary_elementwise", "other")
_ATTENTION = re.compile(r"fmha|flash|attention|softmax|sdpa|scaled_dot_product", re.I)
_GEMM = re.compile(r"gemm|gemv|cutlass|xmma|splitk|cublas|\bmm\b|aten::(mm|bmm|addmm|matmul|linear)$", re.I)
_ELEMENTWISE = re.compile(r"elementwise|vectorized|unrolled|reduce|copy|cat|index|fill|aten::", re.I)


def kernel_class(name: str, stack: list[str]) -> str:
    """The class of a kernel (or CPU operator) `name` launched from Python `stack` (innermost frame first)."""
    frames = " ".join(stack)
    if "row_lora.py" in frames:
        return "lora"
    if "bitsandbytes" in frames or re.search(r"4bit|dequantize|nf4", name, re.I):
        return "nf4_matmul"
    if _ATTENTION.search(name) or "sdpa_attention" in frames:
        return "attention"
    if _GEMM.search(name):
        return "other_gemm"  # the LM head, and any projection a maintained kernel does not cover
    if _ELEMENTWISE.search(name):
        return "norm_rotary_elementwise"
    return "other"


def _frames(event) -> list[str]:  # noqa: ANN001 (a profiler FunctionEvent)
    """Where an operator ran from: its recorded stack, else the Python functions the profiler saw around it."""
    frames = list(event.stack or [])
    parent = event.cpu_parent
    while parent is not None:
        frames.append(parent.name)
        parent = parent.cpu_parent
    return frames


def _profile(run: Run, requests: list[GenerationRequest], cuda: bool) -> dict[str, tuple[int, float]]:
    """Per class: (kernels, microseconds) of running `requests` to the end."""
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, with_stack=True, acc_events=True) as prof:
        run(requests)
        if cuda:
            torch.cuda.synchronize()
    counts: Counter[str] = Counter()
    micros: Counter[str] = Counter()
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        stack = _frames(event)
        if cuda:
            for kernel in event.kernels:
                kind = kernel_class(kernel.name, stack)
                counts[kind] += 1
                micros[kind] += kernel.duration
        elif event.name.startswith("aten::") and event.self_cpu_time_total > 0:
            kind = kernel_class(event.name, stack)
            counts[kind] += 1
            micros[kind] += event.self_cpu_time_total
    return {kind: (counts[kind], micros[kind]) for kind in CLASSES}


def kernel_census(run: Run, device: str, requests: list[GenerationRequest], steps: int = 4) -> dict:
    """Kernels and milliseconds per decode step of `requests` run together by `run`, by class, with totals."""
    cuda = device == "cuda"
    requests = [dataclasses.replace(r, max_new_tokens=steps + 1) for r in requests]
    run(requests)  # warm-up
    one = _profile(run, [dataclasses.replace(r, max_new_tokens=1) for r in requests], cuda)
    full = _profile(run, requests, cuda)
    classes = {kind: {"kernels_per_step": (full[kind][0] - one[kind][0]) / steps,
                      "ms_per_step": (full[kind][1] - one[kind][1]) / steps / 1000} for kind in CLASSES}
    return {"rows": len(requests), "steps": steps, "what": "CUDA kernels" if cuda else "CPU operators (own time)",
            "classes": classes,
            "kernels_per_step": sum(c["kernels_per_step"] for c in classes.values()),
            "ms_per_step": sum(c["ms_per_step"] for c in classes.values())}
