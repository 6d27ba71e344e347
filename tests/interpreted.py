"""Triton kernels run by Triton's interpreter on the CPU, for their tests."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_interpreted(script: str) -> subprocess.CompletedProcess:
    """`script` in a Python process of its own with TRITON_INTERPRET=1: Triton reads it when a kernel is defined,
    at import, so it cannot be set in the test's own process."""
    pytest.importorskip("triton", reason="Triton is a development dependency on Linux x86-64 (pyproject.toml)")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
