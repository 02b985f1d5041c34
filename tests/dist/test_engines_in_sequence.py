"""A ZeRO engine built after a pipeline engine in the same process trains over every rank.

DeepSpeed keeps the pipeline engine's grid in ``deepspeed.utils.groups.mpu``, where an engine
given no mpu reads its groups: before the fix a 2-stage pipeline's grid made the ZeRO engine's
build fail (model-parallel size 2, no mpu), and two 1-stage pipelines made each rank its own
data-parallel group (no gradient all-reduce: ranks trained apart). 2 forked ranks, one case each.
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


def _pipeline_then_zero(files):
    import poplar_ext
    from poplar_ext.pipeline import PoplarPipelineModule

    poplar = {"cluster": str(files["cluster"]), "log_interval_steps": 0}
    config = {"zero_optimization": {"stage": 0}, "poplar": {**poplar, "plan": str(files["pipeline"])}}
    model = PoplarPipelineModule(toy_layers(), loss_fn=mse, config=config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pipeline, *_ = poplar_ext.initialize(
        model=model, optimizer=optimizer, training_data=RegressionData(num_samples=20), config=config
    )
    pipeline.train_batch()

    model = GPT(t.TINY)
    config = {
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "poplar": {**poplar, "plan": str(files["zero"])},
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = SyntheticTokens(num_samples=20, sequence_length=8, vocab_size=32)
    engine, _, loader, _ = poplar_ext.initialize(model=model, optimizer=optimizer, training_data=data, config=config)
    tokens = next(iter(loader))  # each rank its own micro-batch: equal parameters after the step need the reduction
    engine.backward(engine(tokens))
    engine.step()
    return {"dp_world_size": engine.dp_world_size, "parameters": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_zero_engine_after_a_pipeline_engine_trains_over_every_rank(tmp_path, layout):
    files = {
        "cluster": t.write_cluster(tmp_path / "cluster.json", fast=2, slow=0),
        "pipeline": write_pipeline_plan(tmp_path / "pipeline.json", LAYOUTS[layout], stage=0, types=["cpu", "cpu"]),
        "zero": t.write_plan(tmp_path / "zero.json", [(2, 1), (2, 1)], stage=1, device_types=["cpu", "cpu"]),
    }
    first, second = run_ranks(_pipeline_then_zero, world_size=2, tmp_path=tmp_path, args=(files,), timeout_s=180)
    assert first["dp_world_size"] == second["dp_world_size"] == 2
    for mine, theirs in zip(first["parameters"], second["parameters"]):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
