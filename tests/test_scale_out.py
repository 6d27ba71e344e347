"""`kevlaya scale-out` on the CPU: real Redis, API and two worker processes on a tiny random model; every phase's
jobs must end exactly once, the killed worker's on the survivor, and the figures, the plot and the table be written.
The CLI refuses what it cannot run before it starts anything."""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from modellab.bench.scale_out import WAKE_AND_CLAIM_S, Kill, kill_problems

pytestmark = pytest.mark.integration

JOBS = 24
LEASE_S = 8


def test_two_cpu_workers_scale_out_and_a_killed_one_loses_and_repeats_nothing(tmp_path: Path) -> None:
    out = tmp_path / "scale-out.json"
    command = [os.sys.executable, "-m", "cli", "scale-out", "--device", "cpu", "--shape", "tiny", "--gpus", "2",
               "--jobs", str(JOBS), "--kev-tokens", "24", "--laya-tokens", "8", "--max-batch", "4",
               "--lease-seconds", str(LEASE_S), "--sweep-interval", "1", "--workdir", str(tmp_path / "work"),
               "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["command"].startswith("kevlaya scale-out --device cpu") and result["complete"] is True
    assert (result["device"], result["shape"], result["workers"], result["database"]) == ("cpu", "tiny", 2, "SQLite")
    assert result["ledger"]["lease_s"] == LEASE_S and result["ledger"]["sweep_every_s"] == 1
    assert result["service_settings"]["OMP_NUM_THREADS"] == "1"  # one thread each: the workers share two cores

    phases = result["phases"]
    assert list(phases) == ["one_worker", "all_workers", "kill"]
    for name, phase in phases.items():
        assert phase["exactly_once"] is True and set(phase["problems"].values()) == {0}, (name, phase["problems"])
        assert (phase["jobs"], phase["pending"], phase["failed"], phase["lost"], phase["duplicated"]) == (JOBS, 0, 0,
                                                                                                         0, 0)
        assert phase["jobs_per_s"] > 0 and sum(phase["jobs_by_worker"].values()) == JOBS
    assert phases["one_worker"]["jobs_by_worker"] == {"worker-0": JOBS}
    assert set(phases["all_workers"]["jobs_by_worker"]) <= {"worker-0", "worker-1"}
    assert result["speedup"] == round(phases["all_workers"]["jobs_per_s"] / phases["one_worker"]["jobs_per_s"], 3)
    assert result["checks"] == {**{f"{name}_exactly_once": True for name in phases},
                                "kill_claimed_again_within_lease": True} and result["ok"] is True

    kill = phases["kill"]["kill"]
    assert kill["worker"] == "worker-1" and kill["held_jobs"] >= 1  # it died holding claimed jobs
    assert kill["held_finished_by"] == {"worker-0": kill["held_jobs"]}  # every one of them, on the survivor
    assert 0 < kill["lease_expired_s"] <= kill["claimed_again_s"] <= kill["recovery_s"]
    bound = LEASE_S + result["ledger"]["sweep_every_s"] + WAKE_AND_CLAIM_S
    assert kill["lease_and_sweep_s"] == bound and kill["within_lease"] is (kill["claimed_again_s"] <= bound) is True
    assert len(kill["held_finished_s"]) == kill["held_jobs"]

    assert Path(result["plot"]) == out.with_suffix(".png")
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = done.stdout.strip().splitlines()
    assert table[-1] == "checks: all passed"
    assert any(line.startswith("kill: worker-1 SIGKILLed") for line in table)
    assert any(line.startswith("speedup, 2 workers over 1:") for line in table)


def row(id_: str, batch: str, attempts: int = 1) -> SimpleNamespace:
    return SimpleNamespace(id=id_, status="succeeded", attempts=attempts, batch_id=batch, parent_job_id=None,
                           adapter="kev")


def group(worker: str, size: int, finished: bool = True) -> SimpleNamespace:
    return SimpleNamespace(worker=worker, size=size, finished_at=1 if finished else None)


def test_the_kill_explains_a_second_run_of_what_it_held_and_nothing_else() -> None:
    """The killed worker's group never finished: one job it stored before it died stays in it, the one it held ran
    again in the survivor's group. A job run twice to completion, or a second attempt of a job it did not hold, is
    still a problem."""
    groups = {"dead": group("w1", 2, finished=False), "live": group("w0", 2)}
    rows = [row("stored", "dead"), row("held", "live", attempts=2), row("plain", "live")]
    once = Counter({"stored": 1, "held": 1, "plain": 1})
    kill = Kill(1, "w1", at=None, held={"held": None})
    checked = kill_problems(rows, groups, ["stored", "held", "plain"], once, kill)
    assert checked["exactly_once"] is True and checked["stored_by_the_killed_worker_before"] == 1

    twice = kill_problems(rows, {**groups, "again": group("w0", 1)}, ["stored", "held", "plain"], once, kill)
    assert twice["exactly_once"] is False and twice["problems"]["runs_minus_jobs"] == 1

    retried = [row("stored", "dead"), row("held", "live", attempts=2), row("plain", "live", attempts=2)]
    assert kill_problems(retried, groups, ["stored", "held", "plain"], once, kill)["problems"][
        "attempts_not_expected"] == 1

    on_the_dead = {"dead": group("w1", 2, finished=False), "live": group("w0", 1), "late": group("w1", 1)}
    late = [row("stored", "dead"), row("held", "late", attempts=2), row("plain", "live")]
    assert kill_problems(late, on_the_dead, ["stored", "held", "plain"], once, kill)["problems"][
        "held_not_finished_by_a_survivor"] == 1

    nothing = kill_problems([row("plain", "live")], {"live": group("w0", 1)}, ["plain"], Counter({"plain": 1}),
                            Kill(1, "w1"))
    assert nothing["exactly_once"] is False and nothing["problems"]["kill_held_nothing"] == 1


@pytest.mark.parametrize(("arguments", "message"), [
    (["--gpus", "1"], "needs at least 2 workers"),
    (["--gpus", "0"], "--gpus"),
    (["--device", "cuda", "--gpus", "4096"], "--gpus 4096 on cuda needs 4096 GPU(s)"),
    (["--device", "tpu"], "must be auto, cuda or cpu"),
    (["--device", "cpu", "--shape", "qwen-9000"], "must be one of tiny"),
    (["--device", "cpu", "--prompt-min", "300", "--prompt-max", "200"], "--prompt-min <= --prompt-max"),
    (["--device", "cpu", "--lease-seconds", "0"], "must be > 0"),
])
def test_what_the_command_cannot_run_is_refused_before_anything_starts(tmp_path: Path, arguments: list[str],
                                                                      message: str) -> None:
    done = subprocess.run([os.sys.executable, "-m", "cli", "scale-out", *arguments, "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in " ".join(done.stderr.replace("│", " ").split()), done.stderr
    assert not any(tmp_path.iterdir())  # no model, database or log: nothing was started
