"""A checkpoint DeepSpeed cannot find is refused with its folder named, on every rank, before anything loads.

``latest`` naming a tag never written, a mistyped tag, and a tag with a glob character (DeepSpeed finds a
checkpoint's files by a glob pattern of its path: such a save could never be loaded, so it is refused).
One forked group of 2 ranks at ZeRO stage 1.
"""

from __future__ import annotations

import _training as t
import pytest
from harness import run_ranks

ALLOCATIONS = {2: {1: [(3, 2), (6, 1)]}}


def _run(files):
    import torch.distributed as dist

    import poplar_ext

    cluster, plan = files[2, 1]
    model = t.GPT(t.TINY)
    config = t.ds_config(cluster=cluster, plan=plan, stage=1)
    engine, *_ = poplar_ext.initialize(
        model=model, optimizer=t.make_optimizer("adam", model.parameters()), config=config
    )
    root = files["root"]
    engine.save_checkpoint(root, tag="step0")
    if dist.get_rank() == 0:
        (root / "latest").write_text("step9")  # a save that never reached its files
    dist.barrier()
    return {
        "latest": t.refusal(lambda: engine.load_checkpoint(root)),
        "mistyped": t.refusal(lambda: engine.load_checkpoint(root, tag="step1")),
        "glob": t.refusal(lambda: engine.save_checkpoint(root, tag="run[1]")),
        "steps": engine.global_steps,
    }


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    root = tmp_path_factory.mktemp("missing_tag")
    files = {"root": root / "checkpoints", **t.write_world_files(root, ALLOCATIONS)}
    return run_ranks(_run, world_size=2, tmp_path=root, args=(files,), timeout_s=200)


def test_latest_naming_a_missing_tag_is_refused_naming_it(refusals):
    for rank in refusals:
        assert "latest names tag 'step9'" in rank["latest"] and "found no such folder" in rank["latest"]
        assert "model_states.pt in " in rank["latest"]


def test_a_mistyped_tag_is_refused_naming_its_folder(refusals):
    for rank in refusals:
        assert rank["mistyped"].startswith("load_checkpoint: tag 'step1': expected DeepSpeed's")
        assert rank["steps"] == 0


def test_a_tag_deepspeed_could_not_load_is_refused_at_save(refusals):
    for rank in refusals:
        assert rank["glob"].startswith("save_checkpoint: expected a checkpoint folder without the characters * ? [")
        assert rank["glob"].endswith("run[1]")
