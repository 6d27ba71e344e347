"""modellab/tool_choice_check.py against a real API and worker on a tiny random-weight model: every tool_choice
mode is enforced on every call (the figures of 200 calls a mode are in modellab/bench/results/tool-choice-*/)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import API_KEY, start_worker

# a real API and worker, on SQLite (the check is the client's: the database plays no part)
service = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


@pytest.fixture(scope="module")
def long_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tests' tiny shape with a context of 8,192 positions: its tokenizer takes a token a byte, and the check's
    four tools in the system prompt (about 1,700 bytes) with up to 8 calls (1,200) overflow the tiny shape's 2,048."""
    from modellab import model_factory

    config_class, shape = model_factory.SHAPES["tiny"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(model_factory.SHAPES, "tiny-long", (config_class, {**shape, "max_position_embeddings": 8192}))
        return model_factory.build_random_model(tmp_path_factory.mktemp("models"), "tiny-long", seed=0)


@pytest.fixture
def env(env: dict[str, str], long_tiny_model: dict[str, Path]) -> dict[str, str]:
    return {**env, "KEVLAYA_MODEL__BASE": str(long_tiny_model["base"]), "KEVLAYA_KEV__PATH": str(long_tiny_model["kev"]),
            "KEVLAYA_LAYA__PATH": str(long_tiny_model["laya"]), "KEVLAYA_ENGINE__WINDOW_TOKENS": "4096",
            "KEVLAYA_LIMITS__MAX_NEW_TOKENS": "2048"}


def check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "modellab.tool_choice_check", *args], capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])


def test_the_help_names_its_options():
    shown = check("--help")
    assert shown.returncode == 0, shown.stderr
    for option in ("--base-url", "--api-key", "--calls", "--model", "--out"):
        assert option in shown.stdout


@pytest.mark.integration
@service
def test_every_mode_is_enforced_on_every_call(env, api, start_process, tmp_path):
    start_worker(start_process, env, api)
    out = tmp_path / "results.json"
    ran = check("--base-url", f"http://127.0.0.1:{env['KEVLAYA_API__PORT']}/v1", "--api-key", API_KEY,
                "--calls", "4", "--model", "laya", "--max-tokens", "1200", "--out", str(out))
    assert ran.returncode == 0, ran.stdout + ran.stderr
    results = json.loads(out.read_text())
    assert API_KEY not in out.read_text()
    assert results["command"].startswith("python -m modellab.tool_choice_check --base-url http://127.0.0.1:")
    assert "--api-key HIDDEN --calls 4 --model laya" in results["command"]
    assert set(results["modes"]) == {"auto", "none", "required", "named"} and results["all_valid"]
    for mode, counts in results["modes"].items():
        assert (counts["calls"], counts["valid"], counts["valid_percent"]) == (4, 4, 100.0), (mode, counts)
    for mode in ("required", "named"):
        assert results["modes"][mode]["answers"] == {"calls": 4}
    # named: each of the four tools named once, and only it called
    assert set(results["modes"]["named"]["functions_called"]) == {"weather", "book", "pay", "ticket"}
    assert results["modes"]["none"]["answers"] == {"text": 4}


@pytest.mark.integration
@service
def test_a_call_cut_short_is_counted_as_a_failure(env, api, start_process, tmp_path):
    """The check fails what it should: max_tokens too short for a whole call leaves none under required."""
    start_worker(start_process, env, api)
    out = tmp_path / "results.json"
    ran = check("--base-url", f"http://127.0.0.1:{env['KEVLAYA_API__PORT']}/v1", "--api-key", API_KEY,
                "--calls", "2", "--modes", "required,auto", "--max-tokens", "20", "--out", str(out))
    assert ran.returncode == 1, ran.stdout + ran.stderr
    required = json.loads(out.read_text())["modes"]["required"]
    assert required["valid"] == 0 and required["finish_reasons"] == {"length": 2}
    assert required["failures"][0]["problems"][0].startswith("no tool call (finish_reason 'length'")
