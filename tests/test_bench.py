"""`kevlaya bench` end to end on the CPU with the tiny model: the instrument itself must keep working."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from worker.generation import GenerationRequest


def test_bench_runs_the_recipe_and_the_service_and_writes_its_results(redis_server, tmp_path: Path) -> None:  # noqa: ANN001
    kevlaya = str(Path(os.sys.executable).parent / "kevlaya")
    out = tmp_path / "results"
    command = [kevlaya, "bench", "--shape", "tiny", "--device", "cpu", "--jobs", "6", "--kev-tokens", "12",
               "--laya-tokens", "4", "--recipe-jobs", "1", "--latency-samples", "2", "--fit", "2", "--pair-rounds", "2",
               "--stream-jobs", "2",
               "--out", str(out), "--workdir", str(tmp_path / "work"), "--redis-url", redis_server.url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "KEVLAYA_BENCH_MARKER": "1", "KEVLAYA_ENGINE__PREFILL_SHARE": "0.5"})
    assert done.returncode == 0, done.stderr[-3000:]
    [json_path] = out.glob("tiny-*.json")
    assert json_path.with_suffix(".png").stat().st_size > 0
    result = json.loads(json_path.read_text())
    assert result["complete"] is True and not list(out.glob("*.tmp"))  # saved after each phase, then whole
    assert result["command"].startswith("kevlaya bench --shape tiny")
    seed = result["seed_scheme"]
    assert seed["jobs_per_s"] > 0 and seed["timed_jobs"] == 2
    service = result["service"]
    assert service["jobs_per_s"] > 0 and service["speedup_vs_seed"] == service["jobs_per_s"] / seed["jobs_per_s"]
    assert service["failed_jobs"] == 0 and service["oom_events"] == 0
    assert service["mean_group_size"] > 1  # the worker claimed what was queued together
    assert len(service["laya_ms_idle"]) == len(service["laya_ms_under_kev_load"]) == 2
    assert service["laya_p95_ms_under_kev_load"] >= service["laya_p50_ms_under_kev_load"] > 0
    assert [f["load"] for f in service["fit"]] == [2] and service["fit"][0]["failed_jobs"] == 0
    assert 1 <= service["most_in_flight"] <= 6 and service["fit"][0]["most_in_flight"] >= 1
    for when in ("idle", "under_kev_load"):  # each Laya sample's wait for a slot and for its first token
        ttft, total = service[f"laya_ttft_ms_{when}"], service[f"laya_ms_{when}"]
        assert all(0 <= q <= t <= e for q, t, e in zip(service[f"laya_queue_ms_{when}"], ttft, total))
        later = service[f"laya_ms_per_later_token_{when}"]  # what each token after the first took
        assert len(later) == 2 and all(ms > 0 for ms in later)
    # where the engine's time went while Laya ran under Kev load, from the worker's /metrics
    phases = service["engine_phases_under_kev_load"]
    assert phases["step"]["count"] > 0 and phases["step"]["mean_ms"] > 0 and phases["store"]["count"] > 0
    # the decode steps launched
    assert phases["steps"]["count"] > 0
    # of each step, the host's wait for the GPU's tokens (on a CPU the forward pass computes before the read)
    assert phases["wait"]["count"] == phases["step"]["count"]
    assert 0 < phases["wait"]["total_s"] < phases["step"]["total_s"]
    assert result["environment"]["KEVLAYA_BENCH_MARKER"] == "1"  # the settings the service inherited
    assert result["engine_settings"]["prefill_share"] == 0.5  # from the environment, as the worker reads it
    assert service["slots"] >= 1
    # the same workload with every row under the decision grammar, with its steps' cost beside the free run's
    # and with every row forced to call the workload's tool, against free runs from the same prompts
    for name in ("decision_grammar", "tool_call_grammar"):
        pairs = service[name]
        assert [len(runs) for runs in pairs["runs"].values()] == [2, 2]  # free and constrained, in turn
        assert pairs["jobs_per_s_vs_free"] == pairs["grammar"]["jobs_per_s"] / pairs["free"]["jobs_per_s"]
        assert pairs["grammar"]["step_ms"] > 0 and pairs["step_ms_vs_free"] > 0
    # the peer on the same model and jobs, and the service against it
    peer = result["peer"]
    assert peer["jobs"] == 6 and peer["generated_tokens"] == 3 * 12 + 3 * 4  # every job wrote all its tokens
    assert service["speedup_vs_peer"] == service["jobs_per_s"] / peer["jobs_per_s"]
    assert result["workload"]["lora_targets"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"]
    # the census of a decode step: every LoRA layer, attention and the rest, each counted per step
    census = service["census"]["classes"]
    assert census["lora"]["kernels_per_step"] > 0 and census["attention"]["kernels_per_step"] > 0
    assert service["census"]["ms_per_step"] == sum(c["ms_per_step"] for c in census.values())
    # and that class by kernel (here: operator) name, dearest first
    top = service["census"]["elementwise_by_time"]
    assert top and all(name.startswith("aten::") and kernels > 0 for name, kernels, _ in top)
    assert [ms for _, _, ms in top] == sorted((ms for _, _, ms in top), reverse=True)
    # the same Kev jobs with no client and with an SSE client each, alternately: every client saw the stored text,
    # and each first delta's delay from the worker's first token was measured
    streaming = service["streaming"]
    assert [len(runs) for runs in streaming["runs"].values()] == [2, 2] and streaming["jobs"] == 2
    assert streaming["mismatches"] == 0 and streaming["problems"] == {}
    delays = [ms for run in streaming["runs"]["streamed"] for ms in run["first_delta_ms"]]
    assert len(delays) == 4 and all(ms is not None and ms >= 0 for ms in delays)
    assert streaming["first_delta_ms"]["samples"] == 4 and streaming["first_delta_ms"]["p95"] is not None
    # and apart, the first deltas that carry the first token alone (the stream's own delay, not more steps)
    tokens = [n for run in streaming["runs"]["streamed"] for n in run["first_delta_tokens"]]
    alone = streaming["first_delta_ms_first_token_alone"]
    assert alone["samples"] == tokens.count(1) and (alone["samples"] == 0 or alone["p95"] is not None)
    assert streaming["jobs_per_s_vs_free"] > 0 and streaming["step_ms_vs_free"] > 0
    table = done.stdout[done.stdout.index("written "):]  # the table, printed last
    assert "recipe" in table and "service" in table and "speedup vs the recipe's scheme" in table
    assert "decision grammar" in table and "speedup vs the peer" in table and "census of one" in table
    assert "first delta after first token" in table


def test_jobs_in_flight_are_counted_from_their_start_and_finish_times() -> None:
    from datetime import datetime, timedelta

    from modellab.bench.run import most_in_flight
    from modellab.bench.service import JobRow

    t0 = datetime(2026, 1, 1)

    def job(start: float, end: float | None) -> JobRow:
        return JobRow(id="x", adapter="kev", status="succeeded", error_code=None, created_at=t0,
                      started_at=t0 + timedelta(seconds=start),
                      finished_at=None if end is None else t0 + timedelta(seconds=end), total_ms=None, ttft_ms=None,
                      queue_ms=None,
                      batch_id=None)

    # three overlap in [2, 3); one that starts when another ends takes its place, not a fifth slot
    assert most_in_flight([job(0, 3), job(1, 4), job(2, 5), job(3, 6), job(6, 7)]) == 3
    assert most_in_flight([job(0, 1), job(1, 2)]) == 1
    assert most_in_flight([job(0, None)]) == 0 and most_in_flight([]) == 0


def test_the_decode_busy_fraction_keeps_each_runs_least_time_so_one_stall_does_not_skew_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The busy fraction is a difference of two runs (all tokens, one token). A stall of the one-token run made
    decode look faster than its own kernels (a fraction over 1 in an H200 run): each run is now repeated and its
    least time kept. Here the machine's runs are scripted (kernel s, wall s), with a stall in the first
    one-token run and in the second whole run."""
    from modellab.bench import profile

    steps, one, whole = 16, (0.20, 0.25), (0.36, 0.43)
    profiled = iter([(one[0], one[1] + 0.05), whole, one, (whole[0], whole[1] + 0.04), one, whole])
    plain = iter([(one[1] + 0.05, 0.001), (whole[1], 0.002), (one[1], 0.001), (whole[1], 0.002),
                  (one[1], 0.001), (whole[1] + 0.04, 0.002)])
    monkeypatch.setattr(profile, "_kernels_and_wall", lambda run, requests: next(profiled))
    monkeypatch.setattr(profile, "_unprofiled", lambda run, requests: next(plain))
    request = GenerationRequest(job_id=uuid.uuid4(), adapter="kev", messages=[{"role": "user", "content": "hi"}],
                                max_new_tokens=8, temperature=0.0, top_p=1.0, seed=None)
    figures = profile.decode_busy_fraction(lambda requests: None, "cuda", [request], steps=steps)
    decode_kernels, decode_wall = whole[0] - one[0], whole[1] - one[1]
    assert figures["busy_fraction"] == pytest.approx(decode_kernels / decode_wall) and figures["busy_fraction"] < 1
    assert figures["step_ms"] == pytest.approx(decode_wall / steps * 1000)
    assert figures["step_ms_unprofiled"] == pytest.approx(decode_wall / steps * 1000)
    assert figures["prefill_ms_unprofiled"] == pytest.approx(one[1] * 1000)


def test_slot_fit_refuses_a_machine_without_cuda_before_building_anything(tmp_path: Path) -> None:
    """`python -m modellab.bench.slot_fit` measures CUDA memory: without a GPU it says so, exits 2 and writes
    nothing."""
    import sys

    run = subprocess.run([sys.executable, "-m", "modellab.bench.slot_fit", "--out", str(tmp_path / "fit.json")],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 2 and "no CUDA device" in run.stderr, run.stderr
    assert not (tmp_path / "fit.json").exists()


@pytest.mark.parametrize("args, hint", [([], "no CUDA device"), (["--rows", "1,65"], "--rows"),
                                        (["--shape", "tiny"], "--shape")])
def test_the_nf4_kernel_bench_refuses_what_it_cannot_time_and_writes_nothing(tmp_path: Path, args: list[str],
                                                                             hint: str) -> None:
    """`python -m modellab.bench.nf4_kernel` times CUDA kernels for 1 to 64 rows on a real shape: anything else is
    refused with exit 2, naming the option, before a weight is built."""
    import sys

    run = subprocess.run([sys.executable, "-m", "modellab.bench.nf4_kernel", "--out", str(tmp_path / "k.json"),
                          *args], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 2 and hint in run.stderr, run.stderr
    assert not (tmp_path / "k.json").exists()


def test_the_census_classes_the_decoders_own_triton_kernels_by_name() -> None:
    """Triton kernels are launched from Python, by no operator: the census places them by name alone (the NF4
    matmul, the LoRA expand, the rotary embedding), and a GEMM by the range it ran in (a LoRA product) or not
    (the LM head)."""
    from modellab.bench.census import LORA_RANGE, kernel_class

    assert kernel_class("_nf4_matmul_kernel", []) == "nf4_matmul"
    assert kernel_class("_masked_expand_kernel", []) == "lora"
    assert kernel_class("_rotary_kernel", []) == "norm_rotary_elementwise"
    assert kernel_class("sm90_xmma_gemm_f16f16_f16f32", [LORA_RANGE]) == "lora"
    assert kernel_class("sm90_xmma_gemm_f16f16_f16f32", ["aten::mm"]) == "other_gemm"


def _frame(path: str, line: int, name: str) -> dict[str, object]:
    return {"filename": path, "line": line, "name": name}


def test_the_memory_census_finds_the_peak_of_live_allocations_and_sums_them_by_source_line() -> None:
    """`python -m modellab.bench.memory_census` reads PyTorch's allocator trace: the allocations alive when the most
    bytes were (not at the end, nor the largest ever made), summed by the project's line that made them."""
    from modellab.bench.memory_census import by_source, live_at_peak, pools

    join = [_frame("/srv/worker/decoder/kernels/fused_projections.py", 51, "_share_storage"),
            _frame("/usr/lib/python3/site-packages/torch/functional.py", 9, "cat")]
    prefill = [_frame("/srv/worker/decoder/kernels/nf4_matmul.py", 400, "sliced_matmul"),
               _frame("/usr/lib/python3/site-packages/bitsandbytes/functional.py", 7, "dequantize_4bit")]
    trace = [{"action": "alloc", "addr": 1, "size": 100, "frames": join},
             {"action": "alloc", "addr": 2, "size": 30, "frames": prefill},
             {"action": "alloc", "addr": 3, "size": 30, "frames": prefill},  # the peak: 160 bytes alive
             {"action": "free_completed", "addr": 2, "size": 30},
             {"action": "free_completed", "addr": 3, "size": 30},
             {"action": "alloc", "addr": 4, "size": 50, "frames": prefill},  # larger alone, never at the peak
             {"action": "free_completed", "addr": 4, "size": 50}]
    peak, alive = live_at_peak(trace)
    assert peak == 160 and sorted(size for size, _ in alive) == [30, 30, 100]
    rows = by_source(alive, top=5)
    assert [(row["allocations"], row["where"].split(" <- ")[0]) for row in rows] == [
        (1, "kernels/fused_projections.py:51 _share_storage"), (2, "kernels/nf4_matmul.py:400 sliced_matmul")]
    assert rows[1]["where"].endswith("bitsandbytes/functional.py:7 dequantize_4bit")
    segments = [{"segment_pool_id": (0, 0), "total_size": 4 * 2**20, "allocated_size": 2**20},
                {"segment_pool_id": (1, 0), "total_size": 2 * 2**20, "allocated_size": 0},
                {"segment_pool_id": (0, 0), "total_size": 2**20, "allocated_size": 2**20}]
    assert pools(segments) == [{"pool": "(0, 0)", "segments": 2, "reserved_mib": 5.0, "allocated_mib": 2.0},
                               {"pool": "(1, 0)", "segments": 1, "reserved_mib": 2.0, "allocated_mib": 0.0}]


def test_the_memory_census_refuses_a_machine_without_cuda_before_building_anything(tmp_path: Path) -> None:
    import sys

    run = subprocess.run([sys.executable, "-m", "modellab.bench.memory_census", "--out", str(tmp_path / "m.json")],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 2 and "no CUDA device" in run.stderr, run.stderr
    assert not (tmp_path / "m.json").exists()


def test_the_queue_look_bench_times_the_engines_look_on_a_filled_database(tmp_path: Path) -> None:
    """`python -m modellab.bench.queue_look` fills a database and times `queue_snapshot`; a queued count over the
    jobs is refused before anything is written."""
    import sys

    refused = subprocess.run([sys.executable, "-m", "modellab.bench.queue_look", "--jobs", "5", "--queued", "6",
                              "--out", str(tmp_path / "refused.json")], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--queued" in refused.stderr
    assert not (tmp_path / "refused.json").exists()
    url = f"sqlite:///{tmp_path}/look.db"
    run = subprocess.run([sys.executable, "-m", "modellab.bench.queue_look", "--jobs", "50", "--queued", "7",
                          "--looks", "5", "--rounds", "2", "--database-url", url, "--out", str(tmp_path / "l.json")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((tmp_path / "l.json").read_text())
    assert (result["database"], result["jobs"], result["queued"], len(result["rounds_ms"])) == ("sqlite", 50, 7, 2)
    assert result["ms_per_look"] > 0


def test_a_run_shorter_than_the_gap_between_two_processes_clocks_still_takes_positive_time() -> None:
    from datetime import datetime, timedelta, timezone

    from modellab.bench.run import _seconds
    from modellab.bench.service import JobRow

    created = datetime(2026, 12, 7, 12, tzinfo=timezone.utc)  # the API's reading: a little after the worker's
    started, finished = created - timedelta(milliseconds=80), created - timedelta(milliseconds=20)
    rows = [JobRow(str(i), "laya", "succeeded", None, created, started, finished + timedelta(milliseconds=i),
                   None, None, None, None) for i in range(3)]
    assert _seconds(rows) == pytest.approx(0.062)  # the worker's own first start to its last end
    rows[0].created_at = started - timedelta(seconds=1)  # clocks agreeing: from the first creation, as before
    assert _seconds(rows) == pytest.approx(1.062)
