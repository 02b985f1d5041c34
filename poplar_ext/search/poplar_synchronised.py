"""``poplar`` at ZeRO stages 2-3: per divisor s of B, the lowest micro-step time level holding B / s samples,
the excess trimmed from the slowest micro-steps: exact. See docs/search.md."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .allocation import PolicyResult, at_steps, batch_problem, divisors, infeasible
from .cost import StageModel


@dataclass(frozen=True, kw_only=True, eq=False)
class _Levels:
    """Micro-step time levels and, at each, how many samples every type can take."""

    times_s: np.ndarray
    """Candidate micro-step times (sorted): every table value at or above the slowest size-1 step."""
    caps: np.ndarray
    """caps[d, k]: largest micro-batch of type d whose time is <= times_s[k]."""
    capacity: np.ndarray
    """Samples per micro-step with every rank at its cap, per level (non-decreasing)."""


def _levels(model: StageModel) -> _Levels:
    tables = [d.step_time_table_s for d in model.devices]
    floor_s = max(t[0] for t in tables)
    times = np.unique(np.concatenate(tables))
    times = times[times >= floor_s]
    caps = np.stack([np.searchsorted(t, times, side="right") for t in tables])
    return _Levels(times_s=times, caps=caps, capacity=model.counts @ caps)


def _trim(model: StageModel, caps: np.ndarray, total: int) -> list[list[tuple[int, int]]]:
    """Lower per-type sizes from `caps` until they sum to `total`, slowest micro-step first."""
    # Whole types lowered a size at a time keep identical ranks equal; ties go to the smaller size, so that a faster
    # device never gets less.
    sizes = caps.astype(np.int64).copy()
    counts = model.counts
    excess = int(counts @ sizes) - total
    assert excess >= 0
    while excess > 0:
        best = None
        for i, device in enumerate(model.devices):
            if sizes[i] <= 1:
                continue
            key = (-device.step_time_table_s[sizes[i] - 1], sizes[i], i)
            if best is None or key < best:
                best = key
        assert best is not None, "total >= world size leaves a rank above size 1"
        i = best[2]
        if counts[i] <= excess:
            sizes[i] -= 1
            excess -= int(counts[i])
        else:
            groups = [[(int(s), int(c))] for s, c in zip(sizes, counts)]
            groups[i] = [(int(sizes[i]), int(counts[i] - excess)), (int(sizes[i]) - 1, excess)]
            return groups
    return [[(int(s), int(c))] for s, c in zip(sizes, counts)]


def _synchronised_time(levels: _Levels, model: StageModel, steps: np.ndarray, per_step: np.ndarray) -> np.ndarray:
    """Best iteration time for each (accumulation count, samples per micro-step) pair."""
    index = np.searchsorted(levels.capacity, per_step, side="left")
    return steps * levels.times_s[np.minimum(index, len(levels.times_s) - 1)] + model.boundary_s


def poplar_synchronised(model: StageModel, global_batch_size: int) -> PolicyResult:
    """The fastest allocation of exactly `global_batch_size` samples (stages 2 and 3)."""
    levels = _levels(model)
    steps = divisors(global_batch_size)
    per_step = global_batch_size // steps
    valid = (per_step >= model.world_size) & (per_step <= levels.capacity[-1])
    if not np.any(valid):
        return infeasible(
            f"No accumulation count s divides the global batch {global_batch_size} so that B / s lies between "
            f"the {model.world_size} ranks and {int(levels.capacity[-1])} (every rank at its largest "
            f"micro-batch); stage {model.zero_stage} needs the same count on every rank."
        )
    steps, per_step = steps[valid], per_step[valid]
    times = _synchronised_time(levels, model, steps, per_step)
    best = int(np.argmin(times))  # first minimum: the fewest micro-steps among ties
    level = int(np.searchsorted(levels.capacity, per_step[best], side="left"))
    split = _trim(model, levels.caps[:, level], int(per_step[best]))
    return at_steps(model, split, int(steps[best]))


def poplar_synchronised_best(model: StageModel, max_batch: int) -> PolicyResult:
    """The highest-throughput allocation of at most `max_batch` samples (stages 2 and 3)."""
    levels = _levels(model)
    # Capacity levels with as many micro-steps as the maximum allows ...
    per_step = np.unique(levels.capacity[levels.capacity <= max_batch])
    steps = max_batch // per_step
    # ... and, for each count, the largest batch under the maximum.
    edge_steps = np.arange(1, min(max_batch // model.world_size, 100_000) + 1, dtype=np.int64)
    edge_per_step = max_batch // edge_steps
    keep = edge_per_step <= levels.capacity[-1]
    steps = np.concatenate([steps, edge_steps[keep]])
    per_step = np.concatenate([per_step, edge_per_step[keep]])
    if len(steps) == 0:
        return infeasible(batch_problem(model, max_batch, upper_bound=True))
    rate = steps * per_step / _synchronised_time(levels, model, steps, per_step)
    best = int(np.argmax(rate))
    return poplar_synchronised(model, int(steps[best] * per_step[best]))
