"""The engine core: the scheduler and what a step touches, behind `EngineCore.step()`."""
