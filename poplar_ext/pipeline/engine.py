"""`PoplarPipelineEngine`: DeepSpeed's PipelineEngine for one pipeline of a plan, exact over all of them.

See docs/pipeline.md (what happens underneath) and docs/deepspeed-notes.md (pipeline engine).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.dataloader import RepeatingLoader
from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from poplar_ext.collectives import agree_sum, decided_by_rank0, gather_objects, sum_in_group
from poplar_ext.elastic import ends_job_on_user_error
from poplar_ext.hardware.emulation import ComputeSlowdown
from poplar_ext.pipeline.checkpoint import (
    UNIVERSAL_FOLDER,
    check_recount,
    layers_move,
    parameter_differences,
    pipeline_folder,
    pipeline_resume_decision,
)
from poplar_ext.pipeline.grid import grad_or_zeros
from poplar_ext.pipeline.job import PipelineJob
from poplar_ext.pipeline.replan import (
    PARAMETER_SHAPES_KEY,
    convert_pipeline_checkpoint,
    half_precision_master_copies,
    load_parameter_states,
    optimizer_parameter_shapes,
)
from poplar_ext.plan.pipeline_formats import PipelinePlan, pipeline_plan_from_dict
from poplar_ext.runtime.checkpoint import ResumeDecision, read_state, refresh_master_weights, tag_for_load
from poplar_ext.runtime.data import PlanBatchSampler
from poplar_ext.runtime.engine_core import (
    EngineCore,
    refuse_leaving_plan,
    unapplied_loss_scale,
    unscale_reported_grad_norm,
    warn_if_step_skipped,
)
from poplar_ext.runtime.rebalance import Rebalancer
from poplar_ext.runtime.weighting import pipeline_loss_weight

logger = logging.getLogger(__name__)

TRAIN_LOSS_EVENT, EVAL_LOSS_EVENT = "Train/Samples/train_loss", "Train/Samples/eval_loss"
"""The events DeepSpeed's monitor (csv, TensorBoard, wandb, comet) gets from train_batch and eval_batch."""


def _timed(instruction: Callable[..., Any], *, compute: bool = True) -> Callable[..., Any]:
    """`instruction` run inside this rank's compute window: an emulated device slowed down, a real one measured
    where re-balancing watches it. Not `compute` (the optimizer step): slowed on an emulated device only, and left
    out of the busy time re-balancing compares with the layers' profiles."""

    def run(engine: PoplarPipelineEngine, **kwargs: Any) -> Any:
        timer = engine.compute_timer
        if timer is None or not (compute or engine.emulated_compute is not None):
            return instruction(engine, **kwargs)
        busy_before = timer.busy_time_s if not compute else 0.0
        timer.start(instruction.__name__)  # each instruction a kind of block, steady on its own
        try:
            return instruction(engine, **kwargs)
        finally:
            timer.stop()
            if not compute:
                timer.busy_time_s = busy_before

    return run


def _exec_optimizer_step(engine: PoplarPipelineEngine, **kwargs: Any) -> Any:
    """DeepSpeed's optimizer step instruction, its reported gradient norm without the loss scale the engine put in
    itself (`unscale_reported_grad_norm`; every stage's gradients carry it)."""
    scale = unapplied_loss_scale(engine)
    result = PipelineEngine._exec_optimizer_step(engine, **kwargs)
    unscale_reported_grad_norm(engine, scale)
    return result


def _exec_backward_pass(engine: PoplarPipelineEngine, **kwargs: Any) -> Any:
    """DeepSpeed's backward instruction; on the last stage, the loss times the loss scale (in fp32, as
    FP16_Optimizer.backward) where DeepSpeed's backward leaves it out (`_unapplied_loss_scale`). Earlier stages
    receive gradients scaled already."""
    scale = engine._unapplied_loss_scale() if engine.is_last_stage() else None
    if scale is None:
        return PipelineEngine._exec_backward_pass(engine, **kwargs)
    loss = engine.loss
    engine.loss = loss.float() * scale
    try:
        return PipelineEngine._exec_backward_pass(engine, **kwargs)
    finally:
        engine.loss = loss


def agree_on_overflow(
    gradients: Collection[torch.Tensor], *, device: Any, agree: Callable[[int, Any], int] = agree_sum
) -> bool:
    """Whether any rank's `gradients` hold an inf or a NaN (collective: every rank calls it at ReduceGrads).

    Where another rank's do and this rank's do not, this rank's are set to NaN: DeepSpeed's own check then
    skips the step here too (fp16: and lowers the loss scale), on every rank alike. The sum across pipelines
    spreads a non-finite gradient to every copy of its layer already; this holds where the copies' sums would
    differ. `agree`: the sum of an int over all ranks.
    """
    local = any(not bool(torch.isfinite(gradient).all()) for gradient in gradients)
    overflow = agree(int(local), device) > 0
    if overflow and not local:
        for gradient in gradients:
            gradient.fill_(float("nan"))
    return overflow


def optimizer_state_unloadable(engine: Any) -> bool:
    """Whether `engine` (a pipeline's) saves an optimizer state its loading cannot read: DeepSpeed 0.19.8's bf16
    optimizer without ZeRO (bf16 at ZeRO 0), whose state `load_checkpoint` refuses."""
    return isinstance(engine.optimizer, BF16_Optimizer) and not engine.zero_optimization()


def warn_unloadable_optimizer_state(engine: Any, *, rank: int) -> None:
    """At the start of a job whose checkpoints will not resume with their optimizer state, say so (rank 0): the
    refusal comes only at the load, after the run that saved them."""
    if rank == 0 and optimizer_state_unloadable(engine):
        logger.warning(
            "bf16 at ZeRO stage 0: this job's checkpoints will not resume with their optimizer state "
            "(DeepSpeed 0.19.8 cannot read the state it saves there; load_checkpoint refuses it, or loads the "
            "weights alone with load_optimizer_states=False); zero_optimization.stage 1 (a plan searched with "
            "--zero-stage 1) resumes exactly and costs no memory in a pipeline"
        )


class PoplarPipelineEngine(EngineCore, PipelineEngine):
    """DeepSpeed's pipeline engine for this rank's pipeline (built by `poplar_ext.initialize`), used as DeepSpeed's:
    ``loss = engine.train_batch(data_iter)``, or ``engine.train_batch()`` to read the dataloader
    `poplar_ext.initialize` returned. Differences: the loss is the global batch's mean; `train_batch_size()` is
    the plan's global batch; checkpoints hold one folder per pipeline and the data position."""

    plan_from_dict = staticmethod(pipeline_plan_from_dict)
    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        schedule.ForwardPass: _timed(PipelineEngine._exec_forward_pass),
        schedule.BackwardPass: _timed(_exec_backward_pass),
        schedule.OptimizerStep: _timed(_exec_optimizer_step, compute=False),
    }

    def __init__(
        self,
        *,
        poplar_job: PipelineJob,
        slowdown: ComputeSlowdown | None,
        rebalancer: Rebalancer | None = None,
        **deepspeed_arguments: Any,
    ):
        super().__init__(**deepspeed_arguments)
        plan = poplar_job.plan
        self._start_core(
            plan,
            rank=self.global_rank,
            poplar_config=poplar_job.poplar_config,
            slowdown=slowdown,
            rebalancer=rebalancer,
            on_cpu=lambda: self.device.type == "cpu",
            plan_reason=poplar_job.plan_reason,
        )
        self.poplar_job = poplar_job
        self.pipeline_index, self.stage_index = poplar_job.pipeline_index, poplar_job.stage_index
        self._loader: Any = None
        self._own_iterator = False
        self._job_tag: str | None = None
        self._iteration_tokens = 0
        # DeepSpeed's bookkeeping (samples/s, global_samples) reads the batch it was given: the
        # pipeline's; its batch checks ran in __init__, nothing later compares it.
        self._config.train_batch_size = plan.global_batch_size
        for timer in (self.tput_timer, self.batch_timer):
            timer.batch_size = plan.global_batch_size

    def allreduce_gradients(self, bucket_size: int = MEMORY_OPT_ALLREDUCE_SIZE) -> None:
        if self.is_gradient_accumulation_boundary():
            self._sum_across_pipelines()
        if self.zero_optimization_stage() == 0:
            # DeepSpeed's data-parallel group is this rank alone (PlanGrid): its reduction would flatten,
            # all-reduce over one rank, scale by 1 and copy back, ~9% of an iteration in the pipeline bench.
            return
        super().allreduce_gradients(bucket_size)  # ZeRO 1: the optimizer takes its gradients in here

    def _bf16_reduce_grads(self) -> None:
        # DeepSpeed's ReduceGrads calls this instead of allreduce_gradients where its BF16_Optimizer
        # holds the gradients (bf16 at ZeRO 0; ZeRO 1 with fp32 accumulation). DeepSpeed's own
        # reduction, over a data-parallel group of this rank alone, is left out as above.
        self._sum_across_pipelines()

    def _sum_across_pipelines(self) -> None:
        gradients = self._accumulated_gradients()
        self.module.layer_segments.sum_gradients(self.module, gradient_of=gradients.__getitem__)
        if self.poplar_config.loss_reduction == "token_mean":
            self._divide_by_iteration_tokens(gradients.values())
        if self.fp16_enabled() or self.bfloat16_enabled():
            agree_on_overflow(list(gradients.values()), device=self.device)

    def _accumulated_gradients(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """Each trainable parameter of this stage and the tensor holding its gradient summed over the iteration's
        micro-batches: the bf16 optimizer's own buffer (it keeps its gradients apart from ``.grad``), ZeRO's
        ``grad_accum`` where it accumulates in another dtype than the parameters', else ``.grad`` (zeros where
        none: a layer unused by this pipeline's forward still takes part in the sum)."""
        optimizer = self.optimizer
        holders: dict[torch.nn.Parameter, torch.Tensor] = {}
        if isinstance(optimizer, BF16_Optimizer):
            for i, group in enumerate(optimizer.bf16_groups):
                for j, parameter in enumerate(group):
                    holders[parameter] = optimizer.fp32_groups_gradients[i][j]
                    # Summed, every gradient counts in the norm and is clipped, had this pipeline none.
                    optimizer.fp32_groups_has_gradients[i][j] = True
        separate = getattr(optimizer, "use_grad_accum_attribute", False)  # DeepSpeed's ZeRO 1 optimizer
        for parameter in self.module.parameters():
            if not parameter.requires_grad or parameter in holders:
                continue
            if separate:
                if getattr(parameter, "grad_accum", None) is None:
                    parameter.grad_accum = torch.zeros_like(parameter, dtype=optimizer.gradient_accumulation_dtype)
                holders[parameter] = parameter.grad_accum
            else:
                holders[parameter] = grad_or_zeros(parameter)
        return holders

    def _unapplied_loss_scale(self) -> float | None:
        """The loss scale DeepSpeed's backward leaves out of the loss (`unapplied_loss_scale`)."""
        return unapplied_loss_scale(self)

    def _divide_by_iteration_tokens(self, gradients: Collection[torch.Tensor]) -> None:
        # token_mean: each micro-batch loss was weighted by s_p * n (WeightedLoss), so the summed
        # gradient is that of the global batch's token sum; the tokens T of the whole iteration
        # are known only now, every last stage having counted its own (collective: every rank).
        weighted = self.module.loss_fn
        counts = [weighted.tokens if self.is_last_stage() else 0, self._labels_refused()]
        weighted.tokens = 0
        summed = torch.tensor(counts, dtype=torch.int64, device=self.device)
        sum_in_group(summed)
        self._iteration_tokens, refusing = summed.tolist()
        self._refuse_labels("train_batch", refusing)
        if self._iteration_tokens < 1:
            raise ValueError(
                "loss_reduction token_mean: expected at least one label token in the iteration, found none"
            )
        for gradient in gradients:
            gradient.div_(self._iteration_tokens)

    def _labels_refused(self) -> int:
        """1 where this (last) stage found token_mean labels it could not count (logged here), else 0."""
        weighted = self.module.loss_fn
        reason, weighted.refused = weighted.refused, None
        if reason is None:
            return 0
        logger.error("rank %d (pipeline %d's last stage): %s", self.global_rank, self.pipeline_index, reason)
        return 1

    def _refuse_labels(self, call: str, refusing: int) -> None:
        # After an all-reduce: the same count, the same error on every rank.
        if refusing:
            raise ValueError(
                f"{call}: expected micro-batches (inputs, labels) with labels one tensor of token ids with "
                f"poplar.loss_reduction token_mean, found another type on the last stage of {refusing} of "
                f"{len(self.plan.pipelines)} pipelines (logged there): give labels as one tensor per micro-batch"
            )

    def clip_fp32_gradients(self) -> None:
        # DeepSpeed falls short here: its clip_grad_norm_ (runtime/utils.py) counts a gradient
        # only on model-parallel rank 0, which in a pipe grid is stage 0, so its ZeRO-0 norm
        # is stage 0's. After the sum across pipelines every pipeline holds the global
        # gradient: the norm over one pipeline's stages is the global norm.
        # A tied module's copies past this pipeline's first are marked replicated: counted once, clipped all.
        parameters = [p for p in self.module.parameters() if p.grad is not None]
        counted = [p.grad.detach() for p in parameters if not getattr(p, "ds_pipe_replicated", False)]
        # One pass per gradient in its own dtype, the norms' squares summed in float64: a float64 copy
        # of every gradient took ~7 ms of a 100 ms iteration in the pipeline bench.
        norms = torch.stack([torch.linalg.vector_norm(g).double() for g in counted]) if counted else None
        squares = torch.zeros((), dtype=torch.float64, device=self.device) if norms is None else norms.pow(2).sum()
        sum_in_group(squares, self.grid.get_pipe_parallel_group())
        # DeepSpeed's own ZeRO-0 fp32 clip drops the norm: get_global_grad_norm() would say None.
        self._global_grad_norm = float(squares.sqrt())
        coefficient = min(1.0, self.gradient_clipping() / (self._global_grad_norm + 1e-6))
        for parameter in parameters:
            parameter.grad.mul_(coefficient)

    def _checkpoint_tag_validation(self, tag: str) -> None:
        # DeepSpeed checks that every rank saves under one tag; each pipeline saves into its own
        # folder (pipeline<P>, DeepSpeed's tag), so the job's tag is what must agree.
        super()._checkpoint_tag_validation(self._job_tag or tag)

    def train_batch(self, data_iter: Any = None) -> torch.Tensor:
        """DeepSpeed's train_batch; returns the mean loss over the global batch, on every rank (collective), the
        value DeepSpeed's monitor gets too."""
        # token_mean: counted afresh (an iteration that raised may have left some)
        self.module.loss_fn.tokens, self.module.loss_fn.refused = 0, None
        reads_data = self.is_first_stage() or self.is_last_stage()
        self._fed_by_caller = self._fed_by_caller or data_iter is not None  # a switch cannot reach its data
        if data_iter is None and reads_data and self.data_iterator is None and self._loader is not None:
            self._own_iterator = True
            self.set_dataiterator(iter(RepeatingLoader(self._loader)))
        if data_iter is None and reads_data and self.data_iterator is None and self.batch_fn is None:
            # DeepSpeed would read None as the micro-batch and fail inside its schedule ("'NoneType' object
            # is not subscriptable"); only the stages that read data can tell, before any transfer.
            raise ValueError(
                f"train_batch: expected micro-batches to train on, found none on rank {self.global_rank} "
                f"(pipeline {self.pipeline_index}'s {'first' if self.is_first_stage() else 'last'} stage, which "
                "reads them): give poplar_ext.initialize training_data (train_batch() then reads its dataloader), "
                "or call train_batch(data_iter) or engine.set_dataiterator(data_iter)"
            )
        with self._monitor_event_held(TRAIN_LOSS_EVENT):  # it would get rank 0's pipeline's share
            share = super().train_batch(data_iter)
        # Each stage of pipeline p holds its share; each share counted once over all ranks.
        total = share.detach().double() / self.num_stages
        sum_in_group(total)
        if self.poplar_config.loss_reduction == "token_mean":
            total /= self._iteration_tokens  # the shares are token sums (WeightedLoss)
        self.agg_train_loss = total.to(share.dtype)
        self._write_monitor_event(TRAIN_LOSS_EVENT, self.agg_train_loss)
        self._end_of_iteration()
        return self.agg_train_loss

    def eval_batch(
        self,
        data_iter: Any,
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        """DeepSpeed's eval_batch (collective: every rank); with `compute_loss` and ``reduce_output="avg"``
        (its defaults) it returns the loss of the whole batch evaluated by every pipeline, on every rank
        (docs/pipeline.md, Evaluation), and DeepSpeed's monitor gets the same value."""
        weighted = self.module.loss_fn
        size = self.plan.pipelines[self.pipeline_index].micro_batch_size
        with weighted.evaluating(device=self.device, micro_batch_size=size) as totals:
            with self._monitor_event_held(EVAL_LOSS_EVENT):
                result = super().eval_batch(
                    data_iter,
                    return_logits=return_logits,
                    compute_loss=compute_loss,
                    reduce_output=reduce_output,
                    bcast_loss=bcast_loss,
                    num_micro_batches=num_micro_batches,
                )
        if not compute_loss or reduce_output is None:
            return result  # DeepSpeed's: the outputs, or each micro-batch's loss unweighted
        totals[2] = self._labels_refused()
        sum_in_group(totals)  # the other stages add zeros
        weighted_sum, count, refusing = totals.tolist()
        self._refuse_labels("eval_batch", int(refusing))
        if count <= 0:
            raise ValueError(
                "eval_batch: expected at least one label token in the evaluated batch (loss_reduction "
                "token_mean), found none: evaluate micro-batches with labels that are not all -100"
            )
        loss = torch.tensor(weighted_sum / count, dtype=torch.float32, device=self.device)
        self._write_monitor_event(EVAL_LOSS_EVENT, loss)
        return (loss, result[1]) if return_logits else loss

    @contextmanager
    def _monitor_event_held(self, name: str) -> Iterator[None]:
        # DeepSpeed writes `name` with one pipeline's value inside its train_batch and eval_batch;
        # the job's value is known only after, written by _write_monitor_event.
        monitor = self.monitor
        write = monitor.write_events
        monitor.write_events = lambda events: write([event for event in events if event[0] != name])
        try:
            yield
        finally:
            monitor.write_events = write

    def _write_monitor_event(self, name: str, value: torch.Tensor) -> None:
        # As DeepSpeed writes it: rank 0, the samples trained so far as the step.
        if self.global_rank == 0 and self.monitor.enabled:
            self.summary_events = [(name, float(value), self.global_samples)]
            self.monitor.write_events(self.summary_events)

    def _end_of_iteration(self) -> None:
        warn_if_step_skipped(self, step=self.global_steps, rank=self.global_rank)
        self._count_iteration(self.global_steps)
        iteration_s = self._iteration_time_s()  # with re-balancing's check: the logged steps are check steps
        interval = self.poplar_config.log_interval_steps
        if interval and self.global_rank == 0 and self.global_steps % interval == 0 and iteration_s is not None:
            logger.info(
                "poplar step %d: true global batch %d samples, %.2f samples/s, loss %.4f",
                self.global_steps,
                self.plan.global_batch_size,
                self.plan.global_batch_size / iteration_s,
                float(self.agg_train_loss),
            )

    @property
    def data_reached(self) -> int:
        """How far this pipeline's data has been handed out: no plan switch can start before it."""
        return max([self.data_position] + [s.generated_until for s in self._samplers])

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's batch-size setter, refused unless it keeps the plan's global batch (then a no-op): DeepSpeed's
        would make this pipeline's micro-batch count the new batch over its micro-batch (its data-parallel group is
        this rank alone) while the loss weights and the other pipelines stay the plan's."""
        refuse_leaving_plan(
            "set_train_batch_size",
            train_batch_size,
            self.plan.global_batch_size,
            planned_as="the plan's global batch",
            holds="each pipeline's micro-batch size and count are the plan's",
            instead="to train another global batch, save a checkpoint and resume it under a plan of that batch "
            "(poplar.global_batch_size)",
        )

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """DeepSpeed's micro-batch setter, refused unless it keeps this pipeline's micro-batch of the plan (then a
        no-op): see `set_train_batch_size`."""
        refuse_leaving_plan(
            "set_train_micro_batch_size",
            micro_batch_size,
            self.plan.pipelines[self.pipeline_index].micro_batch_size,
            planned_as="this pipeline's micro-batch in the plan",
            holds="each pipeline's micro-batch size and count are the plan's",
            instead="to change them, resume a checkpoint under another pipeline plan",
        )

    def switch_plan(self, plan: PipelinePlan, *, reason: str, record: bool = True) -> None:
        """Train `plan`'s micro-batch counts from the next iteration on (every rank at the same step; the
        samplers already know from where). `plan` keeps the pipelines, their stages and micro-batch sizes."""
        check_recount(self.plan, plan)
        pipeline = plan.pipelines[self.pipeline_index]
        # DeepSpeed's own setter, as for a batch-size schedule: the pipeline's accumulation count and
        # micro_batches (its schedule's length); then the true global batch again for its bookkeeping.
        PipelineEngine.set_train_batch_size(self, pipeline.samples_per_iteration)  # this engine's refuses it
        self._config.train_batch_size = plan.global_batch_size
        if hasattr(self.optimizer, "gradient_accumulation_steps"):  # ZeRO 1's optimizer keeps its own
            self.optimizer.gradient_accumulation_steps = pipeline.num_micro_batches
        self.module.loss_fn.weight = pipeline_loss_weight(
            micro_batch_size=pipeline.micro_batch_size,
            num_micro_batches=pipeline.num_micro_batches,
            global_batch_size=plan.global_batch_size,
            reduction=self.poplar_config.loss_reduction,
        )
        self.plan = plan
        self.poplar_job = self.module.poplar_job = dataclasses.replace(self.poplar_job, plan=plan)
        self.record_switch(plan, step=self.global_steps, reason=reason, record=record, rank=self.global_rank)

    def create_batch_sampler(self, num_samples: int) -> PlanBatchSampler:
        """This pipeline's batch sampler: its share of every iteration from the shared stream, the
        pipelines taking the places ranks take in a ZeRO job (`poplar_ext.runtime.data`)."""
        sampler = PlanBatchSampler.from_plan(
            self.plan,
            num_samples=num_samples,
            rank=self.pipeline_index,
            consumed_samples=self.data_position,
            **self.poplar_config.data_order,
        )
        self._add_sampler(sampler)
        return sampler

    def use_loader(self, loader: Any) -> None:
        """The loader `train_batch()` reads when it is given no iterator (repeated over epochs)."""
        self._loader = loader

    def _client_state_before_save(self) -> dict:
        """At ZeRO 0, each optimizer parameter's name and shape (DeepSpeed names them at ZeRO 1 only)."""
        if self.optimizer is not None and not self.zero_optimization():
            return {PARAMETER_SHAPES_KEY: optimizer_parameter_shapes(self)}
        return {}

    def _save_deepspeed(self, save_dir: str | Path, new_tag: str, client_state: dict, **kwargs: Any) -> Any:
        """DeepSpeed's save into ``save_dir/TAG/pipeline<P>`` (`EngineCore.save_checkpoint`)."""
        self._job_tag = new_tag
        try:
            return PipelineEngine.save_checkpoint(
                self,
                str(Path(save_dir) / new_tag),
                tag=pipeline_folder(self.pipeline_index),
                client_state=client_state,
                save_latest=False,
                **kwargs,
            )
        finally:
            self._job_tag = None

    @ends_job_on_user_error  # a refusal of the checkpoint: every restart would load it again
    def load_checkpoint(self, load_dir: str | Path, tag: Any = None, **kwargs: Any) -> tuple[Any, dict | None]:
        """DeepSpeed's load from ``load_dir/TAG/pipeline<P>``, continuing the data stream (collective).

        Rank 0 reads poplar-ext's state first; a checkpoint that cannot continue here (another data order or
        model, a ZeRO job's) stops every rank before anything is loaded. Under another split the layers move by
        index and the optimizer state by parameter. Returns DeepSpeed's ``(path, client_state)``; ``(None,
        None)`` when `load_dir` has no ``latest``.
        """
        self._refuse_unreadable_optimizer_state(kwargs)
        resolved = tag_for_load(load_dir, tag, deepspeed_engine=self, rank=self.global_rank)
        if resolved is None:
            logger.warning("load_checkpoint: no 'latest' file in %s, nothing loaded", load_dir)
            return None, None
        saved = decided_by_rank0(lambda: read_state(load_dir, resolved), rank=self.global_rank)
        where, current = str(Path(load_dir) / resolved), self._client_state()
        decision = pipeline_resume_decision(
            saved, current, path=where, load_module_only=bool(kwargs.get("load_module_only"))
        )
        if layers_move(saved["plan"], current["plan"]):
            path, client_state = self._load_moving_layers(where, saved["plan"], kwargs)
        else:
            path, client_state = super().load_checkpoint(where, tag=pipeline_folder(self.pipeline_index), **kwargs)
        if path is not None:
            refresh_master_weights(self.optimizer, kwargs)
            self._resume(decision)
        if client_state is not None:
            client_state.pop(PARAMETER_SHAPES_KEY, None)
        return path, client_state

    def _load_moving_layers(self, where: str, saved_plan: dict, kwargs: dict) -> tuple[Any, dict | None]:
        """Another split: every layer's weights from pipeline 0's folder (by layer index), the optimizer state
        per parameter, once every rank found it can (collective)."""
        carry = not kwargs.get("load_module_only") and kwargs.get("load_optimizer_states", True)
        if carry and not self.zero_optimization() and half_precision_master_copies(self.optimizer):
            # Its fp32 copies would need the per-parameter states loaded into them; not done (the same config,
            # the same refusal on every rank, before anything is read).
            raise ValueError(
                f"load_checkpoint: {where} was saved under another pipeline split; expected ZeRO stage 1 to move "
                "a bf16 or fp16 job's optimizer state between stages, found stage 0: resume under the checkpoint's "
                "plan, train at ZeRO 1, or load the weights alone (load_optimizer_states=False)"
            )
        if carry:
            self._check_parameter_states(where, saved_plan)
        path, client_state = super().load_checkpoint(
            where, tag=pipeline_folder(0), **{**kwargs, "load_optimizer_states": False}
        )
        if path is None:
            return path, client_state
        client_state.pop("optimizer", None)  # pipeline 0's stage's state_dict (ZeRO 0), not this stage's
        if not carry:
            return path, client_state
        folder = Path(where) / UNIVERSAL_FOLDER
        if self.zero_optimization():  # DeepSpeed's universal loader, then the weights from its fp32 copies
            self.optimizer.load_hp_checkpoint_state_from_checkpoint_dir("bit16_groups", str(folder))
            self.optimizer.update_lp_params()
        else:
            load_parameter_states(self.optimizer, folder, names=self.param_names)
        return path, client_state

    def _check_parameter_states(self, where: str, saved_plan: dict) -> None:
        """Rank 0 writes the checkpoint's optimizer state per parameter; every rank compares it with this job's
        parameters: the same ValueError on every rank, before anything is loaded (collective)."""
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # ZeRO 1's wraps the user's
        zero_stage, stages = saved_plan["zero_stage"], len(saved_plan["pipelines"][0]["stages"])
        try:
            saved = decided_by_rank0(
                lambda: convert_pipeline_checkpoint(
                    where, num_stages=stages, zero_stage=zero_stage, optimizer_name=type(optimizer).__name__
                ),
                rank=self.global_rank,
            )
        except ValueError as exc:
            raise ValueError(f"load_checkpoint: {where} was saved under another pipeline plan, and {exc}") from exc
        gathered = gather_objects((optimizer_parameter_shapes(self), (Path(where) / UNIVERSAL_FOLDER).is_dir()))
        every_rank: list[dict] = [{} for _ in range(max(len(shapes) for shapes, _ in gathered))]  # per group
        for shapes, _ in gathered:
            for into, group in zip(every_rank, shapes):
                into.update(group)
        differences = parameter_differences(saved, every_rank)
        if differences:
            more = f"; and {len(differences) - 5} more" if len(differences) > 5 else ""
            raise ValueError(
                f"load_checkpoint: {where} holds another model's optimizer state ({'; '.join(differences[:5])}{more}); "
                "expected this job's parameters, with their shapes: resume it with the model it was saved from"
            )
        missing = [rank for rank, (_, seen) in enumerate(gathered) if not seen]
        if missing:
            raise ValueError(
                f"load_checkpoint: {Path(where) / UNIVERSAL_FOLDER} (the checkpoint's optimizer state per parameter, "
                f"written by rank 0) is not visible on ranks {missing}: expected one checkpoint folder every rank "
                "reads; copy it to their nodes, then start again"
            )

    def _refuse_unreadable_optimizer_state(self, kwargs: dict) -> None:
        # DeepSpeed falls short here: without ZeRO it saves BF16_Optimizer's state (bf16 at ZeRO 0 in a
        # pipeline) whole, and loads it as a list of partitions (KeyError: 0 in _load_legacy_checkpoint).
        # The config is the same on every rank: every rank raises, before anything is read.
        reads_state = kwargs.get("load_optimizer_states", True) and not kwargs.get("load_module_only", False)
        if reads_state and optimizer_state_unloadable(self):
            raise ValueError(
                "load_checkpoint: expected ZeRO stage 1 to load a bf16 pipeline's optimizer state, found stage 0 "
                "(DeepSpeed 0.19.8 cannot read the state it saves there); train with zero_optimization.stage 1, "
                "which costs no memory in a pipeline, or load the weights alone (load_optimizer_states=False)"
            )

    def _resume(self, decision: ResumeDecision) -> None:
        self._restore_position(decision)
        if self._own_iterator:  # made at the old position: the next train_batch() makes a new one
            self.data_iterator, self._own_iterator = None, False
        self._continue_plans(decision)


__all__ = ["PoplarPipelineEngine"]
