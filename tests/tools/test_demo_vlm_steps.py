"""The demo VLM training steps: the learning-rate schedule and the time budget a stage's step count is fitted to."""

from __future__ import annotations

import pytest

from tools import demo_vlm_steps as steps


def test_the_schedule_warms_up_then_decays_to_zero():
    lrs = [steps.schedule(step, 100, 1.0, warmup=10) for step in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0) and lrs[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] == pytest.approx(0.0, abs=1e-3)


def test_a_time_budget_fits_the_steps_between_those_done_and_the_most():
    assert steps.steps_in_budget(0.5, minutes=1.0, most=1000, done=20) == 120  # 60 s / 0.5 s
    assert steps.steps_in_budget(0.5, minutes=1.0, most=50, done=20) == 50
    assert steps.steps_in_budget(10.0, minutes=1.0, most=1000, done=20) == 20  # only 6 fit: keep those done


def test_a_step_budget_times_the_steps_after_the_warm_ones_then_fits_the_count(monkeypatch):
    no_budget, logged = steps.StepBudget("reader", None, warm=0, fit=20), []
    assert [no_budget.steps(step, 300, logged.append) for step in range(25)] == [300] * 25 and not logged
    clock = iter([0.0, 100.0, 106.25])  # created; step 10 starts at 100 s, step 60 at 106.25 s: 0.125 s a step
    monkeypatch.setattr(steps.time, "perf_counter", lambda: next(clock))
    budget = steps.StepBudget("encoder", 1.0, warm=10, fit=60)
    counts = [budget.steps(step, 12000, logged.append) for step in range(61)]
    assert counts[:60] == [12000] * 60 and counts[60] == 480  # 60 s / 0.125 s
    assert logged == ["encoder: 0.125 s per step, 480 steps in 1.0 min"]
    clock = iter([0.0, 0.0, 300.0, 0.0])  # 30 s a step: nothing more fits in the minute, one step more still runs
    monkeypatch.setattr(steps.time, "perf_counter", lambda: next(clock))
    slow = steps.StepBudget("reader", 1.0, warm=0, fit=10)
    assert [slow.steps(step, 500, logged.append) for step in range(11)] == [500] * 10 + [11]
    asked = steps.StepBudget("reader", 1.0, warm=0, fit=10)  # asked for no more steps than the timed ones
    assert asked.steps(10, 10, logged.append) == 10
