"""Links of different speeds in one job: each node's declared uplink (the cluster file's
``uplink_bandwidth_bytes_per_s``) prices the transfers and all-reduces that cross it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from poplar_bench.synthetic import SYNTHETIC_LAYERED_MODEL
from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import Cluster, ClusterNode, DeviceGroup, Prediction, cluster_from_dict, cluster_to_dict
from poplar_ext.plan.network_format import cluster_key
from poplar_ext.plan.pipeline_formats import (
    LayerCost,
    LayerProfile,
    LayerSample,
    Pipeline,
    PipelinePlan,
    PipelineStage,
    save_pipeline_plan,
)
from poplar_ext.search.network import modelled_network
from poplar_ext.search.pipeline_cost import predict_pipeline
from poplar_ext.search.pipeline_search import search_pipeline_plan

ONE_GBIT = 1.25e8
"""1 Gb/s in bytes per second."""
TWENTY_FIVE_GBIT = 3.125e9
NETWORK = modelled_network(bus_bandwidth_bytes_per_s=1e9, latency_s=1e-5, note="test: every link 8 Gb/s")


def _cluster(*uplinks: float | None, ranks_per_node: int = 1) -> Cluster:
    return Cluster(
        nodes=tuple(
            ClusterNode(
                name=f"n{i}",
                devices=(DeviceGroup(device_type="g", count=ranks_per_node),),
                uplink_bandwidth_bytes_per_s=uplink,
            )
            for i, uplink in enumerate(uplinks)
        )
    )


def _profile(outputs=(10**6, 10**6, 10, 10), capacity=2_500_000) -> LayerProfile:
    """Layers of 1 ms per sample, 1e6 bytes each of parameters and optimizer state (two fit a device)."""
    layers = tuple(
        LayerCost(
            index=i,
            name="Block",
            samples=tuple(LayerSample(micro_batch_size=b, step_time_s=0.001 * b) for b in (1, 2, 4)),
            parameter_bytes=250_000,
            optimizer_state_bytes=750_000,
            activation_bytes_per_sample=10,
            output_bytes_per_sample=out,
            optimizer_step_time_s=0.0,
        )
        for i, out in enumerate(outputs)
    )
    return LayerProfile(
        device_type="g",
        memory_capacity_bytes=capacity,
        zero_stage=0,
        model=SYNTHETIC_LAYERED_MODEL,
        layers=layers,
        base_memory_bytes=0,
        emulated=None,
        measured_with={"source": "modelled"},
    )


def _plan(*pipelines: Pipeline, num_layers: int = 4) -> PipelinePlan:
    return PipelinePlan(
        policy="poplar",
        zero_stage=0,
        global_batch_size=sum(p.samples_per_iteration for p in pipelines),
        num_layers=num_layers,
        pipelines=pipelines,
        predicted=Prediction(iteration_time_s=1.0, samples_per_s=1.0, ideal_samples_per_s=1.0),
        profile_fingerprints={},
    )


def _pipeline(*stages: tuple[int, int, int], b: int = 2, m: int = 4) -> Pipeline:
    """Stages as (rank, first layer, last layer)."""
    return Pipeline(
        stages=tuple(PipelineStage(rank=r, device_type="g", first_layer=f, last_layer=e) for r, f, e in stages),
        micro_batch_size=b,
        num_micro_batches=m,
    )


# ----------------------------------------------------------------------------------
# The cluster file
# ----------------------------------------------------------------------------------
def _cluster_data(**node1) -> dict:
    return {
        "schema_version": 1,
        "nodes": [
            {"name": "fast", "devices": [{"device_type": "g", "count": 2}], "uplink_bandwidth_bytes_per_s": 3.125e9},
            {"name": "slow", "devices": [{"device_type": "g", "count": 2}], **node1},
        ],
    }


def test_a_node_may_declare_its_uplink_and_the_file_round_trips():
    cluster = cluster_from_dict(_cluster_data(uplink_bandwidth_bytes_per_s=125_000_000))
    assert [n.uplink_bandwidth_bytes_per_s for n in cluster.nodes] == [3.125e9, 1.25e8]
    assert cluster_from_dict(cluster_to_dict(cluster)) == cluster
    # Not declared (absent or null): nothing written, the dict of an old file unchanged.
    old = cluster_from_dict(_cluster_data(uplink_bandwidth_bytes_per_s=None))
    assert old.nodes[1].uplink_bandwidth_bytes_per_s is None
    assert "uplink_bandwidth_bytes_per_s" not in cluster_to_dict(old)["nodes"][1]


@pytest.mark.parametrize("value", ["25Gb", 0, -1.0, True, 1e16, [1e9]])
def test_a_bad_uplink_names_its_file_and_field(value):
    with pytest.raises(FormatError) as caught:
        cluster_from_dict(_cluster_data(uplink_bandwidth_bytes_per_s=value), source="cluster.json")
    assert str(caught.value).startswith(
        "cluster.json: nodes[1].uplink_bandwidth_bytes_per_s: expected a positive number <= 1e+15, found "
    )


def test_a_misspelt_uplink_is_refused_with_the_known_name():
    with pytest.raises(FormatError, match=r"nodes\[1\]\.uplink_bandwidth: .*did you mean 'uplink_bandwidth_bytes_"):
        cluster_from_dict(_cluster_data(uplink_bandwidth=1e9), source="cluster.json")


def test_declared_uplinks_keep_the_network_file_of_the_cluster():
    # The network was measured on the same machines: declaring their links must not lose it.
    assert cluster_key(_cluster(ONE_GBIT, None)) == cluster_key(_cluster(None, None))


# ----------------------------------------------------------------------------------
# Prices
# ----------------------------------------------------------------------------------
TWO_STAGES = _plan(_pipeline((0, 0, 1), (1, 2, 3)))
"""Layers 0-1 on node n0, 2-3 on n1: each micro-batch of 2 sends layer 1's 1e6 bytes per sample both ways."""


def _transfer_s(bandwidth: float) -> float:
    return 4 * 2 * (1e-5 + 2 * 10**6 / bandwidth)


def test_two_nodes_joined_by_a_slow_link_and_by_a_fast_one_are_priced_apart():
    slow = predict_pipeline(TWO_STAGES, [_profile()], NETWORK, cluster=_cluster(ONE_GBIT, TWENTY_FIVE_GBIT))
    fast = predict_pipeline(TWO_STAGES, [_profile()], NETWORK, cluster=_cluster(TWENTY_FIVE_GBIT, TWENTY_FIVE_GBIT))
    assert slow.rank_transfer_time_s == pytest.approx((_transfer_s(ONE_GBIT),) * 2, rel=1e-12)
    # Both uplinks declared: the link is theirs, faster than the network's fit.
    assert fast.rank_transfer_time_s == pytest.approx((_transfer_s(TWENTY_FIVE_GBIT),) * 2, rel=1e-12)
    assert slow.iteration_time_s > fast.iteration_time_s


def test_without_declared_uplinks_the_network_prices_as_before():
    undeclared = predict_pipeline(TWO_STAGES, [_profile()], NETWORK, cluster=_cluster(None, None))
    assert undeclared.rank_transfer_time_s == (_transfer_s(1e9),) * 2
    # One side declared: the link is the slower of its uplink and the network's fit.
    half = predict_pipeline(TWO_STAGES, [_profile()], NETWORK, cluster=_cluster(TWENTY_FIVE_GBIT, None))
    assert half.rank_transfer_time_s == undeclared.rank_transfer_time_s
    slow_half = predict_pipeline(TWO_STAGES, [_profile()], NETWORK, cluster=_cluster(None, ONE_GBIT))
    assert slow_half.rank_transfer_time_s == pytest.approx((_transfer_s(ONE_GBIT),) * 2, rel=1e-12)
    # No network: nothing is priced, declared links or not.
    unpriced = predict_pipeline(TWO_STAGES, [_profile()], cluster=_cluster(ONE_GBIT, ONE_GBIT))
    assert unpriced.rank_transfer_time_s == (0.0, 0.0)


def test_a_gradient_all_reduce_runs_at_its_slowest_link():
    # Three single-stage pipelines, one per node: layers' 4e6 parameter bytes summed over the three nodes.
    plan = _plan(*(_pipeline((r, 0, 3), b=1, m=1) for r in range(3)))
    profile = _profile(capacity=10**8)
    ring = 4 * 1e-5, 4 / 3 * 10**6
    for uplinks, bandwidth in (
        ((TWENTY_FIVE_GBIT, TWENTY_FIVE_GBIT, ONE_GBIT), ONE_GBIT),
        ((TWENTY_FIVE_GBIT, TWENTY_FIVE_GBIT, TWENTY_FIVE_GBIT), TWENTY_FIVE_GBIT),
        ((None, None, None), 1e9),
    ):
        predicted = predict_pipeline(plan, [profile], NETWORK, cluster=_cluster(*uplinks))
        assert predicted.rank_all_reduce_s == pytest.approx((ring[0] + ring[1] / bandwidth,) * 3, rel=1e-12)


def test_each_boundary_reports_its_link_and_its_time():
    cluster = _cluster(TWENTY_FIVE_GBIT, ONE_GBIT, ranks_per_node=2)
    plan = _plan(_pipeline((0, 0, 1), (1, 2, 2), (2, 3, 3)), _pipeline((3, 0, 3), b=1, m=1))
    predicted = predict_pipeline(plan, [_profile(capacity=10**8)], NETWORK, cluster=cluster)
    within, across = predicted.boundary_transfers
    assert (within.pipeline, within.stage, within.ranks, within.nodes) == (0, 0, (0, 1), (0, 0))
    assert (across.pipeline, across.stage, across.ranks, across.nodes) == (0, 1, (1, 2), (0, 1))
    assert across.bandwidth_bytes_per_s == ONE_GBIT and within.bandwidth_bytes_per_s == 1e9
    assert across.time_s == pytest.approx(4 * 2 * (1e-5 + 2 * 10 / ONE_GBIT), rel=1e-12)
    # A stage's transfers are the boundaries on both its sides.
    assert predicted.rank_transfer_time_s[1] == pytest.approx(within.time_s + across.time_s, rel=1e-12)


# ----------------------------------------------------------------------------------
# The search
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["exact", "heuristic"])
def test_the_search_keeps_the_heavy_boundary_on_the_fast_link(method):
    # Three nodes of one device each; two layers fit a device, so one pipeline of three stages.
    # n1's uplink is 1 Gb/s, n0's and n2's 25 Gb/s: layers 0 and 1 send 1e6 bytes per sample, 2 and 3
    # only 10. The slow node goes at an end, behind the light boundary after layer 2.
    cluster = _cluster(TWENTY_FIVE_GBIT, ONE_GBIT, TWENTY_FIVE_GBIT)
    kwargs = {"global_batch_size": 8, "network": NETWORK, "method": method}
    result = search_pipeline_plan([_profile()], cluster, **kwargs, layouts="all")
    (pipeline,) = result.plan.pipelines
    assert pipeline.stages[-1].rank == 1 and pipeline.stages[-1].first_layer == 3
    # Priced per link, the slow node in the middle (both boundaries on its uplink) is slower.
    middle = dataclasses.replace(
        pipeline,
        stages=(
            dataclasses.replace(pipeline.stages[0], rank=0),
            dataclasses.replace(pipeline.stages[1], rank=1),
            dataclasses.replace(pipeline.stages[2], rank=2),
        ),
    )
    worse = predict_pipeline(_plan(middle), [_profile()], NETWORK, cluster=cluster)
    assert worse.iteration_time_s > result.plan.predicted.iteration_time_s * 1.5
    # With every link alike, the order no longer matters.
    alike = _cluster(TWENTY_FIVE_GBIT, TWENTY_FIVE_GBIT, TWENTY_FIVE_GBIT)
    same = [
        predict_pipeline(p, [_profile()], NETWORK, cluster=alike).iteration_time_s for p in (_plan(middle), result.plan)
    ]
    assert same[0] == pytest.approx(same[1], rel=1e-12)


def test_a_slow_link_between_two_nodes_changes_the_searched_plan_time():
    kwargs = {"global_batch_size": 8, "network": NETWORK}
    slow = search_pipeline_plan([_profile()], _cluster(ONE_GBIT, ONE_GBIT, ranks_per_node=2), **kwargs)
    fast = search_pipeline_plan([_profile()], _cluster(TWENTY_FIVE_GBIT, TWENTY_FIVE_GBIT, ranks_per_node=2), **kwargs)
    assert slow.plan.predicted.iteration_time_s > fast.plan.predicted.iteration_time_s


# ----------------------------------------------------------------------------------
# poplar-search --predict
# ----------------------------------------------------------------------------------
def test_predict_shows_each_links_transfer_time(tmp_path, capsys):
    from poplar_ext.search.cli import main
    from poplar_ext.search.examples import example_cluster_file

    data = json.loads(example_cluster_file().read_text())
    data["nodes"][0]["uplink_bandwidth_bytes_per_s"] = TWENTY_FIVE_GBIT
    data["nodes"][1]["uplink_bandwidth_bytes_per_s"] = ONE_GBIT
    cluster_path = tmp_path / "cluster.json"
    cluster_path.write_text(json.dumps(data))
    # Rank 0 (A100, node0) holds layers 0-6, rank 4 (V100, node1) 7-13; the others the whole model.
    stages = [
        PipelineStage(rank=0, device_type="A100-80GB", first_layer=0, last_layer=6),
        PipelineStage(rank=4, device_type="V100-16GB", first_layer=7, last_layer=13),
    ]
    pipelines = [Pipeline(stages=tuple(stages), micro_batch_size=2, num_micro_batches=4)]
    for rank in (1, 2, 3, 5, 6, 7):
        device_type = "A100-80GB" if rank < 4 else "V100-16GB"
        stage = PipelineStage(rank=rank, device_type=device_type, first_layer=0, last_layer=13)
        pipelines.append(Pipeline(stages=(stage,), micro_batch_size=1, num_micro_batches=1))
    plan_path = tmp_path / "plan.json"
    save_pipeline_plan(_plan(*pipelines, num_layers=14), plan_path)
    assert main(["--example", "--cluster", str(cluster_path), "--predict", str(plan_path)]) == 0
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if "node0-node1" in line]
    assert "1.25e+08" in row
    assert main(["--example", "--cluster", str(cluster_path), "--predict", str(plan_path), "--format", "json"]) == 0
    (boundary,) = json.loads(capsys.readouterr().out)["prediction"]["boundary_transfers"]
    assert boundary["bandwidth_bytes_per_s"] == ONE_GBIT and boundary["nodes"] == [0, 1]
    assert f"{boundary['time_s']:.4g}" in row
