"""Re-balancing a pipeline plan (issue 34) without processes: the re-count of micro-batches per pipeline,
rank 0's monitor, the switches a running plan accepts, the resume under a re-balanced plan."""

from __future__ import annotations

import dataclasses

import pytest
from test_pipeline_cost import layer_profile
from test_rebalance_parts import run_checks

from poplar_ext.pipeline.checkpoint import check_recount, pipeline_resume_decision
from poplar_ext.pipeline.planning import pipeline_drift_monitor
from poplar_ext.plan.formats import Cluster, ClusterNode, DeviceGroup, Emulation, Prediction
from poplar_ext.plan.pipeline_formats import (
    Pipeline,
    PipelinePlan,
    PipelineStage,
    layer_profiles_dir,
    pipeline_plan_to_dict,
    save_layer_profile,
)
from poplar_ext.runtime.checkpoint import history_entry, poplar_client_state
from poplar_ext.runtime.config import RebalanceConfig, poplar_config_from_dict
from poplar_ext.runtime.rebalance import PipelineDriftMonitor, RebalanceUnavailable
from poplar_ext.search.pipeline_drift import predict_drifted, recount_pipelines

PROFILES = [layer_profile("a", 0.01)]
"""Layer l takes (l + 1) x 0.01 x b seconds."""
CLUSTER = Cluster(
    nodes=(
        ClusterNode(name="n0", devices=(DeviceGroup(device_type="a", count=2),)),
        ClusterNode(name="n1", devices=(DeviceGroup(device_type="a", count=2),)),
    )
)


def _plan(counts=(4, 4), *, firsts=((0, 2), (0, 2)), sizes=(2, 2)) -> PipelinePlan:
    """Pipeline 0 on ranks 0-1, pipeline 1 on ranks 2-3, both of type a; 4 layers split at `firsts`."""
    pipelines = []
    for p, (count, first, size) in enumerate(zip(counts, firsts, sizes)):
        ends = [*first[1:], 4]
        stages = tuple(
            PipelineStage(rank=2 * p + s, device_type="a", first_layer=f, last_layer=e - 1)
            for s, (f, e) in enumerate(zip(first, ends))
        )
        pipelines.append(Pipeline(stages=stages, micro_batch_size=size, num_micro_batches=count))
    return PipelinePlan(
        policy="poplar",
        zero_stage=0,
        global_batch_size=sum(c * b for c, b in zip(counts, sizes)),
        num_layers=4,
        pipelines=tuple(pipelines),
        predicted=Prediction(iteration_time_s=1.0, samples_per_s=1.0, ideal_samples_per_s=1.0),
        profile_fingerprints={},
    )


# -- the re-count (search.pipeline_drift) --------------------------------------------------------------
def test_a_slowed_stage_moves_micro_batches_to_the_other_pipeline_and_nothing_else():
    # Stage 1 of pipeline 0 (rank 1, layers 2-3: 7 units per micro-batch) runs 3x slower: 21 units.
    # (m0 + 1) x 21 against (m1 + 1) x 7 with m0 + m1 = 8: one micro-batch left on pipeline 0.
    plan = _plan()
    found = recount_pipelines(plan, PROFILES, CLUSTER, [1.0, 3.0, 1.0, 1.0], min_gain=0.05)
    assert found.status == "better" and found.gain > 0.05, found.message
    new = found.plan
    assert [p.num_micro_batches for p in new.pipelines] == [1, 7]
    assert [dataclasses.replace(p, num_micro_batches=0) for p in new.pipelines] == [
        dataclasses.replace(p, num_micro_batches=0) for p in plan.pipelines
    ], "the same ranks, stages, layers and micro-batch sizes, under the cluster's own types"
    assert new.global_batch_size == plan.global_batch_size and new.zero_stage == plan.zero_stage
    drifted = predict_drifted(new, PROFILES, CLUSTER, [1.0, 3.0, 1.0, 1.0])
    assert new.predicted.iteration_time_s == pytest.approx(drifted.iteration_time_s)
    assert found.new_iteration_time_s == pytest.approx(drifted.iteration_time_s)
    before = predict_drifted(plan, PROFILES, CLUSTER, [1.0, 3.0, 1.0, 1.0]).iteration_time_s
    assert found.current_iteration_time_s == pytest.approx(before) and before > drifted.iteration_time_s


def test_without_drift_the_counts_stay():
    found = recount_pipelines(_plan(), PROFILES, CLUSTER, [1.0] * 4, min_gain=0.05)
    assert found.status == "not_better" and found.gain == pytest.approx(0.0, abs=1e-12)
    assert [p.num_micro_batches for p in found.plan.pipelines] == [4, 4]


def test_sizes_that_cannot_move_the_batch_are_not_better():
    # 3 x m0 + 2 x m1 = 14 with both counts >= 1: only (2, 4) and (4, 1); rank 1 at 1.05x changes neither's order.
    plan = _plan((2, 4), sizes=(3, 2))
    found = recount_pipelines(plan, PROFILES, CLUSTER, [1.0, 1.05, 1.0, 1.0], min_gain=0.05)
    assert found.status == "not_better" and [p.num_micro_batches for p in found.plan.pipelines] == [2, 4]


def test_drifted_compute_is_each_rank_s_stage_times_its_micro_batches():
    # Rank 1 holds layers 2-3 (3 + 4 units of 0.01 s per sample) at micro-batch 2, 4 of them, 2x slower.
    predicted = predict_drifted(_plan(), PROFILES, CLUSTER, [1.0, 2.0, 1.0, 1.0])
    assert predicted.rank_compute_time_s[1] == pytest.approx(4 * 2.0 * (0.03 + 0.04) * 2)
    assert predicted.rank_compute_time_s[0] == pytest.approx(4 * (0.01 + 0.02) * 2)


# -- rank 0's monitor ----------------------------------------------------------------------------------
def _monitor() -> PipelineDriftMonitor:
    config = RebalanceConfig(enabled=True, check_interval_steps=2, threshold=0.3, min_gain=0.05, sustained_checks=2)
    return PipelineDriftMonitor(config=config, profiles=PROFILES, cluster=CLUSTER)


def test_a_drifted_pipeline_rank_triggers_one_recount_after_sustained_checks():
    monitor = _monitor()
    decisions, final = run_checks(monitor, _plan(), [[1, 1, 1, 1]] * 2 + [[1, 3, 1, 1]] * 6, noise=0.1)
    assert [step for step, _ in decisions] == [8], "checks 3 and 4 saw it: switched at step 8, once"
    assert "rank 1 (a)" in decisions[0][1]["reason"] and monitor.rank_scales[1] == pytest.approx(3.0, rel=0.25)
    assert monitor.rank_scales[0] == monitor.rank_scales[2] == monitor.rank_scales[3] == 1.0
    counts = [p.num_micro_batches for p in final.pipelines]
    assert isinstance(final, PipelinePlan) and counts[0] < 4 and sum(counts) == 8, counts


def test_noise_below_the_threshold_never_recounts():
    assert run_checks(_monitor(), _plan(), [[1, 1, 1, 1]] * 12, noise=0.2, seed=5)[0] == []


# -- what a running plan accepts, and a resume -----------------------------------------------------------
def test_a_running_pipeline_plan_takes_other_counts_only():
    check_recount(_plan(), _plan((1, 7)))
    with pytest.raises(ValueError, match=r"plan: expected the running pipeline plan with other micro-batch counts"):
        check_recount(_plan(), _plan(firsts=((0, 1), (0, 2))))
    with pytest.raises(ValueError, match=r"pipeline 1's micro-batch size 2 then, 4 now"):
        check_recount(_plan(), _plan((4, 2), sizes=(2, 4)))


def _saved(plan: PipelinePlan, history: list[dict]) -> dict:
    return poplar_client_state(plan, consumed_samples=96, data_position=96, seed=0, shuffle=True, plan_history=history)


def test_a_resume_of_a_rebalanced_run_continues_under_its_last_counts():
    started, rebalanced = _plan(), _plan((1, 7))
    history = [
        history_entry(started, start_step=0, data_position=0, reason="the plan file"),
        history_entry(rebalanced, start_step=4, data_position=64, reason="re-balanced", switched=True),
    ]
    current = _saved(started, history[:1])
    pending = {"plan": pipeline_plan_to_dict(_plan((2, 6))), "position": 112, "reason": "re-balanced again"}
    saved = {**_saved(rebalanced, history), "pending_switch": pending}
    decision = pipeline_resume_decision(saved, current, path="ckpt/step6")
    assert decision.continue_plan == pipeline_plan_to_dict(rebalanced)
    assert (decision.data_position, decision.plan_history) == (96, history)
    assert decision.rebalancing == {"pending_switch": pending}, "the switch agreed before the save still waits"
    assert "under its last plan" in decision.notes[0]
    # A job started from another split continues under its own plan (the layers move), not the checkpoint's.
    other = _saved(_plan(firsts=((0, 1), (0, 2))), history[:1])
    moved = pipeline_resume_decision(saved, other, path="ckpt/step6")
    assert moved.continue_plan is None and moved.data_position == 96 and moved.rebalancing == {}
    assert "under another pipeline plan" in moved.plan_history[-1]["reason"]


# -- rank 0's inputs ----------------------------------------------------------------------------------
def test_rank_0_recounts_from_the_layer_profiles_the_plan_was_made_from(tmp_path):
    config = poplar_config_from_dict(
        {"plan": "p.json", "profiles": str(tmp_path), "rebalance": {"enabled": True}}, base_dir=tmp_path
    )
    with pytest.raises(RebalanceUnavailable, match=r"expected a layer profile of every device type at ZeRO stage 0"):
        pipeline_drift_monitor(_plan(), CLUSTER, config)
    directory = layer_profiles_dir(tmp_path)
    directory.mkdir(parents=True)
    emulated = dataclasses.replace(PROFILES[0], emulated=Emulation(slowdown=1.0, memory_capacity_bytes=10**9))
    save_layer_profile(emulated, directory / "a.json")
    save_layer_profile(dataclasses.replace(emulated, device_type="b"), directory / "b.json")
    monitor = pipeline_drift_monitor(_plan(), CLUSTER, config)
    assert [p.device_type for p in monitor.profiles] == ["a"] and monitor.network is None
    plain = poplar_config_from_dict({"plan": "p.json"}, base_dir=tmp_path)
    with pytest.raises(RebalanceUnavailable) as error:
        pipeline_drift_monitor(_plan(), CLUSTER, plain)
    assert error.value.plain == "no poplar.profiles is named (this job runs a plan file alone)"


def test_a_resume_on_other_device_types_takes_none_of_the_saved_rebalancing():
    plan = _plan()
    speeds = {"rank_scales": [3.0] + [1.0] * (plan.world_size - 1), "streaks": [0] * plan.world_size}
    pending = {"plan": pipeline_plan_to_dict(_plan((2, 6))), "position": 112, "reason": "re-balanced"}
    saved = {**_saved(plan, []), "pending_switch": pending, "drift_monitor": speeds}
    same = pipeline_resume_decision(saved, _saved(plan, []), path="ckpt/step6")
    assert same.rebalancing == {"pending_switch": pending, "drift_monitor": speeds}
    other = _saved(plan, [])
    for pipeline in other["plan"]["pipelines"]:
        for stage in pipeline["stages"]:
            stage["device_type"] = "h100"  # the same plan on other hardware: the saved speeds are another device's
    assert pipeline_resume_decision(saved, other, path="ckpt/step6").rebalancing == {}
