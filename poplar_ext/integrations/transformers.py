"""`PoplarTrainer`, `PoplarTrainerMixin` (any Trainer subclass): the Hugging Face Trainer on a plan; the only importer
of transformers (``pip install 'poplar-ext[hf]'``). See docs/trainer.md (each hook, re-balancing, evaluation)."""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import inspect
import itertools
import json
import logging
import math
import os
import re
import sys
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainingArguments
from transformers.integrations.deepspeed import HfDeepSpeedConfig
from transformers.trainer import SCHEDULER_NAME, TRAINER_STATE_NAME, _is_peft_model
from transformers.trainer_pt_utils import find_batch_size
from transformers.trainer_utils import seed_worker, unwrap_peft_model

from poplar_ext.activation_checkpointing import apply_plan_checkpointing, can_checkpoint
from poplar_ext.collectives import agree_sum, agree_sums, decided_by_rank0
from poplar_ext.elastic import ends_job_on_user_error
from poplar_ext.hardware.emulation import device_label
from poplar_ext.optimizer_offload import check_job_optimizer_offloads, offload_deepspeed_optimizer
from poplar_ext.plan.formats import Plan
from poplar_ext.profiler.measure import training_dtype
from poplar_ext.runtime.checkpoint import (
    REBALANCING_KEYS,
    ResumeDecision,
    agree_storages,
    check_deepspeed_load,
    checkpoint_tag,
    history_entry,
    poplar_client_state,
    read_state,
    restore_replaced,
    resume_decision,
    save_whole,
    saved_world_size,
    unfinished_save,
)
from poplar_ext.runtime.config import GlobalBatchRequest, PoplarConfig, load_deepspeed_config
from poplar_ext.runtime.data import (
    IterationSampler,
    MicroBatchesDataset,
    PlanBatchSampler,
    check_holds_global_batch,
    check_plan_dataset,
)
from poplar_ext.runtime.engine_core import undo_initial_zero_step
from poplar_ext.runtime.evaluation import EvalBatchSampler, eval_batch_sizes
from poplar_ext.runtime.job_start import read_poplar_section
from poplar_ext.runtime.reshard import loading_resharded, resharded_tag
from poplar_ext.runtime.weighting import label_token_count, loss_shifts_labels
from poplar_ext.zero.engine import PoplarEngine, set_deepspeed_batch
from poplar_ext.zero.initialize import Job, prepare_job, rank_devices, wrap_built_engine

logger = logging.getLogger(__name__)

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_BATCH_MISMATCHES = tuple(f"- ds {key}=" for key in _BATCH_KEYS)
"""How Hugging Face's check of the DeepSpeed config against TrainingArguments words a batch value's mismatch."""
MICRO_BATCHES = "poplar_micro_batches"
"""The key of the one item the training dataloader yields per optimizer step: this rank's micro-batches."""


def _rank_arguments(args: TrainingArguments, job: Job, *, checkpointing: bool | None) -> TrainingArguments:
    """`args` for this rank: its plan's micro-batch and accumulation count, the DeepSpeed
    config's batch values left for Hugging Face to fill from them ("auto"), and its
    activation checkpointing (`checkpointing`; None: the model cannot, args as given)."""
    rank_plan = job.plan.ranks[job.rank]
    switched = {}  # one dataclasses.replace: each runs Hugging Face's __post_init__ (its DeepSpeed config read again)
    if checkpointing is not None:
        # transformers 5.24 renamed gradient_checkpointing* to activation_checkpointing* and
        # resolves the old names from the new ones: set the names this version reads.
        fields = {f.name for f in dataclasses.fields(args)}
        name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
        given, given_kwargs = getattr(args, name), getattr(args, name + "_kwargs")
        if bool(given) != checkpointing:
            logger.info(
                "rank %d: %s %s as the plan says (TrainingArguments said %s)", job.rank, name, checkpointing, given
            )
        # The Trainer enables it at train() from these arguments: they must say what the plan says.
        switched = {
            name: checkpointing,
            name + "_kwargs": {**(given_kwargs or {}), "use_reentrant": False} if checkpointing else given_kwargs,
        }
    config = {**job.ds_config, **dict.fromkeys(_BATCH_KEYS, "auto")}
    config["zero_optimization"] = {**config.get("zero_optimization", {}), "stage": job.plan.zero_stage}
    if rank_plan.optimizer_offload:
        offload_deepspeed_optimizer(config)
    eval_batch = eval_batch_sizes(job.plan, smallest_batch_size=args.per_device_eval_batch_size)[job.rank]
    return dataclasses.replace(
        args,
        per_device_train_batch_size=rank_plan.micro_batch_size,
        per_device_eval_batch_size=eval_batch,
        # Each item of the training dataloader is one optimizer step's micro-batches (`MICRO_BATCHES`): the Trainer
        # counts optimizer steps, and the accumulation count can change when the plan does. DeepSpeed gets the rank's
        # count once built (`PoplarTrainerMixin._wrap_engine`).
        gradient_accumulation_steps=1,
        deepspeed=config,
        # poplar-ext agrees on the iteration's tokens itself (`_get_num_items_in_batch`).
        average_tokens_across_devices=False,
        **switched,
    )


@ends_job_on_user_error  # the first refusal of a Trainer's arguments (the mixin's, TRL's): an error of the code
def named_arguments(below: list[type], positional: tuple, keywords: dict[str, Any]) -> dict[str, Any]:
    """`positional` named as the first ``__init__`` in `below` (the classes after the mixin, in MRO order)
    that names them takes them (one taking ``*args`` passes them on; TypeError as Python raises it for too
    many or for one given twice), beside `keywords`."""
    inits = (vars(klass)["__init__"] for klass in below if "__init__" in vars(klass))
    variadic = inspect.Parameter.VAR_POSITIONAL
    init = next(f for f in inits if all(p.kind is not variadic for p in inspect.signature(f).parameters.values()))
    named = dict(list(inspect.signature(init).bind_partial(None, *positional).arguments.items())[1:])  # [0]: self
    twice = sorted(named.keys() & keywords.keys())
    if twice:
        raise TypeError(f"{init.__qualname__}() got multiple values for argument {twice[0]!r}")
    return {**named, **keywords}


def _trains(model: Any) -> bool:
    """Whether `model` (what the Trainer hands compute_loss) is in training mode. A DeepSpeed engine's ``eval()`` and
    ``train()`` set its module's mode alone, its own ``training`` staying True: evaluate() before train() hands
    compute_loss such an engine (DeepSpeed's inference engine at ZeRO 3), whose loss was weighted as training's."""
    return bool(getattr(model, "module", model).training)


_TRL_TRAINERS = ("SFTTrainer", "DPOTrainer", "RewardTrainer")
"""TRL's trainers that poplar_ext.integrations.trl puts on a plan (as Poplar<name>), in the order its docs give."""


def _refuse_before_settling(cls: type, args: TrainingArguments | None) -> tuple[tuple[dict, Path, str], PoplarConfig]:
    """What the mixin refuses from its class and `args` alone, before the job is settled: no collective, no
    profiling (the automatic mode measures at settling) is waited for. Returns the DeepSpeed config
    (`load_deepspeed_config`'s result) and its poplar section, read once."""
    mro = cls.__mro__
    below = list(itertools.takewhile(lambda k: k is not Trainer, mro[mro.index(PoplarTrainerMixin) + 1 :]))
    trl = next((k for k in below if k.__module__.split(".")[0] == "trl"), None)
    if trl is not None and not cls._trl_metrics_on_each_rank:
        # TRL's trainers gather their logged metrics from every rank in each compute_loss: under a plan the ranks reach
        # those gathers with micro-batches of other sizes (gloo aborts) or not at all (the others wait), at step 1.
        names = {k.__name__ for k in trl.__mro__}
        ours = [f"Poplar{name}" for name in _TRL_TRAINERS if name in names]
        if not ours:
            expected = "one of poplar_ext.integrations.trl's classes (" + ", ".join(
                f"Poplar{name}" for name in _TRL_TRAINERS
            )
            expected += f"), which have no counterpart for {trl.__name__}"
        else:
            mixed = next(k for k in below if issubclass(k, Trainer))  # the Trainer class the mixin was put on
            expected = f"poplar_ext.integrations.trl's {ours[0]} in its place"
            if mixed is not trl:
                expected = f"poplar_ext.integrations.trl's {ours[0]} first in the bases: {cls.__name__}({ours[0]}, "
                expected += f"{mixed.__name__})"
        raise ValueError(
            f"{cls.__name__}: PoplarTrainerMixin on trl's {trl.__name__}: expected {expected}, found the mixin alone; "
            f"{trl.__name__} gathers its logged metrics from every rank in each compute_loss, and the ranks of a plan "
            "reach those gathers with micro-batches of other sizes or other numbers of them (the job hangs or aborts "
            "at its first step)"
        )
    for klass in below:
        # A subclass below the mixin choosing its own training batches would have them replaced by the plan's.
        for name in ("get_train_dataloader", "_get_train_sampler"):
            if name in vars(klass):
                raise ValueError(
                    f"{cls.__name__}: {klass.__name__}.{name}: expected the Trainer's own (the plan's sampler replaces "
                    f"it: each rank's micro-batches are the plan's), found one of {klass.__name__}'s, whose batches "
                    "would not be trained; give the data through train_dataset and data_collator instead"
                )
    if args is None or not args.deepspeed:
        raise ValueError(
            f"{cls.__name__}: expected TrainingArguments(deepspeed=...) naming a DeepSpeed config with a "
            "'poplar' section, found none; use the Trainer without poplar-ext for a run without one"
        )
    config = getattr(args, "accelerator_config", None)
    accumulation = getattr(config, "gradient_accumulation_kwargs", None) or {}
    if "num_steps" in accumulation:
        # accelerate's own count would make the Trainer join that many of the plan's optimizer steps into one.
        raise ValueError(
            "TrainingArguments.accelerator_config: gradient_accumulation_kwargs: expected no 'num_steps' with a "
            f"poplar plan (each rank's accumulation count is the plan's), found num_steps={accumulation['num_steps']}; "
            "set the global batch in the DeepSpeed config or the poplar section instead"
        )
    for option in ("dispatch_batches", "split_batches"):
        if getattr(config, option, None):
            # Each rank's micro-batches are the plan's, of uneven sizes: accelerate's rank-0 dispatcher refuses
            # batches of different sizes at the first step (the other ranks then wait), and a batch split evenly
            # is not the plan's.
            raise ValueError(
                f"TrainingArguments.accelerator_config: {option}: expected False with a poplar plan (each rank reads "
                f"its own micro-batches, of the plan's sizes), found True; leave it unset"
            )
    loaded = load_deepspeed_config(config=args.deepspeed)
    if loaded[0].get("checkpoint", {}).get("use_node_local_storage") and not args.save_on_each_node:
        raise ValueError(
            "TrainingArguments.save_on_each_node: expected True with the DeepSpeed config's "
            "checkpoint.use_node_local_storage (DeepSpeed writes each node's part of a checkpoint into that node's "
            "storage; the Trainer writes trainer_state.json, which a resume reads on every rank, on the first node "
            "alone), found False; set it True, or drop use_node_local_storage on storage the nodes share"
        )
    poplar_config = read_poplar_section(
        loaded,
        needs="{} for the automatic mode, or with 'plan' or 'profiles'",
        otherwise="the Trainer without poplar-ext",
    )
    strategy = getattr(args, "train_sampling_strategy", "random")
    # The plan's sampler orders the training data from the poplar section (seed, shuffle, drop_last): TrainingArguments
    # asking for another order would be ignored without a word.
    refused = None  # (argument, what is expected, its value, what to do instead)
    if args.dataloader_drop_last and not poplar_config.drop_last:
        refused = ("dataloader_drop_last", "False while poplar.drop_last is false", True, "set poplar.drop_last true")
    elif args.data_seed is not None and args.data_seed != poplar_config.seed:
        refused = ("data_seed", f"None or poplar.seed ({poplar_config.seed})", args.data_seed, "set poplar.seed")
    elif strategy == "sequential" and poplar_config.shuffle:
        refused = (
            "train_sampling_strategy",
            "'random' while poplar.shuffle is true",
            repr(strategy),
            "set poplar.shuffle false",
        )
    elif strategy not in ("random", "sequential"):
        refused = ("train_sampling_strategy", "'random' or 'sequential'", repr(strategy), "leave it 'random'")
    if refused is not None:
        name, expected, found, instead = refused
        raise ValueError(
            f"TrainingArguments.{name}: expected {expected} (the plan's sampler orders the training data from the "
            f"DeepSpeed config's poplar section: seed, shuffle, drop_last), found {found}; {instead}"
        )
    return loaded, poplar_config


def _refuse_per_rank_retries(args: TrainingArguments) -> None:
    """What the mixin refuses beside `_refuse_before_settling`, from `args` alone and alike on every rank."""
    if getattr(args, "auto_find_batch_size", False):
        # After an out-of-memory error only that rank would halve its batch and retry, while the plan's sampler keeps
        # its micro-batch and the other ranks wait in collectives.
        raise ValueError(
            "TrainingArguments.auto_find_batch_size: expected False with a poplar plan (the plan already sizes each "
            "rank's micro-batch to its device's memory), found True; leave it False (a rank that runs out of memory "
            "needs a smaller micro-batch in the plan: profile its device type again, or edit the plan)"
        )


_PRECISION_SECTIONS = ("fp16", "bf16")
"""The DeepSpeed config's sections whose ``enabled`` Hugging Face fills from TrainingArguments (fp16, bf16)."""


def _precision_as_filled(loaded: tuple[dict, Path, str], args: Any) -> tuple[dict, Path, str]:
    """`loaded` with each precision section's ``"enabled": "auto"`` as TrainingArguments filled it already
    (``args.hf_deepspeed_config``): the job's dtype is read from the config (every device checked for bf16, the
    memory each rank needs), where "auto" would read as enabled, and Hugging Face's own configs say "auto" for both."""
    ds_config, base_dir, source = loaded
    filled = getattr(getattr(args, "hf_deepspeed_config", None), "config", None) or {}
    resolved = dict(ds_config)
    for name in _PRECISION_SECTIONS:
        section, value = ds_config.get(name), (filled.get(name) or {}).get("enabled")
        if isinstance(section, dict) and section.get("enabled") == "auto" and isinstance(value, bool):
            resolved[name] = {**section, "enabled": value}
    return resolved, base_dir, source


def _warn_of_unread_loss_reduction(caller: str, ds_config: Any) -> None:
    """A warning where the DeepSpeed config's poplar section names ``loss_reduction``, which a Trainer does not read:
    the loss it weights is what the Trainer's ``loss_is_scaled_for_ga`` says (see `PoplarTrainerMixin.compute_loss`)."""
    section = ds_config.get("poplar") if isinstance(ds_config, dict) else None
    if isinstance(section, dict) and "loss_reduction" in section:
        logger.warning(
            "%s: poplar.loss_reduction %r is not read by a Trainer (it is the plain loop's and PoplarAccelerator's): "
            "each micro-batch's loss is weighted as the Trainer's loss_is_scaled_for_ga says, the token mean over "
            "the global batch's label tokens where the model takes loss kwargs and the batches have labels, else "
            "the sample mean; leave loss_reduction out of this config (docs/trainer.md)",
            caller,
            section["loss_reduction"],
        )


def _settle_job(
    args: TrainingArguments,
    model: Any,
    train_dataset: Any,
    *,
    collate_fn: Any,
    configured: Any,
    caller: str = "PoplarTrainer",
) -> Job:
    """The plan and its context, resolved alike on every rank (collective) before the Trainer is built;
    `configured`: what `_refuse_before_settling` read; `caller`: the Trainer class, for messages."""
    check_plan_dataset(train_dataset, "train_dataset")  # as given: the only check (prepare_job leaves it to callers)
    _ = args.device  # reading it makes Hugging Face and accelerate set up the process group
    from poplar_ext.collectives import process_group_rank

    _, world_size = process_group_rank()
    launched = int(os.environ.get("WORLD_SIZE", world_size))  # a launcher without it (mpirun): the group's
    # Otherwise the Trainer gives DeepSpeed the batch of its own count of processes, which DeepSpeed refuses late.
    if launched > 1 and args.world_size != launched:
        raise ValueError(
            f"{caller}: expected the {launched} processes of WORLD_SIZE in TrainingArguments.world_size, found "
            f"{args.world_size}: accelerate chose no distributed backend for DeepSpeed on this device (on CPU it has "
            "none by default); on CPU ranks pass TrainingArguments(use_cpu=True, ddp_backend='gloo')"
        )
    loaded, poplar_config = configured
    loaded = _precision_as_filled(loaded, args)
    optimizer = filled = None
    if model is not None:
        # Profiling (the automatic mode) measures the optimizer the Trainer will create.
        optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
        optimizer = functools.partial(optimizer_cls, **optimizer_kwargs)
        if getattr(args, "hf_deepspeed_config", None) is not None:
            # Hugging Face's "auto" values filled as the Trainer fills them: DeepSpeed itself takes no "auto".
            filled = copy.deepcopy(args.hf_deepspeed_config)
            # Its batch values are each rank's from the plan (`_rank_arguments`), not the arguments': a config's
            # batch differing from per_device_train_batch_size x gradient_accumulation_steps x ranks is the job's.
            filled.mismatches = [m for m in filled.mismatches if not m.startswith(_BATCH_MISMATCHES)]
            filled.trainer_config_finalize(args, model, num_training_steps=max(1, args.max_steps))
    per_device, steps = args.per_device_train_batch_size, args.gradient_accumulation_steps
    job = prepare_job(
        loaded,
        poplar_config=poplar_config,
        model=model,
        optimizer=optimizer,
        training_data=train_dataset,
        collate_fn=collate_fn,
        default_global_batch=GlobalBatchRequest(
            size=per_device * steps * world_size,
            origin="TrainingArguments per_device_train_batch_size x gradient_accumulation_steps x world size "
            f"({per_device} x {steps} x {world_size})",
        ),
        profiling_ds_config=None if filled is None else filled.config,
        training_data_name="train_dataset",
    )
    if train_dataset is not None:  # before the Trainer is built, not at train()
        check_holds_global_batch(len(train_dataset), job.plan.global_batch_size, "train_dataset: num_samples")
    return job


class _PlanEvaluation:
    """`PoplarTrainerMixin`'s evaluate() and predict() under the plan (`poplar_ext.runtime.evaluation`):
    rounds of one batch per rank, every sample once and in order, the loss the exact mean over the set.
    It reads the mixin's job, its loss decisions and its dataloader settings."""

    def get_eval_dataloader(self, eval_dataset: Any = None) -> torch.utils.data.DataLoader:
        """This rank's evaluation batches (`poplar_ext.runtime.evaluation`): every sample once, in order."""
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        given = "eval_dataset"
        if isinstance(eval_dataset, str):
            given, eval_dataset = f"eval_dataset[{eval_dataset!r}]", self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        return self._evaluation_loader(dataset, "Evaluation", given)

    def get_test_dataloader(self, test_dataset: Any) -> torch.utils.data.DataLoader:
        """This rank's prediction batches, as `get_eval_dataloader`."""
        if test_dataset is None:
            raise ValueError("Trainer: prediction requires a test_dataset.")
        return self._evaluation_loader(test_dataset, "test", "test_dataset")

    def _evaluation_loader(self, dataset: Any, description: str, given: str) -> torch.utils.data.DataLoader:
        """`given`: what the caller named `dataset`, for its refusal."""
        check_plan_dataset(dataset, given)  # as given, like train_dataset
        dataset, collator = _dataset_and_collator(self, dataset, description)
        sizes = eval_batch_sizes(self.job.plan, smallest_batch_size=self._eval_batch_asked)
        sampler = EvalBatchSampler(num_samples=len(dataset), batch_sizes=sizes, rank=self.job.rank)
        return self._prepared_loader(dataset, sampler, collator, training=False)

    def evaluation_loop(
        self,
        dataloader: Any,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> Any:
        """The Trainer's loop over this rank's rounds; every rank's rows gathered once, in order, and the loss
        the exact mean over the whole data set (token or sample mean, as training counts it)."""
        sampler = _eval_sampler_of(dataloader)
        loop_arguments = (dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        if sampler is None:  # a dataloader of the caller's own: the Trainer's even split
            return super().evaluation_loop(*loop_arguments)
        self._eval_round = _EvalRound(sampler=sampler)
        self.gather_function = self.gather_round_metrics
        try:
            output = super().evaluation_loop(*loop_arguments)
        finally:
            progress, self._eval_round = self._eval_round, None
            self.gather_function = self.accelerator.gather_for_metrics
        loss_sum, loss_count = agree_sums([progress.loss_sum, progress.loss_count], self.args.device)
        if loss_count > 0:
            output.metrics[f"{metric_key_prefix}_loss"] = loss_sum / loss_count
        return output

    def prediction_step(
        self, model: Any, inputs: dict, prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> Any:
        """The Trainer's; under a plan's evaluation also adds this batch's loss to the exact mean."""
        progress = self._eval_round
        if progress is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        progress.index += 1
        counted = self._eval_loss_count(inputs)  # before the Trainer's step may change the batch
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        # A padding batch, or one without label tokens (a completion truncated away): its loss, a mean over
        # nothing (0/0, NaN), adds nothing to the sum nor the count, as the plain Trainer's NaN filter drops it.
        if loss is not None and counted > 0 and progress.sampler.real_counts(progress.index)[self.job.rank] > 0:
            progress.loss_sum += float(loss.detach().float().mean()) * counted
            progress.loss_count += counted
        return loss, logits, labels

    def _eval_loss_count(self, inputs: dict) -> int:
        """What the batch's loss is a mean over: its label tokens (as training counts them) or its samples."""
        if self._loss_is_a_token_mean(inputs):
            return label_token_count(inputs, shifted=self._loss_shifts_labels_truly())
        return int(find_batch_size(inputs) or 0)

    def _loss_is_a_token_mean(self, batch: Any) -> bool:
        """Whether the loss of `batch` is over its label tokens: it has labels, the model takes loss kwargs
        (or the Trainer has a compute_loss_func), and the subclass does not declare a micro-batch mean."""
        return (
            self._inner_loss_is_scaled_for_ga is not False
            and isinstance(batch, Mapping)
            and "labels" in batch
            and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None)
        )

    def gather_round_metrics(self, data: Any, use_gather_object: bool = False) -> Any:
        """The gather during a plan's evaluation (``accelerator.gather``'s arguments): every rank's tensors whole, rank
        0's first, whatever their first dimension, except a padding batch's (collective). The evaluation loop's gather;
        Trainer subclasses that gather metrics in ``compute_loss`` (TRL's) are given it there too."""
        real = self._eval_round.sampler.real_counts(self._eval_round.index)
        accelerator = self.accelerator
        gather = functools.partial(type(accelerator).gather, accelerator)  # the class's: a subclass may replace it

        def every_ranks_rows(tensor: torch.Tensor) -> torch.Tensor:
            tensor = tensor[None] if tensor.dim() == 0 else tensor
            rows = gather(torch.tensor([tensor.shape[0]], device=tensor.device)).tolist()
            gathered = gather(accelerator.pad_across_processes(tensor, dim=0))
            width = max(rows)
            return torch.cat([gathered[r * width : r * width + (n if real[r] else 0)] for r, n in enumerate(rows)])

        return _map_tensors(every_ranks_rows, data)


class PoplarTrainerMixin(_PlanEvaluation):
    """Everything `PoplarTrainer` does, for any ``transformers.Trainer`` subclass.

    Put it first in the bases: ``class MyTrainer(PoplarTrainerMixin, MyOwnTrainer)`` (TRL's trainers: the classes of
    ``poplar_ext.integrations.trl``, which keep TRL's metric gathers on each rank; the mixin alone on one is
    refused). Its methods call ``super()``, so the subclass's own ``__init__``, ``compute_loss`` and data collator run
    inside them: the subclass's loss is computed first and then weighted to the global batch, and the train dataloader
    is the plan's (the subclass's dataset preparation in ``__init__`` is kept; a ``get_train_dataloader`` of its own is
    refused). A subclass that overrides these methods itself (a class *derived from* the mixed class) must call
    ``super()`` in them for the plan to apply; see docs/trainer.md."""

    _trl_metrics_on_each_rank: bool = False
    """Whether TRL's metric gathers in compute_loss are kept on each rank while training (poplar_ext.integrations.trl's
    classes); a TRL trainer under the mixin without it is refused."""

    def _profiling_collator(self, data_collator: Any, train_dataset: Any) -> Any:
        """What puts `train_dataset`'s samples together into the micro-batches the automatic mode profiles (before
        the Trainer is built): the data collator as given. A subclass that prepares its data in ``__init__`` (TRL's)
        says here why its raw samples cannot be profiled."""
        return data_collator

    @ends_job_on_user_error  # the Trainer's own refusals too: every restart would meet them again
    def __init__(self, *positional: Any, **kwargs: Any) -> None:
        # By name, positional ones in the order of the Trainer class mixed in (the Trainer's third is
        # data_collator, DPOTrainer's second ref_model).
        mro = type(self).__mro__
        kwargs = named_arguments(list(mro[mro.index(PoplarTrainerMixin) + 1 :]), positional, kwargs)
        model, args, train_dataset = (kwargs.pop(name, None) for name in ("model", "args", "train_dataset"))
        configured = _refuse_before_settling(type(self), args)
        _refuse_per_rank_retries(args)
        self.job = _settle_job(
            args,
            model,
            train_dataset,
            collate_fn=self._profiling_collator(kwargs.get("data_collator"), train_dataset),
            configured=configured,
        )
        self.poplar_engine: PoplarEngine | None = None
        """The `PoplarEngine` between accelerate and DeepSpeed's engine, once training built it: it times
        compute, re-balances (``poplar.rebalance``) and switches DeepSpeed's batch with the plan."""
        rank_plan = self.job.plan.ranks[self.job.rank]
        # Without a model (model_init) the arguments carry the plan's setting: the Trainer applies it to each
        # model model_init builds, at train(). None: the model cannot checkpoint.
        checkpointing = rank_plan.activation_checkpointing
        if model is not None:
            checkpointing = apply_plan_checkpointing(model, self.job.plan, self.job.rank, source=self.job.plan_reason)
            checkpointing = checkpointing if can_checkpoint(model) else None
        if self.job.rank == 0:  # here, not when train() wraps an engine: evaluate() alone builds none
            logger.info("poplar plan from step 0: %s", self.job.plan_reason)
            _warn_of_unread_loss_reduction(type(self).__name__, configured[0][0])
        logger.info(
            "rank %d: micro-batch %d x %d accumulation steps; true global batch %d, ZeRO stage %d; device %s%s%s",
            self.job.rank,
            rank_plan.micro_batch_size,
            rank_plan.gradient_accumulation_steps,
            self.job.plan.global_batch_size,
            self.job.plan.zero_stage,
            _device_of(self.job, rank_plan.device_type),
            # The plan's memory levers for this rank, as poplar_ext.initialize's line names them.
            "; activation checkpointing" if checkpointing else "",
            "; optimizer offloaded to the host" if rank_plan.optimizer_offload else "",
        )
        self._eval_batch_asked: int = args.per_device_eval_batch_size
        """``per_device_eval_batch_size`` as given: the rank with the smallest plan micro-batch's."""
        super().__init__(
            model=model,
            args=_rank_arguments(args, self.job, checkpointing=checkpointing),
            train_dataset=train_dataset,
            **kwargs,
        )
        if model is None and self.model is not None:
            # The model model_init built: one that cannot checkpoint is refused on every rank alike.
            apply_plan_checkpointing(self.model, self.plan, self.job.rank, source=self.job.plan_reason)
        # What the Trainer subclass says its own loss is (the Trainer's class attribute:
        # False, a micro-batch mean; True, normalised by num_items_in_batch; None, decided
        # per step as the Trainer decides); read before it is overwritten below.
        self._inner_loss_is_scaled_for_ga: bool | None = self.loss_is_scaled_for_ga
        # The loss compute_loss returns is already the global batch's share (see compute_loss).
        self.loss_is_scaled_for_ga = True
        self._train_sampler: PlanBatchSampler | None = None
        self._shifts_labels: bool | None = None
        self._label_mean: bool | None = None
        self._plan_history = [history_entry(self.plan, start_step=0, data_position=0, reason=self.job.plan_reason)]
        self._reshard_on_resume = False
        self._resume_decision: ResumeDecision | None = None
        self._eval_round: _EvalRound | None = None

    @property
    def plan(self) -> Plan:
        """The plan every rank runs now (re-balancing switches it)."""
        engine = self.__dict__.get("poplar_engine")
        return self.job.plan if engine is None else engine.plan

    # -- data ------------------------------------------------------------------------
    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        """This rank's micro-batches of the plan (one pass: one epoch of the true global batch), one item
        per optimizer step: ``{MICRO_BATCHES: [micro-batch, ...]}``, each collated by the data collator."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        dataset, collator = _dataset_and_collator(self, self.train_dataset, "Training")
        batch = self.plan.global_batch_size
        self._train_sampler = PlanBatchSampler.from_plan(
            self.plan,
            rank=self.job.rank,
            num_samples=len(dataset),
            # The Trainer needs every epoch to have the same number of steps: the stream's first epoch has
            # ceil(N / B) iterations (with drop_last, floor).
            iterations_per_pass=len(dataset) // batch
            if self.job.poplar_config.drop_last
            else math.ceil(len(dataset) / batch),
            **self.job.poplar_config.data_order,
        )
        iterations = IterationSampler(self._train_sampler)
        return self._prepared_loader(
            MicroBatchesDataset(dataset), iterations, functools.partial(_collate_each, collator), training=True
        )

    def _prepared_loader(self, dataset: Any, batch_sampler: Any, collate_fn: Any, *, training: bool) -> Any:
        """A DataLoader of `batch_sampler` (already this rank's) prepared by the Trainer's accelerator, passed through
        accelerate's shard wrapper (what the Trainer does for its own rank-aware batch sampler)."""
        options = self._dataloader_options(training=training)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate_fn, **options)
        prepared = self.accelerator.prepare(loader)
        shard = getattr(prepared, "batch_sampler", None)
        if shard is not None and getattr(shard, "batch_sampler", None) is batch_sampler:
            shard.num_processes, shard.process_index = 1, 0
        return prepared

    def _dataloader_options(self, *, training: bool) -> dict[str, Any]:
        """The DataLoader settings the Trainer gives its own loaders (``TrainingArguments.dataloader_*``;
        training also seeds each worker as the Trainer does); the plan's sampler replaces the rest."""
        args = self.args
        options: dict[str, Any] = {
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory,
            "persistent_workers": args.dataloader_persistent_workers,
            "multiprocessing_context": getattr(args, "dataloader_multiprocessing_context", None),
            "prefetch_factor": args.dataloader_prefetch_factor,
        }
        if hasattr(args, "dataloader_in_order"):
            options["in_order"] = args.dataloader_in_order
        if training:
            options["worker_init_fn"] = functools.partial(
                seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index
            )
        return options

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        """The true global batch (the plan's), for the Trainer's step counts, logs and samples/s."""
        return self.plan.global_batch_size

    # -- the loss ----------------------------------------------------------------------
    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor | None:
        """``T / W``: the label tokens of the whole global batch (every rank, every
        accumulation step), counted as the model's loss counts them, over the world size."""
        batch_samples = _micro_batches_of(batch_samples)
        # Decided from what every rank has alike, so that all or none enter the collective.
        if not batch_samples or not self._loss_is_a_token_mean(batch_samples[0]):
            return None
        shifted = self._loss_shifts_labels_truly()
        mine = sum(label_token_count(batch, shifted=shifted) for batch in batch_samples)
        if self._eval_round is not None:
            # Evaluation (the Trainer counts each batch's tokens): each batch's own token mean, which
            # evaluation_loop weights by its tokens for the exact mean over the data set.
            return torch.tensor(mine, dtype=torch.float32, device=device)
        total = agree_sum(mine, self.job.device)
        return torch.tensor(total / self.job.world_size, dtype=torch.float32, device=device)

    def _loss_shifts_labels_truly(self) -> bool:
        if self._shifts_labels is None:
            # The loss the model computes (its loss_function property, the one it calls), not its loss_type:
            # GPT2LMHeadModel has none and still uses ForCausalLMLoss.
            self._shifts_labels = loss_shifts_labels(self.accelerator.unwrap_model(self.model))
        return self._shifts_labels

    def _model_loss_is_a_label_mean(self) -> bool:
        """Whether the loss compute_loss gets is the model's own mean over a micro-batch's labels although the Trainer
        counts it normalised by num_items_in_batch (its rule, `loss_is_scaled_for_ga` None: a model whose forward
        takes ``**kwargs``): the model's, with no label smoother, compute_loss_func or compute_loss of a subclass
        between, from a model that ignores num_items_in_batch (`_model_loss_ignores`)."""
        if self._label_mean is None:
            mro = type(self).__mro__
            below = next(k for k in mro[mro.index(PoplarTrainerMixin) + 1 :] if "compute_loss" in vars(k))
            self._label_mean = (
                self._inner_loss_is_scaled_for_ga is None
                and below is Trainer
                and self.model_accepts_loss_kwargs
                and self.compute_loss_func is None
                and self.label_smoother is None
                and _model_loss_ignores(unwrap_peft_model(self.accelerator.unwrap_model(self.model)))
            )
        return self._label_mean

    def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's, refused on every rank where accelerate would swap it on the offloading ranks alone."""
        optimizer = super().create_optimizer(*args, **kwargs)
        check_job_optimizer_offloads(self.job, optimizer, accelerate_maps=True)
        return optimizer

    def compute_loss(
        self, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """The Trainer's loss, weighted to the global batch when training (see docs/trainer.md)."""
        # A model given num_items_in_batch that returns its micro-batch's label mean anyway (`_model_loss_ignores`):
        # its labels counted before the Trainer's compute_loss may pop them.
        counted = None
        training = _trains(model)
        if training and num_items_in_batch is not None and self._model_loss_is_a_label_mean():
            counted = label_token_count(inputs, shifted=self._loss_shifts_labels_truly())
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        if not training:
            return result
        loss, outputs = result if return_outputs else (result, None)
        # Whether the subclass's loss is its token sum over num_items_in_batch (True) or a micro-batch sample mean
        # (False), as the Trainer's loss_is_scaled_for_ga says.
        normalised = self._inner_loss_is_scaled_for_ga
        if normalised is None:
            normalised = num_items_in_batch is not None
        elif normalised and num_items_in_batch is None:
            raise ValueError(
                f"{type(self).__name__}: loss_is_scaled_for_ga is True (the loss is normalised over the accumulated "
                "batch) but the batches carry no 'labels' to count, so poplar-ext cannot tell over what; set "
                "loss_is_scaled_for_ga = False and return a micro-batch mean, or give the batches labels"
            )
        if counted is not None:
            # The mean over this micro-batch's n labels: n * W / T makes it W * sum / T, as a normalised loss is.
            weight = counted / float(num_items_in_batch)
            if counted == 0:
                # No label tokens (an empty target): the model's mean over none is 0/0, NaN, which the weight 0 keeps
                # NaN; it adds nothing to the global batch's loss (nor gradients: no label reaches the loss).
                loss = torch.nan_to_num(loss, nan=0.0)
        elif normalised:
            weight = 1.0  # the loss divided its token sum by T / W: W * sum / T already
        else:
            # This rank's share of the iteration training now (the engine switches it with the plan).
            engine = self.poplar_engine
            rank_plan = self.job.plan.ranks[self.job.rank] if engine is None else engine.rank_plan
            weight = self.job.world_size * rank_plan.micro_batch_size / self.plan.global_batch_size
        # Always a new tensor: at ZeRO stage 0, DeepSpeed's hook on the engine's own output (the model's loss) divides
        # its gradient by the accumulation count even with scale_wrt_gas=False, which an uneven plan must not get.
        loss = loss * weight
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model: Any, inputs: dict, num_items_in_batch: Any = None) -> torch.Tensor:
        """One optimizer step's micro-batches (`MICRO_BATCHES`), each through the Trainer's ``training_step``;
        DeepSpeed's accumulation boundary is the last one. Returns the summed weighted losses."""
        micro_batches = inputs.get(MICRO_BATCHES) if isinstance(inputs, dict) else None
        if micro_batches is None:  # one micro-batch, e.g. a caller of its own
            return super().training_step(model, inputs, num_items_in_batch)
        state = self.accelerator.gradient_state
        sync_at_end = state.sync_gradients
        # What the Trainer and subclasses (TRL's auxiliary losses) read as this step's micro-batch count.
        self.current_gradient_accumulation_steps = len(micro_batches)
        total = None
        for index, batch in enumerate(micro_batches):
            # accelerate hands this flag to DeepSpeed as the accumulation boundary.
            state._set_sync_gradients(sync_at_end and index == len(micro_batches) - 1)
            loss = super().training_step(model, batch, num_items_in_batch)
            total = loss if total is None else total + loss
        return total

    def floating_point_ops(self, inputs: dict) -> int:
        """The Trainer's count, summed over an optimizer step's micro-batches."""
        return sum(super(PoplarTrainerMixin, self).floating_point_ops(b) for b in _micro_batches_of([inputs]))

    def _track_num_input_tokens(self, inputs: dict) -> None:
        """The Trainer's count (a collective) once per optimizer step, over all its micro-batches: ranks
        run different numbers of them."""
        batches = _micro_batches_of([inputs])
        name = getattr(self.model, "main_input_name", "input_ids")
        if len(batches) > 1 and all(name in b for b in batches):
            merged = {name: torch.cat([b[name].flatten() for b in batches])}
            if all("attention_mask" in b for b in batches):
                merged["attention_mask"] = torch.cat([b["attention_mask"].flatten() for b in batches])
            batches = [merged]
        for batch in batches:
            super()._track_num_input_tokens(batch)

    # -- checkpoints -------------------------------------------------------------------
    def _poplar_state(self) -> dict:
        best = self.__dict__.get("_best_state")
        if best is None:
            return _trained_state(self)
        # load_best_model_at_end loaded the best checkpoint: its state, not the last step's.
        state = {key: value for key, value in best.items() if key != "save_id"}
        if len(best["plan"]["ranks"]) == self.plan.world_size:
            return state
        # Saved on another number of ranks and loaded resharded: a save from here on writes this job's ranks' files,
        # so its state names this job's plan, and the history a resume here from the best checkpoint records (as
        # `_check_resume`'s decision); with the saving ranks' plan, a load on that many ranks let DeepSpeed refuse
        # these files.
        current = _trained_state(self)
        decision = resume_decision(best, current, path=str(self.state.best_model_checkpoint), step=best.get("step", 0))
        state = {key: value for key, value in state.items() if key not in REBALANCING_KEYS}
        return {**state, "plan": current["plan"], "plan_history": decision.plan_history}

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's, with one DeepSpeed save per checkpoint, whole. At ZeRO 3 without
        stage3_gather_16bit_weights_on_model_save, save_model falls back to a DeepSpeed save into checkpoint-N in place,
        which `_save_optimizer_and_scheduler` then saved again: two full copies, twice the peak disk. The fallback saves
        nothing where that save follows, and through `save_whole` where it does not (save_only_model)."""
        fallback = self._save_deepspeed_whole if self.args.save_only_model else _no_deepspeed_save
        return self._with_deepspeed_save(fallback, super()._save_checkpoint, model, trial)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The Trainer's, with DeepSpeed's save into checkpoint-N going through `save_whole`, as
        `PoplarEngine.save_checkpoint`'s does: the tag folder replaced whole once every rank has saved (nothing an
        earlier run's save there left), poplar-ext's state in it, then ``latest``."""
        return self._with_deepspeed_save(self._save_deepspeed_whole, super()._save_optimizer_and_scheduler, output_dir)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's. Where it falls back to the engine's DeepSpeed save into `output_dir` (ZeRO 3 without
        stage3_gather_16bit_weights_on_model_save), that save goes through `save_whole`, poplar-ext's state in it,
        as a checkpoint's does; inside a checkpoint's save, `_save_checkpoint` has chosen it already."""
        if not self.is_deepspeed_enabled or "save_checkpoint" in vars(self.model_wrapped):
            return super().save_model(output_dir, _internal_call)
        return self._with_deepspeed_save(self._save_deepspeed_whole, super().save_model, output_dir, _internal_call)

    def _with_deepspeed_save(self, save: Callable[..., None], method: Callable[..., Any], *args: Any) -> Any:
        """`method(*args)` with the Trainer's calls of engine.save_checkpoint calling `save` (the engine's attribute,
        shadowing the method; the one before after: these nest); as it is without DeepSpeed."""
        if not self.is_deepspeed_enabled:
            return method(*args)
        engine = self.model_wrapped
        before = engine.__dict__.get("save_checkpoint")
        engine.save_checkpoint = save
        try:
            return method(*args)
        finally:
            if before is None:
                del engine.save_checkpoint
            else:
                engine.save_checkpoint = before

    def _save_deepspeed_whole(self, save_dir: str, exclude_frozen_parameters: bool = False) -> None:
        """What the Trainer's engine.save_checkpoint(save_dir[, exclude_frozen_parameters]) does here: `save_whole`."""
        engine = self.model_wrapped

        def save(tag: str) -> None:
            type(engine).save_checkpoint(
                engine, save_dir, tag=tag, save_latest=False, exclude_frozen_parameters=exclude_frozen_parameters
            )

        save_whole(save_dir, None, save, deepspeed_engine=engine, state=self._poplar_state, save_latest=True)

    def _finalize_training(self, trial: Any, num_train_samples: int, start_time: float) -> Any:
        """The Trainer's, with the loss accumulated since the last log averaged over the ranks first (as its
        logging does): each rank's loss is its weighted share of the global batch's, not the mean."""
        total = agree_sums([float(self._tr_loss)], self.args.device)[0]
        self._tr_loss = torch.full_like(self._tr_loss, total / self.job.world_size)
        return super()._finalize_training(trial, num_train_samples, start_time)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; a resumed run is checked against the checkpoint's plan and data order first, and
        ``True`` resumes the newest whole checkpoint (`_whole_checkpoint`)."""
        self._best_state = None  # training again: a save holds this run's state
        if resume_from_checkpoint:
            resume_from_checkpoint = _checkpoint_to_resume(self, resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _check_resume(self, resume_from_checkpoint: str | bool) -> str | None:
        """Decide, on rank 0 and before anything is loaded, whether the checkpoint can continue here; returns the
        checkpoint folder (None: output_dir holds none).

        The Trainer resumes by its step count: the data continues at the saved position when the global batch is the
        checkpoint's, whatever the allocation or the number of ranks (a lost node, an elastic restart); another global
        batch, or another data order, is refused. On another number of ranks at ZeRO stages 1-3 the optimizer state is
        resharded when the engine exists (`_prepare_for_training`)."""
        from poplar_ext.collectives import gather_objects

        self._restore_replaced_tags(resume_from_checkpoint)
        storage_rank = _storage_rank(self.args, self.job.rank)
        here = _resumable_here(resume_from_checkpoint, self.args.output_dir) if storage_rank == 0 else None
        storages = [(rank, view) for rank, view in enumerate(gather_objects(here)) if view is not None]
        folder = _whole_checkpoint(resume_from_checkpoint, storages)  # the same on every rank
        tag = (
            None if folder is None else decided_by_rank0(lambda: checkpoint_tag(Path(folder), None), rank=self.job.rank)
        )
        if tag is not None:  # each node's DeepSpeed load reads its own storage's files: one save on all
            agree_storages(folder, tag, storage_rank=storage_rank, rank=self.job.rank, caller="resume_from_checkpoint")

        def read() -> dict | None:
            place = Path(folder)
            # In the tag folder of the DeepSpeed checkpoint in it (its ``latest``), where PoplarEngine.load_checkpoint
            # reads it too; else beside the tag folder: where earlier poplar-ext versions wrote it (still read).
            return (tag is not None and read_state(place, tag)) or read_state(place.parent, place.name)

        saved = None if folder is None else decided_by_rank0(read, rank=self.job.rank)
        decision = None
        if saved is not None:
            decision = resume_decision(saved, self._poplar_state(), path=folder, step=saved.get("step", 0))
            if saved["plan"]["global_batch_size"] != self.plan.global_batch_size:
                raise ValueError(
                    "resume_from_checkpoint: the checkpoint trained global batches of "
                    f"{saved['plan']['global_batch_size']} "
                    f"samples, this job's plan has {self.plan.global_batch_size}: the Trainer resumes by its step "
                    "count, which names another stream position under another global batch; resume with the "
                    "checkpoint's global batch (or load it with poplar_ext.initialize and engine.load_checkpoint, "
                    "which continue the stream)"
                )
        if folder is not None:
            # The Trainer would fail on these only once the engine is built, deep in its load: the other refusals
            # first, then one round of rank 0's file checks.
            model, world_size, zero_stage = getattr(self, "model", None), self.plan.world_size, self.plan.zero_stage
            decided_by_rank0(
                lambda: _check_files(
                    Path(folder), tag, saved, self.args, model=model, world_size=world_size, zero_stage=zero_stage
                ),
                rank=self.job.rank,
            )
        if decision is not None:
            self._plan_history = decision.plan_history
            self._resume_decision = decision
            self._reshard_on_resume = decision.world_size_changed and self.plan.zero_stage >= 1
        elif tag is not None and self.plan.zero_stage >= 1:
            # No state file (a plain Trainer's checkpoint): how many ranks saved it, as DeepSpeed recorded.
            saved_ranks = decided_by_rank0(lambda: saved_world_size(Path(folder), tag), rank=self.job.rank)
            self._reshard_on_resume = saved_ranks not in (None, self.plan.world_size)
        if self.job.rank == 0 and folder is not None:
            _log_resume(folder, saved=saved, decision=decision, plan_reason=self.job.plan_reason)
        return folder

    def _restore_replaced_tags(self, named: str | bool) -> None:
        """`restore_replaced` (as the engines' loads do, `tag_for_load`) in the checkpoint folder a resume may read:
        the one `named`, or for ``True`` each ``checkpoint-N`` of output_dir (collective)."""
        from poplar_ext.collectives import raise_if_any_failed

        folders = [Path(named)] if named is not True else list(Path(self.args.output_dir).glob("checkpoint-*"))
        storage_rank, node_local = _storage_rank(self.args, self.job.rank), _node_local(self.args)
        failure = None
        for folder in folders:
            try:
                tag = checkpoint_tag(folder, None)
            except (OSError, ValueError):  # refused by rank 0's reading below, on every rank
                continue
            try:
                if tag is not None:
                    restore_replaced(
                        folder, tag, storage_rank=storage_rank, caller="resume_from_checkpoint", node_local=node_local
                    )
            except OSError as exc:  # noqa: BLE001 - raised on every rank, below
                failure = failure or exc
        raise_if_any_failed(failure, rank=self.job.rank)  # restored on every storage before rank 0 reads it

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        """The Trainer's, with a checkpoint of another number of ranks loaded resharded.

        The Trainer loads the DeepSpeed checkpoint right after building the engine, as it was saved; on another number
        of ranks the ZeRO optimizer state must be resharded first (`poplar_ext.runtime.reshard`), so here the engine is
        built without the load and the resharded checkpoint loaded into it (the smallest seam the Trainer has between
        the two)."""
        if resume_from_checkpoint is None or not self._reshard_on_resume:
            prepared = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
            if resume_from_checkpoint is None:  # a loaded checkpoint replaced what the zero step did
                undo_initial_zero_step(self.model_wrapped)
        else:
            prepared = super()._prepare_for_training(max_steps, train_dataloader, None)
            caller = "resume_from_checkpoint"
            tag = decided_by_rank0(lambda: checkpoint_tag(resume_from_checkpoint, None), rank=self.job.rank)
            if tag is None:
                raise ValueError(f"{caller}: {resume_from_checkpoint} holds no DeepSpeed checkpoint ('latest')")
            self._load_resharded(resume_from_checkpoint, tag, caller=caller)
            # What the Trainer loads after DeepSpeed's checkpoint: its scheduler.pt (the Trainer's own
            # scheduler, which DeepSpeed does not hold) and its grad scaler, as a resume on the same ranks.
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
            self._load_scaler(resume_from_checkpoint)
        self._wrap_engine()
        if resume_from_checkpoint is not None and self._train_sampler is not None:
            # The plan's sampler starts at the first iteration of the epoch the Trainer resumes in: the Trainer then
            # skips that epoch's trained steps (accelerate's skip_first_batches), through a wrapper its own set_epoch
            # does not reach.
            step, iterations = self.state.global_step, self._train_sampler.iterations_per_pass
            if iterations:
                self._train_sampler.set_epoch(step // iterations)
            if self._resume_decision is not None and self.poplar_engine is not None:
                self.poplar_engine.continue_from(  # its notes: logged by _check_resume, as resume_from_checkpoint's
                    self._resume_decision, position_samplers=False, next_iteration=step, log_notes=False
                )
        return prepared

    def _load_resharded(self, folder: str, tag: str, *, caller: str) -> None:
        """DeepSpeed checkpoint `tag` of `folder`, saved on another number of ranks, loaded resharded into the
        Trainer's engine (`resharded_tag`; collective), its optimizer and DeepSpeed's schedule with it."""
        engine, rank = self.model_wrapped, self.job.rank
        universal = resharded_tag(folder, tag, deepspeed_engine=engine, rank=rank, caller=caller)
        with loading_resharded(engine):
            path, _ = engine.load_checkpoint(
                folder, tag=universal, load_optimizer_states=True, load_lr_scheduler_states=True
            )
        if path is None:
            raise ValueError(f"{caller}: DeepSpeed found nothing to load in {folder}")

    def _load_best_model(self) -> None:
        """The Trainer's (``load_best_model_at_end``), with a best checkpoint saved on another number of ranks (a
        run resumed on fewer or more) loaded resharded at ZeRO stages 1-3, as a resume loads one: DeepSpeed's own
        load refuses another number of ranks, after the whole run."""
        folder = self.state.best_model_checkpoint
        if not self.is_deepspeed_enabled or not folder:
            return super()._load_best_model()
        rank = self.job.rank
        tag = decided_by_rank0(lambda: checkpoint_tag(Path(folder), None), rank=rank)
        saved = None if tag is None else decided_by_rank0(lambda: read_state(Path(folder), tag), rank=rank)
        saved_ranks = None if saved is None else len(saved["plan"]["ranks"])
        if saved is None and tag is not None and self.plan.zero_stage > 0:
            # No state file (a plain Trainer's checkpoint, still the best of a run resumed from it): as DeepSpeed
            # recorded.
            saved_ranks = decided_by_rank0(lambda: saved_world_size(Path(folder), tag), rank=rank)
        if saved_ranks is None or saved_ranks == self.job.world_size or self.plan.zero_stage == 0:
            super()._load_best_model()
        else:
            self._load_best_resharded(folder, tag, saved_ranks)
        # The engine now holds the best checkpoint's weights, optimizer and DeepSpeed step count: a DeepSpeed save
        # from here on (save_model's at ZeRO 3) is that checkpoint's, its data position and plan history with it.
        self._best_state = saved

    def _load_best_resharded(self, folder: str, tag: str, saved_ranks: int) -> None:
        """`_load_best_model`'s load of a best checkpoint saved on `saved_ranks` ranks, another number (collective)."""
        if self.job.rank == 0:
            logger.info(
                "load_best_model_at_end: loading the best model from %s (score: %s), saved on %d ranks, resharded "
                "for %d",
                folder,
                self.state.best_metric,
                saved_ranks,
                self.job.world_size,
            )
        self._load_resharded(folder, tag, caller="load_best_model_at_end")

    def _wrap_engine(self) -> None:
        """Put a `PoplarEngine` between accelerate and the DeepSpeed engine the Trainer just built (the
        seam PoplarAccelerator uses): accelerate's backward and step go through it, so it times this rank's
        compute (emulating its device type), re-balances, and sets DeepSpeed's micro-batch and accumulation
        count from the plan. The loss stays weighted by `compute_loss`."""
        wrapper = self.accelerator.deepspeed_engine_wrapped
        if wrapper is None or isinstance(wrapper.engine, PoplarEngine):
            return
        engine, job = wrapper.engine, self.job
        labels, slowdown = rank_devices(job)
        set_deepspeed_batch(engine, job.plan, job.rank)  # the Trainer's arguments gave DeepSpeed 1 x b_r
        wrapped = wrap_built_engine(
            job,
            engine,
            labels=labels,
            slowdown=slowdown,
            sampler=self._train_sampler,
            weights_loss=False,
            log_origin=False,
        )
        wrapper.engine = wrapped
        self.poplar_engine = wrapped
        wrapped.switch_listeners.append(self._follow_plan_switch)

    def _follow_plan_switch(self, plan: Plan) -> None:
        """A new plan from the next iteration on (re-balancing, or a resume under the checkpoint's last plan):
        ``args.per_device_train_batch_size`` is the rank's micro-batch in it, as it was in the first plan."""
        self.args.per_device_train_batch_size = plan.ranks[self.job.rank].micro_batch_size


def _model_loss_ignores(model: Any) -> bool:
    """Whether `model` is a transformers model whose forward takes ``**kwargs`` (the Trainer then passes it
    num_items_in_batch and takes its loss for a sum over that count) but computes its loss without them: a forward
    that never hands them to the model's ``loss_function``, the one way transformers' models pass num_items_in_batch
    to a loss, returns torch's mean over the micro-batch's labels (``CrossEntropyLoss``, ``-100`` ignored). In
    transformers 5: BERT's, RoBERTa's, DistilBERT's heads, T5, BART, which never call it, and
    GenericForSequenceClassification and GenericForTokenClassification (Llama's, Mistral's, Qwen's heads), GPT-NeoX's
    and the image classifiers, which call it without ``**kwargs``. A model of another library, whose source cannot
    be read, that names num_items_in_batch, refers to ``loss_function`` other than in such a call, or whose forward
    hands its labels and ``**kwargs`` on to another module (BLIP's, Kosmos-2's, MusicGen's: that one may count them)
    is taken at the Trainer's word."""
    forward = type(model).forward
    if not (getattr(forward, "__module__", None) or "").startswith("transformers."):
        return False
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    if "num_items_in_batch" in source:
        return False
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return False
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    # Every mention of loss_function a call of it that hands on no ``**kwargs`` (none: it is not called).
    called_bare = {id(call.func) for call in calls if all(k.arg is not None for k in call.keywords)}
    mentions = [
        node
        for node in ast.walk(tree)
        if (isinstance(node, ast.Attribute) and node.attr == "loss_function")
        or (isinstance(node, ast.Name) and node.id == "loss_function")
    ]
    if any(id(node) not in called_bare for node in mentions):
        return False
    return not any(
        any(k.arg is None for k in call.keywords) and any(k.arg == "labels" for k in call.keywords) for call in calls
    )


def _no_deepspeed_save(save_dir: str, exclude_frozen_parameters: bool = False) -> None:
    """save_model's DeepSpeed save when `_save_optimizer_and_scheduler`'s follows into the same folder: none (the
    Trainer reads this signature for exclude_frozen_parameters)."""


def _log_resume(folder: str, *, saved: dict | None, decision: ResumeDecision | None, plan_reason: str) -> None:
    """Rank 0's lines of the resume `_check_resume` decided: the plan from the step it starts at, and the decision's
    notes (`saved`: the checkpoint's poplar state; None without one, where the Trainer's step count decides)."""
    _log_resumed_plan(folder, saved=saved, decision=decision, plan_reason=plan_reason)
    if saved is None:
        logger.info(
            "resume_from_checkpoint: the checkpoint holds no poplar-ext state; the Trainer's own "
            "step count decides where the data continues"
        )
    for note in decision.notes if decision is not None else ():
        logger.info("resume_from_checkpoint: %s", note)


def _device_of(job: Any, device_type: str) -> str:
    """`device_type` labelled real or emulated by the job's cluster (the type alone for a job without one)."""
    cluster = getattr(job, "cluster", None)
    return device_type if cluster is None else device_label(device_type, cluster.emulation_of(device_type))


def _log_resumed_plan(folder: str, *, saved: dict | None, decision: ResumeDecision | None, plan_reason: str) -> None:
    """Rank 0's line of the step a resume starts at and the plan from there (`saved`: the checkpoint's poplar state,
    None without one): the Trainer logged "poplar plan from step 0" when built, before it knew of the resume."""
    step = saved.get("step") if saved is not None else None
    if step is None:  # no poplar state (or one without the step): the Trainer resumes at its own state's step
        try:
            step = json.loads((Path(folder) / TRAINER_STATE_NAME).read_text()).get("global_step", 0)
        except (OSError, ValueError, AttributeError):  # the Trainer's own read of it fails next, naming what is wrong
            return
    reason = plan_reason
    if decision is not None and decision.continue_plan is not None:  # the plan the saved run had switched to
        reason = f"the checkpoint's last plan ({decision.plan_history[-1].get('reason', '')})"
    logger.info("poplar plan from step %s (resumed from %s): %s", step, folder, reason)


def _deepspeed_config(args: TrainingArguments) -> dict:
    """The DeepSpeed config the Trainer builds its engine from (this rank's, `_rank_arguments`)."""
    return getattr(getattr(args, "hf_deepspeed_config", None), "config", None) or {}


def _deepspeed_config_object(args: TrainingArguments) -> HfDeepSpeedConfig | None:
    """The Trainer's DeepSpeed config object (TrainingArguments builds one from its `deepspeed` argument; a
    PoplarTrainer, under DeepSpeed, always has one), None where there is none."""
    config = getattr(args, "hf_deepspeed_config", None)
    return config if isinstance(config, HfDeepSpeedConfig) else None


def _node_local(args: TrainingArguments) -> bool:
    """Whether the DeepSpeed config saves each node's part of a checkpoint into that node's own storage."""
    return bool(_deepspeed_config(args).get("checkpoint", {}).get("use_node_local_storage", False))


def _check_files(
    folder: Path,
    tag: str | None,
    saved: dict | None,
    args: TrainingArguments,
    *,
    model: Any,
    world_size: int,
    zero_stage: int | None = None,
) -> None:
    """Rank 0's refusals of the checkpoint files a Trainer resume would load: its scheduler.pt where the Trainer
    needs one (under a DeepSpeed config object), and what the engine's load refuses (`check_deepspeed_load`, strict
    as the Trainer loads: not for a PEFT model)."""
    if _deepspeed_config_object(args) is not None:
        _check_trainer_schedule(folder, args)
    if tag is None:
        return
    config = _deepspeed_config(args)
    check_deepspeed_load(
        folder,
        tag,
        saved,
        module=model,
        strict=not _is_peft_model(model),
        reads_optimizer=True,
        node_local=_node_local(args),
        bf16=training_dtype(config) == "bfloat16" if config else None,
        world_size=world_size,
        caller="resume_from_checkpoint",
        zero_stage=zero_stage,
    )


def _check_trainer_schedule(folder: Path, args: TrainingArguments) -> None:
    """ValueError where a resume from `folder` needs the Trainer's scheduler.pt and it has none.

    Under DeepSpeed the Trainer torch.loads it (on the same ranks, and after a resharded load) unless its scheduler
    is DeepSpeed's (a DeepSpeedSchedulerWrapper, whose state DeepSpeed's own files hold): transformers'
    deepspeed_optim_sched gives DeepSpeed the scheduler where the config has a 'scheduler' section, or an
    'optimizer' one (DeepSpeed then builds the Trainer's schedule itself)."""
    config = _deepspeed_config(args)
    if "scheduler" in config or "optimizer" in config or (folder / SCHEDULER_NAME).is_file():
        return
    if not folder.is_dir():  # named, and on no storage (`_whole_checkpoint`): the Trainer's own error names it
        return
    raise ValueError(
        f"resume_from_checkpoint: {folder}: expected {folder / SCHEDULER_NAME}, the Trainer's learning-rate schedule "
        "(a Trainer's checkpoints save it there where the DeepSpeed config has no 'scheduler' or 'optimizer' "
        "section, as this job's has none), found no such file: this folder was not written by a Trainer under such "
        "a config (a Trainer's checkpoint saved under a DeepSpeed config with a 'scheduler' or 'optimizer' section "
        "keeps the schedule in DeepSpeed's files instead, which a resume under a config without one does not read); "
        "resume it under the DeepSpeed config it was saved with"
    )


def _storage_rank(args: TrainingArguments, rank: int) -> int:
    """This rank's number among those writing its checkpoint storage, as DeepSpeed numbers them."""
    return args.local_process_index if _node_local(args) else rank


def _trained_state(trainer: Any) -> dict:
    """poplar-ext's state of `trainer`'s training run at its current step (a module function: the tests call
    `PoplarTrainerMixin._poplar_state` on stand-ins)."""
    step, engine, sampler = trainer.state.global_step, trainer.poplar_engine, trainer._train_sampler
    consumed = step * trainer.plan.global_batch_size
    state = poplar_client_state(
        trainer.plan,
        consumed_samples=consumed,
        data_position=consumed if sampler is None else sampler.iteration_start(step),
        **trainer.job.poplar_config.data_order,
        plan_history=trainer._plan_history if engine is None else engine.plan_history,
    )
    return {**state, "step": step, **({} if engine is None else engine.rebalancing_state())}


@ends_job_on_user_error  # a refusal of the checkpoint: every restart would meet it again, as the engines' loads
def _checkpoint_to_resume(trainer: Any, resume_from_checkpoint: str | bool) -> str | bool:
    """The checkpoint folder `trainer`'s ``train`` resumes (its `_check_resume`); ``True`` without one refused."""
    folder = trainer._check_resume(resume_from_checkpoint)
    if folder is None and resume_from_checkpoint is True:  # decided alike on every rank
        raise ValueError(f"No valid checkpoint found in output directory ({trainer.args.output_dir})")
    return folder or resume_from_checkpoint


def _resumable_here(named: str | bool, output_dir: str) -> list[tuple[str, str | None]] | str:
    """The checkpoint folders of this storage a resume may read, newest first (the one `named`; for ``True`` each
    ``checkpoint-N`` of `output_dir`), each with the file it lacks to be whole (None: whole; ``""``: no such
    folder); or, where they cannot be read, why.

    Whole: the Trainer's trainer_state.json, which it writes last, and, where a poplar-ext save began, ``latest``
    naming a tag folder with poplar_state.json (`unfinished_save`)."""
    try:
        if named is not True:
            folders = [Path(named)]
        else:
            entries = Path(output_dir).iterdir() if Path(output_dir).is_dir() else ()  # none yet: no checkpoint
            found = [(int(m[1]), p) for p in entries if (m := re.fullmatch(r"checkpoint-(\d+)", p.name))]
            folders = [p for _, p in sorted(found, reverse=True) if p.is_dir()]
        return [(str(folder), _lacking(folder)) for folder in folders]
    except (OSError, ValueError) as exc:  # said on every rank by `_whole_checkpoint`, not raised on this one alone
        return f"{type(exc).__name__}: {exc}"


def _lacking(folder: Path) -> str | None:
    """The file `folder` lacks to be a whole checkpoint (see `_resumable_here`), ``""`` for no such folder, or None."""
    if not folder.is_dir():
        return ""
    state = folder / TRAINER_STATE_NAME
    missing = unfinished_save(folder) or (None if state.is_file() else state)
    return None if missing is None else str(missing)


_NOT_A_TRAINER_CHECKPOINT = (
    ", or a folder no Trainer saved (engine.save_checkpoint writes no trainer_state.json): continue such a "
    "checkpoint with poplar_ext.initialize and engine.load_checkpoint"
)
"""Why a folder lacks only the Trainer's state file, besides a save that stopped before writing it."""


def _whole_checkpoint(named: str | bool, storages: list[tuple[int, list | str]]) -> str | None:
    """The checkpoint folder a resume reads, from what each storage's first rank found (`_resumable_here`; rank 0
    alone on storage the nodes share): the one `named`, refused (ValueError) when a save into it did not finish
    on some storage; for ``True``, the newest ``checkpoint-N`` whole on every storage, each newer one skipped with
    a warning (the Trainer's own pick is the highest N, whole or not, on each node), None when there is none."""
    unreadable = [(rank, view) for rank, view in storages if isinstance(view, str)]
    if unreadable:
        rank, why = unreadable[0]
        raise ValueError(f"resume_from_checkpoint: could not read the checkpoints on rank {rank}'s storage: {why}")
    views = [(rank, dict(view)) for rank, view in storages]
    names = {name for _, view in views for name in view}
    # A named folder as `_resumable_here` wrote it (a trailing "/" dropped).
    folders = (
        [str(Path(named))] if named is not True else sorted(names, key=lambda n: int(n.rsplit("-", 1)[1]), reverse=True)
    )
    where = (lambda rank: f" on rank {rank}'s storage") if len(views) > 1 else (lambda rank: "")
    for folder in folders:
        lacking = [(rank, view.get(folder, "")) for rank, view in views if view.get(folder, "") is not None]
        if not lacking or all(missing == "" for _, missing in lacking) and len(lacking) == len(views):
            return str(folder)  # whole everywhere; or named and nowhere: the Trainer's own error names it
        rank, missing = lacking[0]
        why = (
            f"{folder}: expected a whole checkpoint, found no such folder{where(rank)}"
            if missing == ""
            else f"{folder}: expected a whole checkpoint, found a save into it that did not finish "
            f"({missing} missing{where(rank)})"
        )
        # A folder named, perhaps by no Trainer: where some storage has the Trainer's file, a Trainer saved it.
        if named is not True and all((view.get(folder) or "").endswith(TRAINER_STATE_NAME) for _, view in views):
            why += _NOT_A_TRAINER_CHECKPOINT
        if folder == folders[-1]:
            raise ValueError(f"resume_from_checkpoint: {why}")
        logger.warning("resume_from_checkpoint: skipped %s; resuming from the newest whole one", why)
    return None


@dataclasses.dataclass(kw_only=True)
class _EvalRound:
    """Where a plan's evaluation loop is: its sampler, the round of the batch in hand, the loss so far."""

    sampler: EvalBatchSampler
    index: int = -1
    """The round whose batch the loop handles now (prediction_step counts them)."""
    loss_sum: float = 0.0
    """Sum over this rank's real batches of loss x what it is a mean over."""
    loss_count: float = 0.0
    """Sum over this rank's real batches of what their loss is a mean over (tokens or samples)."""


def _collate_each(collator: Any, micro_batches: list[list[Any]]) -> dict:
    """The data collator applied to each micro-batch of an iteration (`MicroBatchesDataset` items)."""
    return {MICRO_BATCHES: [collator(samples) for samples in micro_batches]}


def _dataset_and_collator(trainer: Any, dataset: Any, description: str) -> tuple[Any, Any]:
    """`dataset` and the data collator with the columns the model does not take removed, as the Trainer
    removes them for its own dataloaders (from a Hugging Face dataset, else in the collator)."""
    datasets = sys.modules.get("datasets")  # not imported: `dataset` is none of its
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        return trainer._remove_unused_columns(dataset, description=description), trainer.data_collator
    return dataset, trainer._get_collator_with_removed_columns(trainer.data_collator, description=description)


def _eval_sampler_of(loader: Any) -> EvalBatchSampler | None:
    """The plan's evaluation sampler under a prepared dataloader's wrappers, or None."""
    sampler = getattr(loader, "batch_sampler", None)
    for _ in range(3):  # accelerate's shard wrapper, and its skip wrapper
        if sampler is None or isinstance(sampler, EvalBatchSampler):
            return sampler
        sampler = getattr(sampler, "batch_sampler", None)
    return None


def _map_tensors(fn: Any, data: Any) -> Any:
    """`data` (tensors in lists, tuples and dicts, as a model's outputs nest them) with `fn` applied to each tensor."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, dict):
        return type(data)({key: _map_tensors(fn, value) for key, value in data.items()})
    if isinstance(data, (list, tuple)):
        return type(data)(_map_tensors(fn, value) for value in data)
    return data


def _micro_batches_of(items: list) -> list:
    """`items` with each optimizer step's bundle (`MICRO_BATCHES`) replaced by its micro-batches."""
    out: list = []
    for item in items:
        bundle = item.get(MICRO_BATCHES) if isinstance(item, dict) else None
        out.extend([item] if bundle is None else bundle)
    return out


class PoplarTrainer(PoplarTrainerMixin, Trainer):
    """``transformers.Trainer`` training the plan of the DeepSpeed config's ``poplar`` section.

    Same arguments as ``Trainer``; ``args.deepspeed`` must name a DeepSpeed config (file
    or dict) with a ``poplar`` section. See docs/trainer.md for what differs.
    ``self.plan`` is the plan every rank runs; ``self.args`` are this rank's arguments."""


__all__ = ["PoplarTrainer", "PoplarTrainerMixin"]
