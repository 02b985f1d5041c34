"""Re-balancing's parts without processes: config, drift schedule, scaled search, monitor, sampler switch."""

from __future__ import annotations

import copy
import dataclasses
import logging
import random
from pathlib import Path

import pytest

from poplar_bench.synthetic import synthetic_profile
from poplar_ext.hardware.emulation import ComputeSlowdown, scheduled_slowdown
from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import (
    Cluster,
    ClusterNode,
    DeviceGroup,
    Emulation,
    cluster_from_dict,
    cluster_to_dict,
    plan_from_dict,
    plan_to_dict,
)
from poplar_ext.plan.pipeline_formats import any_plan_from_dict
from poplar_ext.runtime.config import RebalanceConfig, poplar_config_from_dict
from poplar_ext.runtime.data import IterationLoader, PlanBatchSampler, SampleStream
from poplar_ext.runtime.rebalance import DriftMonitor, FollowsRebalancing, Rebalancer, StepView, SwitchOrder
from poplar_ext.search.api import predict, search_plan
from poplar_ext.search.drift import derived_type, replan, scaled_problem, with_rank_types


# -- the poplar.rebalance section ------------------------------------------------------
def _config(rebalance):
    return poplar_config_from_dict({"plan": "p.json", "rebalance": rebalance}, base_dir=Path("."), source="ds.json")


def test_rebalance_is_auto_by_default_and_every_option_is_read():
    assert poplar_config_from_dict({"plan": "p.json"}, base_dir=Path(".")).rebalance == RebalanceConfig()
    assert RebalanceConfig().enabled is None, "auto: on where the profiles are"
    assert (
        _config({"enabled": "auto"}).rebalance.enabled is None
        and _config({"enabled": False}).rebalance.enabled is False
    )
    read = _config(
        {"enabled": True, "check_interval_steps": 5, "threshold": 0.3, "min_gain": 0.1, "sustained_checks": 3}
    )
    assert read.rebalance == RebalanceConfig(
        enabled=True, check_interval_steps=5, threshold=0.3, min_gain=0.1, sustained_checks=3
    )


@pytest.mark.parametrize(
    "rebalance, message",
    [
        ({"enabled": "yes"}, "ds.json: poplar.rebalance.enabled: expected true, false or 'auto'"),
        ({"check_interval_steps": 0}, "poplar.rebalance.check_interval_steps: expected an integer >= 1"),
        ({"threshold": -0.1}, "poplar.rebalance.threshold: expected a positive number"),
        ({"min_gain": -1}, "poplar.rebalance.min_gain: expected a number"),
        ({"sustained_checks": 0}, "poplar.rebalance.sustained_checks"),
        ({"interval": 3}, "poplar.rebalance.interval: expected one of the keys"),
        (True, "poplar.rebalance: expected an object"),
    ],
)
def test_a_bad_rebalance_section_names_the_field(rebalance, message):
    with pytest.raises(FormatError, match=message.replace("(", r"\(")):
        _config(rebalance)


# -- drift in the emulation -------------------------------------------------------------
CLUSTER = {
    "schema_version": 1,
    "nodes": [{"name": "n", "devices": [{"device_type": "a", "count": 2}, {"device_type": "b", "count": 1}]}],
    "device_types": {"a": {"emulation": {"slowdown": 2.0, "memory_capacity_bytes": 10**9}}},
}


def test_a_slowdown_schedule_is_read_per_type_and_per_rank_and_written_back():
    data = copy.deepcopy(CLUSTER)
    data["device_types"]["a"]["emulation"]["slowdown_schedule"] = [[10, 1.0], [4, 5.0, 1]]
    cluster = cluster_from_dict(data, source="c.json")
    emulation = cluster.emulation_of("a")
    assert emulation.slowdown_schedule == ((4, 5.0, 1), (10, 1.0, None)), "sorted by step"
    assert cluster_to_dict(cluster)["device_types"]["a"]["emulation"]["slowdown_schedule"] == [[4, 5.0, 1], [10, 1.0]]
    assert [scheduled_slowdown(emulation, optimizer_step=s, rank=1) for s in (0, 3, 4, 9, 10)] == [
        2.0,
        2.0,
        5.0,
        5.0,
        1.0,
    ]
    assert [scheduled_slowdown(emulation, optimizer_step=s, rank=0) for s in (4, 10)] == [2.0, 1.0], (
        "rank 1's entry only"
    )
    assert scheduled_slowdown(None, optimizer_step=5, rank=0) == 1.0


def test_a_cluster_without_a_schedule_is_written_as_before():
    assert "slowdown_schedule" not in cluster_to_dict(cluster_from_dict(CLUSTER))["device_types"]["a"]["emulation"]


@pytest.mark.parametrize(
    "schedule, message",
    [
        ([[4, 5.0, 2]], r"slowdown_schedule: expected entries whose rank is one of 'a''s ranks \(0, 1\), found rank 2"),
        ([[4]], r"slowdown_schedule\[0\]: expected a list of at least 2"),
        ([4], r"slowdown_schedule\[0\]: expected \[optimizer_step, slowdown\]"),
        ([[-1, 2.0]], r"slowdown_schedule\[0\]\[0\]: expected an integer >= 0"),
        ([[1, 0]], r"slowdown_schedule\[0\]\[1\]: expected a positive number"),
    ],
)
def test_a_bad_schedule_names_the_entry(schedule, message):
    data = copy.deepcopy(CLUSTER)
    data["device_types"]["a"]["emulation"]["slowdown_schedule"] = schedule
    with pytest.raises(FormatError, match="c.json: device_types.a.emulation." + message):
        cluster_from_dict(data, source="c.json")


def test_compute_timer_accumulates_busy_time_at_the_current_slowdown(monkeypatch):
    clock = iter([0.0, 0.0, 0.1, 0.1, 1.0, 1.0, 1.2, 1.2])
    timer = ComputeSlowdown(Emulation(slowdown=2.0, memory_capacity_bytes=1))
    monkeypatch.setattr(timer, "_now", lambda: (next(clock), next(clock)))
    monkeypatch.setattr("time.sleep", lambda s: None)
    with timer:
        pass
    timer.slowdown = 5.0
    with timer:
        pass
    assert timer.busy_time_s == pytest.approx(2.0 * 0.1 + 5.0 * 0.2)


# -- the scaled search ------------------------------------------------------------------
def _profiles(stage: int = 1):
    return [
        synthetic_profile(
            "a", zero_stage=stage, max_micro_batch_size=16, overhead_s=0.01, seconds_per_sample=0.01, world_size=3
        ),
        synthetic_profile(
            "b", zero_stage=stage, max_micro_batch_size=16, overhead_s=0.01, seconds_per_sample=0.02, world_size=3
        ),
    ]


def _cluster() -> Cluster:
    return Cluster(
        nodes=(
            ClusterNode(name="n0", devices=(DeviceGroup(device_type="a", count=2),)),
            ClusterNode(name="n1", devices=(DeviceGroup(device_type="b", count=1),)),
        )
    )


def test_each_drifted_rank_gets_its_own_scaled_type_in_rank_order():
    profiles, cluster, types = scaled_problem(_profiles(), _cluster(), [1.0, 2.5, 1.0], zero_stage=1)
    assert types == ["a", "a@x2.50", "b"] and cluster.rank_device_types == tuple(types)
    assert [n.name for n in cluster.nodes] == ["n0", "n1"]
    scaled = {p.device_type: p for p in profiles}
    original = {p.device_type: p for p in _profiles()}
    assert [s.micro_step_time_s for s in scaled["a@x2.50"].samples] == pytest.approx(
        [2.5 * s.micro_step_time_s for s in original["a"].samples]
    )
    assert scaled["a@x2.50"].optimizer_step_time_s == pytest.approx(2.5 * original["a"].optimizer_step_time_s)
    assert derived_type("a", 1.004) == "a", "rounded: noise does not split a type"


@pytest.mark.parametrize("stage", [1, 2])
def test_replan_moves_samples_off_a_slowed_rank_and_keeps_the_stage_rules(stage):
    plan = search_plan(_profiles(stage), _cluster(), global_batch_size=96, zero_stage=stage).plan
    found = replan(plan, _profiles(stage), _cluster(), [3.0, 1.0, 1.0], min_gain=0.05)
    assert found.status == "better" and found.gain > 0.05
    new = found.plan
    assert [r.device_type for r in new.ranks] == ["a", "a", "b"], "the cluster's own types again"
    assert new.global_batch_size == 96 and new.zero_stage == stage
    assert new.ranks[0].samples_per_iteration < plan.ranks[0].samples_per_iteration
    if stage >= 2:
        assert len({r.gradient_accumulation_steps for r in new.ranks}) == 1
    # What it predicts is what predict() says of the new plan under the scaled speeds.
    profiles, _, types = scaled_problem(_profiles(stage), _cluster(), [3.0, 1.0, 1.0], zero_stage=stage)
    assert predict(with_rank_types(new, types), profiles).iteration_time_s == pytest.approx(found.new_iteration_time_s)


def test_a_rank_made_four_times_slower_gets_its_speed_share_not_less():
    # Issue 35 asked whether re-balancing over-corrects (a 4x slower rank went from 21 samples per step to
    # 1 where its speed share was about 7). With the drift measured exactly (steady emulation) the search
    # does not: the fast rank 4x slower is as fast as the slow one and gets as many samples.
    speeds = (("fast", 0.004), ("medium", 0.008), ("slow", 0.016))
    profiles = [
        synthetic_profile(t, zero_stage=1, max_micro_batch_size=48, overhead_s=0.01, seconds_per_sample=c, world_size=3)
        for t, c in speeds
    ]
    cluster = Cluster(
        nodes=(ClusterNode(name="n0", devices=tuple(DeviceGroup(device_type=t, count=1) for t, _ in speeds)),)
    )
    plan = search_plan(profiles, cluster, global_batch_size=192, zero_stage=1).plan
    found = replan(plan, profiles, cluster, [4.0, 1.0, 1.0], min_gain=0.05)
    assert found.status == "better"
    assert [r.samples_per_iteration for r in found.plan.ranks] == [48, 96, 48]


def test_replan_without_drift_is_not_better():
    plan = search_plan(_profiles(), _cluster(), global_batch_size=96, zero_stage=1).plan
    found = replan(plan, _profiles(), _cluster(), [1.0, 1.0, 1.0], min_gain=0.05)
    assert found.status == "not_better" and found.gain == pytest.approx(0.0, abs=1e-9)


# -- rank 0's monitor -------------------------------------------------------------------
def _monitor(**options) -> tuple[DriftMonitor, object]:
    config = RebalanceConfig(
        enabled=True, check_interval_steps=2, threshold=0.3, min_gain=0.05, sustained_checks=2, **options
    )
    monitor = DriftMonitor(config=config, profiles=_profiles(), cluster=_cluster())
    plan = search_plan(_profiles(), _cluster(), global_batch_size=96, zero_stage=1).plan
    return monitor, plan


def run_checks(monitor, plan, factors_per_check, *, noise: float = 0.0, seed: int = 0):
    """Checks every 2 iterations of ranks running at `factors_per_check` times their profile; the switches
    decided (step, decision) and the plan in the end (ZeRO or pipeline: test_pipeline_rebalance.py too)."""
    rng = random.Random(seed)
    decisions = []
    for check, factors in enumerate(factors_per_check):
        predicted = monitor.predicted_compute_s(plan)
        # What each rank measures over 2 iterations: its true factor against what the monitor assumes.
        true_busy = [
            2 * p * f / s * (1 + rng.uniform(-noise, noise)) for p, f, s in zip(predicted, factors, monitor.rank_scales)
        ]
        decision = monitor.observe(plan, true_busy, [2] * len(predicted), step=2 * (check + 1))
        if decision is not None:
            plan = any_plan_from_dict(decision["plan"])
            decisions.append((2 * (check + 1), decision))
    return decisions, plan


def test_a_drift_measured_against_ranks_that_are_off_too_says_so(caplog):
    # Rank 0 off by 1.4x from the first check, ranks 1-2 by 2.5x from the second: rank 0 drifted first, and
    # against the others it is faster (its factor falls) though it is slower than its own prediction.
    monitor, plan = _monitor()
    with caplog.at_level(logging.INFO, logger="poplar_ext.runtime.rebalance"):
        decisions, _ = run_checks(monitor, plan, [[1.4, 1, 1], [1.4, 2.5, 2.5]])
    described = (decisions[0][1]["reason"] if decisions else "") + caplog.text
    assert (
        "rank 0 (a) at 1.40x its predicted compute (speed factor 1.00 -> 0.56) against 2.50x for the ranks that did "
        "not drift" in described
    ), described
    assert monitor.rank_scales[0] == pytest.approx(1.4 / 2.5)


def test_a_drift_triggers_exactly_one_replan_after_sustained_checks():
    monitor, plan = _monitor()
    # Rank 0 becomes 3x slower at the third check and stays so.
    decisions, final = run_checks(monitor, plan, [[1, 1, 1]] * 2 + [[3, 1, 1]] * 6, noise=0.1)
    assert [step for step, _ in decisions] == [8], "checks 3 and 4 saw it: switched at step 8, once"
    assert "rank 0 (a)" in decisions[0][1]["reason"] and monitor.rank_scales[0] == pytest.approx(3.0, rel=0.15)
    assert final.ranks[0].samples_per_iteration < plan.ranks[0].samples_per_iteration


def test_noise_below_the_threshold_and_a_single_spike_never_replan():
    monitor, plan = _monitor()
    assert run_checks(monitor, plan, [[1, 1, 1]] * 20, noise=0.2, seed=3)[0] == []
    monitor, plan = _monitor()
    spike = [[1, 1, 1]] * 3 + [[4, 1, 1]] + [[1, 1, 1]] * 3
    assert run_checks(monitor, plan, spike)[0] == [], "one noisy interval is not a drift"


def test_a_recovered_device_gets_its_samples_back():
    monitor, plan = _monitor()
    decisions, final = run_checks(monitor, plan, [[3, 1, 1]] * 4 + [[1, 1, 1]] * 4)
    assert len(decisions) == 2 and monitor.rank_scales[0] == pytest.approx(1.0, rel=0.05)
    assert [r.micro_batch_size for r in final.ranks] == [r.micro_batch_size for r in plan.ranks]


def test_a_search_failure_keeps_the_plan(monkeypatch):
    monitor, plan = _monitor()

    def failing(*args, **kwargs):
        raise ValueError("no profile")

    monkeypatch.setattr("poplar_ext.search.drift.replan", failing)
    assert run_checks(monitor, plan, [[3, 1, 1]] * 3)[0] == []


# -- the sampler and the loader follow a switch -------------------------------------------
class _Plan:
    def __init__(self, allocation):
        self.ranks = [type("R", (), {"micro_batch_size": b, "gradient_accumulation_steps": s}) for b, s in allocation]


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_switched_sampler_continues_the_stream_every_position_once(drop_last):
    samplers = [
        PlanBatchSampler(
            num_samples=50,
            micro_batch_sizes=[2, 3],
            gradient_accumulation_steps=[3, 2],
            rank=r,
            seed=1,
            drop_last=drop_last,
        )
        for r in range(2)
    ]
    iterators = [iter(s) for s in samplers]
    seen = []
    for rank in range(2):  # iteration 0 under the first plan
        seen += [i for _ in range(samplers[rank].gradient_accumulation_steps) for i in next(iterators[rank])]
    assert samplers[0].generated_until == 12
    new = _Plan([(4, 2), (2, 2)])
    for sampler in samplers:
        sampler.switch_plan(new, from_position=12)
    for _ in range(2):
        for rank in range(2):
            seen += [i for _ in range(2) for i in next(iterators[rank])]
    assert seen == SampleStream(num_samples=50, seed=1).indices(0, 36)
    assert (
        samplers[0].micro_batches(5) == [list(b) for b in samplers[0].micro_batches(5)]
        and len(samplers[0].micro_batches(5)[0]) == 4
    )


def test_a_switch_cannot_reach_back_into_data_already_handed_out():
    sampler = PlanBatchSampler(num_samples=50, micro_batch_sizes=[2, 3], gradient_accumulation_steps=[3, 2], rank=0)
    iterator = iter(sampler)
    next(iterator)  # iteration 0 has begun
    with pytest.raises(ValueError, match="from_position: expected an iteration start at or after 12"):
        sampler.switch_plan(_Plan([(4, 2), (2, 2)]), from_position=0)
    with pytest.raises(ValueError, match="global batch 12"):
        sampler.switch_plan(_Plan([(4, 2), (2, 1)]), from_position=12)


def test_the_token_loader_groups_by_the_count_of_the_iteration_that_begins():
    counts = iter([3, 2])
    groups = []
    loader = IterationLoader(
        list(range(5)),
        micro_batches_per_iteration=lambda: next(counts),
        before_iteration=lambda group: groups.append(list(group)),
    )
    assert list(loader) == [0, 1, 2, 3, 4] and groups == [[0, 1, 2], [3, 4]]


def test_accelerates_token_counting_groups_by_the_count_of_the_iteration_it_reads():
    pytest.importorskip("accelerate", reason="PoplarAccelerator needs pip install 'poplar-ext[accelerate]'")
    from poplar_ext.integrations.accelerate import _PlanPasses

    sampler = PlanBatchSampler(num_samples=50, micro_batch_sizes=[2, 3], gradient_accumulation_steps=[3, 2], rank=0)
    counted = []
    passes = iter(_PlanPasses(sampler, lambda position, group: counted.append((position, [len(b) for b in group]))))
    next(passes)  # iteration 0 has begun
    # Another rank's DataLoader has read further: the switch starts at iteration 2, after this rank's next one.
    sampler.switch_plan(_Plan([(4, 2), (2, 2)]), from_position=24)
    trained = [next(passes) for _ in range(2 + 3 + 2)]
    assert counted == [(0, [2, 2, 2]), (12, [2, 2, 2]), (24, [4, 4])]
    assert [len(b) for b in trained] == [2, 2] + [2, 2, 2] + [4, 4]


def test_the_plan_round_trips_after_a_replan():
    plan = search_plan(_profiles(), _cluster(), global_batch_size=96, zero_stage=1).plan
    found = replan(plan, _profiles(), _cluster(), [2.0, 1.0, 1.0], min_gain=0.0).plan
    assert plan_from_dict(plan_to_dict(found)) == found
    assert found.profile_fingerprints == plan.profile_fingerprints, "the profiles it was made from"


def test_a_bias_every_rank_shares_does_not_misstate_the_drifted_rank():
    monitor, plan = _monitor()
    predicted = monitor.predicted_compute_s(plan)
    # Every rank runs 0.8x its profile (profiled on a busier day); rank 0 then 3x on top.
    for step in (2, 4):
        monitor.observe(plan, [2 * p * f for p, f in zip(predicted, (2.4, 0.8, 0.8))], [2, 2, 2], step=step)
    assert monitor.rank_scales == pytest.approx([3.0, 1.0, 1.0])


def test_a_real_gpu_is_timed_with_events_read_only_at_a_check(monkeypatch):
    import torch

    from poplar_ext.hardware.compute_clock import CudaEventTimer

    clock = iter([0.0, 2.0, 5.0, 5.5])  # ms at each record()
    synchronised = []

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.ms = next(clock)

        def synchronize(self):
            synchronised.append(self.ms)

        def elapsed_time(self, end):
            return end.ms - self.ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    timer = CudaEventTimer()
    timer.start()
    timer.start()  # a second start inside a window is ignored
    timer.stop()
    timer.start()
    timer.stop()
    assert synchronised == [], "no synchronisation per window"
    assert timer.busy_time_s == pytest.approx(0.0025)
    timer.busy_time_s = 0.0
    assert timer.busy_time_s == 0.0 and timer.emulation is None


@pytest.mark.parametrize("threshold", [0.2, 1.0])
def test_a_speed_up_is_a_drift_as_large_as_the_slow_down_it_undoes(threshold):
    # 0.25x is the recovery from a 4x slow-down: off by 3 (|1 - 0.25| = 0.75 would miss it at threshold 1.0).
    monitor, plan = _monitor()
    monitor.config = dataclasses.replace(monitor.config, threshold=threshold)
    decisions, final = run_checks(monitor, plan, [[4, 1, 1]] * 4 + [[1, 1, 1]] * 4)
    assert len(decisions) == 2 and monitor.rank_scales[0] == pytest.approx(1.0, rel=0.05)
    # 1.15x and 1/1.15x are both within 0.2: neither is a drift.
    for factor in (1.15, 1 / 1.15):
        monitor, plan = _monitor()
        monitor.config = dataclasses.replace(monitor.config, threshold=0.2)
        assert run_checks(monitor, plan, [[factor, 1, 1]] * 6)[0] == []


# -- the engine's side: what a check measures across a switch ----------------------------
class _Timer:
    busy_time_s = 0.0
    emulation = None


class _RecordingMonitor:
    """Rank 0's monitor reduced to what it is handed: every check's busy times and iteration counts."""

    def __init__(self):
        self.observed = []
        self.rank_scales, self.streaks = [1.0], [0]

    def observe(self, plan, busy_s, iterations, *, step):
        self.observed.append((step, busy_s, iterations))


class _OneRankEngine(FollowsRebalancing):
    """`FollowsRebalancing` on one rank: each optimizer step trains one iteration of 1 s of compute."""

    def __init__(self, rebalancer, plan, global_batch):
        self._rebalancer, self.plan, self.global_batch = rebalancer, plan, global_batch
        self._samplers, self.plan_history, self.steps, self.timer = [], [], 0, _Timer()

    compute_timer = property(lambda self: self.timer)
    trained_position = property(lambda self: self.steps * self.global_batch)

    def _step_view(self, step):
        return StepView(
            step=step,
            plan=self.plan,
            data_reached=self.trained_position,
            has_sampler=True,
            switch_pending=self.pending_switch is not None,
        )

    def switch_plan(self, plan, *, reason, record=True):
        self.plan = plan
        self.record_switch(plan, step=self.steps, reason=reason, record=record, rank=0)

    def train_step(self):
        self.timer.busy_time_s += 1.0
        self.steps += 1
        self.follow_rebalancing(self.steps)


def test_a_switch_reached_between_checks_measures_only_the_new_plans_iterations():
    # A switch agreed earlier (a DataLoader had read ahead) starts after step 3; the check at step 4 must see
    # 1 s over 1 iteration (the one under the new plan), not 1 s over 2, which reads as every rank at 0.5x.
    plan = search_plan(_profiles(), _cluster(), global_batch_size=96, zero_stage=1).plan
    monitor = _RecordingMonitor()
    config = RebalanceConfig(enabled=True, check_interval_steps=4, threshold=0.3, min_gain=0.05, sustained_checks=1)
    engine = _OneRankEngine(Rebalancer(config, rank=0, monitor=monitor), plan, plan.global_batch_size)
    engine.pending_switch = SwitchOrder(plan=plan, position=3 * plan.global_batch_size, reason="agreed before")
    for _ in range(8):
        engine.train_step()
    assert engine.pending_switch is None and [h["start_step"] for h in engine.plan_history] == [3]
    assert monitor.observed == [(4, [1.0], [1]), (8, [4.0], [4])]
