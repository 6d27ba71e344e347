"""What the decoder's Triton kernels (fused_rotary.py, lora_expand.py, nf4_matmul.py) share: whether Triton is
installed, and whether a kernel builds and runs on a device, tried once per process. Triton builds each kernel's
launcher with the machine's C compiler on first use, so a machine without one (a slim image), or a GPU Triton
does not drive, fails there; the decoder then serves through the operations the kernel replaces."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable

import torch

log = logging.getLogger("kevlaya.decoder")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def runs(trial: Callable[[torch.device], object], device: torch.device, kernel: str, otherwise: str) -> bool:
    """Whether `trial` (a tiny call of `kernel`) runs on `device`; if not, the log says why and what serves
    `otherwise`. Callers cache the answer per device."""
    if not triton_available():
        return False
    try:
        trial(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 (any failure to build or launch means: not here)
        reason = str(exc).splitlines()[0] if str(exc) else ""
        log.warning("the %s does not run on %s (%s: %s); %s", kernel, device, type(exc).__name__, reason, otherwise)
        return False
    return True
