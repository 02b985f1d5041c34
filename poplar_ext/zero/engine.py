"""`PoplarEngine`: a proxy over ``DeepSpeedEngine`` training a plan's per-rank batches exactly (docs/training.md)."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from poplar_ext.collectives import agree_sum
from poplar_ext.elastic import ends_job_on_user_error
from poplar_ext.hardware.emulation import OPTIMIZER_STEP_KEY, ComputeSlowdown, micro_step_key, warn_on_overrun
from poplar_ext.hardware.optimizer_window import optimizer_compute_window
from poplar_ext.plan.formats import Plan, one_accumulation_count, plan_from_dict, plan_to_dict
from poplar_ext.runtime.checkpoint import (
    CLIENT_STATE_KEY,
    ResumeDecision,
    check_deepspeed_files,
    check_deepspeed_load,
    read_state,
    refresh_master_weights,
    resume_decision,
    saved_world_size,
    tag_for_load,
)
from poplar_ext.runtime.config import PoplarConfig
from poplar_ext.runtime.data import (
    IterationLoader,
    PlanBatchSampler,
    check_holds_global_batch,
    check_plan_dataset,
    plan_dataloader,
)
from poplar_ext.runtime.engine_core import (
    EngineCore,
    refuse_leaving_plan,
    unapplied_loss_scale,
    unscale_reported_grad_norm,
    warn_if_step_skipped,
)
from poplar_ext.runtime.rebalance import Rebalancer, SwitchOrder
from poplar_ext.runtime.weighting import label_token_count, loss_shifts_labels, loss_weight, weight_loss

logger = logging.getLogger(__name__)


def deepspeed_own(engine: Any, name: str) -> Callable[..., Any]:
    """DeepSpeed's method `name` of `engine` as its class defines it, past an instance attribute of that name:
    `PoplarAccelerator` routes the batch setters and ``deepspeed_io`` of the DeepSpeed engine it returns to the
    `PoplarEngine`, which reaches DeepSpeed's own through this."""
    method = getattr(type(engine), name, None)
    return getattr(engine, name) if method is None else method.__get__(engine, type(engine))


def set_deepspeed_batch(engine: Any, plan: Plan, rank: int) -> None:
    """Make the DeepSpeed `engine` train `rank`'s micro-batch and accumulation count of `plan` from its
    next iteration (called between iterations), counting the plan's true global batch."""
    rank_plan = plan.ranks[rank]
    steps = rank_plan.gradient_accumulation_steps
    # DeepSpeed's own setters, as for a batch-size schedule; then the true global batch
    # again for its bookkeeping (see poplar_ext.initialize).
    deepspeed_own(engine, "set_train_micro_batch_size")(rank_plan.micro_batch_size)
    deepspeed_own(engine, "set_train_batch_size")(rank_plan.samples_per_iteration * plan.world_size)
    engine._config.train_batch_size = plan.global_batch_size
    optimizer = getattr(engine, "optimizer", None)
    if hasattr(optimizer, "gradient_accumulation_steps"):
        optimizer.gradient_accumulation_steps = steps
    # DeepSpeed finds the boundary as (micro_steps + 1) % accumulation == 0 over all
    # micro-steps so far: the count must start the new plan's first iteration at a multiple.
    engine.micro_steps = -(-engine.micro_steps // steps) * steps


def keep_fp32_clip_norm(engine: Any) -> None:
    """DeepSpeed's fp32 ZeRO-0 clip (``clip_fp32_gradients``) drops the norm it computes, so that
    ``get_global_grad_norm()`` says None there and the Trainer logs no ``grad_norm``: `engine`'s clip keeps it."""
    if "clip_fp32_gradients" in vars(engine) or not callable(getattr(type(engine), "clip_fp32_gradients", None)):
        return
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_keeping_the_norm() -> None:
        norm = clip_grad_norm_(
            parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(), mpu=engine.mpu
        )
        engine._global_grad_norm = float(norm)

    engine.clip_fp32_gradients = clip_keeping_the_norm


class PoplarEngine(EngineCore):
    """A DeepSpeedEngine that trains a plan's per-rank batches with exact gradients; use it as the engine
    ``deepspeed.initialize`` returns (every attribute not defined here is the DeepSpeed engine's). Differences:

    * `backward(loss)`: `loss` is this rank's micro-batch loss reduced as ``poplar.loss_reduction`` says; the
      wrapper weights it (``scale_wrt_gas=False``): do not divide it by the accumulation count yourself.
    * `train_batch_size()`: the plan's true global batch; the micro-batch and accumulation count are this rank's.
    * `set_train_batch_size` / `set_train_micro_batch_size`: refused unless they keep the plan's values.
    * `deepspeed_io(dataset)`: for training, this rank's micro-batches of the plan.
    * `save_checkpoint` / `load_checkpoint` also store and restore the data position and the plan history; a
      checkpoint made under another plan, on another cluster, or by plain DeepSpeed can be loaded.
    * `plan_history`: every plan the job ran, with the step it started at and why.
    """

    plan_from_dict = staticmethod(plan_from_dict)

    def __init__(
        self,
        engine: Any,
        *,
        plan: Plan,
        rank: int,
        poplar_config: PoplarConfig,
        device_label: str,
        slowdown: ComputeSlowdown | None,
        rank_device_labels: tuple[str, ...] = (),
        plan_reason: str = "the job's plan",
        rebalancer: Rebalancer | None = None,
        weights_loss: bool = True,
    ) -> None:
        self.deepspeed_engine = engine
        """The real DeepSpeedEngine."""
        self._start_core(
            plan,
            rank=rank,
            poplar_config=poplar_config,
            slowdown=slowdown,
            rebalancer=rebalancer,
            on_cpu=lambda: engine.device.type == "cpu",
            plan_reason=plan_reason,
        )
        self.rank_plan = plan.ranks[rank]
        """This rank's micro-batch size and accumulation count."""
        self.device_label = device_label
        """This rank's device, saying whether it is real or emulated."""
        self.rank_device_labels = rank_device_labels
        """Every rank's device label, rank 0 first."""
        self.last_iteration_time_s: float | None = None
        """Wall time of the last iteration (optimizer step to optimizer step) on this rank."""
        self.last_samples_per_s: float | None = None
        """True global samples per second of the last iteration."""
        self._rank = rank
        self._weights_loss = weights_loss
        self._overrun_warned = False
        self.switch_listeners: list[Callable[[Plan], None]] = []
        """Each called with the new plan at the end of every `switch_plan`: after the optimizer step that ends the
        old plan's last iteration, or in `load_checkpoint` (a resume under the checkpoint's last plan). What
        counts this rank's micro-steps outside DeepSpeed follows the switch there (accelerate's ``accumulate``)."""
        self._outputs_with_gradients = 0
        """Tensors with a gradient in the last forward's outputs: DeepSpeed hooks each (`_weight_direct_backward`)."""
        self._token_counts: collections.deque[int] = collections.deque()
        self.iteration_tokens = 0
        """``token_mean``: the current iteration's label tokens over all ranks (`set_token_counts`)."""
        if self._slowdown is not None:  # emulated, or a real device timed for re-balancing (`_start_core`)
            self._end_emulated_compute_before_reduction()
        if weights_loss:
            self._weight_direct_backward()
        keep_fp32_clip_norm(engine)

    def _weight_direct_backward(self) -> None:
        # DeepSpeed lets `loss.backward()` and `engine.scale(loss).backward()` run on the engine's output (ZeRO 1-3;
        # at stage 0 it refuses them itself): hooks divide its gradient by this rank's accumulation count, not the
        # global batch's mean under uneven plans. Its per-tensor hook is looked up at every forward; ours keeps
        # DeepSpeed's decision whether to scale (not on engine.backward's own graph) and applies the weight.
        engine = self.deepspeed_engine
        divide_by_accumulation = getattr(engine, "_backward_prologue_per_tensor", None)
        if divide_by_accumulation is None:  # a DeepSpeed without torch-style backward
            return

        def weight_instead_of_dividing(grad: Any) -> Any:
            scaled = divide_by_accumulation(grad)
            if scaled is grad:  # DeepSpeed leaves this gradient alone (engine.backward weighted it)
                return grad
            if self._outputs_with_gradients > 1:
                # Each output is hooked: the loss's gradient would meet the weight again at the logits it came from
                # (DeepSpeed divides twice alike), and a token_mean count would be used up per output.
                raise ValueError(
                    "loss.backward(): expected the model's forward to return one tensor with a gradient (the loss), "
                    f"found {self._outputs_with_gradients} (e.g. a loss and logits), each of which would get the "
                    "loss weight; call engine.backward(loss) instead, which weights the loss once"
                )
            return (grad.float() * loss_weight(**self._weight_arguments())).to(grad.dtype)

        engine._backward_prologue_per_tensor = weight_instead_of_dividing

    def _end_emulated_compute_before_reduction(self) -> None:
        # DeepSpeed's backward ends in allreduce_gradients (stages 0/1: the all-reduce, 2: the epilogue). A slow
        # device finishes computing before it communicates, so the emulated window ends (and sleeps) there:
        # after it, the sleep would add to the wait for the others and gloo's CPU time would count as compute.
        engine = self.deepspeed_engine
        reduce = engine.allreduce_gradients

        def allreduce_after_emulated_compute(*args: Any, **kwargs: Any) -> Any:
            if self._slowdown is not None:
                self._slowdown.stop()
            return reduce(*args, **kwargs)

        engine.allreduce_gradients = allreduce_after_emulated_compute

    def __getattr__(self, name: str) -> Any:  # names not found on the proxy itself
        engine = self.__dict__.get("deepspeed_engine")
        if engine is None:
            raise AttributeError(name)
        return getattr(engine, name)

    def start_compute_window(self) -> None:
        """Open this rank's compute window for a micro-step at the plan's micro-batch (a no-op while open)."""
        if self._slowdown is not None:
            self._slowdown.start(micro_step_key(self.rank_plan.micro_batch_size))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(getattr(self.deepspeed_engine, "module", None), "training", True):  # evaluation is not timed
            self.start_compute_window()
        outputs = self.deepspeed_engine(*args, **kwargs)
        if self._weights_loss:  # what `_weight_direct_backward`'s hook reads; nothing else does
            self._outputs_with_gradients = _tensors_with_gradients(outputs)
        return outputs

    forward = __call__

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> Any:
        """DeepSpeed's backward of the weighted `loss` (see the class docstring)."""
        if not self._weights_loss:
            # The caller weighted the loss (the Hugging Face Trainer's compute_loss): time it only.
            return self._timed_backward(loss, **kwargs)
        if "scale_wrt_gas" in kwargs:
            raise ValueError(
                "backward: scale_wrt_gas is set by poplar_ext (the loss weight replaces DeepSpeed's "
                "division by the accumulation count); pass the plain micro-batch loss"
            )
        return self._timed_backward(weight_loss(loss, **self._weight_arguments()), scale_wrt_gas=False, **kwargs)

    def _timed_backward(self, loss: torch.Tensor, **kwargs: Any) -> Any:
        self.start_compute_window()  # for a forward that did not go through the engine
        scale = unapplied_loss_scale(self.deepspeed_engine)
        if scale is None:
            result = self.deepspeed_engine.backward(loss, **kwargs)
        else:
            result = self.deepspeed_engine.backward(loss.float() * scale, **kwargs)
            if isinstance(result, torch.Tensor):  # DeepSpeed returns the loss it was given: the caller's, unscaled
                result = result / scale
        if self._slowdown is not None:
            self._slowdown.stop()  # a no-op unless no reduction ended the window (no_sync)
        return result

    def _weight_arguments(self) -> dict[str, Any]:
        """What `loss_weight` needs for the micro-batch whose backward runs now."""
        arguments: dict[str, Any] = {
            "world_size": self.plan.world_size,
            "micro_batch_size": self.rank_plan.micro_batch_size,
            "global_batch_size": self.plan.global_batch_size,
            "reduction": self.poplar_config.loss_reduction,
        }
        if self.poplar_config.loss_reduction == "token_mean" and self._token_counts:
            arguments["micro_batch_tokens"] = self._token_counts.popleft()
            arguments["global_batch_tokens"] = self.iteration_tokens
        return arguments

    def set_token_counts(self, micro_batch_tokens: Sequence[int]) -> int:
        """This rank's micro-batches' label tokens for the coming iteration (``loss_reduction: token_mean``), one
        count per micro-batch in order; returns the total over all ranks. Collective: every rank calls it once
        before the iteration's first backward (the dataloader `poplar_ext.initialize` returns does). Count each as
        the model's loss counts its tokens: ``label_token_count(batch, shifted=loss_shifts_labels(model))``
        (`poplar_ext.runtime.weighting`; a causal LM does not count each sequence's first label)."""
        counts = [int(n) for n in micro_batch_tokens]
        if len(counts) != self.rank_plan.gradient_accumulation_steps or any(n < 0 for n in counts):
            raise ValueError(
                f"micro_batch_tokens: expected {self.rank_plan.gradient_accumulation_steps} counts >= 0 (one per "
                f"micro-batch of this rank's iteration), found {counts}"
            )
        self.iteration_tokens = agree_sum(sum(counts), self.deepspeed_engine.device)
        self._token_counts = collections.deque(counts)
        return self.iteration_tokens

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """DeepSpeed's step; at an accumulation boundary also counts and logs the iteration, warns of a step
        DeepSpeed skipped, and reports the gradient norm without a loss scale the engine put in itself."""
        boundary = self.deepspeed_engine.is_gradient_accumulation_boundary()
        scale = unapplied_loss_scale(self.deepspeed_engine) if boundary else None  # before the step changes it
        # The optimizer step is compute too: an emulated device runs it slower, as the profiler measures it (its
        # optimizer_step_time_s), its collectives left out.
        slowdown = self.emulated_compute
        if not boundary or slowdown is None:
            result = self.deepspeed_engine.step(*args, **kwargs)
        else:
            busy_before = slowdown.busy_time_s
            optimizer = getattr(self.deepspeed_engine, "optimizer", None)
            with optimizer_compute_window(
                optimizer, start=lambda: slowdown.start(OPTIMIZER_STEP_KEY), stop=slowdown.stop
            ) as split:
                if not split:
                    slowdown.start(OPTIMIZER_STEP_KEY)
                try:
                    result = self.deepspeed_engine.step(*args, **kwargs)
                finally:
                    if not split:
                        slowdown.stop()
            # Re-balancing compares micro-step compute with the profile's micro-steps.
            slowdown.busy_time_s = busy_before
        if boundary:
            unscale_reported_grad_norm(self.deepspeed_engine, scale)
            self._end_of_iteration()
        return result

    def _end_of_iteration(self) -> None:
        step = self.deepspeed_engine.global_steps
        warn_if_step_skipped(self.deepspeed_engine, step=step, rank=self._rank)
        self.last_iteration_time_s = self._iteration_time_s()  # before re-balancing's check, which waits
        self._count_iteration(step)
        if self.last_iteration_time_s is not None:
            self.last_samples_per_s = self.plan.global_batch_size / self.last_iteration_time_s
        interval = self.poplar_config.log_interval_steps
        if interval and step % interval == 0 and not self._overrun_warned:
            self._overrun_warned = warn_on_overrun(self.emulated_compute, rank=self._rank)  # once per job
        if interval and self._rank == 0 and step % interval == 0 and self.last_samples_per_s is not None:
            emulated = self.emulated_compute
            drifted = ""  # the label names the type's slowdown: a slowdown_schedule may have changed this rank's
            if emulated is not None and emulated.slowdown != emulated.emulation.slowdown:
                drifted = f"; rank 0 now {emulated.slowdown:g}x slower (the cluster's slowdown_schedule)"
            logger.info(
                "poplar step %d: true global batch %d samples, %.2f samples/s, %.4f s/iteration "
                "(rank 0: %s, micro-batch %d x %d)%s",
                step,
                self.plan.global_batch_size,
                self.last_samples_per_s,
                self.last_iteration_time_s,
                self.device_label,
                self.rank_plan.micro_batch_size,
                self.rank_plan.gradient_accumulation_steps,
                drifted,
            )

    def train_batch_size(self) -> int:
        """The true global batch: the plan's, the same on every rank."""
        return self.plan.global_batch_size

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's batch-size setter, refused unless it keeps the plan's global batch (then a no-op): under a plan
        each rank's micro-batch and accumulation count are the plan's, and DeepSpeed's setter would change this
        rank's accumulation count alone while the loss weights and the data stay the plan's."""
        refuse_leaving_plan(
            "set_train_batch_size",
            train_batch_size,
            self.plan.global_batch_size,
            planned_as="the plan's global batch",
            holds="each rank's micro-batch and accumulation count are the plan's",
            instead="to train another global batch, save a checkpoint and resume it under a plan of that batch "
            "(poplar.global_batch_size); to move samples between ranks, engine.rebalance_to(plan)",
        )

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """DeepSpeed's micro-batch setter, refused unless it keeps this rank's micro-batch of the plan (then a
        no-op): see `set_train_batch_size`."""
        refuse_leaving_plan(
            "set_train_micro_batch_size",
            micro_batch_size,
            self.rank_plan.micro_batch_size,
            planned_as="this rank's micro-batch in the plan",
            holds="each rank's micro-batch and accumulation count are the plan's",
            instead="to change them, engine.rebalance_to(plan) on every rank (the same global batch), or resume a "
            "checkpoint under another plan",
        )

    def check_switch(self, plan: Plan) -> None:
        """ValueError unless `plan` can replace the current one mid-run (the same on every rank)."""
        new, old = ((p.global_batch_size, p.world_size, p.zero_stage) for p in (plan, self.plan))
        problem = None
        if new != old:
            problem = (
                "a switch keeps the global batch, the world size and the ZeRO stage "
                f"({', '.join(map(str, old))}), found {', '.join(map(str, new))}"
            )
        # Activation checkpointing was applied to the model, the offload to the config, before DeepSpeed's build.
        for field in ("device_type", "activation_checkpointing", "optimizer_offload"):
            kept, found = ([str(getattr(r, field)) for r in p.ranks] for p in (self.plan, plan))
            if problem is None and kept != found:
                problem = (
                    f"each rank keeps its {'device type' if field == 'device_type' else field} "
                    f"({', '.join(kept)}), found {', '.join(found)}"
                )
        if problem is None and one_accumulation_count(plan.zero_stage):
            if len({r.gradient_accumulation_steps for r in plan.ranks}) > 1:
                counts = ", ".join(str(r.gradient_accumulation_steps) for r in plan.ranks)
                problem = f"every rank has the same accumulation count at ZeRO stage {plan.zero_stage}, found {counts}"
        if problem is not None:
            raise ValueError(f"plan: expected a plan that can replace the running one: {problem}")

    def switch_plan(self, plan: Plan, *, reason: str, record: bool = True) -> None:
        """Train `plan` (the same global batch, world size and stage) from the next iteration on; every rank calls
        it at the same optimizer step, its samplers knowing from where (`PlanBatchSampler.switch_plan`)."""
        self.check_switch(plan)
        engine, rank_plan = self.deepspeed_engine, plan.ranks[self._rank]
        set_deepspeed_batch(engine, plan, self._rank)
        self.plan, self.rank_plan = plan, rank_plan
        self.record_switch(plan, step=engine.global_steps, reason=reason, record=record, rank=self._rank)
        for listener in self.switch_listeners:
            listener(plan)

    def rebalance_to(self, plan: Plan, *, reason: str = "switched by the training script") -> None:
        """Every rank switches to rank 0's `plan` from the next iteration its samplers have not started (collective).

        Call it on every rank right after the same optimizer step. `plan` re-balances the same global batch among
        the same ranks at the same stage (e.g. from `search.drift.replan`); gradients stay exact and the data
        continues, every sample once. ``poplar.rebalance`` does this by itself. A ValueError while an earlier
        switch waits for its iteration (`pending_switch`, the same on every rank).
        """
        from poplar_ext.collectives import broadcast_from_rank0, gather_objects

        if (pending := self.pending_switch) is not None:
            raise ValueError(
                f"rebalance_to: expected no plan switch pending, found one ({pending.reason}) waiting for stream "
                f"position {pending.position} (the samplers had handed out data up to it): call rebalance_to once "
                "engine.pending_switch is None, after the optimizer step that trains up to that position"
            )
        if self.poplar_config.drop_last:  # the same on every rank: one config
            raise ValueError(
                "rebalance_to: expected poplar.drop_last false, found true: a switch starts at a stream "
                "position, which drop_last's skipped epoch tails break; set drop_last false to switch plans"
            )
        if not isinstance(plan, Plan):
            raise TypeError(
                f"rebalance_to: plan: expected a ZeRO plan (poplar_ext.plan.formats.Plan: load_plan(path), "
                f"plan_from_dict(data), or a search's result.plan), found {type(plan).__name__}"
            )
        chosen = plan_from_dict(broadcast_from_rank0(plan_to_dict(plan)), source="<plan from rank 0>")
        self.check_switch(chosen)  # the same verdict on every rank: rank 0's plan
        position = max(gather_objects(self.data_reached))
        self.schedule_switch(SwitchOrder(plan=chosen, position=position, reason=reason))

    @property
    def data_reached(self) -> int:
        """How far this rank's data has been handed out: no plan switch can start before it."""
        return max([self.trained_position] + [s.generated_until for s in self._samplers])

    @property
    def batch_samplers(self) -> list[PlanBatchSampler]:
        """The batch samplers made by `create_batch_sampler` (they follow plan switches and resumes)."""
        return list(self._samplers)

    def create_batch_sampler(self, num_samples: int, *, iterations_per_pass: int | None = None) -> PlanBatchSampler:
        """This rank's batch sampler for a DataLoader of your own, from the engine's data position on
        (``DataLoader(dataset, batch_sampler=engine.create_batch_sampler(len(dataset)))``)."""
        sampler = PlanBatchSampler.from_plan(
            self.plan,
            rank=self._rank,
            num_samples=num_samples,
            consumed_samples=self.data_position,
            iterations_per_pass=iterations_per_pass,
            **self.poplar_config.data_order,
        )
        self._add_sampler(sampler)
        return sampler

    def deepspeed_io(
        self,
        dataset: Any,
        batch_size: int | None = None,
        route: str = "train",
        pin_memory: bool = True,
        data_sampler: Any = None,
        collate_fn: Any = None,
        num_local_io_workers: int | None = None,
    ) -> Any:
        """DeepSpeed's ``deepspeed_io``; for training (`route` ``"train"``, its default) the loader is this rank's
        micro-batches of the plan, as the dataloader `poplar_ext.initialize` returns for ``training_data``
        (DeepSpeed's would give every rank an equal share of `dataset` in batches of this rank's micro-batch size:
        a partial last micro-batch, iterations that end on different ranks at different samples, samples trained
        twice or not at all). `collate_fn` defaults to the one given to ``initialize``; `pin_memory` follows the
        device. For training, `batch_size` can only be this rank's micro-batch and `data_sampler` none (the plan
        splits the data). Other routes (``"eval"``, ``"predict"``) are DeepSpeed's (an equal share of `dataset` per
        rank, padded with repeated samples), in batches of `batch_size`, by default the plan's smallest micro-batch
        on every rank: DeepSpeed's default, this rank's micro-batch, would give the ranks different numbers of
        batches, and at ZeRO stage 3, where every forward gathers the parameters from every rank, hang."""
        if route != "train":
            if batch_size is None:
                batch_size = min(r.micro_batch_size for r in self.plan.ranks)
            return deepspeed_own(self.deepspeed_engine, "deepspeed_io")(
                dataset,
                batch_size=batch_size,
                route=route,
                pin_memory=pin_memory,
                data_sampler=data_sampler,
                collate_fn=collate_fn,
                num_local_io_workers=num_local_io_workers,
            )
        if batch_size is not None and batch_size != self.rank_plan.micro_batch_size:
            raise ValueError(
                f"deepspeed_io: batch_size: expected None or this rank's micro-batch size in the plan "
                f"({self.rank_plan.micro_batch_size}), found {batch_size!r}: the plan gives each rank its own "
                "micro-batch; change the plan (or poplar.global_batch_size) to change it"
            )
        if data_sampler is not None:
            raise ValueError(
                f"deepspeed_io: data_sampler: expected None for training, found {type(data_sampler).__name__}: the "
                "plan's batch sampler splits the data among the ranks (engine.create_batch_sampler), every sample "
                "once per epoch"
            )
        check_plan_dataset(dataset, "deepspeed_io: dataset", otherwise="or feed each rank its plan's micro-batches")
        check_holds_global_batch(len(dataset), self.plan.global_batch_size, "deepspeed_io: dataset: num_samples")
        if collate_fn is None:
            collate_fn = getattr(self.deepspeed_engine, "collate_fn", None)
        return self.plan_training_loader(dataset, collate_fn=collate_fn, num_workers=num_local_io_workers or 0)

    def plan_training_loader(self, dataset: Any, *, collate_fn: Any = None, num_workers: int = 0) -> Any:
        """This rank's micro-batches of `dataset` by a new batch sampler of the engine (`create_batch_sampler`);
        under ``loss_reduction: token_mean`` an iteration at a time, its label tokens agreed before its first
        micro-batch (`set_token_counts`)."""
        sampler = self.create_batch_sampler(len(dataset))
        loader = plan_dataloader(
            dataset, sampler, collate_fn=collate_fn, device=self.deepspeed_engine.device, num_workers=num_workers
        )
        if self.poplar_config.loss_reduction != "token_mean":
            return loader
        shifted = loss_shifts_labels(getattr(self.deepspeed_engine, "module", None))
        return IterationLoader(
            loader,
            micro_batches_per_iteration=lambda: self.rank_plan.gradient_accumulation_steps,
            before_iteration=lambda group: self.set_token_counts(
                [label_token_count(b, shifted=shifted) for b in group]
            ),
        )

    def adopt_batch_sampler(self, sampler: PlanBatchSampler) -> None:
        """Let a sampler built before the engine (accelerate prepares dataloaders first) follow plan switches and
        `load_checkpoint`'s data position, as `create_batch_sampler`'s do."""
        if sampler.global_batch_size != self.plan.global_batch_size or sampler.rank != self._rank:
            raise ValueError(
                f"sampler: expected rank {self._rank}'s sampler of global batch {self.plan.global_batch_size}, "
                f"found rank {sampler.rank}'s of {sampler.global_batch_size}"
            )
        self._add_sampler(sampler)

    def _save_deepspeed(self, save_dir: str | Path, new_tag: str, client_state: dict, **kwargs: Any) -> Any:
        """DeepSpeed's save into ``save_dir/TAG`` (`EngineCore.save_checkpoint`)."""
        from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

        # DeepSpeed's own converter (ds_to_universal) requires this entry; poplar-ext's
        # (`poplar_ext.runtime.reshard`) does not, but keeps checkpoints usable by both.
        client_state.setdefault(UNIVERSAL_CHECKPOINT_INFO, _added_universal_info())
        return self.deepspeed_engine.save_checkpoint(
            save_dir, tag=new_tag, client_state=client_state, save_latest=False, **kwargs
        )

    @ends_job_on_user_error  # a refusal of the checkpoint: every restart would load it again
    def load_checkpoint(self, load_dir: str | Path, tag: Any = None, **kwargs: Any) -> tuple[Any, dict | None]:
        """DeepSpeed's load_checkpoint, continuing the data stream under this job's plan.

        Rank 0 reads poplar-ext's state first: a resume that cannot continue (another data order) stops every rank
        before any weight is read, and so does a checkpoint DeepSpeed would load wrong or fail on some ranks (another
        model, a rank's file missing, optimizer states of another precision: `check_deepspeed_load`). Another
        plan, global batch or world size is fine: the data continues at the saved position, and the plan history
        records the resume. Where the number of ranks changed at ZeRO
        stages 1-3 with the optimizer state loaded, rank 0 reshards the checkpoint (`poplar_ext.runtime.reshard`)
        into ``TAG_universal`` beside it, unless there, and every rank loads that. An optimizer state that cannot
        be resharded (not one value per parameter element) stops every rank before any weight is loaded, naming
        the optimizer and the state; a ``TAG_universal`` some rank cannot see stops every rank with the command
        that writes it. The weights alone load
        on any number of ranks (at stage 3 merged from every rank's partition, `merging_weights_of`). A plain
        DeepSpeed checkpoint, or ``load_module_only=True``, starts the data at position 0, with a logged note; a
        plain one's optimizer state saved on another number of ranks (told by the ``dp_world_size`` DeepSpeed
        records in its model states file) is resharded too.
        Returns DeepSpeed's ``(path, client_state)``.
        """
        from poplar_ext.collectives import decided_by_rank0
        from poplar_ext.runtime.reshard import loading_resharded, merging_weights_of, resharded_tag

        resolved = tag_for_load(load_dir, tag, deepspeed_engine=self.deepspeed_engine, rank=self._rank)

        module_only, with_optimizer = (
            bool(kwargs.get("load_module_only")),
            bool(kwargs.get("load_optimizer_states", True)),
        )

        def read_checked_state() -> dict | None:
            check_deepspeed_files(load_dir, resolved, named_by_latest=tag is None)
            saved = read_state(load_dir, resolved)
            bf16 = getattr(self.deepspeed_engine, "bfloat16_enabled", None)
            check_deepspeed_load(
                load_dir,
                resolved,
                saved,
                module=getattr(self.deepspeed_engine, "module", None),
                strict=bool(kwargs.get("load_module_strict", True)),
                reads_optimizer=with_optimizer and not module_only,
                node_local=self.deepspeed_engine.use_node_local_storage(),
                bf16=None if bf16 is None else bool(bf16()),
                world_size=self.plan.world_size,
                zero_stage=self.plan.zero_stage,
            )
            return saved

        saved = None if resolved is None else decided_by_rank0(read_checked_state, rank=self._rank)
        where = str(Path(load_dir) / resolved) if resolved is not None else str(load_dir)
        decision = None
        load_tag = resolved  # not the caller's None: on node-local storage each node's ``latest`` may differ
        loading: Any = nullcontext()
        reshards = self.plan.zero_stage > 0 and with_optimizer and not module_only
        if saved is None and resolved is not None and reshards:
            # No state file (a plain DeepSpeed checkpoint): how many ranks saved it, as DeepSpeed recorded.
            saved_ranks = decided_by_rank0(lambda: saved_world_size(load_dir, resolved), rank=self._rank)
            if saved_ranks not in (None, self.plan.world_size):
                load_tag = resharded_tag(
                    Path(load_dir), resolved, deepspeed_engine=self.deepspeed_engine, rank=self._rank
                )
                loading = loading_resharded(self.deepspeed_engine)
        if saved is not None:
            decision = resume_decision(
                saved,
                self._client_state(),
                path=where,
                step=saved.get("step", 0),
                load_module_only=module_only,
                load_optimizer_states=with_optimizer,
            )
            # The weights alone load on any number of ranks; the optimizer's partitions at stages 1-3 do not.
            if decision.world_size_changed and reshards:
                load_tag = resharded_tag(
                    Path(load_dir), resolved, deepspeed_engine=self.deepspeed_engine, rank=self._rank
                )
                loading = loading_resharded(self.deepspeed_engine)
        if module_only and self.plan.zero_stage == 3:
            # The model's file holds empty partitions at stage 3: DeepSpeed would load no weight, silently.
            # Without the optimizer state it merges them from every rank's partition (`merging_weights_of`).
            kwargs["load_optimizer_states"] = False
        if self.plan.zero_stage == 3 and resolved is not None and not kwargs.get("load_optimizer_states", True):
            loading = merging_weights_of(resolved, self.deepspeed_engine)  # never while resharding: it loads them
        with loading:
            path, client_state = self.deepspeed_engine.load_checkpoint(load_dir, tag=load_tag, **kwargs)
        if path is None:
            return path, client_state
        refresh_master_weights(getattr(self.deepspeed_engine, "optimizer", None), kwargs)
        client_state = without_added_universal_info(client_state)
        if decision is None:  # no state file: poplar-ext 0.1's client_state entry, or a plain DeepSpeed checkpoint
            decision = resume_decision(
                client_state.pop(CLIENT_STATE_KEY, None),
                self._client_state(),
                path=where,
                step=self.deepspeed_engine.global_steps,
                load_module_only=module_only,
            )
        self.continue_from(decision)
        return path, client_state

    def continue_from(
        self,
        decision: ResumeDecision,
        *,
        position_samplers: bool = True,
        next_iteration: int | None = None,
        log_notes: bool = True,
    ) -> None:
        """Continue from a checkpoint as `decision` says: its data position, samples, plan history, and its last
        plan when the run had switched (every rank alike). A trainer that loads the DeepSpeed checkpoint itself
        and positions its dataloader itself passes `position_samplers` False and its sampler's `next_iteration`;
        one that logged the decision's notes when it made it passes `log_notes` False."""
        self._restore_position(decision, position_samplers=position_samplers)
        if not position_samplers and next_iteration is not None:
            self._restored_iteration = next_iteration
        self._continue_plans(decision, log_notes=log_notes)


def _added_universal_info() -> dict:
    """The universal-checkpoint entry `PoplarEngine` adds to a client state that has none."""
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_VERSION_KEY, UNIVERSAL_CHECKPOINT_VERSION_VALUE

    return {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}


def without_added_universal_info(client_state: dict | None) -> dict:
    """A loaded client state as the script saved it: without the entry poplar-ext added to it at save."""
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    client_state = dict(client_state or {})
    if client_state.get(UNIVERSAL_CHECKPOINT_INFO) == _added_universal_info():
        del client_state[UNIVERSAL_CHECKPOINT_INFO]
    return client_state


__all__ = ["CLIENT_STATE_KEY", "PoplarEngine", "set_deepspeed_batch", "unapplied_loss_scale"]


def _tensors_with_gradients(outputs: Any) -> int:
    """The tensors with a grad_fn in `outputs` (tensors, tuples, lists, dicts), as DeepSpeed hooks them."""
    if isinstance(outputs, torch.Tensor):
        return int(outputs.grad_fn is not None)
    if isinstance(outputs, (tuple, list)):
        return sum(_tensors_with_gradients(item) for item in outputs)
    if isinstance(outputs, dict):
        return sum(_tensors_with_gradients(value) for value in outputs.values())
    return 0
