"""Steady emulated compute from the profile a plan was made from (issue 35): which profile, and the
micro-step times it gives (the blocks' waits and overruns are tested in test_emulation.py)."""

from __future__ import annotations

import dataclasses

import pytest

from poplar_bench.synthetic import synthetic_profile
from poplar_ext.hardware.emulation import OPTIMIZER_STEP_KEY, micro_step_key, steady_reference
from poplar_ext.plan.formats import (
    Cluster,
    ClusterNode,
    DeviceGroup,
    DeviceTypeInfo,
    Emulation,
    Plan,
    Prediction,
    RankPlan,
    profile_from_dict,
    save_profile,
)
from poplar_ext.runtime.config import poplar_config_from_dict
from poplar_ext.zero.planning import ProfileDirectory, steady_compute_profiles

SLOW = Emulation(slowdown=3.0, memory_capacity_bytes=10**9)


def _profile(device_type: str, *, seconds_per_sample: float, emulated: Emulation | None = SLOW, **measured):
    profile = synthetic_profile(
        device_type,
        zero_stage=1,
        max_micro_batch_size=16,
        overhead_s=0.01,
        seconds_per_sample=seconds_per_sample,
        world_size=2,
    )
    measured_with = {"source": "measured", "micro_step_times_include_communication": False, **measured}
    return dataclasses.replace(profile, emulated=emulated, measured_with=measured_with)


def test_micro_steps_take_the_profile_time_over_its_slowdown_and_nothing_beyond_its_largest():
    reference = steady_reference(_profile("slow", seconds_per_sample=0.03))
    assert reference is not None and reference.profile_slowdown == 3.0
    for size in (1, 2, 4, 8, 16):  # sampled sizes: the curve passes through them
        assert reference.base_s(micro_step_key(size)) == pytest.approx((0.01 + 0.03 * size) / 3.0)
    assert reference.base_s(micro_step_key(17)) is None
    assert reference.base_s(OPTIMIZER_STEP_KEY) is None  # learned
    assert "slow" in reference.source and "ZeRO stage 1" in reference.source


def test_a_profile_whose_times_hold_communication_gives_no_reference():
    profile = _profile("slow", seconds_per_sample=0.03, micro_step_times_include_communication=True)
    assert steady_reference(profile) is None


def _cluster() -> Cluster:
    return Cluster(
        nodes=(
            ClusterNode(
                name="n0",
                devices=(DeviceGroup(device_type="fast", count=1), DeviceGroup(device_type="slow", count=1)),
            ),
        ),
        device_types={"slow": DeviceTypeInfo(emulation=SLOW)},
    )


def _plan(fingerprints: dict[str, str]) -> Plan:
    ranks = tuple(
        RankPlan(rank=r, device_type=t, micro_batch_size=4, gradient_accumulation_steps=2)
        for r, t in enumerate(("fast", "slow"))
    )
    return Plan(
        policy="poplar",
        zero_stage=1,
        global_batch_size=16,
        ranks=ranks,
        predicted=Prediction(iteration_time_s=1.0, samples_per_s=16.0, ideal_samples_per_s=20.0),
        profile_fingerprints=fingerprints,
    )


def test_each_emulated_type_is_steady_at_the_profile_its_plan_was_made_from(tmp_path):
    fast = _profile("fast", seconds_per_sample=0.01, emulated=None)
    slow = _profile("slow", seconds_per_sample=0.03)
    other_model = dataclasses.replace(slow, model=dataclasses.replace(slow.model, fingerprint="sha256:another-model"))
    for name, profile in (("fast", fast), ("slow", slow), ("slow-other", other_model)):
        save_profile(profile, tmp_path / f"{name}.json")
    config = poplar_config_from_dict(
        {"cluster": "c.json", "plan": "p.json", "profiles": str(tmp_path)}, base_dir=tmp_path
    )
    directory = ProfileDirectory(config, _cluster())
    plan = _plan({"fast": fast.fingerprint, "slow": slow.fingerprint})
    chosen = steady_compute_profiles(plan, _cluster(), directory)
    # The real type is measured, not made steady; of two slow profiles, the one the plan names.
    assert list(chosen) == ["slow"]
    assert profile_from_dict(chosen["slow"]) == slow


def test_without_profiles_beside_the_plan_every_type_learns_its_times(tmp_path):
    config = poplar_config_from_dict({"cluster": "c.json", "plan": "p.json"}, base_dir=tmp_path)
    assert steady_compute_profiles(_plan({}), _cluster(), ProfileDirectory(config, _cluster())) == {}


def test_a_plan_searched_from_a_rescaled_profile_is_steady_at_the_rescaled_times(tmp_path):
    slow = _profile("slow", seconds_per_sample=0.03)
    save_profile(slow, tmp_path / "slow.json")
    config = poplar_config_from_dict(
        {"cluster": "c.json", "plan": "p.json", "profiles": str(tmp_path)}, base_dir=tmp_path
    )
    plan = dataclasses.replace(
        _plan({"slow": "sha256:the-rescaled-profile"}),
        calibration={"slow": {"outcome": "rescaled", "measured_over_profiled": 1.25, "sizes": [4]}},
    )
    chosen = profile_from_dict(steady_compute_profiles(plan, _cluster(), ProfileDirectory(config, _cluster()))["slow"])
    assert [s.micro_step_time_s for s in chosen.samples] == pytest.approx(
        [1.25 * s.micro_step_time_s for s in slow.samples]
    )


def test_an_emulated_pipeline_stage_is_steady_at_its_layer_profiles(tmp_path):
    from test_pipeline_cost import PLAN, layer_profile

    from poplar_ext.pipeline.planning import steady_stage_times
    from poplar_ext.plan.pipeline_formats import layer_profiles_dir, save_layer_profile

    cluster = Cluster(
        nodes=(
            ClusterNode(name="n0", devices=(DeviceGroup(device_type="a", count=2),)),
            ClusterNode(name="n1", devices=(DeviceGroup(device_type="b", count=1),)),
        ),
        device_types={"b": DeviceTypeInfo(emulation=SLOW)},
    )
    directory = layer_profiles_dir(tmp_path)
    directory.mkdir(parents=True)
    save_layer_profile(layer_profile("a", 0.01), directory / "a.json")
    save_layer_profile(dataclasses.replace(layer_profile("b", 0.02), emulated=SLOW), directory / "b.json")
    config = poplar_config_from_dict(
        {"cluster": "c.json", "plan": "p.json", "profiles": str(tmp_path)}, base_dir=tmp_path
    )
    times = steady_stage_times(PLAN, cluster, config)
    # Only rank 2 (type b) is emulated: layer 3 at micro-batch 2, at the profile's slowdown.
    assert times == {
        2: {
            "compute_s": pytest.approx(0.16),
            "recompute_s": 0.0,
            "optimizer_step_s": pytest.approx(0.004),
            "profile_slowdown": 3.0,
            "type": "b",
        }
    }
    no_profiles = poplar_config_from_dict({"cluster": "c.json", "plan": "p.json"}, base_dir=tmp_path)
    assert steady_stage_times(PLAN, cluster, no_profiles) == {}
