"""A stage the plan checkpoints recomputes its forward and trains exactly as without (issue 34).

4 forked ranks as `test_pipeline`'s ``two_by_two`` plan (two pipelines of 2 stages, different
splits and counts), once as written and once with pipeline 1's first stage (rank 2, layers
0-3, 2 micro-batches in flight) marked ``activation_checkpointing``: the parameters after 3
steps equal one process's, and the plain run's; rank 2 runs every layer's forward twice per
micro-batch, the other ranks once. A user's ``activation_checkpoint_interval`` beside that
plan is refused alike on every rank.
"""

from __future__ import annotations

import json

import _training as t
import pytest
import torch
from harness import run_ranks
from test_pipeline import (
    NUM_SAMPLES,
    PLANS,
    STEPS,
    TYPES,
    RecordingData,
    _config,
    _max_difference,
    _reference,
    write_pipeline_plan,
)

from poplar_ext.models.toy_pipeline import mse

CHECKPOINTED_RANK = 2
LAYERS_OF_RANK = {0: 2, 1: 4, 2: 4, 3: 2}
"""How many layers each rank's stage holds in ``two_by_two``."""
MICRO_BATCHES_OF_RANK = {0: 4, 1: 4, 2: 2, 3: 2}


def _write_checkpointed_plan(path, *, stage):
    write_pipeline_plan(path, PLANS["two_by_two"], stage=stage)
    plan = json.loads(path.read_text())
    plan["pipelines"][1]["stages"][0]["activation_checkpointing"] = True
    path.write_text(json.dumps(plan))
    return path


def _train(files, plan_key, *, stage=0):
    import poplar_ext
    from poplar_ext.models.toy_pipeline import toy_layers
    from poplar_ext.pipeline import PoplarPipelineModule

    config = _config(files, plan_key, stage=stage)
    model = PoplarPipelineModule(toy_layers(), loss_fn=mse, seed_layers=True, config=config)
    forwards = [0]
    for layer in model.forward_funcs:
        if isinstance(layer, torch.nn.Module):
            layer.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = RecordingData(num_samples=NUM_SAMPLES)
    engine, _, _, _ = poplar_ext.initialize(model=model, optimizer=optimizer, training_data=data, config=config)
    losses = [float(engine.train_batch()) for _ in range(STEPS)]
    return {
        "params": {name: p.detach().clone() for name, p in engine.module.state_dict().items()},
        "losses": losses,
        "forwards": forwards[0],
        "interval": engine.module.activation_checkpoint_interval,
    }


def _refused(files, **arguments):
    from poplar_ext.models.toy_pipeline import toy_layers
    from poplar_ext.pipeline import PoplarPipelineModule

    config = _config(files, "checkpointed", stage=0, **arguments.pop("extra", {}))
    try:
        PoplarPipelineModule(toy_layers(), loss_fn=mse, config=config, **arguments)
        return "accepted"
    except ValueError as exc:
        return str(exc)


def _all_cases(files):
    return {
        "refused_argument": _refused(files, activation_checkpoint_interval=1),
        "refused_config": _refused(files, extra={"pipeline": {"activation_checkpoint_interval": 2}}),
        "plain": _train(files, "plain"),
        "checkpointed": _train(files, "checkpointed"),
        "checkpointed_zero1": _train(files, "checkpointed_1", stage=1),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline_recompute")
    files = {
        "cluster": t.write_cluster(tmp / "cluster.json", fast=2, slow=2),
        "plain": write_pipeline_plan(tmp / "plain.json", PLANS["two_by_two"], stage=0),
        "checkpointed": _write_checkpointed_plan(tmp / "checkpointed.json", stage=0),
        "checkpointed_1": _write_checkpointed_plan(tmp / "checkpointed1.json", stage=1),
    }
    return run_ranks(_all_cases, world_size=len(TYPES), tmp_path=tmp, args=(files,), init_process_group=False)


@pytest.mark.parametrize("case", ["checkpointed", "checkpointed_zero1"])
def test_a_checkpointed_stage_trains_as_one_process_and_as_without(results, case):
    global_batch = sum(b * s for _, b, s in PLANS["two_by_two"])
    expected, losses, _ = _reference(global_batch, STEPS)
    runs = [r[case] for r in results]
    assert _max_difference([run["params"] for run in runs], expected) <= 1e-5
    for run, plain in zip(runs, (r["plain"] for r in results)):
        assert run["losses"] == pytest.approx(losses, abs=1e-6)
        assert max(float((run["params"][k] - v).abs().max()) for k, v in plain["params"].items()) <= 1e-6


def test_only_the_checkpointed_rank_runs_its_forward_again(results):
    for rank, result in enumerate(results):
        once = STEPS * MICRO_BATCHES_OF_RANK[rank] * LAYERS_OF_RANK[rank]
        assert result["plain"]["forwards"] == once and result["plain"]["interval"] == 0
        if rank == CHECKPOINTED_RANK:
            # One block of the stage's 4 layers, recomputed in each backward.
            assert result["checkpointed"]["interval"] == LAYERS_OF_RANK[rank]
            assert result["checkpointed"]["forwards"] == 2 * once
        else:
            assert result["checkpointed"]["interval"] == 0 and result["checkpointed"]["forwards"] == once


@pytest.mark.parametrize(
    "case,name",
    [
        ("refused_argument", "PoplarPipelineModule: activation_checkpoint_interval: expected 0"),
        ("refused_config", "pipeline.activation_checkpoint_interval: expected 0"),
    ],
)
def test_a_users_interval_beside_a_checkpointing_plan_is_refused_on_every_rank(results, case, name):
    messages = {r[case] for r in results}
    assert len(messages) == 1, f"ranks disagree: {messages}"
    message = messages.pop()
    assert name in message and "pipelines[1].stages[0]" in message and "found " in message
