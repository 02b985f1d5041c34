"""Saves into one tag on another number of ranks: a resume loads the last save, never an earlier one's files.

3 ranks save into tag ``last``; 2 ranks resume it (which writes ``last_universal``), train and save into
``last`` again; 3 ranks resume ``last``. They must get the 2 ranks' parameters: neither the resharded
copy of the first save nor the first save's third optimizer shard (left beside the second save's two)
may be taken for the second save. ZeRO stages 1 and 3, forked groups of 3, 2 and 3 ranks.
"""

from __future__ import annotations

import os

import _training as t
import pytest
import torch
from harness import run_ranks

STAGES = (1, 3)
ALLOCATIONS = {
    3: {1: [(2, 2), (2, 2), (4, 1)], 3: [(2, 2), (1, 2), (3, 2)]},
    2: {1: [(3, 2), (6, 1)], 3: [(4, 2), (2, 2)]},
}


def _engine(files, stage):
    import poplar_ext

    cluster, plan = files[int(os.environ["WORLD_SIZE"]), stage]
    model = t.GPT(t.TINY)
    config = t.ds_config(cluster=cluster, plan=plan, stage=stage)
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
