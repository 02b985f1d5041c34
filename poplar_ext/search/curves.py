"""Micro-step time as a monotone function of the micro-batch size: isotonic regression, PCHIP, straight lines
outside the samples (profiles/README.md, docs/search.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from poplar_ext.plan.formats import Profile


@dataclass(frozen=True, kw_only=True)
class StepTimeCurve:
    """Monotone micro-step time (seconds) against micro-batch size, valid on [1, max_micro_batch_size]."""

    device_type: str
    """Device type of the profile it was fitted to."""
    zero_stage: int
    """ZeRO stage of that profile."""
    max_micro_batch_size: int
    """Largest micro-batch that fits (>= 1; profiles that fit nothing have no curve)."""
    knot_sizes: tuple[float, ...]
    """Sampled micro-batch sizes."""
    knot_times_s: tuple[float, ...]
    """Sampled micro-step times after isotonic pooling (non-decreasing)."""

    def __call__(self, micro_batch_size: float | np.ndarray) -> np.ndarray:
        """Micro-step time in seconds at `micro_batch_size` (any real values in [1, max])."""
        x = np.asarray(micro_batch_size, dtype=float)
        if np.any(x < 1) or np.any(x > self.max_micro_batch_size):
            raise ValueError(
                f"micro_batch_size: expected values from 1 to {self.max_micro_batch_size} "
                f"(the largest that fits {self.device_type} at stage {self.zero_stage}), "
                f"found {x.min()}..{x.max()}"
            )
        sizes = np.asarray(self.knot_sizes)
        times = np.asarray(self.knot_times_s)
        if len(sizes) == 1:
            low_slope = high_slope = times[0] / sizes[0]
            inside = np.full_like(x, times[0])
        else:
            low_slope = min((times[1] - times[0]) / (sizes[1] - sizes[0]), times[0] / sizes[0])
            high_slope = (times[-1] - times[-2]) / (sizes[-1] - sizes[-2])
            # Imported here: scipy.interpolate takes ~0.7 s to import, and `import poplar_ext.search`
            # (which every user of poplar_ext.plan.formats pays) should not.
            from scipy.interpolate import PchipInterpolator

            inside = PchipInterpolator(sizes, times, extrapolate=False)(np.clip(x, sizes[0], sizes[-1]))
        below = times[0] + low_slope * (x - sizes[0])
        above = times[-1] + high_slope * (x - sizes[-1])
        return np.where(x < sizes[0], below, np.where(x > sizes[-1], above, inside))

    def table(self) -> np.ndarray:
        """Times at micro-batch sizes 1..max (index i holds size i + 1), non-decreasing."""
        times = self(np.arange(1, self.max_micro_batch_size + 1, dtype=float))
        return np.maximum.accumulate(times)


def fastest_size(table_s: np.ndarray) -> int:
    """The micro-batch size of highest throughput in a step-time table (index i holds size i + 1, as `table`)."""
    return int(np.argmax(np.arange(1, len(table_s) + 1) / table_s)) + 1


def fit_curve(profile: Profile) -> StepTimeCurve | None:
    """The monotone curve of `profile`, or None when the model fits no micro-batch (max 0)."""
    if profile.max_micro_batch_size == 0:
        return None
    return fit_points(
        [s.micro_batch_size for s in profile.samples],
        [s.micro_step_time_s for s in profile.samples],
        device_type=profile.device_type,
        zero_stage=profile.zero_stage,
        max_micro_batch_size=profile.max_micro_batch_size,
    )


def fit_points(
    micro_batch_sizes: Sequence[int],
    times_s: Sequence[float],
    *,
    device_type: str,
    zero_stage: int,
    max_micro_batch_size: int,
) -> StepTimeCurve:
    """The monotone curve through measured ``(micro_batch_size, time)`` points (sizes increasing)."""
    sizes = np.array(micro_batch_sizes, dtype=float)
    times = np.array(times_s, dtype=float)
    assert len(sizes) >= 1 and np.all(np.diff(sizes) > 0), "formats guarantees increasing sizes"
    from scipy.optimize import isotonic_regression  # here: ~0.8 s to import, as scipy.interpolate below

    pooled = isotonic_regression(times, increasing=True).x
    return StepTimeCurve(
        device_type=device_type,
        zero_stage=zero_stage,
        max_micro_batch_size=max_micro_batch_size,
        knot_sizes=tuple(sizes.tolist()),
        knot_times_s=tuple(pooled.tolist()),
    )
