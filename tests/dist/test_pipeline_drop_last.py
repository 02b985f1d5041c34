"""A pipeline job with ``poplar.drop_last`` resumes where its data stood, across a dropped epoch tail.

3 forked CPU ranks: a 2-stage pipeline beside a 1-stage one, global batch 7 on 16 samples, so each
epoch holds 2 iterations and drops its last 2 samples. After 3 steps the next iteration starts at
stream position 23 (epoch 1's second), not 3 x 7 = 21; a checkpoint saved there resumes with the
iteration the uninterrupted run trains next.
"""

from __future__ import annotations

import _training as t
import torch
from harness import run_ranks
from test_pipeline import RecordingData, write_pipeline_plan

from poplar_ext.models.toy_pipeline import mse

NUM_SAMPLES = 16
PIPELINES = [([(0, 0, 2), (1, 3, 5)], 2, 2), ([(2, 0, 5)], 3, 1)]  # B = 7
TYPES = ["cpu", "cpu", "cpu"]


def _engine(files):
    import poplar_ext
    from poplar_ext.models.toy_pipeline import toy_layers
    from poplar_ext.pipeline import PoplarPipelineModule

    config = {
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**6,
        "poplar": {
            "cluster": str(files["cluster"]),
            "plan": str(files["plan"]),
            "drop_last": True,
            "log_interval_steps": 0,
        },
    }
    model = PoplarPipelineModule(toy_layers(), loss_fn=mse, seed_layers=True, config=config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = RecordingData(num_samples=NUM_SAMPLES)
    engine, _, _, _ = poplar_ext.initialize(model=model, optimizer=optimizer, training_data=data, config=config)
    return engine, data


def _save_and_resume(files):
    engine, data = _engine(files)
    for _ in range(3):
        engine.train_batch()
    out = {"position_after_3": engine.data_position}
    engine.save_checkpoint(files["checkpoints"])
    before = len(data.seen)
    engine.train_batch()
    out["uninterrupted"] = data.seen[before:]
    engine, data = _engine(files)
    engine.load_checkpoint(files["checkpoints"])
    out["position_resumed"] = engine.data_position
    engine.train_batch()
    out["resumed"] = data.seen
    return out


def test_a_drop_last_pipeline_job_resumes_with_the_next_iteration(tmp_path):
    files = {
        "cluster": t.write_cluster(tmp_path / "cluster.json", fast=3, slow=0),
        "plan": write_pipeline_plan(tmp_path / "plan.json", PIPELINES, stage=0, types=TYPES),
        "checkpoints": tmp_path / "checkpoints",
    }
    results = run_ranks(
        _save_and_resume, world_size=3, tmp_path=tmp_path, args=(files,), init_process_group=False, timeout_s=180
    )
    for rank, result in enumerate(results):
        # Iterations start at 0, 7 | 16, 23 | 32: after 3 steps the stream stands at 23.
        assert result["position_after_3"] == 23, rank
        assert result["position_resumed"] == 23, rank
        assert result["resumed"] == result["uninterrupted"], rank
    assert results[0]["uninterrupted"] and results[2]["uninterrupted"]  # the first stages read data
