"""The training steps of ``tools/train_demo_vlm.py``: the learning-rate schedule, the time budget a stage's step
count is fitted to, and one optimizer update."""

from __future__ import annotations

import math
import time

import torch


def schedule(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to zero."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def steps_in_budget(seconds_per_step: float, minutes: float, most: int, done: int) -> int:
    """How many steps fit in `minutes` at `seconds_per_step`: at most `most`, at least the `done` ones."""
    return max(done, min(most, int(minutes * 60 / seconds_per_step)))


class StepBudget:
    """A stage's time budget (None: none): the steps from `warm` to `fit` are timed, then the step count (at most
    the one asked, and so the learning-rate schedule) is fitted to `minutes`."""

    def __init__(self, stage: str, minutes: float | None, warm: int, fit: int) -> None:
        self.stage, self.minutes, self.warm, self.fit = stage, minutes, warm, fit
        self.started = time.perf_counter()

    def steps(self, step: int, steps: int, log) -> int:
        """Called before each step with the step count so far: the step count to train for."""
        if self.minutes and step == self.warm:
            self.started = time.perf_counter()
        if self.minutes and step == self.fit < steps:
            per_step = (time.perf_counter() - self.started) / (self.fit - self.warm)
            # at least one step more: the last step's end evaluates and saves the stage's output
            steps = steps_in_budget(per_step, self.minutes, steps, done=self.fit + 1)
            log(f"{self.stage}: {per_step:.3f} s per step, {steps} steps in {self.minutes} min")
        return steps


def optimizer_step(optimizer, params, loss: torch.Tensor, lr: float) -> None:
    """One update at learning rate `lr`, the gradient clipped to norm 1."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
