"""DeepSpeed's node-local storage (``checkpoint.use_node_local_storage``) under real engines.

2 forked ranks stand for 2 nodes of one rank each (``LOCAL_RANK`` 0 on both), at ZeRO 1. Each node
saving into a folder of its own: every folder holds the whole tag (model states, its rank's optimizer
shard, ``poplar_state.json``) and a load restores the saved parameters. One folder that both share:
the save is refused on both ranks before any file is written (without the refusal both nodes' first
ranks rename the same folders and the save fails with a rename error).
"""

from __future__ import annotations

import os

import _training as t
import pytest
import torch
from harness import run_ranks

STAGE = 1
ALLOCATION = [(2, 2), (4, 1)]


def _engine(files):
    import poplar_ext

    os.environ["LOCAL_RANK"] = "0"  # one rank per node: DeepSpeed reads it when the engine is built
    cluster, plan = files[2, STAGE]
    config = t.ds_config(cluster=cluster, plan=plan, stage=STAGE) | {"checkpoint": {"use_node_local_storage": True}}
    model = t.GPT(t.TINY)
    engine, *_ = poplar_ext.initialize(
        model=model, optimizer=t.make_optimizer("adam", model.parameters()), config=config
    )
    return engine


def _save_load_then_share(files) -> dict:
    rank = int(os.environ["RANK"])
    engine = _engine(files)
    data = t.dataset()
    t.train_steps(engine, torch.utils.data.DataLoader(data, batch_sampler=engine.create_batch_sampler(len(data))), 2)
    own = files["root"] / f"node{rank}"
    engine.save_checkpoint(own, tag="t")
    saved = t.full_parameters(engine)
    files_in_tag = sorted(p.name for p in (own / "t").iterdir())
    resumed = _engine(files)
    resumed.load_checkpoint(own, tag="t")
    try:
        resumed.save_checkpoint(files["root"] / "shared", tag="t")
        refusal = None
    except ValueError as error:
        refusal = str(error)
    return {
        "loaded_equal": t.max_difference(t.full_parameters(resumed), saved) == 0.0,
        "files_in_tag": files_in_tag,
        "refusal": refusal,
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("node_local")
    files = {"root": root, **t.write_world_files(root, {2: {STAGE: ALLOCATION}})}
    return root, run_ranks(_save_load_then_share, world_size=2, tmp_path=root, args=(files,), timeout_s=300)


def test_each_node_saves_the_whole_tag_into_its_own_folder_and_loads_it(results):
    _, ranks = results
    for rank, result in enumerate(ranks):
        assert "poplar_state.json" in result["files_in_tag"] and "mp_rank_00_model_states.pt" in result["files_in_tag"]
        assert any(name.startswith(f"zero_pp_rank_{rank}_") for name in result["files_in_tag"]), result
        assert result["loaded_equal"]


def test_a_folder_both_nodes_share_is_refused_on_every_rank_before_any_file(results):
    root, ranks = results
    for result in ranks:
        assert result["refusal"] is not None
        assert result["refusal"].startswith(f"save_checkpoint: {root / 'shared'} is one storage for several nodes")
    assert list((root / "shared").iterdir()) == []
