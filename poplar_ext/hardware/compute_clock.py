"""Timing a rank's compute, the one place that reads a device's compute clock: thread CPU time on CPU, CUDA events
on a GPU. See profiles/README.md ("Timing is each rank's own work")."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

Clock = Literal["thread", "cuda"]
"""``thread``: this thread's CPU time; ``cuda``: the GPU's time (synchronised)."""


class ComputeTimer(Protocol):
    """Windows of a rank's compute, summed: what re-balancing reads at a check."""

    slowdown: float

    def start(self, key: Hashable = None) -> None: ...

    def stop(self) -> float: ...

    @property
    def running(self) -> bool: ...

    @property
    def busy_time_s(self) -> float: ...

    @busy_time_s.setter
    def busy_time_s(self, value: float) -> None: ...


@dataclass(frozen=True, kw_only=True)
class ComputeWindow:
    """How a micro-step's compute is timed on one kind of device at one ZeRO stage (`compute_window`)."""

    clock: Clock
    """``thread``: the computing thread's CPU time (waits cost none); ``cuda``: CUDA events (waits count)."""
    ends_at_reduction: bool
    """The window ends where DeepSpeed's gradient reduction starts (``allreduce_gradients``), as
    training's compute window does; False: at the micro-step's end."""
    types_at_once: bool
    """Every device type can be timed at once: nothing in the window waits for another rank. False:
    one type at a time, the others running micro-batch 1 (they finish first, so none is waited for)."""
    includes_communication: bool
    """The window holds the micro-step's collectives (the cost model subtracts them:
    ``micro_step_times_include_communication`` in the profile)."""

    def to_dict(self) -> dict[str, Any]:
        """As a profile's ``measured_with.compute_window`` records it."""
        return {
            "clock": self.clock,
            "ends_at": "gradient reduction" if self.ends_at_reduction else "micro-step end",
            "device_types_at_once": self.types_at_once,
            "includes_communication": self.includes_communication,
        }


def compute_window(device_kind: str, zero_stage: int) -> ComputeWindow:
    """How a non-boundary micro-step's compute is timed on `device_kind` (``cpu``, ``cuda``) at `zero_stage`.

    The thread's CPU time (CPU) ignores waits: every type at once, up to the reduction. CUDA events count
    waits: at ZeRO-0/1 nothing is communicated (all types at once, up to the reduction); at ZeRO-2 the
    reduce-scatter runs at the reduction (one type at a time, up to it); ZeRO-3's all-gathers run all
    through the micro-step (one type at a time, all of it, the cost model subtracting its communication)."""
    cuda, stage_3 = device_kind == "cuda", zero_stage == 3
    return ComputeWindow(
        clock="cuda" if cuda else "thread",
        ends_at_reduction=not (cuda and stage_3),
        types_at_once=not cuda or zero_stage in (0, 1),
        includes_communication=cuda and stage_3,
    )


class ComputeSpan:
    """One span of compute on `clock`: `start`, then `end` (only the first counts), then `elapsed_s`."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._marks: list[Any] = []

    def _mark(self) -> Any:
        return _recorded_event() if self.clock == "cuda" else time.thread_time()

    def start(self) -> None:
        self._marks = [self._mark()]

    def end(self) -> None:
        """Ends the span here unless it ended already (a reduction hook, then the micro-step's end)."""
        if len(self._marks) == 1:
            self._marks.append(self._mark())

    def elapsed_s(self) -> float:
        if len(self._marks) != 2:
            raise RuntimeError(f"ComputeSpan: expected a started and ended span, found {len(self._marks)} marks")
        start, end = self._marks
        if self.clock == "cuda":
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        return end - start


def _recorded_event() -> Any:
    """A CUDA timing event recorded on the current stream now."""
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


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
    span = ComputeSpan("cuda" if getattr(device, "type", "cpu") == "cuda" else "thread")
    span.start()
    run()
    span.end()
    return span.elapsed_s()


class CudaEventTimer:
    """A real GPU's compute windows: `ComputeSlowdown`'s interface without its synchronisation at every
    window (CUDA events recorded on the stream, summed when `busy_time_s` is read)."""

    emulation = None
    slowdown = 1.0

    def __init__(self) -> None:
        self._started: Any = None
        self._windows: list[tuple[Any, Any]] = []
        self._summed_s = 0.0

    @property
    def running(self) -> bool:
        return self._started is not None

    def start(self, key: Hashable = None) -> None:
        if self._started is None:
            self._started = _recorded_event()

    def stop(self) -> float:
        if self._started is not None:
            self._windows.append((self._started, _recorded_event()))
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
