"""Cached profiles checked at start (issue 27): the comparison, the decision, the rescaled curve, the
plan's record, ``poplar.calibration``, and `resolve_plan` with a stand-in timer (no ranks)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from poplar_bench.synthetic import simple_cluster, synthetic_profile
from poplar_ext.plan.formats import load_cluster, plan_from_dict, plan_to_dict, save_cluster, save_profile
from poplar_ext.profiler.calibration import (
    NOT_CHECKED,
    REMEASURED,
    RESCALED,
    TRUSTED,
    apply_checks,
    check_profiles,
    plan_sizes,
    profiled_time_s,
    with_calibration,
)
from poplar_ext.runtime.config import poplar_config_from_dict
from poplar_ext.zero.planning import ProfileDirectory, resolve_plan


@pytest.fixture
def cluster_path(tmp_path):
    path = tmp_path / "cluster.json"
    save_cluster(simple_cluster({"fast": 1, "slow": 1}), path)
    return path


def _profile(device_type="fast", seconds_per_sample=0.01):
    return synthetic_profile(
        device_type,
        zero_stage=1,
        max_micro_batch_size=16,
        overhead_s=0.002,
        seconds_per_sample=seconds_per_sample,
        world_size=2,
    )


def test_profiled_time_is_the_sample_or_the_line_between_neighbours():
    profile = _profile()
    times = {s.micro_batch_size: s.micro_step_time_s for s in profile.samples}
    sizes = sorted(times)
    assert profiled_time_s(profile, sizes[1]) == times[sizes[1]]
    missing = next(b for b in range(1, 17) if b not in times)
    low = max(b for b in sizes if b < missing)
    high = min(b for b in sizes if b > missing)
    expected = times[low] + (times[high] - times[low]) * (missing - low) / (high - low)
    assert profiled_time_s(profile, missing) == pytest.approx(expected)


def test_a_profile_off_by_more_than_the_threshold_is_rescaled_or_remeasured_and_within_it_trusted():
    fast, slow = _profile("fast"), _profile("slow", 0.04)
    measured = {
        "fast": {8: 1.3 * profiled_time_s(fast, 8), 16: 1.25 * profiled_time_s(fast, 16)},
        "slow": {4: 1.05 * profiled_time_s(slow, 4)},
    }
    checks = check_profiles([fast, slow], measured, threshold=0.1, action="rescale")
    assert checks["fast"].outcome == RESCALED and checks["fast"].sizes == (8, 16)
    assert checks["fast"].measured_over_profiled == pytest.approx(1.275)
    assert checks["slow"].outcome == TRUSTED
    assert check_profiles([fast, slow], measured, threshold=0.1, action="remeasure")["fast"].outcome == REMEASURED
    assert check_profiles([fast, slow], measured, threshold=0.3, action="rescale")["fast"].outcome == TRUSTED
    assert check_profiles([fast, slow], measured, threshold=0.1, action="off")["fast"].outcome == NOT_CHECKED
    # Faster than profiled is as stale as slower.
    quicker = {"fast": {8: 0.7 * profiled_time_s(fast, 8)}}
    assert check_profiles([fast], quicker, threshold=0.1, action="rescale")["fast"].outcome == RESCALED


def test_rescaling_scales_only_the_micro_step_times_and_says_so():
    fast, slow = _profile("fast"), _profile("slow", 0.04)
    checks = check_profiles(
        [fast, slow], {"fast": {8: 2.0 * profiled_time_s(fast, 8)}}, threshold=0.1, action="rescale"
    )
    rescaled_fast, same_slow = apply_checks([fast, slow], checks)
    assert same_slow is slow
    assert [s.micro_step_time_s for s in rescaled_fast.samples] == pytest.approx(
        [2.0 * s.micro_step_time_s for s in fast.samples]
    )
    assert [s.peak_memory_bytes for s in rescaled_fast.samples] == [s.peak_memory_bytes for s in fast.samples]
    assert rescaled_fast.optimizer_step_time_s == fast.optimizer_step_time_s
    assert rescaled_fast.max_micro_batch_size == fast.max_micro_batch_size
    assert rescaled_fast.measured_with["calibration"] == {
        "rescaled_by": pytest.approx(2.0),
        "rescaled_from_fingerprint": fast.fingerprint,
    }
    assert rescaled_fast.fingerprint != fast.fingerprint


def test_the_plan_records_the_checks_and_a_plan_without_any_reads_and_writes_as_before():
    from poplar_bench.synthetic import simple_cluster
    from poplar_ext.search import search_plan

    fast, slow = _profile("fast"), _profile("slow", 0.04)
    plan = search_plan([fast, slow], simple_cluster({"fast": 1, "slow": 1}), global_batch_size=20).plan
    assert "calibration" not in plan_to_dict(plan)
    sizes = plan_sizes([plan])
    assert sizes == {r.device_type: [r.micro_batch_size] for r in plan.ranks}
    measured = {t: {b: 1.5 * profiled_time_s(p, b) for b in sizes[t]} for t, p in (("fast", fast), ("slow", slow))}
    recorded = with_calibration(plan, check_profiles([fast, slow], measured, threshold=0.1, action="rescale"))
    data = plan_to_dict(recorded)
    assert data["calibration"]["fast"]["outcome"] == "rescaled"
    assert data["calibration"]["slow"]["measured_over_profiled"] == pytest.approx(1.5)
    assert plan_from_dict(data) == recorded
    data["calibration"]["fast"]["outcome"] = "guessed"
    with pytest.raises(ValueError, match=r"calibration\.fast\.outcome"):
        plan_from_dict(data)


def test_the_calibration_section_is_read_with_its_defaults_and_bad_values_are_named(tmp_path):
    base = {"profiles": "p"}
    default = poplar_config_from_dict(base, base_dir=tmp_path).calibration
    assert (default.action, default.threshold, default.repeats) == ("rescale", 0.1, 3)
    section = {**base, "calibration": {"action": "remeasure", "threshold": 0.25, "repeats": 2}}
    read = poplar_config_from_dict(section, base_dir=tmp_path).calibration
    assert (read.action, read.threshold, read.repeats) == ("remeasure", 0.25, 2)
    with pytest.raises(ValueError, match=r"poplar\.calibration\.action"):
        poplar_config_from_dict({**base, "calibration": {"action": "trust"}}, base_dir=tmp_path)
    with pytest.raises(ValueError, match=r"poplar\.calibration\.thresold"):
        poplar_config_from_dict({**base, "calibration": {"thresold": 0.1}}, base_dir=tmp_path)


def _cached(directory):
    directory.mkdir()
    profiles = {"fast": _profile("fast", 0.001), "slow": _profile("slow", 0.004)}
    for device_type, profile in profiles.items():
        save_profile(profile, directory / f"{device_type}.json")
    return profiles


def _resolve_with_timer(
    cluster_path, directory, slower_by, *, action="rescale", measure=None, read=None, missing=(), parked=()
):
    """`resolve_plan` on rank 0 with a timer whose micro-steps run `slower_by[type]` x the cached profile;
    `read`: a list that gets the job's `ProfileDirectory`; `missing`: types whose cached profile is removed;
    `parked`: those whose cached profile another world size's replaced (kept in the cache's own folder)."""
    from poplar_ext.profiler.cache import parked_profiles_dir

    calls = []
    profiles = {p.device_type: p for p in _cached(directory).values()}
    for device_type in missing:
        (directory / f"{device_type}.json").unlink()
    for device_type in parked:
        kept = parked_profiles_dir(directory, 2) / f"{device_type}.json"
        kept.parent.mkdir(parents=True, exist_ok=True)
        (directory / f"{device_type}.json").rename(kept)

    def time_at_sizes(sizes, plan, cluster):
        calls.append({t: list(v) for t, v in sizes.items()})
        return {t: {b: slower_by[t] * profiled_time_s(profiles[t], b) for b in v} for t, v in sizes.items()}

    config = poplar_config_from_dict(
        {
            "cluster": str(cluster_path),
            "profiles": str(directory),
            "global_batch_size": 40,
            "calibration": {"action": action, "threshold": 0.1},
        },
        base_dir=cluster_path.parent,
    )
    profile_directory = ProfileDirectory(config, load_cluster(cluster_path))
    plan = resolve_plan(
        config,
        load_cluster(cluster_path),
        world_size=2,
        rank=0,
        zero_stage=1,
        broadcast=lambda o: o,
        measure_missing=measure,
        time_at_sizes=time_at_sizes,
        directory=profile_directory,
    )
    if read is not None:
        read.append(profile_directory)
    return plan, calls


def test_cached_profiles_off_the_timed_micro_steps_are_rescaled_and_the_plan_says_so(cluster_path, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="poplar_ext.zero.planning"):
        plan, calls = _resolve_with_timer(cluster_path, tmp_path / "profiles", {"fast": 4.0, "slow": 1.0})
    assert len(calls) == 1 and set(calls[0]) == {"fast", "slow"}
    assert plan.calibration["fast"]["outcome"] == "rescaled"
    assert plan.calibration["slow"]["outcome"] == "trusted"
    assert "fast ran 4.00x its cached profile" in caplog.text
    # Searched again from the rescaled curve: fast, 4x slower than cached, is no faster than slow now.
    unchecked, none = _resolve_with_timer(cluster_path, tmp_path / "again", {"fast": 4.0, "slow": 1.0}, action="off")
    assert unchecked.calibration == {} and none == []
    fast_share = {r.device_type: r.samples_per_iteration for r in plan.ranks}["fast"]
    assert fast_share <= 20 < {r.device_type: r.samples_per_iteration for r in unchecked.ranks}["fast"]


def test_a_stale_cached_profile_is_measured_again_with_remeasure(cluster_path, tmp_path):
    asked = []

    def measure(missing, cluster, force=False):
        asked.append((sorted(missing), force))
        return [dataclasses.replace(_profile("fast", 0.004), measured_with={"source": "measured", "again": True})]

    plan, _ = _resolve_with_timer(
        cluster_path, tmp_path / "profiles", {"fast": 4.0, "slow": 1.0}, action="remeasure", measure=measure
    )
    assert asked == [([("fast", 1)], True)]
    assert plan.calibration["fast"]["outcome"] == "remeasured"
    assert {r.device_type: r.samples_per_iteration for r in plan.ranks}["fast"] <= 20


def _resolve_with_slow_missing(cluster_path, tmp_path, measured):
    """`resolve_plan` where "slow" has no cached profile and the measurer returns `measured`: the plan and the
    device types calibration timed (each call's)."""
    plan, calls = _resolve_with_timer(
        cluster_path,
        tmp_path / "profiles",
        {"fast": 1.0, "slow": 1.0},
        measure=lambda missing, cluster, force=False: measured,
        missing=("slow",),
    )
    return plan, [sorted(call) for call in calls]


def test_a_profile_the_measurer_measured_anew_beside_a_missing_one_is_not_calibrated(cluster_path, tmp_path):
    # Measuring the missing "slow" profile also measured "fast" again (its cache entry refused, say): both
    # profiles are this job's own, so none is timed against itself and called "trusted".
    again = {"source": "measured", "again": True}
    measured = [dataclasses.replace(_profile(t, s), measured_with=again) for t, s in (("fast", 0.002), ("slow", 0.004))]
    plan, timed = _resolve_with_slow_missing(cluster_path, tmp_path, measured)
    assert timed == []
    assert plan.calibration == {}


def test_a_profile_the_profiler_moved_back_from_another_world_sizes_folder_is_calibrated(cluster_path, tmp_path):
    # An elastic job back at 2 ranks: slow's 2-rank profile was kept apart while another world size's stood in the
    # directory, and the profiler's lookup brings it back (here, the measurer returns it as the profiler would).
    slow = _profile("slow", 0.004)
    plan, timed = _resolve_with_timer(
        cluster_path,
        tmp_path / "profiles",
        {"fast": 1.0, "slow": 3.0},
        measure=lambda missing, cluster, force=False: [slow] if missing == [("slow", 1)] else [],
        parked=("slow",),
    )
    assert [sorted(call) for call in timed] == [["fast", "slow"]], "cached, so checked before it is trusted"
    assert plan.calibration["slow"]["outcome"] == "rescaled"


def test_a_cached_profile_the_plan_uses_is_calibrated_though_another_of_its_types_was_measured(cluster_path, tmp_path):
    # Measuring the missing "slow" also measured fast's activation-checkpointing variant; the plan runs fast's
    # cached plain profile, which is still checked.
    checkpointed = dataclasses.replace(_profile("fast", 0.003), activation_checkpointing=True)
    plan, timed = _resolve_with_slow_missing(cluster_path, tmp_path, [checkpointed, _profile("slow", 0.004)])
    assert not any(r.activation_checkpointing for r in plan.ranks)
    assert timed == [["fast"]]


def test_re_balancing_re_plans_from_the_profile_calibration_measured_again(cluster_path, tmp_path):
    # Rank 0 stored the remeasured profile over the cached file: re-balancing (and steady emulation) get it
    # from the job's directory, not the stale one read before.
    from poplar_ext.zero.planning import load_rebalance_inputs

    again = dataclasses.replace(_profile("fast", 0.004), measured_with={"source": "measured", "again": True})
    read = []
    plan, _ = _resolve_with_timer(
        cluster_path,
        tmp_path / "profiles",
        {"fast": 4.0, "slow": 1.0},
        action="remeasure",
        measure=lambda missing, cluster, force=False: [again],
        read=read,
    )
    profiles, _ = load_rebalance_inputs(read[0].poplar_config, read[0].cluster, plan, directory=read[0])
    assert {p.device_type: p for p in profiles}["fast"] == again


def test_a_calibration_outcome_is_logged_with_what_it_means():
    from poplar_ext.zero.planning import calibration_outcome_text

    assert calibration_outcome_text("rescaled", 1.81).startswith("rescaled (its cached times are multiplied by 1.81")
    assert "used as it is" in calibration_outcome_text("trusted", 1.02)
    assert "cache updated" in calibration_outcome_text("remeasured", 2.0)


def test_calibration_is_logged_by_rank_0_alone(caplog, monkeypatch):
    # A second run of the accelerate example logged "rescaled 1.81x" once per rank (issue 36, item 9).
    import logging
    from pathlib import Path
    from types import SimpleNamespace

    from poplar_ext.plan.formats import plan_from_dict
    from poplar_ext.profiler.calibration import CalibrationCheck
    from poplar_ext.runtime.config import poplar_config_from_dict
    from poplar_ext.zero import planning

    plan = plan_from_dict(
        {
            "schema_version": 1,
            "policy": "poplar",
            "zero_stage": 1,
            "global_batch_size": 4,
            "ranks": [
                {"rank": r, "device_type": "fast", "micro_batch_size": 2, "gradient_accumulation_steps": 1}
                for r in range(2)
            ],
            "predicted": {"iteration_time_s": 1.0, "samples_per_s": 4.0, "ideal_samples_per_s": 4.0},
            "profile_fingerprints": {},
        }
    )
    request = SimpleNamespace(
        poplar_config=poplar_config_from_dict({"profiles": "p"}, base_dir=Path(".")), cluster=None
    )
    checks = {"fast": CalibrationCheck(device_type="fast", measured_over_profiled=1.02, sizes=(2,), outcome="trusted")}
    # What rank 0 decided, on every rank (the decision itself is check_profiles', tested above).
    monkeypatch.setattr(planning, "decided_by_rank0", lambda decide, rank, broadcast: checks)
    logged = {}
    for rank in (0, 1):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=planning.__name__):
            calibrated = planning._calibrated(
                request,
                plan,
                {"fast": [2]},
                rank=rank,
                broadcast=lambda outcome: outcome,
                time_at_sizes=lambda sizes, plan, cluster: {},
                measure=None,
            )
        logged[rank] = caplog.text
        assert calibrated.calibration == {"fast": checks["fast"].to_dict()}
    assert "poplar.calibration: fast ran 1.02x" in logged[0] and "used as it is" in logged[0]
    assert "poplar.calibration" not in logged[1]


def _plan_with_levers(levers: list[tuple[str, tuple[bool, bool]]]):
    return plan_from_dict(
        {
            "schema_version": 1,
            "policy": "poplar",
            "zero_stage": 1,
            "global_batch_size": 2 * len(levers),
            "ranks": [
                {
                    "rank": r,
                    "device_type": device_type,
                    "micro_batch_size": 2,
                    "gradient_accumulation_steps": 1,
                    "activation_checkpointing": checkpointing,
                    "optimizer_offload": offload,
                }
                for r, (device_type, (checkpointing, offload)) in enumerate(levers)
            ],
            "predicted": {"iteration_time_s": 1.0, "samples_per_s": 4.0, "ideal_samples_per_s": 4.0},
            "profile_fingerprints": {},
        }
    )


@pytest.mark.parametrize(
    ("levers", "checked"),
    [
        # Types that differ in activation checkpointing (the search's choice at stages 0-2, and under CPU
        # noise the choice can flip between runs) are checked: each rank times with its own setting.
        ([("fast", (True, False)), ("slow", (False, False))], True),
        ([("fast", (False, True)), ("slow", (False, False))], False),
        # Ranks of one type that differ: no setting stands for the type.
        ([("fast", (True, False)), ("fast", (False, False)), ("slow", (False, False))], False),
    ],
)
def test_a_plan_whose_types_differ_in_checkpointing_is_still_checked(monkeypatch, caplog, levers, checked):
    from pathlib import Path
    from types import SimpleNamespace

    from poplar_ext.profiler.calibration import CalibrationCheck
    from poplar_ext.runtime.config import poplar_config_from_dict
    from poplar_ext.zero import planning

    plan = _plan_with_levers(levers)
    request = SimpleNamespace(
        poplar_config=poplar_config_from_dict({"profiles": "p"}, base_dir=Path(".")), cluster=None
    )
    checks = {
        t: CalibrationCheck(device_type=t, measured_over_profiled=1.0, sizes=(2,), outcome="trusted") for t, _ in levers
    }
    monkeypatch.setattr(planning, "decided_by_rank0", lambda decide, rank, broadcast: checks)
    timed = []
    with caplog.at_level(logging.INFO, logger=planning.__name__):
        calibrated = planning._calibrated(
            request,
            plan,
            {t: [2] for t, _ in levers},
            rank=0,
            broadcast=lambda outcome: outcome,
            time_at_sizes=lambda sizes, plan, cluster: timed.append(sizes) or {},
            measure=None,
        )
    assert bool(timed) is checked
    assert calibrated.calibration == ({t: c.to_dict() for t, c in checks.items()} if checked else {})
    assert ("poplar.calibration: not checked" in caplog.text) is not checked


def test_a_re_plan_during_training_keeps_the_calibration_record():
    # The switched plan and its history entry still say how the cached profiles compared at start.
    from poplar_ext.runtime.config import RebalanceConfig
    from poplar_ext.runtime.rebalance import DriftMonitor
    from poplar_ext.search import search_plan

    fast, slow = _profile("fast"), _profile("slow", 0.04)
    cluster = simple_cluster({"fast": 1, "slow": 1})
    plan = search_plan([fast, slow], cluster, global_batch_size=20).plan
    sizes = plan_sizes([plan])
    measured = {t: {b: 1.5 * profiled_time_s(p, b) for b in sizes[t]} for t, p in (("fast", fast), ("slow", slow))}
    recorded = with_calibration(plan, check_profiles([fast, slow], measured, threshold=0.1, action="rescale"))
    config = RebalanceConfig(enabled=True, check_interval_steps=1, threshold=0.3, min_gain=0.0, sustained_checks=1)
    monitor = DriftMonitor(config=config, profiles=[fast, slow], cluster=cluster)
    predicted = monitor.predicted_compute_s(recorded)
    decision = monitor.observe(recorded, [3 * predicted[0], predicted[1]], [1, 1], step=4)  # the fast rank 3x slower
    switched = plan_from_dict(decision["plan"])
    assert switched.ranks != recorded.ranks
    assert switched.calibration == recorded.calibration and switched.calibration["fast"]["outcome"] == "rescaled"


@pytest.mark.parametrize("shared_directory", [False, True], ids=["one model", "two models' profiles"])
def test_re_balancing_predicts_from_the_rescaled_profiles_the_plan_was_searched_from(
    cluster_path, tmp_path, shared_directory
):
    from poplar_ext.runtime.config import RebalanceConfig
    from poplar_ext.runtime.rebalance import DriftMonitor
    from poplar_ext.search import predict
    from poplar_ext.zero.planning import ProfileDirectory, load_rebalance_inputs, stale_profile_types

    slower_by = {"fast": 1.2345678, "slow": 1.0}  # as measured: not a round ratio
    plan, _ = _resolve_with_timer(cluster_path, tmp_path / "profiles", slower_by)
    assert plan.calibration["fast"]["outcome"] == "rescaled"
    cached = [_profile("fast", 0.001), _profile("slow", 0.004)]
    if shared_directory:  # another model's profiles of the same types beside them (the user cache)
        for profile in cached:
            other = dataclasses.replace(profile, model=dataclasses.replace(profile.model, fingerprint="sha256:other"))
            save_profile(other, tmp_path / "profiles" / f"other-{profile.device_type}.json")
    config = poplar_config_from_dict(
        {"profiles": str(tmp_path / "profiles"), "rebalance": {"enabled": True}}, base_dir=tmp_path
    )
    # Nor is the plan stale against the very profiles it was searched from (a false StalePlanWarning).
    assert stale_profile_types(plan, ProfileDirectory(config, load_cluster(cluster_path)).profiles()) == []
    profiles, _ = load_rebalance_inputs(config, load_cluster(cluster_path), plan)
    fast = {p.device_type: p for p in profiles}["fast"]
    assert fast.fingerprint == plan.profile_fingerprints["fast"], "the profile the plan was searched from"
    # Ranks running exactly as calibration timed them have not drifted: every ratio 1, no re-plan.
    truth = [
        dataclasses.replace(
            p,
            samples=tuple(
                dataclasses.replace(s, micro_step_time_s=s.micro_step_time_s * slower_by[p.device_type])
                for s in p.samples
            ),
        )
        for p in cached
    ]
    busy_s = [2 * t for t in predict(plan, truth).rank_compute_time_s]
    config = RebalanceConfig(enabled=True, check_interval_steps=1, threshold=0.1, min_gain=0.0, sustained_checks=1)
    monitor = DriftMonitor(config=config, profiles=profiles, cluster=load_cluster(cluster_path))
    assert monitor.observe(plan, busy_s, [2, 2], step=2) is None
    assert monitor.checks[-1]["ratios"] == pytest.approx([1.0, 1.0], rel=1e-3)
