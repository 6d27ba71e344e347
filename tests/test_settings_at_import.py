"""Settings are read when an app or a worker is built, never at import: a broken environment must not break
importing a module (a test collector, a tool, `kevlaya --help`), and building must fail with the field named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BROKEN = {"KEVLAYA_ENGINE__MAX_BATCH": "not-a-number"}
# Importing it builds the worker's Celery app (`celery -A worker.tasks`), so it reads the settings.
BUILDS_AN_APP = {"worker.tasks"}


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, **BROKEN})


def modules() -> list[str]:
    names = []
    for package in ("shared", "api", "worker", "modellab", "cli"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__main__":  # runs a command
                continue
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return [name for name in names if name not in BUILDS_AN_APP]


def test_every_module_imports_with_a_broken_setting():
    names = modules()
    assert {"shared.celeryconfig", "shared.queue", "api.main", "cli.main"} <= set(names)
    done = python(f"import importlib\nfor name in {names!r}:\n    importlib.import_module(name)\nprint('imported')")
    assert done.returncode == 0 and done.stdout.strip() == "imported", done.stderr[-3000:]


@pytest.mark.parametrize("build", [
    "from api.main import create_app; create_app()",
    "from shared.queue import celery_app; celery_app()",
    "import worker.tasks",
])
def test_building_an_app_with_a_broken_setting_fails_naming_it(build: str):
    done = python(build)
    assert done.returncode != 0
    assert "validation error for Settings" in done.stderr, done.stderr[-3000:]
    assert "max_batch" in done.stderr and "not-a-number" in done.stderr, done.stderr[-3000:]
