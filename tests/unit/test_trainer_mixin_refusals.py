"""What PoplarTrainerMixin refuses from the Trainer subclass it is mixed into, before anything is built."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="PoplarTrainerMixin needs pip install 'poplar-ext[hf]'")

from _dataset_checks import Settling, counted_dataset_checks  # noqa: E402
from transformers import Trainer  # noqa: E402

from poplar_ext.integrations.transformers import PoplarTrainerMixin  # noqa: E402

pytestmark = pytest.mark.usefixtures("in_tmp_path")  # the Trainer creates output_dir

ACCELERATE_USE_DEEPSPEED_BEFORE_ANY_TEST = os.environ.get("ACCELERATE_USE_DEEPSPEED")  # read at collection


class CurriculumTrainer(Trainer):
    def _get_train_sampler(self, train_dataset=None):
        return None


class OwnLoaderTrainer(Trainer):
    def get_train_dataloader(self):
        return None


@pytest.mark.parametrize("base", [CurriculumTrainer, OwnLoaderTrainer])
def test_a_subclass_choosing_its_own_training_batches_is_refused(base):
    name = "_get_train_sampler" if base is CurriculumTrainer else "get_train_dataloader"

    class Mixed(PoplarTrainerMixin, base):
        pass

    with pytest.raises(ValueError, match=f"Mixed: {base.__name__}.{name}: expected the Trainer's own"):
        Mixed(model=None, args=None)


def test_a_class_derived_from_the_mixed_one_may_wrap_the_plans_loader():
    # Above the mixin in the MRO: it calls super() and gets the plan's loader (tests/dist/test_trl.py
    # records the batches so); only the missing deepspeed config stops this one.
    class Mixed(PoplarTrainerMixin, Trainer):
        pass

    class Recording(Mixed):
        def get_train_dataloader(self):
            return super().get_train_dataloader()

    with pytest.raises(ValueError, match=r"Recording: expected TrainingArguments\(deepspeed=...\)"):
        Recording(model=None, args=None)


def _arguments_of_a_settled_job(monkeypatch, arguments: dict, section: dict):
    """TrainingArguments with `arguments` and the poplar `section`, and `_settle_job` replaced by a one-rank
    job of that section (no process group)."""
    from pathlib import Path
    from types import SimpleNamespace

    from poplar_ext.integrations import transformers as integration
    from poplar_ext.plan.formats import plan_from_dict
    from poplar_ext.runtime.config import poplar_config_from_dict

    plan = plan_from_dict(
        {
            "schema_version": 1,
            "policy": "uniform",
            "zero_stage": 0,
            "global_batch_size": 4,
            "ranks": [{"rank": 0, "device_type": "cpu", "micro_batch_size": 2, "gradient_accumulation_steps": 2}],
            "predicted": {"iteration_time_s": 1.0, "samples_per_s": 4.0, "ideal_samples_per_s": 4.0},
            "profile_fingerprints": {},
        },
        source="test",
    )
    config = poplar_config_from_dict({"plan": "p.json", **section}, base_dir=Path("."))
    job = SimpleNamespace(
        plan=plan,
        rank=0,
        world_size=1,
        poplar_config=config,
        plan_reason="the plan file p.json",
        ds_config={"zero_optimization": {"stage": 0}},
    )
    monkeypatch.setattr(integration, "_settle_job", lambda *args, **kwargs: job)
    return _training_arguments(arguments, section)


def _training_arguments(arguments: dict, section: dict):
    """TrainingArguments with `arguments` and a DeepSpeed config whose poplar section is `section`."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir="unused",
        use_cpu=True,
        deepspeed={"zero_optimization": {"stage": 0}, "poplar": section},
        report_to=[],
        **arguments,
    )


@pytest.mark.parametrize(
    ("arguments", "section", "match"),
    [
        (
            {"dataloader_drop_last": True},
            {},
            r"dataloader_drop_last: expected False while poplar\.drop_last is false .* found True; "
            r"set poplar\.drop_last true",
        ),
        ({"data_seed": 7}, {"seed": 3}, r"data_seed: expected None or poplar\.seed \(3\) .* found 7; set poplar\.seed"),
        (
            {"train_sampling_strategy": "sequential"},
            {},
            r"train_sampling_strategy: expected 'random' while poplar\.shuffle is true .* found 'sequential'; "
            r"set poplar\.shuffle false",
        ),
        (
            {"train_sampling_strategy": "group_by_length"},
            {},
            r"train_sampling_strategy: expected 'random' or 'sequential' .* found 'group_by_length'",
        ),
    ],
)
def test_training_arguments_choosing_the_data_order_are_refused_before_the_job_is_settled(
    monkeypatch, arguments, section, match
):
    # The automatic mode (no plan) would profile every device type while the job is settled: the
    # refusal comes first, and ends a restarting launcher's job (the same at every restart).
    import torch

    import poplar_ext.elastic as elastic
    from poplar_ext.integrations import transformers as integration
    from poplar_ext.integrations.transformers import PoplarTrainer

    def settle(*args, **kwargs):
        raise AssertionError("the job was settled (profiled, in the automatic mode) before the refusal")

    monkeypatch.setattr(integration, "_settle_job", settle)
    monkeypatch.setattr(integration, "prepare_job", settle)
    ended: list[BaseException] = []
    monkeypatch.setattr(elastic, "end_restarting_launcher", ended.append)
    args = _training_arguments(arguments, section)
    with pytest.raises(ValueError, match=match) as refused:
        PoplarTrainer(model=torch.nn.Linear(2, 1), args=args, train_dataset=[{"x": 1}] * 8)
    assert ended == [refused.value]


def test_auto_find_batch_size_is_refused_before_the_job_is_settled(monkeypatch):
    # After an out-of-memory error only that rank would halve its batch and retry, the plan's sampler keeping its
    # micro-batch and the other ranks waiting in collectives: refused on every rank alike, before any collective.
    import torch

    import poplar_ext.elastic as elastic
    from poplar_ext.integrations import transformers as integration
    from poplar_ext.integrations.transformers import PoplarTrainer

    def settle(*args, **kwargs):
        raise AssertionError("the job was settled before the refusal")

    monkeypatch.setattr(integration, "_settle_job", settle)
    ended: list[BaseException] = []
    monkeypatch.setattr(elastic, "end_restarting_launcher", ended.append)
    args = _training_arguments({"auto_find_batch_size": True}, {})
    match = (
        r"TrainingArguments\.auto_find_batch_size: expected False with a poplar plan \(the plan already sizes each "
        r"rank's micro-batch to its device's memory\), found True; leave it False"
    )
    with pytest.raises(ValueError, match=match) as refused:
        PoplarTrainer(model=torch.nn.Linear(2, 1), args=args, train_dataset=[{"x": 1}] * 8)
    assert ended == [refused.value]


def test_the_refusals_before_settling_end_a_restarting_launchers_job(monkeypatch):
    import poplar_ext.elastic as elastic
    from poplar_ext.integrations.transformers import PoplarTrainer

    ended: list[BaseException] = []
    monkeypatch.setattr(elastic, "end_restarting_launcher", ended.append)
    with pytest.raises(ValueError, match=r"expected TrainingArguments\(deepspeed=...\)") as refused:
        PoplarTrainer(model=None, args=None)
    assert ended == [refused.value]


@pytest.mark.parametrize(
    ("positional", "keywords", "match"),
    [((None,), {"model": None}, "got multiple values for argument 'model'"), ((None,) * 30, {}, "too many")],
)
def test_arguments_python_refuses_end_a_restarting_launchers_job(monkeypatch, positional, keywords, match):
    # Refused while the arguments are named, before the job is settled: the same at every restart.
    import poplar_ext.elastic as elastic
    from poplar_ext.integrations.transformers import PoplarTrainer

    ended: list[BaseException] = []
    monkeypatch.setattr(elastic, "end_restarting_launcher", ended.append)
    with pytest.raises(TypeError, match=match) as refused:
        PoplarTrainer(*positional, **keywords)
    assert ended == [refused.value]


def test_the_trainers_own_refusals_after_settling_end_a_restarting_launchers_job(monkeypatch):
    import torch

    import poplar_ext.elastic as elastic
    from poplar_ext.integrations.transformers import PoplarTrainer

    args = _arguments_of_a_settled_job(monkeypatch, {}, {})
    ended: list[BaseException] = []
    monkeypatch.setattr(elastic, "end_restarting_launcher", ended.append)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'") as refused:
        PoplarTrainer(model=torch.nn.Linear(2, 1), args=args, bogus=1)
    assert ended == [refused.value]


@pytest.mark.parametrize(
    ("arguments", "section"),
    [
        ({"dataloader_drop_last": True}, {"drop_last": True}),
        ({"data_seed": 3}, {"seed": 3}),
        ({"data_seed": 0}, {}),
        ({"train_sampling_strategy": "sequential"}, {"shuffle": False}),
    ],
)
def test_training_arguments_saying_what_the_poplar_section_says_are_taken(monkeypatch, arguments, section):
    from poplar_ext.integrations.transformers import PoplarTrainer

    args = _arguments_of_a_settled_job(monkeypatch, arguments, section)
    # Past the data order: the Trainer's own refusal of a missing model.
    with pytest.raises(RuntimeError, match="requires either a `model` or `model_init`"):
        PoplarTrainer(model=None, args=args)


class _Settled(Exception):
    """What `_settle_job` was given: the arguments as the mixin read them."""


def _capture_settle_job(monkeypatch):
    from poplar_ext.integrations import transformers as integration

    def settle(args, model, train_dataset, *, collate_fn, configured):
        raise _Settled({"args": args, "model": model, "train_dataset": train_dataset, "collate_fn": collate_fn})

    monkeypatch.setattr(integration, "_settle_job", settle)


def test_arguments_by_position_are_read_in_the_mixed_trainers_order(monkeypatch):
    # Trainer(model, args, data_collator, train_dataset): the third is the collator, not the data.
    from transformers import TrainingArguments

    from poplar_ext.integrations.transformers import PoplarTrainer

    _capture_settle_job(monkeypatch)
    args = TrainingArguments(
        output_dir="unused", use_cpu=True, deepspeed={"zero_optimization": {"stage": 0}, "poplar": {}}, report_to=[]
    )
    model, collator, dataset = object(), object(), [1, 2]
    with pytest.raises(_Settled) as settled:
        PoplarTrainer(model, args, collator, dataset)
    given = settled.value.args[0]
    assert (given["model"], given["args"], given["collate_fn"], given["train_dataset"]) == (
        model,
        args,
        collator,
        dataset,
    )


def test_a_trainer_subclass_passing_args_on_is_read_in_the_trainers_order(monkeypatch):
    # class MyTrainer(Trainer): def __init__(self, *args, alpha=1.0, **kwargs): its *args are the Trainer's.
    from transformers import TrainingArguments

    class Weighted(Trainer):
        def __init__(self, *args, alpha=1.0, **kwargs):
            super().__init__(*args, **kwargs)

    class Mixed(PoplarTrainerMixin, Weighted):
        pass

    _capture_settle_job(monkeypatch)
    args = TrainingArguments(
        output_dir="unused", use_cpu=True, deepspeed={"zero_optimization": {"stage": 0}, "poplar": {}}, report_to=[]
    )
    model, collator, dataset = object(), object(), [1, 2]
    with pytest.raises(_Settled) as settled:
        Mixed(model, args, collator, dataset, alpha=2.0)
    given = settled.value.args[0]
    assert (given["args"], given["collate_fn"], given["train_dataset"]) == (args, collator, dataset)


def test_a_dpo_trainers_config_by_position_is_its_third_argument(monkeypatch):
    # DPOTrainer(model, ref_model, args, ...): the second is the reference model.
    pytest.importorskip("trl", reason="TRL's trainers need pip install 'poplar-ext[trl]'")
    from trl import DPOConfig

    from poplar_ext.integrations.trl import PoplarDPOTrainer

    _capture_settle_job(monkeypatch)
    config = DPOConfig(
        output_dir="unused", use_cpu=True, deepspeed={"zero_optimization": {"stage": 0}, "poplar": {}}, report_to=[]
    )
    model, reference = object(), object()
    with pytest.raises(_Settled) as settled:
        PoplarDPOTrainer(model, reference, config)
    assert (settled.value.args[0]["model"], settled.value.args[0]["args"]) == (model, config)


def test_a_train_dataset_without_indices_is_named_as_given(monkeypatch):
    # Refused before the job is settled, as train_dataset (not poplar_ext.initialize's training_data).
    import torch

    from poplar_ext.integrations import transformers as integration
    from poplar_ext.integrations.transformers import PoplarTrainer

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from range(8)

    def settle(*args, **kwargs):
        raise AssertionError("the job was settled")

    monkeypatch.setattr(integration, "prepare_job", settle)
    args = _training_arguments({}, {})
    with pytest.raises(ValueError, match=r"^train_dataset: expected a map-style dataset .* found Stream"):
        PoplarTrainer(model=torch.nn.Linear(2, 1), args=args, train_dataset=Stream())


@pytest.mark.parametrize("sized", [False, True], ids=["no len", "IterableDataset with len"])
@pytest.mark.parametrize(
    ("given", "loader"),
    [
        ("eval_dataset", lambda trainer, stream: trainer.get_eval_dataloader(stream)),
        ("eval_dataset['held_out']", lambda trainer, stream: trainer.get_eval_dataloader("held_out")),
        ("test_dataset", lambda trainer, stream: trainer.get_test_dataloader(stream)),
    ],
    ids=["eval_dataset", "eval_dataset by name", "test_dataset"],
)
def test_an_evaluation_data_set_without_indices_is_named_as_given(monkeypatch, sized, given, loader):
    # The check train_dataset has (runtime.data's): an IterableDataset with __len__ has no indices either.
    import torch

    from poplar_ext.integrations.transformers import PoplarTrainer

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from range(8)

    stream = type("Stream", (Stream,), {"__len__": lambda self: 8})() if sized else Stream()
    args = _arguments_of_a_settled_job(monkeypatch, {}, {})
    trainer = PoplarTrainer(model=torch.nn.Linear(2, 1), args=args, eval_dataset={"held_out": stream})
    with pytest.raises(ValueError, match=rf"^{re.escape(given)}: expected a map-style dataset .* found Stream, "):
        loader(trainer, stream)


def test_predicting_without_a_test_dataset_is_refused_by_name(monkeypatch):
    # As the Trainer refuses evaluating without an eval_dataset, not a TypeError from len(None).
    import torch

    from poplar_ext.integrations.transformers import PoplarTrainer

    args = _arguments_of_a_settled_job(monkeypatch, {}, {})
    trainer = PoplarTrainer(model=torch.nn.Linear(2, 1), args=args)
    with pytest.raises(ValueError, match=r"^Trainer: prediction requires a test_dataset\.$"):
        trainer.get_test_dataloader(None)


def test_the_deepspeed_config_and_its_poplar_section_are_read_once(monkeypatch):
    # Read before the job is settled (to refuse TrainingArguments from it), then handed to prepare_job.
    from unittest import mock

    import torch

    import poplar_ext.zero.initialize as zero_initialize
    from poplar_ext import collectives
    from poplar_ext.integrations import transformers as integration
    from poplar_ext.integrations.transformers import PoplarTrainer
    from poplar_ext.runtime import config, job_start

    load = mock.Mock(wraps=config.load_deepspeed_config)
    section = mock.Mock(wraps=job_start.poplar_config_from_dict)
    monkeypatch.setattr(integration, "load_deepspeed_config", load)
    monkeypatch.setattr(zero_initialize, "load_deepspeed_config", load)
    monkeypatch.setattr(job_start, "poplar_config_from_dict", section)

    class Settling(Exception):
        """prepare_job went past the section to the process group."""

    def join_job(**options):
        raise Settling

    monkeypatch.setattr(zero_initialize, "join_job", join_job)
    monkeypatch.setattr(collectives, "process_group_rank", lambda: (0, 1))  # one process, no process group
    with pytest.raises(Settling):
        PoplarTrainer(model=torch.nn.Linear(2, 1), args=_training_arguments({}, {}), train_dataset=[{"x": 1}] * 8)
    assert (load.call_count, section.call_count) == (1, 1)


def test_the_train_dataset_is_checked_once(monkeypatch):
    # prepare_job runs (up to the process group): train_dataset, checked in its own words before the job is
    # settled, is not checked again in poplar_ext.initialize's (training_data).
    import torch

    from poplar_ext import collectives
    from poplar_ext.integrations import transformers as integration
    from poplar_ext.integrations.transformers import PoplarTrainer

    checked = counted_dataset_checks(monkeypatch, integration)
    monkeypatch.setattr(collectives, "process_group_rank", lambda: (0, 1))  # one process, no process group
    with pytest.raises(Settling):
        PoplarTrainer(model=torch.nn.Linear(2, 1), args=_training_arguments({}, {}), train_dataset=[{"x": 1}] * 8)
    assert checked == ["train_dataset"]


def test_a_trainer_that_sees_fewer_processes_than_launched_is_refused_before_planning(monkeypatch):
    # Launched as 2 on CPU without ddp_backend="gloo": accelerate builds no process group, the Trainer
    # counts 1 process and would give DeepSpeed that one's batch; each rank would have planned alone.
    from types import SimpleNamespace

    import poplar_ext.collectives as collectives
    from poplar_ext.integrations import transformers as integration

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(collectives, "process_group_rank", lambda: (0, 2))
    arguments = SimpleNamespace(device="cpu", world_size=1)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "PoplarTrainer: expected the 2 processes of WORLD_SIZE in TrainingArguments.world_size, found 1"
        )
        + r".*pass TrainingArguments\(use_cpu=True, ddp_backend='gloo'\)",
    ):
        integration._settle_job(arguments, None, list(range(8)), collate_fn=None, configured=None)


@pytest.mark.parametrize(("precision", "dtype"), [(False, "float32"), (True, "float16")])
def test_the_job_trains_in_the_precision_the_trainer_fills_in_for_auto(monkeypatch, precision, dtype):
    # Hugging Face's own configs say "enabled": "auto" for fp16 and bf16 alike; read as they stand, "auto" was
    # bf16 for the device check: a V100 (7.0) training in fp32 or fp16 was refused as below bf16's 8.0.
    from types import SimpleNamespace

    import poplar_ext.collectives as collectives
    from poplar_ext.hardware.discovery import DeviceFacts, check_device_support
    from poplar_ext.integrations import transformers as integration
    from poplar_ext.profiler.measure import training_dtype

    section = {"plan": "p.json"}
    config = {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 1}}
    from transformers import TrainingArguments

    # TrainingArguments fills "auto" from its own fields (fp16=True, refused on a CPU, set as it fills it on a GPU).
    filled = TrainingArguments(output_dir="unused", use_cpu=True, deepspeed={**config, "poplar": section}, report_to=[])
    assert filled.hf_deepspeed_config.config["bf16"]["enabled"] is False
    if precision:
        filled.hf_deepspeed_config.config["fp16"]["enabled"] = True
    monkeypatch.setattr(collectives, "process_group_rank", lambda: (0, 1))
    seen = {}

    def prepare_job(loaded, **_):
        seen["ds_config"] = loaded[0]
        raise Settling

    monkeypatch.setattr(integration, "prepare_job", prepare_job)
    arguments = SimpleNamespace(
        device="cpu",
        world_size=1,
        hf_deepspeed_config=filled.hf_deepspeed_config,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
    )
    from poplar_ext.runtime.config import poplar_config_from_dict

    loaded = (config, Path("."), "ds_config.json")
    with pytest.raises(Settling):
        integration._settle_job(
            arguments,
            None,
            list(range(8)),
            collate_fn=None,
            configured=(loaded, poplar_config_from_dict(section, base_dir=Path("."))),
        )
    assert training_dtype(seen["ds_config"]) == dtype
    v100 = DeviceFacts(
        rank=0,
        host="h",
        node="h/x/y",
        device_type="V100-16GB",
        hardware="Tesla V100-SXM2-16GB",
        memory_bytes=16 * 2**30,
        device_id="u",
        compute_capability=(7, 0),
        cuda_arch_list=("sm_70",),
    )
    check_device_support([v100], bf16=training_dtype(seen["ds_config"]) == "bfloat16", source="ds_config.json")


def test_a_train_dataset_smaller_than_the_global_batch_is_refused_before_the_trainer_is_built(monkeypatch):
    # Not at train(), after the Trainer (and in the automatic mode the profiling) is done, as "num_samples" alone.
    from types import SimpleNamespace

    import poplar_ext.collectives as collectives
    from poplar_ext.integrations import transformers as integration

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(collectives, "process_group_rank", lambda: (0, 1))
    job = SimpleNamespace(plan=SimpleNamespace(global_batch_size=10))
    monkeypatch.setattr(integration, "prepare_job", lambda *args, **kwargs: job)
    arguments = SimpleNamespace(
        device="cpu", world_size=1, per_device_train_batch_size=2, gradient_accumulation_steps=1
    )
    message = r"^train_dataset: num_samples: expected at least the global batch \(10 samples\), found 5"
    with pytest.raises(ValueError, match=message):
        integration._settle_job(arguments, None, list(range(5)), collate_fn=None, configured=(({}, ".", "ds"), None))
    assert integration._settle_job(arguments, None, list(range(10)), collate_fn=None, configured=(({}, ".", "d"), None))


def test_a_deepspeed_config_with_its_own_global_batch_is_not_refused_for_the_arguments_batch(monkeypatch):
    # train_batch_size 10 in the config is the job's global batch (docs/training.md; per_device_train_batch_size x
    # gradient_accumulation_steps x ranks only where the config has none), which the plan splits per rank. Hugging
    # Face's own check of that config against the arguments (8 x 1 x 1 here), run for the profiling config,
    # refused it: "ds train_batch_size=10 vs hf train_batch_size (calculated)=8". Its other checks stay.
    from types import SimpleNamespace

    import torch
    from transformers import TrainingArguments

    import poplar_ext.collectives as collectives
    from poplar_ext.integrations import transformers as integration
    from poplar_ext.integrations.transformers import PoplarTrainer

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(collectives, "process_group_rank", lambda: (0, 1))
    job = SimpleNamespace(plan=SimpleNamespace(global_batch_size=10))
    asked = {}

    def prepare_job(loaded, **options):
        asked.update(batch=loaded[0]["train_batch_size"], profiling=options["profiling_ds_config"])
        return job

    monkeypatch.setattr(integration, "prepare_job", prepare_job)

    def arguments(**config):
        auto = dict.fromkeys(("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"), "auto")
        deepspeed = {**auto, "zero_optimization": {"stage": 0}, "poplar": {}, **config}
        return TrainingArguments(output_dir="unused", use_cpu=True, deepspeed=deepspeed, report_to=[])

    args = arguments(train_batch_size=10)
    configured = integration._refuse_before_settling(PoplarTrainer, args)
    model = torch.nn.Linear(2, 1)
    assert integration._settle_job(args, model, list(range(10)), collate_fn=None, configured=configured) is job
    assert asked["batch"] == 10 and asked["profiling"]["zero_optimization"]["stage"] == 0
    args = arguments(train_batch_size=10, gradient_clipping=0.5)  # max_grad_norm 1.0: still Hugging Face's refusal
    configured = integration._refuse_before_settling(PoplarTrainer, args)
    with pytest.raises(ValueError, match=r"- ds gradient_clipping=0\.5 vs hf max_grad_norm=1\.0"):
        integration._settle_job(args, model, list(range(10)), collate_fn=None, configured=configured)


def test_the_plans_origin_is_logged_once_when_the_trainer_is_built(monkeypatch, caplog):
    # Here, for evaluate() alone builds no engine; train()'s engine does not log it again (log_origin=False,
    # tests/unit/test_zero_initialize_order.py).
    import logging

    import torch

    from poplar_ext.integrations.transformers import PoplarTrainer

    args = _arguments_of_a_settled_job(monkeypatch, {}, {})
    with caplog.at_level(logging.INFO, logger="poplar_ext"):
        PoplarTrainer(model=torch.nn.Linear(2, 1), args=args, train_dataset=[{"x": 1}] * 8)
    assert "rank 0: micro-batch 2 x 2 accumulation steps" in caplog.text
    assert caplog.text.count("poplar plan from step 0: the plan file p.json") == 1
    assert "rank 0: micro-batch 2 x 2 accumulation steps; true global batch 4, ZeRO stage 0; device cpu" in caplog.text


def test_the_trainers_rank_line_says_whether_its_device_is_real_or_emulated(monkeypatch, caplog):
    # The ZeRO loop's line said "cpu-slow (emulated ...)"; the Trainer's gave the micro-batch alone.
    import logging

    import torch

    from poplar_ext.integrations import transformers as integration
    from poplar_ext.integrations.transformers import PoplarTrainer
    from poplar_ext.plan.formats import cluster_from_dict

    args = _arguments_of_a_settled_job(monkeypatch, {}, {})
    emulated = {"cpu": {"emulation": {"slowdown": 2.0, "memory_capacity_bytes": 10**9}}}
    cluster = cluster_from_dict(
        {
            "schema_version": 1,
            "nodes": [{"name": "n", "devices": [{"device_type": "cpu", "count": 1}]}],
            "device_types": emulated,
        }  # fmt: skip
    )
    settle = integration._settle_job
    monkeypatch.setattr(integration, "_settle_job", lambda *a, **k: _with_cluster(settle(*a, **k), cluster))
    with caplog.at_level(logging.INFO, logger="poplar_ext"):
        PoplarTrainer(model=torch.nn.Linear(2, 1), args=args, train_dataset=[{"x": 1}] * 8)
    assert re.search(r"ZeRO stage 0; device cpu \(emulated[^)]*2", caplog.text), caplog.text


def test_the_trainers_rank_line_names_the_plans_memory_levers(monkeypatch, caplog):
    # poplar_ext.initialize's line says "activation checkpointing" and "optimizer offloaded to the host" where the
    # plan sets them; the Trainer's said neither, so its log could not show that the plan's levers were applied.
    import dataclasses
    import logging

    from transformers import GPT2Config, GPT2LMHeadModel

    from poplar_ext.integrations import transformers as integration
    from poplar_ext.integrations.transformers import PoplarTrainer

    args = _arguments_of_a_settled_job(monkeypatch, {}, {})
    job = integration._settle_job(None, None, None, collate_fn=None, configured=None)
    levers = dataclasses.replace(job.plan.ranks[0], activation_checkpointing=True, optimizer_offload=True)
    job.plan = dataclasses.replace(job.plan, ranks=(levers,))
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))
    with caplog.at_level(logging.INFO, logger="poplar_ext"):
        PoplarTrainer(model=model, args=args, train_dataset=[{"x": 1}] * 8)
    assert "ZeRO stage 0; device cpu; activation checkpointing; optimizer offloaded to the host" in caplog.text


def _with_cluster(job, cluster):
    job.cluster = cluster
    return job


def test_the_tests_above_leave_accelerate_off_deepspeed_for_the_tests_after():
    # TrainingArguments(deepspeed=...) above set ACCELERATE_USE_DEEPSPEED=true in os.environ: left there, a plain
    # Trainer later in the same pytest process went through DeepSpeed (tests/dist/test_trl.py's reference run,
    # into DeepSpeed's MPI discovery: no mpi4py). Runs last in this file, after them.
    assert os.environ.get("ACCELERATE_USE_DEEPSPEED") == ACCELERATE_USE_DEEPSPEED_BEFORE_ANY_TEST
