"""The network measured within and between nodes when the cluster has several (forked CPU ranks)."""

from __future__ import annotations

import json

import pytest
from harness import run_ranks


def _measure(cluster_path: str) -> dict:
    import torch

    from poplar_ext.plan.network_format import network_to_dict
    from poplar_ext.profiler.layout import build_layout
    from poplar_ext.profiler.network import measure_network

    network = measure_network(
        build_layout(cluster_path, torch.device("cpu"), bf16=False), message_bytes=(4096, 1 << 20), repeats=2
    )
    return network_to_dict(network)


def _cluster(path, node_sizes) -> str:
    nodes = [
        {"name": f"n{i}", "devices": [{"device_type": f"cpu-{i}", "count": size}]} for i, size in enumerate(node_sizes)
    ]
    types = {
        f"cpu-{i}": {"emulation": {"slowdown": 1.0, "memory_capacity_bytes": 10**9}} for i in range(len(node_sizes))
    }
    path.write_text(json.dumps({"schema_version": 1, "nodes": nodes, "device_types": types}))
    return str(path)


@pytest.mark.parametrize("node_sizes", [(2, 2), (2, 1)])
def test_several_nodes_are_timed_within_and_between_nodes(tmp_path, node_sizes):
    from poplar_ext.plan.network_format import COLLECTIVES, network_from_dict

    results = run_ranks(
        _measure,
        world_size=sum(node_sizes),
        tmp_path=tmp_path / "ranks",
        args=(_cluster(tmp_path / "cluster.json", node_sizes),),
        timeout_s=180,
    )
    assert all(r == results[0] for r in results[1:]) or all(r["scopes"] == results[0]["scopes"] for r in results)
    network = network_from_dict(results[0])
    assert network.num_nodes == 2 and network.world_size == sum(node_sizes)
    assert set(network.scopes) == {"within_node", "between_nodes"}
    assert network.scopes["within_node"].group_size == 2 and network.scopes["between_nodes"].group_size == 2
    for scope in network.scopes.values():
        assert set(scope.collectives) == set(COLLECTIVES)
        assert all(
            len(fit.samples) == 2 and all(s.time_s > 1e-9 for s in fit.samples) for fit in scope.collectives.values()
        )


def test_one_node_has_no_scopes(tmp_path):
    results = run_ranks(
        _measure, world_size=2, tmp_path=tmp_path / "ranks", args=(_cluster(tmp_path / "c.json", (2,)),), timeout_s=180
    )
    assert "scopes" not in results[0]


def _cached_network(cluster_path: str, cache_dir: str) -> str:
    import torch

    from poplar_ext.profiler.layout import build_layout
    from poplar_ext.profiler.network import cached_or_measured_network

    layout = build_layout(cluster_path, torch.device("cpu"), bf16=False)
    try:
        cached_or_measured_network(layout, cache_dir, force=False, message_bytes=(4096,))
    except ValueError as exc:
        return f"ValueError: {exc}"
    return "no error"


def test_a_bad_network_file_is_an_error_on_every_rank(tmp_path):
    """Rank 0 alone reads the cache: its error must reach the other ranks, not leave them in its broadcast."""
    from poplar_ext.plan.formats import load_cluster
    from poplar_ext.plan.network_format import network_path

    cluster_path = _cluster(tmp_path / "c.json", (2,))
    bad = network_path(tmp_path / "profiles", load_cluster(cluster_path))
    bad.parent.mkdir(parents=True)
    bad.write_text('{"schema_version": 1, "kind": "network"}')
    results = run_ranks(
        _cached_network,
        world_size=2,
        tmp_path=tmp_path / "ranks",
        args=(cluster_path, str(tmp_path / "profiles")),
        timeout_s=120,
        pg_timeout_s=20,
    )
    assert all(r.startswith("ValueError: ") and bad.name in r for r in results), results
