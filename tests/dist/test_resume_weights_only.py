"""A resume on another number of ranks without the optimizer state (``load_optimizer_states=False``).

At ZeRO stages 1-2 the model's file holds every weight: nothing is resharded, so an optimizer whose state
could not be resharded (one value per parameter, here) does not stop a resume that does not load it.
3 ranks save at stage 1, 2 ranks load the weights; two forked groups.
"""

from __future__ import annotations

import os

import _training as t
import pytest
import torch
from harness import run_ranks

ALLOCATIONS = {3: {1: [(2, 2), (2, 2), (4, 1)]}, 2: {1: [(3, 2), (6, 1)]}}


def _run(files, *, save):
    import poplar_ext

    cluster, plan = files[int(os.environ["WORLD_SIZE"]), 1]
    model = t.GPT(t.TINY)
    config = t.ds_config(cluster=cluster, plan=plan, stage=1)
    engine, *_ = poplar_ext.initialize(model=model, optimizer=t.OddStateSGD(model.parameters(), lr=0.1), config=config)
    if save:
        data = t.dataset()
        t.train_steps(
            engine, torch.utils.data.DataLoader(data, batch_sampler=engine.create_batch_sampler(len(data))), 2
        )
        engine.save_checkpoint(files["root"], tag="c")
    else:
        engine.load_checkpoint(files["root"], tag="c", load_optimizer_states=False)
    return t.full_parameters(engine)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights_only")
    files = {"root": root / "checkpoints", **t.write_world_files(root, ALLOCATIONS)}
    saved = run_ranks(_run, world_size=3, tmp_path=root, args=(files,), kwargs={"save": True}, timeout_s=200)
    loaded = run_ranks(_run, world_size=2, tmp_path=root, args=(files,), kwargs={"save": False}, timeout_s=200)
    return saved, loaded, files["root"]


def test_the_weights_load_on_another_number_of_ranks_without_resharding(runs):
    saved, loaded, root = runs
    for rank in loaded:
        assert t.max_difference(rank, saved[0]) == 0.0
    assert not (root / "c_universal").exists()
