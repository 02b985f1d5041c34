"""A plain DeepSpeed checkpoint (no poplar_state.json) loaded by poplar-ext on another number of ranks.

Plain DeepSpeed saves a ZeRO checkpoint on 2 ranks after 3 optimizer steps (Adam), at stages 1 and 3; poplar-ext
loads it on 3 ranks under a plan. Its optimizer state is resharded as a poplar-ext checkpoint's is (the number of
ranks that saved it told by the dp_world_size of its model states file), where DeepSpeed alone refuses another
world size (ZeRORuntimeException); the data starts at position 0, as for a plain checkpoint on as many ranks. Two forked
groups (2 ranks, then 3). The same for the Trainer: a plain Hugging Face Trainer's checkpoint (ZeRO 1, 2 ranks)
resumed by PoplarTrainer on 3 (two more groups).
"""

from __future__ import annotations

import os

import _training as t
import pytest
import torch
from harness import run_ranks

STAGES = (1, 3)
STEPS = 3


def _plain_deepspeed(root):
    import deepspeed

    rank, saved = int(os.environ["RANK"]), {}
    data = t.dataset()
    for stage in STAGES:
        model = t.GPT(t.TINY)
        config = {
            "train_batch_size": 4,
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10_000,
        }
        optimizer = t.make_optimizer("adam", model.parameters())
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        for step in range(STEPS):
            batch = torch.stack([data[4 * step + 2 * rank + i] for i in range(2)])
            engine.backward(engine(batch))
            engine.step()
        engine.save_checkpoint(root / f"stage{stage}")
        saved[stage] = t.full_parameters(engine)
    return saved


def _poplar_load(root):
    import poplar_ext

    loaded = {}
    for stage in STAGES:
        model = t.GPT(t.TINY)
        config = t.ds_config(cluster=root / "cluster3.json", plan=root / f"plan3-{stage}.json", stage=stage)
        optimizer = t.make_optimizer("adam", model.parameters())
        engine, *_ = poplar_ext.initialize(model=model, optimizer=optimizer, config=config)
        engine.load_checkpoint(root / f"stage{stage}")
        base = engine.deepspeed_engine.optimizer.optimizer
        loaded[stage] = {
            "params": t.full_parameters(engine),
            "steps": sorted({float(s["step"]) for s in base.state.values()}),
            "data_position": engine.data_position,
        }
    return loaded


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain_deepspeed")
    t.write_cluster(root / "cluster3.json", slow=2, slowdown=1.0)
    for stage in STAGES:
        t.write_plan(
            root / f"plan3-{stage}.json", [(2, 1), (1, 1), (1, 1)], stage=stage, device_types=["cpu"] + ["cpu-slow"] * 2
        )
    options = {"tmp_path": root, "timeout_s": 300}
    saved = run_ranks(_plain_deepspeed, world_size=2, args=(root,), **options)[0]
    return saved, run_ranks(_poplar_load, world_size=3, args=(root,), **options)


@pytest.mark.parametrize("stage", STAGES)
def test_a_plain_deepspeed_checkpoint_loads_resharded_on_more_ranks(runs, stage):
    saved, loaded = runs
    for rank in loaded:
        assert t.max_difference(rank[stage]["params"], saved[stage]) == 0.0
        assert rank[stage]["steps"] == [float(STEPS)]  # Adam's state came with it
        assert rank[stage]["data_position"] == 0


def _plain_trainer(root):
    import _hf_common as hf
    from transformers import Trainer, TrainingArguments

    config = {key: value for key, value in hf.trainer_ds_config(1).items() if key != "poplar"}
    arguments = TrainingArguments(
        output_dir=str(root / "trainer"),
        deepspeed=config,
        use_cpu=True,
        ddp_backend="gloo",
        max_steps=STEPS,
        per_device_train_batch_size=2,
        report_to=[],
        save_strategy="steps",
        save_steps=STEPS,
        dataloader_num_workers=0,
        **hf.OPTIMIZATION,
    )
    data = hf.RecordingVarLen()
    Trainer(model=hf.tiny_gpt2(), args=arguments, train_dataset=data, data_collator=hf.collate).train()


def _poplar_trainer_resume(root):
    import _hf_common as hf
    from transformers import TrainingArguments

    from poplar_ext.integrations.transformers import PoplarTrainer

    config = hf.trainer_ds_config(1, cluster=str(root / "cluster3.json"), plan=str(root / "plan3-1.json"))
    config["poplar"]["global_batch_size"] = 4
    arguments = TrainingArguments(
        output_dir=str(root / "resumed"),
        deepspeed=config,
        use_cpu=True,
        ddp_backend="gloo",
        max_steps=STEPS + 1,
        per_device_train_batch_size=2,
        report_to=[],
        save_strategy="no",
        dataloader_num_workers=0,
        **hf.OPTIMIZATION,
    )
    data = hf.RecordingVarLen()
    trainer = PoplarTrainer(model=hf.tiny_gpt2(), args=arguments, train_dataset=data, data_collator=hf.collate)
    trainer.train(resume_from_checkpoint=str(root / "trainer" / f"checkpoint-{STEPS}"))
    base = trainer.model_wrapped.optimizer.optimizer
    return sorted({float(s["step"]) for s in base.state.values()})


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    pytest.importorskip("transformers", reason="the Hugging Face tests need pip install 'poplar-ext[hf]'")
    root = tmp_path_factory.mktemp("plain_trainer")
    t.write_cluster(root / "cluster3.json", slow=2, slowdown=1.0)
    t.write_plan(root / "plan3-1.json", [(2, 1), (1, 1), (1, 1)], stage=1, device_types=["cpu"] + ["cpu-slow"] * 2)
    options = {"tmp_path": root, "timeout_s": 300}
    run_ranks(_plain_trainer, world_size=2, args=(root,), **options)
    return run_ranks(_poplar_trainer_resume, world_size=3, args=(root,), **options)


def test_a_plain_trainer_checkpoint_resumes_resharded_in_poplar_trainer_on_more_ranks(trainer_runs):
    assert trainer_runs == [[float(STEPS + 1)]] * 3  # Adam's state came with it: one more step on it
