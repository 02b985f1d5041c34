"""Cached profiles checked against a few micro-steps timed at start (pure; the timing is the api's
`time_micro_steps`). See docs/training.md (``poplar.calibration``)."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from poplar_ext.plan.formats import Plan, Profile
from poplar_ext.section import CALIBRATION_ACTIONS  # the poplar section's values: it lives below the profiler

TRUSTED, RESCALED, REMEASURED, NOT_CHECKED = "trusted", "rescaled", "remeasured", "not checked"
"""What happened to a device type's profile, as the plan records it."""

RATIO_DIGITS = 4
"""Decimals of the measured / profiled ratio a plan records (and a rescale uses)."""


@dataclass(frozen=True, kw_only=True)
class CalibrationCheck:
    """One device type's profile against micro-steps timed at start."""

    device_type: str
    measured_over_profiled: float
    """Median over the timed sizes of measured / profiled micro-step time (1.0: as profiled)."""
    sizes: tuple[int, ...]
    """The micro-batch sizes timed (those the plan gives the type)."""
    outcome: str
    """`TRUSTED`, `RESCALED` or `REMEASURED` (or `NOT_CHECKED` with action ``off``)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome,
            "measured_over_profiled": round(self.measured_over_profiled, RATIO_DIGITS),
            "sizes": list(self.sizes),
        }


def timed_as_training(zero_stage: int) -> bool:
    """Whether calibration times micro-steps as training runs them (every type at once, wall clock): at
    ZeRO-0/1 a non-boundary micro-step communicates nothing; at ZeRO-2/3 a fast type would wait for a slow
    one in its collectives, so micro-steps are timed as profiling times them (`compute_window`)."""
    return zero_stage in (0, 1)


def profiled_time_s(profile: Profile, micro_batch_size: int) -> float:
    """The profile's micro-step time at `micro_batch_size`: the sample, else linear between its neighbours
    (beyond the curve: the nearest two samples' line, never below zero)."""
    samples = sorted(profile.samples, key=lambda s: s.micro_batch_size)
    if not samples:
        raise ValueError(f"profile of {profile.device_type}: expected samples to compare with, found none")
    for sample in samples:
        if sample.micro_batch_size == micro_batch_size:
            return sample.micro_step_time_s
    if len(samples) == 1:
        only = samples[0]
        return only.micro_step_time_s * micro_batch_size / only.micro_batch_size
    above = next((i for i, s in enumerate(samples) if s.micro_batch_size > micro_batch_size), len(samples) - 1)
    low, high = samples[max(0, above - 1)], samples[max(1, above)]
    slope = (high.micro_step_time_s - low.micro_step_time_s) / (high.micro_batch_size - low.micro_batch_size)
    return max(0.0, low.micro_step_time_s + slope * (micro_batch_size - low.micro_batch_size))


def measured_over_profiled(profile: Profile, measured_s: Mapping[int, float]) -> float:
    """Median over the sizes of `measured_s` (size -> median measured micro-step time) of measured / profiled."""
    if not measured_s:
        raise ValueError(f"measured_s: expected timed micro-steps of {profile.device_type}, found none")
    return statistics.median(t / profiled_time_s(profile, size) for size, t in measured_s.items())


def outcome_for(ratio: float, *, threshold: float, action: str) -> str:
    """`TRUSTED` within `threshold` (|ratio - 1| <= threshold), else what `action` does."""
    if action not in CALIBRATION_ACTIONS:
        raise ValueError(f"action: expected one of {', '.join(CALIBRATION_ACTIONS)}, found {action!r}")
    if action == "off":
        return NOT_CHECKED
    if abs(ratio - 1.0) <= threshold:
        return TRUSTED
    return RESCALED if action == "rescale" else REMEASURED


def check_profiles(
    profiles: list[Profile], measured_s: Mapping[str, Mapping[int, float]], *, threshold: float, action: str
) -> dict[str, CalibrationCheck]:
    """Each device type in `measured_s` (type -> size -> measured time) against its profile in `profiles`."""
    by_type = {p.device_type: p for p in profiles}
    checks = {}
    for device_type, times in measured_s.items():
        if device_type not in by_type:
            raise ValueError(f"measured_s: {device_type} has no profile among those given")
        # Rounded as the plan records it: the rescale is then made again from the plan alone, to the fingerprint.
        ratio = round(measured_over_profiled(by_type[device_type], times), RATIO_DIGITS)
        checks[device_type] = CalibrationCheck(
            device_type=device_type,
            measured_over_profiled=ratio,
            sizes=tuple(sorted(times)),
            outcome=outcome_for(ratio, threshold=threshold, action=action),
        )
    return checks


def rescaled_profile(profile: Profile, ratio: float) -> Profile:
    """`profile` with every micro-step time times `ratio` (compute only: memory and the boundary are kept);
    its provenance says so and names the profile it came from."""
    if not ratio > 0.0:
        raise ValueError(f"ratio: expected a positive factor, found {ratio}")
    samples = tuple(dataclasses.replace(s, micro_step_time_s=s.micro_step_time_s * ratio) for s in profile.samples)
    provenance = {
        **profile.measured_with,
        "calibration": {"rescaled_by": ratio, "rescaled_from_fingerprint": profile.fingerprint},
    }
    return dataclasses.replace(profile, samples=samples, measured_with=provenance)


def apply_checks(profiles: list[Profile], checks: Mapping[str, CalibrationCheck]) -> list[Profile]:
    """`profiles` with those whose check says `RESCALED` rescaled (the others as they are)."""
    return [
        rescaled_profile(p, checks[p.device_type].measured_over_profiled)
        if p.device_type in checks and checks[p.device_type].outcome == RESCALED
        else p
        for p in profiles
    ]


def plan_sizes(plans: list[Plan]) -> dict[str, list[int]]:
    """Device type -> the micro-batch sizes `plans` give it (sorted, distinct): what calibration times."""
    sizes: dict[str, set[int]] = {}
    for plan in plans:
        for rank in plan.ranks:
            sizes.setdefault(rank.device_type, set()).add(rank.micro_batch_size)
    return {t: sorted(v) for t, v in sizes.items()}


def with_calibration(plan: Plan, checks: Mapping[str, CalibrationCheck]) -> Plan:
    """`plan` recording what calibration did to each of its device types' profiles."""
    return dataclasses.replace(plan, calibration={t: c.to_dict() for t, c in sorted(checks.items())})
