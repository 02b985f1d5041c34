"""The ZeRO cost model: an allocation's iteration time at one stage (profiles/README.md, docs/search.md)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from poplar_ext.plan.formats import MIN_TIME_S, IncludedCommunication, Profile, listed, one_accumulation_count
from poplar_ext.plan.network_format import NetworkProfile

from .curves import fastest_size, fit_curve
from .model_states import DTYPE_BYTES

BACKWARD_SHARE = 2.0 / 3.0
"""Share of a micro-step spent in backward (two of its three matrix products): what
collectives overlapped with backward can hide under."""


@dataclass(frozen=True, kw_only=True)
class StageCommunication:
    """The collectives one ZeRO stage issues per iteration, priced by a network (seconds)."""

    zero_stage: int
    world_size: int
    micro_step_exposed_s: float
    """Per micro-step, collectives that compute waits for."""
    micro_step_overlapped_s: float
    """Per micro-step, collectives DeepSpeed overlaps with backward (stage 3's
    ``overlap_comm``, on by default there; only where the backend has streams)."""
    boundary_s: float
    """At the accumulation boundary."""

    def micro_step_time_s(self, compute_s: np.ndarray | float) -> np.ndarray | float:
        """A micro-step of `compute_s` seconds of compute, with its communication."""
        hidden = BACKWARD_SHARE * np.asarray(compute_s)
        return compute_s + self.micro_step_exposed_s + np.maximum(0.0, self.micro_step_overlapped_s - hidden)

    def compute_time_s(self, micro_step_s: np.ndarray) -> np.ndarray:
        """Inverse of `micro_step_time_s`: the compute in a measured micro-step that included communication."""
        without_exposed = np.asarray(micro_step_s, dtype=float) - self.micro_step_exposed_s
        if self.micro_step_overlapped_s > 0:
            # Where compute is too short to hide the overlapped part, the part that shows
            # is overlapped - share x compute: solve t = c + overlapped - share x c for c.
            short = without_exposed < self.micro_step_overlapped_s / BACKWARD_SHARE
            solved = (without_exposed - self.micro_step_overlapped_s) / (1.0 - BACKWARD_SHARE)
            without_exposed = np.where(short, solved, without_exposed)
        return np.maximum(without_exposed, MIN_TIME_S)


def stage_communication(
    network: NetworkProfile,
    *,
    zero_stage: int,
    num_parameters: int,
    dtype: str,
    world_size: int,
    recomputes_forward: bool = False,
) -> StageCommunication:
    """What ZeRO `zero_stage` communicates per micro-step and per boundary over `world_size` ranks: the whole model in
    the training dtype per collective (buckets priced alike: they are large; profiles/README.md)."""
    message_bytes = float(num_parameters) * DTYPE_BYTES[dtype]

    def time_s(collective: str) -> float:
        return network.time_s(collective, message_bytes, world_size)

    exposed = overlapped = boundary = 0.0
    if zero_stage == 0:
        boundary = time_s("all_reduce")
    elif zero_stage == 1:
        boundary = time_s("reduce_scatter") + time_s("all_gather")
    elif zero_stage == 2:  # DeepSpeed's overlap_comm defaults to off below stage 3
        exposed = time_s("reduce_scatter")
        boundary = time_s("all_gather")
    elif zero_stage == 3:
        # The forward gather counted exposed (prefetching hides part: conservative); a recomputed forward gathers again.
        exposed = time_s("all_gather")
        backward = (2 if recomputes_forward else 1) * time_s("all_gather") + time_s("reduce_scatter")
        if network.overlaps_compute:
            overlapped = backward
        else:
            exposed += backward
    else:
        raise ValueError(f"zero_stage: expected 0, 1, 2 or 3, found {zero_stage!r}")
    return StageCommunication(
        zero_stage=zero_stage,
        world_size=world_size,
        micro_step_exposed_s=exposed,
        micro_step_overlapped_s=overlapped,
        boundary_s=boundary,
    )


def micro_step_times_include_communication(profile: Profile) -> bool:
    """Whether a profile's micro-step times contain the stage's per-micro-step collectives.

    The profiler writes ``measured_with.micro_step_times_include_communication``; older
    profiles say it through their clock: a CPU rank's thread CPU time leaves out the
    gloo threads that communicate, CUDA events and modelled times include it.
    """
    flag = profile.measured_with.get("micro_step_times_include_communication")
    if isinstance(flag, bool):
        return flag
    return "CPU time" not in str(profile.measured_with.get("timing", ""))


@dataclass(frozen=True, kw_only=True, eq=False)
class DeviceCost:
    """What the search knows about one device type at one stage."""

    device_type: str
    """Name, as in the cluster description and the profile."""
    num_ranks: int
    """How many ranks of the cluster have this type."""
    step_time_table_s: np.ndarray
    """Micro-step time at sizes 1..max_micro_batch_size (index i = size i + 1), non-decreasing."""
    optimizer_step_time_s: float
    """The profile's accumulation-boundary time; with a network, only its compute (the
    optimizer step at this world size), the boundary collectives being `StageModel.communication`'s."""
    profile: Profile
    """The profile the table was fitted to."""
    compute_step_time_table_s: np.ndarray | None = None
    """With a network: the micro-step times without communication (the table is these plus it)."""

    @property
    def max_micro_batch_size(self) -> int:
        return len(self.step_time_table_s)

    @property
    def best_samples_per_s(self) -> float:
        """Best throughput of one rank over integer micro-batches (boundary excluded)."""
        size = fastest_size(self.step_time_table_s)
        return float(size / self.step_time_table_s[size - 1])


@dataclass(frozen=True, kw_only=True, eq=False)
class StageModel:
    """The cost model of one cluster at one ZeRO stage."""

    zero_stage: int
    """ZeRO stage 0..3."""
    devices: tuple[DeviceCost, ...]
    """One entry per device type, in order of first appearance in rank order."""
    rank_device_index: np.ndarray
    """For every rank, the index into `devices` of its type."""
    communication: StageCommunication | None = None
    """The stage's collectives at this world size (None: no network given; the boundary as measured)."""

    @property
    def world_size(self) -> int:
        return len(self.rank_device_index)

    @property
    def synchronised_micro_steps(self) -> bool:
        """True for stages 2 and 3: every rank must run the same accumulation count."""
        return one_accumulation_count(self.zero_stage)

    @property
    def boundary_s(self) -> float:
        communication = 0.0 if self.communication is None else self.communication.boundary_s
        return max(d.optimizer_step_time_s for d in self.devices) + communication

    @property
    def counts(self) -> np.ndarray:
        return np.array([d.num_ranks for d in self.devices], dtype=np.int64)

    @property
    def total_max_micro_batch(self) -> int:
        """Samples in one micro-step with every rank at its largest micro-batch."""
        return int(sum(d.num_ranks * d.max_micro_batch_size for d in self.devices))

    @property
    def ideal_samples_per_s(self) -> float:
        """Sum over ranks of each rank's best standalone throughput (boundary excluded)."""
        return float(sum(d.num_ranks * d.best_samples_per_s for d in self.devices))

    def rank_busy_times_s(self, micro_batch_sizes: np.ndarray, accumulation_steps: np.ndarray) -> np.ndarray:
        """Per-rank compute time per iteration: ``s_r * t_r(b_r)`` (seconds)."""
        return accumulation_steps * self.rank_micro_step_times_s(micro_batch_sizes)

    def rank_micro_step_times_s(self, micro_batch_sizes: np.ndarray, *, compute: bool = False) -> np.ndarray:
        """Per-rank time of one micro-step at its micro-batch size (`compute`: without communication)."""
        micro_batch_sizes = np.asarray(micro_batch_sizes, dtype=np.int64)
        times = np.empty(len(micro_batch_sizes))
        for index, device in enumerate(self.devices):
            mask = self.rank_device_index == index
            sizes = micro_batch_sizes[mask]
            outside = mask & ((micro_batch_sizes < 1) | (micro_batch_sizes > device.max_micro_batch_size))
            if np.any(outside):
                # Which ranks too: a plan gives each rank its own size, and a rank's is what to change.
                at = listed([f"rank {r} ({micro_batch_sizes[r]})" for r in np.flatnonzero(outside)])
                raise ValueError(
                    f"micro_batch_size: expected 1 to {device.max_micro_batch_size} on {device.device_type} "
                    f"at ZeRO stage {self.zero_stage}, found {int(sizes.min())}..{int(sizes.max())}; outside it: {at}"
                )
            table = device.compute_step_time_table_s if compute else None
            times[mask] = (device.step_time_table_s if table is None else table)[sizes - 1]
        return times

    def rank_compute_micro_step_times_s(self, micro_batch_sizes: np.ndarray) -> np.ndarray:
        """Per-rank micro-step time without communication (the same as `rank_micro_step_times_s` without a network)."""
        return self.rank_micro_step_times_s(micro_batch_sizes, compute=True)

    def iteration_time_s(self, micro_batch_sizes: np.ndarray, accumulation_steps: np.ndarray) -> float:
        """Predicted iteration time (seconds) of an allocation under this stage."""
        accumulation_steps = np.asarray(accumulation_steps, dtype=np.int64)
        if self.synchronised_micro_steps:
            # A plan with unequal counts is invalid at these stages (check_plan says so);
            # if asked anyway, the longest count sets the pace.
            micro = self.rank_micro_step_times_s(micro_batch_sizes)
            return float(accumulation_steps.max() * micro.max() + self.boundary_s)
        busy = self.rank_busy_times_s(micro_batch_sizes, accumulation_steps)
        return float(busy.max() + self.boundary_s)


def build_stage_model(
    profiles_by_type: dict[str, Profile],
    rank_device_types: Sequence[str],
    zero_stage: int,
    network: NetworkProfile | None = None,
) -> StageModel:
    """The cost model of ranks with `rank_device_types` at `zero_stage`, one profile (fitting a micro-batch) per
    device type; with a `network` communication is priced for these ranks (`device_cost`)."""
    counts = Counter(rank_device_types)
    priced = [
        device_cost(
            profiles_by_type[name],
            device_type=name,
            num_ranks=count,
            zero_stage=zero_stage,
            world_size=len(rank_device_types),
            network=network,
        )
        for name, count in counts.items()
    ]
    return assemble_stage_model([d for d, _ in priced], rank_device_types, zero_stage, priced[-1][1])


def _priced_by(network: NetworkProfile, profile: Profile, zero_stage: int, world_size: int) -> StageCommunication:
    """The collectives of `profile`'s model (and activation checkpointing) at `zero_stage` over `world_size` ranks."""
    return stage_communication(
        network,
        zero_stage=zero_stage,
        num_parameters=profile.model.num_parameters,
        dtype=profile.model.dtype,
        world_size=world_size,
        recomputes_forward=profile.activation_checkpointing,
    )


def included_communication(profile: Profile, network: NetworkProfile) -> IncludedCommunication:
    """What `profile`'s times hold when it was measured over `network` (the profiler records it)."""
    held = _priced_by(network, profile, profile.zero_stage, profile.world_size)
    return IncludedCommunication(**{f.name: getattr(held, f.name) for f in dataclasses.fields(IncludedCommunication)})


def profiled_communication(profile: Profile, network: NetworkProfile) -> StageCommunication:
    """The communication `profile`'s times hold: as priced when it was measured where it says
    (`Profile.included_communication`), else priced by `network` at the profile's world size."""
    held = profile.included_communication
    if held is None:
        return _priced_by(network, profile, profile.zero_stage, profile.world_size)
    return StageCommunication(zero_stage=profile.zero_stage, world_size=profile.world_size, **dataclasses.asdict(held))


def device_cost(
    profile: Profile,
    *,
    device_type: str,
    num_ranks: int,
    zero_stage: int,
    world_size: int,
    network: NetworkProfile | None,
) -> tuple[DeviceCost, StageCommunication | None]:
    """Device type `device_type` (measured by `profile`) among `world_size` ranks, and the stage's communication
    (None without a network: then the profile's times as measured).

    With a `network`, the profile's own communication is taken out of its times, the optimizer step scaled to a rank's
    shard, and the cluster's communication added (the same for every type of one setting).
    """
    curve = fit_curve(profile)
    assert curve is not None, "callers filter out profiles that fit no micro-batch"
    table = curve.table()
    optimizer_step_time_s = profile.optimizer_step_time_s
    compute_table = communication = None
    if network is not None:
        communication = _priced_by(network, profile, zero_stage, world_size)
        profiled = profiled_communication(profile, network)
        compute_table = profiled.compute_time_s(table) if micro_step_times_include_communication(profile) else table
        # The fitted table is non-decreasing; so must the priced one be (the policies rely on it).
        table = np.maximum.accumulate(communication.micro_step_time_s(compute_table))
        optimizer_step_time_s = max(0.0, profile.optimizer_step_time_s - profiled.boundary_s)
        if zero_stage >= 1:
            optimizer_step_time_s *= profile.world_size / world_size  # each rank updates 1/W of the states
    device = DeviceCost(
        device_type=device_type,
        num_ranks=num_ranks,
        step_time_table_s=table,
        optimizer_step_time_s=optimizer_step_time_s,
        profile=profile,
        compute_step_time_table_s=compute_table,
    )
    return device, communication


def assemble_stage_model(
    devices: Sequence[DeviceCost],
    rank_device_types: Sequence[str],
    zero_stage: int,
    communication: StageCommunication | None,
) -> StageModel:
    """The stage model of `devices` (one per device type, in order of first appearance in `rank_device_types`)."""
    index_of = {d.device_type: i for i, d in enumerate(devices)}
    rank_index = np.array([index_of[t] for t in rank_device_types], dtype=np.int64)
    return StageModel(
        zero_stage=zero_stage, devices=tuple(devices), rank_device_index=rank_index, communication=communication
    )
