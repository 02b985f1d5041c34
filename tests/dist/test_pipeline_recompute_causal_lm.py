"""Checkpointed first stages of a tied GPT-2 train exactly as the model in one process (issue 34).

4 forked ranks as `test_pipeline_causal_lm`'s ``two_by_two`` at ZeRO 0, both pipelines' first
stages (rank 0: the tied embedding and the positions; rank 2: those and both blocks) marked
``activation_checkpointing``: their input is token ids, with which DeepSpeed's reentrant
checkpoint fails in backward (no input requires a gradient); the parameters after 3 steps equal
one process's.
"""

from __future__ import annotations

import json

import pytest
from harness import run_ranks

pytest.importorskip("transformers", reason="a Hugging Face model: pip install 'poplar-ext[hf]'")

import _training as t  # noqa: E402
from test_pipeline import write_pipeline_plan  # noqa: E402
from test_pipeline_causal_lm import PLANS, TYPES, _engine, _parameters, _reference  # noqa: E402

CASE = ("gpt2", "two_by_two", 0)
CHECKPOINTED_RANKS = (0, 2)


def _train(files):
    engine, model = _engine(files, *CASE)
    losses = [float(engine.train_batch()) for _ in range(3)]
    return {
        "params": _parameters(engine, model),
        "losses": losses,
        "interval": engine.module.activation_checkpoint_interval,
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline_recompute_causal_lm")
    plan = write_pipeline_plan(tmp / "plan.json", PLANS["two_by_two"], stage=0, types=TYPES)
    data = json.loads(plan.read_text())
    for pipeline in data["pipelines"]:
        pipeline["stages"][0]["activation_checkpointing"] = True
    plan.write_text(json.dumps(data))
    files = {"cluster": t.write_cluster(tmp / "cluster.json", fast=2, slow=2), ("two_by_two", 0): plan}
    return run_ranks(_train, world_size=4, tmp_path=tmp, args=(files,), init_process_group=False, timeout_s=300)


def test_checkpointed_stages_reading_token_ids_train_as_the_model_in_one_process(results):
    expected, losses, _ = _reference("gpt2", sum(b * s for _, b, s in PLANS["two_by_two"]))
    assert {name for r in results for name in r["params"]} == set(expected)
    difference = max(float((v - expected[name]).abs().max()) for r in results for name, v in r["params"].items())
    assert difference <= 1e-5
    assert [r["interval"] for r in results] == [2, 0, 4, 0]  # each checkpointed stage's layers: one block
    for r in results:
        assert r["losses"] == pytest.approx(losses, abs=1e-5)
