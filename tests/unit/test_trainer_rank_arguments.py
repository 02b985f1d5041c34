"""Each rank's TrainingArguments (`_rank_arguments`): its plan's batch and activation checkpointing, built once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.usefixtures("in_tmp_path")  # the Trainer creates output_dir

pytest.importorskip("transformers", reason="PoplarTrainer needs pip install 'poplar-ext[hf]'")


def test_a_ranks_arguments_are_built_once_with_the_plans_checkpointing(monkeypatch):
    # Building TrainingArguments reads their DeepSpeed config again (Hugging Face's __post_init__): once per rank.
    from transformers import TrainingArguments

    from poplar_ext.integrations.transformers import _rank_arguments
    from poplar_ext.plan.formats import plan_from_dict

    ranks = [{"rank": 0, "device_type": "cpu", "micro_batch_size": 2, "gradient_accumulation_steps": 3}]
    predicted = {"iteration_time_s": 1.0, "samples_per_s": 6.0, "ideal_samples_per_s": 6.0}
    plan = {"schema_version": 1, "policy": "uniform", "zero_stage": 1, "global_batch_size": 6, "ranks": ranks}
    plan = plan_from_dict({**plan, "predicted": predicted, "profile_fingerprints": {}}, source="test")
    ds_config = {"zero_optimization": {"stage": 1}}
    args = TrainingArguments(output_dir="unused", use_cpu=True, deepspeed=ds_config, report_to=[])
    built = []
    post_init = TrainingArguments.__post_init__
    monkeypatch.setattr(TrainingArguments, "__post_init__", lambda self: (built.append(self), post_init(self))[1])
    ranked = _rank_arguments(args, SimpleNamespace(plan=plan, rank=0, ds_config=ds_config), checkpointing=True)
    assert len(built) == 1 and built[0] is ranked
    name = "activation_checkpointing" if hasattr(args, "activation_checkpointing") else "gradient_checkpointing"
    assert (getattr(ranked, name), getattr(ranked, f"{name}_kwargs")) == (True, {"use_reentrant": False})
    assert (ranked.per_device_train_batch_size, ranked.gradient_accumulation_steps) == (2, 1)
