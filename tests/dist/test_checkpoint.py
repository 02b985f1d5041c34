"""Checkpoint and resume through DeepSpeed: same samples, same parameters; another plan continues the stream.

One forked group of 3 ranks, ZeRO stages 1 (per-rank accumulation counts) and 3.
The loader is built by the user from `engine.create_batch_sampler`, so this also
covers the own-DataLoader path.
"""

from __future__ import annotations

import _training as t
import pytest
import torch
from harness import run_ranks

TOTAL_STEPS = 5
SAVE_AFTER = 2
ALLOCATIONS = {1: [(3, 2), (1, 3), (2, 1)], 3: [(2, 2), (1, 2), (3, 2)]}
OTHER_ALLOCATION = [(1, 2), (3, 3), (2, 1)]  # same stage (1), other batches
TYPES = ["cpu", "cpu-slow", "cpu-slow"]


def _engine(files, stage, plan_key=None):
    import poplar_ext

    model = t.GPT(t.TINY)
    engine, *_ = poplar_ext.initialize(
        model=model,
        optimizer=t.make_optimizer("adam", model.parameters()),
        config=t.ds_config(cluster=files["cluster"], plan=files[plan_key or stage], stage=stage),
    )
    seen = []
    data = t.dataset()
    loader = torch.utils.data.DataLoader(
        data, batch_sampler=t.RecordingSampler(engine.create_batch_sampler(len(data)), seen)
    )
    return engine, loader, seen


def _run(files):
    out = {}
    for stage in (1, 3):
        engine, loader, straight_seen = _engine(files, stage)
        t.train_steps(engine, loader, TOTAL_STEPS)
        straight = t.full_parameters(engine)

        engine, loader, first_seen = _engine(files, stage)
        t.train_steps(engine, loader, SAVE_AFTER)
        engine.save_checkpoint(files["checkpoints"] / f"stage{stage}", tag="step2")
        before_consumed = engine.consumed_samples

        engine, loader, resumed_seen = _engine(files, stage)  # a fresh model: the weights come from the checkpoint
        path, _ = engine.load_checkpoint(files["checkpoints"] / f"stage{stage}", tag="step2")
        assert path is not None
        resumed_consumed = engine.consumed_samples
        t.train_steps(engine, loader, TOTAL_STEPS - SAVE_AFTER)
        out[stage] = {
            "max_difference": t.max_difference(straight, t.full_parameters(engine)),
            "same_samples": first_seen + resumed_seen == straight_seen,
            "consumed": (before_consumed, resumed_consumed, engine.consumed_samples),
            "deepspeed_global_samples": engine.global_samples,
        }
    engine, _, _ = _engine(files, 1, plan_key="other")
    engine.load_checkpoint(files["checkpoints"] / "stage1", tag="step2")
    out["other_plan"] = {"position": engine.data_position, "history": [h["reason"] for h in engine.plan_history]}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("checkpoint")
    files = {"cluster": t.write_cluster(tmp / "cluster.json"), "checkpoints": tmp / "checkpoints"}
    for stage, allocation in ALLOCATIONS.items():
        files[stage] = t.write_plan(tmp / f"plan{stage}.json", allocation, stage=stage, device_types=TYPES)
    files["other"] = t.write_plan(tmp / "other.json", OTHER_ALLOCATION, stage=1, device_types=TYPES)
    return run_ranks(_run, world_size=3, tmp_path=tmp, args=(files,), timeout_s=240)


@pytest.mark.parametrize("stage", [1, 3])
def test_resume_reaches_the_uninterrupted_parameters(results, stage):
    for rank_result in results:
        assert rank_result[stage]["max_difference"] <= 1e-6


@pytest.mark.parametrize("stage", [1, 3])
def test_resume_continues_with_the_same_samples(results, stage):
    global_batch = sum(b * s for b, s in ALLOCATIONS[stage])
    for rank_result in results:
        assert rank_result[stage]["same_samples"]
        assert rank_result[stage]["consumed"] == (
            SAVE_AFTER * global_batch,
            SAVE_AFTER * global_batch,
            TOTAL_STEPS * global_batch,
        )
        assert rank_result[stage]["deepspeed_global_samples"] == TOTAL_STEPS * global_batch  # true, not nominal


def test_another_plan_continues_the_stream_on_every_rank(results):
    saved_at = SAVE_AFTER * sum(b * s for b, s in ALLOCATIONS[1])
    for rank_result in results:
        assert rank_result["other_plan"]["position"] == saved_at
        assert "under another plan (global batch 11 then, 13 now)" in rank_result["other_plan"]["history"][-1]
