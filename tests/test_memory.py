"""The VRAM budget (worker/memory.py) on plain numbers: slots from the arithmetic, then from a measured peak."""

from __future__ import annotations

from worker.memory import SlotBudget, after_prefill_out_of_memory, after_step_out_of_memory, kv_bytes_per_token


def test_slots_come_from_the_budget_arithmetic():
    # Qwen2.5-3B: 36 layers, 2 key/value heads of 128, fp16: 36 KiB per token
    per_token = kv_bytes_per_token(36, 2, 128, 2)
    assert per_token == 36 * 1024
    budget = SlotBudget(budget_bytes=int(5.5 * 2**30), resident_bytes=int(1.94 * 2**30),
                        workspace_bytes=2**29, kv_per_token=per_token, window=1024)
    spare = int(5.5 * 2**30) - int(1.94 * 2**30) - 2**29
    assert budget.slots(1000) == spare // (per_token * 1024) == 87  # 3.06 GiB of 36 MiB slots
    assert budget.slots(16) == 16
    # Llama-2-7B: 32 layers × 32 heads × 128 → 512 KiB per token; 3.9 GiB resident in a 5 GiB budget
    seven = SlotBudget(budget_bytes=5 * 2**30, resident_bytes=int(3.9 * 2**30), workspace_bytes=2**28,
                       kv_per_token=kv_bytes_per_token(32, 32, 128, 2), window=256)
    assert seven.slots(16) == 6 and "6 slot(s) of 256 tokens" in seven.explain(16)
    assert SlotBudget(2**30, 2**30, 0, per_token, 1024).slots(16) == 0


def test_nf4_scales_kept_decoded_only_where_they_cost_no_slot():
    """Joined projections keep their NF4 scales decoded unless that memory would take a slot: on the 7B shape
    under a 6 GB card (fp8 cache, 1,024-token slots) its 211 MiB would take the fourth; on 3B, room is left."""
    mib = 2**20
    seven = SlotBudget(budget_bytes=int(5.5 * 2**30), resident_bytes=int(3.90 * 2**30), workspace_bytes=2**29,
                       kv_per_token=kv_bytes_per_token(32, 32, 128, 1), window=1024)
    assert seven.slots(16) == 4
    assert seven.costs_a_slot(211 * mib, 16) and not seven.costs_a_slot(0, 16)
    three = SlotBudget(budget_bytes=int(5.5 * 2**30), resident_bytes=int(2.38 * 2**30), workspace_bytes=2**29,
                       kv_per_token=kv_bytes_per_token(36, 2, 128, 2), window=1024)
    assert three.slots(36) == 36 and not three.costs_a_slot(85 * mib, 36)


def test_a_measured_peak_over_the_budget_takes_slots_away_until_sizing_ends():
    gib = 2**30
    budget = SlotBudget(  # Llama-2-7B, 384-token slots: 0.1875 GiB each
        budget_bytes=5 * gib, resident_bytes=int(3.69 * gib), workspace_bytes=gib // 4,
        kv_per_token=kv_bytes_per_token(32, 32, 128, 2), window=384)
    assert budget.slots(5) == 5  # the 0.25 GiB estimate
    assert budget.after_measuring(5, 5 * gib) == 5  # a peak at the budget fits: keep them
    # A peak of 5.07 GiB means a 0.44 GiB workspace: 0.87 GiB left for slots, four of them
    over = int(5.07 * gib)
    assert budget.after_measuring(5, over) == 4
    assert budget.after_measuring(5, 5 * gib + 1) == 4  # at least one fewer, however small the excess
    assert budget.after_measuring(5, None) == 4  # out of memory while measuring: one fewer, measured again
    assert budget.after_measuring(1, None) == 0  # nothing holds: the worker stops with the arithmetic
    assert budget.after_measuring(5, 9 * gib) == 0


def test_an_out_of_memory_gives_back_half_the_rows_and_admits_one_fewer():
    assert after_step_out_of_memory(8) == (4, 7)
    assert after_step_out_of_memory(3) == (1, 2)
    assert after_step_out_of_memory(2) == (1, 1)
    assert after_prefill_out_of_memory(5) == 5  # the prefill's rows go back; those in flight stay
    assert after_prefill_out_of_memory(0) == 1
