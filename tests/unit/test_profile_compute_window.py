"""The profiler's compute window on CPU ends where training's does: at DeepSpeed's gradient reduction."""

from __future__ import annotations

import time
from types import SimpleNamespace

from poplar_ext.profiler.measure import StageMeasurement


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class _Engine:
    """Stands for a DeepSpeed engine whose backward reduces gradients (ZeRO 2-3) inside a micro-step."""

    reductions = 0

    def allreduce_gradients(self) -> None:
        type(self).reductions += 1
        _burn(0.2)  # the reduction's CPU time: communication, not compute


def _measurement(engine: _Engine) -> StageMeasurement:
    measurement = object.__new__(StageMeasurement)
    measurement.engine = engine
    measurement.layout = SimpleNamespace(device=SimpleNamespace(type="cpu"))
    measurement.zero_stage = 2

    def micro_step(size: int, *, boundary: bool) -> None:
        _burn(0.05)  # forward and backward up to the reduction
        engine.allreduce_gradients()
        _burn(0.01)

    measurement._micro_step = micro_step
    return measurement


def test_the_reduction_is_not_counted_as_compute():
    engine = _Engine()
    elapsed_s = _measurement(engine)._time_compute_window(4)
    assert 0.04 <= elapsed_s < 0.15, elapsed_s
    assert _Engine.reductions == 1 and "allreduce_gradients" not in vars(engine), "the engine's own method again"


def test_without_a_reduction_the_whole_micro_step_counts():
    class NoReduction(_Engine):
        pass

    engine = NoReduction()
    measurement = _measurement(engine)
    measurement._micro_step = lambda size, *, boundary: _burn(0.05)
    assert 0.04 <= measurement._time_compute_window(4) < 0.15
