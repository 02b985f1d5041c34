"""The cost model: predicted iteration time of a per-rank allocation under one ZeRO stage.

Rank r runs ``s_r`` micro-steps of ``b_r`` samples; ``t_r`` is its device type's
monotone micro-step time curve (`search.curves`), evaluated at integer sizes.

* Stages 2 and 3 communicate on every micro-step, so every micro-step waits for the
  slowest rank and all ranks run the same count ``s``::

      iteration_time_s = s * max_r t_r(b_r) + boundary_s

* Stages 0 and 1 communicate at the accumulation boundary only, so each rank runs
  its own micro-steps and the boundary waits for the busiest rank::

      iteration_time_s = max_r (s_r * t_r(b_r)) + boundary_s

``boundary_s`` is the largest ``optimizer_step_time_s`` among the device types in
the cluster: the optimizer step and the boundary collectives end together.

Ranks of one device type are interchangeable, so the model keeps one entry per
device type with a rank count; the policies work per type and only the final
allocation is per rank.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from search.curves import fit_curve
from search.formats import Profile


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
    """The profile's accumulation-boundary time."""
    profile: Profile
    """The profile the table was fitted to."""

    @property
    def max_micro_batch_size(self) -> int:
        return len(self.step_time_table_s)

    @property
    def best_samples_per_s(self) -> float:
        """Best throughput of one rank over integer micro-batches (boundary excluded)."""
        sizes = np.arange(1, self.max_micro_batch_size + 1)
        return float(np.max(sizes / self.step_time_table_s))


@dataclass(frozen=True, kw_only=True, eq=False)
class StageModel:
    """The cost model of one cluster at one ZeRO stage."""

    zero_stage: int
    """ZeRO stage 0..3."""
    devices: tuple[DeviceCost, ...]
    """One entry per device type, in order of first appearance in rank order."""
    rank_device_index: np.ndarray
    """For every rank, the index into `devices` of its type."""

    @property
    def world_size(self) -> int:
        return len(self.rank_device_index)

    @property
    def synchronised_micro_steps(self) -> bool:
        """True for stages 2 and 3: every rank must run the same accumulation count."""
        return self.zero_stage >= 2

    @property
    def boundary_s(self) -> float:
        return max(d.optimizer_step_time_s for d in self.devices)

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

    def rank_micro_step_times_s(self, micro_batch_sizes: np.ndarray) -> np.ndarray:
        """Per-rank time of one micro-step at its micro-batch size."""
        micro_batch_sizes = np.asarray(micro_batch_sizes, dtype=np.int64)
        times = np.empty(len(micro_batch_sizes))
        for index, device in enumerate(self.devices):
            mask = self.rank_device_index == index
            sizes = micro_batch_sizes[mask]
            if np.any(sizes < 1) or np.any(sizes > device.max_micro_batch_size):
                raise ValueError(
                    f"micro_batch_size: expected 1 to {device.max_micro_batch_size} on {device.device_type} "
                    f"at ZeRO stage {self.zero_stage}, found {int(sizes.min())}..{int(sizes.max())}"
                )
            times[mask] = device.step_time_table_s[sizes - 1]
        return times

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
    profiles_by_type: dict[str, Profile], rank_device_types: Sequence[str], zero_stage: int
) -> StageModel:
    """The cost model of ranks with `rank_device_types` at `zero_stage`, one profile per device type.

    Every profile must fit at least one micro-batch (``max_micro_batch_size >= 1``);
    the caller reports stages where some device fits none as infeasible.
    """
    counts = dict(Counter(rank_device_types))
    types = list(counts)
    devices = []
    for name in types:
        profile = profiles_by_type[name]
        curve = fit_curve(profile)
        assert curve is not None, "callers filter out profiles that fit no micro-batch"
        devices.append(
            DeviceCost(
                device_type=name,
                num_ranks=counts[name],
                step_time_table_s=curve.table(),
                optimizer_step_time_s=profile.optimizer_step_time_s,
                profile=profile,
            )
        )
    index_of = {name: i for i, name in enumerate(types)}
    rank_index = np.array([index_of[t] for t in rank_device_types], dtype=np.int64)
    return StageModel(zero_stage=zero_stage, devices=tuple(devices), rank_device_index=rank_index)
