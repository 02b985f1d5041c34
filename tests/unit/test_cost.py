"""The cost model (poplar_ext/search/cost.py)."""

import numpy as np
import pytest

from poplar_bench.synthetic import synthetic_profile
from poplar_ext.search.cost import build_stage_model


def model(stage):
    # fast: t(b) = 0.1 + 0.01 b, slow: t(b) = 0.2 + 0.05 b; boundary 0.03 (slow's) wins the max
    profiles = {
        "fast": synthetic_profile(
            "fast",
            zero_stage=stage,
            max_micro_batch_size=16,
            overhead_s=0.1,
            seconds_per_sample=0.01,
            optimizer_step_time_s=0.02,
            sizes=[1, 16],
        ),
        "slow": synthetic_profile(
            "slow",
            zero_stage=stage,
            max_micro_batch_size=4,
            overhead_s=0.2,
            seconds_per_sample=0.05,
            optimizer_step_time_s=0.03,
            sizes=[1, 4],
        ),
    }
    return build_stage_model(profiles, ["fast", "slow", "fast"], stage)


@pytest.mark.parametrize("stage", [2, 3])
def test_synchronised_stages_wait_for_the_slowest_micro_step(stage):
    m = model(stage)
    sizes, steps = np.array([10, 2, 8]), np.array([3, 3, 3])
    # max micro-step: max(0.2, 0.3, 0.18) = 0.3
    assert m.iteration_time_s(sizes, steps) == pytest.approx(3 * 0.3 + 0.03)


@pytest.mark.parametrize("stage", [0, 1])
def test_boundary_only_stages_wait_for_the_busiest_rank(stage):
    m = model(stage)
    sizes, steps = np.array([10, 2, 8]), np.array([2, 1, 4])
    # busy: 2 * 0.2, 1 * 0.3, 4 * 0.18 = 0.4, 0.3, 0.72
    assert m.iteration_time_s(sizes, steps) == pytest.approx(0.72 + 0.03)
    np.testing.assert_allclose(m.rank_busy_times_s(sizes, steps), [0.4, 0.3, 0.72])


def test_types_in_first_appearance_order_with_counts_and_ideal():
    m = model(0)
    assert [d.device_type for d in m.devices] == ["fast", "slow"]
    assert list(m.counts) == [2, 1] and list(m.rank_device_index) == [0, 1, 0]
    assert m.boundary_s == 0.03
    assert m.total_max_micro_batch == 2 * 16 + 4
    assert m.ideal_samples_per_s == pytest.approx(2 * 16 / 0.26 + 4 / 0.4)


def test_micro_batch_above_the_cap_is_an_error():
    with pytest.raises(ValueError, match=r"micro_batch_size: expected 1 to 4 on slow at ZeRO stage 0, found 5..5"):
        model(0).iteration_time_s(np.array([1, 5, 1]), np.array([1, 1, 1]))
