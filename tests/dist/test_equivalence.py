"""Uneven per-rank batches give exactly the single-process global-batch parameters.

3 ranks (one real CPU type, two emulated slower ones), ZeRO stages 0-3, fp32,
gradient clipping on, SGD with momentum and Adam, 3 optimizer steps, against one
process training on the concatenated global batch. One forked group runs all eight
configurations in sequence.
"""

from __future__ import annotations

import os

import _training as t
import pytest
from harness import run_ranks

STEPS = 3
UNEVEN_COUNTS = [(3, 2), (1, 3), (2, 1)]  # stages 0/1: per-rank accumulation counts (B = 11)
SAME_COUNTS = [(3, 2), (1, 2), (2, 2)]  # stages 2/3: one count, uneven micro-batches (B = 12)
CONFIGS = [(stage, opt) for stage in (0, 1, 2, 3) for opt in ("sgd", "adam")]


def _allocation(stage):
    return UNEVEN_COUNTS if stage < 2 else SAME_COUNTS


def _train_all(files):
    import poplar_ext

    results = {}
    for stage, opt in CONFIGS:
        model = t.GPT(t.TINY)
        engine, _, loader, _ = poplar_ext.initialize(
            model=model,
            optimizer=t.make_optimizer(opt, model.parameters()),
            training_data=t.dataset(),
            config=t.ds_config(cluster=files["cluster"], plan=files[stage], stage=stage),
        )
        t.train_steps(engine, loader, STEPS)
        params = t.full_parameters(engine)
        if int(os.environ["RANK"]) == 0:
            results[(stage, opt)] = params
    return results


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("equivalence")
    types = ["cpu", "cpu-slow", "cpu-slow"]
    files = {"cluster": t.write_cluster(tmp / "cluster.json")}
    for stage in (0, 1, 2, 3):
        files[stage] = t.write_plan(tmp / f"plan{stage}.json", _allocation(stage), stage=stage, device_types=types)
    return run_ranks(_train_all, world_size=3, tmp_path=tmp, args=(files,), timeout_s=240)[0]


@pytest.mark.parametrize("stage,opt", CONFIGS)
def test_matches_single_process_on_the_global_batch(distributed_results, stage, opt):
    global_batch = sum(b * s for b, s in _allocation(stage))
    expected, norms = t.reference_parameters(opt, global_batch, STEPS)
    assert max(norms) > t.CLIP, "clipping must be active for this test to cover it"
    assert t.max_difference(distributed_results[(stage, opt)], expected) <= 1e-6


# -- the user calls backward on the loss instead of engine.backward ---------------------
DIRECT = [(stage, how) for stage in (1, 2, 3) for how in ("loss.backward", "engine.scale")]


def _train_direct(engine, loader, how):
    done = 0
    while True:
        for tokens in loader:
            loss = engine(tokens.to(engine.device))
            (loss if how == "loss.backward" else engine.scale(loss)).backward()
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            done += boundary
            if done == STEPS:
                return


def _train_direct_all(files):
    import poplar_ext

    results = {}
    for stage, how in DIRECT:
        model = t.GPT(t.TINY)
        engine, _, loader, _ = poplar_ext.initialize(
            model=model,
            optimizer=t.make_optimizer("sgd", model.parameters()),
            training_data=t.dataset(),
            config=t.ds_config(cluster=files["cluster"], plan=files[stage], stage=stage),
        )
        _train_direct(engine, loader, how)
        params = t.full_parameters(engine)
        if int(os.environ["RANK"]) == 0:
            results[(stage, how)] = params
    # Stage 0: DeepSpeed refuses a backward it cannot see, on every rank, before any step.
    model = t.GPT(t.TINY)
    engine, _, loader, _ = poplar_ext.initialize(
        model=model,
        optimizer=t.make_optimizer("sgd", model.parameters()),
        training_data=t.dataset(),
        config=t.ds_config(cluster=files["cluster"], plan=files[0], stage=0),
    )
    try:
        engine(next(iter(loader)).to(engine.device)).backward()
        results["stage0"] = "accepted"
    except RuntimeError as exc:
        results["stage0"] = str(exc)
    return results


@pytest.fixture(scope="module")
def direct_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("direct")
    types = ["cpu", "cpu-slow", "cpu-slow"]
    files = {"cluster": t.write_cluster(tmp / "cluster.json")}
    for stage in (0, 1, 2, 3):
        files[stage] = t.write_plan(tmp / f"plan{stage}.json", _allocation(stage), stage=stage, device_types=types)
    return run_ranks(_train_direct_all, world_size=3, tmp_path=tmp, args=(files,), timeout_s=240)


@pytest.mark.parametrize("stage,how", DIRECT)
def test_backward_on_the_loss_is_exact_too(direct_results, stage, how):
    global_batch = sum(b * s for b, s in _allocation(stage))
    expected, _ = t.reference_parameters("sgd", global_batch, STEPS)
    assert t.max_difference(direct_results[0][(stage, how)], expected) <= 1e-6


def test_backward_on_the_loss_at_stage_0_is_refused_on_every_rank(direct_results):
    for rank in direct_results:
        assert "use engine.backward(loss)" in rank["stage0"], rank["stage0"]
