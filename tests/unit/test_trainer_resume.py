"""PoplarTrainer's resume decision, taken before anything is loaded (no process group, no Trainer built).

The Trainer resumes by its step count: the stream continues at the saved position when
the global batch is the checkpoint's, whatever the allocation or the number of ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers", reason="PoplarTrainer needs pip install 'poplar-ext[hf]'")

from poplar_ext.integrations.transformers import PoplarTrainer  # noqa: E402
from poplar_ext.plan.formats import plan_from_dict  # noqa: E402
from poplar_ext.runtime.checkpoint import history_entry, poplar_client_state, write_state  # noqa: E402
from poplar_ext.runtime.config import poplar_config_from_dict  # noqa: E402


def _plan(allocation: list[tuple[int, int]], stage: int = 1):
    return plan_from_dict(
        {
            "schema_version": 1,
            "policy": "poplar",
            "zero_stage": stage,
            "global_batch_size": sum(b * s for b, s in allocation),
            "ranks": [
                {"rank": r, "device_type": "cpu", "micro_batch_size": b, "gradient_accumulation_steps": s}
                for r, (b, s) in enumerate(allocation)
            ],
            "predicted": {"iteration_time_s": 1.0, "samples_per_s": 1.0, "ideal_samples_per_s": 1.0},
            "profile_fingerprints": {},
        },
        source="test",
    )


def _trainer(plan, output_dir: Path) -> SimpleNamespace:
    """What `_check_resume` reads of a PoplarTrainer."""
    config = poplar_config_from_dict({"plan": "p.json"}, base_dir=Path("."))
    trainer = SimpleNamespace(
        args=SimpleNamespace(output_dir=str(output_dir)),
        plan=plan,
        _train_sampler=None,
        job=SimpleNamespace(rank=0, poplar_config=config, plan_reason="the plan file p.json"),
        state=SimpleNamespace(global_step=0),
        _reshard_on_resume=False,
        _resume_decision=None,
        poplar_engine=None,
    )
    trainer._plan_history = [history_entry(plan, start_step=0, data_position=0, reason="the plan file p.json")]
    trainer._poplar_state = lambda: PoplarTrainer._poplar_state(trainer)
    trainer._restore_replaced_tags = lambda named: PoplarTrainer._restore_replaced_tags(trainer, named)
    return trainer


def _checkpoint(output_dir: Path, plan, step: int, *, tag: str | None = None) -> Path:
    """A Trainer checkpoint with poplar_state.json in DeepSpeed's tag folder `tag` named by ``latest`` (as
    `save_whole` leaves it), or where earlier poplar-ext versions wrote it (no `tag`)."""
    state = poplar_client_state(plan, consumed_samples=step * plan.global_batch_size, seed=0, shuffle=True)
    state["step"] = step
    folder = output_dir / f"checkpoint-{step}"
    write_state(*((folder, tag) if tag else (output_dir, folder.name)), state)
    if tag:
        (folder / "latest").write_text(tag)
    (folder / "trainer_state.json").write_text("{}")  # the Trainer's, written last
    return folder


def _unfinished(output_dir: Path, step: int) -> Path:
    """checkpoint-`step` as a save stopped in DeepSpeed's part leaves it: the model's files, the tag's new folder
    with DeepSpeed's files, no poplar_state.json, ``latest`` nor trainer_state.json."""
    folder = output_dir / f"checkpoint-{step}"
    (folder / f"global_step{step}.saving").mkdir(parents=True)
    (folder / f"global_step{step}.saving" / "mp_rank_00_model_states.pt").write_text("DeepSpeed's")
    (folder / "model.safetensors").write_text("the model's")
    return folder


def test_a_resume_from_the_last_checkpoint_skips_one_whose_save_did_not_finish(tmp_path, caplog):
    plan = _plan([(4, 2), (4, 1)])
    whole = _checkpoint(tmp_path, plan, step=2, tag="global_step2")
    unfinished = _unfinished(tmp_path, step=4)
    trainer = _trainer(plan, tmp_path)
    with caplog.at_level("WARNING", logger="poplar_ext"):
        assert PoplarTrainer._check_resume(trainer, True) == str(whole)
    assert trainer._resume_decision.data_position == 2 * plan.global_batch_size  # checkpoint-2's state
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        f"resume_from_checkpoint: skipped {unfinished}: expected a whole checkpoint, found a save into it that did "
        f"not finish ({unfinished / 'latest'} missing); resuming from the newest whole one"
    ]


def test_a_checkpoint_whose_save_did_not_finish_is_refused_by_name(tmp_path):
    plan = _plan([(4, 2), (4, 1)])
    _checkpoint(tmp_path, plan, step=2, tag="global_step2")
    unfinished = _unfinished(tmp_path, step=4)
    trainer = _trainer(plan, tmp_path)
    with pytest.raises(
        ValueError,
        match=f"resume_from_checkpoint: {unfinished}: expected a whole checkpoint, found a "
        f"save into it that did not finish \\({unfinished / 'latest'} missing\\)",
    ):
        PoplarTrainer._check_resume(trainer, str(unfinished))
    (unfinished / "latest").write_text("global_step4")  # DeepSpeed's own, before poplar-ext swapped the tag in
    with pytest.raises(
        ValueError,
        match=f"did not finish \\({unfinished / 'global_step4' / 'poplar_state.json'} missing\\)",
    ):
        PoplarTrainer._check_resume(trainer, str(unfinished))
    (unfinished / "global_step4.saving").rename(unfinished / "global_step4")
    write_state(unfinished, "global_step4", {})  # swapped in; the Trainer stopped before its own state file
    with pytest.raises(ValueError, match=f"\\({unfinished / 'trainer_state.json'} missing\\)"):
        PoplarTrainer._check_resume(trainer, str(unfinished))
    (tmp_path / "checkpoint-2" / "trainer_state.json").unlink()
    with pytest.raises(ValueError, match=f"{tmp_path / 'checkpoint-2'}: expected a whole checkpoint"):
        PoplarTrainer._check_resume(trainer, True)  # none whole: refused, not the Trainer's pick of checkpoint-4


def test_a_folder_no_trainer_saved_is_refused_with_where_to_resume_it(tmp_path):
    plan = _plan([(4, 2), (4, 1)])
    folder = tmp_path / "engine-save"  # engine.save_checkpoint's: DeepSpeed's tag and latest, no Trainer files
    write_state(folder, "global_step2", {})
    (folder / "latest").write_text("global_step2")
    trainer = _trainer(plan, tmp_path)
    with pytest.raises(ValueError) as refused:
        PoplarTrainer._check_resume(trainer, str(folder))
    assert f"did not finish ({folder / 'trainer_state.json'} missing), or a folder no Trainer saved" in str(
        refused.value
    )
    assert "continue such a checkpoint with poplar_ext.initialize and engine.load_checkpoint" in str(refused.value)


@pytest.mark.parametrize("newest", [True, False])
def test_a_tag_folder_a_stopped_save_renamed_is_restored(tmp_path, caplog, newest):
    # A save stopped between its renames: global_step2 is global_step2.replaced; the resume read no state, and
    # DeepSpeed's load then failed a bare AssertionError on every rank.
    plan = _plan([(4, 2), (4, 1)])
    folder = _checkpoint(tmp_path, plan, step=2, tag="global_step2")
    (folder / "global_step2").rename(folder / "global_step2.replaced")
    trainer = _trainer(plan, tmp_path)
    with caplog.at_level("WARNING", logger="poplar_ext"):
        assert PoplarTrainer._check_resume(trainer, True if newest else str(folder)) == str(folder)
    assert (folder / "global_step2" / "poplar_state.json").is_file()
    assert trainer._resume_decision.data_position == 2 * plan.global_batch_size  # the saved state
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"resume_from_checkpoint: {folder / 'global_step2'} is missing and {folder / 'global_step2.replaced'} holds "
        f"the checkpoint a save into it was replacing when it stopped: restored as {folder / 'global_step2'}"
    ]


def test_fewer_ranks_with_the_same_global_batch_resume_resharded_and_recorded(tmp_path):
    folder = _checkpoint(tmp_path, _plan([(2, 2), (2, 2), (4, 1)]), step=2)
    trainer = _trainer(_plan([(3, 2), (2, 3)]), tmp_path)
    PoplarTrainer._check_resume(trainer, str(folder))
    assert trainer._reshard_on_resume
    assert "under another plan (3 ranks then, 2 now)" in trainer._plan_history[-1]["reason"]
    assert trainer._plan_history[-1]["start_step"] == 2


def test_the_same_number_of_ranks_needs_no_resharding(tmp_path):
    folder = _checkpoint(tmp_path, _plan([(4, 2), (4, 1)]), step=2)
    trainer = _trainer(_plan([(3, 2), (2, 3)]), tmp_path)
    PoplarTrainer._check_resume(trainer, True)  # the last checkpoint of output_dir
    assert not trainer._reshard_on_resume
    assert trainer._plan_history[-1]["reason"].startswith(f"resumed from {folder} under another plan")


def test_another_global_batch_is_refused(tmp_path):
    folder = _checkpoint(tmp_path, _plan([(2, 2), (2, 2), (4, 1)]), step=2)
    trainer = _trainer(_plan([(2, 2), (2, 3)]), tmp_path)
    with pytest.raises(ValueError, match="trained global batches of 12 samples, this job's plan has 10"):
        PoplarTrainer._check_resume(trainer, str(folder))


@pytest.mark.parametrize("refusal", ["another global batch", "no checkpoint"])
def test_a_refused_resume_ends_a_restarting_launchers_job(tmp_path, monkeypatch, refusal):
    # As the engines' load_checkpoint: every restart would meet the same refusal, --max-restarts times over.
    from poplar_ext import elastic

    ended: list[BaseException] = []
    monkeypatch.setattr(elastic, "end_restarting_launcher", ended.append)
    folder = _checkpoint(tmp_path, _plan([(2, 2), (2, 2), (4, 1)]), step=2)
    trainer = _trainer(_plan([(2, 2), (2, 3)]), tmp_path if refusal == "another global batch" else tmp_path / "none")
    trainer._check_resume = lambda named: PoplarTrainer._check_resume(trainer, named)
    with pytest.raises(ValueError, match="trained global batches of 12|No valid checkpoint found") as refused:
        PoplarTrainer.train(trainer, resume_from_checkpoint=str(folder) if refusal == "another global batch" else True)
    assert ended == [refused.value]


def test_a_resume_is_refused_where_the_nodes_storages_hold_different_saves(tmp_path, monkeypatch):
    # Node-local storage: another node's first rank holds another save under the tag (its own stopped before it
    # was whole); DeepSpeed would load each node's files as one checkpoint.
    from poplar_ext import collectives

    plan = _plan([(4, 2), (4, 1)])
    folder = _checkpoint(tmp_path, plan, step=2, tag="global_step2")
    trainer = _trainer(plan, tmp_path)
    other = (("another save", "the save at data position 999"), None, None)  # (TAG, TAG.saving, TAG.replaced)
    # The other node holds the same checkpoint folders, whole (a list: what each node can resume), another save
    # under the tag (a tuple) and no failure (None).
    monkeypatch.setattr(collectives, "gather_objects", lambda held: [held, other if isinstance(held, tuple) else held])
    with pytest.raises(ValueError, match=r"^resume_from_checkpoint: tag 'global_step2': expected one save under it"):
        PoplarTrainer._check_resume(trainer, str(folder))
    monkeypatch.setattr(collectives, "gather_objects", lambda held: [held, held])
    assert PoplarTrainer._check_resume(trainer, str(folder)) == str(folder)


def _on_two_node_storages(trainer, monkeypatch, other_node):
    """`trainer` as rank 0 of a job on DeepSpeed's node-local storage (save_on_each_node: each node writes its own
    output_dir); the other node's first rank sees what `other_node(named)` returns for the collective reads."""
    from poplar_ext import collectives

    trainer.args.hf_deepspeed_config = SimpleNamespace(config={"checkpoint": {"use_node_local_storage": True}})
    trainer.args.local_process_index = 0

    def gather(held):
        return [held, other_node(held) if isinstance(held, list) else held]  # a list: what each node can resume

    monkeypatch.setattr(collectives, "gather_objects", gather)


def test_a_resume_on_node_local_storage_takes_the_newest_checkpoint_whole_on_every_node(tmp_path, monkeypatch):
    # The other node stopped after the save of checkpoint-4 and before its trainer_state.json: resuming
    # checkpoint-4 would fail on that node's ranks alone (the Trainer reads trainer_state.json on every rank).
    plan = _plan([(4, 2), (4, 1)])
    older = _checkpoint(tmp_path, plan, step=2, tag="global_step2")
    newer = _checkpoint(tmp_path, plan, step=4, tag="global_step4")
    trainer = _trainer(plan, tmp_path)

    def other_node(held):
        return [(name, f"{name}/trainer_state.json" if name == str(newer) else lacking) for name, lacking in held]

    _on_two_node_storages(trainer, monkeypatch, other_node)
    assert PoplarTrainer._check_resume(trainer, True) == str(older)
    for named in (str(newer), f"{newer}/"):
        with pytest.raises(ValueError, match=rf"{newer}: expected a whole checkpoint.*state.json missing on rank 1"):
            PoplarTrainer._check_resume(trainer, named)


def test_a_resume_where_the_first_node_has_no_checkpoint_is_refused_on_every_rank(tmp_path, monkeypatch):
    # A replacement node became rank 0 and its output_dir is empty: the Trainer's own pick would raise on rank 0 and
    # have the other node's ranks resume their newest checkpoint and wait.
    plan = _plan([(4, 2), (4, 1)])
    trainer = _trainer(plan, tmp_path / "empty")
    theirs = str(tmp_path / "empty" / "checkpoint-2")
    _on_two_node_storages(trainer, monkeypatch, lambda held: [(theirs, None)])
    with pytest.raises(ValueError, match=rf"{theirs}: expected a whole checkpoint.*on rank 0's storage"):
        PoplarTrainer._check_resume(trainer, True)


def test_resume_from_checkpoint_true_without_any_checkpoint_is_refused_alike_on_every_rank(tmp_path):
    plan = _plan([(4, 2), (4, 1)])
    trainer = _trainer(plan, tmp_path / "missing")
    trainer._check_resume = lambda named: PoplarTrainer._check_resume(trainer, named)
    with pytest.raises(ValueError, match=r"No valid checkpoint found in output directory \(.*missing\)"):
        PoplarTrainer.train(trainer, resume_from_checkpoint=True)


def test_the_engines_rebalancing_is_saved_and_goes_on_at_a_resume(tmp_path):
    plan = _plan([(4, 2), (4, 1)])
    trainer = _trainer(plan, tmp_path)
    speeds = {"drift_monitor": {"rank_scales": [4.0, 1.0], "streaks": [0, 1]}}
    trainer.poplar_engine = SimpleNamespace(plan_history=trainer._plan_history, rebalancing_state=lambda: speeds)
    folder = tmp_path / "checkpoint-2"
    write_state(folder, "global_step2", PoplarTrainer._poplar_state(trainer))
    (folder / "latest").write_text("global_step2")
    (folder / "trainer_state.json").write_text("{}")
    trainer.poplar_engine = None  # the resumed job's, built after the decision
    PoplarTrainer._check_resume(trainer, str(folder))
    assert trainer._resume_decision.rebalancing == speeds


def _under_deepspeed(trainer: SimpleNamespace, config: dict) -> SimpleNamespace:
    """`trainer` with the DeepSpeed config object TrainingArguments builds from `config`."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    trainer.args.hf_deepspeed_config = HfTrainerDeepSpeedConfig(config)
    return trainer


def _without_the_trainers_schedule(tmp_path: Path, plan=None) -> tuple[Path, SimpleNamespace]:
    """A Trainer checkpoint folder without scheduler.pt (as `_checkpoint` writes it), and a trainer whose
    DeepSpeed config has no scheduler of DeepSpeed's."""
    plan = plan or _plan([(4, 2), (4, 1)])
    folder = _checkpoint(tmp_path, plan, step=2, tag="global_step2")
    trainer = _under_deepspeed(_trainer(plan, tmp_path), {"zero_optimization": {"stage": 1}})
    return folder, trainer


@pytest.mark.parametrize("named", [True, False])
def test_a_checkpoint_without_the_trainers_schedule_is_refused_before_anything_is_loaded(tmp_path, named):
    # The Trainer torch.loads scheduler.pt when its scheduler is not DeepSpeed's: a FileNotFoundError deep in
    # transformers once the engine was built (on the resharding path, after DeepSpeed's load).
    folder, trainer = _without_the_trainers_schedule(tmp_path)
    with pytest.raises(ValueError) as refused:
        PoplarTrainer._check_resume(trainer, True if named else str(folder))
    message = str(refused.value)
    assert message.startswith(f"resume_from_checkpoint: {folder}: expected {folder / 'scheduler.pt'}")
    assert "the Trainer's learning-rate schedule" in message
    assert "not written by a Trainer" in message
    assert "saved under a DeepSpeed config with a 'scheduler' or 'optimizer' section" in message
    assert message.endswith("; resume it under the DeepSpeed config it was saved with")
    assert "engine.save_checkpoint" not in message  # its folders have no trainer_state.json: refused before this
    assert trainer._resume_decision is None  # refused before the decision


@pytest.mark.parametrize("section", ["scheduler", "optimizer"])
def test_a_checkpoint_without_scheduler_pt_resumes_where_deepspeed_holds_the_schedule(tmp_path, section):
    # With DeepSpeed's scheduler (its own, or the Trainer's built by DeepSpeed for its optimizer) the schedule is
    # in DeepSpeed's files, and the Trainer reads no scheduler.pt.
    folder, trainer = _without_the_trainers_schedule(tmp_path)
    trainer.args.hf_deepspeed_config.config[section] = {"type": "WarmupLR" if section == "scheduler" else "AdamW"}
    assert PoplarTrainer._check_resume(trainer, str(folder)) == str(folder)


def _plan_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("poplar plan from step")]


def test_a_resume_logs_the_step_it_resumed_at_and_the_plan_from_there(tmp_path, caplog):
    # The Trainer logged "poplar plan from step 0: ..." when built, and nothing of the resume's step.
    plan = _plan([(4, 2), (4, 1)])
    folder = _checkpoint(tmp_path, plan, step=2, tag="global_step2")
    trainer = _trainer(plan, tmp_path)
    with caplog.at_level("INFO", logger="poplar_ext"):
        PoplarTrainer._check_resume(trainer, str(folder))
    assert _plan_lines(caplog) == [f"poplar plan from step 2 (resumed from {folder}): the plan file p.json"]


def test_a_resume_under_another_plan_logs_the_step_beside_what_changed(tmp_path, caplog):
    folder = _checkpoint(tmp_path, _plan([(2, 2), (2, 2), (4, 1)]), step=2)
    trainer = _trainer(_plan([(3, 2), (2, 3)]), tmp_path)
    with caplog.at_level("INFO", logger="poplar_ext"):
        PoplarTrainer._check_resume(trainer, str(folder))
    assert _plan_lines(caplog) == [f"poplar plan from step 2 (resumed from {folder}): the plan file p.json"]
    assert f"resume_from_checkpoint: resumed from {folder} under another plan (3 ranks then, 2 now)" in caplog.text


def test_a_resume_under_the_checkpoints_last_plan_names_it(tmp_path, caplog):
    # The saved run re-balanced at step 1; this job starts from the plan that run started from.
    first, switched = _plan([(4, 2), (4, 1)]), _plan([(2, 3), (3, 2)])
    history = [
        history_entry(first, start_step=0, data_position=0, reason="the plan file p.json"),
        history_entry(switched, start_step=1, data_position=12, reason="re-balanced at step 1: a test", switched=True),
    ]
    state = poplar_client_state(switched, consumed_samples=24, seed=0, shuffle=True, plan_history=history)
    folder = tmp_path / "checkpoint-2"
    write_state(folder, "global_step2", {**state, "step": 2})
    (folder / "latest").write_text("global_step2")
    (folder / "scheduler.pt").write_text("the Trainer's schedule")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    trainer = _trainer(first, tmp_path)
    with caplog.at_level("INFO", logger="poplar_ext"):
        PoplarTrainer._check_resume(trainer, str(folder))
    assert trainer._resume_decision.continue_plan is not None
    assert _plan_lines(caplog) == [
        f"poplar plan from step 2 (resumed from {folder}): the checkpoint's last plan (re-balanced at step 1: a test)"
    ]


def test_a_resume_without_poplar_state_logs_the_trainers_step(tmp_path, caplog):
    plan = _plan([(4, 2), (4, 1)])
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    (folder / "scheduler.pt").write_text("the Trainer's schedule")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    trainer = _trainer(plan, tmp_path)
    with caplog.at_level("INFO", logger="poplar_ext"):
        assert PoplarTrainer._check_resume(trainer, str(folder)) == str(folder)
    assert _plan_lines(caplog) == [f"poplar plan from step 3 (resumed from {folder}): the plan file p.json"]
    assert "the checkpoint holds no poplar-ext state" in caplog.text


def test_a_checkpoint_without_the_trainers_schedule_resumes_without_a_deepspeed_config_object(tmp_path):
    # No DeepSpeed config object: not the Trainer under DeepSpeed, which reads no scheduler.pt there.
    folder, trainer = _without_the_trainers_schedule(tmp_path)
    trainer.args.hf_deepspeed_config = None
    assert PoplarTrainer._check_resume(trainer, str(folder)) == str(folder)
    assert not (folder / "scheduler.pt").exists()


def test_the_other_refusals_of_a_resume_come_before_the_trainers_schedule(tmp_path):
    # Another global batch is the refusal to fix first; the schedule is a matter of the DeepSpeed config.
    folder, trainer = _without_the_trainers_schedule(tmp_path, plan=_plan([(4, 2), (2, 2)]))
    trainer.plan = _plan([(4, 2), (2, 1)])
    with pytest.raises(ValueError, match="trained global batches of 12 samples, this job's plan has 10"):
        PoplarTrainer._check_resume(trainer, str(folder))
    assert trainer._resume_decision is None


def test_a_named_folder_on_no_storage_is_left_to_the_trainers_own_error(tmp_path):
    # The Trainer's "Can't find a valid checkpoint at ..." names it; it is no folder a Trainer did not write.
    _, trainer = _without_the_trainers_schedule(tmp_path)
    missing = tmp_path / "checkpoint-9"
    assert PoplarTrainer._check_resume(trainer, str(missing)) == str(missing)
    assert trainer._resume_decision is None


@pytest.mark.parametrize("on_both", [False, True])
def test_a_trainer_state_missing_on_one_node_only_is_not_named_a_folder_no_trainer_saved(
    tmp_path, monkeypatch, on_both
):
    # Node-local storage without save_on_each_node: the Trainer wrote trainer_state.json on the first node alone.
    # That node's folder is a Trainer's: "a folder no Trainer saved" would point the wrong way. Missing on every
    # node, the folder may be one no Trainer saved.
    plan = _plan([(4, 2), (4, 1)])
    folder = _checkpoint(tmp_path, plan, step=2, tag="global_step2")
    if on_both:
        (folder / "trainer_state.json").unlink()
    trainer = _trainer(plan, tmp_path)
    state = f"{folder}/trainer_state.json"
    _on_two_node_storages(trainer, monkeypatch, lambda held: [(name, state) for name, _ in held])
    with pytest.raises(ValueError) as refused:
        PoplarTrainer._check_resume(trainer, str(folder))
    message = str(refused.value)
    assert f"did not finish ({state} missing on rank {0 if on_both else 1}'s storage)" in message
    assert ("or a folder no Trainer saved" in message) == on_both


def _with_model_states(folder: Path, tag: str, saved_module) -> None:
    """`folder`/`tag` holding DeepSpeed's model states file as a ZeRO 1-2 save writes it for `saved_module`."""
    import torch

    shapes = {name: p.shape for name, p in saved_module.named_parameters()}
    torch.save(
        {"module": saved_module.state_dict(), "param_shapes": [shapes]}, folder / tag / "mp_rank_00_model_states.pt"
    )


def test_a_checkpoint_of_another_model_is_refused_before_the_trainer_loads_it(tmp_path):
    # DeepSpeed pads a resharded ZeRO-3 checkpoint of another model to this one's sizes, and trains.
    import torch

    plan = _plan([(4, 2), (4, 1)])
    folder = _checkpoint(tmp_path, plan, step=2, tag="global_step2")
    _with_model_states(folder, "global_step2", torch.nn.Linear(4, 2))
    trainer = _trainer(plan, tmp_path)
    trainer.model = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError) as refused:
        PoplarTrainer._check_resume(trainer, str(folder))
    message = str(refused.value)
    assert message.startswith(f"resume_from_checkpoint: {folder / 'global_step2' / 'mp_rank_00_model_states.pt'}: ")
    assert "weight: expected [3, 4], found [2, 4]" in message
    assert trainer._resume_decision is None  # refused before the decision

    trainer.model = torch.nn.Linear(4, 2)  # the model it was saved from
    assert PoplarTrainer._check_resume(trainer, str(folder)) == str(folder)
    assert trainer._resume_decision is not None


def test_a_checkpoint_missing_a_ranks_zero_file_is_refused_before_the_trainer_loads_it(tmp_path):
    # The Trainer's DeepSpeed load failed on the rank reading the missing file while the others waited.
    plan = _plan([(4, 2), (4, 1)])
    folder = _checkpoint(tmp_path, plan, step=2, tag="global_step2")
    (folder / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_text("DeepSpeed's")
    trainer = _trainer(plan, tmp_path)
    with pytest.raises(ValueError) as refused:
        PoplarTrainer._check_resume(trainer, str(folder))
    message = str(refused.value)
    assert message.startswith(f"resume_from_checkpoint: {folder / 'global_step2'}: expected the ZeRO stage 1 files")
    assert "*zero_pp_rank_1_mp_rank_*_optim_states.pt" in message
    assert trainer._resume_decision is None


@pytest.mark.parametrize("bf16", [True, False])
def test_optimizer_states_of_another_precision_are_refused_before_the_trainer_loads_them(tmp_path, bf16):
    # DeepSpeed names bf16 optimizer files bf16_zero_pp_rank_*: on the ranks that saved them, the other precision
    # failed on every rank with a bare FileNotFoundError once the engine was built.
    plan = _plan([(4, 2), (4, 1)])
    folder = _checkpoint(tmp_path, plan, step=2, tag="global_step2")
    (folder / "scheduler.pt").write_text("the Trainer's schedule")
    saved_prefix = "" if bf16 else "bf16_"
    for rank in range(2):
        (folder / "global_step2" / f"{saved_prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_text("")
    config = {"zero_optimization": {"stage": 1}, "bf16": {"enabled": bf16}}
    trainer = _under_deepspeed(_trainer(plan, tmp_path), config)
    with pytest.raises(ValueError, match=rf"^resume_from_checkpoint: {folder / 'global_step2'}: expected the "):
        PoplarTrainer._check_resume(trainer, str(folder))
    config["bf16"]["enabled"] = not bf16  # the precision it was saved in
    trainer = _under_deepspeed(_trainer(plan, tmp_path), config)
    assert PoplarTrainer._check_resume(trainer, str(folder)) == str(folder)


@pytest.mark.parametrize(("saved_on", "resharded"), [([(2, 2), (2, 2), (4, 1)], True), ([(4, 2), (4, 1)], False)])
def test_the_best_model_saved_on_another_number_of_ranks_is_loaded_resharded(
    tmp_path, monkeypatch, saved_on, resharded
):
    # load_best_model_at_end after a resume on 2 ranks of a run whose best checkpoint 3 ranks saved: DeepSpeed's own
    # load (the Trainer's) refuses another DP world size at the very end of the run.
    from transformers import Trainer

    folder = _checkpoint(tmp_path, _plan(saved_on), step=2, tag="global_step2")
    plan = _plan([(3, 2), (2, 3)])
    trainer = PoplarTrainer.__new__(PoplarTrainer)
    trainer.__dict__.update(
        is_deepspeed_enabled=True,
        job=SimpleNamespace(rank=0, world_size=2, plan=plan),
        state=SimpleNamespace(best_model_checkpoint=str(folder), best_metric=0.5),
    )
    loads = []
    monkeypatch.setattr(Trainer, "_load_best_model", lambda self: loads.append("as saved"))
    monkeypatch.setattr(
        PoplarTrainer,
        "_load_resharded",
        lambda self, folder, tag, caller: loads.append((folder, tag, caller)),
        raising=False,
    )
    PoplarTrainer._load_best_model(trainer)
    expected = [(str(folder), "global_step2", "load_best_model_at_end")] if resharded else ["as saved"]
    assert loads == expected


def test_a_plain_trainers_best_model_saved_on_another_number_of_ranks_is_loaded_resharded(tmp_path, monkeypatch):
    # A plain Trainer's run (no poplar_state.json) resumed by PoplarTrainer on 2 ranks, its best checkpoint still the
    # plain run's of 3: the best model went to DeepSpeed's own load as saved, which refuses another DP world size
    # ("ZeRORuntimeException: The checkpoint being loaded used a DP world size of 3 ...") at the end of the run.
    from transformers import Trainer

    folder = tmp_path / "checkpoint-2"
    (folder / "global_step2").mkdir(parents=True)
    (folder / "latest").write_text("global_step2")
    import torch

    torch.save({"module": {}, "dp_world_size": 3}, folder / "global_step2" / "mp_rank_00_model_states.pt")
    plan = _plan([(3, 2), (2, 3)])
    trainer = PoplarTrainer.__new__(PoplarTrainer)
    trainer.__dict__.update(
        is_deepspeed_enabled=True,
        job=SimpleNamespace(rank=0, world_size=2, plan=plan),
        state=SimpleNamespace(best_model_checkpoint=str(folder), best_metric=0.5),
    )
    loads = []
    monkeypatch.setattr(Trainer, "_load_best_model", lambda self: loads.append("as saved"))
    monkeypatch.setattr(
        PoplarTrainer,
        "_load_resharded",
        lambda self, folder, tag, caller: loads.append((folder, tag, caller)),
        raising=False,
    )
    PoplarTrainer._load_best_model(trainer)
    assert loads == [(str(folder), "global_step2", "load_best_model_at_end")]


def test_a_save_after_the_best_model_is_loaded_holds_the_best_checkpoints_poplar_state(tmp_path, monkeypatch):
    # At the end of the run the engine holds checkpoint-2's weights, optimizer and DeepSpeed step (its tag
    # global_step2): trainer.save_model's DeepSpeed save at ZeRO 3 must not say step 8 and the data of step 8.
    from transformers import Trainer

    plan = _plan([(4, 2), (4, 1)])
    folder = _checkpoint(tmp_path, plan, step=2, tag="global_step2")
    trainer = PoplarTrainer.__new__(PoplarTrainer)
    fields = vars(_trainer(plan, tmp_path))
    trainer.__dict__.update({k: v for k, v in fields.items() if k not in ("_poplar_state", "_restore_replaced_tags")})
    trainer.__dict__.update(
        is_deepspeed_enabled=True, state=SimpleNamespace(global_step=8, best_model_checkpoint=str(folder))
    )
    trainer.job.world_size, trainer.job.plan = 2, plan
    monkeypatch.setattr(Trainer, "_load_best_model", lambda self: None)
    assert trainer._poplar_state()["step"] == 8
    PoplarTrainer._load_best_model(trainer)
    state = trainer._poplar_state()
    assert (state["step"], state["consumed_samples"], state["data_position"]) == (2, 24, 24)


def test_a_save_after_a_best_model_loaded_resharded_names_this_jobs_ranks(tmp_path, monkeypatch):
    # The best checkpoint saved on 3 ranks, loaded resharded on 2 (a run resumed on fewer): a DeepSpeed save from
    # here on (save_model's at ZeRO 3) writes 2 ranks' files, so its state must name this job's 2-rank plan. With
    # the best checkpoint's 3-rank plan, a load on 3 ranks let DeepSpeed refuse the 2-rank files, and one on 2
    # resharded files already of its own ranks.
    from transformers import Trainer

    from poplar_ext.runtime.checkpoint import resume_decision

    saved_on, plan = _plan([(2, 2), (2, 2), (4, 1)]), _plan([(3, 2), (2, 3)])
    folder = _checkpoint(tmp_path, saved_on, step=2, tag="global_step2")
    trainer = PoplarTrainer.__new__(PoplarTrainer)
    fields = vars(_trainer(plan, tmp_path))
    trainer.__dict__.update({k: v for k, v in fields.items() if k not in ("_poplar_state", "_restore_replaced_tags")})
    trainer.__dict__.update(
        is_deepspeed_enabled=True,
        state=SimpleNamespace(global_step=8, best_model_checkpoint=str(folder), best_metric=0.5),
    )
    trainer.job.world_size, trainer.job.plan = 2, plan
    monkeypatch.setattr(Trainer, "_load_best_model", lambda self: None)
    monkeypatch.setattr(PoplarTrainer, "_load_resharded", lambda self, folder, tag, caller: None, raising=False)
    PoplarTrainer._load_best_model(trainer)
    state = trainer._poplar_state()
    assert (state["step"], state["consumed_samples"], state["data_position"]) == (2, 24, 24)
    assert len(state["plan"]["ranks"]) == 2
    again = resume_decision(state, trainer._poplar_state(), path=str(folder), step=2)
    assert not again.world_size_changed and again.data_position == 24
    assert state["plan_history"][-1]["start_step"] == 2  # the resharded load, as a resume on 2 ranks records it
