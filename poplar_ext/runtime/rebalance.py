"""Re-balancing: when a device drifts, every rank switches to a better plan together (docs/training.md,
docs/pipeline.md)."""

from __future__ import annotations

import collections
import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from poplar_ext.collectives import decided_by_rank0, gather_objects
from poplar_ext.hardware.compute_clock import (  # CudaEventTimer: re-exported
    ComputeTimer,
    CudaEventTimer,
    compute_window,
)
from poplar_ext.plan.formats import Cluster, Plan, Profile
from poplar_ext.plan.pipeline_formats import LayerProfile, PipelinePlan, any_plan_from_dict
from poplar_ext.runtime.checkpoint import history_entry, plan_as_dict
from poplar_ext.runtime.config import RebalanceConfig
from poplar_ext.runtime.data import plan_shares

if TYPE_CHECKING:
    from poplar_ext.plan.network_format import NetworkProfile
    from poplar_ext.search.drift import Replan

logger = logging.getLogger(__name__)

MAX_CHECKS_KEPT = 1000


def unmeasurable_reason(device_kind: str, zero_stage: int) -> str | None:
    """Why re-balancing cannot measure compute on `device_kind` at `zero_stage` (None: it can).

    On CPU the thread's CPU time leaves waits out. On CUDA the events count them: at ZeRO-2/3 the compute
    windows hold collectives (ZeRO-3's all-gathers all through forward and backward, ZeRO-2's reduce-scatters
    of full buckets) in which a fast GPU waits for a slow one, so every type would look as slow as the slowest
    and re-planning would drift toward uniform. No part of a ZeRO-3 micro-step is free of them, and timing one
    type at a time (as profiling does) would stop training: re-balancing is refused there.
    """
    if compute_window(device_kind, zero_stage).types_at_once:
        return None
    return (
        f"its compute cannot be measured on CUDA at ZeRO stage {zero_stage}: the compute windows hold "
        "collectives in which a fast GPU waits for a slow one, so every GPU would look as slow as the "
        "slowest (re-balancing runs on CPU at any stage, and on CUDA at ZeRO stages 0-1)"
    )


@dataclass(kw_only=True)
class DriftMonitor:
    """Rank 0's view of every rank's speed against the profiles, and the re-planning decision."""

    config: RebalanceConfig
    profiles: list[Profile] | list[LayerProfile]
    """The profiles of the plan's stage (every device type of the cluster): layer profiles for a pipeline plan."""
    cluster: Cluster
    network: NetworkProfile | None = None
    rank_scales: list[float] = field(default_factory=list)
    """Each rank's assumed time factor against its profile (1.0: as profiled)."""
    streaks: list[int] = field(default_factory=list)
    """Consecutive checks on which each rank was off its prediction by more than the threshold."""
    checks: collections.deque = field(default_factory=lambda: collections.deque(maxlen=MAX_CHECKS_KEPT))
    """The latest checks: ``{"step", "ratios", "scales"}`` each (for logs and the drift bench)."""

    def __post_init__(self) -> None:
        world_size = self.cluster.world_size
        self.rank_scales = self.rank_scales or [1.0] * world_size
        self.streaks = self.streaks or [0] * world_size

    def predicted_compute_s(self, plan: Plan) -> list[float]:
        """Each rank's predicted compute time per iteration under `plan` and the assumed speeds."""
        from poplar_ext.plan.levers import plan_levers
        from poplar_ext.search.api import predict
        from poplar_ext.search.drift import scaled_problem, with_rank_types

        profiles, _, rank_types = scaled_problem(
            self.profiles, self.cluster, self.rank_scales, zero_stage=plan.zero_stage, levers=plan_levers(plan)
        )
        return list(predict(with_rank_types(plan, rank_types), profiles, self.network).rank_compute_time_s)

    def search_again(self, plan: Plan) -> Replan:
        """`plan`'s global batch searched again under the assumed speeds (`search.drift.replan`)."""
        from poplar_ext.search.drift import replan

        return replan(
            plan, self.profiles, self.cluster, self.rank_scales, min_gain=self.config.min_gain, network=self.network
        )

    def observe(
        self, plan: Plan | PipelinePlan, busy_s: list[float], iterations: list[int], *, step: int
    ) -> dict[str, Any] | None:
        """One check: every rank's busy time over its `iterations`; a decision ``{"plan", "reason"}`` or None."""
        predicted = self.predicted_compute_s(plan)
        ratios: list[float | None] = []
        for busy, count, expected in zip(busy_s, iterations, predicted):
            ratios.append(busy / (count * expected) if count > 0 and expected > 0 and busy > 0 else None)
        self.checks.append({"step": step, "ratios": list(ratios), "scales": list(self.rank_scales)})
        threshold = self.config.threshold
        for rank, ratio in enumerate(ratios):
            # Slower and faster alike: 1.25x and 0.8x are one drift (a recovery must undo what a slowdown did).
            off = ratio is not None and max(ratio, 1.0 / ratio) - 1.0 > threshold
            self.streaks[rank] = self.streaks[rank] + 1 if off else 0
        drifted = [rank for rank, streak in enumerate(self.streaks) if streak >= self.config.sustained_checks]
        if not drifted:
            return None
        before = list(self.rank_scales)
        # Relative to the ranks that did not drift: a bias every rank shares (profiles taken
        # on a busier day) changes no allocation, and would misstate the drifted rank's speed.
        steady = [r for rank, r in enumerate(ratios) if r is not None and rank not in drifted]
        reference = statistics.median(steady) if steady else 1.0
        for rank in drifted:
            self.rank_scales[rank] *= ratios[rank] / reference
        self.streaks = [0] * len(self.streaks)
        # Where the other ranks are off their predictions too, the factor follows the ratio against them, which
        # may even point the other way: say so, or a rank read as slower would be seen to get more samples.
        against = "" if f"{reference:.2f}" == "1.00" else f" against {reference:.2f}x for the ranks that did not drift"
        described = ", ".join(
            f"rank {rank} ({self.cluster.rank_device_types[rank]}) at {ratios[rank]:.2f}x its predicted compute "
            f"(speed factor {before[rank]:.2f} -> {self.rank_scales[rank]:.2f}){against}"
            for rank in drifted
        )
        try:
            found = self.search_again(plan)
        except ValueError as exc:  # a search problem must not stop training: keep the plan, say why
            logger.warning(
                "poplar rebalance at step %d: %s drifted, but the search failed (%s); keeping the plan",
                step,
                described,
                exc,
            )
            return None
        if found.status != "better" or found.plan is None:
            logger.info("poplar rebalance at step %d: %s drifted; keeping the plan: %s", step, described, found.message)
            return None
        reason = f"re-balanced at step {step}: {described}; {found.message}"
        return {"plan": plan_as_dict(found.plan), "reason": reason}


@dataclass(kw_only=True)
class PipelineDriftMonitor(DriftMonitor):
    """`DriftMonitor` for a pipeline plan: predictions from layer profiles, and a re-plan that moves
    micro-batches between the same pipelines (`search.pipeline_drift.recount_pipelines`)."""

    def predicted_compute_s(self, plan: PipelinePlan) -> list[float]:
        """Each rank's predicted forward and backward time per iteration under `plan` and the assumed speeds."""
        from poplar_ext.search.pipeline_drift import predict_drifted

        prediction = predict_drifted(plan, self.profiles, self.cluster, self.rank_scales, network=self.network)
        return list(prediction.rank_compute_time_s)

    def search_again(self, plan: PipelinePlan) -> Replan:
        """Each pipeline's micro-batch count searched again under the assumed speeds."""
        from poplar_ext.search.pipeline_drift import recount_pipelines

        return recount_pipelines(
            plan, self.profiles, self.cluster, self.rank_scales, min_gain=self.config.min_gain, network=self.network
        )


@dataclass(frozen=True, kw_only=True)
class SwitchOrder:
    """Rank 0's decision, the same on every rank: switch to `plan` from stream `position` on."""

    plan: Plan | PipelinePlan
    position: int
    """Stream position of the first iteration under `plan` (no rank's sampler has started it)."""
    reason: str


@dataclass(frozen=True, kw_only=True)
class StepView:
    """What a check needs of this rank's job after an optimizer step (the engine fills it)."""

    step: int
    """Optimizer steps taken."""
    plan: Plan | PipelinePlan
    """The plan running now."""
    data_reached: int
    """How far this rank's data has been handed out: no switch can start before it."""
    has_sampler: bool
    """The rank trains from the engine's batch sampler (else a switch cannot reach its data)."""
    switch_pending: bool


class FollowsRebalancing:
    """What every re-balancing engine shares: the switch rank 0 decided waits in `pending_switch` for the
    iteration it starts at, a check runs after every optimizer step, and each switch is recorded and logged.

    Its subclass provides ``_rebalancer`` (None when off), ``_samplers``, ``plan_history``, ``compute_timer``,
    ``trained_position`` and ``_step_view(step)`` (`EngineCore`: from the engine's ``data_reached``), and the
    engine ``switch_plan(plan, *, reason, record)`` (which calls `record_switch`).
    """

    pending_switch: SwitchOrder | None = None
    """A switch agreed by every rank, waiting for the iteration it starts at."""

    def schedule_switch(self, order: SwitchOrder, *, record: bool = True) -> None:
        """Switch to the order's plan at the iteration that starts at its stream position (every rank alike);
        `record`: add it to the plan history (not for a resume under the checkpoint's last plan)."""
        for sampler in self._samplers:
            sampler.switch_plan(order.plan, from_position=order.position)
        if order.position <= self.trained_position:
            self.switch_plan(order.plan, reason=order.reason, record=record)
        else:
            self.pending_switch = order

    def rebalancing_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of re-balancing (``poplar_state.json``): ``pending_switch``, the switch agreed
        whose iteration no step has reached; ``drift_monitor``, rank 0's assumed speeds (which rank 0 writes)."""
        state: dict[str, Any] = {}
        if (pending := self.pending_switch) is not None:
            state["pending_switch"] = {
                "plan": plan_as_dict(pending.plan),
                "position": pending.position,
                "reason": pending.reason,
            }
        if (monitor := self._monitor()) is not None:
            state["drift_monitor"] = {"rank_scales": list(monitor.rank_scales), "streaks": list(monitor.streaks)}
        return state

    def continue_rebalancing(self, saved: dict[str, Any]) -> None:
        """A resume that continues the saved run's last plan takes over its `rebalancing_state` (`saved`): without
        its speeds, a device that drifted before the save would never be seen to recover."""
        if (pending := saved.get("pending_switch")) is not None:
            plan = any_plan_from_dict(pending["plan"], source="<the checkpoint's pending switch>")
            self.schedule_switch(SwitchOrder(plan=plan, position=pending["position"], reason=pending["reason"]))
        if (monitor := self._monitor()) is not None and (speeds := saved.get("drift_monitor")) is not None:
            monitor.rank_scales, monitor.streaks = list(speeds["rank_scales"]), list(speeds["streaks"])

    def _monitor(self) -> DriftMonitor | None:
        return None if self._rebalancer is None else self._rebalancer.monitor

    def follow_rebalancing(self, step: int) -> None:
        """After optimizer step `step`: a switch agreed earlier whose iteration has come, then a check
        (collective at check steps: every rank calls it)."""
        if self.pending_switch is not None and self.trained_position >= self.pending_switch.position:
            pending, self.pending_switch = self.pending_switch, None
            self.switch_plan(pending.plan, reason=pending.reason)
        if self._rebalancer is not None:
            order = self._rebalancer.after_step(self._step_view(step), self.compute_timer)
            if order is not None:
                self.schedule_switch(order)

    def record_switch(self, plan: Plan | PipelinePlan, *, step: int, reason: str, record: bool, rank: int) -> None:
        """What follows every switch: a new measurement, the plan history (`record`), the log line on rank 0."""
        if self._rebalancer is not None:
            self._rebalancer.restart_measurement(self.compute_timer, after_step=step)
        if record:
            entry = history_entry(
                plan, start_step=step, data_position=self.trained_position, reason=reason, switched=True
            )
            self.plan_history.append(entry)
        if rank == 0:
            shares = " ".join(f"{b}x{count}" for b, count in zip(*plan_shares(plan)))
            logger.info("poplar plan from step %d: %s; micro-batches %s", step, reason, shares)


class Rebalancer:
    """One rank's part: measure, report every check interval, and return the switch rank 0 decides (it reads
    a `StepView` and the compute timer, never the engine, which applies the switch)."""

    def __init__(self, config: RebalanceConfig, *, rank: int, monitor: DriftMonitor | None) -> None:
        assert (monitor is not None) == (rank == 0), "rank 0 alone holds the monitor"
        self.config = config
        self.rank = rank
        self.monitor = monitor
        self.active = True
        """False once the job turned out unable to re-balance (see `after_step`); the same on every rank."""
        self._iterations = 0
        self._restarted_after_step: int | None = None
        """The optimizer step a new plan's measurement starts after: that step's iteration (the old plan's,
        its busy time dropped) is not counted when `after_step` sees it."""

    def restart_measurement(self, timer: ComputeTimer | None, *, after_step: int | None = None) -> None:
        """A new plan starts (after optimizer step `after_step`): the next check measures only its iterations."""
        if timer is not None:
            timer.busy_time_s = 0.0
        self._iterations = 0
        self._restarted_after_step = after_step

    def after_step(self, view: StepView, timer: ComputeTimer) -> SwitchOrder | None:
        """At every optimizer step, after DeepSpeed's (collective at check steps: every rank calls it)."""
        if not self.active:
            return None
        # A switch that waited for its iteration starts at this step, before this call: this step's iteration
        # ran the old plan and its busy time is gone; counting it would halve every rank's measured speed.
        if view.step != self._restarted_after_step:
            self._iterations += 1
        self._restarted_after_step = None
        if view.step % self.config.check_interval_steps:
            return None
        report = {
            "busy_s": timer.busy_time_s,
            "iterations": self._iterations,
            "generated_until": view.data_reached,
            "has_sampler": view.has_sampler,
            "pending": view.switch_pending,
        }
        timer.busy_time_s, self._iterations = 0.0, 0
        reports = gather_objects(report)
        if not all(r["has_sampler"] for r in reports):
            self._give_up([rank for rank, r in enumerate(reports) if not r["has_sampler"]])
            return None
        if any(r["pending"] for r in reports):
            return None  # a switch is on its way: measure it first

        def decide() -> dict[str, Any] | None:
            assert self.monitor is not None
            busy, iterations = [r["busy_s"] for r in reports], [r["iterations"] for r in reports]
            return self.monitor.observe(view.plan, busy, iterations, step=view.step)

        decision = decided_by_rank0(decide, rank=self.rank)
        if decision is None:
            return None
        plan = any_plan_from_dict(decision["plan"], source="<re-balanced plan>")
        return SwitchOrder(plan=plan, position=max(r["generated_until"] for r in reports), reason=decision["reason"])

    def _give_up(self, without_sampler: list[int]) -> None:
        self.active = False
        if self.rank == 0:
            # Asked for explicitly: a warning; on by default ("auto"): a note.
            logger.log(
                logging.WARNING if self.config.enabled else logging.INFO,
                "poplar rebalance: off for this job: ranks %s feed batches of their own, which a plan switch cannot "
                "change; train from the dataloader poplar_ext.initialize returns or engine.create_batch_sampler",
                without_sampler,
            )


class RebalanceUnavailable(ValueError):
    """Re-balancing cannot run in this job: an error where the config asks for it, a plain note in the log
    where it is on by default (`plain`)."""

    def __init__(self, message: str, *, plain: str) -> None:
        super().__init__(message)
        self.plain = plain
        """Why, in words for a log line that is no error."""


def job_rebalancer(job: Any, *, make_monitor: Callable[[], DriftMonitor]) -> Rebalancer | None:
    """The job's re-balancing, or None when it is off; collective.

    `job`: a ZeRO or pipeline job (its ``poplar_config``, ``source``, ``rank``, ``device`` and ``plan``). Rank 0
    makes the monitor it re-plans with (`make_monitor`, raising `RebalanceUnavailable` where its profiles are
    missing). Where it cannot run: off when ``enabled`` is ``"auto"`` (logged), the same ValueError on every
    rank when it is ``true``.
    """
    config = job.poplar_config
    if config.rebalance.enabled is False:
        return None
    unmeasurable = unmeasurable_reason(job.device.type, job.plan.zero_stage)
    refusal = None  # (where, why the error says, why the note says)
    if unmeasurable is not None:
        refusal = (f"on {job.device.type} at ZeRO stage {job.plan.zero_stage}", unmeasurable, unmeasurable)
    elif config.drop_last:
        # With drop_last an epoch's last positions are not trained, so iterations do not start a global
        # batch apart, which a switch's position (agreed from how far each rank's data has gone) assumes.
        refusal = (
            "with poplar.drop_last true",
            "re-balancing switches plans at stream positions, which drop_last's skipped epoch tails break; set "
            "drop_last false to re-balance",
            "poplar.drop_last is true",
        )
    if refusal is not None:
        where, error, note = refusal
        if config.rebalance.enabled:
            raise ValueError(
                f"{job.source}: poplar.rebalance.enabled: expected false (or auto, which turns it off) {where}, "
                f"found true: {error}"
            )
        if job.rank == 0:
            logger.info("poplar rebalance (auto): off for this job: %s", note)
        return None
    made: dict[str, DriftMonitor] = {}

    def load() -> str | None:  # the inputs stay on rank 0: only it re-plans
        try:
            made["monitor"] = make_monitor()
        except ValueError as exc:
            if config.rebalance.enabled:
                raise
            return getattr(exc, "plain", str(exc))
        return None

    unavailable = decided_by_rank0(load, rank=job.rank)
    if unavailable is not None:
        if job.rank == 0:
            logger.info(
                "poplar rebalance: off for this job, as it is by default where it cannot run: it re-plans from a "
                "profile of every device type, and %s (nothing is wrong; poplar.rebalance.enabled false says so "
                "without this note)",
                unavailable,
            )
        return None
    return Rebalancer(config.rebalance, rank=job.rank, monitor=made.get("monitor"))


__all__ = [
    "CudaEventTimer",
    "DriftMonitor",
    "FollowsRebalancing",
    "PipelineDriftMonitor",
    "RebalanceUnavailable",
    "Rebalancer",
    "StepView",
    "SwitchOrder",
    "job_rebalancer",
    "unmeasurable_reason",
]
