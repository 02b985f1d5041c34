"""Activation checkpointing chosen per device type by the search (issue 16): formats, exactness, stage rules."""

import dataclasses
import json

import numpy as np
import pytest
from _exhaustive import assert_search_is_exact, brute_force, random_cluster

from poplar_bench.synthetic import simple_cluster, synthetic_profile
from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import (
    load_profiles,
    plan_from_dict,
    plan_to_dict,
    profile_from_dict,
    profile_to_dict,
    save_profile,
)
from poplar_ext.plan.levers import lever_choices
from poplar_ext.search.api import check_plan, predict, search_plan


def pair(name, *, stage, cap, overhead, per_sample, checkpointed_cap, recompute=1.3, optimizer_s=0.01):
    """A device type profiled without and with activation checkpointing (slower, larger micro-batches)."""
    plain = synthetic_profile(
        name,
        zero_stage=stage,
        max_micro_batch_size=cap,
        overhead_s=overhead,
        seconds_per_sample=per_sample,
        optimizer_step_time_s=optimizer_s,
    )
    checkpointed = synthetic_profile(
        name,
        zero_stage=stage,
        max_micro_batch_size=checkpointed_cap,
        overhead_s=overhead * recompute,
        seconds_per_sample=per_sample * recompute,
        optimizer_step_time_s=optimizer_s,
    )
    return [plain, dataclasses.replace(checkpointed, activation_checkpointing=True)]


def random_pairs(rng, names, stage, max_cap):
    profiles = []
    for name in names:
        cap = int(rng.integers(0, max_cap + 1))  # 0: fits only with checkpointing
        profiles += pair(
            name,
            stage=stage,
            cap=cap,
            overhead=float(rng.uniform(0.005, 0.05)),
            per_sample=float(rng.uniform(0.001, 0.02)),
            checkpointed_cap=int(rng.integers(max(cap, 1), max_cap + 3)),
            recompute=float(rng.uniform(1.05, 1.6)),
            optimizer_s=float(rng.uniform(0.0, 0.05)),
        )
    return profiles


@pytest.mark.parametrize("seed", range(48))
def test_poplar_chooses_checkpointing_exactly_on_small_clusters(seed):
    rng = np.random.default_rng(1600 + seed)
    stage = seed % 4
    names = [f"gpu{i}" for i in range(int(rng.integers(1, 3)))]
    profiles = random_pairs(rng, names, stage, max_cap=4)
    cluster, batch = random_cluster(rng, names)
    plan = assert_search_is_exact(profiles, cluster, stage, batch)
    if plan is None:
        return
    if stage == 3:
        assert len({r.activation_checkpointing for r in plan.ranks}) == 1


@pytest.mark.parametrize("seed", range(8))
def test_poplar_auto_batch_is_the_best_over_batches_and_settings(seed):
    rng = np.random.default_rng(1700 + seed)
    stage = seed % 4
    profiles = random_pairs(rng, ["a", "b"], stage, max_cap=3)
    cluster = simple_cluster({"a": 1, "b": 1})
    limit = 10
    result = search_plan(profiles, cluster, zero_stage=stage, max_global_batch_size=limit)
    rates = [b / t for b in range(2, limit + 1) if np.isfinite(t := brute_force(profiles, cluster, stage, b)[0])]
    if not rates:
        assert not result.ok
        return
    assert result.plan.predicted.samples_per_s == pytest.approx(max(rates), rel=1e-12)


def small_memory_cluster(stage):
    """A fast type that fits 8 and a slower one that fits 1 without checkpointing, 8 with it."""
    fast = pair("fast", stage=stage, cap=8, overhead=0.01, per_sample=0.001, checkpointed_cap=16, recompute=1.5)
    slow = pair("small", stage=stage, cap=1, overhead=0.02, per_sample=0.001, checkpointed_cap=8)
    return fast + slow, simple_cluster({"fast": 1, "small": 1})


def test_checkpointing_only_the_small_memory_type_wins():
    profiles, cluster = small_memory_cluster(0)
    result = search_plan(profiles, cluster, global_batch_size=32, zero_stage=0)
    assert result.ok
    by_type = {r.device_type: r.activation_checkpointing for r in result.plan.ranks}
    assert by_type == {"fast": False, "small": True}
    assert "activation checkpointing on small" in result.message
    without = search_plan(
        [p for p in profiles if not p.activation_checkpointing], cluster, global_batch_size=32, zero_stage=0
    )
    assert result.plan.predicted.iteration_time_s < without.plan.predicted.iteration_time_s
    data = plan_to_dict(result.plan)
    assert [r["activation_checkpointing"] for r in data["ranks"]] == [False, True]
    assert plan_from_dict(data) == result.plan


def test_stage_3_never_mixes_checkpointing():
    profiles, cluster = small_memory_cluster(3)
    # Checkpointing the small type alone would be best (as at stage 0); stage 3 allows all or none.
    assert brute_force(profiles, cluster, 0, 32)[1] == {"fast": (False, False), "small": (True, False)}
    result = search_plan(profiles, cluster, global_batch_size=32, zero_stage=3)
    assert result.ok
    assert len({r.activation_checkpointing for r in result.plan.ranks}) == 1
    best, _ = brute_force(profiles, cluster, 3, 32)
    assert result.plan.predicted.iteration_time_s == pytest.approx(best, rel=1e-12)
    off, on = (False, False), (True, False)
    assert lever_choices(
        {"fast": {off: profiles[0], on: profiles[1]}, "small": {off: profiles[2], on: profiles[3]}}, 3, choose=True
    ) == [{"fast": off, "small": off}, {"fast": on, "small": on}]


def test_the_search_leaves_checkpointing_off_where_memory_is_enough():
    fast = pair("fast", stage=1, cap=16, overhead=0.01, per_sample=0.001, checkpointed_cap=32)
    slow = pair("slow", stage=1, cap=16, overhead=0.02, per_sample=0.003, checkpointed_cap=32)
    result = search_plan(fast + slow, simple_cluster({"fast": 2, "slow": 1}), global_batch_size=36, zero_stage=1)
    assert result.ok and not any(r.activation_checkpointing for r in result.plan.ranks)
    assert "activation checkpointing" not in result.message


@pytest.mark.parametrize("policy", ["uniform", "proportional"])
def test_baselines_keep_their_meaning(policy):
    profiles, cluster = small_memory_cluster(2)
    plain = [p for p in profiles if not p.activation_checkpointing]
    with_variants = search_plan(profiles, cluster, global_batch_size=32, zero_stage=2, policy=policy)
    without = search_plan(plain, cluster, global_batch_size=32, zero_stage=2, policy=policy)
    assert with_variants.plan == without.plan
    assert not any(r.activation_checkpointing for r in with_variants.plan.ranks)


def test_a_type_that_fits_only_with_checkpointing_uses_it():
    fast = pair("fast", stage=2, cap=8, overhead=0.01, per_sample=0.001, checkpointed_cap=16)
    tiny = pair("tiny", stage=2, cap=0, overhead=0.02, per_sample=0.003, checkpointed_cap=2)
    cluster = simple_cluster({"fast": 1, "tiny": 1})
    result = search_plan(fast + tiny, cluster, global_batch_size=12, zero_stage=2)
    assert result.ok
    best, setting = brute_force(fast + tiny, cluster, 2, 12)
    assert setting["tiny"] == (True, False)
    assert {r.device_type: (r.activation_checkpointing, r.optimizer_offload) for r in result.plan.ranks} == setting
    assert result.plan.predicted.iteration_time_s == pytest.approx(best, rel=1e-12)
    plain_only = search_plan([fast[0], tiny[0]], cluster, global_batch_size=12, zero_stage=2)
    assert not plain_only.ok and "does not fit tiny" in plain_only.message


def test_check_plan_and_predict_hold_plans_to_the_checkpointing_rules():
    profiles, cluster = small_memory_cluster(3)
    plan = search_plan(profiles, cluster, global_batch_size=32, zero_stage=3).plan
    ranks = list(plan.ranks)
    ranks[1] = dataclasses.replace(ranks[1], activation_checkpointing=not ranks[0].activation_checkpointing)
    mixed = dataclasses.replace(plan, ranks=tuple(ranks))
    assert any("ZeRO stage 3 needs the same activation_checkpointing" in p for p in check_plan(mixed, cluster))
    cluster2 = simple_cluster({"fast": 2, "small": 1})
    profiles2, _ = small_memory_cluster(2)
    plan2 = search_plan(profiles2, cluster2, global_batch_size=32, zero_stage=2).plan
    ranks2 = list(plan2.ranks)
    ranks2[1] = dataclasses.replace(ranks2[1], activation_checkpointing=not ranks2[0].activation_checkpointing)
    split_type = dataclasses.replace(plan2, ranks=tuple(ranks2))
    assert any("differ in activation_checkpointing (fast)" in p for p in check_plan(split_type, cluster2))
    with pytest.raises(ValueError, match="one activation_checkpointing per device type"):
        predict(split_type, profiles2)
    # A plan asking for checkpointing on a type profiled only without it has no profile to be held to.
    plain = [p for p in profiles2 if not p.activation_checkpointing]
    small_on = dataclasses.replace(
        plan2,
        ranks=tuple(dataclasses.replace(r, activation_checkpointing=r.device_type == "small") for r in plan2.ranks),
    )
    # Without checkpointing, fast is held to its own (smaller) cap.
    assert any("(fast: 13 > 8)" in p for p in check_plan(small_on, cluster2, profiles2))
    assert any("small with activation checkpointing" in p for p in check_plan(small_on, cluster2, plain))
    with pytest.raises(ValueError, match="small with activation checkpointing"):
        predict(small_on, plain)


def test_profile_field_round_trips_and_old_fingerprints_stay(tmp_path):
    plain, checkpointed = pair("gpu", stage=2, cap=4, overhead=0.01, per_sample=0.01, checkpointed_cap=8)
    data = profile_to_dict(plain)
    assert data["activation_checkpointing"] is False
    old = {k: v for k, v in data.items() if k not in ("activation_checkpointing", "optimizer_offload")}
    assert profile_from_dict(old) == plain
    # A profile written before the field existed keeps its fingerprint (plans name it).
    from poplar_ext.plan.formats import content_fingerprint

    assert plain.fingerprint == content_fingerprint(old)
    assert checkpointed.fingerprint != plain.fingerprint
    assert profile_from_dict(profile_to_dict(checkpointed)) == checkpointed
    with pytest.raises(FormatError, match="activation_checkpointing: expected true or false"):
        profile_from_dict({**data, "activation_checkpointing": "yes"})
    save_profile(plain, tmp_path / "a.json")
    save_profile(checkpointed, tmp_path / "b.json")
    assert len(load_profiles(tmp_path)) == 2
    save_profile(checkpointed, tmp_path / "c.json")
    with pytest.raises(FormatError, match="second profile for 'gpu' at stage 2 with activation checkpointing"):
        load_profiles(tmp_path)


def test_plans_written_before_the_field_load_with_checkpointing_off(tmp_path):
    profiles, cluster = small_memory_cluster(2)
    data = plan_to_dict(search_plan(profiles, cluster, global_batch_size=32, zero_stage=2).plan)
    for rank in data["ranks"]:
        del rank["activation_checkpointing"]
    assert not any(r.activation_checkpointing for r in plan_from_dict(json.loads(json.dumps(data))).ranks)
    data["ranks"][0]["activation_checkpointing"] = 1
    with pytest.raises(FormatError, match=r"ranks\[0\]\.activation_checkpointing: expected true or false"):
        plan_from_dict(data)


def test_two_profiles_of_one_type_stage_and_setting_are_refused():
    plain, _ = pair("gpu", stage=2, cap=4, overhead=0.01, per_sample=0.01, checkpointed_cap=8)
    cluster = simple_cluster({"gpu": 1})
    with pytest.raises(
        ValueError, match="one profile per \\(device type, ZeRO stage, activation checkpointing, optimizer "
    ):
        search_plan([plain, plain], cluster, global_batch_size=4)


def test_poplar_search_shows_a_checkpointing_column_only_when_a_rank_checkpoints():
    from poplar_ext.search.cli import plan_table

    profiles, cluster = small_memory_cluster(0)
    with_choice = plan_table(search_plan(profiles, cluster, global_batch_size=32, zero_stage=0), profiles)
    header, *rows = [line.split() for line in with_choice.splitlines() if line.startswith(("ranks", "0 ", "1 "))]
    assert header[-1] == "checkpointing" and [row[-1] for row in rows] == ["off", "on"]
    plain = [p for p in profiles if not p.activation_checkpointing]
    assert "checkpointing" not in plan_table(search_plan(plain, cluster, global_batch_size=32, zero_stage=0), plain)


@pytest.mark.parametrize("policy", ["poplar", "uniform", "proportional"])
def test_stage_3_without_a_common_setting_is_infeasible_not_mixed(policy):
    a = pair("a", stage=3, cap=4, overhead=0.01, per_sample=0.001, checkpointed_cap=8)
    b = pair("b", stage=3, cap=4, overhead=0.01, per_sample=0.001, checkpointed_cap=8)
    cluster = simple_cluster({"a": 1, "b": 1})
    result = search_plan([a[0], b[1]], cluster, global_batch_size=8, zero_stage=3, policy=policy)
    assert not result.ok
    assert "Stage 3 needs one activation checkpointing setting on every rank" in result.message
    assert "a without only; b with only" in result.message
    # With every type profiled with it, stage 3 runs all checkpointed.
    both = search_plan([a[0], a[1], b[1]], cluster, global_batch_size=8, zero_stage=3, policy=policy)
    assert both.ok and all(r.activation_checkpointing for r in both.plan.ranks)


def test_a_re_plan_under_drift_keeps_each_types_checkpointing():
    from poplar_ext.search.drift import replan

    profiles, cluster = small_memory_cluster(0)
    plan = search_plan(profiles, cluster, global_batch_size=32, zero_stage=0).plan
    assert [r.activation_checkpointing for r in plan.ranks] == [False, True]
    # The fast rank becomes 3x slower: without the setting kept, the search could move checkpointing.
    found = replan(plan, profiles, cluster, [3.0, 1.0], min_gain=0.0)
    assert found.plan is not None
    assert [r.activation_checkpointing for r in found.plan.ranks] == [False, True]
    assert found.plan.global_batch_size == 32


def test_the_drift_monitor_predicts_a_checkpointed_plan_with_each_types_setting():
    from poplar_ext.runtime.config import RebalanceConfig
    from poplar_ext.runtime.rebalance import DriftMonitor

    profiles, cluster = small_memory_cluster(0)
    plan = search_plan(profiles, cluster, global_batch_size=32, zero_stage=0).plan
    assert [r.activation_checkpointing for r in plan.ranks] == [False, True]
    config = RebalanceConfig(enabled=True, check_interval_steps=1, threshold=0.3, min_gain=0.05, sustained_checks=1)
    monitor = DriftMonitor(config=config, profiles=profiles, cluster=cluster)
    assert monitor.predicted_compute_s(plan) == pytest.approx(list(predict(plan, profiles).rank_compute_time_s))
    predicted = monitor.predicted_compute_s(plan)
    # The fast rank runs 3x slower for one check: the re-plan keeps each type's setting.
    decision = monitor.observe(plan, [2 * 3 * predicted[0], 2 * predicted[1]], [2, 2], step=2)
    assert decision is not None
    new = plan_from_dict(decision["plan"])
    assert [r.activation_checkpointing for r in new.ranks] == [False, True]
