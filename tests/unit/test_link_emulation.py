"""The emulated slow link: what crosses it, what it costs, and the wrapped collectives that pay it."""

from __future__ import annotations

import time
import types

import pytest
import torch

from poplar_bench import link_emulation
from poplar_bench.link_emulation import LinkEmulation, install_link_emulation

LINK = LinkEmulation(node_of_rank=(0, 0, 1, 1), bandwidth_bytes_per_s=100e6, latency_s=0.001)


def test_only_what_spans_both_nodes_crosses_the_link_at_ring_bytes() -> None:
    assert LINK.crossing_bytes("all_reduce", 1000, [0, 1]) == 0.0
    assert LINK.delay_s("all_reduce", 1000, [2, 3]) == 0.0
    assert LINK.crossing_bytes("all_reduce", 1000, [0, 1, 2, 3]) == pytest.approx(1500)  # 2 (n-1)/n
    assert LINK.crossing_bytes("all_reduce", 1000, [0, 2]) == pytest.approx(1000)
    assert LINK.crossing_bytes("all_gather", 1000, [0, 1, 2, 3]) == pytest.approx(750)
    assert LINK.crossing_bytes("p2p", 1000, [1, 2]) == 1000
    assert LINK.delay_s("p2p", 10**6, [1, 2]) == pytest.approx(0.001 + 0.01)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s"):
        LinkEmulation(node_of_rank=(0,), bandwidth_bytes_per_s=0)


def _fake_dist(calls: list) -> types.SimpleNamespace:
    world = object()
    return types.SimpleNamespace(
        group=types.SimpleNamespace(WORLD=world),
        get_rank=lambda: 1,
        get_world_size=lambda: 4,
        get_process_group_ranks=lambda group: group,
    )


def test_a_wrapped_collective_sleeps_only_when_its_group_crosses() -> None:
    calls: list = []
    dist = _fake_dist(calls)
    all_reduce = link_emulation._wrap(
        dist, LINK, lambda *a, **k: calls.append(a) or None, "all_reduce", "all_reduce", 0, "tensor"
    )
    tensor = torch.zeros(2_500_000)  # 10 MB: 0.1 s over the link as a pair's all-reduce
    started = time.perf_counter()
    all_reduce(tensor, group=[0, 1])
    within = time.perf_counter() - started
    started = time.perf_counter()
    all_reduce(tensor, group=[1, 2])
    crossing = time.perf_counter() - started
    assert len(calls) == 2
    assert within < 0.05 and crossing >= 0.1


def test_install_replaces_and_undo_restores_torch_distributed() -> None:
    import torch.distributed as dist

    before = dist.all_reduce
    undo = install_link_emulation(LINK)
    try:
        assert dist.all_reduce is not before and dist.all_reduce.__wrapped__ is before
    finally:
        undo()
    assert dist.all_reduce is before
