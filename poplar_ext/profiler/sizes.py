"""Which micro-batch sizes the profiler tries (pure: every rank decides alike from the same agreed numbers).
See docs/profiling.md."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np


def dense_sizes(largest: int) -> list[int]:
    """Micro-batch sizes dense enough for the time curve: 1, 2, 3, 4, 6, 8, 12, 16, 24, ... and `largest`
    (powers of two and their midpoints: neighbours at most 50 % apart)."""
    if largest < 0:
        raise ValueError(f"largest: expected an integer >= 0, found {largest}")
    powers = [2**i for i in range(largest.bit_length())]
    midpoints = [p + p // 2 for p in powers if p >= 2 and p + p // 2 <= largest]
    return sorted({*powers, *midpoints, *([largest] if largest else [])})


def sweep_sizes(micro_batch_sizes: Iterable[int] | None, largest: int) -> list[int]:
    """The sizes timed for the curve up to `largest` (what fits): those of `micro_batch_sizes` up to it and
    it, or `dense_sizes` (None); none when nothing fits."""
    if micro_batch_sizes is None or largest < 1:
        return dense_sizes(max(largest, 0))
    return sorted({b for b in micro_batch_sizes if b <= largest} | {largest})


@dataclass(frozen=True, kw_only=True)
class MemoryFit:
    """Peak memory as a straight line of the micro-batch size: ``intercept + slope * b``."""

    intercept_bytes: float
    """Memory that does not depend on the micro-batch (model, gradients, optimizer state)."""
    bytes_per_sample: float
    """Extra peak memory per sample (activations)."""

    def predict_bytes(self, micro_batch_size: int) -> float:
        """Predicted peak at `micro_batch_size`."""
        return self.intercept_bytes + self.bytes_per_sample * micro_batch_size

    def largest_fitting(self, capacity_bytes: float) -> int | None:
        """Largest micro-batch predicted to fit in `capacity_bytes`; None for a flat or falling line (noise
        on a tiny model): the caller then doubles until a real trial fails."""
        if self.bytes_per_sample <= 0:
            return None
        return max(0, int((capacity_bytes - self.intercept_bytes) // self.bytes_per_sample))


def fit_memory(points: dict[int, int]) -> MemoryFit | None:
    """Least-squares line through (micro-batch size, peak bytes); None below two sizes."""
    if len(points) < 2:
        return None
    slope, intercept = np.polyfit(list(points), [float(v) for v in points.values()], deg=1)
    return MemoryFit(intercept_bytes=float(intercept), bytes_per_sample=float(slope))


@dataclass(kw_only=True)
class LargestFitSearch:
    """Finds the largest micro-batch that fits, trial by trial (`next_size`, then `record`), for one device
    type at one stage.

    Sizes double from 1 up to what the memory fit predicts, confirmed by a real run; a failure bisects.
    With `exact` the size above the result is run too (it fails); without (a real device whose
    out-of-memory could strike inside a collective) only sizes predicted to fit with `margin` to spare.
    """

    capacity_bytes: int
    """The memory the device type has (real or emulated)."""
    limit: int
    """Never try a micro-batch larger than this."""
    exact: bool
    """Whether trying a size predicted not to fit is safe."""
    margin: float = 0.1
    """Fraction of the capacity kept free when `exact` is off."""
    largest_fitting: int = 0
    """Largest size run without running out of memory so far (0: none yet)."""
    smallest_failing: int | None = None
    """Smallest size that ran out of memory so far (None: none yet)."""
    predicted: int | None = None
    """The memory fit's latest prediction of the largest size."""
    peaks: dict[int, int] = field(default_factory=dict)
    """Measured peak memory of every size that fitted."""

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError(f"limit: expected an integer >= 1, found {self.limit}")
        if self.capacity_bytes < 1:
            raise ValueError(f"capacity_bytes: expected an integer >= 1, found {self.capacity_bytes}")

    @property
    def ceiling(self) -> int:
        """Largest size still worth trying (exclusive bound minus one)."""
        return self.limit if self.smallest_failing is None else min(self.limit, self.smallest_failing - 1)

    def next_size(self) -> int | None:
        """The next size to run, or None when the search is finished."""
        lo, ceiling = self.largest_fitting, self.ceiling
        if lo >= ceiling:
            return None
        if lo == 0:
            return 1
        if self.smallest_failing is not None:
            # A real failure: the line was wrong somewhere above lo; bisect.
            return (lo + ceiling + 1) // 2
        fit = fit_memory(self.peaks)
        usable = self.capacity_bytes if self.exact else self.capacity_bytes * (1.0 - self.margin)
        self.predicted = None if fit is None else fit.largest_fitting(usable)
        if self.predicted is None:
            return min(2 * lo, ceiling)
        if self.predicted > lo:
            return min(self.predicted, 2 * lo, ceiling)
        # Predicted not to fit above lo: confirm that only where failing is safe.
        return lo + 1 if self.exact else None

    def record(self, size: int, *, fits: bool, peak_memory_bytes: int | None = None) -> None:
        """The outcome of running `size` (its peak memory when it fitted)."""
        if fits:
            assert size > self.largest_fitting, "sizes are proposed in increasing order while they fit"
            self.largest_fitting = size
            if peak_memory_bytes is not None:
                self.peaks[size] = peak_memory_bytes
        else:
            self.smallest_failing = size if self.smallest_failing is None else min(self.smallest_failing, size)

    @property
    def limited_by_limit(self) -> bool:
        """True when the result is the size limit, not the device's memory."""
        return self.largest_fitting >= self.limit
