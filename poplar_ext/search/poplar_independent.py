"""``poplar`` at ZeRO stages 0-1: the least time at which the ranks run exactly B samples (docs/search.md)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .allocation import PolicyResult, finish
from .cost import StageModel
from .curves import fastest_size

SMALL_DELTA = 4096
"""Exact sums within this many samples of either end are decided by sumsets directly."""

MAX_BREAKPOINTS = 2_000_000
"""The automatic global batch compares at most this many capacity levels."""

TWO_LEVEL_MAX_WORK = 1 << 21
"""The two-level construction holds one rank's achievable works as a mask: above this
many samples per rank it is skipped (the exact methods do not need it)."""

RESIDUE_MAX_MODULUS = 1024
"""Residue classes are taken modulo micro-batch sizes up to this (arrays of its square)."""

_INF = np.int64(1) << 61
"""No sum in this residue class (twice it still fits in int64)."""

Groups = list[list[tuple[int, int, int]]]
"""Per device type, ``(micro_batch, accumulation_steps, num_ranks)`` groups."""


def steps_within(time_s: float, table: np.ndarray) -> np.ndarray:
    """For each size, the most micro-steps ``s`` with ``s * t(b) <= time_s`` (same float product as the cost model)."""
    steps = np.floor(time_s / table)
    steps = np.where((steps + 1) * table <= time_s, steps + 1, steps)
    steps = np.where(steps * table > time_s, steps - 1, steps)
    return steps.astype(np.int64)


@dataclass(frozen=True, kw_only=True, eq=False)
class _RankOptions:
    """What one rank of a device type can run within a time: ``b * s`` for each usable ``b``, ``1 <= s <= steps``."""

    sizes: np.ndarray
    """Micro-batch sizes with at least one micro-step within the time, ascending."""
    steps: np.ndarray
    """The most micro-steps within the time at each of those sizes."""
    most_work: int
    """The most samples the rank can run within the time."""

    @property
    def gaps(self) -> np.ndarray:
        """Per size, how far its most work falls short of the rank's most work (0 at a best size)."""
        return self.most_work - self.sizes * self.steps


def _rank_options(table: np.ndarray, time_s: float) -> _RankOptions:
    steps = steps_within(time_s, table)
    usable = np.flatnonzero(steps >= 1)
    sizes = (usable + 1).astype(np.int64)
    steps = steps[usable]
    return _RankOptions(sizes=sizes, steps=steps, most_work=int(np.max(sizes * steps)) if len(sizes) else 0)


class FlatTables:
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
        self.slack = sum(d.num_ranks * fastest_size(d.step_time_table_s) for d in model.devices)

    def capacity(self, time_s: float) -> int:
        """Samples all ranks can run within `time_s`, each at its most."""
        work = self.sizes * steps_within(time_s, self.times_s)
        return int(self.counts @ np.maximum.reduceat(work, self.starts))

    def next_breakpoint(self, time_s: float) -> float:
        """The smallest ``s * t(b)`` over all types and sizes that is larger than `time_s`."""
        return float(np.min((steps_within(time_s, self.times_s) + 1) * self.times_s))

    def previous_breakpoint(self, time_s: float) -> float:
        """The largest ``s * t(b)`` (s >= 1) over all types and sizes that is at most `time_s` (0 when none)."""
        return float(np.max(steps_within(time_s, self.times_s) * self.times_s))

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


# -- Exact sums by bitsets: every reachable deficit (or headroom) up to a small target
def sumset(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """{x + y} of two sets given as boolean masks over [0, cap], truncated to [0, cap]."""
    cap = len(a)
    if cap <= 512:
        return np.convolve(a.astype(np.int64), b.astype(np.int64))[:cap] > 0
    # numpy's FFT rather than scipy.signal's: importing that takes longer than most searches.
    # The products count pairs (at most `cap`); float64 FFT error at these lengths is
    # orders of magnitude below the 0.5 that separates none from one.
    length = 1 << (2 * cap - 1).bit_length()
    product = np.fft.irfft(np.fft.rfft(a.astype(float), length) * np.fft.rfft(b.astype(float), length), length)
    return product[:cap] > 0.5


class TypeSums:
    """The sums of n picks from one set (n identical ranks' reductions, or pipelines' deficits): ``powers[j]`` those of
    ``2**j`` picks, ``bits`` the j of n's binary digits, ``partials[k]`` the sums of the picks of ``bits[:k]``
    (``partials[0]``: only 0); kept to split a total back (`split`: evenly; pipeline sizing's `_picks` too)."""

    def __init__(self, single: np.ndarray, count: int) -> None:
        self.count = count
        self.powers = [single]
        while (1 << len(self.powers)) <= count:
            last = self.powers[-1]
            self.powers.append(last if last.all() else sumset(last, last))
        self.bits = [j for j in range(len(self.powers)) if count >> j & 1]
        self.partials = [np.eye(1, len(single), dtype=bool)[0]]
        for j in self.bits:
            self.partials.append(sumset(self.partials[-1], self.powers[j]))
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


def _offsets_mask(options: _RankOptions, target: int, downward: bool) -> np.ndarray:
    """One rank's reachable offsets up to `target` as a mask: downward the deficit ``gap_b + k * b`` below its most
    work, upward the work ``b - 1 + k * b`` above one sample (``0 <= k < steps_b``): one progression per size."""
    mask = np.zeros(target + 1, dtype=bool)
    starts = options.gaps if downward else options.sizes - 1
    for start, size, steps in zip(starts.tolist(), options.sizes.tolist(), options.steps.tolist()):
        if start <= target:
            mask[start : min(target, start + size * (steps - 1)) + 1 : size] = True
    return mask


def _exact_by_bitsets(model: StageModel, options: list[_RankOptions], time_s: float, total: int) -> Groups | None:
    """`_exact_at` by sumsets of per-rank offsets up to min(deficit, headroom): exact, O(that * log)."""
    maxima = [o.most_work for o in options]
    deficit = int(model.counts @ np.array(maxima)) - total
    # Per-rank offsets from whichever end is nearer: down from every rank's most work, or up from one sample each.
    headroom = total - model.world_size
    downward = deficit <= headroom
    target = deficit if downward else headroom
    singles = [_offsets_mask(o, target, downward) for o in options]
    sums = [TypeSums(single, device.num_ranks) for single, device in zip(singles, model.devices)]
    chain = [np.eye(1, target + 1, dtype=bool)[0]]
    for type_sums in sums:
        chain.append(sumset(chain[-1], type_sums.reachable))
    if not chain[-1][target]:
        return None
    groups: Groups = [[] for _ in model.devices]
    left = target
    for i in range(len(sums) - 1, -1, -1):
        share = left * model.devices[i].num_ranks / sum(d.num_ranks for d in model.devices[: i + 1])
        x = TypeSums._closest_pair(sums[i].reachable, chain[i], left, share)
        per_work: Counter = Counter()
        for delta, count in sums[i].split(x).items():
            per_work[maxima[i] - delta if downward else 1 + delta] += count
        groups[i] = _work_groups(model.devices[i].step_time_table_s, per_work, time_s)
        left -= x
    return groups


# -- Per-rank works back to (micro-batch, micro-steps), and the two-level construction
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
    return [
        (micro, steps, count) for (micro, steps), count in sorted(merged.items(), key=lambda kv: -kv[0][0] * kv[0][1])
    ]


def _achievable_work(table: np.ndarray, time_s: float, most: int) -> np.ndarray:
    """Sorted sample counts one rank can run within `time_s` (some b * s with s * t(b) <= time_s)."""
    mask = np.zeros(most + 1, dtype=bool)
    for size, steps in enumerate(steps_within(time_s, table), start=1):
        if steps >= 1:
            mask[size : size * steps + 1 : size] = True
    return np.flatnonzero(mask)


def _two_level_at(
    model: StageModel, time_s: float, total: int, maxima: list[int]
) -> list[list[tuple[int, int, int]]] | None:
    """Fast path of `_exact_at` (None: not found, no proof of none): every rank of a type at one of two adjacent
    achievable counts, type totals water-filled by capacity, one type (each in turn) absorbing the rounding."""
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
        """Totals ``(total, level l, up)`` of type i near `target`, nearest first: ``a[l]`` each, `up` at ``a[l+1]``."""
        n, a = counts[i], values[i]
        clipped = min(max(target, n * a[0]), n * a[-1])
        centre = min(int(np.searchsorted(n * a, clipped, side="right")) - 1, len(a) - 1)
        found = {n * int(a[-1]): (n * int(a[-1]), len(a) - 1, 0)}
        for level in range(max(0, centre - 2), min(len(a) - 1, centre + 3)):
            gap = int(a[level + 1] - a[level])
            middle = round((clipped - n * int(a[level])) / gap)
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


# -- Exact sums by residues: the smallest deficit of the other ranks in each class
@lru_cache(maxsize=64)
def _cyclic_differences(modulus: int) -> np.ndarray:
    return (np.arange(modulus)[:, None] - np.arange(modulus)[None, :]) % modulus


def _empty_sum(modulus: int) -> np.ndarray:
    """The residue vector of the sum of no terms: 0 in class 0, nothing elsewhere."""
    vector = np.full(modulus, _INF, dtype=np.int64)
    vector[0] = 0
    return vector


def _min_plus(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cyclic (min, +) convolution: ``out[r] = min_j x[j] + y[(r - j) % m]``, and the j that attains it."""
    modulus = len(x)
    if x[0] == 0 and np.all(x[1:] == _INF):
        return y, np.zeros(modulus, dtype=np.int64)  # x is the empty sum: O(m) instead of O(m^2)
    sums = x[None, :] + y[_cyclic_differences(modulus)]
    best = np.argmin(sums, axis=1)
    return np.minimum(sums[np.arange(modulus), best], _INF), best


def _single_residues(options: _RankOptions, modulus: int, deficit: int) -> np.ndarray:
    """One rank's smallest deficit (at most `deficit`) in each residue class modulo `modulus` (_INF: none); at size b
    the deficits ``gap_b + k * b`` repeat their residues after `modulus` values of k."""
    keep = options.gaps <= deficit
    gaps, sizes, steps = options.gaps[keep], options.sizes[keep], options.steps[keep]
    k = np.arange(modulus, dtype=np.int64)
    values = gaps[:, None] + k[None, :] * sizes[:, None]
    values = values[(k[None, :] < np.minimum(steps, modulus)[:, None]) & (values <= deficit)]
    out = np.full(modulus, _INF, dtype=np.int64)
    np.minimum.at(out, values % modulus, values)
    return out


class _ResidueSums:
    """Smallest total deficit of `count` identical ranks in each residue class, with the way back; ``powers[j]`` is
    the vector for ``2**j`` ranks, by (min, +) squaring."""

    def __init__(self, single: np.ndarray, count: int) -> None:
        self.single = single
        self.modulus = len(single)
        # A smallest sum has at most modulus - 1 nonzero terms (among more, two partial sums share a residue and the
        # terms between them could be dropped), so the work depends on the modulus only.
        count = min(count, self.modulus - 1)
        self.powers = [single]
        self.power_splits: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
        while (1 << len(self.powers)) <= count:
            power, split = _min_plus(self.powers[-1], self.powers[-1])
            self.powers.append(power)
            self.power_splits.append(split)
        self.bits = [j for j in range(len(self.powers)) if count >> j & 1]
        self.partials = [_empty_sum(self.modulus)]
        self.partial_splits = []
        for j in self.bits:
            partial, split = _min_plus(self.partials[-1], self.powers[j])
            self.partials.append(partial)
            self.partial_splits.append(split)

    @property
    def minimum(self) -> np.ndarray:
        return self.partials[-1]

    def _power_terms(self, j: int, residue: int) -> list[int]:
        if j == 0:
            value = int(self.single[residue])
            return [value] if value else []
        left = int(self.power_splits[j][residue])
        return self._power_terms(j - 1, left) + self._power_terms(j - 1, (residue - left) % self.modulus)

    def terms(self, residue: int) -> list[int]:
        """The nonzero per-rank deficits whose sum is ``minimum[residue]`` (fewer than the ranks)."""
        found: list[int] = []
        for position in range(len(self.bits) - 1, -1, -1):
            previous = int(self.partial_splits[position][residue])
            found += self._power_terms(self.bits[position], (residue - previous) % self.modulus)
            residue = previous
        assert residue == 0, "the partial chain starts at the empty sum"
        return found


def _residue_anchor(options: list[_RankOptions], deficit: int) -> int | None:
    """The device type, of least work, one rank of which can take up any remainder of the deficit (at most
    ``most_work - b`` at its largest size), or None."""
    best, best_cost = None, math.inf
    for index, o in enumerate(options):
        moduli = o.sizes[o.gaps <= deficit]
        if deficit > o.most_work - int(o.sizes[-1]) or int(moduli.max()) > RESIDUE_MAX_MODULUS:
            continue
        cost = float(np.sum(moduli.astype(float) ** 2))
        if cost < best_cost:
            best, best_cost = index, cost
    return best


def _exact_by_residues(
    model: StageModel, options: list[_RankOptions], time_s: float, total: int, anchor: int
) -> Groups | None:
    """`_exact_at` by residue classes, exact when `anchor` is `_residue_anchor`'s type.

    An anchor rank at size b has deficit ``gap_b + k * b``, so a split exists exactly when the others' smallest deficit
    in the class of ``deficit - gap_b`` modulo b is at most ``deficit - gap_b`` (the anchor rank takes the rest).
    """
    maxima = [o.most_work for o in options]
    deficit = int(model.counts @ np.array(maxima)) - total
    others = [d.num_ranks - (i == anchor) for i, d in enumerate(model.devices)]
    own = options[anchor]
    for k in np.argsort(own.gaps, kind="stable"):
        gap, size = int(own.gaps[k]), int(own.sizes[k])
        if gap > deficit:
            break  # sorted: every later size leaves too much
        rest = deficit - gap
        chain, splits, sums = [_empty_sum(size)], [], []
        present = [i for i, count in enumerate(others) if count]
        for i in present:
            type_sums = _ResidueSums(_single_residues(options[i], size, rest), others[i])
            link, split = _min_plus(chain[-1], type_sums.minimum)
            sums.append(type_sums)
            chain.append(link)
            splits.append(split)
        residue = rest % size
        if chain[-1][residue] > rest:
            continue
        deficits: list[list[int]] = [[] for _ in model.devices]
        for position in range(len(present) - 1, -1, -1):
            previous = int(splits[position][residue])
            deficits[present[position]] = sums[position].terms((residue - previous) % size)
            residue = previous
        taken = deficit - sum(sum(d) for d in deficits)
        # The anchor condition is what makes the last bound hold: the anchor rank runs >= 1 step.
        assert taken >= gap and (taken - gap) % size == 0 and taken <= maxima[anchor] - size
        per_work: list[Counter] = [Counter() for _ in model.devices]
        for i, terms in enumerate(deficits):
            per_work[i].update(maxima[i] - d for d in terms)
            per_work[i][maxima[i]] += others[i] - len(terms)
        if gap == 0:
            # A best size: the anchor's share can be spread in steps of b over every rank
            # of its type still at its most work, as evenly as possible.
            idle = per_work[anchor].pop(maxima[anchor], 0) + 1
            base, extra = divmod(taken // size, idle)
            per_work[anchor][maxima[anchor] - (base + 1) * size] += extra
            per_work[anchor][maxima[anchor] - base * size] += idle - extra
        else:
            per_work[anchor][maxima[anchor] - taken] += 1
        return [_work_groups(device.step_time_table_s, work, time_s) for device, work in zip(model.devices, per_work)]
    return None


# -- Exactness at one time, and the search over times
def _exact_at(model: StageModel, time_s: float, total: int) -> Groups | None:
    """An allocation of exactly `total` samples with every rank busy <= `time_s`, or None (exact): bitsets near an
    end, else residue classes where an anchor exists, else the two-level fast path, then bitsets."""
    options = [_rank_options(d.step_time_table_s, time_s) for d in model.devices]
    maxima = [o.most_work for o in options]
    if min(maxima) < 1:
        return None  # some rank cannot run one sample: below the floor
    deficit = int(model.counts @ np.array(maxima)) - total
    if deficit < 0:
        return None
    headroom = total - model.world_size
    if min(deficit, headroom) <= SMALL_DELTA:
        return _exact_by_bitsets(model, options, time_s, total)
    anchor = _residue_anchor(options, deficit)
    if anchor is not None:
        return _exact_by_residues(model, options, time_s, total, anchor)
    if max(maxima) <= TWO_LEVEL_MAX_WORK:
        fast = _two_level_at(model, time_s, total, maxima)
        if fast is not None:
            return fast
    return _exact_by_bitsets(model, options, time_s, total)


def _first_exact_time(model: StageModel, flat: FlatTables, total: int, infeasible_s: float) -> tuple[float, Groups]:
    """The first breakpoint after `infeasible_s` at which `total` samples split exactly, and a split: galloping then
    bisecting, as feasibility only changes at breakpoints and never stops once it starts."""
    surplus = max(flat.capacity(infeasible_s) - total, max(d.max_micro_batch_size for d in model.devices), 1)
    while True:
        surplus *= 2
        feasible_s = flat.min_time_for(total + surplus, model.world_size)
        if feasible_s <= infeasible_s:
            continue
        groups = _exact_at(model, feasible_s, total)
        if groups is not None:
            break
        infeasible_s = feasible_s
    while flat.next_breakpoint(infeasible_s) < feasible_s:
        middle = (infeasible_s + feasible_s) / 2
        probe = flat.previous_breakpoint(middle)
        if probe <= infeasible_s:
            infeasible_s = middle  # no breakpoint in between: nothing changes up to `middle`
            continue
        found = _exact_at(model, probe, total)
        if found is None:
            infeasible_s = probe
        else:
            feasible_s, groups = probe, found
    return feasible_s, groups


def poplar_independent(model: StageModel, global_batch_size: int) -> PolicyResult:
    """The fastest allocation of exactly `global_batch_size` samples (stages 0 and 1): exact, from the first
    capacity breakpoint T0 (a lower bound) to the first time the batch splits exactly."""
    flat = FlatTables(model)
    time_s = flat.min_time_for(global_batch_size, model.world_size)
    groups = _exact_at(model, time_s, global_batch_size)
    if groups is None:
        time_s, groups = _first_exact_time(model, flat, global_batch_size, time_s)
    return PolicyResult(allocation=finish(model, groups))


def first_steps_from(low_s: float, table: np.ndarray) -> np.ndarray:
    """For each size, the fewest micro-steps ``s >= 1`` with ``s * t(b) >= low_s``."""
    steps = np.maximum(1, np.ceil(low_s / table))
    steps = np.where((steps > 1) & ((steps - 1) * table >= low_s), steps - 1, steps)
    steps = np.where(steps * table < low_s, steps + 1, steps)
    return steps.astype(np.int64)


def capacity_levels(model: StageModel, low_s: float, high_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Every time ``s * t(b)`` in [low_s, high_s] and the capacity (samples of all ranks) at it: sorted by time, a
    running maximum of ``b * s`` per type."""
    times, types, work, start = [], [], [], []
    for index, device in enumerate(model.devices):
        table = device.step_time_table_s
        first, per_size = level_steps(table, low_s, high_s)
        sizes = np.arange(1, len(table) + 1)
        start.append(int(np.max(sizes * (first - 1))))
        size_index, steps = level_points(first, per_size)
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


def level_steps(table: np.ndarray, low_s: float, high_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Per size, the fewest micro-steps ``s`` with ``s * t(b) >= low_s`` and how many counts from there stay
    within `high_s` (0 or more)."""
    first = first_steps_from(low_s, table)
    return first, np.maximum(0, steps_within(high_s, table) - first + 1)


def level_points(first: np.ndarray, per_size: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every ``(b, s)`` that `level_steps` counts, size by size: each one's size index and micro-steps."""
    size_index = np.repeat(np.arange(len(first)), per_size)
    offsets = np.arange(len(size_index)) - np.repeat(np.cumsum(per_size) - per_size, per_size)
    return size_index, first[size_index] + offsets


def level_count(model: StageModel, low_s: float, high_s: float) -> int:
    return sum(int(np.sum(level_steps(d.step_time_table_s, low_s, high_s)[1])) for d in model.devices)


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
    high = FlatTables(model).min_time_for(max_batch, model.world_size)
    low = max(cut, floor_s)
    note = ""
    while low < high and level_count(model, low, high) > MAX_BREAKPOINTS:
        low = (low + high) / 2
        note = f"capacity levels below {low:.4g} s were not compared (more than {MAX_BREAKPOINTS})"
    if low > high:
        return PolicyResult(allocation=at_max.allocation, note=note)
    times, capacity = capacity_levels(model, low, high)
    rate = np.where(capacity <= max_batch, capacity / (times + boundary), -1.0)
    if len(rate) == 0 or rate.max() <= best_rate:
        return PolicyResult(allocation=at_max.allocation, note=note)
    k = int(np.argmax(rate))
    groups = _exact_at(model, float(times[k]), int(capacity[k]))
    assert groups is not None, "a capacity level is reachable at its own time"
    return PolicyResult(allocation=finish(model, groups), note=note)
