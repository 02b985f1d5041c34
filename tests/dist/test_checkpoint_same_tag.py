"""Saves into one tag on another number of ranks: a resume loads the last save, never an earlier one's files.

3 ranks save into tag ``last``; 2 ranks resume it (which writes ``last_universal``), train and save into
``last`` again; 3 ranks resume ``last``. They must get the 2 ranks' parameters: neither the resharded
copy of the first save nor the first save's third optimizer shard (left beside the second save's two)
may be taken for the second save. ZeRO stages 1 and 3, forked groups of 3, 2 and 3 ranks.
Also on 2 ranks: a save at another ZeRO stage or dtype (fp32, bf16) leaves only its own files in the tag, and a
save that fails on one rank leaves the earlier checkpoint, which a resume loads; one rank failing to write its
file fails the save on every rank at once (not at the group's timeout).
"""

from __future__ import annotations

import os

import _training as t
import pytest
import torch
from harness import run_ranks, run_ranks_outcomes

STAGES = (1, 3)
ALLOCATIONS = {
    3: {1: [(2, 2), (2, 2), (4, 1)], 3: [(2, 2), (1, 2), (3, 2)]},
    2: {1: [(3, 2), (6, 1)], 3: [(4, 2), (2, 2)]},
}


def _engine(files, stage, dtype="fp32"):
    import poplar_ext

    cluster, plan = files[int(os.environ["WORLD_SIZE"]), stage]
    model = t.GPT(t.TINY)
    config = t.ds_config(cluster=cluster, plan=plan, stage=stage) | (
        {"bf16": {"enabled": True}} if dtype == "bf16" else {}
    )
    engine, *_ = poplar_ext.initialize(
        model=model, optimizer=t.make_optimizer("adam", model.parameters()), config=config
    )
    data = t.dataset()
    return engine, torch.utils.data.DataLoader(data, batch_sampler=engine.create_batch_sampler(len(data)))


def _phase(files, *, load, save):
    out = {}
    for stage in STAGES:
        engine, loader = _engine(files, stage)
        if load:
            engine.load_checkpoint(files["root"] / f"stage{stage}", tag="last")
            out[stage] = t.full_parameters(engine)
        if save:
            t.train_steps(engine, loader, 2)
            engine.save_checkpoint(files["root"] / f"stage{stage}", tag="last")
            out[stage] = t.full_parameters(engine)
    return out


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    root = tmp_path_factory.mktemp("same_tag")
    files = {"root": root, **t.write_world_files(root, ALLOCATIONS)}
    options = {"tmp_path": root, "args": (files,), "timeout_s": 300}
    first = run_ranks(_phase, world_size=3, kwargs={"load": False, "save": True}, **options)
    second = run_ranks(_phase, world_size=2, kwargs={"load": True, "save": True}, **options)
    third = run_ranks(_phase, world_size=3, kwargs={"load": True, "save": False}, **options)
    return first, second, third


@pytest.mark.parametrize("stage", STAGES)
def test_a_resume_loads_the_last_save_into_a_tag(phases, stage):
    first, second, third = phases
    assert t.max_difference(first[0][stage], second[0][stage]) > 1e-3  # the two saves differ
    for rank in third:
        assert t.max_difference(rank[stage], second[0][stage]) <= 1e-6


def _save_each(files, saves):
    folder = files["root"] / "layouts"
    for stage, dtype in saves:  # each save's files, of other names than the earlier's (stage 1 and 3; bf16_ prefixes)
        engine, _ = _engine(files, stage, dtype)
        engine.save_checkpoint(folder, tag="last")
    engine.save_checkpoint(folder, tag="fresh")
    return {tag: sorted(p.name for p in (folder / tag).iterdir()) for tag in ("last", "fresh")}


@pytest.mark.parametrize(
    "saves",
    [((1, "fp32"), (3, "fp32")), ((1, "fp32"), (1, "bf16")), ((1, "bf16"), (1, "fp32"))],
    ids=["stage1-stage3", "fp32-bf16", "bf16-fp32"],
)
def test_a_save_at_another_stage_or_dtype_leaves_only_its_own_files_in_the_tag(tmp_path, saves):
    files = {"root": tmp_path, **t.write_world_files(tmp_path, {2: ALLOCATIONS[2]})}
    listings = run_ranks(_save_each, world_size=2, tmp_path=tmp_path, args=(files, saves), timeout_s=180)
    assert listings[0]["last"] == listings[0]["fresh"]
    bf16_shards = any(name.startswith("bf16_zero_pp_rank_") for name in listings[0]["fresh"])
    assert bf16_shards == (saves[-1][1] == "bf16")  # each dtype's own names (DeepSpeed's _get_zero_ckpt_prefix)


def _saved_then_trained(files, folder):
    """A ZeRO-1 engine that saved tag "last" into `folder` and trained on; the parameters it saved."""
    engine, loader = _engine(files, 1)
    t.train_steps(engine, loader, 1)
    engine.save_checkpoint(files["root"] / folder, tag="last")
    earlier = t.full_parameters(engine)
    t.train_steps(engine, loader, 2)
    return engine, earlier


def _save_then_fail(files):
    engine, earlier = _saved_then_trained(files, "failed")
    if os.environ["RANK"] == "1":  # rank 0 writes the model file and its shard; this rank fails at its own

        def lost(*args, **kwargs):
            raise OSError("disk full")

        engine.deepspeed_engine._save_zero_checkpoint = lost
    try:
        engine.save_checkpoint(files["root"] / "failed", tag="last")
    except Exception as exc:  # noqa: BLE001 - rank 1's error; rank 0's lost peer, in DeepSpeed's barrier
        return earlier, str(exc)
    return earlier, None


def _resume(files, folder="failed"):
    engine, _ = _engine(files, 1)
    engine.load_checkpoint(files["root"] / folder)  # latest
    return t.full_parameters(engine)


def test_a_save_that_fails_on_a_rank_leaves_the_earlier_checkpoint(tmp_path):
    files = {"root": tmp_path, **t.write_world_files(tmp_path, {2: ALLOCATIONS[2]})}
    options = {"world_size": 2, "tmp_path": tmp_path, "args": (files,), "timeout_s": 180}
    (earlier, _), (_, error) = [outcome.value for outcome in run_ranks_outcomes(_save_then_fail, **options)]
    assert error == "disk full"
    for rank in run_ranks(_resume, **options):
        assert t.max_difference(rank, earlier) <= 1e-6


def _save_with_a_full_disk(files):
    # Rank 1's shard cannot be written (disk full) and that rank lives on, as a rank whose caller catches the
    # error does, or one under NCCL, whose peers no closed connection tells: rank 0 must not wait for it.
    import time

    engine, earlier = _saved_then_trained(files, "full")
    checkpoints = engine.deepspeed_engine.checkpoint_engine
    write = checkpoints.save

    def full(state_dict, path):
        if os.environ["RANK"] == "1" and "optim_states" in str(path):
            raise OSError(28, "No space left on device")
        return write(state_dict, path)

    checkpoints.save = full
    started = time.monotonic()
    try:
        engine.save_checkpoint(files["root"] / "full", tag="last")
        error = None
    except Exception as exc:  # noqa: BLE001 - what each rank was told
        error = f"{type(exc).__name__}: {exc}"
    waited_s = time.monotonic() - started
    (files["root"] / f"failed{os.environ['RANK']}").touch()
    while not all((files["root"] / f"failed{rank}").exists() for rank in "01") and time.monotonic() - started < 40:
        time.sleep(0.1)
    return earlier, error, waited_s


def test_a_rank_failing_to_write_its_part_fails_the_save_on_every_rank_at_once(tmp_path):
    files = {"root": tmp_path, **t.write_world_files(tmp_path, {2: ALLOCATIONS[2]})}
    options = {"world_size": 2, "tmp_path": tmp_path, "args": (files,), "timeout_s": 180}
    outcomes = run_ranks(_save_with_a_full_disk, **options, pg_timeout_s=20)
    for _, error, waited_s in outcomes:
        assert error == "RuntimeError: rank 1 failed: OSError: [Errno 28] No space left on device"
        assert waited_s < 10
    for rank in run_ranks(_resume, **options, kwargs={"folder": "full"}):
        assert t.max_difference(rank, outcomes[0][0]) <= 1e-6
