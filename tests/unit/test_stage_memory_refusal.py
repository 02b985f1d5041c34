"""The runtime refuses a plan whose ZeRO stage a rank cannot hold, before DeepSpeed builds the engine."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from poplar_ext.zero.planning import check_stage_memory

GIB = 2**30
# The module, not the function of the same name that poplar_ext.runtime exports.
initialize = importlib.import_module("poplar_ext.zero.initialize")


def _plan(zero_stage, offload=(False, False)):
    types = ("A100-80GB", "V100-16GB")
    return SimpleNamespace(
        zero_stage=zero_stage,
        ranks=tuple(
            SimpleNamespace(rank=r, device_type=t, optimizer_offload=o) for r, (t, o) in enumerate(zip(types, offload))
        ),
    )


def _check(plan):
    # The main case: a 1B-parameter model in bf16 with Adam on an A100-80 and a V100-16.
    check_stage_memory(
        plan,
        capacities_bytes=[80 * GIB, 16 * GIB],
        num_parameters=10**9,
        num_trainable_parameters=10**9,
        dtype="bfloat16",
        optimizer_bytes_per_parameter=8,
    )


def test_a_rank_that_cannot_hold_the_stage_is_named_with_estimate_and_capacity():
    with pytest.raises(ValueError, match=r"rank 1 \(V100-16GB\): ZeRO stage 0 needs at least 18\.6 GiB") as caught:
        _check(_plan(0))
    assert "more than its memory of 16.0 GiB" in str(caught.value)
    assert "rank 0" not in str(caught.value)


@pytest.mark.parametrize("plan", [_plan(1), _plan(2)])
def test_a_stage_every_rank_holds_passes(plan):
    _check(plan)


def test_initialize_checks_each_ranks_own_memory(monkeypatch):
    # Two ranks sharing one 32 GiB device get 16 GiB each; an emulated type gets its declared capacity.
    facts = [SimpleNamespace(host="h", node="h", device_id=0, memory_bytes=32 * GIB) for _ in range(2)]
    cluster = SimpleNamespace(
        rank_device_types=("A100-80GB", "V100-16GB"),
        emulation_of=lambda t: SimpleNamespace(memory_capacity_bytes=80 * GIB) if t == "A100-80GB" else None,
    )
    model = torch.nn.Linear(4, 4)
    monkeypatch.setattr(initialize, "check_stage_memory", lambda plan, **kwargs: seen.update(kwargs))
    seen: dict = {}
    initialize._check_stage_memory(
        _plan(0), cluster=cluster, facts=facts, model=model, ds_config={"bf16": {"enabled": True}}
    )
    assert seen["capacities_bytes"] == [80 * GIB, 16 * GIB]
    assert (seen["num_parameters"], seen["dtype"], seen["optimizer_bytes_per_parameter"]) == (20, "bfloat16", 8)


def test_a_model_built_under_zero_init_counts_its_full_parameters(monkeypatch):
    facts = [SimpleNamespace(host="h", node="h", device_id=r, memory_bytes=16 * GIB) for r in range(2)]
    cluster = SimpleNamespace(rank_device_types=("A100-80GB", "V100-16GB"), emulation_of=lambda t: None)
    model = torch.nn.Linear(4, 4)
    for parameter in model.parameters():
        parameter.data = torch.empty(0)  # as ZeRO-3 partitions it
        parameter.ds_numel = 1000
    seen: dict = {}
    monkeypatch.setattr(initialize, "check_stage_memory", lambda plan, **kwargs: seen.update(kwargs))
    initialize._check_stage_memory(_plan(3), cluster=cluster, facts=facts, model=model, ds_config={})
    assert (seen["num_parameters"], seen["dtype"]) == (2000, "float32")
