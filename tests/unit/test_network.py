"""The network file and communication in the cost model (plan.network_format, search.network, search.cost)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from poplar_bench.synthetic import synthetic_profile
from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import (
    Cluster,
    ClusterNode,
    DeviceGroup,
    IncludedCommunication,
    load_profiles,
    profile_from_dict,
    profile_to_dict,
    save_cluster,
    save_profile,
)
from poplar_ext.plan.network_format import (
    CollectiveSample,
    NetworkProfile,
    cluster_key,
    find_network,
    load_network,
    network_path,
    network_to_dict,
    ring_factors,
    save_network,
)
from poplar_ext.search import predict, search_plan
from poplar_ext.search.cli import main as search_main
from poplar_ext.search.cost import BACKWARD_SHARE, build_stage_model, stage_communication
from poplar_ext.search.network import fit_collective, modelled_network

GB = 1e9


def _cluster(counts: dict[str, int]) -> Cluster:
    return Cluster(
        nodes=(ClusterNode(name="n0", devices=tuple(DeviceGroup(device_type=t, count=c) for t, c in counts.items())),),
        device_types={},
    )


def _profile(
    device_type: str, stage: int, *, world_size: int = 2, includes: bool | None = None, overhead_s: float = 0.01
):
    profile = synthetic_profile(
        device_type,
        zero_stage=stage,
        max_micro_batch_size=16,
        overhead_s=overhead_s,
        seconds_per_sample=0.002,
        optimizer_step_time_s=0.05,
        world_size=world_size,
    )
    if includes is not None:
        profile = dataclasses.replace(
            profile, measured_with={**profile.measured_with, "micro_step_times_include_communication": includes}
        )
    return profile


def _network(bandwidth: float = 1 * GB, latency: float = 1e-4, backend: str = "gloo") -> NetworkProfile:
    return modelled_network(bus_bandwidth_bytes_per_s=bandwidth, latency_s=latency, backend=backend, note="test")


# -- the ring model ----------------------------------------------------------------
def test_ring_factors_follow_the_nccl_tests_bus_bandwidth_definition():
    assert ring_factors("all_reduce", 4) == (6, 1.5)
    assert ring_factors("reduce_scatter", 4) == (3, 0.75)
    assert ring_factors("all_gather", 8) == (7, 7 / 8)
    assert ring_factors("all_reduce", 1) == (0, 0.0)
    with pytest.raises(ValueError, match="collective: expected one of"):
        ring_factors("broadcast", 4)


def test_the_fit_recovers_latency_and_bandwidth_and_predicts_another_world_size():
    latency, bandwidth = 2e-4, 3 * GB
    sizes = [2**12, 2**16, 2**20, 2**23, 2**25]

    def exact(collective, n, w):
        hops, volume = ring_factors(collective, w)
        return hops * latency + volume * n / bandwidth

    samples = [CollectiveSample(message_bytes=n, time_s=exact("all_reduce", n, 3)) for n in sizes]
    fit = fit_collective("all_reduce", 3, samples)
    assert fit.latency_s == pytest.approx(latency, rel=1e-6)
    assert fit.bus_bandwidth_bytes_per_s == pytest.approx(bandwidth, rel=1e-6)
    network = dataclasses.replace(_network(), collectives={**_network().collectives, "all_reduce": fit})
    assert network.time_s("all_reduce", 10**8, 64) == pytest.approx(exact("all_reduce", 10**8, 64), rel=1e-6)


def test_a_fit_never_has_negative_latency_or_bandwidth():
    # Times that fall with size (noise) would give a negative slope by plain least squares.
    samples = [CollectiveSample(message_bytes=n, time_s=t) for n, t in [(4096, 3e-3), (2**20, 2e-3), (2**24, 1e-3)]]
    fit = fit_collective("all_gather", 2, samples)
    assert fit.latency_s >= 0 and fit.bus_bandwidth_bytes_per_s > 0


# -- the file --------------------------------------------------------------------------
def test_a_network_file_round_trips_and_is_found_by_its_cluster(tmp_path):
    cluster = _cluster({"a": 1, "b": 1})
    network = dataclasses.replace(_network(), cluster_key=cluster_key(cluster), world_size=2)
    save_network(network, network_path(tmp_path, cluster))
    found = find_network(tmp_path, cluster)
    assert found is not None and network_to_dict(found) == network_to_dict(network)
    assert find_network(tmp_path, _cluster({"a": 2, "b": 1})) is None, "another cluster has another key"
    assert list(tmp_path.glob("*.json")) == [], "each *.json of a profile directory stays one device type's profile"


def test_load_profiles_skips_a_network_file_beside_the_profiles(tmp_path):
    save_profile(_profile("a", 0), tmp_path / "a.json")
    save_network(_network(), tmp_path / "network-x.json")
    assert [p.device_type for p in load_profiles(tmp_path)] == ["a"]


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda d: d["collectives"]["all_reduce"].update(bus_bandwidth_bytes_per_s=-1),
            r"collectives\.all_reduce\.bus_bandwidth_bytes_per_s: expected",
        ),
        (lambda d: d["collectives"].pop("all_gather"), r"collectives\.all_gather"),
        (lambda d: d.update(latency=1), r"latency"),
        (lambda d: d["measured_with"].update(source="guessed"), r"measured_with\.source"),
        (lambda d: d.update(schema_version=2), r"schema_version"),
        (
            lambda d: d.update(backend="NCCL"),
            r"backend: expected a backend as torch names it, in lower case \(here 'nccl'\)",
        ),
    ],
)
def test_a_bad_network_file_names_the_file_and_the_field(tmp_path, edit, match):
    data = network_to_dict(_network())
    edit(data)
    path = tmp_path / "network-bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(FormatError, match=match) as caught:
        load_network(path)
    assert str(path) in str(caught.value)


# -- the cost model -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("stage", "micro_collectives", "boundary_collectives"),
    [
        (0, [], ["all_reduce"]),
        (1, [], ["reduce_scatter", "all_gather"]),
        (2, ["reduce_scatter"], ["all_gather"]),
        (3, ["all_gather", "all_gather", "reduce_scatter"], []),
    ],
)
def test_each_stage_prices_the_collectives_deepspeed_issues(stage, micro_collectives, boundary_collectives):
    network = _network()
    message = 1_000_000 * 4  # the synthetic model: 1M float32 parameters
    communication = stage_communication(
        network, zero_stage=stage, num_parameters=1_000_000, dtype="float32", world_size=8
    )
    assert communication.micro_step_exposed_s == pytest.approx(
        sum(network.time_s(c, message, 8) for c in micro_collectives)
    )
    assert communication.boundary_s == pytest.approx(sum(network.time_s(c, message, 8) for c in boundary_collectives))


def test_with_nccl_stage_3_hides_the_backward_collectives_under_backward():
    network = _network(backend="nccl")
    communication = stage_communication(network, zero_stage=3, num_parameters=1_000_000, dtype="float16", world_size=8)
    overlapped = communication.micro_step_overlapped_s
    assert overlapped > 0
    long_compute = 10 * overlapped / BACKWARD_SHARE
    assert communication.micro_step_time_s(long_compute) == pytest.approx(
        long_compute + communication.micro_step_exposed_s
    )
    assert communication.compute_time_s(np.array([communication.micro_step_time_s(0.001)]))[0] == pytest.approx(0.001)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_profile_whose_times_include_communication_predicts_its_own_world_size_unchanged(stage):
    profiles = {
        "a": _profile("a", stage, world_size=4, includes=True),
        "b": _profile("b", stage, world_size=4, includes=True),
    }
    types = ["a", "a", "b", "b"]
    plain = build_stage_model(profiles, types, stage)
    priced = build_stage_model(profiles, types, stage, _network())
    np.testing.assert_allclose(priced.devices[0].step_time_table_s, plain.devices[0].step_time_table_s, rtol=1e-9)
    assert priced.boundary_s == pytest.approx(plain.boundary_s)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_cpu_profile_without_communication_in_its_micro_steps_gets_it_added(stage):
    profiles = {"a": _profile("a", stage, world_size=2, includes=False)}
    network = _network(bandwidth=0.1 * GB)
    plain = build_stage_model(profiles, ["a", "a"], stage)
    priced = build_stage_model(profiles, ["a", "a"], stage, network)
    extra = priced.communication.micro_step_exposed_s
    assert (extra > 0) == (stage >= 2)
    np.testing.assert_allclose(priced.devices[0].step_time_table_s, plain.devices[0].step_time_table_s + extra)
    assert priced.boundary_s == pytest.approx(plain.boundary_s), "the measured boundary already held its collectives"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_profile_reused_over_another_network_loses_the_communication_it_was_measured_with(stage):
    # Measured over a fast link (its times hold the fast link's collectives), priced for a job over a
    # slow one: the profile's own communication comes out, the slow link's goes in. Priced from the
    # job's network instead, the slow link's larger boundary would eat the optimizer step.
    fast, slow = _network(bandwidth=10 * GB), _network(bandwidth=0.01 * GB)
    plain = _profile("a", stage, world_size=2, includes=True)
    held = stage_communication(
        fast, zero_stage=stage, num_parameters=plain.model.num_parameters, dtype=plain.model.dtype, world_size=2
    )
    measured_fast = dataclasses.replace(
        plain,
        samples=tuple(
            dataclasses.replace(x, micro_step_time_s=x.micro_step_time_s + held.micro_step_exposed_s)
            for x in plain.samples
        ),
        optimizer_step_time_s=plain.optimizer_step_time_s + held.boundary_s,
        included_communication=IncludedCommunication(
            micro_step_exposed_s=held.micro_step_exposed_s,
            micro_step_overlapped_s=held.micro_step_overlapped_s,
            boundary_s=held.boundary_s,
        ),
    )
    priced = build_stage_model({"a": measured_fast}, ["a", "a"], stage, slow)
    alone = build_stage_model({"a": plain}, ["a", "a"], stage)
    assert priced.devices[0].optimizer_step_time_s == pytest.approx(plain.optimizer_step_time_s)
    assert priced.boundary_s == pytest.approx(plain.optimizer_step_time_s + priced.communication.boundary_s)
    expected = alone.devices[0].step_time_table_s + priced.communication.micro_step_exposed_s
    np.testing.assert_allclose(priced.devices[0].step_time_table_s, expected, rtol=1e-9)
    slow_part = priced.communication.boundary_s + priced.communication.micro_step_exposed_s
    assert slow_part > 10 * (held.boundary_s + held.micro_step_exposed_s) > 0


def test_included_communication_round_trips_and_is_checked(tmp_path):
    profile = dataclasses.replace(
        _profile("a", 1),
        included_communication=IncludedCommunication(
            micro_step_exposed_s=0.0, micro_step_overlapped_s=0.0, boundary_s=0.25
        ),
    )
    data = profile_to_dict(profile)
    assert profile_from_dict(json.loads(json.dumps(data))) == profile
    assert _profile("a", 1).fingerprint != profile.fingerprint
    data["included_communication"]["boundary_s"] = -1
    with pytest.raises(FormatError, match=r"included_communication\.boundary_s"):
        profile_from_dict(data, source="p.json")
    old = profile_to_dict(_profile("a", 1))
    assert "included_communication" not in old  # written as files from before the field: fingerprints stay
    assert profile_from_dict(old).included_communication is None


def test_a_larger_cluster_than_profiled_pays_more_communication_and_a_smaller_optimizer_shard():
    stage = 1
    profiles = {"a": _profile("a", stage, world_size=2, includes=False)}
    network = _network(bandwidth=1 * GB, latency=0.0)
    small = build_stage_model(profiles, ["a"] * 2, stage, network)
    large = build_stage_model(profiles, ["a"] * 64, stage, network)
    message = 1_000_000 * 4
    assert large.communication.boundary_s == pytest.approx(2 * (63 / 64) * message / GB)
    assert large.devices[0].optimizer_step_time_s == pytest.approx(small.devices[0].optimizer_step_time_s * 2 / 64)
    assert large.communication.boundary_s > small.communication.boundary_s


def test_the_search_and_predict_use_the_network_and_say_where_the_time_goes():
    stage = 2
    profiles = [
        _profile("a", stage, world_size=2, includes=False),
        _profile("b", stage, world_size=2, includes=False, overhead_s=0.02),
    ]
    cluster = _cluster({"a": 1, "b": 1})
    network = _network(bandwidth=0.05 * GB)
    without = search_plan(profiles, cluster, global_batch_size=24, zero_stage=stage)
    priced = search_plan(profiles, cluster, global_batch_size=24, zero_stage=stage, network=network)
    assert priced.plan.predicted.iteration_time_s > without.plan.predicted.iteration_time_s

    # Communication on every micro-step makes fewer, larger micro-steps pay.
    def steps(result):
        return result.plan.ranks[0].gradient_accumulation_steps

    assert steps(priced) <= steps(without)
    prediction = predict(priced.plan, profiles, network)
    assert prediction.iteration_time_s == pytest.approx(priced.plan.predicted.iteration_time_s)
    assert prediction.micro_step_communication_s > 0
    assert all(c < b for c, b in zip(prediction.rank_compute_time_s, prediction.rank_busy_time_s))


def test_poplar_search_takes_the_network_file_beside_the_profiles_or_the_one_named(tmp_path, capsys):
    stage = 2
    directory = tmp_path / "profiles"
    directory.mkdir()
    for t in ("a", "b"):
        save_profile(_profile(t, stage, includes=False), directory / f"{t}.json")
    cluster = _cluster({"a": 1, "b": 1})
    save_cluster(cluster, tmp_path / "cluster.json")
    argv = [
        "--profiles",
        str(directory),
        "--cluster",
        str(tmp_path / "cluster.json"),
        "--global-batch-size",
        "24",
        "--zero-stage",
        "2",
        "--format",
        "json",
    ]

    def predicted(*extra):
        assert search_main([*argv, *extra]) == 0
        return json.loads(capsys.readouterr().out)["predicted"]["iteration_time_s"]

    base = predicted()
    slow = dataclasses.replace(_network(bandwidth=0.05 * GB), cluster_key=cluster_key(cluster))
    save_network(slow, network_path(directory, cluster))
    assert predicted() > base, "the network file measured on this cluster is used by default"
    assert predicted("--no-network") == pytest.approx(base)
    named = tmp_path / "other.json"
    save_network(_network(bandwidth=0.01 * GB), named)
    assert predicted("--network", str(named)) > predicted()
    (tmp_path / "broken.json").write_text("{}")
    assert search_main([*argv, "--network", str(tmp_path / "broken.json")]) == 2
    assert "broken.json" in capsys.readouterr().err


def test_scopes_round_trip_and_a_bad_scope_names_its_field(tmp_path):
    from poplar_ext.plan.network_format import NetworkScope, network_from_dict

    base = _network()
    network = dataclasses.replace(
        base,
        num_nodes=2,
        scopes={
            "within_node": NetworkScope(group_size=2, collectives=base.collectives),
            "between_nodes": NetworkScope(group_size=2, collectives=base.collectives),
        },
    )
    data = network_to_dict(network)
    assert network_from_dict(data) == network
    assert "scopes" not in network_to_dict(base), "a one-node file is written as before"
    data["scopes"]["across_racks"] = data["scopes"].pop("between_nodes")
    with pytest.raises(FormatError, match=r"n.json: scopes.across_racks: expected one of the keys"):
        network_from_dict(data, source="n.json")


@pytest.mark.parametrize(("backend", "reused"), [("gloo", True), ("nccl", False)])
def test_a_cached_network_file_is_reused_only_over_the_backend_it_was_measured_with(
    tmp_path, monkeypatch, backend, reused
):
    from types import SimpleNamespace

    from poplar_ext.profiler import network as profiler_network

    cluster = _cluster({"a": 1, "b": 1})
    stored = dataclasses.replace(_network(), cluster_key=cluster_key(cluster), world_size=2, backend="gloo")
    save_network(stored, network_path(tmp_path, cluster))
    measured = dataclasses.replace(stored, backend=backend)
    monkeypatch.setattr(profiler_network, "process_group_backend", lambda: backend)
    monkeypatch.setattr(profiler_network, "measure_network", lambda layout, message_bytes: measured)
    layout = SimpleNamespace(world_size=2, rank=0, cluster=cluster)
    network, line = profiler_network.cached_or_measured_network(layout, tmp_path, force=False)
    assert network.backend == backend and line.startswith("network: from the cache" if reused else "network: measured")


@pytest.mark.parametrize(("cuda", "expected"), [(True, "nccl"), (False, "gloo")])
def test_a_process_group_with_a_backend_per_device_is_named_by_the_device_in_use(monkeypatch, cuda, expected):
    # dist.init_process_group() without a backend gives one per device, and torch names it "undefined": a
    # network file measured so would read as not overlapping collectives with compute on a GPU (only "nccl" does).
    import torch
    import torch.distributed as dist

    from poplar_ext.collectives import process_group_backend

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "undefined")
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert process_group_backend() == expected
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert process_group_backend() == "nccl"


@pytest.mark.parametrize(
    ("spelled", "cuda", "expected"),
    [("cpu:gloo,cuda:nccl", True, "nccl"), ("cpu:gloo,cuda:nccl", False, "gloo"), ("cpu:gloo", True, "gloo")],
)
def test_a_process_group_started_with_a_backend_per_device_is_named_by_the_device_in_use(
    monkeypatch, spelled, cuda, expected
):
    # dist.init_process_group("cpu:gloo,cuda:nccl"), torch's documented spelling: torch names the group by that
    # string (get_backend() == "cpu:gloo,cuda:nccl", not "undefined"), which process_group_backend returned as it
    # was: the network file said "cpu:gloo,cuda:nccl", priced as not overlapping, timed on the host through gloo.
    import torch
    import torch.distributed as dist

    from poplar_ext.collectives import _collective_device, process_group_backend

    monkeypatch.setattr(dist, "get_backend", lambda group=None: spelled)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: spelled)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert process_group_backend() == expected
    assert str(_collective_device(torch.device("cuda", 1))) == ("cuda:1" if expected == "nccl" else "cpu")


@pytest.mark.parametrize(("cuda", "expected"), [(True, "cuda:1"), (False, "cpu")])
def test_a_group_with_a_backend_per_device_times_its_collectives_on_the_device_it_names(monkeypatch, cuda, expected):
    # A network file measured under such a group on a GPU says "nccl" (process_group_backend): its collectives must
    # then run on the rank's CUDA device, which the group sends through NCCL, not on the host through gloo.
    import torch
    import torch.distributed as dist

    from poplar_ext.collectives import _collective_device

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "undefined")
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert str(_collective_device(torch.device("cuda", 1) if cuda else torch.device("cpu"))) == expected
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert str(_collective_device(torch.device("cuda", 1))) == "cpu"
