"""The monotone micro-step time curve (poplar_ext/search/curves.py)."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poplar_bench.synthetic import synthetic_profile
from poplar_ext.search.curves import fit_curve


def profile_with(sizes, times, cap):
    base = synthetic_profile(
        "X", zero_stage=0, max_micro_batch_size=cap, overhead_s=0.1, seconds_per_sample=0.01, sizes=sizes
    )
    samples = tuple(
        type(s)(micro_batch_size=s.micro_batch_size, micro_step_time_s=t, peak_memory_bytes=s.peak_memory_bytes)
        for s, t in zip(base.samples, times)
    )
    return dataclasses.replace(base, samples=samples)


def test_isotonic_pools_violators_into_their_mean():
    curve = fit_curve(profile_with([1, 2, 3, 4], [1.0, 3.0, 2.0, 4.0], cap=4))
    np.testing.assert_allclose(curve.knot_times_s, [1.0, 2.5, 2.5, 4.0])
    curve = fit_curve(profile_with([1, 2, 3], [3.0, 2.0, 1.0], cap=3))
    np.testing.assert_allclose(curve.knot_times_s, [2.0, 2.0, 2.0])


def test_curve_passes_through_monotone_samples_and_extrapolates_linearly():
    curve = fit_curve(profile_with([2, 4, 8], [0.2, 0.3, 0.5], cap=10))
    np.testing.assert_allclose(curve([2, 4, 8]), [0.2, 0.3, 0.5])
    # above the last sample: slope of the last segment (0.05 per sample)
    np.testing.assert_allclose(curve(10), 0.6)
    # below the first: slope of the first segment (0.05), here below t1 / b1 = 0.1
    np.testing.assert_allclose(curve(1), 0.15)


def test_steep_first_segment_keeps_small_sizes_positive():
    curve = fit_curve(profile_with([4, 8], [0.1, 0.9], cap=8))
    # first-segment slope 0.2 would give t(1) < 0; the slope is limited to t1 / b1
    np.testing.assert_allclose(curve(1), 0.025)


def test_single_sample_is_proportional():
    curve = fit_curve(profile_with([4], [0.4], cap=6))
    np.testing.assert_allclose(curve([1, 4, 6]), [0.1, 0.4, 0.6])


def test_non_monotone_times_are_smoothed_not_rejected():
    curve = fit_curve(profile_with([1, 2, 4], [0.3, 0.2, 0.5], cap=4))
    table = curve.table()
    assert np.all(np.diff(table) >= 0)
    np.testing.assert_allclose(table[[0, 1]], [0.25, 0.25])


def test_model_that_fits_nothing_has_no_curve():
    profile = synthetic_profile("X", zero_stage=3, max_micro_batch_size=0, overhead_s=0.1, seconds_per_sample=0.01)
    assert fit_curve(profile) is None


def test_curve_outside_its_range_is_an_error():
    curve = fit_curve(profile_with([1, 2], [0.1, 0.2], cap=3))
    with pytest.raises(ValueError, match=r"micro_batch_size: expected values from 1 to 3"):
        curve(4)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 200), min_size=1, max_size=8, unique=True),
    st.lists(st.floats(1e-4, 10.0), min_size=8, max_size=8),
    st.integers(0, 50),
)
def test_curve_is_monotone_and_positive_on_a_dense_grid(sizes, times, extra_cap):
    sizes = sorted(sizes)
    cap = sizes[-1] + extra_cap
    curve = fit_curve(profile_with(sizes, times[: len(sizes)], cap=cap))
    grid = np.linspace(1, cap, 4000)
    values = curve(grid)
    assert np.all(values > 0)
    assert np.all(np.diff(values) >= -1e-12 * values.max())
    table = curve.table()
    assert len(table) == cap and np.all(np.diff(table) >= 0)
