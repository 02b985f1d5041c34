"""`EngineCore`: what every engine keeps over DeepSpeed's (docs/design.md, "Engines over one core")."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from poplar_ext.hardware.compute_clock import ComputeTimer, CudaEventTimer
from poplar_ext.hardware.emulation import ComputeSlowdown, scheduled_slowdown
from poplar_ext.plan.formats import Plan
from poplar_ext.plan.pipeline_formats import PipelinePlan
from poplar_ext.runtime.checkpoint import ResumeDecision, history_entry, poplar_client_state, save_whole
from poplar_ext.runtime.config import PoplarConfig
from poplar_ext.runtime.data import PlanBatchSampler
from poplar_ext.runtime.rebalance import FollowsRebalancing, Rebalancer, StepView, SwitchOrder

logger = logging.getLogger(__name__)


def unapplied_loss_scale(engine: Any) -> float | None:
    """The fp16 loss scale DeepSpeed's backward leaves out of the loss on `engine` (a DeepSpeedEngine), or None
    where it applies it or none is used.

    DeepSpeed falls short in fp16 at ZeRO stage 0: its backward multiplies the loss by the loss scale for its ZeRO
    optimizers only (deepspeed/runtime/engine.py ``backward``; deepspeedai/DeepSpeed#8393, open), while the steps of
    FP16_Optimizer and FP16_UnfusedOptimizer divide the gradients by it: every update would be the loss scale times
    too small (65536 by default). Both engines put it in themselves."""
    fp16_enabled = getattr(engine, "fp16_enabled", None)
    if fp16_enabled is None or not fp16_enabled():
        return None
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    optimizer = getattr(engine, "optimizer", None)
    config = getattr(optimizer, "loss_scale_config", None)
    if isinstance(optimizer, ZeROOptimizer) or config is None or not config.use_grad_scaling:
        return None
    return float(config.cur_scale)


def unscale_reported_grad_norm(engine: Any, scale: float | None) -> None:
    """`engine`'s reported gradient norm (a DeepSpeedEngine's ``get_global_grad_norm``, the Trainer's logged
    grad_norm) divided by `scale`, the loss scale the engine put in itself before this step
    (`unapplied_loss_scale`; None: nothing to undo). DeepSpeed's FP16_UnfusedOptimizer (fp16 at ZeRO 0) records the
    norm of the gradients as it holds them, scaled (its clipping divides it by the scale itself): with the scale put
    into the loss it read as the loss scale times the true norm. FP16_Optimizer (around a fused optimizer) records
    it divided by the scale already: left as it is, as is a skipped step's norm (negative, infinite)."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer

    norm = getattr(engine, "_global_grad_norm", None)
    if scale is None or norm is None or isinstance(getattr(engine, "optimizer", None), FP16_Optimizer):
        return
    value = float(norm)
    if value > 0 and math.isfinite(value):
        engine._global_grad_norm = norm / scale


def warn_if_step_skipped(engine: Any, *, step: int, rank: int) -> bool:
    """After optimizer step `step` of `engine` (a DeepSpeedEngine): True where DeepSpeed skipped it (gradients not
    finite, the same on every rank: an fp16 overflow, or NaN or inf in bf16 and fp32 too), with a warning on rank 0.
    DeepSpeed logs its own at INFO, below its logger's level, so the step's data went untrained without a word."""
    applied = getattr(engine, "was_step_applied", None)
    if applied is None or applied():
        return False
    if rank == 0:
        fp16_enabled = getattr(engine, "fp16_enabled", None)
        cause, scale = "NaN or inf", ""  # bf16, fp32: no loss scale to lower
        if fp16_enabled is not None and fp16_enabled():
            loss_scale = getattr(getattr(engine, "optimizer", None), "loss_scale", None)  # DeepSpeed's optimizers'
            cause = "an fp16 overflow"
            scale = f", the loss scale now {float(loss_scale):g}" if isinstance(loss_scale, (int, float)) else ""
        logger.warning(
            "poplar step %d: DeepSpeed skipped the optimizer step (gradients not finite: %s)%s; "
            "its data is not trained again (%d steps skipped so far)",
            step,
            cause,
            scale,
            getattr(engine, "skipped_steps", 0),
        )
    return True


def undo_initial_zero_step(engine: Any) -> bool:
    """Undo the optimizer step of zero gradients DeepSpeed's fp16 optimizers at ZeRO stage 0 take when they are
    built (FP16_UnfusedOptimizer around a torch optimizer such as Adam, AdamW or SGD; FP16_Optimizer around a fused
    one such as the FusedAdam of a config's ``optimizer`` section on a GPU); True where it did.

    DeepSpeed 0.19.8 builds their state with ``initialize_optimizer_states``: every gradient zero, then the user's
    ``optimizer.step()``. Adam and AdamW then count a step that never was (their bias correction makes every later
    update another size than one process training the same batches), and AdamW's weight decay shrinks every fp32
    master weight by lr x weight_decay before any training. Call it on a freshly built `engine` (a
    DeepSpeedEngine), before any step and never after a checkpoint load (which replaces that state; PoplarTrainer
    calls it only where the Trainer's build loaded none): each fp32 master weight is set back to its fp16
    parameter (DeepSpeed made it from that, which the zero step did not touch) and the state that step created
    is dropped, so the optimizer starts as torch's would."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    optimizer = getattr(engine, "optimizer", None)
    if isinstance(optimizer, FP16_UnfusedOptimizer) and not optimizer.fused_lamb_legacy:
        pairs = [pair for groups in zip(optimizer.fp16_groups, optimizer.fp32_groups) for pair in zip(*groups)]
    elif isinstance(optimizer, FP16_Optimizer):  # one flat master per group
        pairs = list(zip(optimizer.fp16_groups_flat, optimizer.fp32_groups_flat))
    else:
        return False
    for low, high in pairs:
        high.data.copy_(low.data)
        optimizer.optimizer.state.pop(high, None)
    return True


def refuse_leaving_plan(setter: str, found: Any, planned: int, *, planned_as: str, holds: str, instead: str) -> None:
    """ValueError from DeepSpeed's batch setter `setter` (``set_train_batch_size``, ``set_train_micro_batch_size``)
    unless `found` keeps the plan's value `planned` (then a no-op): DeepSpeed's setter would change one rank's counts
    while the loss weights and the data stay the plan's. `planned_as` names the value, `holds` says what the plan
    fixes, `instead` what to do."""
    if found != planned:
        raise ValueError(f"{setter}: expected {planned_as} ({planned}), found {found!r}: {holds}; {instead}")


class EngineCore(FollowsRebalancing):
    """The engine-independent half of an engine. The engine calls `_start_core` in its constructor and
    `_count_iteration` and `_iteration_time_s` after each optimizer step; it provides ``global_steps``,
    ``switch_plan``, ``data_reached`` (`FollowsRebalancing`) and ``_save_deepspeed``."""

    plan_from_dict: Callable[..., Plan | PipelinePlan]
    """How this engine's plans are read from JSON (a checkpoint's last plan)."""
    _fed_by_caller = False
    """The job feeds batches past the engine's samplers, where a plan switch cannot reach them."""

    def _start_core(
        self,
        plan: Plan | PipelinePlan,
        *,
        rank: int,
        poplar_config: PoplarConfig,
        slowdown: ComputeSlowdown | None,
        rebalancer: Rebalancer | None,
        on_cpu: Callable[[], bool],
        plan_reason: str,
    ) -> None:
        """`on_cpu`: whether this rank's device is the CPU (asked where re-balancing needs a timer)."""
        from poplar_ext.collectives import job_timeout_on_every_group

        job_timeout_on_every_group()  # the groups DeepSpeed made for the engine: the job's timeout, not torch's
        self.plan = plan
        """The plan every rank runs."""
        self.poplar_config = poplar_config
        self.consumed_samples = 0
        """Samples (of all ranks) trained by the optimizer steps so far."""
        self.plan_history: list[dict] = [history_entry(plan, start_step=0, data_position=0, reason=plan_reason)]
        """Every plan the job ran: ``start_step``, ``data_position``, ``reason`` and the ``plan`` (JSON)."""
        if slowdown is None and rebalancer is not None:
            # A real device too measures its compute (never sleeps) when re-balancing watches
            # it: the thread's CPU time on CPU, CUDA events (read at checks only) on a GPU.
            slowdown = ComputeSlowdown(None) if on_cpu() else CudaEventTimer()
        self._slowdown = slowdown
        self._rebalancer = rebalancer
        self._core_rank = rank
        self.pending_switch: SwitchOrder | None = None
        """A plan switch agreed by every rank, waiting for the iteration it starts at."""
        self._samplers: list[PlanBatchSampler] = []
        self._restored_iteration = 0
        """The iteration trained by the first optimizer step since the restore, numbered as every sampler of the
        job numbers them (`data_position`)."""
        self._restored_position = 0
        self._steps_since_restore = 0
        self._last_boundary_time: float | None = None
        self._follow_slowdown_schedule(0)  # a drift from step 0 holds from the first micro-step

    @property
    def emulated_compute(self) -> ComputeSlowdown | None:
        """This rank's emulated slowdown (None on a real device); `emulated_compute.stop()` ends its
        window early, e.g. to time a collective without the emulated sleep in it."""
        if self._slowdown is None or self._slowdown.emulation is None:
            return None
        return self._slowdown

    @property
    def compute_timer(self) -> ComputeTimer | None:
        """What times this rank's compute: the emulation's slowdown, or, when re-balancing is on, a timer
        that only measures."""
        return self._slowdown

    @property
    def rebalancer(self) -> Rebalancer | None:
        """The job's re-balancing (``poplar.rebalance``), None when off; on rank 0 its ``monitor`` holds the checks."""
        return self._rebalancer

    @property
    def trained_position(self) -> int:
        """Stream position after the last optimizer step (a DataLoader may have read further)."""
        return self._restored_position + self._steps_since_restore * self.plan.global_batch_size

    @property
    def data_position(self) -> int:
        """Stream position where the next iteration starts (see `poplar_ext.runtime.data`): the first one no
        optimizer step has trained, counted in steps (a DataLoader reading ahead, accelerate's or workers', has
        begun later iterations), but, once a sampler has handed out data, never beyond the furthest one read:
        steps trained on batches of the script's own took nothing from the stream (a sampler never read, or one
        per pass, lags; a pipeline's middle stages read none). With ``drop_last`` the samplers' iterations skip
        each epoch's tail: their start, not a global batch apart."""
        if not self._samplers:
            return self.trained_position
        trained = self._next_untrained_position()
        read = max(sampler.consumed_samples for sampler in self._samplers)
        return min(trained, read) if read > self._restored_position else trained

    def _step_view(self, step: int) -> StepView:
        return StepView(
            step=step,
            plan=self.plan,
            data_reached=self.data_reached,
            has_sampler=bool(self._samplers) and not self._fed_by_caller,
            switch_pending=self.pending_switch is not None,
        )

    def _follow_slowdown_schedule(self, optimizer_step: int) -> None:
        # An emulated drift (the cluster's slowdown_schedule) holds from its optimizer step on, also after a resume.
        timer = self._slowdown
        if timer is not None and timer.emulation is not None and timer.emulation.slowdown_schedule:
            before = timer.slowdown
            timer.slowdown = scheduled_slowdown(timer.emulation, optimizer_step=optimizer_step, rank=self._core_rank)
            if timer.slowdown != before:  # each rank says its own: the step lines are rank 0's, its type's factor
                logger.info(
                    "rank %d: emulated compute now %gx slower (was %gx) after %d optimizer steps, as the cluster's "
                    "slowdown_schedule says",
                    self._core_rank,
                    timer.slowdown,
                    before,
                    optimizer_step,
                )

    def _count_iteration(self, step: int) -> None:
        """After optimizer step `step`: the samples counted, the emulated drift and re-balancing followed
        (collective at check steps)."""
        self.consumed_samples += self.plan.global_batch_size
        self._steps_since_restore += 1
        self._follow_slowdown_schedule(step)
        self.follow_rebalancing(step)

    def _iteration_time_s(self) -> float | None:
        """Wall time since the previous call (an optimizer step to the next); None at the first."""
        now = time.perf_counter()
        previous, self._last_boundary_time = self._last_boundary_time, now
        return None if previous is None else now - previous

    def save_checkpoint(
        self,
        save_dir: str | Path,
        tag: Any = None,
        client_state: dict | None = None,
        save_latest: bool = True,
        **kwargs: Any,
    ) -> Any:
        """DeepSpeed's save_checkpoint, with poplar-ext's state file in the tag folder; written into a new folder
        that replaces the tag's once every rank has saved, then named in ``latest`` (`save_whole`)."""
        client = {**(client_state or {}), **self._client_state_before_save()}

        def save(new_tag: str) -> Any:
            return self._save_deepspeed(save_dir, new_tag, client, **kwargs)

        return save_whole(save_dir, tag, save, deepspeed_engine=self, state=self._client_state, save_latest=save_latest)

    def _client_state_before_save(self) -> dict:
        """What the engine adds to DeepSpeed's client state, taken before `save_whole` begins."""
        return {}

    def _client_state(self) -> dict:
        """What this job writes into a checkpoint's ``poplar_state.json``."""
        state = poplar_client_state(
            self.plan,
            consumed_samples=self.consumed_samples,
            data_position=self.data_position,
            **self.poplar_config.data_order,
            plan_history=self.plan_history,
        )
        return {**state, "step": self.global_steps, **self.rebalancing_state()}

    def _restore_position(self, decision: ResumeDecision, *, position_samplers: bool = True) -> None:
        """The samples and data position of a resume (then `_continue_plans`); the restored step's emulated drift."""
        self._follow_slowdown_schedule(self.global_steps)
        self.consumed_samples = decision.consumed_samples
        self._restored_position, self._steps_since_restore = decision.data_position, 0
        # A load into an engine that trained already (a roll-back): its switches, made or pending, were agreed at
        # positions of the run before the load, which the resumed stream reaches again. From the restored position
        # the samplers hand out the plan the engine trains now (`_continue_plans` then schedules the checkpoint's).
        self.pending_switch = None
        for sampler in self._samplers:
            sampler.restart_plan(self.plan)
        if position_samplers:
            for sampler in self._samplers:
                sampler.set_position(decision.data_position)
            if self._samplers:
                self._restored_iteration = self._samplers[0].next_iteration

    def _add_sampler(self, sampler: PlanBatchSampler) -> None:
        """A batch sampler that follows plan switches and resumes."""
        if not self._samplers:  # its next iteration is the one the next optimizer step trains
            self._restored_iteration = sampler.next_iteration - self._steps_since_restore
        if self.pending_switch is not None:  # made at the data position, before the switch's
            sampler.switch_plan(self.pending_switch.plan, from_position=self.pending_switch.position)
        # A pass begun after a pass read ahead of training (or left early) starts at the first iteration untrained.
        sampler.trained_position = self._next_untrained_position
        self._samplers.append(sampler)

    def _next_untrained_position(self) -> int:
        """Stream position of the iteration the next optimizer step trains (as `data_position` counts steps)."""
        return self._samplers[0].iteration_start(self._restored_iteration + self._steps_since_restore)

    def _continue_plans(self, decision: ResumeDecision, *, log_notes: bool = True) -> None:
        """The plan history of a resume, and its last plan when the run had switched (every rank alike); rank 0
        logs the decision's notes unless the caller logged them (`log_notes` False)."""
        self.plan_history = decision.plan_history or self.plan_history
        if decision.continue_plan is not None:
            plan = self.plan_from_dict(decision.continue_plan, source="<the checkpoint's last plan>")
            order = SwitchOrder(plan=plan, position=decision.data_position, reason="the checkpoint's last plan")
            self.schedule_switch(order, record=False)
        self.continue_rebalancing(decision.rebalancing)
        if self._core_rank == 0 and log_notes:
            for note in decision.notes:
                logger.info("load_checkpoint: %s", note)
