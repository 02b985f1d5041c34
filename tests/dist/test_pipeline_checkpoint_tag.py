"""A pipeline checkpoint DeepSpeed could not load is refused at its save; a missing tag names its folder; a save
into a tag that fails on one rank leaves the tag's earlier checkpoint, which a resume loads.

DeepSpeed finds a checkpoint's files by a glob pattern of its path: a tag like ``run[1]`` would be saved
and never loaded. 3 forked CPU ranks, a 2-stage pipeline beside a 1-stage one.
"""

from __future__ import annotations

import os
import shutil

import _training as t
import pytest
from harness import run_ranks, run_ranks_outcomes
from test_pipeline import write_pipeline_plan
from test_pipeline_drop_last import PIPELINES, TYPES, _engine


def _run(files):
    engine, _ = _engine(files)
    engine.train_batch()
    return {
        "glob": t.refusal(lambda: engine.save_checkpoint(files["checkpoints"], tag="run[1]")),
        "missing": t.refusal(lambda: engine.load_checkpoint(files["checkpoints"], tag="step9")),
    }


def test_a_tag_deepspeed_could_not_load_is_refused_at_save(tmp_path):
    files = {
        "cluster": t.write_cluster(tmp_path / "cluster.json", fast=3, slow=0),
        "plan": write_pipeline_plan(tmp_path / "plan.json", PIPELINES, stage=0, types=TYPES),
        "checkpoints": tmp_path / "checkpoints",
    }
    results = run_ranks(_run, world_size=3, tmp_path=tmp_path, args=(files,), init_process_group=False, timeout_s=180)
    for result in results:
        assert result["glob"].startswith("save_checkpoint: expected a checkpoint folder without the characters * ? [")
        assert result["glob"].endswith("run[1]")
        assert "step9 holds no poplar_state.json" in result["missing"]
    assert not (files["checkpoints"] / "run[1]").exists()


def _parameters(engine):
    return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def _save_then_fail(files):
    engine, _ = _engine(files)
    engine.train_batch()
    engine.save_checkpoint(files["checkpoints"], tag="last")
    earlier = _parameters(engine)
    engine.train_batch()
    if os.environ["RANK"] == "1":  # pipeline 0's second stage fails at its files; the other ranks write theirs

        def lost(*args, **kwargs):
            raise OSError("disk full")

        engine._save_checkpoint = lost
    try:
        engine.save_checkpoint(files["checkpoints"], tag="last")
    except Exception as exc:  # noqa: BLE001 - rank 1's error; the others' lost peer, in DeepSpeed's barrier
        return earlier, str(exc)
    return earlier, None


def _resume(files):
    engine, _ = _engine(files)
    engine.load_checkpoint(files["checkpoints"])  # latest
    return _parameters(engine)


@pytest.fixture(scope="module")
def failed_save(tmp_path_factory):
    """Every rank's parameters at the first save, and what its second save raised; the options to run ranks."""
    tmp_path = tmp_path_factory.mktemp("failed_save")
    files = {
        "cluster": t.write_cluster(tmp_path / "cluster.json", fast=3, slow=0),
        "plan": write_pipeline_plan(tmp_path / "plan.json", PIPELINES, stage=0, types=TYPES),
        "checkpoints": tmp_path / "checkpoints",
    }
    options = {"world_size": 3, "tmp_path": tmp_path, "args": (files,), "init_process_group": False, "timeout_s": 180}
    return [outcome.value for outcome in run_ranks_outcomes(_save_then_fail, **options)], options


def test_a_save_that_fails_on_a_rank_leaves_the_earlier_checkpoint(failed_save):
    saved, options = failed_save
    assert saved[1][1] == "disk full"
    for (earlier, _), resumed in zip(saved, run_ranks(_resume, **options)):
        assert t.max_difference(resumed, earlier) == 0


def test_a_tag_left_between_the_renames_of_a_save_is_restored_and_loads(failed_save, tmp_path):
    # The storage rank stopped after renaming "last" to last.replaced, before last.saving became "last".
    saved, options = failed_save
    files = {**options["args"][0], "checkpoints": tmp_path / "checkpoints"}
    shutil.copytree(options["args"][0]["checkpoints"], files["checkpoints"])
    (files["checkpoints"] / "last").rename(files["checkpoints"] / "last.replaced")
    resumed = run_ranks(_resume, **{**options, "tmp_path": tmp_path, "args": (files,)})
    for (earlier, _), parameters in zip(saved, resumed):
        assert t.max_difference(parameters, earlier) == 0
    assert sorted(p.name for p in files["checkpoints"].iterdir()) == ["last", "last.saving", "latest"]
