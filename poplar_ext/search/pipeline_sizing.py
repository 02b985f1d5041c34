"""Every pipeline's micro-batch size and count: they sum to the global batch in the least time (docs/search.md)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .poplar_independent import TypeSums, sumset

MAX_SUMSET = 1 << 22
"""The largest global batch the exact sizing handles (its sumsets are arrays of up to this many values)."""
STEPS_BEFORE_GALLOP = 8
"""Breakpoints tried one by one after T0 before galloping (the exact sum is usually found there)."""
MAX_LISTED_BREAKPOINTS = 50_000
"""Up to this many (size, count) options the breakpoints are listed and sorted; beyond, time is bisected."""


@dataclass(frozen=True, kw_only=True, eq=False)
class PipelineOptions:
    """What each of `count` identical pipelines can run: ``m`` micro-batches of size ``sizes[i]``
    in ``(m + num_stages - 1) x stage_s[i]`` seconds, ``1 <= m <= max_micro_batches[i]``.

    A size may have several entries, each with its time and limit (a split that fits
    fewer micro-batches in flight can be faster, for fewer micro-batches)."""

    num_stages: int
    sizes: np.ndarray
    """Usable micro-batch sizes (int64), one per entry."""
    stage_s: np.ndarray
    """The slowest stage's time per micro-batch at each size."""
    max_micro_batches: np.ndarray
    """Memory's limit on the count at each size (int64)."""
    count: int = 1

    def micro_batches_within(self, time_s: float, global_batch_size: int) -> np.ndarray:
        """Per size, the most micro-batches within `time_s` (0: none), with ``b x m <= B``."""
        offset = self.num_stages - 1
        m = np.floor(time_s / self.stage_s) - offset
        # The same float product as the cost model decides, not the division.
        m = np.where((m + 1 + offset) * self.stage_s <= time_s, m + 1, m)
        m = np.where((m + offset) * self.stage_s > time_s, m - 1, m)
        limit = np.minimum(self.max_micro_batches, global_batch_size // self.sizes)
        return np.clip(m, 0, limit).astype(np.int64)

    def most_samples(self, time_s: float, global_batch_size: int) -> int:
        return int(np.max(self.sizes * self.micro_batches_within(time_s, global_batch_size), initial=0))

    def time_s(self, index: int, num_micro_batches: int) -> float:
        return (num_micro_batches + self.num_stages - 1) * float(self.stage_s[index])


@dataclass(frozen=True, kw_only=True)
class Sizing:
    """The outcome: per class, one ``(micro_batch_size, num_micro_batches)`` per pipeline."""

    time_s: float
    """The slowest pipeline's time."""
    choices: tuple[tuple[tuple[int, int], ...], ...]
    """Per class (as given), ``count`` pairs."""


# -- Sumsets
def _picks(sums: TypeSums, total: int) -> list[int]:
    """One pick per copy whose sum is `total` (which must be reachable)."""
    picks: list[int] = []
    for k in range(len(sums.bits) - 1, -1, -1):
        part = _split(total, sums.partials[k], sums.powers[sums.bits[k]])
        picks += _unfold(sums, part, sums.bits[k])
        total -= part
    assert total == 0
    return picks


def _unfold(sums: TypeSums, total: int, level: int) -> list[int]:
    if level == 0 or total == 0:
        # Nothing left to share out (deficits only: 0 is a pipeline at its most, in every deficit set).
        return [total] + [0] * ((1 << level) - 1)
    half = _split(total, sums.powers[level - 1], sums.powers[level - 1])
    return _unfold(sums, total - half, level - 1) + _unfold(sums, half, level - 1)


def _split(total: int, left: np.ndarray, right: np.ndarray) -> int:
    """A value y in `right` with ``total - y`` in `left`."""
    ys = np.flatnonzero(right[: total + 1])
    fits = left[total - ys]
    assert np.any(fits), "the sum was reachable"
    return int(ys[np.argmax(fits)])


# -- The exact split of B at a time
def _value_set(options: PipelineOptions, m: np.ndarray, most: int, limit: int, as_deficit: bool) -> np.ndarray:
    """What one pipeline can give up (deficit) or run (total), as an indicator over 0..limit."""
    values = np.zeros(limit + 1, dtype=bool)
    for b, count in zip(options.sizes.tolist(), m.tolist()):
        if count < 1:
            continue
        if as_deficit:
            low = max(1, -(-(most - limit) // b))
            works = b * np.arange(low, count + 1)
            values[most - works] = True
        else:
            values[b * np.arange(1, min(count, limit // b) + 1)] = True
    return values


def _exact_at(
    classes: Sequence[PipelineOptions], time_s: float, global_batch_size: int
) -> tuple[tuple[tuple[int, int], ...], ...] | None:
    """Per class, per pipeline ``(b, m)`` within `time_s` summing to B; None when there is none."""
    ms = [c.micro_batches_within(time_s, global_batch_size) for c in classes]
    most = [int(np.max(c.sizes * m, initial=0)) for c, m in zip(classes, ms)]
    if any(w == 0 for w in most):
        return None
    surplus = sum(c.count * w for c, w in zip(classes, most)) - global_batch_size
    if surplus < 0:
        return None
    as_deficit = surplus <= global_batch_size
    target = surplus if as_deficit else global_batch_size
    assert target <= MAX_SUMSET, "search_pipeline_plan holds the global batch to MAX_SUMSET"
    sumsets = [TypeSums(_value_set(c, m, w, target, as_deficit), c.count) for c, m, w in zip(classes, ms, most)]
    partial = [np.eye(1, target + 1, dtype=bool)[0]]  # the sums of the first k classes' picks
    for sums in sumsets:
        partial.append(sumset(partial[-1], sums.reachable))
    if not partial[-1][target]:
        return None
    choices = []
    for k in range(len(classes) - 1, -1, -1):
        mine = _split(target, partial[k], sumsets[k].reachable)
        target -= mine
        works = [most[k] - v if as_deficit else v for v in _picks(sumsets[k], mine)]
        choices.append(tuple(_fastest_way(classes[k], ms[k], work) for work in works))
    return tuple(reversed(choices))


def _fastest_way(options: PipelineOptions, m: np.ndarray, work: int) -> tuple[int, int]:
    """The quickest ``(b, m)`` running exactly `work` samples (ties: the larger micro-batch)."""
    best = None
    for index, (b, limit) in enumerate(zip(options.sizes.tolist(), m.tolist())):
        if work % b == 0 and 1 <= work // b <= limit:
            time_s = options.time_s(index, work // b)
            if best is None or time_s <= best[0]:
                best = (time_s, b, work // b)
    assert best is not None, "the work came from these options"
    return best[1], best[2]


# -- The smallest time
def _next_breakpoint(classes: Sequence[PipelineOptions], time_s: float, global_batch_size: int) -> float:
    """The smallest ``(m + S - 1) tau(b)`` above `time_s` with m within the limits (inf when none)."""
    best = math.inf
    for c in classes:
        m = c.micro_batches_within(time_s, global_batch_size) + 1
        limit = np.minimum(c.max_micro_batches, global_batch_size // c.sizes)
        times = (m + c.num_stages - 1) * c.stage_s
        times = times[(m <= limit) & (times > time_s)]
        if len(times):
            best = min(best, float(times.min()))
    return best


def _listed_breakpoints(classes: Sequence[PipelineOptions], global_batch_size: int) -> np.ndarray | None:
    limits = [np.minimum(c.max_micro_batches, global_batch_size // c.sizes) for c in classes]
    if sum(int(x.sum()) for x in limits) > MAX_LISTED_BREAKPOINTS:
        return None
    times = [
        (np.arange(1, n + 1) + c.num_stages - 1) * t
        for c, lim in zip(classes, limits)
        for t, n in zip(c.stage_s.tolist(), lim.tolist())
    ]
    return np.unique(np.concatenate(times)) if times else np.zeros(0)


def lower_bound_s(classes: Sequence[PipelineOptions], global_batch_size: int) -> float:
    """T0: the smallest breakpoint at which the pipelines' most samples reach B (inf when none does)."""

    def enough(time_s: float) -> bool:
        return sum(c.count * c.most_samples(time_s, global_batch_size) for c in classes) >= global_batch_size

    listed = _listed_breakpoints(classes, global_batch_size)
    if listed is not None:
        first = bisect.bisect_left(listed, True, key=lambda time_s: enough(float(time_s)))
        return float(listed[first]) if first < len(listed) else math.inf
    lo, hi = 0.0, _all_options_s(classes, global_batch_size)
    if not enough(hi):
        return math.inf
    while lo < (mid := (lo + hi) / 2) < hi:
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi


def _all_options_s(classes: Sequence[PipelineOptions], global_batch_size: int) -> float:
    """A time within which every option of every pipeline fits."""
    return max(
        float(np.max((np.minimum(c.max_micro_batches, global_batch_size // c.sizes) + c.num_stages - 1) * c.stage_s))
        for c in classes
    )


def size_pipelines(classes: Sequence[PipelineOptions], global_batch_size: int) -> Sizing | None:
    """The smallest time at which the pipelines run exactly `global_batch_size` samples (None: never).

    Every class needs at least one usable size; each pipeline runs at least one micro-batch.
    """
    if any(len(c.sizes) == 0 for c in classes) or sum(c.count for c in classes) > global_batch_size:
        return None
    time_s = lower_bound_s(classes, global_batch_size)
    infeasible_s = None
    for _ in range(STEPS_BEFORE_GALLOP):
        if time_s == math.inf:
            return None
        choices = _exact_at(classes, time_s, global_batch_size)
        if choices is not None:
            # The first feasible breakpoint after an infeasible one: optimal.
            return Sizing(time_s=_slowest(classes, choices), choices=choices)
        infeasible_s, time_s = time_s, _next_breakpoint(classes, time_s, global_batch_size)
    if time_s == math.inf:
        return None
    everything_s = _all_options_s(classes, global_batch_size)
    gap = time_s - infeasible_s
    while (choices := _exact_at(classes, time_s, global_batch_size)) is None:
        if time_s >= everything_s:
            return None
        infeasible_s, gap = time_s, 2 * gap
        time_s = min(time_s + gap, everything_s)
    lo, hi = infeasible_s, time_s
    while lo < (mid := (lo + hi) / 2) < hi:
        found = _exact_at(classes, mid, global_batch_size)
        if found is None:
            lo = mid
        else:
            hi, choices = mid, found
    return Sizing(time_s=_slowest(classes, choices), choices=choices)


def pick_time_s(options: PipelineOptions, micro_batch_size: int, num_micro_batches: int) -> float:
    """The quickest entry running `num_micro_batches` of `micro_batch_size`."""
    allowed = (options.sizes == micro_batch_size) & (options.max_micro_batches >= num_micro_batches)
    return (num_micro_batches + options.num_stages - 1) * float(options.stage_s[allowed].min())


def _slowest(classes: Sequence[PipelineOptions], choices: tuple[tuple[tuple[int, int], ...], ...]) -> float:
    return max(pick_time_s(c, b, m) for c, picks in zip(classes, choices) for b, m in picks)
