"""What the demo runs: the emulated cluster, the model, the DeepSpeed config, the schedule (no torch: `--help` and
the unit tests stay fast)."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from poplar_ext.plan.formats import (
    ZERO_STAGES,
    Cluster,
    ClusterNode,
    DeviceGroup,
    DeviceTypeInfo,
    Emulation,
)

MIB = 1 << 20

CALIBRATION_MODES = ("cached", "always", "off")  # `DemoSettings.calibration`'s values
CALIBRATION_ACTIONS = ("rescale", "remeasure")


@dataclass(frozen=True, kw_only=True)
class DemoDevice:
    """One emulated device type of the demo cluster (one rank each)."""

    name: str
    slowdown: float
    """Compute slowdown against the real CPU core the rank runs on."""
    memory_headroom_bytes: int
    """Emulated memory above the rank's baseline (interpreter, libraries, model,
    optimizer: the CPU peak the profiler measures is the whole process's)."""


def default_devices() -> tuple[DemoDevice, ...]:
    # Relative speeds 1 : 1/2 : 1/4, like the fast / 2x slower / 4x slower.
    # Even the fast type is 3x slower than a core, so the three ranks together need
    # 1/3 + 1/6 + 1/12 of a core and do not compete for a 2-core machine's cores
    # (real devices do not share compute), and a rank that waits for a core while
    # other processes run still meets its emulated duration (see
    # poplar_ext.hardware.emulation.ComputeSlowdown). Slower types get less memory, as on real
    # mixed clusters: uniform (one micro-batch for all) is held to cpu-slow's.
    return (
        DemoDevice(name="cpu-fast", slowdown=3.0, memory_headroom_bytes=192 * MIB),
        DemoDevice(name="cpu-medium", slowdown=6.0, memory_headroom_bytes=96 * MIB),
        DemoDevice(name="cpu-slow", slowdown=12.0, memory_headroom_bytes=48 * MIB),
    )


def eight_rank_devices() -> tuple[DemoDevice, ...]:
    """`poplar-bench demo --eight-ranks`: two ``cpu8-fast`` (6x slower than a core), three ``cpu8-medium`` (12x),
    three ``cpu8-slow`` (24x): together 2/6 + 3/12 + 3/24 = 0.71 of a core, so more ranks than a 2-core machine's
    cores still compute on a core each. Their own type names keep their profiles apart in the demo's cache."""
    kinds = (("cpu8-fast", 6.0, 2, 192 * MIB), ("cpu8-medium", 12.0, 3, 96 * MIB), ("cpu8-slow", 24.0, 3, 48 * MIB))
    return tuple(
        DemoDevice(name=name, slowdown=slowdown, memory_headroom_bytes=headroom)
        for name, slowdown, count, headroom in kinds
        for _ in range(count)
    )


FASTEST_HEADROOM_BYTES = 192 * MIB
MIN_HEADROOM_BYTES = 32 * MIB


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (taskset, a container's cpuset), which can be fewer than
    the machine's ``os.cpu_count()``; the reports' ``usable_cpus``."""
    cores = os.cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        cores = min(cores, len(os.sched_getaffinity(0)) or cores)
    return cores


def devices_from_slowdowns(slowdowns: list[float] | tuple[float, ...]) -> tuple[DemoDevice, ...]:
    """One emulated device type per rank, ``cpu<rank>-x<slowdown>``, for configurations nobody tuned. Memory follows
    speed as in the default cluster: the fastest gets 192 MiB of headroom, one k times slower 1/k of it (>= 32 MiB)."""
    if len(slowdowns) < 2:
        raise ValueError(f"slowdowns: expected at least 2 values (one rank each), found {len(slowdowns)}")
    bad = [s for s in slowdowns if not (isinstance(s, (int, float)) and s >= 1.0)]
    if bad:
        raise ValueError(f"slowdowns: expected numbers >= 1 (compute slowdown against a CPU core), found {bad}")
    cores_needed, cores = sum(1.0 / s for s in slowdowns), usable_cores()
    if cores_needed > cores:
        # Ranks that compete for cores are slowed by each other, not by their emulation.
        raise ValueError(
            f"slowdowns: the emulated ranks need {cores_needed:.2f} cores together (sum of 1/slowdown), "
            f"this machine has {cores}: use larger slowdowns"
        )
    fastest = min(slowdowns)
    return tuple(
        DemoDevice(
            name=f"cpu{rank}-x{slowdown:g}",
            slowdown=float(slowdown),
            memory_headroom_bytes=max(
                MIN_HEADROOM_BYTES, int(FASTEST_HEADROOM_BYTES * fastest / slowdown) // MIB * MIB
            ),
        )
        for rank, slowdown in enumerate(slowdowns)
    )


@dataclass(frozen=True, kw_only=True)
class DemoModel:
    """Shape of the toy GPT (poplar_ext.models.toy_gpt.GPTConfig fields); ~0.9M parameters."""

    vocab_size: int = 256
    sequence_length: int = 64
    num_layers: int = 4
    num_heads: int = 4
    hidden_size: int = 128


_POSITIVE_INTS = "global_batch_size max_micro_batch_size profile_repeats iterations rounds standalone_repeats".split()


@dataclass(frozen=True, kw_only=True)
class DemoSettings:
    """Everything the demo's behaviour depends on; the CLI sets a few of these."""

    devices: tuple[DemoDevice, ...] = field(default_factory=default_devices)
    """One rank per device, in rank order (devices of one name are ranks of one type)."""
    nodes: int = 1
    """Emulated nodes the ranks are split over, in rank order and evenly (all on this machine)."""
    model: DemoModel = field(default_factory=DemoModel)
    zero_stage: int = 1
    """ZeRO stage of every policy's run (default 1: it communicates only at the accumulation boundary, so each
    rank's busy time is measured apart from its waiting)."""
    global_batch_size: int = 192
    """Samples per iteration, the same for every policy."""
    max_micro_batch_size: int = 48
    """Largest micro-batch the profiler tries on any device."""
    profile_repeats: int = 5
    """Measured micro-steps per size when profiling (median): more than the profiler's 3, as the search picks the
    sizes whose profiled times look best, so noise turns into plans slower than predicted."""
    iterations: int = 2
    """Measured iterations per policy in each round."""
    warmup_iterations: int = 1
    """Unmeasured iterations of each policy at the start of every round (after the switch of engine)."""
    rounds: int = 3
    """Each round runs every policy in turn, so background load hits all policies alike."""
    standalone_repeats: int = 5
    """Micro-steps timed per size when measuring each device's standalone throughput."""
    cache_dir: Path | None = None
    """Where the demo keeps its emulated cluster (``cluster.json``) and the profiler's
    cache (``profiles/``). None: ``$XDG_CACHE_HOME/poplar-ext/demo`` (``~/.cache`` when unset)."""
    force_profile: bool = False
    """Measure again even when cached profiles exist."""
    activation_checkpointing: str = "off"
    """What the profiler measures (``activation_checkpointing``): ``off`` here, ``both`` for the checkpointing bench."""
    calibration: str = "off"
    """Check profiles against micro-steps timed at start (`poplar_ext.profiler.calibration`): ``cached`` (cached
    profiles only, as a job does), ``always``, ``off`` (default: emulated compute is steady at its profile's times)."""
    calibration_action: str = "rescale"
    """``rescale`` or ``remeasure`` (``poplar.calibration.action``)."""
    calibration_threshold: float = 0.1
    """Largest |measured / profiled - 1| a profile is trusted with (``poplar.calibration.threshold``)."""
    seed: int = 0
    timeout_s: float = 600.0
    """The whole multi-rank run is abandoned (ranks killed) after this long."""

    def __post_init__(self) -> None:
        if len(self.devices) < 2:
            raise ValueError(f"devices: expected at least 2 emulated devices, found {len(self.devices)}")
        if not isinstance(self.nodes, int) or not 1 <= self.nodes <= len(self.devices):
            raise ValueError(
                f"nodes: expected an integer from 1 to the ranks ({len(self.devices)}), found {self.nodes!r}"
            )
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage: expected 0, 1, 2 or 3, found {self.zero_stage!r}")
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, found {value!r}")
        for name, choices in (("calibration", CALIBRATION_MODES), ("calibration_action", CALIBRATION_ACTIONS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}: expected one of {', '.join(choices)}, found {getattr(self, name)!r}")
        if not 0.0 < self.calibration_threshold <= 10.0:
            raise ValueError(
                f"calibration_threshold: expected a number in (0, 10], found {self.calibration_threshold!r}"
            )
        if self.global_batch_size < len(self.devices):
            raise ValueError(
                f"global_batch_size: expected at least one sample per rank ({len(self.devices)}), found "
                f"{self.global_batch_size}"
            )

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def cache_root(self) -> Path:
        if self.cache_dir is not None:
            return Path(self.cache_dir)
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "poplar-ext" / "demo"

    def profiles_dir(self) -> Path:
        """The profiler's cache: one profile file per (device type, stage)."""
        return self.cache_root() / "profiles"

    def cluster_file(self) -> Path:
        """The emulated cluster of the last run, reused so that cached profiles match it."""
        return self.cache_root() / "cluster.json"


BASELINE_ROUNDING_BYTES = 32 * MIB


def memory_capacity_bytes(device: DemoDevice, baseline_bytes: int) -> int:
    """`device`'s emulated capacity: the baseline rounded up to 32 MiB, plus its headroom."""
    rounded = -(-baseline_bytes // BASELINE_ROUNDING_BYTES) * BASELINE_ROUNDING_BYTES
    return rounded + device.memory_headroom_bytes


def demo_cluster(settings: DemoSettings, *, baseline_bytes: int) -> Cluster:
    """`settings.nodes` nodes of the ranks in order, with the emulations declared: capacities above
    `baseline_bytes`, the ranks' measured memory before any micro-batch (see `memory_capacity_bytes`)."""
    quotient, remainder = divmod(len(settings.devices), settings.nodes)
    nodes, first = [], 0
    for index in range(settings.nodes):
        count = quotient + (index < remainder)
        names = (device.name for device in settings.devices[first : first + count])
        groups = tuple(DeviceGroup(device_type=name, count=len(list(run))) for name, run in itertools.groupby(names))
        first += count
        nodes.append(ClusterNode(name="localhost" if settings.nodes == 1 else f"node{index}", devices=groups))
    return Cluster(
        nodes=tuple(nodes),
        device_types={
            d.name: DeviceTypeInfo(
                emulation=Emulation(slowdown=d.slowdown, memory_capacity_bytes=memory_capacity_bytes(d, baseline_bytes))
            )
            for d in settings.devices
        },
    )


def deepspeed_config(settings: DemoSettings) -> dict[str, Any]:
    """An ordinary DeepSpeed config for the demo; the true global batch is the only batch key (poplar_ext gives
    each rank its micro-batch and accumulation count from the plan, the profiler sets its own). Gradient clipping
    is explicit: DeepSpeed 0.19.8 defaults it to 1.0. ``torch_adam``: DeepSpeed's own Adam on CPU is a C++ op it
    compiles on first use (~70 s on 2 cores)."""
    return {
        "train_batch_size": settings.global_batch_size,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": settings.zero_stage},
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }
