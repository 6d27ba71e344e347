"""The flat variable names of the release before the groups (`KEVLAYA_API_PORT`) still set their grouped fields
(`api.port`) for one release, from the environment and from `.env`, each with a `FutureWarning` naming the new
variable; where the new variable is set too, the new one wins. The only test that uses the old names."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pydantic
import pytest

from shared.settings import FLAT_NAMES, Settings

ROOT = Path(__file__).resolve().parents[1]


def built(**kwargs: object) -> tuple[Settings, list[str]]:
    """The settings and the FutureWarnings building them gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settings = Settings(**kwargs)
    return settings, [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


def test_an_old_name_sets_its_grouped_field_and_the_warning_names_the_new_one(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KEVLAYA_API_PORT", "9001")
    monkeypatch.setenv("KEVLAYA_MAX_BATCH", "7")
    monkeypatch.setenv("KEVLAYA_ENGINE_WINDOW_TOKENS", "512")
    settings, caught = built(_env_file=None)
    assert "KEVLAYA_API_PORT is deprecated; use KEVLAYA_API__PORT" in caught
    assert (settings.api.port, settings.engine.max_batch, settings.engine.window_tokens) == (9001, 7, 512)
    assert settings.api.host == "127.0.0.1"  # the rest of the group keeps its defaults


def test_every_old_name_set_warns_once_naming_its_new_variable(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KEVLAYA_API_PORT", "9001")
    monkeypatch.setenv("KEVLAYA_STREAM_KEEP_S", "30")
    monkeypatch.setenv("KEVLAYA_DEVICE", "cpu")
    _, caught = built(_env_file=None)
    assert sorted(caught) == ["KEVLAYA_API_PORT is deprecated; use KEVLAYA_API__PORT",
                              "KEVLAYA_DEVICE is deprecated; use KEVLAYA_MODEL__DEVICE",
                              "KEVLAYA_STREAM_KEEP_S is deprecated; use KEVLAYA_STREAMS__KEEP_S"]


def test_the_new_name_wins_over_the_old_one(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KEVLAYA_API_PORT", "9001")
    monkeypatch.setenv("KEVLAYA_API__PORT", "9002")
    settings, caught = built(_env_file=None)
    assert settings.api.port == 9002
    assert caught == ["KEVLAYA_API_PORT is deprecated and ignored: KEVLAYA_API__PORT is set"]


def test_old_names_in_dotenv_work_and_the_new_name_wins_wherever_it_is_set(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    dotenv = tmp_path / ".env"
    dotenv.write_text("KEVLAYA_SWEEP_INTERVAL_S=4\nKEVLAYA_LEASE_SECONDS=20\nKEVLAYA_BATCH_LEASE_S=5\n"
                      "KEVLAYA_BATCH__LEASE_S=6\n")
    monkeypatch.setenv("KEVLAYA_LEASE_SECONDS", "30")  # the environment over .env, as for the new names
    monkeypatch.setenv("KEVLAYA_RELIABILITY__SWEEP_INTERVAL_S", "2")  # a new name in the environment over an old one
    settings, caught = built(_env_file=dotenv)
    assert settings.reliability.sweep_interval_s == 2
    assert settings.reliability.lease_seconds == 30
    assert settings.batch.lease_s == 6
    assert "KEVLAYA_LEASE_SECONDS (in .env) is deprecated; use KEVLAYA_RELIABILITY__LEASE_SECONDS" in caught
    assert "KEVLAYA_SWEEP_INTERVAL_S (in .env) is deprecated and ignored: " \
           "KEVLAYA_RELIABILITY__SWEEP_INTERVAL_S is set" in caught
    assert "KEVLAYA_BATCH_LEASE_S (in .env) is deprecated and ignored: KEVLAYA_BATCH__LEASE_S is set" in caught


def test_unknown_variables_stay_ignored_without_a_warning(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("KEVLAYA_NO_SUCH_SETTING", "1")
    monkeypatch.setenv("KEVLAYA_API__NO_SUCH_SETTING", "1")
    (tmp_path / ".env").write_text("KEVLAYA_NOR_THIS=1\n")
    settings, caught = built(_env_file=tmp_path / ".env")
    assert caught == []
    assert settings.api.port == Settings(_env_file=None).api.port


def test_an_old_name_is_validated_as_its_field(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KEVLAYA_MAX_BATCH", "0")
    with pytest.warns(FutureWarning), pytest.raises(pydantic.ValidationError, match=r"engine\.max_batch"):
        Settings(_env_file=None)
    monkeypatch.setenv("KEVLAYA_MAX_BATCH", "4")
    monkeypatch.setenv("KEVLAYA_API_KEY", "")  # empty is unset, as for the new name
    monkeypatch.setenv("KEVLAYA_API_MAX_CONNECTIONS", "")
    with pytest.warns(FutureWarning):
        settings = Settings(_env_file=None)
    assert settings.api.key is None and settings.connections.max is None


def test_every_old_name_is_read(monkeypatch: pytest.MonkeyPatch):
    """Each of the old names, set to its field's default, is read (one warning each) and changes nothing."""
    defaults = Settings(_env_file=None)
    expected = []
    for old, target in FLAT_NAMES.items():
        group, name = target.split(".")
        value = getattr(getattr(defaults, group), name)
        if value is None:
            continue
        monkeypatch.setenv(f"KEVLAYA_{old.upper()}", str(value).lower() if isinstance(value, bool) else str(value))
        monkeypatch.delenv(f"KEVLAYA_{group.upper()}__{name.upper()}", raising=False)
        expected.append(f"KEVLAYA_{old.upper()} is deprecated; use KEVLAYA_{group.upper()}__{name.upper()}")
    settings, caught = built(_env_file=None)
    assert sorted(caught) == sorted(expected)
    assert settings == defaults


def test_an_operator_sees_the_warning_at_startup():
    """With Python's own warning filters (no pytest), building the settings prints the warning on stderr."""
    env = {**os.environ, "KEVLAYA_API_PORT": "9001"}
    done = subprocess.run([sys.executable, "-c", "from shared.settings import get_settings; "
                           "print(get_settings().api.port)"], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "9001"
    assert "FutureWarning: KEVLAYA_API_PORT is deprecated; use KEVLAYA_API__PORT" in done.stderr
