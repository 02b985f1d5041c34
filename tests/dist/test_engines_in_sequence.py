"""A ZeRO engine and a pipeline engine in the same process, in either order, each train over their own groups.

DeepSpeed keeps the pipeline engine's grid in ``deepspeed.utils.groups.mpu``, where an engine
given no mpu reads its groups, at its build and (ZeRO 0's gradient all-reduce) at every step.
Built after a pipeline, before the fix a 2-stage pipeline's grid made the ZeRO engine's build
fail (model-parallel size 2, no mpu), and two 1-stage pipelines made each rank its own
data-parallel group (no gradient all-reduce: ranks trained apart). Built before a 2-stage
pipeline, a ZeRO 0 engine's next step reduced over the pipeline's data-parallel groups, each
rank alone. 2 forked ranks, one case each.
"""

from __future__ import annotations

import _training as t
import pytest
import torch
from harness import run_ranks
from test_pipeline import write_pipeline_plan

from poplar_ext.models.toy_gpt import GPT, SyntheticTokens
from poplar_ext.models.toy_pipeline import RegressionData, mse, toy_layers

LAYOUTS = {
    "two_stages": [([(0, 0, 2), (1, 3, 5)], 2, 2)],
    "two_pipelines": [([(0, 0, 5)], 2, 2), ([(1, 0, 5)], 2, 2)],
}


def _pipeline_step(files) -> float:
    import poplar_ext
    from poplar_ext.pipeline import PoplarPipelineModule

    poplar = {"cluster": str(files["cluster"]), "log_interval_steps": 0, "plan": str(files["pipeline"])}
    config = {"zero_optimization": {"stage": 0}, "poplar": poplar}
    model = PoplarPipelineModule(toy_layers(), loss_fn=mse, config=config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pipeline, *_ = poplar_ext.initialize(
        model=model, optimizer=optimizer, training_data=RegressionData(num_samples=20), config=config
    )
    return float(pipeline.train_batch())


def _zero_engine(files, stage: int):
    import poplar_ext

    model = GPT(t.TINY)
    config = {
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "poplar": {"cluster": str(files["cluster"]), "log_interval_steps": 0, "plan": str(files[f"zero{stage}"])},
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = SyntheticTokens(num_samples=20, sequence_length=8, vocab_size=32)
    engine, _, loader, _ = poplar_ext.initialize(model=model, optimizer=optimizer, training_data=data, config=config)
    return engine, loader


def _zero_step(engine, loader) -> dict:
    tokens = next(iter(loader))  # each rank its own micro-batch: equal parameters after the step need the reduction
    engine.backward(engine(tokens))
    engine.step()
    return {"dp_world_size": engine.dp_world_size, "parameters": [p.detach().clone() for p in engine.parameters()]}


def _pipeline_then_zero(files):
    _pipeline_step(files)
    return _zero_step(*_zero_engine(files, stage=1))


def _zero_then_pipeline_then_zero_step(files):
    engine, loader = _zero_engine(files, stage=0)
    pipeline_loss = _pipeline_step(files)
    return {**_zero_step(engine, loader), "pipeline_loss": pipeline_loss}


def _files(tmp_path, layout):
    return {
        "cluster": t.write_cluster(tmp_path / "cluster.json", fast=2, slow=0),
        "pipeline": write_pipeline_plan(tmp_path / "pipeline.json", LAYOUTS[layout], stage=0, types=["cpu", "cpu"]),
        **{
            f"zero{stage}": t.write_plan(
                tmp_path / f"zero{stage}.json", [(2, 1), (2, 1)], stage=stage, device_types=["cpu", "cpu"]
            )
            for stage in (0, 1)
        },
    }


def _assert_trained_together(first, second):
    assert first["dp_world_size"] == second["dp_world_size"] == 2
    for mine, theirs in zip(first["parameters"], second["parameters"]):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_zero_engine_after_a_pipeline_engine_trains_over_every_rank(tmp_path, layout):
    files = _files(tmp_path, layout)
    _assert_trained_together(
        *run_ranks(_pipeline_then_zero, world_size=2, tmp_path=tmp_path, args=(files,), timeout_s=180)
    )


def test_a_zero_engine_built_before_a_pipeline_engine_still_reduces_over_every_rank(tmp_path):
    # Two stages: the pipeline grid's data-parallel groups are each rank alone.
    files = _files(tmp_path, "two_stages")
    first, second = run_ranks(
        _zero_then_pipeline_then_zero_step, world_size=2, tmp_path=tmp_path, args=(files,), timeout_s=180
    )
    assert first["pipeline_loss"] == second["pipeline_loss"] > 0.0  # the pipeline trained too
    _assert_trained_together(first, second)
