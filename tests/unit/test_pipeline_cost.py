"""The pipeline cost model (poplar_ext.search.pipeline_cost): stage times, 1F1B, transfers, the layer
boundary, memory."""

from __future__ import annotations

import dataclasses

import pytest

from poplar_ext.plan.formats import Cluster, ClusterNode, DeviceGroup, ModelInfo, Prediction
from poplar_ext.plan.network_format import COLLECTIVES, CollectiveFit, NetworkProfile, NetworkScope
from poplar_ext.plan.pipeline_formats import (
    LayerCost,
    LayerProfile,
    LayerSample,
    Pipeline,
    PipelinePlan,
    PipelineStage,
)
from poplar_ext.search.pipeline_cost import in_flight, predict_pipeline, segments

MODEL = ModelInfo(name="toy", fingerprint="sha256:toy", num_parameters=10_000, dtype="float32")


def layer_profile(device_type: str, seconds_per_sample: float, *, zero_stage: int = 0, num_layers: int = 4):
    """Layer l takes (l + 1) x seconds_per_sample x b; bytes grow with l as in `_expected`."""
    layers = tuple(
        LayerCost(
            index=i,
            name="Block",
            samples=tuple(
                LayerSample(micro_batch_size=b, step_time_s=(i + 1) * seconds_per_sample * b) for b in (1, 2, 4)
            ),
            parameter_bytes=1000 * (i + 1),
            optimizer_state_bytes=3000 * (i + 1),
            activation_bytes_per_sample=10 * (i + 1),
            output_bytes_per_sample=[100, 200, 300, 4, 5, 6][i],
            optimizer_step_time_s=0.001 * (i + 1),
        )
        for i in range(num_layers)
    )
    return LayerProfile(
        device_type=device_type,
        memory_capacity_bytes=10**9,
        zero_stage=zero_stage,
        model=MODEL,
        layers=layers,
        base_memory_bytes=100,
        emulated=None,
        measured_with={"source": "modelled"},
    )


PROFILES = [layer_profile("a", 0.01), layer_profile("b", 0.02)]
CLUSTER = Cluster(
    nodes=(
        ClusterNode(name="n0", devices=(DeviceGroup(device_type="a", count=2),)),
        ClusterNode(name="n1", devices=(DeviceGroup(device_type="b", count=1),)),
    )
)


def _fits(latency_s: float, bandwidth: float) -> dict[str, CollectiveFit]:
    return dict.fromkeys(COLLECTIVES, CollectiveFit(latency_s=latency_s, bus_bandwidth_bytes_per_s=bandwidth))


NETWORK = NetworkProfile(
    cluster_key="test",
    world_size=3,
    num_nodes=2,
    backend="nccl",
    collectives=_fits(0.001, 1e6),
    measured_with={"source": "modelled"},
    scopes={
        "within_node": NetworkScope(group_size=2, collectives=_fits(0.0, 1e9)),
        "between_nodes": NetworkScope(group_size=2, collectives=_fits(0.001, 2e6)),
    },
)


def _stage(rank, device_type, first, last):
    return PipelineStage(rank=rank, device_type=device_type, first_layer=first, last_layer=last)


def _plan(pipelines, zero_stage=0, num_layers=4):
    return PipelinePlan(
        policy="poplar",
        zero_stage=zero_stage,
        global_batch_size=sum(p.samples_per_iteration for p in pipelines),
        num_layers=num_layers,
        pipelines=tuple(pipelines),
        predicted=Prediction(iteration_time_s=1.0, samples_per_s=1.0, ideal_samples_per_s=1.0),
        profile_fingerprints={},
    )


# Pipeline 0: rank 0 (a, node n0) holds layers 0-2, rank 2 (b, node n1) layer 3; 3 micro-batches of 2.
# Pipeline 1: rank 1 (a, node n0) holds all four layers; 1 micro-batch of 4.
PLAN = _plan(
    [
        Pipeline(stages=(_stage(0, "a", 0, 2), _stage(2, "b", 3, 3)), micro_batch_size=2, num_micro_batches=3),
        Pipeline(stages=(_stage(1, "a", 0, 3),), micro_batch_size=4, num_micro_batches=1),
    ]
)


def test_a_plan_is_priced_stage_by_stage_as_the_docstring_says():
    predicted = predict_pipeline(PLAN, PROFILES, NETWORK, cluster=CLUSTER)
    # Boundary 0|1 carries layer 2's 300 bytes x 2 samples between nodes: 1 ms + 600 B / 2 MB/s, both ways.
    transfer = 2 * (0.001 + 600 / 2e6)
    stage0, stage1 = (1 + 2 + 3) * 0.01 * 2 + transfer, 4 * 0.02 * 2 + transfer
    assert predicted.rank_stage_time_s == pytest.approx((stage0, 0.4, stage1))
    # 1F1B: (m + S - 1) x the slowest stage.
    assert predicted.pipeline_time_s == pytest.approx(((3 + 2 - 1) * stage1, 0.4))
    assert predicted.rank_busy_time_s == pytest.approx((3 * stage0, 0.4, 3 * stage1))
    assert predicted.rank_transfer_time_s == pytest.approx((3 * transfer, 0.0, 3 * transfer))
    # Layers 0-2 summed over ranks 0 and 1 (one node: 6000 B at 1 GB/s, no latency), then layer 3 over
    # ranks 2 and 1 (two nodes: the job's fit), which waits for rank 1's first all-reduce.
    first = 6000 / 1e9
    second = first + 2 * 0.001 + 4000 / 1e6
    assert predicted.rank_all_reduce_s == pytest.approx((first, second, second))
    assert predicted.rank_optimizer_step_s == pytest.approx((0.006, 0.010, 0.004))
    assert predicted.boundary_s == pytest.approx(second + 0.010)
    assert predicted.iteration_time_s == pytest.approx(4 * stage1 + second + 0.010)
    assert predicted.samples_per_s == pytest.approx(10 / predicted.iteration_time_s)


def test_memory_counts_the_micro_batches_1f1b_keeps_in_flight():
    predicted = predict_pipeline(PLAN, PROFILES, NETWORK, cluster=CLUSTER)
    # base + parameters and optimizer state + min(m, S - s) x b x kept bytes per sample
    assert predicted.rank_memory_bytes == (
        100 + 4 * 6000 + 2 * 2 * 60,
        100 + 4 * 10000 + 1 * 4 * 100,
        100 + 4 * 4000 + 1 * 2 * 40,
    )
    assert [in_flight(4, s, 10) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight(4, s, 2) for s in range(4)] == [2, 2, 2, 1]


def test_without_a_network_nothing_is_priced_but_compute_and_the_optimizer_step():
    predicted = predict_pipeline(PLAN, PROFILES)
    assert predicted.rank_transfer_time_s == (0.0, 0.0, 0.0)
    assert predicted.boundary_s == pytest.approx(0.010)
    assert predicted.iteration_time_s == pytest.approx(4 * 4 * 0.02 * 2 + 0.010)


def test_without_the_cluster_ranks_are_priced_as_on_different_nodes():
    predicted = predict_pipeline(PLAN, PROFILES, NETWORK)
    assert predicted.rank_transfer_time_s[0] == pytest.approx(3 * 2 * (0.001 + 600 / 2e6))
    assert predicted.rank_all_reduce_s[0] == pytest.approx(2 * 0.001 + 6000 / 1e6)


def test_gradients_are_summed_per_run_of_layers_with_the_same_holders():
    # bench/results/pipeline_feasibility's check_1_hetero: parts [0, 1, 3, 6] on ranks 0-2 beside rank 3 alone.
    pipelines = [
        Pipeline(
            stages=(_stage(0, "a", 0, 0), _stage(1, "a", 1, 2), _stage(2, "a", 3, 5)),
            micro_batch_size=2,
            num_micro_batches=4,
        ),
        Pipeline(stages=(_stage(3, "a", 0, 5),), micro_batch_size=3, num_micro_batches=2),
    ]
    assert segments(pipelines, 6) == [(0, 0, (0, 3)), (1, 2, (1, 3)), (3, 5, (2, 3))]


def test_a_layer_curve_is_made_monotone_before_it_is_summed():
    profile = layer_profile("a", 0.01)
    noisy = dataclasses.replace(
        profile.layers[0],
        samples=(
            LayerSample(micro_batch_size=1, step_time_s=0.02),
            LayerSample(micro_batch_size=2, step_time_s=0.01),
            LayerSample(micro_batch_size=4, step_time_s=0.04),
        ),
    )
    profile = dataclasses.replace(profile, layers=(noisy, *profile.layers[1:]))
    plan = _plan(
        [Pipeline(stages=(_stage(0, "a", 0, 0), _stage(1, "a", 1, 3)), micro_batch_size=1, num_micro_batches=1)]
    )
    # Pooled: sizes 1 and 2 both take 0.015 s.
    assert predict_pipeline(plan, [profile]).rank_compute_time_s[0] == pytest.approx(0.015)


def test_predicting_without_a_fitting_layer_profile_is_a_value_error():
    with pytest.raises(ValueError, match=r"at ZeRO stage 1 for every device type of the plan, found none for a, b"):
        predict_pipeline(dataclasses.replace(PLAN, zero_stage=1), PROFILES)
    with pytest.raises(
        ValueError, match=r"expected 4 layers \(the plan's num_layers\), found 6 in the layer profile of a$"
    ):
        predict_pipeline(PLAN, [layer_profile("a", 0.01, num_layers=6), layer_profile("b", 0.02, num_layers=6)])
    with pytest.raises(ValueError, match=r"one layer profile per \(device type, ZeRO stage\), found two for 'a'"):
        predict_pipeline(PLAN, [*PROFILES, layer_profile("a", 0.03)])


def test_two_models_layer_profiles_of_one_type_are_named_as_two_models_with_the_option_that_picks_one():
    # A folder of layers/ with a model profiled twice (another dropout: another fingerprint, the same name
    # "pipeline") was refused as "found two for 'a' at stage 0", no model named, no word of --model.
    other = ModelInfo(name="toy", fingerprint="sha256:other", num_parameters=10_000, dtype="float32")
    again = [dataclasses.replace(p, model=other) for p in PROFILES]
    with pytest.raises(ValueError) as error:
        predict_pipeline(PLAN, [*PROFILES, *again])
    assert str(error.value) == (
        "layer_profiles: expected layer profiles of one model, found 2: toy (sha256:other), toy (sha256:toy) "
        "(poplar-search: --model NAME or FINGERPRINT picks one)"
    )


def test_each_stage_blocks_are_its_layers_times_at_its_pipelines_micro_batch():
    from poplar_ext.search.pipeline_cost import stage_block_times

    blocks = stage_block_times(PLAN, PROFILES)
    # Rank 0 (a): layers 0-2 at micro-batch 2 take (1 + 2 + 3) x 0.01 x 2; their optimizer 0.001 x (1 + 2 + 3).
    assert blocks[0] == {"compute_s": pytest.approx(0.12), "recompute_s": 0.0, "optimizer_step_s": pytest.approx(0.006)}
    # Rank 2 (b): layer 3 at micro-batch 2; rank 1 (a): every layer at micro-batch 4.
    assert blocks[2]["compute_s"] == pytest.approx(4 * 0.02 * 2)
    assert blocks[1] == {
        "compute_s": pytest.approx(10 * 0.01 * 4),
        "recompute_s": 0.0,
        "optimizer_step_s": pytest.approx(0.010),
    }
