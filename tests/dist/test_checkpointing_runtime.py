"""Each rank applies its plan's activation checkpointing (issue 16): exact gradients, refusal, toggles.

3 ranks (cpu, cpu-slow, cpu-slow); the slow type checkpoints and the fast one does not,
at ZeRO stages 0-2 (stage 3 allows all-or-none: every rank checkpoints there), against
one process training the global batch without checkpointing. One forked group runs
every case in sequence.
"""

from __future__ import annotations

import os

import _training as t
import pytest
import torch
from harness import run_ranks

STEPS = 3
UNEVEN_COUNTS = [(3, 2), (1, 3), (2, 1)]
SAME_COUNTS = [(3, 2), (1, 2), (2, 2)]
TYPES = ["cpu", "cpu-slow", "cpu-slow"]
MIXED = [False, True, True]
CASES = [(0, MIXED), (1, MIXED), (2, MIXED), (3, [True, True, True])]


def _allocation(stage):
    return UNEVEN_COUNTS if stage < 2 else SAME_COUNTS


class Wrapped(torch.nn.Module):
    """A model poplar-ext cannot switch by itself (not the GPT class, no Hugging Face method)."""

    def __init__(self):
        super().__init__()
        self.inner = t.GPT(t.TINY)

    def forward(self, tokens):
        return self.inner(tokens)


def toggle(model, enabled):
    model.inner.activation_checkpointing = enabled


def _count_block_forwards(model):
    calls = [0]
    # A pre-hook: a recompute stops early, once it has what backward needs, and skips forward hooks.
    model.blocks[0].register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _run_all(files):
    import poplar_ext

    rank = int(os.environ["RANK"])
    results = {}
    for stage, _checkpointing in CASES:
        model = t.GPT(t.TINY)
        calls = _count_block_forwards(model)
        engine, _, loader, _ = poplar_ext.initialize(
            model=model,
            optimizer=t.make_optimizer("sgd", model.parameters()),
            training_data=t.dataset(),
            config=t.ds_config(cluster=files["cluster"], plan=files[stage], stage=stage),
        )
        t.train_steps(engine, loader, STEPS)
        micro_steps = STEPS * engine.rank_plan.gradient_accumulation_steps
        results[("forwards per micro-step", stage)] = calls[0] / micro_steps
        results[("flag", stage)] = model.activation_checkpointing
        params = t.full_parameters(engine)
        if rank == 0:
            results[("params", stage)] = params
    # A model that cannot switch: refused on every rank; with a toggle of the user's it trains.
    model = Wrapped()
    try:
        poplar_ext.initialize(
            model=model,
            optimizer=t.make_optimizer("sgd", model.parameters()),
            training_data=t.dataset(),
            config=t.ds_config(cluster=files["cluster"], plan=files[0], stage=0),
        )
        results["refused"] = None
    except ValueError as exc:
        results["refused"] = str(exc)
    model = Wrapped()
    calls = _count_block_forwards(model.inner)
    engine, _, loader, _ = poplar_ext.initialize(
        model=model,
        optimizer=t.make_optimizer("sgd", model.parameters()),
        training_data=t.dataset(),
        config=t.ds_config(cluster=files["cluster"], plan=files[0], stage=0),
        checkpointing_toggle=toggle,
    )
    t.train_steps(engine, loader, 1)
    results["toggle forwards per micro-step"] = calls[0] / engine.rank_plan.gradient_accumulation_steps
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("checkpointing")
    files = {"cluster": t.write_cluster(tmp / "cluster.json")}
    for stage, checkpointing in CASES:
        files[stage] = t.write_plan(
            tmp / f"plan{stage}.json", _allocation(stage), stage=stage, device_types=TYPES, checkpointing=checkpointing
        )
    return run_ranks(_run_all, world_size=3, tmp_path=tmp, args=(files,), timeout_s=300)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_checkpointing_ranks_give_the_global_batch_parameters(results, stage):
    global_batch = sum(b * s for b, s in _allocation(stage))
    expected, _ = t.reference_parameters("sgd", global_batch, STEPS)
    assert t.max_difference(results[0][("params", stage)], expected) <= 1e-6


@pytest.mark.parametrize("stage,checkpointing", CASES)
def test_each_rank_recomputes_as_its_plan_says(results, stage, checkpointing):
    for rank, on in enumerate(checkpointing):
        assert results[rank][("flag", stage)] is on
        # A checkpointed block runs its forward again in backward.
        assert results[rank][("forwards per micro-step", stage)] == (2.0 if on else 1.0)


def test_a_model_that_cannot_checkpoint_is_refused_on_every_rank(results):
    for rank, result in enumerate(results):
        message = result["refused"]
        assert message is not None, f"rank {rank} accepted the plan"
        assert "ranks[1].activation_checkpointing" in message and "checkpointing_toggle" in message
        assert "Wrapped" in message


def test_a_toggle_of_the_users_applies_the_plan(results):
    assert [result["toggle forwards per micro-step"] for result in results] == [1.0, 2.0, 2.0]
