"""`poplar_ext.initialize`: DeepSpeed's initialize, with a plan's per-rank batches.

What a user changes in an ordinary DeepSpeed script: ``deepspeed.initialize`` becomes
``poplar_ext.initialize`` (same arguments, same four return values) and the DeepSpeed
config gets a top-level ``poplar`` section (see `poplar_ext.config`). The loop stays
``loss = engine(batch); engine.backward(loss); engine.step()``.

What happens underneath, on every rank:

1. The plan is resolved and checked before any collective (`poplar_ext.planning`).
2. DeepSpeed gets a valid nominal config with this rank's micro-batch size b_r and
   accumulation count s_r (``train_batch_size = b_r * s_r * W``); DeepSpeed never
   compares configs across ranks.
3. The returned engine is a thin proxy (`PoplarEngine`) over the real
   ``DeepSpeedEngine``: its ``backward`` weights the loss (`poplar_ext.weighting`) so
   that gradients are exactly those of the mean loss over the global batch; on an
   emulated device type the forward..backward window is slowed
   (`poplar_ext.emulation`); at each optimizer step it counts the samples consumed and
   logs the true global batch and samples/s. Everything else is delegated (the
   emulated window ends where DeepSpeed starts reducing gradients: see
   `PoplarEngine._end_emulated_compute_before_reduction`).
4. The training dataloader (when ``training_data`` is given) yields this rank's
   micro-batches from the shared data stream (`poplar_ext.data`).

An emulated memory capacity is not measured during training (a peak check on one rank
would need all ranks to agree before any could stop): it is enforced through the plan,
whose micro-batches `search.check_plan` holds to the profiles' largest, and the
profiler measured those against the emulated capacity.
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any

import torch

from search.formats import Plan, load_cluster, plan_to_dict
from poplar_ext.config import (
    SECTION,
    PoplarConfig,
    requested_zero_stage,
    load_deepspeed_config,
    nominal_deepspeed_config,
    poplar_config_from_dict,
)
from poplar_ext.data import PlanBatchSampler
from poplar_ext.dist import broadcast_from_rank0, rank_info_from_env
from poplar_ext.emulation import ComputeSlowdown, device_label, emulation_for_rank, limit_cpu_threads
from poplar_ext.planning import resolve_plan
from poplar_ext.weighting import weight_loss

CLIENT_STATE_KEY = "poplar"
"""Where poplar-ext keeps its state in a DeepSpeed checkpoint's client_state."""

logger = logging.getLogger("poplar_ext")


def _allocation(plan_dict: dict) -> dict:
    """The part of a plan that decides which samples each rank sees and how gradients add."""
    return {
        "zero_stage": plan_dict["zero_stage"],
        "global_batch_size": plan_dict["global_batch_size"],
        "ranks": [(r["micro_batch_size"], r["gradient_accumulation_steps"]) for r in plan_dict["ranks"]],
    }


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
        )
        self._samplers.append(sampler)
        return sampler

    # -- checkpoints -------------------------------------------------------------
    def _client_state(self) -> dict:
        return {
            "plan": plan_to_dict(self.plan),
            "consumed_samples": self.consumed_samples,
            "seed": self.poplar_config.seed,
            "shuffle": self.poplar_config.shuffle,
        }

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
        client_state = dict(client_state or {})
        saved = client_state.pop(CLIENT_STATE_KEY, None)
        if saved is None:
            raise ValueError(
                f"load_checkpoint: {path} was not saved by poplar_ext (its client_state has no "
                f"'{CLIENT_STATE_KEY}' entry), so its data position and plan are unknown"
            )
        current = self._client_state()
        if _allocation(saved["plan"]) != _allocation(current["plan"]):
            raise ValueError(
                f"load_checkpoint: {path} was saved with the plan {_allocation(saved['plan'])} but this job runs "
                f"{_allocation(current['plan'])}; resume with the checkpoint's plan (its samples and gradients differ otherwise)"
            )
        if (saved["seed"], saved["shuffle"]) != (current["seed"], current["shuffle"]):
            raise ValueError(
                f"load_checkpoint: {path} was saved with poplar.seed {saved['seed']} and shuffle {saved['shuffle']}, "
                f"this job has {current['seed']} and {current['shuffle']}; the data order would differ"
            )
        self.consumed_samples = saved["consumed_samples"]
        for sampler in self._samplers:
            sampler.set_position(self.consumed_samples)
        return path, client_state


def _ensure_log_handler() -> None:
    # A library logger without a handler shows only warnings; training logs are info.
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s] [poplar_ext] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _on_cpu() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: torch.utils.data.Dataset | None = None,
    lr_scheduler: Any = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: dict | str | None = None,
    mesh_param: Any = None,
    config_params: dict | str | None = None,
) -> tuple[PoplarEngine, Any, torch.utils.data.DataLoader | None, Any]:
    """``deepspeed.initialize`` with the plan of the config's ``poplar`` section.

    Same arguments and return values: ``(engine, optimizer, training_dataloader,
    lr_scheduler)``. The engine is a `PoplarEngine`; the dataloader (None without
    `training_data`) yields this rank's micro-batches. Raises ValueError, on every
    rank alike and before any collective, for a bad config or a plan that cannot run.
    """
    import deepspeed

    ds_config, base_dir = load_deepspeed_config(config, config_params=config_params, args=args)
    if SECTION not in ds_config:
        raise ValueError(
            f"DeepSpeed config: expected a top-level '{SECTION}' section (with 'cluster' and 'plan' or 'profiles'), "
            "found none; use deepspeed.initialize for a run without one"
        )
    poplar_config = poplar_config_from_dict(ds_config[SECTION], base_dir=base_dir)
    _ensure_log_handler()
    info = rank_info_from_env()
    cluster = load_cluster(poplar_config.cluster)
    model_fingerprint = None
    if poplar_config.profiles is not None and model is not None:
        from poplar_ext.fingerprint import model_fingerprint as fingerprint_of

        model_fingerprint = fingerprint_of(model)
    measure_missing = None
    if model is not None and training_data is not None and poplar_config.plan is None:
        # Fully automatic mode: missing profiles are measured with this model and data.
        from poplar_ext.profiler_auto import missing_profiles_measurer

        measure_missing = missing_profiles_measurer(
            model=model, training_data=training_data, collate_fn=collate_fn, optimizer=optimizer,
            ds_config=ds_config, profiles_dir=poplar_config.profiles,
            micro_batch_size_limit=poplar_config.global_batch_size or ds_config.get("train_batch_size")
            or poplar_config.max_global_batch_size,
        )
    plan = resolve_plan(
        poplar_config,
        cluster,
        world_size=info.world_size,
        rank=info.rank,
        zero_stage=requested_zero_stage(poplar_config, ds_config),
        global_batch_size=ds_config.get("train_batch_size"),
        model_fingerprint=model_fingerprint,
        broadcast=broadcast_from_rank0,
        measure_missing=measure_missing,
    )
    nominal = nominal_deepspeed_config(ds_config, plan, info.rank)
    emulation = emulation_for_rank(cluster, info.rank)
    on_cpu = _on_cpu()
    if on_cpu:
        limit_cpu_threads()
        # The allocator the profiler timed the micro-steps under: without it glibc
        # returns activation memory after every step and faulting it back in costs
        # CPU time that the profiles (and so the plan's predictions) do not contain.
        from poplar_ext.memory import steady_cpu_allocator

        steady_cpu_allocator()
    labels = tuple(device_label(t, cluster.emulation_of(t)) for t in cluster.rank_device_types)
    label = labels[info.rank]
    rank_plan = plan.ranks[info.rank]
    logger.info(
        "rank %d: %s, micro-batch %d x %d accumulation steps; true global batch %d, ZeRO stage %d",
        info.rank, label, rank_plan.micro_batch_size, rank_plan.gradient_accumulation_steps,
        plan.global_batch_size, plan.zero_stage,
    )
    # DeepSpeed refuses a config both in args and in config=: it gets the nominal one only.
    ds_args = None
    if args is not None:
        ds_args = copy.copy(args)
        if hasattr(ds_args, "deepspeed_config"):
            ds_args.deepspeed_config = None
    extra = {} if distributed_port is None else {"distributed_port": distributed_port}
    engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
        args=ds_args,
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler,
        mpu=mpu,
        dist_init_required=dist_init_required,
        config=nominal,
        mesh_param=mesh_param,
        **extra,
    )
    # DeepSpeed's own bookkeeping (samples/s lines, global_samples for monitors and
    # checkpoints) reads the batch size it was given: make it the true one. Its batch
    # checks ran during initialize; nothing after them compares it with the per-rank values.
    engine._config.train_batch_size = plan.global_batch_size
    if hasattr(engine, "tput_timer"):
        engine.tput_timer.batch_size = plan.global_batch_size
    slowdown = None
    if emulation is not None:
        slowdown = ComputeSlowdown(emulation, clock="thread" if on_cpu else "cuda")
    wrapped = PoplarEngine(
        engine, plan=plan, rank=info.rank, poplar_config=poplar_config, device_label=label, slowdown=slowdown,
        rank_device_labels=labels,
    )
    dataloader = None
    if training_data is not None:
        sampler = wrapped.create_batch_sampler(len(training_data))
        dataloader = torch.utils.data.DataLoader(training_data, batch_sampler=sampler, collate_fn=collate_fn)
    return wrapped, ds_optimizer, dataloader, ds_scheduler


__all__ = ["CLIENT_STATE_KEY", "PoplarEngine", "initialize"]
