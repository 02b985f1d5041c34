"""`PoplarEngine`: the DeepSpeed engine, training a plan's per-rank batches with exact gradients.

A thin proxy over the real ``DeepSpeedEngine`` (`poplar_ext.initialize` builds it):
its ``backward`` weights the loss (`poplar_ext.runtime.weighting`) so that gradients
are exactly those of the mean loss over the global batch; on an emulated device type
the forward..backward window is slowed (`poplar_ext.hardware.emulation`); at each
optimizer step it counts the samples consumed and logs the true global batch and
samples/s; its checkpoints carry the plan and the data position
(`poplar_ext.runtime.checkpoint`). Everything else is delegated (the emulated window
ends where DeepSpeed starts reducing gradients: see
`PoplarEngine._end_emulated_compute_before_reduction`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from poplar_ext.hardware.emulation import ComputeSlowdown
from poplar_ext.runtime.checkpoint import CLIENT_STATE_KEY, poplar_client_state, restored_consumed_samples
from poplar_ext.runtime.config import PoplarConfig
from poplar_ext.runtime.data import PlanBatchSampler
from poplar_ext.runtime.weighting import loss_weight, weight_loss
from search.formats import Plan

logger = logging.getLogger(__name__)


class PoplarEngine:
    """A DeepSpeedEngine that trains a plan's per-rank batches with exact gradients.

    Use it exactly like the engine ``deepspeed.initialize`` returns; every attribute
    not defined here is the DeepSpeed engine's. Differences:

    * `backward(loss)`: `loss` is this rank's micro-batch loss reduced as
      ``poplar.loss_reduction`` says (a mean by default); the wrapper weights it and
      calls DeepSpeed's backward with ``scale_wrt_gas=False``. Do not divide it by the
      accumulation count yourself.
    * `train_batch_size()`: the true global batch (the plan's), not DeepSpeed's
      per-rank nominal value. `train_micro_batch_size_per_gpu()` and
      `gradient_accumulation_steps()` are this rank's.
    * `save_checkpoint` / `load_checkpoint` also store and restore the plan and the
      data position; loading a checkpoint made with another plan raises ValueError.
    """

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
    ) -> None:
        self.deepspeed_engine = engine
        """The real DeepSpeedEngine."""
        self.plan = plan
        """The plan every rank runs."""
        self.rank_plan = plan.ranks[rank]
        """This rank's micro-batch size and accumulation count."""
        self.poplar_config = poplar_config
        self.device_label = device_label
        """This rank's device, saying whether it is real or emulated."""
        self.rank_device_labels = rank_device_labels
        """Every rank's device label, rank 0 first."""
        self.consumed_samples = 0
        """Samples (of all ranks) consumed by the optimizer steps so far: the data position."""
        self.last_iteration_time_s: float | None = None
        """Wall time of the last iteration (optimizer step to optimizer step) on this rank."""
        self.last_samples_per_s: float | None = None
        """True global samples per second of the last iteration."""
        self._rank = rank
        self._slowdown = slowdown
        self._samplers: list[PlanBatchSampler] = []
        self._last_boundary_time: float | None = None
        if slowdown is not None:
            self._end_emulated_compute_before_reduction()
        self._weight_direct_backward()

    def _weight_direct_backward(self) -> None:
        # DeepSpeed lets `loss.backward()` and `engine.scale(loss).backward()` run on the
        # engine's output (ZeRO stages 1-3; at stage 0 it refuses them itself): hooks on
        # the output divide its gradient by this rank's accumulation count, which with
        # uneven plans is not the global batch's mean. Its per-tensor hook is looked up
        # at every forward; ours keeps DeepSpeed's decision of whether to scale (not on
        # engine.backward's own graph) and applies the plan's weight instead.
        engine = self.deepspeed_engine
        divide_by_accumulation = getattr(engine, "_backward_prologue_per_tensor", None)
        if divide_by_accumulation is None:  # a DeepSpeed without torch-style backward
            return
        weight = loss_weight(
            world_size=self.plan.world_size,
            micro_batch_size=self.rank_plan.micro_batch_size,
            global_batch_size=self.plan.global_batch_size,
            reduction=self.poplar_config.loss_reduction,
        )

        def weight_instead_of_dividing(grad: Any) -> Any:
            scaled = divide_by_accumulation(grad)
            if scaled is grad:  # DeepSpeed leaves this gradient alone (engine.backward weighted it)
                return grad
            return (grad.float() * weight).to(grad.dtype)

        engine._backward_prologue_per_tensor = weight_instead_of_dividing

    def _end_emulated_compute_before_reduction(self) -> None:
        # DeepSpeed's backward ends by calling allreduce_gradients (the boundary
        # all-reduce at stages 0/1, the reduction epilogue at stage 2). A slow device
        # finishes its compute before it communicates, so the emulated window ends (and
        # its sleep happens) there: sleeping after the reduction would add this rank's
        # sleep on top of its wait for the others, and count gloo's CPU time as compute.
        engine = self.deepspeed_engine
        reduce = engine.allreduce_gradients

        def allreduce_after_emulated_compute(*args: Any, **kwargs: Any) -> Any:
            if self._slowdown is not None:
                self._slowdown.stop()
            return reduce(*args, **kwargs)

        engine.allreduce_gradients = allreduce_after_emulated_compute

    @property
    def emulated_compute(self) -> ComputeSlowdown | None:
        """This rank's emulated slowdown (None on a real device).

        Its window runs from forward to the gradient reduction (and over the optimizer
        step at a boundary); `emulated_compute.stop()` ends it early, e.g. to time a
        collective without the emulated sleep in it.
        """
        return self._slowdown

    # -- delegation --------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # Only called for names not found on the proxy itself.
        engine = self.__dict__.get("deepspeed_engine")
        if engine is None:
            raise AttributeError(name)
        return getattr(engine, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._slowdown is not None:
            self._slowdown.start()
        return self.deepspeed_engine(*args, **kwargs)

    forward = __call__

    # -- the training step -------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> Any:
        """DeepSpeed's backward of the weighted `loss` (see the class docstring)."""
        if "scale_wrt_gas" in kwargs:
            raise ValueError(
                "backward: scale_wrt_gas is set by poplar_ext (the loss weight replaces DeepSpeed's "
                "division by the accumulation count); pass the plain micro-batch loss"
            )
        if self._slowdown is not None:
            self._slowdown.start()  # for a forward that did not go through the engine
        weighted = weight_loss(
            loss,
            world_size=self.plan.world_size,
            micro_batch_size=self.rank_plan.micro_batch_size,
            global_batch_size=self.plan.global_batch_size,
            reduction=self.poplar_config.loss_reduction,
        )
        result = self.deepspeed_engine.backward(weighted, scale_wrt_gas=False, **kwargs)
        if self._slowdown is not None:
            self._slowdown.stop()  # a no-op unless no reduction ended the window (no_sync)
        return result

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """DeepSpeed's step; at an accumulation boundary also counts and logs the iteration."""
        boundary = self.deepspeed_engine.is_gradient_accumulation_boundary()
        # The optimizer step is compute too: an emulated device runs it slower, as the
        # profiler measures it (its optimizer_step_time_s).
        emulate = boundary and self._slowdown is not None
        if emulate:
            self._slowdown.start()
        try:
            result = self.deepspeed_engine.step(*args, **kwargs)
        finally:
            if emulate:
                self._slowdown.stop()
        if boundary:
            self._end_of_iteration()
        return result

    def _end_of_iteration(self) -> None:
        self.consumed_samples += self.plan.global_batch_size
        now = time.perf_counter()
        if self._last_boundary_time is not None:
            self.last_iteration_time_s = now - self._last_boundary_time
            self.last_samples_per_s = self.plan.global_batch_size / self.last_iteration_time_s
        self._last_boundary_time = now
        interval = self.poplar_config.log_interval_steps
        step = self.deepspeed_engine.global_steps
        if interval and self._rank == 0 and step % interval == 0 and self.last_samples_per_s is not None:
            logger.info(
                "poplar step %d: true global batch %d samples, %.2f samples/s, %.4f s/iteration "
                "(rank 0: %s, micro-batch %d x %d)",
                step,
                self.plan.global_batch_size,
                self.last_samples_per_s,
                self.last_iteration_time_s,
                self.device_label,
                self.rank_plan.micro_batch_size,
                self.rank_plan.gradient_accumulation_steps,
            )

    def train_batch_size(self) -> int:
        """The true global batch: the plan's, the same on every rank."""
        return self.plan.global_batch_size

    # -- data --------------------------------------------------------------------
    def create_batch_sampler(self, num_samples: int, *, iterations_per_pass: int | None = None) -> PlanBatchSampler:
        """This rank's batch sampler for a DataLoader of your own
        (``DataLoader(dataset, batch_sampler=engine.create_batch_sampler(len(dataset)))``).

        It starts at the engine's data position and follows it on `load_checkpoint`.
        """
        sampler = PlanBatchSampler.from_plan(
            self.plan,
            rank=self._rank,
            num_samples=num_samples,
            seed=self.poplar_config.seed,
            shuffle=self.poplar_config.shuffle,
            consumed_samples=self.consumed_samples,
            iterations_per_pass=iterations_per_pass,
            drop_last=self.poplar_config.drop_last,
        )
        self._samplers.append(sampler)
        return sampler

    # -- checkpoints -------------------------------------------------------------
    def _client_state(self) -> dict:
        return poplar_client_state(
            self.plan,
            consumed_samples=self.consumed_samples,
            seed=self.poplar_config.seed,
            shuffle=self.poplar_config.shuffle,
            drop_last=self.poplar_config.drop_last,
        )

    def save_checkpoint(self, save_dir: str | Path, tag: Any = None, client_state: dict | None = None, **kwargs: Any) -> Any:
        """DeepSpeed's save_checkpoint, with the plan and the data position in client_state."""
        state = dict(client_state or {})
        state[CLIENT_STATE_KEY] = self._client_state()
        return self.deepspeed_engine.save_checkpoint(save_dir, tag=tag, client_state=state, **kwargs)

    def load_checkpoint(self, load_dir: str | Path, tag: Any = None, **kwargs: Any) -> tuple[Any, dict | None]:
        """DeepSpeed's load_checkpoint; restores the data position, refuses another plan.

        Returns DeepSpeed's ``(path, client_state)`` without poplar-ext's own entry.
        """
        path, client_state = self.deepspeed_engine.load_checkpoint(load_dir, tag=tag, **kwargs)
        if path is None:
            return path, client_state
        self.consumed_samples, client_state = restored_consumed_samples(path, client_state, self._client_state())
        for sampler in self._samplers:
            sampler.set_position(self.consumed_samples)
        return path, client_state


__all__ = ["CLIENT_STATE_KEY", "PoplarEngine"]
