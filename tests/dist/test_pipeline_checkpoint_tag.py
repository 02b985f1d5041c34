"""A pipeline checkpoint DeepSpeed could not load is refused at its save; a missing tag names its folder.

DeepSpeed finds a checkpoint's files by a glob pattern of its path: a tag like ``run[1]`` would be saved
and never loaded. 3 forked CPU ranks, a 2-stage pipeline beside a 1-stage one.
"""

from __future__ import annotations

import _training as t
from harness import run_ranks
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
