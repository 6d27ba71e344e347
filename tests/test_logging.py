"""Log lines: what the service's processes print is true of the service."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from shared.logs import MISLEADING


def test_a_library_line_untrue_of_the_project_is_dropped_and_its_logger_still_speaks(
        caplog: pytest.LogCaptureFixture) -> None:
    import worker  # noqa: F401  (the serving side installs the filter as it is imported)

    [(name, start)] = MISLEADING.items()
    with caplog.at_level(logging.WARNING, logger=name):
        logging.getLogger(name).warning("%s: no network. Please make sure you already `pip install kernels`", start)
        logging.getLogger(name).warning("another warning")
    assert [record.getMessage() for record in caplog.records] == ["another warning"]


@pytest.mark.parametrize("module", ["worker.model.loading", "modellab.evaluation"])
def test_loading_the_model_libraries_prints_no_hub_kernel_warning(module: str) -> None:
    """bitsandbytes logs that warning as it is imported, on CPUs with AVX512-BF16 (elsewhere it has nothing to say)."""
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120,
                          check=True)
    assert "gemm_4bit_forward" not in done.stderr
