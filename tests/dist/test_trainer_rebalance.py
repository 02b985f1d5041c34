"""Re-balancing inside PoplarTrainer, on 3 forked CPU ranks (tiny GPT-2 from its config).

* Plan switches during ``train()`` (ordered from a callback through
  ``trainer.poplar_engine.rebalance_to``, as ``poplar.rebalance`` orders them) change each
  rank's micro-batch and accumulation count at the same optimizer step; the parameters
  equal one process training the same global batches, every sample once, ``max_steps``
  and the LR schedule count optimizer steps of the true global batch, and a resume from a
  checkpoint taken after a switch continues under the switched plan.
* A ``slowdown_schedule`` that makes rank 0 4x slower mid-run triggers one re-plan through
  ``poplar.rebalance``, logged in the plan history, which moves samples away from it. Every
  rank is emulated and steady at synthetic profiles (the plan searched from them at start),
  so the checks read exactly the schedule's factor, whatever the machine's load.
"""

from __future__ import annotations

import functools
import json
from contextlib import contextmanager
from pathlib import Path

import pytest
from harness import run_ranks

pytest.importorskip("transformers", reason="the Hugging Face tests need pip install 'poplar-ext[hf]'")

import _hf_common as hf  # noqa: E402
import _training as t  # noqa: E402

TYPES = ["cpu", "cpu-slow", "cpu-slow"]
GLOBAL_BATCH = 12
STEPS = 7
SAVE_STEP = 6  # in the second epoch (5 iterations each): the resume skips into it
FIRST = {1: [(2, 2), (4, 1), (2, 2)], 3: [(2, 2), (1, 2), (3, 2)]}
# Ordered after these optimizer steps; each applies at the first iteration no rank has read yet. Stage 1's last,
# ordered at the save's step (its iteration read ahead), is still pending at the save: the resume applies it too.
SWITCHES = {
    1: {1: [(4, 1), (1, 4), (2, 2)], 4: [(3, 2), (2, 1), (2, 2)], SAVE_STEP: [(3, 2), (2, 1), (2, 2)]},
    3: {1: [(3, 2), (2, 2), (1, 2)]},
}


def _arguments(out: str, config: str, **extra):
    from transformers import TrainingArguments

    fields = dict(
        output_dir=out,
        deepspeed=config,
        use_cpu=True,
        ddp_backend="gloo",
        max_steps=STEPS,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=EVAL_BATCH,
        report_to=[],
        logging_steps=1,
        dataloader_num_workers=0,
        **{**hf.OPTIMIZATION, "lr_scheduler_type": "linear", "warmup_steps": 2},
    )
    return TrainingArguments(**{**fields, **extra})


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=False)


class _Recorder:
    """Passes a batch sampler's items through and remembers them; forwards set_epoch (which the Trainer
    calls on the batch sampler under accelerate's shard wrapper) and nothing else, as the plan's own."""

    def __init__(self, inner, seen: list):
        self.inner, self.seen = inner, seen

    def __iter__(self):
        for item in self.inner:
            self.seen.append(item)
            yield item

    def __len__(self):
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)


def _recording_trainer(seen: list):
    from poplar_ext.integrations.transformers import PoplarTrainer

    class Recording(PoplarTrainer):
        def get_train_dataloader(self):
            loader = super().get_train_dataloader()
            shard = loader.batch_sampler
            shard.batch_sampler = _Recorder(shard.batch_sampler, seen)
            return loader

    return Recording


def _switching_callback(trainer_ref: list, template: dict, switches: dict[int, list[tuple[int, int]]]):
    from transformers import TrainerCallback

    from poplar_ext.plan.formats import plan_from_dict

    class Switch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            allocation = switches.get(state.global_step)
            if allocation is not None:
                ranks = [
                    dict(r, micro_batch_size=b, gradient_accumulation_steps=s)
                    for r, (b, s) in zip(template["ranks"], allocation)
                ]
                trainer_ref[0].poplar_engine.rebalance_to(plan_from_dict(dict(template, ranks=ranks)), reason="test")

    return Switch()


def _train_switching(configs: dict[int, str], out: str) -> dict:
    import os

    import torch

    from poplar_ext.plan.formats import load_plan, plan_to_dict

    results = {}
    for stage, config in configs.items():
        template = plan_to_dict(load_plan(os.path.join(os.path.dirname(config), f"plan{stage}.json")))
        _reset_accelerate()
        seen: list = []
        ref: list = []
        trainer = _recording_trainer(seen)(
            model=hf.tiny_gpt2(),
            args=_arguments(
                f"{out}/{stage}",
                config,
                save_strategy="steps",
                save_steps=SAVE_STEP,
                include_num_input_tokens_seen="non_padding",
            ),
            train_dataset=hf.RecordingVarLen(),
            data_collator=hf.collate,
            callbacks=[_switching_callback(ref, template, SWITCHES[stage])],
        )
        ref.append(trainer)
        stale = _plant_an_earlier_save(Path(f"{out}/{stage}/checkpoint-{SAVE_STEP}"))
        with _counting_deepspeed_saves() as saves:
            trainer.train()
        learning_rates = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
        result = {
            "params": hf.full_parameters(trainer.model_wrapped),
            "seen": [i for iteration in seen[:STEPS] for batch in iteration for i in batch],
            "history": [(h["start_step"], h["reason"]) for h in trainer.poplar_engine.plan_history],
            "last": [(r.micro_batch_size, r.gradient_accumulation_steps) for r in trainer.plan.ranks],
            "args_micro_batch": trainer.args.per_device_train_batch_size,
            "learning_rates": learning_rates,
            "steps": trainer.state.global_step,
            "tokens_seen": trainer.state.num_input_tokens_seen,
            "stale_left": [str(path) for path in stale if path.exists()],
            "deepspeed_saves": saves,
        }
        if stage == 1:
            result["eval"] = _evaluate(trainer)
            # Resumed from the checkpoint taken after the first switch: it continues under that plan.
            _reset_accelerate()
            resumed_seen: list = []
            skipped = SAVE_STEP % -(-hf.NUM_SAMPLES // GLOBAL_BATCH)  # iterations of its epoch before the checkpoint
            resumed = _recording_trainer(resumed_seen)(
                model=hf.tiny_gpt2(),
                # No logging: train_loss is the loss accumulated since the resume.
                args=_arguments(f"{out}/{stage}", config, save_strategy="no", logging_strategy="no"),
                train_dataset=hf.RecordingVarLen(),
                data_collator=hf.collate,
            )
            output = resumed.train(resume_from_checkpoint=f"{out}/{stage}/checkpoint-{SAVE_STEP}")
            history = resumed.poplar_engine.plan_history
            result["resumed"] = {
                "params": hf.full_parameters(resumed.model_wrapped),
                "plan_at_resume": [
                    (r["micro_batch_size"], r["gradient_accumulation_steps"]) for r in history[-1]["plan"]["ranks"]
                ],
                "history": [h["start_step"] for h in history],
                "args_micro_batch": resumed.args.per_device_train_batch_size,
                "train_loss": output.metrics["train_loss"],
                # The Trainer skips the epoch's trained iterations through the sampler (they pass the recorder).
                "seen": [
                    i
                    for iteration in resumed_seen[skipped : skipped + STEPS - SAVE_STEP]
                    for batch in iteration
                    for i in batch
                ],
            }
            result["losses"] = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
            result["loaded_by_engine"] = _load_with_an_engine(config, f"{out}/{stage}/checkpoint-{SAVE_STEP}")
            result["resumed_replaced"] = _resume_a_replaced_tag(config, f"{out}/{stage}", f"{out}/replaced")
        results[stage] = result
        torch.distributed.barrier()
    return results


@contextmanager
def _counting_deepspeed_saves():
    """Inside: each DeepSpeed save of this rank's engine appends its tag to the list yielded."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    saves: list = []
    save = DeepSpeedEngine.save_checkpoint

    @functools.wraps(save)
    def counted(engine, save_dir, *args, **kwargs):
        saves.append(kwargs.get("tag"))
        return save(engine, save_dir, *args, **kwargs)

    DeepSpeedEngine.save_checkpoint = counted
    try:
        yield saves
    finally:
        DeepSpeedEngine.save_checkpoint = save


def _resume_a_replaced_tag(config: str, saved: str, out: str) -> dict:
    """checkpoint-SAVE_STEP as a save into it left it when it stopped between its renames (its tag folder renamed
    to ``TAG.replaced``), resumed to STEPS: the parameters, and the warnings logged."""
    import logging
    import os
    import shutil

    import torch

    from poplar_ext.integrations.transformers import PoplarTrainer

    if os.environ["RANK"] == "0":
        folder = Path(out) / f"checkpoint-{SAVE_STEP}"
        shutil.copytree(Path(saved) / folder.name, folder)
        (folder / f"global_step{SAVE_STEP}").rename(folder / f"global_step{SAVE_STEP}.replaced")
    torch.distributed.barrier()
    _reset_accelerate()
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("poplar_ext").addHandler(handler)
    try:
        trainer = PoplarTrainer(
            model=hf.tiny_gpt2(),
            args=_arguments(out, config, save_strategy="no", logging_strategy="no"),
            train_dataset=hf.RecordingVarLen(),
            data_collator=hf.collate,
        )
        trainer.train(resume_from_checkpoint=f"{out}/checkpoint-{SAVE_STEP}")
    finally:
        logging.getLogger("poplar_ext").removeHandler(handler)
    return {"params": hf.full_parameters(trainer.model_wrapped), "warnings": warnings}


def _plant_an_earlier_save(folder: Path) -> list[Path]:
    """What an earlier save into checkpoint `folder` on 4 ranks, resumed on others, left (rank 0 writes it): a 4th
    rank's optimizer file and the resharded copy. A resume on another number of ranks would read either."""
    import os

    tag = folder / f"global_step{SAVE_STEP}"
    stale = [tag / "zero_pp_rank_3_mp_rank_00_optim_states.pt", Path(f"{tag}_universal")]
    if os.environ["RANK"] == "0":
        tag.mkdir(parents=True)
        stale[0].write_bytes(b"")
        (stale[1] / "zero").mkdir(parents=True)
    return stale


def _load_with_an_engine(config: str, checkpoint: str) -> dict:
    """The Trainer's checkpoint loaded by `poplar_ext.initialize`'s engine under the run's first plan (its weights:
    the Trainer's AdamW has two parameter groups): where its data and plans continue."""
    import os

    import torch

    import poplar_ext

    _reset_accelerate()
    files = {name: Path(os.path.dirname(config)) / f"{name}.json" for name in ("cluster", "plan1")}
    model = hf.tiny_gpt2()
    engine, *_ = poplar_ext.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters()),
        config=t.ds_config(cluster=files["cluster"], plan=files["plan1"], stage=1),
    )
    engine.load_checkpoint(checkpoint, load_optimizer_states=False)
    return {
        "data_position": engine.data_position,
        "plan": [(r.micro_batch_size, r.gradient_accumulation_steps) for r in engine.plan.ranks],
        "history": [h["start_step"] for h in engine.plan_history],
    }


EVAL_SAMPLES, PREDICT_SAMPLES, EVAL_BATCH = 23, 13, 3  # plan 1's micro-batches 2, 4, 2: batches 3, 6, 3


def token_accuracy(prediction) -> dict:
    """compute_metrics: the share of label tokens whose next token the logits predict (shifted)."""

    labels, logits = prediction.label_ids[:, 1:], prediction.predictions[:, :-1]
    counted = labels != -100
    return {"accuracy": float((logits.argmax(-1) == labels)[counted].mean()), "tokens": int(counted.sum())}


def _evaluate(trainer) -> dict:
    trainer.compute_metrics = token_accuracy
    metrics = trainer.evaluate(eval_dataset=hf.RecordingVarLen(EVAL_SAMPLES))
    predicted = trainer.predict(hf.RecordingVarLen(PREDICT_SAMPLES))
    return {
        "metrics": metrics,
        "batch": trainer.args.per_device_eval_batch_size,
        "predictions": predicted.predictions,
        "label_ids": predicted.label_ids,
        "predict_loss": predicted.metrics["test_loss"],
    }


def _one_process_evaluation(params: dict, num_samples: int) -> tuple[float, list]:
    """The trained parameters on one process: the whole set's token-mean loss in one batch, and each
    sample's logits at its own positions."""
    import torch

    model = hf.tiny_gpt2()
    model.load_state_dict(params, strict=False)
    data = hf.RecordingVarLen(num_samples)
    batch = hf.collate([data[i] for i in range(num_samples)])
    with torch.no_grad():
        out = model(**batch)
    lengths = batch["attention_mask"].sum(1).tolist()
    return float(out.loss), [out.logits[i, :n] for i, n in enumerate(lengths)]


def test_evaluate_and_predict_count_every_sample_once_and_equal_one_process(switching):
    import numpy as np

    evaluated = switching[0][1]["eval"]
    assert [r[1]["eval"]["batch"] for r in switching] == [3, 6, 3], "each rank's batch follows its plan micro-batch"
    loss, logits = _one_process_evaluation(switching[0][1]["params"], EVAL_SAMPLES)
    assert evaluated["metrics"]["eval_loss"] == pytest.approx(loss, rel=1e-5)
    data = hf.RecordingVarLen(EVAL_SAMPLES)
    expected = np.concatenate([(row.argmax(-1)[:-1] == torch_row(item)[1:]) for row, item in zip(logits, data.items)])
    assert evaluated["metrics"]["eval_tokens"] == len(expected)
    assert evaluated["metrics"]["eval_accuracy"] == pytest.approx(float(expected.mean()))
    # predict(): 13 samples for batches of 3, 6, 3: the last round has one sample, ranks 0 and 2 pad.
    loss, logits = _one_process_evaluation(switching[0][1]["params"], PREDICT_SAMPLES)
    predictions = evaluated["predictions"]
    assert predictions.shape[0] == PREDICT_SAMPLES
    for i, row in enumerate(logits):
        assert np.abs(predictions[i, : len(row)] - row.numpy()).max() <= 1e-4, f"sample {i}"
    assert evaluated["predict_loss"] == pytest.approx(loss, rel=1e-5)


def torch_row(item: list[int]):
    import torch

    return torch.tensor(item)


@pytest.fixture(scope="module")
def switching(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer-switches")
    configs = hf.trainer_configs(root, FIRST, TYPES)
    return run_ranks(_train_switching, world_size=3, tmp_path=root, args=(configs, str(root / "out")), timeout_s=300)


@pytest.mark.parametrize("stage", sorted(FIRST))
def test_switches_inside_the_trainer_keep_gradients_exact(switching, stage):
    expected = hf.reference_parameters(GLOBAL_BATCH, STEPS, schedule_warmup_steps=2)
    assert t.max_difference(switching[0][stage]["params"], expected) <= 1e-5


@pytest.mark.parametrize("stage", sorted(FIRST))
def test_every_rank_switches_at_the_same_step_and_every_sample_once(switching, stage):
    first = switching[0][stage]
    history = first["history"]
    assert len(history) == 1 + len(SWITCHES[stage]), history
    ordered = sorted(SWITCHES[stage])
    assert all(start > at for (start, _), at in zip(history[1:], ordered)), (history, ordered)
    assert all(r[stage]["history"] == history for r in switching), "every rank switched at the same step"
    assert [r[stage]["last"] for r in switching][0] == SWITCHES[stage][ordered[-1]]
    # trainer.args.per_device_train_batch_size follows: each rank's micro-batch in the plan it trains now.
    assert [r[stage]["args_micro_batch"] for r in switching] == [b for b, _ in SWITCHES[stage][ordered[-1]]]
    trained = sorted(i for r in switching for i in r[stage]["seen"])
    assert trained == sorted(t.SampleStream(num_samples=hf.NUM_SAMPLES, seed=0).indices(0, STEPS * GLOBAL_BATCH))


def test_max_steps_and_the_schedule_count_optimizer_steps(switching):
    first = switching[0][1]
    assert first["steps"] == STEPS
    # Linear warm-up over 2 optimizer steps, then linear decay to 0 at max_steps: the rate each step used.
    peak = hf.OPTIMIZATION["learning_rate"]
    expected = [peak * (s / 2 if s < 2 else (STEPS - s) / (STEPS - 2)) for s in range(STEPS)]
    assert first["learning_rates"] == pytest.approx(expected), first["learning_rates"]


def test_a_resume_after_a_switch_continues_under_the_switched_plan(switching):
    first = switching[0][1]
    resumed = first["resumed"]
    applied = [k for k, (start, _) in enumerate(first["history"][1:]) if start <= SAVE_STEP]
    assert applied, "the test needs a switch applied before the checkpoint"
    ordered = sorted(SWITCHES[1])
    assert resumed["plan_at_resume"] == SWITCHES[1][ordered[applied[-1]]]
    assert [r[1]["resumed"]["args_micro_batch"] for r in switching] == [b for b, _ in resumed["plan_at_resume"]]
    assert resumed["history"] == [start for start, _ in first["history"]], "also the switch pending at the save"
    expected = hf.reference_parameters(GLOBAL_BATCH, STEPS, schedule_warmup_steps=2)
    assert t.max_difference(resumed["params"], expected) <= 1e-5


def test_a_resume_restores_a_tag_folder_a_stopped_save_renamed(switching):
    # The Trainer's resume read no poplar_state.json and DeepSpeed's load failed a bare AssertionError on every rank.
    resumed = switching[0][1]["resumed_replaced"]
    expected = hf.reference_parameters(GLOBAL_BATCH, STEPS, schedule_warmup_steps=2)
    assert t.max_difference(resumed["params"], expected) <= 1e-5
    assert [w for w in resumed["warnings"] if "restored as" in w], resumed["warnings"]


def test_an_engine_loading_a_trainer_checkpoint_continues_its_data_and_plans(switching):
    # poplar_state.json was beside the DeepSpeed tag folder, where engine.load_checkpoint does not look: it
    # started the data at 0 under its own plan, the history lost.
    first = switching[0][1]
    loaded, resumed = first["loaded_by_engine"], first["resumed"]
    assert loaded["data_position"] == SAVE_STEP * GLOBAL_BATCH
    assert loaded["plan"] == resumed["plan_at_resume"]
    assert loaded["history"] == [start for start, _ in first["history"] if start <= SAVE_STEP]


@pytest.mark.parametrize("stage", sorted(FIRST))
def test_a_trainer_save_into_a_used_checkpoint_folder_replaces_it(switching, stage):
    # The Trainer saves with DeepSpeed's own save_checkpoint, which leaves other ranks' files and the copy alone.
    assert switching[0][stage]["stale_left"] == []


@pytest.mark.parametrize("stage", sorted(FIRST))
def test_a_trainer_checkpoint_is_one_deepspeed_save(switching, stage):
    # At ZeRO 3 without stage3_gather_16bit_weights_on_model_save, save_model fell back to a DeepSpeed save in place,
    # then the optimizer's save wrote a second full copy beside it: two saves, twice the peak disk.
    # Checkpoints at SAVE_STEP and at the last step (the Trainer saves the end of training too).
    assert switching[0][stage]["deepspeed_saves"] == [f"global_step{step}.saving" for step in (SAVE_STEP, STEPS)]


def _train_saving_the_model_only(config: str, out: str) -> list:
    from poplar_ext.integrations.transformers import PoplarTrainer

    _reset_accelerate()
    args = _arguments(out, config, max_steps=2, save_strategy="steps", save_steps=2, save_only_model=True)
    trainer = PoplarTrainer(
        model=hf.tiny_gpt2(), args=args, train_dataset=hf.RecordingVarLen(), data_collator=hf.collate
    )
    with _counting_deepspeed_saves() as saves:
        trainer.train()
    return saves


def test_save_only_model_at_zero_3_saves_deepspeed_whole(tmp_path):
    # No optimizer's save follows: save_model's fallback is the checkpoint's one DeepSpeed save, swapped in whole.
    configs = hf.trainer_configs(tmp_path, {3: FIRST[3]}, TYPES)
    out = tmp_path / "out"
    results = run_ranks(
        _train_saving_the_model_only, world_size=3, tmp_path=tmp_path / "ranks", args=(configs[3], str(out))
    )
    assert results[0] == ["global_step2.saving"]
    assert (out / "checkpoint-2" / "latest").read_text() == "global_step2"
    assert (out / "checkpoint-2" / "global_step2" / "poplar_state.json").is_file()


DRIFT_STEPS = 12


def _train_drifting(config: str, out: str) -> dict:
    seen: list = []
    _reset_accelerate()
    trainer = _recording_trainer(seen)(
        model=hf.gpt2(width=96),
        args=_arguments(out, config, save_strategy="no", max_steps=DRIFT_STEPS, per_device_train_batch_size=8),
        train_dataset=hf.RecordingVarLen(),
        data_collator=hf.collate,
    )
    first = [(r.micro_batch_size, r.gradient_accumulation_steps) for r in trainer.plan.ranks]
    trainer.train()
    return {
        "first": first,
        "last": [(r.micro_batch_size, r.gradient_accumulation_steps) for r in trainer.plan.ranks],
        "history": [(h["start_step"], h["reason"]) for h in trainer.poplar_engine.plan_history],
        "seen": [i for iteration in seen[:DRIFT_STEPS] for batch in iteration for i in batch],
    }


def test_a_drifting_rank_is_re_balanced_inside_the_trainer(tmp_path):
    # Synthetic profiles, every rank emulated and steady at them: what the checks read does not depend on the load.
    slowdowns = {"cpu-fast": 1.0, "cpu-slow": 2.0}
    t.write_steady_profiles(tmp_path / "profiles", hf.gpt2(width=96), slowdowns, fast_s_per_sample=0.01)
    cluster = json.loads(
        t.write_cluster(tmp_path / "cluster.json", fast=1, slow=2, slowdown=2.0, fast_type="cpu-fast").read_text()
    )
    cluster["device_types"]["cpu-fast"]["emulation"]["slowdown_schedule"] = [[4, 4.0, 0]]
    (tmp_path / "cluster.json").write_text(json.dumps(cluster))
    config = hf.trainer_ds_config(
        1,
        cluster=str(tmp_path / "cluster.json"),
        profiles=str(tmp_path / "profiles"),
        calibration={"action": "off"},
        rebalance={"enabled": True, "check_interval_steps": 2, "threshold": 1.0, "sustained_checks": 2},
    )
    (tmp_path / "ds.json").write_text(json.dumps(config))
    results = run_ranks(
        _train_drifting,
        world_size=3,
        tmp_path=tmp_path / "ranks",
        args=(str(tmp_path / "ds.json"), str(tmp_path / "out")),
        timeout_s=300,
    )
    first = results[0]
    assert len(first["history"]) == 2, first["history"]
    start_step, reason = first["history"][1]
    assert start_step > 4 and "rank 0 (cpu-fast) at 4.00x its predicted compute (speed factor 1.00 -> 4.00)" in reason
    before, after = first["first"], first["last"]
    assert after[0][0] * after[0][1] < before[0][0] * before[0][1], f"{before} -> {after}"
    assert all(r["history"] == first["history"] and r["last"] == after for r in results)
    trained = sorted(i for r in results for i in r["seen"])
    assert trained == sorted(t.SampleStream(num_samples=hf.NUM_SAMPLES, seed=0).indices(0, DRIFT_STEPS * 24))


def test_the_final_train_loss_is_the_global_mean_over_the_ranks(switching):
    # The loss of the steps since the last log (here all of the resumed run's) averaged over the
    # ranks, as the logged losses are: each rank's own is its weighted share of the global batch's.
    first = switching[0][1]
    logged = [first["losses"][step] for step in range(SAVE_STEP + 1, STEPS + 1)]
    assert first["resumed"]["train_loss"] == pytest.approx(sum(logged) / len(logged), rel=1e-4)


def test_a_resume_inside_a_later_epoch_continues_the_data_where_it_stopped(switching):
    resumed = [i for r in switching for i in r[1]["resumed"]["seen"]]
    stream = t.SampleStream(num_samples=hf.NUM_SAMPLES, seed=0)
    assert sorted(resumed) == sorted(stream.indices(SAVE_STEP * GLOBAL_BATCH, (STEPS - SAVE_STEP) * GLOBAL_BATCH))


def test_input_tokens_seen_are_counted_once_per_optimizer_step(switching):
    # include_num_input_tokens_seen gathers in every step; ranks run different numbers of micro-batches.
    data = hf.RecordingVarLen()
    stream = t.SampleStream(num_samples=hf.NUM_SAMPLES, seed=0).indices(0, STEPS * GLOBAL_BATCH)
    assert switching[0][1]["tokens_seen"] == sum(len(data.items[i]) for i in stream)
