"""Optimizer offload per device type (issue 16's second lever): formats, the exact search, plan checks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from _exhaustive import assert_search_is_exact, random_cluster

from poplar_bench.synthetic import simple_cluster, synthetic_profile
from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import (
    content_fingerprint,
    load_profiles,
    plan_from_dict,
    plan_to_dict,
    profile_from_dict,
    profile_to_dict,
    save_profile,
)
from poplar_ext.search.api import (
    check_plan,
    lever_choices,
    plan_levers,
    predict,
    search_plan,
)


def variants(
    name,
    *,
    stage,
    cap,
    overhead,
    per_sample,
    optimizer_s=0.01,
    ckpt_cap=None,
    offload_cap=None,
    recompute=1.3,
    offload_step_s=0.05,
):
    """A device type profiled with each memory lever its caps name (None: not profiled so).

    Offloading frees the device of the optimizer state (a larger cap) and makes the
    boundary slower (the host's optimizer step and the copies).
    """

    def one(levers, max_mbs):
        ckpt, offload = levers
        profile = synthetic_profile(
            name,
            zero_stage=stage,
            max_micro_batch_size=max_mbs,
            overhead_s=overhead * (recompute if ckpt else 1.0),
            seconds_per_sample=per_sample * (recompute if ckpt else 1.0),
            optimizer_step_time_s=optimizer_s + (offload_step_s if offload else 0.0),
        )
        return dataclasses.replace(profile, activation_checkpointing=ckpt, optimizer_offload=offload)

    caps = {(False, False): cap, (True, False): ckpt_cap}
    if stage in (1, 2):
        caps[(False, True)] = offload_cap
        caps[(True, True)] = None if ckpt_cap is None or offload_cap is None else ckpt_cap + offload_cap - cap
    return [one(levers, c) for levers, c in caps.items() if c is not None]


def random_profiles(rng, names, stage, max_cap):
    profiles = []
    for name in names:
        cap = int(rng.integers(0, max_cap + 1))  # 0: fits only with a lever
        profiles += variants(
            name,
            stage=stage,
            cap=cap,
            overhead=float(rng.uniform(0.005, 0.05)),
            per_sample=float(rng.uniform(0.001, 0.02)),
            optimizer_s=float(rng.uniform(0.0, 0.05)),
            ckpt_cap=int(rng.integers(max(cap, 1), max_cap + 3)) if rng.random() < 0.7 else None,
            offload_cap=int(rng.integers(max(cap, 1), max_cap + 3)),
            recompute=float(rng.uniform(1.05, 1.6)),
            offload_step_s=float(rng.uniform(0.0, 0.1)),
        )
    return profiles


@pytest.mark.parametrize("seed", range(48))
def test_poplar_chooses_offload_and_checkpointing_exactly_on_small_clusters(seed):
    rng = np.random.default_rng(1800 + seed)
    stage = (1, 2, 1, 2, 0, 3)[seed % 6]
    names = [f"gpu{i}" for i in range(int(rng.integers(1, 3)))]
    profiles = random_profiles(rng, names, stage, max_cap=4)
    cluster, batch = random_cluster(rng, names)
    plan = assert_search_is_exact(profiles, cluster, stage, batch)
    if plan is None:
        return
    if stage in (0, 3):
        assert not any(r.optimizer_offload for r in plan.ranks)
    assert None not in plan_levers(plan).values(), "one setting per device type"


def small_memory_cluster(stage, *, offload_step_s=0.02):
    """A fast type that fits 8, and a small-memory one that fits 1, or 8 with its optimizer offloaded."""
    fast = variants("fast", stage=stage, cap=8, overhead=0.01, per_sample=0.001, offload_cap=12, offload_step_s=0.05)
    small = variants(
        "small", stage=stage, cap=1, overhead=0.02, per_sample=0.001, offload_cap=8, offload_step_s=offload_step_s
    )
    return fast + small, simple_cluster({"fast": 1, "small": 1})


@pytest.mark.parametrize("stage", [1, 2])
def test_offloading_only_the_small_memory_type_wins(stage):
    profiles, cluster = small_memory_cluster(stage)
    result = search_plan(profiles, cluster, global_batch_size=32, zero_stage=stage)
    assert result.ok
    assert {r.device_type: r.optimizer_offload for r in result.plan.ranks} == {"fast": False, "small": True}
    assert "optimizer offload on small" in result.message
    without = search_plan(
        [p for p in profiles if not p.optimizer_offload], cluster, global_batch_size=32, zero_stage=stage
    )
    assert result.plan.predicted.samples_per_s > without.plan.predicted.samples_per_s
    from poplar_ext.search.cli import plan_table

    table = plan_table(result, profiles)
    assert "optimizer offload" in table.splitlines()[2]
    assert "checkpointing" not in table.splitlines()[2]


def test_the_search_leaves_offload_off_where_the_boundary_costs_more_than_it_frees():
    profiles, cluster = small_memory_cluster(1, offload_step_s=5.0)
    result = search_plan(profiles, cluster, global_batch_size=32, zero_stage=1)
    assert result.ok and not any(r.optimizer_offload for r in result.plan.ranks)


@pytest.mark.parametrize("policy", ["uniform", "proportional"])
def test_the_baselines_do_not_offload(policy):
    profiles, cluster = small_memory_cluster(1)
    result = search_plan(profiles, cluster, global_batch_size=32, zero_stage=1, policy=policy)
    assert result.ok and not any(r.optimizer_offload for r in result.plan.ranks)


def test_offload_is_tried_only_at_stages_1_and_2():
    profile = synthetic_profile("gpu", zero_stage=3, max_micro_batch_size=4, overhead_s=0.01, seconds_per_sample=0.01)
    with pytest.raises(ValueError, match="optimizer_offload only at ZeRO stages 1-2, found it for 'gpu' at stage 3"):
        search_plan(
            [dataclasses.replace(profile, optimizer_offload=True)], simple_cluster({"gpu": 1}), global_batch_size=4
        )
    data = profile_to_dict(dataclasses.replace(profile, optimizer_offload=True))
    with pytest.raises(
        FormatError,
        match=r"p.json: optimizer_offload: expected false at ZeRO stage 3 \(poplar-ext "
        r"offloads the optimizer at stages 1-2 only\), found boolean true",
    ):
        profile_from_dict(data, source="p.json")
    choices = lever_choices({"gpu": {(False, False): profile}}, 3, choose=True)
    assert choices == [{"gpu": (False, False)}]


def test_profile_and_plan_fields_round_trip_and_old_files_load(tmp_path):
    plain, offloaded = variants("gpu", stage=2, cap=4, overhead=0.01, per_sample=0.01, offload_cap=8)
    data = profile_to_dict(plain)
    assert data["optimizer_offload"] is False
    old = {k: v for k, v in data.items() if k not in ("activation_checkpointing", "optimizer_offload")}
    assert profile_from_dict(old) == plain and plain.fingerprint == content_fingerprint(old)
    assert offloaded.fingerprint != plain.fingerprint
    assert profile_from_dict(profile_to_dict(offloaded)) == offloaded
    assert offloaded.key == ("gpu", 2, False, True) and offloaded.levers == (False, True)
    save_profile(plain, tmp_path / "a.json")
    save_profile(offloaded, tmp_path / "b.json")
    assert len(load_profiles(tmp_path)) == 2
    save_profile(offloaded, tmp_path / "c.json")
    with pytest.raises(FormatError, match="second profile for 'gpu' at stage 2 with optimizer offload"):
        load_profiles(tmp_path)
    profiles, cluster = small_memory_cluster(2)
    plan = search_plan(profiles, cluster, global_batch_size=32, zero_stage=2).plan
    written = plan_to_dict(plan)
    assert [r["optimizer_offload"] for r in written["ranks"]] == [False, True]
    assert plan_from_dict(written) == plan
    for rank in written["ranks"]:
        del rank["optimizer_offload"]
    assert not any(r.optimizer_offload for r in plan_from_dict(written).ranks)
    written["zero_stage"] = 0
    written["ranks"][1]["optimizer_offload"] = True
    with pytest.raises(FormatError, match=r"ranks\[1\].optimizer_offload: expected false at ZeRO stage 0"):
        plan_from_dict(written, source="plan.json")


def test_check_plan_and_predict_hold_plans_to_the_offload_rules():
    profiles, _ = small_memory_cluster(1)
    cluster = simple_cluster({"fast": 1, "small": 2})
    plan = search_plan(profiles, cluster, global_batch_size=24, zero_stage=1).plan
    assert [r.optimizer_offload for r in plan.ranks] == [False, True, True]
    mixed = dataclasses.replace(
        plan, ranks=(plan.ranks[0], plan.ranks[1], dataclasses.replace(plan.ranks[2], optimizer_offload=False))
    )
    assert any("differ in optimizer_offload (small)" in p for p in check_plan(mixed, cluster, profiles))
    with pytest.raises(ValueError, match="one optimizer_offload per device type, found both for small"):
        predict(mixed, profiles)
    at_3 = dataclasses.replace(plan, zero_stage=3)
    assert any("offloads the optimizer at ZeRO stages 1-2 only" in p for p in check_plan(at_3, cluster))
    no_offload_profile = [p for p in profiles if not (p.device_type == "small" and p.optimizer_offload)]
    assert any(
        "No profile at ZeRO stage 1 for small with optimizer offload" in p
        for p in check_plan(plan, cluster, no_offload_profile)
    )


def test_a_re_plan_under_drift_keeps_each_types_offload():
    from poplar_ext.search.drift import replan

    profiles, cluster = small_memory_cluster(1)
    plan = search_plan(profiles, cluster, global_batch_size=32, zero_stage=1).plan
    found = replan(plan, profiles, cluster, [3.0, 1.0], min_gain=0.0)
    assert found.plan is not None
    assert [r.optimizer_offload for r in found.plan.ranks] == [False, True]
