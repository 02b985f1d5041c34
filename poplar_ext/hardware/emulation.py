"""Emulated device types: a real rank made slower and given a smaller memory.

A cluster description may declare a device type as emulated (a compute slowdown
factor and a memory capacity), so that a CPU machine, or one GPU shared by several
processes, can stand in for a heterogeneous cluster. This module is the only place
that applies an emulation; the profiler, the search and the engine treat emulated
and real device types alike and only call in here.

How a slowdown is applied: the rank runs its real compute and the block is given a
wall duration of ``slowdown * compute_time``: at its end the rank sleeps whatever
is left of that target (``slowdown * compute_time - wall time already spent``, or
nothing). On CPU the compute time is the CPU time of the calling thread
(`time.thread_time`), the same clock the profiler times micro-steps by, so an
emulated rank trains exactly as long as its profile predicts. CPU time and not wall
time, because wall time includes waiting in gloo collectives and, when there are
more ranks than cores, waiting for a core: multiplying those would slow a rank for
time that is not its compute. Padding to a target instead of sleeping
``(slowdown - 1) * compute_time`` on top means a rank that already lost wall time
waiting for a core (or in a collective) is not slowed twice: it models a device
that has its compute to itself. On CUDA the CPU time says nothing about the
kernels, so there the block is synchronised and timed by wall time
(`clock="cuda"`), and the rank sleeps ``(slowdown - 1) * wall time``.

How drift is applied: an emulation's ``slowdown_schedule`` changes a rank's slowdown
from a given optimizer step on (`scheduled_slowdown`); the engine sets
`ComputeSlowdown.slowdown` after every optimizer step, so that tests and the bench
can make one device slower or faster in the middle of a run.

Where an emulation holds (docs/limits.md): the padding works while a computing rank has a core
to itself, so that its wall time is its CPU time and the rest of the target is sleep. The ranks
of one machine keep ``sum over them of 1 / slowdown`` cores busy (`core_demand`); with other
processes' load on top, a rank waits for a core, its compute's wall time exceeds ``slowdown x
CPU time`` and it runs above its profile (bench/results/emulation_load/: thread CPU time stayed
within 8% of the profile's while the wall time overran it by up to 5x on a 2-core machine whose
load average was 5-8). `check_emulation_range` warns (`EmulationRangeWarning`) where the demand
exceeds the cores and logs a warning where the load average on top does.

How a memory capacity is applied: `check_emulated_memory` compares a measured peak
(see the profiler's memory measurement) with the capacity and raises
`EmulatedOutOfMemoryError`, a `RuntimeError` like a real out-of-memory. An emulated
device on a CPU-only machine shares the process's memory with its "host": what an
offloading optimizer keeps on the host (`host_resident_optimizer_bytes`) is taken off
the measured peak before the comparison, as a real device would not hold it.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Iterable
from typing import Any

from poplar_ext.hardware.compute_clock import Clock, clock_now
from poplar_ext.plan.formats import Cluster, Emulation

logger = logging.getLogger(__name__)


class EmulatedOutOfMemoryError(RuntimeError):
    """A measured peak exceeded an emulated device's memory capacity."""


class EmulationRangeWarning(UserWarning):
    """The emulated ranks of one machine keep more cores busy than it has (sum of 1/slowdown): they
    wait for cores and their compute runs above its profile, whatever the plan (module docstring)."""


def core_demand(slowdowns: Iterable[float]) -> float:
    """Cores that ranks at these slowdowns keep busy: the sum of 1/slowdown (a slowdown below 1 counts as 1)."""
    return sum(1.0 / max(1.0, s) for s in slowdowns)


def node_slowdowns(cluster: Cluster) -> dict[str, list[float]]:
    """Node name -> the slowdown of each of its emulated ranks (nodes without any left out)."""
    found: dict[str, list[float]] = {}
    for node in cluster.nodes:
        for group in node.devices:
            emulation = cluster.emulation_of(group.device_type)
            if emulation is not None:
                found.setdefault(node.name, []).extend([emulation.slowdown] * group.count)
    return found


def check_emulation_range(
    cluster: Cluster, *, cores: int | None = None, load_average: float | None = None
) -> dict[str, float]:
    """Each node's core demand (`core_demand` of its emulated ranks), warned about outside the range.

    Every node is taken to be a machine like this one (`cores`: default its usable cores). Beyond
    the cores: `EmulationRangeWarning`. Within them but beyond with `load_average` (default this
    machine's 1-minute load average, other processes' and these ranks' own) on top: a logged
    warning, since the load may pass.
    """
    cores = cores or _usable_cores()
    if load_average is None:
        load_average = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    demands = {name: core_demand(slowdowns) for name, slowdowns in node_slowdowns(cluster).items()}
    for name, demand in demands.items():
        if demand > cores:
            warnings.warn(
                f"emulated devices on {name}: the ranks keep {demand:.2f} cores busy (sum of 1/slowdown) and the "
                f"machine has {cores}: they will wait for cores and run above their profiles; use larger slowdowns "
                "(docs/limits.md)",
                EmulationRangeWarning,
                stacklevel=2,
            )
        elif demand + load_average > cores:
            logger.warning(
                "emulated devices on %s: the ranks keep %.2f cores busy and the load average is %.1f on %d cores: "
                "while the load lasts, ranks wait for cores and run above their profiles (docs/limits.md)",
                name,
                demand,
                load_average,
                cores,
            )
    return demands


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def emulation_for_rank(cluster: Cluster, rank: int) -> Emulation | None:
    """The emulation of `rank`'s device type in `cluster`, or None when it is a real device."""
    device_types = cluster.rank_device_types
    if not 0 <= rank < len(device_types):
        raise ValueError(f"rank: expected a rank of the cluster description (0..{len(device_types) - 1}), found {rank}")
    return cluster.emulation_of(device_types[rank])


def scheduled_slowdown(emulation: Emulation | None, *, optimizer_step: int, rank: int) -> float:
    """`rank`'s slowdown once `optimizer_step` optimizer steps are done (1.0 for a real device).

    The emulation's ``slowdown``, replaced by each ``slowdown_schedule`` entry for the
    type (rank None) or for this rank whose step has been reached; the last one wins.
    """
    if emulation is None:
        return 1.0
    slowdown = emulation.slowdown
    for step, value, only_rank in emulation.slowdown_schedule:
        if step <= optimizer_step and only_rank in (None, rank):
            slowdown = value
    return slowdown


def device_label(device_type: str, emulation: Emulation | None) -> str:
    """How logs and results name a device: always says whether it is real or emulated.

    ``"a100 (real)"`` or ``"cpu-slow (emulated: 3.0x slower, 2.0 GB)"``.
    """
    if emulation is None:
        return f"{device_type} (real)"
    memory_gb = emulation.memory_capacity_bytes / 1e9
    return f"{device_type} (emulated: {emulation.slowdown:g}x slower, {memory_gb:.1f} GB)"


def check_emulated_memory(emulation: Emulation | None, peak_memory_bytes: int, *, device_type: str = "") -> None:
    """Raise `EmulatedOutOfMemoryError` when `peak_memory_bytes` exceeds the emulated capacity.

    Does nothing for a real device (`emulation` None): a real device raises its own
    out-of-memory error.
    """
    if emulation is None or peak_memory_bytes <= emulation.memory_capacity_bytes:
        return
    name = f"{device_type} " if device_type else ""
    raise EmulatedOutOfMemoryError(
        f"emulated device {name}out of memory: peak {peak_memory_bytes} bytes exceeds its "
        f"capacity of {emulation.memory_capacity_bytes} bytes"
    )


def host_resident_optimizer_bytes(engine: Any) -> int:
    """Bytes a DeepSpeed ZeRO-1/2 engine's offloading optimizer keeps on the host (0 when it does not offload).

    DeepSpeed's fp32 master partition and its gradient, the gradients accumulated on
    the host, its host staging buffers, and the optimizer's state (Adam's moments).
    Each tensor counts once.
    """
    import torch

    optimizer = getattr(engine, "optimizer", None)
    if not getattr(optimizer, "cpu_offload", False):
        return 0
    seen: set[int] = set()
    total = 0

    def add(tensor: Any) -> None:
        nonlocal total
        if torch.is_tensor(tensor) and tensor.device.type == "cpu" and tensor.numel() and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()

    for master in getattr(optimizer, "single_partition_of_fp32_groups", None) or []:
        add(master)
        add(master.grad)
    for accumulated in (getattr(optimizer, "accumulated_grads_in_cpu", None) or {}).values():
        add(accumulated)
    # The host-side staging buffers DeepSpeed allocates only to offload.
    for buffer in getattr(optimizer, "param_buffer_of_bit16_for_cpu_offload_groups", None) or []:
        add(buffer)
    add(getattr(optimizer, "temp_grad_buffer_for_cpu_offload", None))
    inner = getattr(optimizer, "optimizer", None)
    for state in getattr(inner, "state", {}).values():
        for value in state.values():
            add(value)
    return total


class ComputeSlowdown:
    """Times blocks of compute and pads them to `emulation.slowdown` times their compute time.

    Use as a context manager (``with slowdown: ...``) or with `start()` / `stop()`
    when the block spans calls (the engine starts at forward and stops after
    backward). With `emulation` None it only measures and never sleeps, so callers
    need no special case for real devices.
    """

    def __init__(self, emulation: Emulation | None, *, clock: Clock = "thread") -> None:
        if clock not in ("thread", "cuda"):
            raise ValueError(f"clock: expected 'thread' or 'cuda', found {clock!r}")
        self.emulation = emulation
        self.clock = clock
        self.slowdown = 1.0 if emulation is None else emulation.slowdown
        """The factor applied now (the engine follows the emulation's ``slowdown_schedule``)."""
        self.compute_time_s = 0.0
        """Measured compute time of the last block."""
        self.busy_time_s = 0.0
        """Sum over blocks of their emulated duration (slowdown x compute time): the device's busy time,
        the quantity a profile predicts. Callers reset it (`poplar_ext.runtime.rebalance`)."""
        self.delay_s = 0.0
        """Time slept after the last block."""
        self._started_at: tuple[float, float] | None = None
        """(compute clock, wall clock) at `start()`."""

    @property
    def running(self) -> bool:
        """True between `start()` and `stop()`."""
        return self._started_at is not None

    def _now(self) -> tuple[float, float]:
        """(compute clock, wall clock) now, in seconds."""
        return clock_now(self.clock)

    def start(self) -> None:
        """Begin timing a block; a second `start()` before `stop()` is ignored."""
        if self._started_at is None:
            self._started_at = self._now()

    def stop(self) -> float:
        """End the block, sleep what is left of its emulated duration and return that sleep (seconds)."""
        if self._started_at is None:
            return 0.0
        (compute_start, wall_start), (compute_end, wall_end) = self._started_at, self._now()
        self._started_at = None
        self.compute_time_s = max(0.0, compute_end - compute_start)
        # A slowdown below 1 cannot make real compute faster: it is clamped to 1 (no delay).
        slowdown = max(1.0, self.slowdown)
        self.busy_time_s += slowdown * self.compute_time_s
        self.delay_s = max(0.0, slowdown * self.compute_time_s - (wall_end - wall_start))
        if self.delay_s > 0.0:
            time.sleep(self.delay_s)
        return self.delay_s

    def __enter__(self) -> ComputeSlowdown:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


__all__ = [
    "ComputeSlowdown",
    "EmulatedOutOfMemoryError",
    "EmulationRangeWarning",
    "check_emulated_memory",
    "check_emulation_range",
    "core_demand",
    "node_slowdowns",
    "device_label",
    "emulation_for_rank",
    "host_resident_optimizer_bytes",
    "scheduled_slowdown",
]
