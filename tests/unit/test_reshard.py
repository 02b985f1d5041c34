"""Which optimizer states a resume on another number of ranks carries over, and which it refuses.

The states are those of one flat ZeRO partition (one parameter group of one rank);
the resharding itself is tested with real ranks in tests/dist/test_resume_any_optimizer.py.
"""

from __future__ import annotations

import pytest
import torch

from poplar_ext.runtime.reshard import carried_states, convert_checkpoint, main

NUMEL = 6


def _carried(state):
    return carried_states(state, partition_numel=NUMEL, optimizer_name="Opt", saved_ranks=3)


def test_every_per_element_state_and_step_are_carried_and_none_is_skipped():
    state = {
        "exp_avg": torch.zeros(NUMEL),
        "exp_avg_sq": torch.ones(NUMEL),
        "momentum_buffer": torch.zeros(NUMEL),
        "step": torch.tensor(4.0),
        "unused": None,
    }
    assert sorted(_carried(state)) == ["exp_avg", "exp_avg_sq", "momentum_buffer", "step"]
    assert _carried({"step": 7}) == {"step": 7}  # an int step stays an int
    assert _carried({}) == {}  # SGD before its first step


def test_the_last_ranks_padded_states_are_carried_but_no_other_length():
    # DeepSpeed strips the group padding from the saved fp32 partition, not from the states.
    padded = {"exp_avg": torch.zeros(NUMEL + 4), "step": 2}
    carried = carried_states(padded, partition_numel=NUMEL, optimizer_name="Opt", saved_ranks=3, padding_numel=4)
    assert sorted(carried) == ["exp_avg", "step"]
    with pytest.raises(ValueError, match=r"'exp_avg' as a tensor of shape \(10,\)"):
        carried_states(padded, partition_numel=NUMEL, optimizer_name="Opt", saved_ranks=3, padding_numel=3)


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"row_var": torch.zeros(2)}, r"Opt keeps the state 'row_var' as a tensor of shape \(2,\)"),
        ({"grid": torch.zeros(2, 3)}, r"'grid' as a tensor of shape \(2, 3\)"),  # as many elements, not flat
        ({"mu_product": torch.tensor(0.9)}, r"'mu_product' as a tensor of shape \(\)"),  # a scalar other than step
        ({"old_dirs": []}, r"'old_dirs' as a list"),  # not per-parameter (LBFGS)
        ({"step": torch.zeros(NUMEL)}, r"'step' as a tensor of shape \(6,\)"),
        ({"fp32": torch.zeros(NUMEL)}, r"'fp32'"),  # the weights' own name in the checkpoint
        ({0: torch.zeros(NUMEL)}, r"the state 0 "),
    ],
)
def test_a_state_that_cannot_be_cut_is_refused_naming_the_optimizer_and_the_key(state, match):
    with pytest.raises(ValueError, match=match) as raised:
        _carried(state)
    assert "resume this checkpoint on 3 ranks, as it was saved" in str(raised.value)


def test_an_existing_output_folder_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="exists already"):
        convert_checkpoint(tmp_path / "in", tmp_path)
    assert main(["--input_folder", str(tmp_path / "in"), "--output_folder", str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_an_input_folder_that_is_not_a_folder_is_named_as_such(tmp_path, capsys, kind):
    # It read "holds no ZeRO optimizer state", as if the folder were a checkpoint of the wrong stage.
    source = tmp_path / "ckpt" / "global_step2"
    if kind == "file":
        source.parent.mkdir()
        source.write_text("")
    found = "no such folder" if kind == "missing" else "a file"
    with pytest.raises(ValueError, match=rf"^{source}: expected a checkpoint's tag folder, found {found}$"):
        convert_checkpoint(source, tmp_path / "out")
    assert main(["--input_folder", str(source), "--output_folder", str(tmp_path / "out")]) == 2
    assert f"found {found}" in capsys.readouterr().err


@pytest.mark.parametrize("with_latest", [True, False])
def test_the_folder_holding_the_tags_is_named_as_such_with_a_tag_to_pass(tmp_path, capsys, with_latest):
    # It read "holds no ZeRO optimizer state (...): nothing to reshard", as if there were nothing to do.
    save_dir = tmp_path / "ckpt"
    for tag in ("global_step9", "global_step10"):
        (save_dir / tag).mkdir(parents=True)
        (save_dir / tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    (save_dir / "global_step2").mkdir()  # a ZeRO-0 save: its optimizer state is in the model states file
    (save_dir / "global_step2" / "mp_rank_00_model_states.pt").write_bytes(b"")
    if with_latest:
        (save_dir / "latest").write_text("global_step9\n")
    expected = (
        f"{save_dir}: expected a checkpoint's tag folder, found the folder holding the tags (global_step2, "
        f"global_step9, global_step10{'; latest: global_step9' if with_latest else ''}); pass one of them, e.g. "
        f"{save_dir / ('global_step9' if with_latest else 'global_step10')}"
    )
    with pytest.raises(ValueError) as raised:
        convert_checkpoint(save_dir, tmp_path / "out")
    assert str(raised.value) == expected
    assert main(["--input_folder", str(save_dir), "--output_folder", str(tmp_path / "out")]) == 2
    assert expected in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_checkpoint_missing_a_ranks_optimizer_file_is_refused_naming_it(tmp_path, capsys):
    # It failed with "RuntimeError: shape '[16, 64]' is invalid for input of size 96" and a traceback: DeepSpeed's
    # converter took the two files there for a checkpoint of two ranks.
    import json

    source = tmp_path / "ckpt" / "global_step3"
    source.mkdir(parents=True)
    (source / "mp_rank_00_model_states.pt").write_bytes(b"")
    for rank in (0, 1):  # rank 2's lost
        (source / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    plan = {"zero_stage": 1, "global_batch_size": 12, "ranks": [{"device_type": "cpu"}] * 3}
    state = {"seed": 0, "shuffle": True, "consumed_samples": 36, "plan": plan}
    (source / "poplar_state.json").write_text(json.dumps(state))
    expected = (
        f"{source}: expected the ZeRO stage 1 files of each of the 3 ranks that saved it (poplar_state.json: "
        "plan.ranks), found 1 missing (*zero_pp_rank_2_mp_rank_*_optim_states.pt): the checkpoint is incomplete (a "
        "file lost, or not copied); copy the missing files from where it was saved, or load another checkpoint"
    )
    with pytest.raises(ValueError) as raised:
        convert_checkpoint(source, tmp_path / "out")
    assert str(raised.value) == expected
    assert main(["--input_folder", str(source), "--output_folder", str(tmp_path / "out")]) == 2
    assert expected in capsys.readouterr().err and not (tmp_path / "out").exists()
