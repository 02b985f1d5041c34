"""`PoplarAccelerator`: accelerate's Accelerator with a plan's per-rank batches; the only importer of accelerate
(``pip install 'poplar-ext[accelerate]'``). See docs/accelerate.md (usage, limits, each extended method and why)."""

from __future__ import annotations

import collections
import contextlib
import copy
import itertools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import DistributedType, pad_across_processes, recursively_apply

from poplar_ext.elastic import ends_job_on_user_error
from poplar_ext.optimizer_offload import check_job_optimizer_offloads
from poplar_ext.runtime.config import AUTO, DICT_SOURCE, SECTION, GlobalBatchRequest, nominal_deepspeed_config
from poplar_ext.runtime.data import PlanBatchSampler, check_holds_global_batch, check_plan_dataset
from poplar_ext.runtime.engine_core import undo_initial_zero_step
from poplar_ext.runtime.job_start import read_poplar_section
from poplar_ext.runtime.weighting import label_token_count, loss_shifts_labels
from poplar_ext.zero.engine import PoplarEngine
from poplar_ext.zero.initialize import Job, prepare_job, set_up_rank, wrap_built_engine

logger = logging.getLogger(__name__)

_CONFIG_FILE_VARIABLE = "ACCELERATE_DEEPSPEED_CONFIG_FILE"
_DATALOADER_OPTIONS = (
    "num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
    "persistent_workers", "pin_memory_device", "generator",
)  # fmt: skip


class _PlanPasses(torch.utils.data.Sampler[list[int]]):
    """The plan's batch sampler as a DataLoader's ``batch_sampler``, without ``set_epoch``.

    accelerate's DataLoaderShard calls ``set_epoch(n)`` with the number of passes it has
    seen in this process, which after ``load_state`` (or a pass left early) is not the
    stream's epoch; the plan's sampler keeps its own position instead.

    With `count_tokens` (``token_mean``), each iteration's micro-batches are taken from the
    sampler together (indices only) and ``count_tokens(position, micro_batches)`` is called
    before the first is handed out, `position` being the iteration's stream position."""

    def __init__(self, sampler: PlanBatchSampler, count_tokens: Callable[[int, list], None] | None = None) -> None:
        self.plan_sampler = sampler
        self.count_tokens = count_tokens

    def __iter__(self):
        if self.count_tokens is None:
            yield from self.plan_sampler
            return
        sampler = self.plan_sampler
        sampler.begin_pass()  # where the pass starts, before it is read here
        micro_batches = iter(sampler)
        while True:
            iteration = sampler.next_iteration
            # The count of the iteration read now: a switch scheduled for a later one has already
            # changed the sampler's gradient_accumulation_steps.
            group = list(itertools.islice(micro_batches, sampler.split(iteration)[1]))
            if not group:
                return
            self.count_tokens(sampler.iteration_start(iteration), group)
            yield from group

    def __len__(self) -> int:
        return len(self.plan_sampler)


class _CountedCollate:
    """A training DataLoader's collate function that hands out the micro-batches `hand_out` was given (the ones
    ``token_mean`` counted, in the sampler's order), else collates with the user's `user_collate_fn`."""

    def __init__(self, user_collate_fn: Callable[[list], Any]) -> None:
        self.user_collate_fn = user_collate_fn
        self._batches: collections.deque = collections.deque()

    def hand_out(self, batches: list) -> None:
        self._batches.clear()  # what a pass left early had collated and not handed out
        self._batches.extend(batches)

    def __call__(self, samples: list) -> Any:
        return self._batches.popleft() if self._batches else self.user_collate_fn(samples)


def _plain_global_batch(accelerator: Any, train_loader: Any) -> GlobalBatchRequest | None:
    """What a plain Accelerator trains per optimizer step with `train_loader` (None: it has no batch_size)."""
    if not train_loader.batch_size:
        return None
    batch, steps = train_loader.batch_size, accelerator.gradient_accumulation_steps
    if accelerator.split_batches:  # a plain Accelerator cuts each batch among its processes
        return GlobalBatchRequest(
            size=batch * steps,
            origin=f"the DataLoader's batch_size x gradient_accumulation_steps with split_batches ({batch} x {steps})",
        )
    return GlobalBatchRequest(
        size=batch * steps * accelerator.num_processes,
        origin="the DataLoader's batch_size x gradient_accumulation_steps x processes "
        f"({batch} x {steps} x {accelerator.num_processes})",
    )


class PoplarAccelerator(Accelerator):
    """``accelerate.Accelerator`` training the plan of the DeepSpeed config's ``poplar`` section.

    Same arguments as ``Accelerator``, and `loss_fn(engine, batch) -> loss`: the automatic mode's profiling loss
    where the model does not return one from its batch (default: as `poplar_ext.initialize`'s). DeepSpeed must be on
    (accelerate's config file, or ``deepspeed_plugin=``). See docs/accelerate.md for what differs. After the first
    ``prepare``: `plan` (every rank's), `poplar_engine` (after the model's), this rank's `micro_batch_size` and
    ``gradient_accumulation_steps``, and `global_batch_size`."""

    @ends_job_on_user_error  # accelerate's refusals of its arguments and these: the same at every restart
    def __init__(self, *args: Any, loss_fn: Callable[[Any, Any], Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._profiling_loss_fn = loss_fn
        if self.distributed_type != DistributedType.DEEPSPEED:
            raise ValueError(
                f"PoplarAccelerator: expected DeepSpeed (accelerate's config with distributed_type DEEPSPEED and a "
                f"deepspeed_config_file, or deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...)), found "
                f"{self.distributed_type}; the plan's per-rank batches are DeepSpeed configs"
            )
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if self.num_processes != launched:
            raise ValueError(
                f"PoplarAccelerator: expected the {launched} processes of WORLD_SIZE in accelerate's state, found "
                f"{self.num_processes}: accelerate chose no distributed backend for DeepSpeed on this device (on CPU "
                "it has none by default); pass kwargs_handlers=[InitProcessGroupKwargs(backend='gloo')]"
            )
        self.job: Job | None = None
        """The plan and its context, settled by the first ``prepare`` on every rank."""
        self.poplar_engine: PoplarEngine | None = None
        """The `PoplarEngine` over the DeepSpeed engine (what backward and checkpoints go through)."""
        self._train_sampler: PlanBatchSampler | None = None
        self._train_loader: Any = None
        self._prepared_train_loader: Any = None
        self._data_position_loaded = False
        """``load_state`` moved the training data to a checkpoint's position (what ``skip_first_batches`` would do)."""
        self._model: Any = None
        self._iteration_tokens: dict[int, list[int]] = {}
        """``token_mean``: each counted iteration's micro-batch label tokens, by its stream position."""
        self._micro_steps_in_iteration = 0
        self._accumulated_since_backward = False
        """An ``accumulate()`` block entered since the last `backward`, which needs one (`_check_accumulating`)."""

    # -- the plan ----------------------------------------------------------------------
    @property
    def plan(self) -> Any:
        """The plan every rank runs now (None before the first ``prepare``; re-balancing may switch it)."""
        if self.poplar_engine is not None:
            return self.poplar_engine.plan
        return None if self.job is None else self.job.plan

    @property
    def micro_batch_size(self) -> int:
        """This rank's micro-batch size b_r."""
        return self._settled_plan().ranks[self.process_index].micro_batch_size

    @property
    def global_batch_size(self) -> int:
        """The true global batch B of one optimizer step, over every rank and accumulation step."""
        return self._settled_plan().global_batch_size

    def _settled_plan(self) -> Any:
        if self.job is None:
            raise ValueError("PoplarAccelerator: the plan is resolved by the first prepare(...); call it first")
        return self.plan

    def _start_job(self, model: Any, optimizer: Any, train_loader: Any) -> Job:
        """Resolve the plan on every rank and make the plugin's config this rank's (collective)."""
        # The DeepSpeed config accelerate holds, the folder its relative paths start from, its name.
        config, config_file = self.state.deepspeed_plugin.deepspeed_config, os.environ.get(_CONFIG_FILE_VARIABLE)
        if config_file and config_file != "none":
            loaded = copy.deepcopy(config), Path(config_file).resolve().parent, config_file
        else:
            loaded = copy.deepcopy(config), Path.cwd(), f"DeepSpeedPlugin's {DICT_SOURCE}"
        # Without accelerate's "auto" values (top level and zero_optimization): what the automatic mode's
        # profiling gives DeepSpeed, which takes no "auto".
        profiling = {k: v for k, v in loaded[0].items() if v != AUTO}
        if isinstance(profiling.get("zero_optimization"), dict):
            profiling["zero_optimization"] = {k: v for k, v in profiling["zero_optimization"].items() if v != AUTO}
        if isinstance(optimizer, torch.optim.Optimizer):
            profiling["zero_allow_untested_optimizer"] = True  # as accelerate's _prepare_deepspeed sets it
        # Without the section, what this script runs instead is a plain Accelerator (prepare_job's words name
        # deepspeed.initialize).
        poplar_config = read_poplar_section(loaded, otherwise="accelerate's Accelerator (not PoplarAccelerator)")
        job = prepare_job(
            loaded,
            poplar_config=poplar_config,
            model=model,
            optimizer=optimizer,
            training_data=None if train_loader is None else train_loader.dataset,
            collate_fn=None if train_loader is None else train_loader.collate_fn,
            default_global_batch=self._default_global_batch(loaded[0], train_loader),
            profiling_ds_config=profiling,
            loss_fn=self._profiling_loss_fn,
            training_data_name="the training DataLoader",
        )
        if train_loader is not None:  # before the engine is built
            size = len(train_loader.dataset)
            check_holds_global_batch(size, job.plan.global_batch_size, "the training DataLoader: num_samples")
        plain = None if train_loader is None else _plain_global_batch(self, train_loader)  # before the plan's counts
        self._use_rank_config(job)
        given = plain is not None and job.poplar_config.plan is not None  # a searched plan's batch is the config's
        if given and job.rank == 0 and plain.size != job.plan.global_batch_size:
            # The plan's batch is trained, as documented; a learning rate tuned for the script's may not fit it.
            logger.warning(
                "PoplarAccelerator: the plan's global batch of %d samples replaces the %d of %s",
                job.plan.global_batch_size,
                plain.size,
                plain.origin,
            )
        return job

    def _default_global_batch(self, ds_config: dict, train_loader: Any) -> GlobalBatchRequest | None:
        """A plain Accelerator's global batch (the DataLoader's batch_size per process), for a plan searched
        at start when neither the poplar section nor the DeepSpeed config sets one; a plan file's is its own."""
        section = ds_config.get(SECTION)
        if not isinstance(section, dict) or "plan" in section or train_loader is None:
            return None
        return _plain_global_batch(self, train_loader)

    def _use_rank_config(self, job: Job) -> None:
        """This rank's nominal DeepSpeed config (its b_r, s_r, the plan's stage) in the plugin accelerate reads."""
        nominal = nominal_deepspeed_config(job.ds_config, job.plan, job.rank, source=job.source)
        plugin = self.state.deepspeed_plugin
        # accelerate reads the plugin's dict (and its HfDeepSpeedConfig holds the same one) from here on.
        plugin.deepspeed_config.clear()
        plugin.deepspeed_config.update(nominal)
        plugin.hf_ds_config.set_stage_and_offload()
        plugin.zero_stage = job.plan.zero_stage
        plugin.gradient_accumulation_steps = nominal["gradient_accumulation_steps"]
        self.gradient_accumulation_steps = nominal["gradient_accumulation_steps"]  # what accumulate() counts

    # -- prepare -------------------------------------------------------------------------
    @ends_job_on_user_error  # refusals of what it is given (accelerate's, these) and of the plan: the same at restart
    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        """accelerate's; a ValueError or TypeError of it ends a restarting launcher's job (`poplar_ext.elastic`)."""
        return super().prepare(*args, device_placement=device_placement)

    def _prepare_deepspeed(self, *args: Any) -> tuple:
        model = next((a for a in args if isinstance(a, torch.nn.Module)), None)
        optimizer = next((a for a in args if isinstance(a, torch.optim.Optimizer)), None)
        loaders = [a for a in args if isinstance(a, torch.utils.data.DataLoader)]
        train_loader = loaders[0] if loaders and self._train_loader is None else None
        if train_loader is not None:  # named as given: the only check (prepare_job leaves it to its callers)
            check_plan_dataset(train_loader.dataset, "the training DataLoader")
        if self.job is None:
            self.job = self._start_job(model, optimizer, train_loader)
        check_job_optimizer_offloads(self.job, optimizer, accelerate_maps=True)
        if train_loader is not None:
            if self.job.rank == 0:
                _warn_of_a_later_shuffling_loader(loaders)
            planned = self._plan_dataloader(train_loader)
            args = tuple(planned if a is train_loader else a for a in args)
        labels = slowdown = None
        if model is not None:
            self._model = model
            # The plan's activation checkpointing goes into the model before DeepSpeed wraps it.
            labels, slowdown = set_up_rank(self.job, model, toggle=None)
        previous = self.deepspeed_engine_wrapped
        result = super()._prepare_deepspeed(*args)
        wrapper = self.deepspeed_engine_wrapped
        if wrapper is not None and wrapper is not previous:
            # A PoplarEngine between accelerate and the DeepSpeed engine it just built; its compute window opens
            # at the forward of the model prepare returned (DeepSpeed's engine).
            engine = wrapper.engine
            undo_initial_zero_step(engine)  # fp16 at ZeRO 0: DeepSpeed's zero-gradient step at its build
            wrapped = wrap_built_engine(self.job, engine, labels=labels, slowdown=slowdown, sampler=self._train_sampler)
            wrapped.switch_listeners.append(self._follow_plan_switch)
            wrapper.engine = wrapped  # accelerator.backward: weighted backward, then the counting step
            self._models[self._models.index(engine)] = wrapped  # save_state/load_state: the data position too
            self.poplar_engine = wrapped
            _route_plan_calls(engine, wrapped)
        if model is None:
            self._warn_of_unwrapped_schedulers(args)
        return result

    def _warn_of_unwrapped_schedulers(self, args: tuple) -> None:
        """Under DeepSpeed accelerate wraps only a scheduler prepared with the model: one prepared alone stays the
        script's, stepped at every ``lr_scheduler.step()``. Where ranks accumulate different counts, a loop stepping
        it on every micro-batch (as it steps a prepared one) steps it a different number of times on each rank."""
        counts = self._accumulation_counts()
        if self.job is None or self.job.rank != 0 or len(set(counts)) <= 1:
            return
        for scheduler in args:
            if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
                logger.warning(
                    "PoplarAccelerator: the LR scheduler %s was prepared without the model, so accelerate leaves it as "
                    "it is (under DeepSpeed it wraps only a scheduler prepared with the model): each "
                    "lr_scheduler.step() steps it, and on every micro-batch ranks of different accumulation counts "
                    "(counts by rank: %s) would step it different numbers of times, each rank at its own learning "
                    "rate; prepare it with the model, or step it under `if accelerator.sync_gradients:`",
                    type(scheduler).__name__,
                    counts,
                )

    def free_memory(self, *objects: Any) -> Any:
        """accelerate's (``clear`` calls it), then the training state of the last ``prepare`` forgotten: the next
        ``prepare`` plans its first DataLoader and wraps its engine again, under the job's plan (resolved once)."""
        released = super().free_memory(*objects)
        self.poplar_engine = None
        self._train_sampler = self._train_loader = self._prepared_train_loader = self._model = None
        self._data_position_loaded = False
        self._iteration_tokens.clear()
        self._micro_steps_in_iteration = 0
        self._accumulated_since_backward = False
        if self.job is not None:  # a re-balanced plan's count back to the job's plan, which the next engine starts on
            self._use_rank_config(self.job)
        return released

    def _follow_plan_switch(self, plan: Any) -> None:
        """A new plan from the next iteration on (re-balancing, or ``load_state`` resuming under the checkpoint's last
        plan): ``accumulate()`` counts its accumulation count. It syncs when its micro-step counter `step` is a multiple
        of the count, so the counter moves to the next multiple, as `PoplarEngine.switch_plan` moves DeepSpeed's."""
        steps = plan.ranks[self.process_index].gradient_accumulation_steps
        self.gradient_accumulation_steps = steps
        self.step = -(-self.step // steps) * steps

    def save_state(self, output_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
        """accelerate's; refused between two optimizer steps of this rank when the plan's ranks accumulate
        different counts (accelerate's examples save every N batches: its collectives would meet the other ranks'
        gradient reduction and hang; `_check_collective_at_sync_point`). Where every rank accumulates alike, a save
        mid-iteration is fine: the data resumes at the iteration start."""
        self._check_collective_at_sync_point(
            "save_state",
            found="after",
            effect="save_state's collectives would meet their gradient reduction and hang. Save under `if "
            "accelerator.sync_gradients:`, counting optimizer steps, not batches",
        )
        return super().save_state(output_dir, *args, **kwargs)

    def load_state(self, input_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
        """accelerate's, then ``accumulate()``'s micro-step counter `step` back to 0: the training data resumes at
        an iteration start (the checkpoint's data position), whatever micro-step the saved run had reached."""
        loaded = super().load_state(input_dir, *args, **kwargs)
        # accelerate restores `step` from the RNG file: a multiple of the saved plan's count (another plan's
        # would sync off its iterations), a micro-step inside an iteration (a save mid-iteration), or none
        # (a rank the saved run did not have). DeepSpeed's boundary follows `sync_gradients`, so only these count.
        self.step = 0
        self._micro_steps_in_iteration = 0
        self._data_position_loaded = True
        return loaded

    def _plan_dataloader(self, loader: torch.utils.data.DataLoader) -> torch.utils.data.DataLoader:
        """`loader` rebuilt on this rank's plan sampler (its dataset, collate function and workers)."""
        dataset = loader.dataset
        config = self.job.poplar_config
        if self.poplar_engine is not None:
            sampler = self.poplar_engine.create_batch_sampler(len(dataset))
        else:
            sampler = PlanBatchSampler.from_plan(
                self.job.plan, rank=self.job.rank, num_samples=len(dataset), **config.data_order
            )
        if self.poplar_engine is None and self.job.rank == 0:
            _warn_of_replaced_order(loader, shuffle=config.shuffle, drop_last=config.drop_last)
        options = {name: getattr(loader, name) for name in _DATALOADER_OPTIONS if hasattr(loader, name)}
        if loader.num_workers > 0:
            options["prefetch_factor"] = loader.prefetch_factor
        count = None
        if config.loss_reduction == "token_mean":
            # A loader this method planned before, prepared again (after free_memory): its user's collate_fn.
            collate = getattr(loader.collate_fn, "user_collate_fn", loader.collate_fn)
            # In this process (no workers) the micro-batches counted are the ones handed out, in the sampler's order:
            # a collate_fn that draws random numbers (an MLM collator's masking) would otherwise be counted from
            # another draw than the one trained. Workers collate in their own processes, again.
            in_process = not options.get("num_workers")
            counted = _CountedCollate(collate)

            def count(position: int, micro_batches: list) -> None:
                shifted = loss_shifts_labels(self._model)
                batches = [collate([dataset[i] for i in indices]) for indices in micro_batches]
                self._iteration_tokens[position] = [label_token_count(b, shifted=shifted) for b in batches]
                if in_process:
                    counted.hand_out(batches)

            options["collate_fn"] = counted if in_process else collate

        planned = torch.utils.data.DataLoader(dataset, batch_sampler=_PlanPasses(sampler, count), **options)
        self._train_sampler, self._train_loader = sampler, planned
        return planned

    def prepare_data_loader(self, data_loader: Any, device_placement: Any = None, slice_fn_for_dispatch: Any = None):
        """accelerate's, except for the training DataLoader: prepared as one process's (its sampler is this rank's)."""
        if data_loader is not self._train_loader:
            return super().prepare_data_loader(
                data_loader, device_placement=device_placement, slice_fn_for_dispatch=slice_fn_for_dispatch
            )
        prepared = prepare_data_loader(
            data_loader,
            self.device,
            num_processes=1,
            process_index=0,
            put_on_device=self.device_placement if device_placement is None else device_placement,
            rng_types=None,
            dispatch_batches=False,
            even_batches=False,
            use_seedable_sampler=False,
            non_blocking=self.non_blocking,
        )
        self._dataloaders.append(prepared)
        self._prepared_train_loader = prepared
        return prepared

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """accelerate's, except for the training dataloader, which ``load_state`` already moved to the saved
        data position (skipping again would skip data)."""
        if dataloader is self._prepared_train_loader:
            if num_batches and not self._data_position_loaded:
                # Nothing moved the data: a resume by the script's own means would train the skipped batches again.
                logger.warning(
                    "skip_first_batches(%d): the training dataloader is not skipped: no load_state ran since prepare, "
                    "and only load_state moves its data (to a checkpoint's position); it continues at stream position "
                    "%d; returned as it is (resume with load_state to continue a saved run's data)",
                    num_batches,
                    0 if self.poplar_engine is None else self.poplar_engine.data_position,
                )
            elif num_batches:
                logger.info(
                    "skip_first_batches(%d): the training dataloader already continues where load_state left the "
                    "data; returned as it is",
                    num_batches,
                )
            return dataloader
        return super().skip_first_batches(dataloader, num_batches)

    # -- the loss ------------------------------------------------------------------------
    @contextlib.contextmanager
    def accumulate(self, *models: Any):
        """accelerate's; counted, so that `backward` can tell a loop that does not use it."""
        self._accumulated_since_backward = True
        with super().accumulate(*models):
            yield

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """accelerate's (its DeepSpeed wrapper calls the `PoplarEngine`, which weights `loss`); with
        ``token_mean``, the iteration's label tokens are agreed across ranks before its first backward.
        Refused outside ``accumulate()`` when any rank of the plan accumulates (every rank alike)."""
        self._check_accumulating()
        if self.job is not None and self.job.poplar_config.loss_reduction == "token_mean":
            if self._micro_steps_in_iteration == 0:
                self._agree_iteration_tokens()
            self._micro_steps_in_iteration = 0 if self.sync_gradients else self._micro_steps_in_iteration + 1
        super().backward(loss, **kwargs)

    @ends_job_on_user_error  # the loop's code: the same refusal at every restart
    def _check_accumulating(self) -> None:
        """Without ``accumulate()`` `sync_gradients` stays True: every micro-batch would be an optimizer step of
        a partial batch, and ranks of different counts would step different numbers of times (a hang). Decided
        from the plan, which every rank shares, so that every rank refuses at the same backward, before any
        collective (a rank of count 1 alone would train right, but its peers would not)."""
        plan = self.plan
        counts = [] if plan is None else [r.gradient_accumulation_steps for r in plan.ranks]
        if self._accumulated_since_backward or max(counts, default=1) == 1:
            self._accumulated_since_backward = False
            return
        accumulating = [rank for rank, count in enumerate(counts) if count > 1]
        raise ValueError(
            "PoplarAccelerator.backward: expected each micro-batch's backward inside `with "
            "accelerator.accumulate(model):`, since the plan gives ranks "
            f"{accumulating} accumulation counts above 1 (counts by rank: {counts}); found a backward "
            "without accumulate() since the previous one, which would make every micro-batch an optimizer "
            "step of a partial batch. Wrap the forward, accelerator.backward, optimizer.step() and "
            "optimizer.zero_grad() of each batch in accelerator.accumulate(model)"
        )

    def _agree_iteration_tokens(self) -> None:
        engine = self.poplar_engine
        # The sampler's position, as the dataloader keyed its count: with drop_last an epoch's
        # tail is skipped, so it is not steps x global batch (`trained_position`) past an epoch.
        position = engine.data_position
        counts = self._iteration_tokens.pop(position, None)
        if counts is None:
            raise ValueError(
                "loss_reduction token_mean: expected the training dataloader prepare returned to have counted the "
                f"label tokens of the iteration at stream position {position}, found none; train from that "
                "dataloader (its batches are dicts with 'labels')"
            )
        # Iterations read ahead but never trained (a pass left early) are counted again when read again.
        for stale in [p for p in self._iteration_tokens if p < position]:
            del self._iteration_tokens[stale]
        engine.set_token_counts(counts)

    # -- collectives ---------------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        """accelerate's; refused between two optimizer steps of this rank when the plan's ranks accumulate different
        counts (`_check_collective_at_sync_point`)."""
        self._check_collective_at_sync_point("gather")
        return super().gather(tensor)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """accelerate's (``check_trigger`` calls it); refused as `gather` is."""
        self._check_collective_at_sync_point("reduce")
        return super().reduce(tensor, reduction=reduction, scale=scale)

    def wait_for_everyone(self) -> None:
        """accelerate's barrier; refused as `gather` is."""
        self._check_collective_at_sync_point("wait_for_everyone")
        super().wait_for_everyone()

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """accelerate's (it gathers every rank's sizes); refused as `gather` is."""
        self._check_collective_at_sync_point("pad_across_processes")
        return super().pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    @ends_job_on_user_error  # the loop's code: the same refusal at every restart
    def _check_collective_at_sync_point(
        self,
        call: str,
        *,
        found: str = "at",
        effect: str = "this collective would meet other calls of it or their gradient reduction (a crash or a hang). "
        "Sum locally and call it under `if accelerator.sync_gradients:`",
    ) -> None:
        """Where ranks accumulate different counts, they run different numbers of micro-batches per optimizer step: a
        collective on every micro-batch (diffusers' scripts gather the loss inside ``accumulate()``) pairs different
        micro-batches across ranks with each other and with the gradient reduction, and gloo aborts or hangs. Refused
        on a rank between two of its optimizer steps, before the collective; at an optimizer step
        (``sync_gradients``) every rank is at its own, and a plan of one count runs every rank alike."""
        counts = self._accumulation_counts()
        if len(set(counts)) <= 1 or self.sync_gradients:
            return
        steps = self.gradient_accumulation_steps
        raise ValueError(
            f"PoplarAccelerator.{call}: expected a call at an optimizer step (accelerator.sync_gradients True), "
            f"since the plan gives ranks different accumulation counts (counts by rank: {counts}); found one {found} "
            f"micro-batch {self.step % steps} of this rank's {steps}: the other ranks are at other micro-batches, "
            f"where {effect}"
        )

    def _accumulation_counts(self) -> list[int]:
        """Every rank's accumulation count in the plan it runs now (none before the first ``prepare``)."""
        plan = self.plan
        return [] if plan is None else [r.gradient_accumulation_steps for r in plan.ranks]

    # -- metrics -------------------------------------------------------------------------
    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """accelerate's, with tensors whose first dimension differs across ranks (the plan's micro-batches)
        gathered whole: every rank's rows, rank 0's first, nothing dropped or repeated (collective). Refused between
        two optimizer steps of this rank where ranks accumulate different counts, objects (accelerate's
        ``gather_object``) as tensors (`gather`): `_check_collective_at_sync_point`."""
        try:
            recursively_apply(lambda x: x, input_data, error_on_other_type=True)
        except TypeError:
            use_gather_object = True
        if use_gather_object:
            # accelerate's gather_object, past `gather`: refused between optimizer steps as a tensor's gather is.
            self._check_collective_at_sync_point("gather_for_metrics")
        if use_gather_object or self.num_processes == 1:
            return super().gather_for_metrics(input_data, use_gather_object=use_gather_object)
        return recursively_apply(self._gather_rows, input_data)

    def _gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor[None] if tensor.dim() == 0 else tensor
        rows = self.gather(torch.tensor([tensor.shape[0]], device=tensor.device)).tolist()
        if len(set(rows)) == 1:  # even: accelerate's own (its evaluation remainder handling included)
            return super().gather_for_metrics(tensor)
        gathered = self.gather(pad_across_processes(tensor, dim=0))
        width = max(rows)
        return torch.cat([gathered[r * width : r * width + n] for r, n in enumerate(rows)])


_PLAN_CALLS = ("deepspeed_io", "set_train_batch_size", "set_train_micro_batch_size")
"""What the DeepSpeed engine ``prepare`` returns answers as the `PoplarEngine` does (`_route_plan_calls`)."""


def _warn_of_a_later_shuffling_loader(loaders: list) -> None:
    """The first DataLoader of a ``prepare`` is the training one; where it reads in order and a later one shuffles,
    the script likely passed its evaluation DataLoader first, which leaves the training one split evenly by
    accelerate: ranks of uneven counts then wait on each other at the first optimizer step."""
    random = torch.utils.data.RandomSampler
    if not _reads_in_order(loaders[0]):
        return
    shuffling = [index for index, loader in enumerate(loaders) if isinstance(loader.sampler, random)]
    if shuffling:
        logger.warning(
            "PoplarAccelerator: prepare takes its first DataLoader, which reads in order, as the training one, yet "
            "its DataLoader number %d shuffles: if that one trains, pass it to prepare first (an evaluation "
            "DataLoader taken as the training one leaves the training one split evenly by accelerate, and ranks of "
            "different accumulation counts then wait on each other at the first optimizer step)",
            shuffling[0] + 1,
        )


def _reads_in_order(loader: torch.utils.data.DataLoader) -> bool:
    """Whether `loader` reads its dataset in order: a ``SequentialSampler`` in plain batches (a sampler or batch
    sampler of the script's own, such as a ``SubsetRandomSampler`` or a length-grouped one, may shuffle)."""
    batches = getattr(loader, "batch_sampler", None)
    plain = batches is None or type(batches) is torch.utils.data.BatchSampler
    return plain and isinstance(getattr(loader, "sampler", None), torch.utils.data.SequentialSampler)


def _route_plan_calls(engine: Any, wrapped: PoplarEngine) -> None:
    """The script holds DeepSpeed's `engine` (the model ``prepare`` returned), not `wrapped`: its ``deepspeed_io``
    would split the data evenly in batches of this rank's micro-batch, and its batch setters would change one
    rank's accumulation count, silently. They go to `wrapped` (the plan's loader, the setters' refusals), which
    reaches DeepSpeed's own (`poplar_ext.zero.engine.deepspeed_own`)."""
    for name in _PLAN_CALLS:
        setattr(engine, name, getattr(wrapped, name))


def _warn_of_replaced_order(loader: torch.utils.data.DataLoader, *, shuffle: bool, drop_last: bool) -> None:
    """Warn where the training DataLoader asked for another order than the poplar section's, which the plan's
    sampler follows instead (the Trainer refuses such arguments; a DataLoader's ``shuffle`` defaults to False)."""
    sampler, batches = getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)
    given = {torch.utils.data.RandomSampler: True, torch.utils.data.SequentialSampler: False}.get(type(sampler))
    replaced, section_shuffle = [], f"poplar.shuffle {str(shuffle).lower()}"
    if batches is not None and type(batches) is not torch.utils.data.BatchSampler:
        replaced.append(f"batch_sampler {type(batches).__name__} ({section_shuffle})")
    elif given is not None and given != shuffle:
        replaced.append(f"shuffle={given} by {section_shuffle}")
    elif given is None and sampler is not None:
        replaced.append(f"sampler {type(sampler).__name__} ({section_shuffle})")
    if bool(getattr(loader, "drop_last", False)) != drop_last:
        replaced.append(f"drop_last={loader.drop_last} by poplar.drop_last {str(drop_last).lower()}")
    if replaced:
        logger.warning(
            "PoplarAccelerator: the plan's sampler replaces the training DataLoader's %s: it orders the training "
            "data from the DeepSpeed config's poplar section (seed, shuffle, drop_last); set them there",
            " and ".join(replaced),
        )
