"""The ``poplar`` policy at ZeRO stages 0 and 1: per-rank accumulation counts, balanced busy time.

Rank r may run any ``(b_r, s_r)`` with ``s_r * t_r(b_r) <= T``. The search finds the
smallest T at which the ranks can run ``B`` samples together (capacity: each rank's
largest ``b * s`` within T), then makes the sum exact: first by a two-level
construction (every rank of a type at one of two adjacent achievable counts, one odd
rank allowed), otherwise by exact sumsets of per-rank deltas; when no exact sum
exists at T it moves to the next time at which any ``s * t(b)`` is reached. Exact.
"""

from __future__ import annotations

import math
from collections import Counter
from functools import lru_cache

import numpy as np

from search.allocation import PolicyResult, finish
from search.cost import StageModel

SMALL_DELTA = 4096
"""Exact sums within this many samples of either end are decided by sumsets directly."""

MAX_BREAKPOINTS = 2_000_000
"""The automatic global batch compares at most this many capacity levels."""


def _steps_within(time_s: float, table: np.ndarray) -> np.ndarray:
    """For each size, the most micro-steps ``s`` with ``s * t(b) <= time_s`` (same float product as the cost model)."""
    steps = np.floor(time_s / table)
    steps = np.where((steps + 1) * table <= time_s, steps + 1, steps)
    steps = np.where(steps * table > time_s, steps - 1, steps)
    return steps.astype(np.int64)


class _FlatTables:
    """All types' tables end to end, so that capacity at a time is one vectorised pass."""

    def __init__(self, model: StageModel) -> None:
        tables = [d.step_time_table_s for d in model.devices]
        self.times_s = np.concatenate(tables)
        self.sizes = np.concatenate([np.arange(1, len(t) + 1) for t in tables])
        self.starts = np.cumsum([0] + [len(t) for t in tables[:-1]])
        self.counts = model.counts
        self.floor_s = max(float(t[0]) for t in tables)
        self.ideal_samples_per_s = model.ideal_samples_per_s
        # Rank r runs at least floor(T / t(b*)) * b* > T * rate_r - b* samples within T
        # (b* its best size), so capacity >= T * ideal - slack.
        self.slack = sum(
            d.num_ranks * int(np.argmax(np.arange(1, d.max_micro_batch_size + 1) / d.step_time_table_s) + 1)
            for d in model.devices
        )

    def capacity(self, time_s: float) -> int:
        """Samples all ranks can run within `time_s`, each at its most."""
        work = self.sizes * _steps_within(time_s, self.times_s)
        return int(self.counts @ np.maximum.reduceat(work, self.starts))

    def next_breakpoint(self, time_s: float) -> float:
        """The smallest ``s * t(b)`` over all types and sizes that is larger than `time_s`."""
        return float(np.min((_steps_within(time_s, self.times_s) + 1) * self.times_s))

    def min_time_for(self, total: int, world_size: int) -> float:
        """Smallest busy time at which the ranks together can run `total` samples (ignoring exactness)."""
        low = self.floor_s
        if self.capacity(low) >= total:
            return low
        # Capacity is at most T * ideal and at least T * ideal - slack: bracket from both.
        low = max(low, total / self.ideal_samples_per_s * (1 - 1e-12))
        high = math.ceil(total / world_size) * self.floor_s
        bound = (total + self.slack) / self.ideal_samples_per_s * (1 + 1e-12)
        if low < bound < high and self.capacity(bound) >= total:
            high = bound
        if self.capacity(low) >= total:
            low = self.floor_s
        while True:
            candidate = self.next_breakpoint(low)
            if self.capacity(candidate) >= total:
                return candidate
            mid = (low + high) / 2
            if mid <= candidate or mid >= high:
                low = candidate  # too close for bisection: step from breakpoint to breakpoint
            elif self.capacity(mid) >= total:
                high = mid
            else:
                low = mid


def _sumset(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """{x + y} of two sets given as boolean masks over [0, cap], truncated to [0, cap]."""
    cap = len(a)
    if cap <= 512:
        out = np.convolve(a.astype(np.int64), b.astype(np.int64))[:cap] > 0
    else:
        from scipy.signal import fftconvolve  # here: a slow import that most searches never need

        out = fftconvolve(a.astype(float), b.astype(float))[:cap] > 0.5
    return out


class _TypeSums:
    """Which reductions (below each rank's maximum) n identical ranks can make together.

    ``powers[j]`` is the set of sums of ``2**j`` single-rank reductions; the n-fold
    set is the sum of the powers in n's binary expansion. Kept so that a reachable
    total can be split back into per-rank reductions, as evenly as possible.
    """

    def __init__(self, single: np.ndarray, count: int) -> None:
        self.count = count
        self.powers = [single]
        while (1 << len(self.powers)) <= count:
            last = self.powers[-1]
            self.powers.append(last if last.all() else _sumset(last, last))
        self.bits = [j for j in range(len(self.powers)) if count >> j & 1]
        self.partials = [np.eye(1, len(single), dtype=bool)[0]]
        for j in self.bits:
            self.partials.append(_sumset(self.partials[-1], self.powers[j]))
        self._split = lru_cache(maxsize=None)(self._split_uncached)

    @property
    def reachable(self) -> np.ndarray:
        return self.partials[-1]

    @staticmethod
    def _closest_pair(left: np.ndarray, right: np.ndarray, total: int, target: float) -> int:
        """A ``u`` in `left` with ``total - u`` in `right`, closest to `target`."""
        candidates = np.flatnonzero(left[: total + 1] & right[total::-1])
        assert len(candidates), "total was reachable"
        return int(candidates[np.argmin(np.abs(candidates - target))])

    def _split_uncached(self, j: int, total: int) -> tuple[tuple[int, int], ...]:
        if total == 0:
            return ((0, 1 << j),)
        if j == 0:
            return ((total, 1),)
        half = self.powers[j - 1]
        u = self._closest_pair(half, half, total, total / 2)
        merged = Counter(dict(self._split(j - 1, u)))
        merged.update(dict(self._split(j - 1, total - u)))
        return tuple(sorted(merged.items()))

    def split(self, total: int) -> Counter:
        """Per-rank reductions summing to `total`: reduction -> number of ranks."""
        result: Counter = Counter()
        ranks_left = self.count
        for position in range(len(self.bits) - 1, -1, -1):
            j = self.bits[position]
            share = total * (1 << j) / ranks_left
            u = self._closest_pair(self.powers[j], self.partials[position], total, share)
            result.update(dict(self._split(j, u)))
            total -= u
            ranks_left -= 1 << j
        assert total == 0
        return result


def _realise(table: np.ndarray, work: int, time_s: float) -> tuple[int, int]:
    """(micro_batch, steps) with product `work` and the shortest busy time <= `time_s`."""
    sizes = np.arange(1, min(len(table), work) + 1)
    sizes = sizes[work % sizes == 0]
    busy = (work // sizes) * table[sizes - 1]
    ok = busy <= time_s
    assert np.any(ok), "work was taken from the achievable set"
    sizes, busy = sizes[ok], busy[ok]
    best = np.flatnonzero(busy == busy.min()).max()  # ties: the larger micro-batch
    return int(sizes[best]), int(work // sizes[best])


def _work_groups(table: np.ndarray, per_work: Counter, time_s: float) -> list[tuple[int, int, int]]:
    """Per-rank work counts -> ``(micro_batch, steps, count)`` groups, most work first."""
    merged: Counter = Counter()
    for work, count in per_work.items():
        if count:
            merged[_realise(table, work, time_s)] += count
    return [(micro, steps, count) for (micro, steps), count in sorted(merged.items(), key=lambda kv: -kv[0][0] * kv[0][1])]


def _achievable_work(table: np.ndarray, time_s: float, most: int) -> np.ndarray:
    """Sorted sample counts one rank can run within `time_s` (some b * s with s * t(b) <= time_s)."""
    mask = np.zeros(most + 1, dtype=bool)
    for size, steps in enumerate(_steps_within(time_s, table), start=1):
        if steps >= 1:
            mask[size : size * steps + 1 : size] = True
    return np.flatnonzero(mask)


def _two_level_at(model: StageModel, time_s: float, total: int, maxima: list[int]) -> list[list[tuple[int, int, int]]] | None:
    """Fast path of `_exact_at`: within each type, every rank runs one of two adjacent achievable counts.

    Type totals are proportional to capacity, clipped to what each type can run
    (water-filling); one type (each tried in turn) absorbs the rounding. Returns None
    when this shape cannot hit `total`.
    """
    counts = [d.num_ranks for d in model.devices]
    values = [_achievable_work(d.step_time_table_s, time_s, m) for d, m in zip(model.devices, maxima)]
    low = np.array([n * int(v[0]) for n, v in zip(counts, values)], dtype=float)
    high = np.array([n * int(v[-1]) for n, v in zip(counts, values)], dtype=float)
    # Shares in proportion to capacity, clipped to what each type can run (water-filling).
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if np.clip(mid * high, low, high).sum() < total:
            lo = mid
        else:
            hi = mid
    share = np.clip(hi * high, low, high)
    share *= total / share.sum()

    def near(i: int, target: float, spread: int) -> list[tuple[int, int, int]]:
        """Totals ``(total, level, ranks one level up)`` of type i around `target`, nearest first.

        Level l puts every rank at ``a[l]`` and `up` of them at ``a[l + 1]``.
        """
        n, a = counts[i], values[i]
        clipped = min(max(target, n * a[0]), n * a[-1])
        centre = min(int(np.searchsorted(n * a, clipped, side="right")) - 1, len(a) - 1)
        found = {n * int(a[-1]): (n * int(a[-1]), len(a) - 1, 0)}
        for level in range(max(0, centre - 2), min(len(a) - 1, centre + 3)):
            gap = int(a[level + 1] - a[level])
            middle = int(round((clipped - n * int(a[level])) / gap))
            for up in range(max(0, middle - spread), min(n, middle + spread) + 1):
                found.setdefault(n * int(a[level]) + up * gap, (n * int(a[level]) + up * gap, level, up))
        return sorted(found.values(), key=lambda pick: (abs(pick[0] - target), pick[0]))

    def two_level(n: int, a: np.ndarray, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each wanted total of n ranks: (reachable?, level, up), vectorised."""
        inside = (n * a[0] <= wanted) & (wanted <= n * a[-1])
        level = np.clip(np.searchsorted(n * a, wanted, side="right") - 1, 0, len(a) - 1)
        gap = np.where(level < len(a) - 1, a[np.minimum(level + 1, len(a) - 1)] - a[level], 1)
        offset = wanted - n * a[level]
        ok = inside & (offset % gap == 0) & ((level < len(a) - 1) | (offset == 0))
        return ok, level, np.where(ok, offset // gap, 0)

    def exactly(i: int, wanted: int) -> tuple[int, int, int, int | None] | None:
        """Type i's ranks in two adjacent levels, or failing that all but one of them
        with the odd rank at any count it can run: ``(total, level, up, odd)``."""
        n, a = counts[i], values[i]
        ok, level, up = two_level(n, a, np.array([wanted]))
        if ok[0]:
            return (wanted, int(level[0]), int(up[0]), None)
        if n == 1:
            return None
        ok, level, up = two_level(n - 1, a, wanted - a)
        hits = np.flatnonzero(ok)
        if len(hits) == 0:
            return None
        # The odd rank as close to the others as possible.
        k = hits[np.argmin(np.abs(a[hits] * (n - 1) - (wanted - a[hits])))]
        return (wanted, int(level[k]), int(up[k]), int(a[k]))

    def groups_of(picks: dict[int, tuple]) -> list[list[tuple[int, int, int]]]:
        groups = []
        for i, pick in sorted(picks.items()):
            _, level, up = pick[:3]
            odd = pick[3] if len(pick) > 3 else None
            per_work: Counter = Counter()
            if up:
                per_work[int(values[i][level + 1])] += up
            per_work[int(values[i][level])] += counts[i] - up - (odd is not None)
            if odd is not None:
                per_work[odd] += 1
            groups.append(_work_groups(model.devices[i].step_time_table_s, per_work, time_s))
        return groups

    if len(counts) == 1:
        pick = exactly(0, total)
        return None if pick is None else groups_of({0: pick})
    # The last type absorbs the rounding exactly; the one before it may move a few
    # steps off its share to make that possible.
    for last in range(len(counts) - 1, -1, -1):
        order = [j for j in range(len(counts)) if j != last]
        carry = 0.0
        picks: dict[int, tuple[int, int, int]] = {}
        for i in order[:-1]:
            target = share[i] + carry
            picks[i] = near(i, target, 0)[0]
            carry = target - picks[i][0]
        second = order[-1]
        fixed = sum(p[0] for p in picks.values())
        for candidate in near(second, share[second] + carry, 32):
            pick = exactly(last, total - fixed - candidate[0])
            if pick is not None:
                return groups_of({**picks, second: candidate, last: pick})
    return None


def _exact_at(model: StageModel, time_s: float, total: int) -> list[list[tuple[int, int, int]]] | None:
    """An allocation of exactly `total` samples with every rank busy <= `time_s`, or None.

    Tries `_two_level_at` first; otherwise decides exactly with sumsets of the per-rank
    reductions below each rank's maximum (`_TypeSums`).
    """
    maxima = []
    for device in model.devices:
        table = device.step_time_table_s
        maxima.append(int(np.max(np.arange(1, len(table) + 1) * _steps_within(time_s, table))))
    deficit = int(model.counts @ np.array(maxima)) - total
    assert deficit >= 0
    # Decide exactly with per-rank deltas from whichever end is nearer: down from every
    # rank's maximum, or up from one sample each. Small problems go straight to the
    # sumsets; large ones first try the (usually successful) two-level construction.
    headroom = total - model.world_size
    downward = deficit <= headroom
    target = deficit if downward else headroom
    if target > SMALL_DELTA:
        fast = _two_level_at(model, time_s, total, maxima)
        if fast is not None:
            return fast
    singles = []
    for device, top in zip(model.devices, maxima):
        values = _achievable_work(device.step_time_table_s, time_s, top)
        deltas = top - values if downward else values - 1
        single = np.zeros(target + 1, dtype=bool)
        single[deltas[deltas <= target]] = True
        singles.append(single)
    sums = [_TypeSums(single, device.num_ranks) for single, device in zip(singles, model.devices)]
    chain = [np.eye(1, target + 1, dtype=bool)[0]]
    for type_sums in sums:
        chain.append(_sumset(chain[-1], type_sums.reachable))
    if not chain[-1][target]:
        return None
    groups: list[list[tuple[int, int, int]]] = [[] for _ in model.devices]
    left = target
    for i in range(len(sums) - 1, -1, -1):
        share = left * model.devices[i].num_ranks / sum(d.num_ranks for d in model.devices[: i + 1])
        x = _TypeSums._closest_pair(sums[i].reachable, chain[i], left, share)
        per_work: Counter = Counter()
        for delta, count in sums[i].split(x).items():
            per_work[maxima[i] - delta if downward else 1 + delta] += count
        groups[i] = _work_groups(model.devices[i].step_time_table_s, per_work, time_s)
        left -= x
    return groups


def poplar_independent(model: StageModel, global_batch_size: int) -> PolicyResult:
    """The fastest allocation of exactly `global_batch_size` samples (stages 0 and 1)."""
    flat = _FlatTables(model)
    time_s = flat.min_time_for(global_batch_size, model.world_size)
    while True:
        groups = _exact_at(model, time_s, global_batch_size)
        if groups is not None:
            return PolicyResult(allocation=finish(model, groups))
        time_s = flat.next_breakpoint(time_s)


def _first_steps_from(low_s: float, table: np.ndarray) -> np.ndarray:
    """For each size, the fewest micro-steps ``s >= 1`` with ``s * t(b) >= low_s``."""
    steps = np.maximum(1, np.ceil(low_s / table))
    steps = np.where((steps > 1) & ((steps - 1) * table >= low_s), steps - 1, steps)
    steps = np.where(steps * table < low_s, steps + 1, steps)
    return steps.astype(np.int64)


def _capacity_levels(model: StageModel, low_s: float, high_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Every time ``s * t(b)`` in [low_s, high_s] and the capacity (samples of all ranks) at it.

    A rank's most work within T is the largest ``b * s`` among its (b, s) with
    ``s * t(b) <= T``; sorted by time, that is a running maximum per type.
    """
    times, types, work, start = [], [], [], []
    for index, device in enumerate(model.devices):
        table = device.step_time_table_s
        first = _first_steps_from(low_s, table)
        last = _steps_within(high_s, table)
        sizes = np.arange(1, len(table) + 1)
        start.append(int(np.max(sizes * (first - 1))))
        per_size = np.maximum(0, last - first + 1)
        size_index = np.repeat(np.arange(len(table)), per_size)
        offsets = np.arange(len(size_index)) - np.repeat(np.cumsum(per_size) - per_size, per_size)
        steps = first[size_index] + offsets
        times.append(steps * table[size_index])
        work.append(steps * sizes[size_index])
        types.append(np.full(len(size_index), index))
    times_all, types_all, work_all = np.concatenate(times), np.concatenate(types), np.concatenate(work)
    order = np.argsort(times_all, kind="stable")
    times_all, types_all, work_all = times_all[order], types_all[order], work_all[order]
    capacity = np.zeros(len(times_all), dtype=np.int64)
    for index, device in enumerate(model.devices):
        own = np.where(types_all == index, work_all, start[index])
        capacity += device.num_ranks * np.maximum.accumulate(own) if len(own) else 0
    # Only the last of equal times sees every (b, s) at that time.
    last_of_time = np.r_[times_all[1:] != times_all[:-1], True] if len(times_all) else np.zeros(0, dtype=bool)
    return times_all[last_of_time], capacity[last_of_time]


def _level_count(model: StageModel, low_s: float, high_s: float) -> int:
    return sum(
        int(np.sum(np.maximum(0, _steps_within(high_s, d.step_time_table_s) - _first_steps_from(low_s, d.step_time_table_s) + 1)))
        for d in model.devices
    )


def poplar_independent_best(model: StageModel, max_batch: int) -> PolicyResult:
    """The highest-throughput allocation of at most `max_batch` samples (stages 0 and 1)."""
    at_max = poplar_independent(model, max_batch)
    assert at_max.allocation is not None
    best_rate = at_max.allocation.samples_per_s
    # A capacity level (every rank at its most work within a time) is the best batch for
    # its time, so only levels can beat the maximum batch. A level at time T runs at
    # most ideal * T / (T + boundary) samples/s: levels below `cut` cannot win.
    ideal = model.ideal_samples_per_s
    boundary = model.boundary_s
    cut = best_rate * boundary / (ideal - best_rate) if ideal > best_rate else math.inf
    floor_s = max(float(d.step_time_table_s[0]) for d in model.devices)
    high = _FlatTables(model).min_time_for(max_batch, model.world_size)
    low = max(cut, floor_s)
    note = ""
    while low < high and _level_count(model, low, high) > MAX_BREAKPOINTS:
        low = (low + high) / 2
        note = f"capacity levels below {low:.4g} s were not compared (more than {MAX_BREAKPOINTS})"
    if low > high:
        return PolicyResult(allocation=at_max.allocation, note=note)
    times, capacity = _capacity_levels(model, low, high)
    rate = np.where(capacity <= max_batch, capacity / (times + boundary), -1.0)
    if len(rate) == 0 or rate.max() <= best_rate:
        return PolicyResult(allocation=at_max.allocation, note=note)
    k = int(np.argmax(rate))
    groups = _exact_at(model, float(times[k]), int(capacity[k]))
    assert groups is not None, "a capacity level is reachable at its own time"
    return PolicyResult(allocation=finish(model, groups), note=note)
