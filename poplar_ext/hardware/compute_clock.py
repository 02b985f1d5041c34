"""Timing a rank's compute: the one place that reads a device's compute clock.

On CPU the clock is this thread's CPU time (time.thread_time): waits in collectives
and time lost to other processes on the cores do not count. On CUDA it is the GPU's
own time, with events. Three users: the profiler times a micro-step (`time_compute`),
emulated device types pad their compute to a slowdown (`poplar_ext.hardware.emulation.
ComputeSlowdown`, reading `clock_now`), and re-balancing sums a real GPU's compute
windows without synchronising each (`CudaEventTimer`); both of the latter are
`ComputeTimer`s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal, Protocol

Clock = Literal["thread", "cuda"]
"""``thread``: this thread's CPU time; ``cuda``: the GPU's time (synchronised)."""


class ComputeTimer(Protocol):
    """Windows of a rank's compute, summed: what re-balancing reads at a check."""

    slowdown: float

    def start(self) -> None: ...

    def stop(self) -> float: ...

    @property
    def running(self) -> bool: ...

    @property
    def busy_time_s(self) -> float: ...

    @busy_time_s.setter
    def busy_time_s(self, value: float) -> None: ...


def clock_now(clock: Clock) -> tuple[float, float]:
    """(compute clock, wall clock) now, in seconds; on CUDA the device is synchronised first."""
    if clock == "cuda":
        import torch

        torch.cuda.synchronize()
        wall = time.perf_counter()
        return wall, wall
    return time.thread_time(), time.perf_counter()


def time_compute(device: Any, run: Callable[[], Any]) -> float:
    """Seconds of `device`'s compute that ``run()`` takes (CUDA events on a GPU, else thread CPU time)."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
    started = time.thread_time()
    run()
    return time.thread_time() - started


class CudaEventTimer:
    """A real GPU's compute windows, timed with CUDA events and read only at a check.

    The same interface as `ComputeSlowdown` with no emulation (`start`, `stop`,
    `busy_time_s`), without its synchronisation at every window: the events are
    recorded on the stream and their times summed when `busy_time_s` is read.
    """

    emulation = None
    slowdown = 1.0

    def __init__(self) -> None:
        self._started: Any = None
        self._windows: list[tuple[Any, Any]] = []
        self._summed_s = 0.0

    @property
    def running(self) -> bool:
        return self._started is not None

    def _event(self) -> Any:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        if self._started is None:
            self._started = self._event()

    def stop(self) -> float:
        if self._started is not None:
            self._windows.append((self._started, self._event()))
            self._started = None
        return 0.0

    @property
    def busy_time_s(self) -> float:
        for start, end in self._windows:
            end.synchronize()
            self._summed_s += start.elapsed_time(end) / 1000.0
        self._windows.clear()
        return self._summed_s

    @busy_time_s.setter
    def busy_time_s(self, value: float) -> None:
        self._windows.clear()
        self._summed_s = value


__all__ = ["Clock", "ComputeTimer", "CudaEventTimer", "clock_now", "time_compute"]
