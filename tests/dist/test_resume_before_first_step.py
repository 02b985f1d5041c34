"""A checkpoint saved before the first optimizer step, resumed on another number of ranks.

The optimizer holds no state yet: resharding carries the weights alone, and the resumed job trains as one
process would from the start. 2 ranks save at step 0, 3 ranks resume and train 3 steps, ZeRO stages 1
and 3; two forked groups.
"""

from __future__ import annotations

import os

import _training as t
import pytest
import torch
from harness import run_ranks

STAGES = (1, 3)
STEPS = 3
GLOBAL_BATCH = 12
ALLOCATIONS = {
    2: {1: [(3, 2), (6, 1)], 3: [(4, 2), (2, 2)]},
    3: {1: [(2, 2), (2, 2), (4, 1)], 3: [(2, 2), (1, 2), (3, 2)]},
}


def _run(files, *, save):
    import poplar_ext

    out = {}
    for stage in STAGES:
        cluster, plan = files[int(os.environ["WORLD_SIZE"]), stage]
        model = t.GPT(t.TINY)
        config = t.ds_config(cluster=cluster, plan=plan, stage=stage)
        engine, *_ = poplar_ext.initialize(
            model=model, optimizer=t.make_optimizer("adam", model.parameters()), config=config
        )
        if save:
            engine.save_checkpoint(files["root"] / f"stage{stage}")
            continue
        engine.load_checkpoint(files["root"] / f"stage{stage}")
        data = t.dataset()
        t.train_steps(
            engine, torch.utils.data.DataLoader(data, batch_sampler=engine.create_batch_sampler(len(data))), STEPS
        )
        out[stage] = t.full_parameters(engine)
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("before_first_step")
    files = {"root": root / "checkpoints", **t.write_world_files(root, ALLOCATIONS)}
    run_ranks(_run, world_size=2, tmp_path=root, args=(files,), kwargs={"save": True}, timeout_s=200)
    return run_ranks(_run, world_size=3, tmp_path=root, args=(files,), kwargs={"save": False}, timeout_s=200)


@pytest.mark.parametrize("stage", STAGES)
def test_the_resumed_job_trains_as_one_process_from_the_start(resumed, stage):
    expected, _ = t.reference_parameters("adam", GLOBAL_BATCH, STEPS)
    for rank in resumed:
        assert t.max_difference(rank[stage], expected) <= 1e-5
