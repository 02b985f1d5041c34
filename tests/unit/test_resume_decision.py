"""Which plan a resumed job continues under (poplar_ext.runtime.checkpoint.resume_decision)."""

from __future__ import annotations

import copy
import json

import pytest

from poplar_ext.plan.errors import FormatError
from poplar_ext.runtime.checkpoint import STATE_FILE, read_state, resume_decision


def _plan(allocation, *, checkpointing=(False, False)):
    return {
        "schema_version": 1,
        "zero_stage": 1,
        "global_batch_size": sum(b * s for b, s in allocation),
        "ranks": [
            {
                "rank": r,
                "device_type": t,
                "micro_batch_size": b,
                "gradient_accumulation_steps": s,
                "activation_checkpointing": c,
            }
            for r, ((b, s), t, c) in enumerate(zip(allocation, ["fast", "slow"], checkpointing))
        ],
    }


STARTED = [(4, 3), (2, 2)]
SWITCHED = [(4, 2), (2, 4)]


def _saved(started):
    switched = copy.deepcopy(started)
    for rank, (b, s) in zip(switched["ranks"], SWITCHED):
        rank.update(micro_batch_size=b, gradient_accumulation_steps=s)
    history = [
        {"start_step": 0, "data_position": 0, "reason": "searched", "plan": started},
        {"start_step": 5, "data_position": 80, "reason": "re-balanced", "plan": switched, "switched": True},
    ]
    return {
        "seed": 0,
        "shuffle": True,
        "drop_last": False,
        "consumed_samples": 160,
        "data_position": 160,
        "plan": switched,
        "plan_history": history,
    }


def _current(plan):
    return {"seed": 0, "shuffle": True, "drop_last": False, "plan": plan}


def test_a_job_started_from_the_same_plan_continues_under_the_switched_one():
    started = _plan(STARTED, checkpointing=(False, True))
    decision = resume_decision(_saved(started), _current(copy.deepcopy(started)), path="ckpt", step=10)
    assert decision.continue_plan is not None
    assert [
        (r["micro_batch_size"], r["gradient_accumulation_steps"]) for r in decision.continue_plan["ranks"]
    ] == SWITCHED
    assert decision.data_position == 160


def test_a_job_whose_plan_checkpoints_otherwise_keeps_its_own_plan():
    # Same allocation, other activation checkpointing: the saved run's switched plan would
    # bring back the old setting, which the runtime applied once, before training.
    saved = _saved(_plan(STARTED, checkpointing=(False, True)))
    decision = resume_decision(saved, _current(_plan(STARTED, checkpointing=(False, False))), path="ckpt", step=10)
    assert decision.continue_plan is None
    assert decision.data_position == 160
    assert decision.plan_history[-1]["plan"]["ranks"][1]["activation_checkpointing"] is False


def test_a_stage_deepspeed_cannot_load_the_files_at_is_refused_naming_both():
    """DeepSpeed's loader fails deep inside (a bare assertion, a missing file, None.copy) across its layouts:
    stage 0, stages 1-2, stage 3."""
    saved = _saved(_plan(STARTED))
    for saved_stage, stage, allowed in ((1, 3, "1 or 2"), (3, 2, "3"), (0, 1, "0"), (2, 0, "1 or 2")):
        saved["plan"]["zero_stage"] = saved_stage
        current = _plan(STARTED)
        current["zero_stage"] = stage
        with pytest.raises(ValueError) as refused:
            resume_decision(saved, _current(current), path="ckpt/t", step=10)
        assert str(refused.value).startswith("load_checkpoint: ckpt/t: poplar_state.json: plan.zero_stage: expected")
        assert f"found {saved_stage}: resume it at ZeRO stage {allowed} (" in str(refused.value)
    saved["plan"]["zero_stage"] = 1
    current = _plan(STARTED)
    current["zero_stage"] = 2  # the same files: DeepSpeed loads them
    assert resume_decision(saved, _current(current), path="ckpt/t", step=10).data_position == 160


def test_a_state_file_without_what_a_resume_reads_names_the_file_and_field(tmp_path):
    """A truncated copy or a hand edit: a FormatError, not a KeyError deep in the resume."""
    state = _saved(_plan(STARTED))
    (tmp_path / "t").mkdir()
    path = tmp_path / "t" / STATE_FILE
    for field, value, expected in (
        ("seed", None, "seed: expected a value, found "),
        ("shuffle", "yes", "shuffle: expected true or false, found "),
        ("plan", {"ranks": []}, "plan.zero_stage: expected a value, found "),
        ("pending_switch", {"plan": {}, "position": -16, "reason": "r"}, "pending_switch.position: expected an"),
        ("drift_monitor", {"rank_scales": [4.0, 0], "streaks": [0, 0]}, "drift_monitor.rank_scales[1]: expected a"),
    ):
        broken = {k: v for k, v in state.items() if k != field}
        if value is not None:
            broken[field] = value
        path.write_text(json.dumps(broken))
        with pytest.raises(FormatError) as refused:
            read_state(tmp_path, "t")
        assert str(refused.value).startswith(f"{path}: {expected}")
    path.write_text(json.dumps(state))
    assert read_state(tmp_path, "t") == state


def test_the_saved_rebalancing_goes_on_only_where_the_job_continues_the_last_plan_on_the_same_device_types():
    pending = {"plan": _plan([(4, 1), (2, 6)]), "position": 176, "reason": "re-balanced again"}
    rebalancing = {"pending_switch": pending, "drift_monitor": {"rank_scales": [1.0, 0.5], "streaks": [1, 0]}}
    saved = {**_saved(_plan(STARTED)), **rebalancing}
    other_types = copy.deepcopy(saved["plan"])
    other_types["ranks"][1]["device_type"] = "other"
    for current, continued in (
        (copy.deepcopy(saved["plan"]), True),  # the last plan
        (_plan(STARTED), True),  # the plan the run started from: continues under the last
        (other_types, False),
        (_plan([(4, 2), (2, 1)]), False),  # another global batch
    ):
        decision = resume_decision(saved, _current(current), path="ckpt", step=10)
        assert decision.rebalancing == (rebalancing if continued else {})


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_new_batch_says_where_the_data_continues(drop_last):
    # With drop_last the sampler starts at the new batch's first iteration at or after the position
    # (PlanBatchSampler.set_position): the note must not say the data continues exactly there.
    saved = {**_saved(_plan(STARTED)), "drop_last": drop_last}
    current = {**_current(_plan([(4, 2), (2, 1)])), "drop_last": drop_last}
    notes = " ".join(resume_decision(saved, current, path="ckpt", step=10).notes)
    assert "the data continues at stream position 160 with the new batch" in notes
    assert ("fewer than a batch, are skipped in this epoch" in notes) is drop_last
    # The new batch's grid may leave no whole iteration in the rest of the epoch: 17 samples, 7 trained by a batch of
    # 7, then a batch of 6 (iterations at 0 and 6 in each epoch) skips the other 10, not fewer than a batch.
    assert ("the rest of this epoch is skipped too: up to twice the new batch less 2 samples" in notes) is drop_last


def test_the_weights_alone_load_across_stages_0_to_2_not_3():
    # DeepSpeed's model file holds every weight at stages 0-2: load_optimizer_states=False loads it at any of
    # them; stage 3 partitions the weights too.
    saved = _saved(_plan(STARTED))
    for saved_stage, stage in ((0, 1), (1, 0), (2, 0)):
        saved["plan"]["zero_stage"] = saved_stage
        current = _plan(STARTED)
        current["zero_stage"] = stage
        decision = resume_decision(saved, _current(current), path="ckpt/t", step=10, load_optimizer_states=False)
        assert decision.data_position == 160
        with pytest.raises(ValueError, match=r"or load its weights alone \(load_optimizer_states=False\)$"):
            resume_decision(saved, _current(current), path="ckpt/t", step=10)
    saved["plan"]["zero_stage"] = 1
    current = _plan(STARTED)
    current["zero_stage"] = 3
    with pytest.raises(ValueError, match=r"resume it at ZeRO stage 1 or 2 \(zero_optimization.stage, or poplar"):
        resume_decision(saved, _current(current), path="ckpt/t", step=10, load_optimizer_states=False)
