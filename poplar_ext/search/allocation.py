"""What every allocation policy returns, and the helpers they share. See docs/search.md."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .cost import StageModel


@dataclass(frozen=True, kw_only=True, eq=False)
class Allocation:
    """Per-rank micro-batch sizes and accumulation counts, rank order."""

    micro_batch_sizes: np.ndarray
    """Samples per micro-step, per rank."""
    accumulation_steps: np.ndarray
    """Micro-steps per iteration, per rank."""
    iteration_time_s: float
    """Predicted by the stage's cost model."""

    @property
    def global_batch_size(self) -> int:
        return int(np.sum(self.micro_batch_sizes * self.accumulation_steps))

    @property
    def samples_per_s(self) -> float:
        return self.global_batch_size / self.iteration_time_s


@dataclass(frozen=True, kw_only=True, eq=False)
class PolicyResult:
    """An allocation, or the reason a policy has none."""

    allocation: Allocation | None
    reason: str = ""
    """Why there is no allocation (a full sentence); empty when there is one."""
    note: str = ""
    """Anything the user should know about how the allocation was chosen."""

    @property
    def ok(self) -> bool:
        return self.allocation is not None


def infeasible(reason: str) -> PolicyResult:
    """A result with no allocation and `reason`."""
    return PolicyResult(allocation=None, reason=reason)


def finish(model: StageModel, groups: list[list[tuple[int, int, int]]]) -> Allocation:
    """Expand per-type groups ``(micro_batch, accumulation, count)`` to rank order."""
    sizes = np.empty(model.world_size, dtype=np.int64)
    steps = np.empty(model.world_size, dtype=np.int64)
    for index, type_groups in enumerate(groups):
        ranks = np.flatnonzero(model.rank_device_index == index)
        start = 0
        for micro, accumulation, count in type_groups:
            sizes[ranks[start : start + count]] = micro
            steps[ranks[start : start + count]] = accumulation
            start += count
        assert start == len(ranks), "every rank of a type gets exactly one group"
    return Allocation(
        micro_batch_sizes=sizes,
        accumulation_steps=steps,
        iteration_time_s=model.iteration_time_s(sizes, steps),
    )


def at_steps(model: StageModel, split: list[list[tuple[int, int]]], steps: int) -> PolicyResult:
    """The allocation of per-type ``(micro_batch, count)`` groups, every rank at `steps` micro-steps."""
    return PolicyResult(allocation=finish(model, [[(micro, steps, count) for micro, count in g] for g in split]))


def batch_problem(model: StageModel, global_batch_size: int, *, upper_bound: bool = False) -> str:
    """Why no policy can allocate `global_batch_size` (a sentence), or ``""``; `upper_bound`: the batch is the
    largest one allowed (a maximum given for the automatic global batch), and the sentence says so."""
    if global_batch_size < model.world_size:
        batch = (
            f"largest global batch allowed ({global_batch_size})"
            if upper_bound
            else f"global batch {global_batch_size}"
        )
        ranks = model.world_size
        return f"The {batch} is smaller than the {ranks} ranks; every rank needs at least one sample per iteration."
    return ""


def divisors(n: int) -> np.ndarray:
    """The divisors of `n`, ascending."""
    small = np.arange(1, math.isqrt(n) + 1, dtype=np.int64)
    small = small[n % small == 0]
    return np.unique(np.concatenate([small, n // small]))
