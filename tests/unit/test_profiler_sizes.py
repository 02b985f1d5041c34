"""The profiler's size choices: the dense curve, the memory line and the largest-size probe."""

from __future__ import annotations

import pytest

from poplar_ext.profiler.sizes import LargestFitSearch, MemoryFit, dense_sizes, fit_memory

MB = 10**6


def test_dense_sizes_are_powers_of_two_and_their_midpoints_up_to_the_largest() -> None:
    assert dense_sizes(16) == [1, 2, 3, 4, 6, 8, 12, 16]
    assert dense_sizes(20) == [1, 2, 3, 4, 6, 8, 12, 16, 20]
    assert dense_sizes(1) == [1]
    assert dense_sizes(0) == []


def test_dense_sizes_reject_a_negative_largest() -> None:
    with pytest.raises(ValueError, match="largest: expected an integer >= 0, found -1"):
        dense_sizes(-1)


def test_memory_fit_recovers_a_line_and_predicts_the_largest_fitting_size() -> None:
    fit = fit_memory({1: 110 * MB, 2: 120 * MB, 4: 140 * MB})
    assert fit is not None
    assert fit.intercept_bytes == pytest.approx(100 * MB)
    assert fit.bytes_per_sample == pytest.approx(10 * MB)
    assert fit.largest_fitting(205 * MB) == 10


def test_memory_fit_needs_two_sizes_and_a_flat_line_predicts_no_limit() -> None:
    assert fit_memory({1: 5}) is None
    assert MemoryFit(intercept_bytes=100.0, bytes_per_sample=0.0).largest_fitting(50) is None


def _run(search: LargestFitSearch, fits_up_to: int, peak=lambda b: 100 * MB + 10 * MB * b) -> list[int]:
    tried = []
    while (size := search.next_size()) is not None:
        tried.append(size)
        assert len(tried) < 50, tried
        fits = size <= fits_up_to
        search.record(size, fits=fits, peak_memory_bytes=peak(size) if fits else None)
    return tried


def test_exact_search_doubles_then_confirms_the_prediction_and_the_next_size_fails() -> None:
    search = LargestFitSearch(capacity_bytes=305 * MB, limit=256, exact=True)
    tried = _run(search, fits_up_to=20)
    assert tried == [1, 2, 4, 8, 16, 20, 21]
    assert (search.largest_fitting, search.smallest_failing) == (20, 21)


def test_exact_search_bisects_when_the_prediction_fails() -> None:
    # Memory grows faster above 12 than the line through the small sizes says.
    search = LargestFitSearch(capacity_bytes=305 * MB, limit=256, exact=True)
    tried = _run(search, fits_up_to=13)
    assert search.largest_fitting == 13 and search.smallest_failing == 14
    assert tried[:5] == [1, 2, 4, 8, 16]


def test_unsafe_search_never_tries_a_size_predicted_not_to_fit_with_the_margin() -> None:
    search = LargestFitSearch(capacity_bytes=305 * MB, limit=256, exact=False, margin=0.1)
    tried = _run(search, fits_up_to=20)
    # 0.9 * 305 MB = 274.5 MB -> 17 samples predicted; nothing above is tried.
    assert max(tried) == 17 and search.largest_fitting == 17 and search.smallest_failing is None


def test_search_stops_at_the_limit() -> None:
    search = LargestFitSearch(capacity_bytes=10**12, limit=6, exact=True)
    assert _run(search, fits_up_to=10**6) == [1, 2, 4, 6]
    assert search.limited_by_limit


def test_nothing_fits_gives_zero() -> None:
    search = LargestFitSearch(capacity_bytes=MB, limit=8, exact=True)
    assert _run(search, fits_up_to=0) == [1]
    assert search.largest_fitting == 0


def test_search_rejects_a_zero_limit() -> None:
    with pytest.raises(ValueError, match="limit: expected an integer >= 1, found 0"):
        LargestFitSearch(capacity_bytes=MB, limit=0, exact=True)


@pytest.mark.parametrize(("limit", "failing", "trials_left"), [(4, None, 4), (256, 7, 4)])
def test_the_trials_left_for_progress_stop_at_the_limit_and_below_a_failed_size(limit, failing, trials_left) -> None:
    from poplar_ext.profiler.measure import MeasureSettings, StageMeasurement, _TypeRecord

    # A tiny model on 8 GB: the memory line predicts tens of thousands of samples fit.
    search = LargestFitSearch(capacity_bytes=8000 * MB, limit=limit, exact=True)
    record = _TypeRecord(search=search)
    for size, peak in ((1, 400 * MB), (2, 400 * MB + 100_000), (4, 400 * MB + 300_000)):
        if size < limit:
            assert search.next_size() == size
            search.record(size, fits=True, peak_memory_bytes=peak)
            record.peaks[size] = peak
    if failing is not None:
        search.record(failing, fits=False)
    assert search.next_size() is not None and search.predicted > 10_000
    measurement = StageMeasurement(
        layout=None,
        zero_stage=0,
        types_to_measure=("t",),
        build_engine=None,
        make_batch=None,
        loss_fn=None,
        settings=MeasureSettings(micro_batch_size_limit=limit),
    )
    # Sizes left up to the limit 4: 3 and 4; below the failed 7: 3 and 6; each + 2 for the probe still going.
    assert measurement._remaining_estimate({"t": record}) == trials_left
