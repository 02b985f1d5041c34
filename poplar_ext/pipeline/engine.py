"""`PoplarPipelineEngine`: DeepSpeed's PipelineEngine for one pipeline of a plan, exact over all of them.

DeepSpeed sees each pipeline as a whole job of data-parallel size 1 (`PlanGrid`); this
subclass adds what crosses pipelines, at the smallest seams DeepSpeed offers:

* `allreduce_gradients`, which ``_exec_reduce_grads`` calls by name at the schedule's
  ``ReduceGrads`` instruction (runtime/pipe/engine.py), first sums each layer's gradient
  over the pipelines holding it (`LayerSegments`), then runs DeepSpeed's own over the
  one-rank group (nothing to add at ZeRO 0; ZeRO 1's hand-over to its optimizer). With
  each micro-batch loss weighted by ``s_p * b_p / B`` (`PoplarPipelineModule`) the
  optimizer sees the gradient of the mean loss over the global batch. With ``token_mean``
  the weight is ``s_p * n`` and the sum is divided here by the iteration's label tokens,
  counted by every pipeline's last stage. A tied module's gradient is summed too (over
  every stage of every pipeline using it); ``ReduceTiedGrads`` finds no DeepSpeed groups.
  In bf16 DeepSpeed's optimizer keeps the gradients apart (``_bf16_reduce_grads`` replaces
  ``allreduce_gradients`` there): the sum is made on whatever tensor holds each parameter's
  accumulated gradient (`_accumulated_gradients`). In fp16 and bf16 the ranks then agree
  whether any gradient overflowed (`agree_on_overflow`), so that every pipeline skips the
  step, and keeps one loss scale, when any does.
* the backward instruction of the last stage multiplies the loss by the loss scale where
  DeepSpeed's backward leaves it out (fp16 at ZeRO 0, `_unapplied_loss_scale`).
* `clip_fp32_gradients` (called by ``_take_model_step`` at ZeRO 0, fp32): DeepSpeed's
  takes the norm of stage 0's gradients only; here, of the whole pipeline's (a tied
  module counted once).
* ``_INSTRUCTION_MAP``: the forward, backward and optimizer-step instructions of an
  emulated device type run slowed down (`poplar_ext.hardware.emulation`), as the ZeRO
  path's forward..backward window and step. ``_exec_forward_pass`` and the others
  cannot be overridden by name: DeepSpeed's map holds its own function objects.
* `train_batch` returns the global batch's mean loss on every rank (DeepSpeed's is the
  pipeline's share, its data-parallel average being over one pipeline) and counts the
  samples; `save_checkpoint` / `load_checkpoint` keep one folder per pipeline and
  poplar-ext's state (`poplar_ext.pipeline.checkpoint`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.dataloader import RepeatingLoader
from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from poplar_ext.collectives import agree_sum, decided_by_rank0, sum_in_group
from poplar_ext.hardware.emulation import ComputeSlowdown, scheduled_slowdown
from poplar_ext.pipeline.checkpoint import pipeline_folder, pipeline_resume_decision
from poplar_ext.pipeline.job import PipelineJob
from poplar_ext.runtime.checkpoint import (
    ResumeDecision,
    checkpoint_tag,
    history_entry,
    poplar_client_state,
    read_state,
    write_latest_when_saved,
    write_state,
)
from poplar_ext.runtime.data import PlanBatchSampler

logger = logging.getLogger(__name__)


def _emulated(instruction: Callable[..., Any]) -> Callable[..., Any]:
    """`instruction` run inside this rank's emulated compute window (a real device: as it is)."""

    def run(engine: PoplarPipelineEngine, **kwargs: Any) -> Any:
        slowdown = engine.emulated_compute
        if slowdown is None:
            return instruction(engine, **kwargs)
        slowdown.start(instruction.__name__)  # each instruction a kind of block, steady on its own
        try:
            return instruction(engine, **kwargs)
        finally:
            slowdown.stop()

    return run


def _exec_backward_pass(engine: PoplarPipelineEngine, **kwargs: Any) -> Any:
    """DeepSpeed's backward instruction; on the last stage, the loss times the loss scale where DeepSpeed's
    backward leaves it out (`PoplarPipelineEngine._unapplied_loss_scale`), as FP16_Optimizer.backward scales it:
    in fp32. Earlier stages receive gradients scaled already."""
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

    Where another rank's do and this rank's do not, this rank's are set to NaN: DeepSpeed's own check
    then skips the step here too (fp16: and lowers the loss scale), on every rank alike. The sum across
    pipelines spreads a non-finite gradient to every copy of its layer already; this holds where the
    copies' sums would differ. `agree`: `poplar_ext.collectives.agree_sum` (the sum of an int over all ranks).
    """
    local = any(not bool(torch.isfinite(gradient).all()) for gradient in gradients)
    overflow = agree(int(local), device) > 0
    if overflow and not local:
        for gradient in gradients:
            gradient.fill_(float("nan"))
    return overflow


class PoplarPipelineEngine(PipelineEngine):
    """DeepSpeed's pipeline engine for this rank's pipeline (built by `poplar_ext.initialize`).

    Use it as DeepSpeed's: ``loss = engine.train_batch(data_iter)``, or
    ``engine.train_batch()`` to read the dataloader `poplar_ext.initialize` returned.
    Differences: the returned loss is the global batch's mean; `train_batch_size()` is
    the plan's global batch; checkpoints hold one folder per pipeline and the data position.
    """

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        schedule.ForwardPass: _emulated(PipelineEngine._exec_forward_pass),
        schedule.BackwardPass: _emulated(_exec_backward_pass),
        schedule.OptimizerStep: _emulated(PipelineEngine._exec_optimizer_step),
    }

    def __init__(self, *, poplar_job: PipelineJob, slowdown: ComputeSlowdown | None, **deepspeed_arguments: Any):
        super().__init__(**deepspeed_arguments)
        plan = poplar_job.plan
        self.poplar_job = poplar_job
        self.plan = plan
        """The pipeline plan every rank runs."""
        self.pipeline_index, self.stage_index = poplar_job.pipeline_index, poplar_job.stage_index
        self.consumed_samples = 0
        """Samples (of all pipelines) trained by the optimizer steps so far."""
        self.plan_history: list[dict] = [
            history_entry(plan, start_step=0, data_position=0, reason=poplar_job.plan_reason)
        ]
        self._slowdown = slowdown
        self._restored_position = 0
        self._steps_since_restore = 0
        self._samplers: list[PlanBatchSampler] = []
        self._loader: Any = None
        self._own_iterator = False
        self._job_tag: str | None = None
        self._last_boundary_time: float | None = None
        self._iteration_tokens = 0
        # DeepSpeed's bookkeeping (samples/s, global_samples) reads the batch it was given: the
        # pipeline's; its batch checks ran in __init__, nothing later compares it.
        self._config.train_batch_size = plan.global_batch_size
        for timer in (self.tput_timer, self.batch_timer):
            timer.batch_size = plan.global_batch_size

    @property
    def emulated_compute(self) -> ComputeSlowdown | None:
        """This rank's emulated slowdown (None on a real device)."""
        return self._slowdown

    # -- across pipelines ----------------------------------------------------------
    def allreduce_gradients(self, bucket_size: int = MEMORY_OPT_ALLREDUCE_SIZE) -> None:
        if self.is_gradient_accumulation_boundary():
            self._sum_across_pipelines()
        super().allreduce_gradients(bucket_size)

    def _bf16_reduce_grads(self) -> None:
        # DeepSpeed's ReduceGrads calls this instead of allreduce_gradients where its BF16_Optimizer
        # holds the gradients (bf16 at ZeRO 0; ZeRO 1 with fp32 accumulation).
        self._sum_across_pipelines()
        super()._bf16_reduce_grads()

    def _sum_across_pipelines(self) -> None:
        gradients = self._accumulated_gradients()
        self.module.layer_segments.sum_gradients(self.module, gradient_of=gradients.__getitem__)
        if self.poplar_job.poplar_config.loss_reduction == "token_mean":
            self._divide_by_iteration_tokens(gradients.values())
        if self.fp16_enabled() or self.bfloat16_enabled():
            agree_on_overflow(list(gradients.values()), device=self.device)

    def _accumulated_gradients(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """Each trainable parameter of this stage and the tensor holding its gradient summed over the
        iteration's micro-batches: the bf16 optimizer's own buffer, ZeRO's ``grad_accum`` where it
        accumulates in another dtype than the parameters', else ``.grad`` (zeros where there is none: a
        layer unused by this pipeline's forward still takes part in the sum)."""
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
                if parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
                holders[parameter] = parameter.grad
        return holders

    def _unapplied_loss_scale(self) -> float | None:
        """The loss scale DeepSpeed's backward leaves out of the loss (None where it applies it, or where none is used).

        DeepSpeed falls short here: its backward multiplies the loss by the loss scale for its ZeRO
        optimizers only (runtime/engine.py ``backward``; deepspeedai/DeepSpeed#8393, open), while the
        steps of FP16_Optimizer and FP16_UnfusedOptimizer (fp16 at ZeRO 0) divide the gradients by it."""
        config = getattr(self.optimizer, "loss_scale_config", None)
        if not self.fp16_enabled() or isinstance(self.optimizer, ZeROOptimizer) or config is None:
            return None
        return config.cur_scale if config.use_grad_scaling else None

    def _divide_by_iteration_tokens(self, gradients: Collection[torch.Tensor]) -> None:
        # token_mean: each micro-batch loss was weighted by s_p * n (WeightedLoss), so the summed
        # gradient is that of the global batch's token sum; the tokens T of the whole iteration
        # are known only now, every last stage having counted its own (collective: every rank).
        weighted = self.module.loss_fn
        tokens = torch.tensor(weighted.tokens if self.is_last_stage() else 0, dtype=torch.int64, device=self.device)
        weighted.tokens = 0
        sum_in_group(tokens)
        self._iteration_tokens = int(tokens.item())
        if self._iteration_tokens < 1:
            raise ValueError(
                "loss_reduction token_mean: expected at least one label token in the iteration, found none"
            )
        for gradient in gradients:
            gradient.div_(self._iteration_tokens)

    def clip_fp32_gradients(self) -> None:
        # DeepSpeed falls short here: its clip_grad_norm_ (runtime/utils.py) counts a gradient
        # only on model-parallel rank 0, which in a pipe grid is stage 0, so its ZeRO-0 norm
        # is stage 0's. After the sum across pipelines every pipeline holds the global
        # gradient: the norm over one pipeline's stages is the global norm.
        # A tied module's copies past this pipeline's first are marked replicated: counted once, clipped all.
        parameters = [p for p in self.module.parameters() if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for parameter in parameters:
            if not getattr(parameter, "ds_pipe_replicated", False):
                squares += parameter.grad.detach().double().pow(2).sum()
        sum_in_group(squares, self.grid.get_pipe_parallel_group())
        coefficient = min(1.0, self.gradient_clipping() / (float(squares.sqrt()) + 1e-6))
        for parameter in parameters:
            parameter.grad.mul_(coefficient)

    def _checkpoint_tag_validation(self, tag: str) -> None:
        # DeepSpeed checks that every rank saves under one tag; each pipeline saves into its own
        # folder (pipeline<P>, DeepSpeed's tag), so the job's tag is what must agree.
        super()._checkpoint_tag_validation(self._job_tag or tag)

    # -- training ------------------------------------------------------------------
    def train_batch(self, data_iter: Any = None) -> torch.Tensor:
        """DeepSpeed's train_batch; returns the mean loss over the global batch, on every rank (collective)."""
        self.module.loss_fn.tokens = 0  # token_mean: counted afresh (an evaluation may have counted some)
        reads_data = self.is_first_stage() or self.is_last_stage()
        if data_iter is None and reads_data and self.data_iterator is None and self._loader is not None:
            self._own_iterator = True
            self.set_dataiterator(iter(RepeatingLoader(self._loader)))
        share = super().train_batch(data_iter)
        # Each stage of pipeline p holds its share; each share counted once over all ranks.
        total = share.detach().double() / self.num_stages
        sum_in_group(total)
        if self.poplar_job.poplar_config.loss_reduction == "token_mean":
            total /= self._iteration_tokens  # the shares are token sums (WeightedLoss)
        self.agg_train_loss = total.to(share.dtype)
        self._end_of_iteration()
        return self.agg_train_loss

    def _end_of_iteration(self) -> None:
        self.consumed_samples += self.plan.global_batch_size
        self._steps_since_restore += 1
        if self._slowdown is not None and self._slowdown.emulation is not None:
            self._slowdown.slowdown = scheduled_slowdown(
                self._slowdown.emulation, optimizer_step=self.global_steps, rank=self.global_rank
            )
        now = time.perf_counter()
        previous, self._last_boundary_time = self._last_boundary_time, now
        interval = self.poplar_job.poplar_config.log_interval_steps
        if interval and self.global_rank == 0 and self.global_steps % interval == 0 and previous is not None:
            logger.info(
                "poplar step %d: true global batch %d samples, %.2f samples/s, loss %.4f",
                self.global_steps,
                self.plan.global_batch_size,
                self.plan.global_batch_size / (now - previous),
                float(self.agg_train_loss),
            )

    # -- data ----------------------------------------------------------------------
    def create_batch_sampler(self, num_samples: int) -> PlanBatchSampler:
        """This pipeline's batch sampler: its share of every iteration from the shared stream, the
        pipelines taking the places ranks take in a ZeRO job (`poplar_ext.runtime.data`)."""
        config = self.poplar_job.poplar_config
        sampler = PlanBatchSampler(
            num_samples=num_samples,
            micro_batch_sizes=[p.micro_batch_size for p in self.plan.pipelines],
            gradient_accumulation_steps=[p.num_micro_batches for p in self.plan.pipelines],
            rank=self.pipeline_index,
            seed=config.seed,
            shuffle=config.shuffle,
            consumed_samples=self.data_position,
            drop_last=config.drop_last,
        )
        self._samplers.append(sampler)
        return sampler

    def use_loader(self, loader: Any) -> None:
        """The loader `train_batch()` reads when it is given no iterator (repeated over epochs)."""
        self._loader = loader

    @property
    def data_position(self) -> int:
        """Stream position where the next iteration starts (see `poplar_ext.runtime.data`)."""
        return self._restored_position + self._steps_since_restore * self.plan.global_batch_size

    # -- checkpoints ---------------------------------------------------------------
    def _client_state(self) -> dict:
        config = self.poplar_job.poplar_config
        state = poplar_client_state(
            self.plan,
            consumed_samples=self.consumed_samples,
            data_position=self.data_position,
            seed=config.seed,
            shuffle=config.shuffle,
            drop_last=config.drop_last,
            plan_history=self.plan_history,
        )
        state["step"] = self.global_steps
        return state

    def save_checkpoint(
        self,
        save_dir: str | Path,
        tag: Any = None,
        client_state: dict | None = None,
        save_latest: bool = True,
        **kwargs,
    ) -> Any:
        """DeepSpeed's save, into ``save_dir/TAG/pipeline<P>``, with poplar-ext's state in ``save_dir/TAG``;
        ``latest`` names TAG once every rank has written its part (collective)."""
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"  # DeepSpeed's default
        if self.global_rank == 0:
            write_state(save_dir, tag, self._client_state())
        self._job_tag = tag
        try:
            saved = super().save_checkpoint(
                str(Path(save_dir) / tag),
                tag=pipeline_folder(self.pipeline_index),
                client_state=dict(client_state or {}),
                save_latest=False,
                **kwargs,
            )
        finally:
            self._job_tag = None
        if save_latest:
            write_latest_when_saved(save_dir, tag, rank=self.global_rank)
        return saved

    def load_checkpoint(self, load_dir: str | Path, tag: Any = None, **kwargs: Any) -> tuple[Any, dict | None]:
        """DeepSpeed's load from ``load_dir/TAG/pipeline<P>``, continuing the data stream (collective).

        Rank 0 reads poplar-ext's state first; a checkpoint of another plan (or data order,
        or a ZeRO job) stops every rank before anything is loaded. Returns DeepSpeed's
        ``(path, client_state)``; ``(None, None)`` when `load_dir` has no ``latest``.
        """
        self._refuse_unreadable_optimizer_state(kwargs)
        resolved = decided_by_rank0(lambda: checkpoint_tag(load_dir, tag), rank=self.global_rank)
        if resolved is None:
            logger.warning("load_checkpoint: no 'latest' file in %s, nothing loaded", load_dir)
            return None, None
        saved = decided_by_rank0(lambda: read_state(load_dir, resolved), rank=self.global_rank)
        where = str(Path(load_dir) / resolved)
        decision = pipeline_resume_decision(
            saved, self._client_state(), path=where, load_module_only=bool(kwargs.get("load_module_only"))
        )
        path, client_state = super().load_checkpoint(where, tag=pipeline_folder(self.pipeline_index), **kwargs)
        if path is not None:
            self._resume(decision)
        return path, client_state

    def _refuse_unreadable_optimizer_state(self, kwargs: dict) -> None:
        # DeepSpeed falls short here: without ZeRO it saves BF16_Optimizer's state (bf16 at ZeRO 0 in a
        # pipeline) whole, and loads it as a list of partitions (KeyError: 0 in _load_legacy_checkpoint).
        # The config is the same on every rank: every rank raises, before anything is read.
        reads_state = kwargs.get("load_optimizer_states", True) and not kwargs.get("load_module_only", False)
        if reads_state and isinstance(self.optimizer, BF16_Optimizer) and not self.zero_optimization():
            raise ValueError(
                "load_checkpoint: expected ZeRO stage 1 to load a bf16 pipeline's optimizer state, found stage 0 "
                "(DeepSpeed 0.19.8 cannot read the state it saves there); train with zero_optimization.stage 1, "
                "which costs no memory in a pipeline, or load the weights alone (load_optimizer_states=False)"
            )

    def _resume(self, decision: ResumeDecision) -> None:
        self.consumed_samples = decision.consumed_samples
        self._restored_position, self._steps_since_restore = decision.data_position, 0
        for sampler in self._samplers:
            sampler.set_position(decision.data_position)
        if self._own_iterator:  # made at the old position: the next train_batch() makes a new one
            self.data_iterator, self._own_iterator = None, False
        self.plan_history = decision.plan_history or self.plan_history
        if self.global_rank == 0:
            for note in decision.notes:
                logger.info("load_checkpoint: %s", note)


__all__ = ["PoplarPipelineEngine"]
