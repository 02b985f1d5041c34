"""A plain DeepSpeed checkpoint (no poplar_state.json) loaded by poplar-ext on another number of ranks.

Plain DeepSpeed saves a ZeRO checkpoint on 2 ranks after 3 optimizer steps (Adam), at stages 1 and 3; poplar-ext
loads it on 3 ranks under a plan. Its optimizer state is resharded as a poplar-ext checkpoint's is (the number of
ranks that saved it told by its ZeRO files), where DeepSpeed alone refuses another world size
(ZeRORuntimeException); the data starts at position 0, as for a plain checkpoint on as many ranks. Two forked
groups (2 ranks, then 3).
"""

from __future__ import annotations

import os

import _training as t
import pytest
import torch
from harness import run_ranks

STAGES = (1, 3)
STEPS = 3


def _plain_deepspeed(root):
    import deepspeed

    rank, saved = int(os.environ["RANK"]), {}
    data = t.dataset()
    for stage in STAGES:
        model = t.GPT(t.TINY)
        config = {
            "train_batch_size": 4,
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10_000,
        }
        optimizer = t.make_optimizer("adam", model.parameters())
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        for step in range(STEPS):
            batch = torch.stack([data[4 * step + 2 * rank + i] for i in range(2)])
            engine.backward(engine(batch))
            engine.step()
        engine.save_checkpoint(root / f"stage{stage}")
        saved[stage] = t.full_parameters(engine)
    return saved


def _poplar_load(root):
    import poplar_ext

    loaded = {}
    for stage in STAGES:
        model = t.GPT(t.TINY)
        config = t.ds_config(cluster=root / "cluster3.json", plan=root / f"plan3-{stage}.json", stage=stage)
        optimizer = t.make_optimizer("adam", model.parameters())
        engine, *_ = poplar_ext.initialize(model=model, optimizer=optimizer, config=config)
        engine.load_checkpoint(root / f"stage{stage}")
        base = engine.deepspeed_engine.optimizer.optimizer
        loaded[stage] = {
            "params": t.full_parameters(engine),
            "steps": sorted({float(s["step"]) for s in base.state.values()}),
            "data_position": engine.data_position,
        }
    return loaded


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain_deepspeed")
    t.write_cluster(root / "cluster3.json", slow=2, slowdown=1.0)
    for stage in STAGES:
        t.write_plan(
            root / f"plan3-{stage}.json", [(2, 1), (1, 1), (1, 1)], stage=stage, device_types=["cpu"] + ["cpu-slow"] * 2
        )
    options = {"tmp_path": root, "timeout_s": 300}
    saved = run_ranks(_plain_deepspeed, world_size=2, args=(root,), **options)[0]
    return saved, run_ranks(_poplar_load, world_size=3, args=(root,), **options)


@pytest.mark.parametrize("stage", STAGES)
def test_a_plain_deepspeed_checkpoint_loads_resharded_on_more_ranks(runs, stage):
    saved, loaded = runs
    for rank in loaded:
        assert t.max_difference(rank[stage]["params"], saved[stage]) == 0.0
        assert rank[stage]["steps"] == [float(STEPS)]  # Adam's state came with it
        assert rank[stage]["data_position"] == 0
