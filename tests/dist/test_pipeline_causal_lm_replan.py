"""A tied causal LM's pipeline checkpoint resumed under another pipeline plan (issue 34).

4 forked ranks: a tiny GPT-2 (its head tied to its embedding) from `causal_lm_layers`, token
mean, clipping on, SGD with momentum at ZeRO 0. 2 steps under 2 pipelines of 2 stages, saved;
a new model under 1 pipeline of 4 stages (the embedding on the first, the head alone on the
last, holding the tied module through its forward_fn only) loads it and trains the third:
every parameter equals one process training the model on the same 3 global batches.
"""

from __future__ import annotations

import pytest
from harness import run_ranks

pytest.importorskip("transformers", reason="a Hugging Face model: pip install 'poplar-ext[hf]'")

import _training as t  # noqa: E402
from test_pipeline import write_pipeline_plan  # noqa: E402
from test_pipeline_causal_lm import PLANS, TYPES, _engine, _parameters, _reference  # noqa: E402

SAVED, RESUMED = "two_by_two", "one_by_four"
ONE_BY_FOUR = [([(0, 0, 0), (1, 1, 2), (2, 3, 4), (3, 5, 5)], 2, 7)]  # B = 14, as two_by_two's


def _resume_under_another_plan(files):
    engine, _ = _engine(files, "gpt2", SAVED, 0)
    for _ in range(2):
        engine.train_batch()
    engine.save_checkpoint(files["checkpoints"])
    engine, model = _engine(files, "gpt2", RESUMED, 0)
    engine.load_checkpoint(files["checkpoints"])
    engine.train_batch()
    return _parameters(engine, model)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline_causal_lm_replan")
    files = {"cluster": t.write_cluster(tmp / "cluster.json", fast=2, slow=2), "checkpoints": tmp / "checkpoints"}
    for plan, pipelines in ((SAVED, PLANS[SAVED]), (RESUMED, ONE_BY_FOUR)):
        files[(plan, 0)] = write_pipeline_plan(tmp / f"{plan}.json", pipelines, stage=0, types=TYPES)
    return run_ranks(
        _resume_under_another_plan, world_size=4, tmp_path=tmp, args=(files,), init_process_group=False, timeout_s=240
    )


def test_a_tied_model_resumed_under_another_split_trains_as_one_process(results):
    expected, _, _ = _reference("gpt2", 14)  # 3 steps of the global batch both plans share
    held = {name for params in results for name in params}
    assert held == set(expected), sorted(held ^ set(expected))
    difference = max(
        float((value - expected[name]).abs().max()) for params in results for name, value in params.items()
    )
    assert difference <= 1e-5
