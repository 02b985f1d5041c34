"""`PoplarSFTTrainer`, `PoplarDPOTrainer`, `PoplarRewardTrainer`: TRL's trainers on a plan, the loss weighted to the
global batch as each trainer declares it, what cannot be exact refused; the only importer of trl
(``pip install 'poplar-ext[trl]'``).
See docs/trainer.md (refused settings, TRL's logged metrics)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from trl import DPOTrainer, RewardTrainer, SFTTrainer

from poplar_ext.collectives import gather_objects
from poplar_ext.elastic import ends_job_on_user_error
from poplar_ext.integrations.transformers import PoplarTrainerMixin, named_arguments

# DPO loss types whose value for a pair depends on the other pairs of its micro-batch.
_MICRO_BATCH_DPO_LOSSES = {
    "aot": "sorts the log-ratios over the micro-batch, pairing each with another pair's",
    "aot_unpaired": "sorts the log-ratios over the micro-batch, pairing each with another pair's",
    "sft": "averages over the micro-batch's chosen tokens (a token mean per micro-batch, not per sample)",
}


class _LocalMetrics(PoplarTrainerMixin):
    """TRL's metric gathers kept on this rank while training (see docs/trainer.md)."""

    _trl_metrics_on_each_rank = True

    @contextlib.contextmanager
    def _metrics_on_this_rank(self) -> Iterator[None]:
        if not self.model.training and self._eval_round is None:
            yield
            return
        # Under a plan, ranks take different numbers of micro-steps of different sizes: a gather per micro-step would
        # pair one rank's k-th micro-step with another's k-th of another optimizer step, wait for one that never comes,
        # or meet other shapes. Evaluating, every rank runs one batch per round, of its own size: gathered whole.
        gather = (lambda data, use_gather_object=False: data) if self.model.training else self.gather_round_metrics
        self.accelerator.gather_for_metrics = gather
        self.accelerator.gather = gather
        try:
            yield
        finally:
            del self.accelerator.gather_for_metrics, self.accelerator.gather  # the class's methods again

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """TRL's training metrics of every rank, merged (`merged_training_metrics`), before TRL averages and
        logs them. Every rank logs at the same steps (the Trainer's logging), so the gather meets."""
        metrics = getattr(self, "_metrics", None)
        if metrics is not None and self.model.training and metrics.get("train"):
            mine = {key: (float(sum(values)), len(values)) for key, values in metrics["train"].items()}
            metrics["train"].clear()
            metrics["train"].update(merged_training_metrics(gather_objects(mine)))
        elif _is_evaluation_log(logs) and metrics is not None and _running_totals_in(metrics.get("eval")):
            # TRL logs its training token count with the evaluation's metrics too: this rank's share of it, since
            # training kept it per rank. Every rank logs an evaluation (`evaluate`), so the gather meets; other
            # logs (after predict(), which logs nothing, a user's own on one rank) start no collective.
            totals = {key: (float(metrics["eval"][key][-1]), 1) for key in _running_totals_in(metrics["eval"])}
            metrics["eval"].update(merged_training_metrics(gather_objects(totals)))
        super().log(logs, *args, **kwargs)

    def compute_loss(
        self, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        with self._metrics_on_this_rank():
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )

    def _profiling_collator(self, data_collator: Any, train_dataset: Any) -> Any:
        """A collator that refuses: the automatic mode profiles micro-batches of the data set as given, before
        TRL's ``__init__`` tokenizes it and builds its collator (and a DPO step is not the model's own loss)."""
        trainer = type(self).__name__

        def refuse(samples: list) -> Any:
            raise ValueError(
                f"{trainer}: the DeepSpeed config's poplar section has no plan, so the plan is searched from profiles "
                "measured on micro-batches of train_dataset before the trainer is built, and TRL prepares its data "
                "(tokens, collator) only while it is built: expected poplar.plan (a plan file: poplar-search "
                "--profiles DIR --cluster FILE --output plan.json, or one written by hand), found none"
            )

        return refuse


RUNNING_TOTALS = ("num_tokens",)
"""TRL metrics that are a running count on each rank: the job's is their sum over the ranks."""


def _is_evaluation_log(logs: Any) -> bool:
    """Whether `logs` are an evaluation's metrics (``evaluate``'s, whatever its ``metric_key_prefix``): the Trainer
    adds ``<prefix>_runtime`` to them, and ``train_runtime`` to training's summary alone."""
    return isinstance(logs, dict) and any(str(k).endswith("_runtime") and k != "train_runtime" for k in logs)


def _running_totals_in(metrics: Any) -> list[str]:
    """The `RUNNING_TOTALS` TRL keeps in `metrics` (one mode's lists), in that order."""
    return [key for key in RUNNING_TOTALS if metrics and metrics.get(key)]


def merged_training_metrics(every_rank: list[dict[str, tuple[float, int]]]) -> dict[str, list[float]]:
    """TRL's metric lists from each rank's ``{key: (sum of its values, how many)}``: a running total summed
    over the ranks, any other metric the mean over every micro-step of every rank (TRL's own is the mean
    over its micro-steps of values gathered from every rank)."""
    merged: dict[str, list[float]] = {}
    for key in sorted({key for rank in every_rank for key in rank}):
        parts = [rank[key] for rank in every_rank if key in rank]
        total, count = sum(p[0] for p in parts), sum(p[1] for p in parts)
        if key in RUNNING_TOTALS:
            merged[key] = [total]
        elif count:
            merged[key] = [total / count]
    return merged


class PoplarSFTTrainer(_LocalMetrics, SFTTrainer):
    """``trl.SFTTrainer`` training the plan of the DeepSpeed config's ``poplar`` section.

    Same arguments as ``SFTTrainer`` (by keyword); see docs/trainer.md. Padding-free batches (``padding_free``, or
    ``packing`` with a ``bfd`` strategy) need an attention that keeps the sequences of a flattened micro-batch apart
    (flash attention), or they are refused."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = named_arguments([SFTTrainer], args, kwargs)
        model, config = given.get("model"), given.get("args")
        # From the arguments, before the plan is resolved on every rank (a collective).
        _refuse_padding_free_across_sequences(config, _attention_to_be(model, config))
        super().__init__(*args, **kwargs)
        if isinstance(model, str):  # the model TRL loaded: its attention as it came out
            _refuse_padding_free_across_sequences(self.args, _attention_to_be(self.model, self.args))

    def _profiling_collator(self, data_collator: Any, train_dataset: Any) -> Any:
        """Your collator where your data set is already tokens (``input_ids``), as TRL then takes it; else refused."""
        # Only a map-style data set has a first sample to look at; `_settle_job` refuses any other with its reason.
        map_style = hasattr(train_dataset, "__len__") and hasattr(train_dataset, "__getitem__")
        first = train_dataset[0] if map_style and len(train_dataset) else {}
        if data_collator is not None and isinstance(first, dict) and "input_ids" in first:
            return data_collator
        return super()._profiling_collator(data_collator, train_dataset)


def _attention_to_be(model: Any, args: Any) -> str | None:
    """The attention implementation the model has, or, for a model TRL will load from a name, the one
    ``SFTConfig.model_init_kwargs`` asks for ('None': transformers' default, which is not flash)."""
    if model is None:
        return None
    if isinstance(model, str):
        return str((getattr(args, "model_init_kwargs", None) or {}).get("attn_implementation"))
    return str(getattr(getattr(model, "config", None), "_attn_implementation", None))


@ends_job_on_user_error
def _refuse_padding_free_across_sequences(args: Any, attention: str | None) -> None:
    """Padding-free batches flatten a micro-batch into one row; an attention that does not keep its sequences apart lets
    each attend to the others of its micro-batch, so the loss depends on how the global batch is split (which poplar-ext
    changes per rank). Refused before the mixin's refusals, and as they do, it ends a restarting launcher's job."""
    if args is None or attention is None:
        return
    strategy = getattr(args, "packing_strategy", None)
    padding_free = getattr(args, "padding_free", False) or (
        getattr(args, "packing", False) and strategy in {"bfd", "bfd_split"}
    )
    if padding_free and "flash" not in attention:
        what = "padding_free=True" if args.padding_free else f"packing=True with packing_strategy={strategy!r}"
        raise ValueError(
            f"PoplarSFTTrainer: SFTConfig: {what} flattens each micro-batch into one sequence, and the model's "
            f"attention ({attention!r}) lets its sequences attend to each other, so the gradients depend on how "
            "the global batch is split into micro-batches (which differs per rank): expected a flash attention "
            "implementation, or packing_strategy='wrapped', or padding_free=False"
        )


class PoplarDPOTrainer(_LocalMetrics, DPOTrainer):
    """``trl.DPOTrainer`` training the plan of the DeepSpeed config's ``poplar`` section.

    Same arguments as ``DPOTrainer`` (pass ``ref_model`` or let TRL build it); a loss type that
    compares the pairs of a micro-batch is refused."""

    @ends_job_on_user_error  # as the mixin's refusals, which come after this one's
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        config = named_arguments([DPOTrainer], args, kwargs).get("args")
        # The batch sizes as given, before the plan makes them each rank's own (`_precompute_ref_logps`).
        self._precompute_batch_sizes = (
            getattr(config, "per_device_train_batch_size", None),
            getattr(config, "per_device_eval_batch_size", None),
        )
        loss_types = getattr(config, "loss_type", None) or []
        for loss_type in [loss_types] if isinstance(loss_types, str) else loss_types:
            if loss_type in _MICRO_BATCH_DPO_LOSSES:
                raise ValueError(
                    f"PoplarDPOTrainer: DPOConfig.loss_type: expected losses computed per pair, found {loss_type!r}, "
                    f"which {_MICRO_BATCH_DPO_LOSSES[loss_type]}: its gradient depends on how the global batch is "
                    "split into micro-batches, so no per-rank split equals one device training the global batch"
                )
        super().__init__(*args, **kwargs)

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        """TRL's, in batches of one size on every rank. TRL batches a set of its own (accelerate's even split, each
        batch gathered from every rank) in ``precompute_ref_batch_size`` or else this rank's
        ``per_device_*_batch_size``, which the plan makes differ per rank (the gathers would not match): without
        ``precompute_ref_batch_size`` the batch size given in the arguments, as the plain trainer uses it. A set held
        in memory on several ranks is refused on every rank alike (`_refuse_a_set_in_memory`)."""
        _refuse_a_set_in_memory(dataset, name, self.accelerator.num_processes)
        if self.args.precompute_ref_batch_size is None:
            train, evaluation = self._precompute_batch_sizes
            batch_size = train if dataset is self.train_dataset else evaluation
        return super()._precompute_ref_logps(dataset, name, batch_size)


class PoplarRewardTrainer(_LocalMetrics, RewardTrainer):
    """``trl.RewardTrainer`` training the plan of the DeepSpeed config's ``poplar`` section.

    Same arguments as ``RewardTrainer``; its loss (with ``margin`` and ``center_rewards_coefficient`` too) is a mean
    over a micro-batch's pairs (``loss_is_scaled_for_ga`` False), weighted ``W * b_r / B``. Its metric gathers
    (rewards, accuracy, margin, token count) are kept per rank while training and merged when the Trainer logs, as
    the other TRL trainers'; with ``PoplarTrainerMixin`` alone the ranks' gathers met with other shapes or never."""


def _refuse_a_set_in_memory(dataset: Any, name: str, ranks: int) -> None:
    """TRL writes the precomputed reference log-probs to the set's cache file on the main process, and every rank
    reads them from it: a set held in memory has that file in a temporary folder of each process's own, where the
    other ranks failed on it ("Failed to open local file '/tmp/hf_datasets-.../cache-....arrow'")."""
    if ranks > 1 and getattr(dataset, "cache_files", None) == []:
        others = "the other rank does" if ranks == 2 else f"the other {ranks - 1} ranks do"
        raise ValueError(
            f"PoplarDPOTrainer: DPOConfig.precompute_ref_log_probs: expected the {name} data set in files every "
            "rank reads (TRL writes the reference log-probs into its cache file on the first rank, and every rank "
            "reads them from there), found one held in memory, whose cache file goes to a temporary folder of each "
            f"process's own, where {others} not find the first rank's; give a set saved to disk "
            "(save_to_disk, then datasets.load_from_disk) or loaded from files, or set precompute_ref_log_probs=False"
        )


__all__ = ["PoplarDPOTrainer", "PoplarRewardTrainer", "PoplarSFTTrainer"]
