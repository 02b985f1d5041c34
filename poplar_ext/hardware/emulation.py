"""Emulated device types: a real rank made slower and given a smaller memory; the only place that applies one.
See docs/limits.md (what the emulation models)."""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
import warnings
from collections.abc import Callable, Collection, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from poplar_ext.hardware.compute_clock import Clock, clock_now
from poplar_ext.plan.formats import Cluster, Emulation, Profile

logger = logging.getLogger(__name__)


class EmulatedOutOfMemoryError(RuntimeError):
    """A measured peak exceeded an emulated device's memory capacity."""


class EmulationRangeWarning(UserWarning):
    """The emulated ranks of one machine keep more cores busy than it has (sum of 1/slowdown): they
    wait for cores and their compute runs above its profile, whatever the plan (docs/limits.md, emulation)."""


def core_demand(slowdowns: Iterable[float]) -> float:
    """Cores that ranks at these slowdowns keep busy: the sum of 1/slowdown (a slowdown below 1 counts as 1)."""
    return sum(1.0 / max(1.0, s) for s in slowdowns)


def check_emulation_range(
    cluster: Cluster, *, cores: int | None = None, load_average: float | None = None
) -> dict[str, float]:
    """Each node's core demand (`core_demand` of its emulated ranks), on nodes taken to be like this machine.

    Beyond its `cores` (default: its usable cores): `EmulationRangeWarning`; beyond them with `load_average`
    (default: its 1-minute load average) on top: a logged warning, since the load may pass."""
    cores = cores or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if load_average is None:
        load_average = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    slowdowns: dict[str, list[float]] = {}  # node name -> the slowdown of each of its emulated ranks
    for node in cluster.nodes:
        for group in node.devices:
            emulation = cluster.emulation_of(group.device_type)
            if emulation is not None:
                slowdowns.setdefault(node.name, []).extend([emulation.slowdown] * group.count)
    demands = {name: core_demand(node_slowdowns) for name, node_slowdowns in slowdowns.items()}
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


def emulation_for_rank(cluster: Cluster, rank: int) -> Emulation | None:
    """The emulation of `rank`'s device type in `cluster`, or None when it is a real device."""
    device_types = cluster.rank_device_types
    if not 0 <= rank < len(device_types):
        raise ValueError(f"rank: expected a rank of the cluster description (0..{len(device_types) - 1}), found {rank}")
    return cluster.emulation_of(device_types[rank])


def scheduled_slowdown(emulation: Emulation | None, *, optimizer_step: int, rank: int) -> float:
    """`rank`'s slowdown once `optimizer_step` steps are done (1.0 for a real device): the emulation's, or
    the last ``slowdown_schedule`` entry reached for the type (rank None) or this rank."""
    if emulation is None:
        return 1.0
    slowdown = emulation.slowdown
    for step, value, only_rank in emulation.slowdown_schedule:
        if step <= optimizer_step and only_rank in (None, rank):
            slowdown = value
    return slowdown


def without_drift(emulation: Emulation | None) -> Emulation | None:
    """`emulation` at its own slowdown: a drift schedule is training's, not a profile's."""
    return None if emulation is None else dataclasses.replace(emulation, slowdown_schedule=())


EMULATED_TIMES = " (x the emulated slowdown)"
"""What a profile's ``measured_with.timing`` adds to its clock where the device is emulated (a real one's times are
the clock's alone)."""


def device_label(device_type: str, emulation: Emulation | None) -> str:
    """How logs and results name a device: ``a100 (real)``, ``cpu-slow (emulated: 3.0x slower, 2.0 GB)``."""
    if emulation is None:
        return f"{device_type} (real)"
    return f"{device_type} (emulated: {emulation.slowdown:g}x slower, {emulation.memory_capacity_bytes / 1e9:.1f} GB)"


def check_emulated_memory(emulation: Emulation | None, peak_memory_bytes: int, *, device_type: str = "") -> None:
    """Raise `EmulatedOutOfMemoryError` when `peak_memory_bytes` exceeds the emulated capacity (a real
    device, `emulation` None, raises its own)."""
    if emulation is None or peak_memory_bytes <= emulation.memory_capacity_bytes:
        return
    name = f"{device_type} " if device_type else ""
    raise EmulatedOutOfMemoryError(
        f"emulated device {name}out of memory: peak {peak_memory_bytes} bytes exceeds its "
        f"capacity of {emulation.memory_capacity_bytes} bytes"
    )


def host_resident_optimizer_bytes(engine: Any) -> int:
    """Bytes a DeepSpeed ZeRO-1/2 engine's offloading optimizer keeps on the host (0 when it does not offload):
    the fp32 master partition and its gradient, host-accumulated gradients, staging buffers, optimizer state."""
    import torch

    optimizer = getattr(engine, "optimizer", None)
    if not getattr(optimizer, "cpu_offload", False):
        return 0
    masters = getattr(optimizer, "single_partition_of_fp32_groups", None) or []
    states = getattr(getattr(optimizer, "optimizer", None), "state", {}).values()
    tensors = [
        *(t for master in masters for t in (master, master.grad)),
        *(getattr(optimizer, "accumulated_grads_in_cpu", None) or {}).values(),
        # The host-side staging buffers DeepSpeed allocates only to offload.
        *(getattr(optimizer, "param_buffer_of_bit16_for_cpu_offload_groups", None) or []),
        getattr(optimizer, "temp_grad_buffer_for_cpu_offload", None),
        *(value for state in states for value in state.values()),
    ]
    on_host = {
        t.data_ptr(): t.numel() * t.element_size()
        for t in reversed(tensors)  # the first tensor at an address counts
        if torch.is_tensor(t) and t.device.type == "cpu" and t.numel()
    }
    return sum(on_host.values())


LEARNED_BLOCKS = 3
"""Blocks of one kind timed by the compute clock before their median becomes the kind's base."""

OVERRUN_WARNING_SHARE = 0.02
"""Overrun above this share of the steady compute makes an emulated result suspect (`overrun_share`)."""


@dataclass(frozen=True, kw_only=True)
class SteadyReference:
    """Blocks' times taken from a profile: block key -> seconds at the profile's slowdown."""

    block_time_s: Callable[[Hashable], float | None]
    """Seconds of a block of that kind *at the profile's slowdown*, or None where the profile does not say
    (another kind of block, or a micro-batch beyond its largest)."""
    profile_slowdown: float
    """The slowdown the profile's times include (its emulation's ``slowdown``)."""
    source: str
    """Where the times come from, for logs (``the profile of cpu-slow at ZeRO stage 1``)."""

    def base_s(self, key: Hashable) -> float | None:
        """The block's compute on the real device, or None."""
        time_s = self.block_time_s(key)
        return None if time_s is None else time_s / max(1.0, self.profile_slowdown)


def steady_reference(profile: Profile) -> SteadyReference | None:
    """Micro-step bases from `profile`'s fitted curve (the search's: `poplar_ext.search.curves`), so that a
    rank trains as long as the plan predicts; None where it fits nothing or its times include communication."""
    from poplar_ext.search.cost import micro_step_times_include_communication
    from poplar_ext.search.curves import fit_curve

    curve = fit_curve(profile)
    if curve is None or micro_step_times_include_communication(profile):
        return None
    table = curve.table()

    def time_at(key: Hashable) -> float | None:
        at_size = isinstance(key, tuple) and len(key) == 2 and key[0] == "micro_step" and 1 <= key[1] <= len(table)
        return float(table[key[1] - 1]) if at_size else None

    return SteadyReference(
        block_time_s=time_at,
        profile_slowdown=profile.emulated.slowdown if profile.emulated is not None else 1.0,
        source=f"the profile of {profile.device_type} at ZeRO stage {profile.zero_stage}",
    )


def pipeline_reference(
    *,
    stage_compute_s: float,
    optimizer_step_s: float,
    profile_slowdown: float,
    source: str,
    recompute_s: float = 0.0,
) -> SteadyReference:
    """A pipeline stage's blocks from its layer profiles: a micro-batch's forward and backward take
    `stage_compute_s` between them, a third and two thirds (a backward computes about twice a forward's
    work), the backward of a checkpointed stage `recompute_s` more (its forward again); the optimizer step
    `optimizer_step_s` (all at the profile's slowdown)."""
    times = {
        PIPELINE_FORWARD_KEY: stage_compute_s / 3.0,
        PIPELINE_BACKWARD_KEY: 2.0 * stage_compute_s / 3.0 + recompute_s,
        PIPELINE_OPTIMIZER_KEY: optimizer_step_s,
    }
    return SteadyReference(block_time_s=times.get, profile_slowdown=profile_slowdown, source=source)


PIPELINE_FORWARD_KEY = "_exec_forward_pass"
PIPELINE_BACKWARD_KEY = "_exec_backward_pass"
PIPELINE_OPTIMIZER_KEY = "_exec_optimizer_step"
"""The block keys of a pipeline engine's instructions (DeepSpeed's PipelineEngine method names)."""


def micro_step_key(micro_batch_size: int) -> tuple[str, int]:
    """The block key of a micro-step (forward to the gradient reduction) at `micro_batch_size`."""
    return ("micro_step", int(micro_batch_size))


OPTIMIZER_STEP_KEY = ("optimizer_step",)
"""The block key of the optimizer step at an accumulation boundary."""


class ComputeSlowdown:
    """Gives each block of compute its steady time: ``slowdown x`` its base (docs/limits.md, emulation).

    ``with slowdown: ...``, or `start(key)` / `stop()` for a block spanning calls; the key names the kind
    of block (`micro_step_key`, `OPTIMIZER_STEP_KEY`, any hashable), whose base comes from `reference` or
    is learned. With `emulation` None it only measures. `window_waits`: True, or the keys of the blocks
    that may wait in collectives: only their compute clock counts towards an overrun."""

    def __init__(
        self,
        emulation: Emulation | None,
        *,
        clock: Clock = "thread",
        reference: SteadyReference | None = None,
        window_waits: bool | Collection[Hashable] = False,
    ) -> None:
        if clock not in ("thread", "cuda"):
            raise ValueError(f"clock: expected 'thread' or 'cuda', found {clock!r}")
        self.emulation = emulation
        self.clock = clock
        self.reference = reference
        self.window_waits = window_waits
        self.slowdown = 1.0 if emulation is None else emulation.slowdown
        """The factor applied now (the engine follows the emulation's ``slowdown_schedule``)."""
        self.compute_time_s = 0.0
        """Compute clock time of the last block."""
        self.busy_time_s = 0.0
        """Sum of the blocks' steady times: the busy time a profile predicts (callers reset it)."""
        self.delay_s = 0.0
        """Time slept after the last block."""
        self.steady_s = 0.0
        """Sum of every block's steady time since the start (never reset)."""
        self.overrun_s = 0.0
        """Sum of the time blocks ran past their steady time (never reset)."""
        self.overrun_blocks = 0
        """Blocks that ran past their steady time."""
        self.blocks = 0
        """Blocks timed."""
        self._learned: dict[Hashable, list[float]] = {}
        self._overrun_by_kind: dict[str, float] = {}
        self._started_at: tuple[float, float] | None = None
        """(compute clock, wall clock) at `start()`."""
        self._key: Hashable = None

    @property
    def running(self) -> bool:
        """True between `start()` and `stop()`."""
        return self._started_at is not None

    @property
    def overrun_share(self) -> float:
        """Overrun over steady compute (0.0 before any block)."""
        return self.overrun_s / self.steady_s if self.steady_s > 0 else 0.0

    def overrun_report(self) -> dict[str, float | int]:
        """What every bench result reports of this rank's emulation."""
        return {
            "steady_compute_s": self.steady_s,
            "overrun_s": self.overrun_s,
            "overrun_blocks": self.overrun_blocks,
            "blocks": self.blocks,
            "overrun_share": self.overrun_share,
            "overrun_s_by_kind": dict(self._overrun_by_kind),
        }

    def _now(self) -> tuple[float, float]:
        """(compute clock, wall clock) now, in seconds."""
        return clock_now(self.clock)

    def start(self, key: Hashable = None) -> None:
        """Begin a block of kind `key`; a second `start()` before `stop()` is ignored."""
        if self._started_at is None:
            self._started_at = self._now()
            self._key = key

    def base_s(self, key: Hashable) -> float | None:
        """The block's compute on the real device: from the reference, learned, or None while learning."""
        if self.reference is not None:
            base = self.reference.base_s(key)
            if base is not None:
                return base
        learned = self._learned.get(key, ())
        return statistics.median(learned) if len(learned) >= LEARNED_BLOCKS else None

    def stop(self) -> float:
        """End the block, sleep what is left of its steady time and return that sleep (seconds)."""
        if self._started_at is None:
            return 0.0
        (compute_start, wall_start), (compute_end, wall_end) = self._started_at, self._now()
        self._started_at = None
        self.compute_time_s = max(0.0, compute_end - compute_start)
        wall_s = wall_end - wall_start
        if self.emulation is None:  # a real device: measured, never made steady
            self.busy_time_s += self.compute_time_s
            self.delay_s = 0.0
            return 0.0
        base = self.base_s(self._key)
        if base is None:
            self._learned.setdefault(self._key, []).append(self.compute_time_s)
            base = self.compute_time_s
        # A slowdown below 1 cannot make real compute faster: it is clamped to 1 (no delay).
        steady_s = max(1.0, self.slowdown) * base
        self.busy_time_s += steady_s
        self.steady_s += steady_s
        self.blocks += 1
        waits = self.window_waits is True or (
            not isinstance(self.window_waits, bool) and self._key in self.window_waits
        )
        over_s = (self.compute_time_s if waits else wall_s) - steady_s
        if over_s > 0.0:
            self.overrun_s += over_s
            self.overrun_blocks += 1
            kind = str(self._key[0] if isinstance(self._key, tuple) else self._key)
            self._overrun_by_kind[kind] = self._overrun_by_kind.get(kind, 0.0) + over_s
        self.delay_s = max(0.0, steady_s - wall_s)
        if self.delay_s > 0.0:
            time.sleep(self.delay_s)
        return self.delay_s

    def __enter__(self) -> ComputeSlowdown:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def warn_on_overrun(timer: ComputeSlowdown | None, *, rank: int) -> bool:
    """Log a warning when `timer`'s overrun exceeds `OVERRUN_WARNING_SHARE` of its steady compute; True then."""
    if timer is None or timer.emulation is None or timer.overrun_share <= OVERRUN_WARNING_SHARE:
        return False
    logger.warning(
        "rank %d: emulated compute ran %.1f%% over its steady time (%d of %d blocks, %.3f s): the rank lacked a "
        "core, or its real work is longer than its profile says; results that include it are not steady "
        "(docs/limits.md)",
        rank,
        100 * timer.overrun_share,
        timer.overrun_blocks,
        timer.blocks,
        timer.overrun_s,
    )
    return True
