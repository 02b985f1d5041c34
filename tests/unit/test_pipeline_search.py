"""The pipeline search (poplar_ext.search.pipeline_search and its parts): exact against brute force, the
heuristic where it
must be exact, the sizing and the split against enumeration, infeasible statuses, bad input, check_pipeline_plan."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from _pipeline_brute_force import brute_force, ordered_partitions

from poplar_bench.synthetic import SYNTHETIC_LAYERED_MODEL, random_layer_profiles, simple_cluster
from poplar_ext.plan.formats import Cluster, ClusterNode, DeviceGroup
from poplar_ext.plan.pipeline_formats import (
    LayerCost,
    LayerProfile,
    LayerSample,
    pipeline_plan_from_dict,
    pipeline_plan_to_dict,
)
from poplar_ext.search.network import modelled_network
from poplar_ext.search.pipeline_cost import Links, layer_table, predict_pipeline
from poplar_ext.search.pipeline_layouts import all_layouts, candidate_layouts
from poplar_ext.search.pipeline_search import check_pipeline_plan, search_pipeline_plan
from poplar_ext.search.pipeline_sizing import PipelineOptions, size_pipelines
from poplar_ext.search.pipeline_split import Shape, balanced_split, split_costs


def _case(seed: int):
    """A random small cluster (2-3 ranks of two types, 1 or 2 per node), model, network and batch."""
    rng = np.random.default_rng(seed)
    num_layers = int(rng.integers(2, 5))
    profiles = random_layer_profiles(rng, ["a", "b"], num_layers=num_layers)
    counts = {"a": int(rng.integers(1, 3)), "b": 1}
    cluster = simple_cluster(counts, ranks_per_node=int(rng.integers(1, 3)))
    network = (
        None
        if rng.random() < 0.3
        else modelled_network(
            bus_bandwidth_bytes_per_s=float(rng.uniform(1e8, 1e10)), latency_s=float(rng.uniform(0, 1e-3)), note="t"
        )
    )
    return profiles, cluster, network, int(rng.integers(cluster.world_size, 7))


def _time(result) -> float:
    return result.plan.predicted.iteration_time_s if result.ok else np.inf


# Seeds whose optimum has multi-stage pipelines split unevenly (9, 20, 29, 36, 41, 53), or not (0, 11).
@pytest.mark.parametrize("seed", [0, 9, 11, 20, 29, 36, 41, 53])
def test_the_exact_search_reaches_the_brute_force_optimum(seed):
    profiles, cluster, network, batch = _case(seed)
    best, _ = brute_force(profiles, cluster, batch, network=network)
    result = search_pipeline_plan(profiles, cluster, global_batch_size=batch, network=network, method="exact")
    assert result.method == "exact" and np.isfinite(best) == result.ok
    if result.ok:
        assert _time(result) == pytest.approx(best, rel=1e-9)
        assert check_pipeline_plan(result.plan, cluster, profiles) == []
        assert predict_pipeline(result.plan, profiles, network, cluster=cluster).iteration_time_s == pytest.approx(
            _time(result), rel=1e-12
        )


@pytest.mark.parametrize("layouts", ["all", "candidates"])
@pytest.mark.parametrize("seed", range(8))
def test_the_heuristic_is_exact_on_two_ranks_when_only_the_pipelines_time_counts(seed, layouts):
    # Two ranks: the candidate layouts are all layouts. No network, no optimizer step: the boundary is 0,
    # so the balanced split for each count in flight (exact for a pipeline's time) is the whole optimum.
    # Odd seeds: neither device holds the whole model, so the two-stage pipeline and its order decide.
    rng = np.random.default_rng(100 + seed)
    profiles = random_layer_profiles(rng, ["a", "b"], num_layers=int(rng.integers(2, 6)))
    profiles = [
        dataclasses.replace(
            p,
            memory_capacity_bytes=10**15
            if seed % 2 == 0
            else p.base_memory_bytes
            + 3 * sum(x.parameter_bytes + x.optimizer_state_bytes for x in p.layers) // 4
            + 8 * sum(x.activation_bytes_per_sample for x in p.layers),
            layers=tuple(dataclasses.replace(x, optimizer_step_time_s=0.0) for x in p.layers),
        )
        for p in profiles
    ]
    types = ["a", "a"] if seed % 4 == 0 else ["a", "b"]
    cluster = simple_cluster({t: types.count(t) for t in dict.fromkeys(types)}, ranks_per_node=1)
    batch = int(rng.integers(2, 40))
    exact, heuristic = (
        search_pipeline_plan(profiles, cluster, global_batch_size=batch, method=method, layouts=layouts)
        for method in ("exact", "heuristic")
    )
    assert heuristic.method == "heuristic" and exact.ok
    assert _time(heuristic) == pytest.approx(_time(exact), rel=1e-9)


def _two_layers(device_type: str, seconds_per_work: float, works=(1.0, 4.0), kept=1000, capacity=None):
    """Two layers of `works`; each layer's parameters and optimizer state 1e6 bytes: one fits a device, two do not."""
    layers = tuple(
        LayerCost(
            index=i,
            name="Block",
            samples=tuple(LayerSample(micro_batch_size=b, step_time_s=work * seconds_per_work * b) for b in (1, 2)),
            parameter_bytes=250_000,
            optimizer_state_bytes=750_000,
            activation_bytes_per_sample=kept,
            output_bytes_per_sample=10,
            optimizer_step_time_s=0.0,
        )
        for i, work in enumerate(works)
    )
    return LayerProfile(
        device_type=device_type,
        memory_capacity_bytes=capacity or 1_500_000,
        zero_stage=0,
        model=SYNTHETIC_LAYERED_MODEL,
        layers=layers,
        base_memory_bytes=0,
        emulated=None,
        measured_with={"source": "modelled"},
    )


def test_the_stage_order_puts_the_heavy_layers_on_the_fast_device_whichever_rank_comes_first():
    # Rank 0 is fast, rank 1 slow; layer 1 is four times layer 0. Neither holds both layers.
    profiles = [_two_layers("fast", 0.001), _two_layers("slow", 0.004)]
    cluster = simple_cluster({"fast": 1, "slow": 1}, ranks_per_node=1)
    for layouts in ("all", "candidates"):
        result = search_pipeline_plan(profiles, cluster, global_batch_size=8, method="heuristic", layouts=layouts)
        (pipeline,) = result.plan.pipelines
        assert [(s.device_type, s.first_layer) for s in pipeline.stages] == [("slow", 0), ("fast", 1)]


def test_a_pipeline_that_memory_holds_to_one_micro_batch_in_flight_is_found():
    # Each stage holds one layer and room for 1000 bytes of activations: one micro-batch of one sample in
    # flight, never the two that 1F1B keeps on the first of two stages once there are two micro-batches.
    profiles = [_two_layers("a", 0.001, kept=1000, capacity=1_001_000)]
    cluster = simple_cluster({"a": 2}, ranks_per_node=2)
    for method in ("exact", "heuristic"):
        result = search_pipeline_plan(profiles, cluster, global_batch_size=1, method=method)
        (pipeline,) = result.plan.pipelines
        assert len(pipeline.stages) == 2 and (pipeline.micro_batch_size, pipeline.num_micro_batches) == (1, 1)
    assert not search_pipeline_plan(profiles, cluster, global_batch_size=2).ok


def _enumerated_sizing(classes, batch):
    """Smallest slowest-pipeline time over every (b, m) of every pipeline summing to `batch`."""
    per_pipeline = []
    for c in classes:
        options = [
            (int(b), m, (m + c.num_stages - 1) * float(t))
            for b, t, limit in zip(c.sizes, c.stage_s, c.max_micro_batches)
            for m in range(1, min(int(limit), batch // int(b)) + 1)
        ]
        per_pipeline += [options] * c.count
    best = np.inf
    for combo in itertools.product(*per_pipeline):
        if sum(b * m for b, m, _ in combo) == batch:
            best = min(best, max(t for _, _, t in combo))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_sizing_finds_the_smallest_time_that_sums_exactly_to_the_batch(seed):
    rng = np.random.default_rng(seed)
    classes = []
    for _ in range(int(rng.integers(1, 3))):
        sizes = np.sort(rng.choice(np.arange(1, 7), size=int(rng.integers(1, 4)), replace=False)).astype(np.int64)
        classes.append(
            PipelineOptions(
                num_stages=int(rng.integers(1, 4)),
                sizes=sizes,
                stage_s=np.sort(rng.uniform(0.01, 0.1, len(sizes))) * sizes / sizes[0],
                max_micro_batches=rng.integers(1, 6, len(sizes)),
                count=int(rng.integers(1, 3)),
            )
        )
    batch = int(rng.integers(sum(c.count for c in classes), 16))
    expected = _enumerated_sizing(classes, batch)
    sizing = size_pipelines(classes, batch)
    if not np.isfinite(expected):
        assert sizing is None
        return
    assert sizing.time_s == pytest.approx(expected, rel=1e-12)
    picks = [pick for choice in sizing.choices for pick in choice]
    assert sum(b * m for b, m in picks) == batch
    assert [len(choice) for choice in sizing.choices] == [c.count for c in classes]


@pytest.mark.parametrize("seed", range(4))
def test_the_balanced_split_is_the_best_split_that_fits(seed):
    rng = np.random.default_rng(seed)
    profiles = random_layer_profiles(rng, ["a", "b"], num_layers=6)
    # Activations only, room for two samples' worth: at size 1 a split fits, at size 8 none can (stage 0
    # keeps 3 micro-batches, stage 1 two, stage 2 one: 8 x (3 k0 + 2 k1 + k2) > 2 x (k0 + k1 + k2)).
    profiles = [
        dataclasses.replace(
            p,
            memory_capacity_bytes=p.base_memory_bytes + 2 * sum(x.activation_bytes_per_sample for x in p.layers),
            layers=tuple(dataclasses.replace(x, parameter_bytes=0, optimizer_state_bytes=0) for x in p.layers),
        )
        for p in profiles
    ]
    tables = {p.device_type: layer_table(p, 8) for p in profiles}
    network = modelled_network(bus_bandwidth_bytes_per_s=1e8, latency_s=1e-4, note="t")
    # Three nodes, the middle one's uplink slow: each boundary's link its own price.
    links = Links(network=network, rank_nodes=(0, 1, 2), node_uplinks_bytes_per_s=(1e8, 1e6, 1e8))
    types = tuple(rng.choice(["a", "b"], 3))
    shape = Shape(
        device_types=types, transfer_prices=links.transfer_prices((0, 1, 2) if rng.integers(2) else (0, 2, 1))
    )
    sizes = np.arange(1, 9, dtype=np.int64)
    found = balanced_split(shape, tables, sizes)
    for index in range(len(sizes)):
        best = np.inf
        for cut, checkpointing in itertools.product(
            itertools.combinations(range(1, 6), 2), itertools.product((False, True), repeat=3)
        ):
            slowest, limit = split_costs(shape, (0, *cut), tables, sizes[index : index + 1], checkpointing)
            if limit[0] >= 3:  # fits S - s in flight on every stage
                best = min(best, float(slowest[0]))
        assert found.slowest_stage_s[index] == pytest.approx(best, rel=1e-12)
        if np.isfinite(best):
            priced = [
                split_costs(shape, found.first_layers(index), tables, sizes[index : index + 1], checkpointing)
                for checkpointing in itertools.product((False, True), repeat=3)
            ]
            assert min(slowest[0] for slowest, limit in priced if limit[0] >= 3) == pytest.approx(best, rel=1e-12)
    assert np.isfinite(found.slowest_stage_s[0]) and not np.isfinite(found.slowest_stage_s[-1]), "memory decides"


def test_layouts_hold_every_rank_once_and_the_exact_list_is_complete():
    cluster = simple_cluster({"a": 2, "b": 2}, ranks_per_node=2)
    exact = all_layouts(cluster, max_stages=4)
    # Every ordered partition of the 4 ranks, counted once per arrangement of the two interchangeable pairs.
    labels = "aabb"
    distinct = {
        tuple(sorted(tuple(labels[r] for r in p) for p in partition)) for partition in ordered_partitions([0, 1, 2, 3])
    }
    assert len(list(ordered_partitions([0, 1, 2, 3]))) == 73 and len(exact) == len(distinct) == 21
    assert {tuple(sorted(tuple(labels[r] for r in p) for p in layout)) for layout in exact} == distinct
    large = simple_cluster({"a": 12, "b": 20}, ranks_per_node=4)
    three = simple_cluster({"a": 3, "b": 2, "c": 4}, ranks_per_node=2)
    for layout in [*exact, *candidate_layouts(large, max_stages=16), *candidate_layouts(three, max_stages=9)]:
        ranks = sorted(r for pipeline in layout for r in pipeline)
        assert ranks == list(range(len(ranks)))
    shapes = {tuple(sorted(len(p) for p in layout)) for layout in candidate_layouts(large, max_stages=16)}
    # homogeneous (a in 3 pipelines of 4, b in 5 of 4); 4 alike mixed; 3 mixed and the left-over b's beside;
    # the left-over b's spread over the first pipelines.
    assert {(4,) * 8, (8,) * 4, (2, 10, 10, 10), (10, 11, 11)} <= shapes
    # Three types: mixed pipelines of two of them beside the third's own, e.g. a and c paired, b alone.
    types = three.rank_device_types
    compositions = {
        tuple(sorted("".join(sorted(types[r] for r in p)) for p in layout))
        for layout in candidate_layouts(three, max_stages=9)
    }
    assert ("ac", "ac", "acc", "b", "b") in compositions and ("aaabbcccc",) in compositions


def _small():
    rng = np.random.default_rng(7)
    return random_layer_profiles(rng, ["a", "b"], num_layers=4, zero_stages=(0, 1)), simple_cluster({"a": 2, "b": 1})


def test_a_plan_that_cannot_be_made_is_a_status_with_its_reason():
    profiles, cluster = _small()
    tiny = [dataclasses.replace(p, memory_capacity_bytes=p.base_memory_bytes + 1) for p in profiles]
    result = search_pipeline_plan(tiny, cluster, global_batch_size=4)
    assert result.status == "infeasible" and result.plan is None
    assert "do the stages fit the devices' memory" in result.message
    refused = search_pipeline_plan(profiles, cluster, global_batch_size=4, zero_stage=2)
    assert not refused.ok and "DeepSpeed's pipeline engine refuses ZeRO stage 2" in refused.message


def test_an_infeasible_pipeline_search_names_the_type_that_holds_no_stage():
    profiles, cluster = _small()
    only_b_tiny = [
        dataclasses.replace(p, memory_capacity_bytes=p.base_memory_bytes + 1) if p.device_type == "b" else p
        for p in profiles
    ]
    result = search_pipeline_plan(only_b_tiny, cluster, global_batch_size=4, zero_stage=0)
    assert result.status == "infeasible"
    assert "do the stages fit the devices' memory" in result.message
    assert " b holds no stage: its smallest, one layer of one sample, needs " in result.message
    assert " a holds no stage" not in result.message


def test_auto_evaluates_both_stages_and_keeps_the_faster():
    profiles, cluster = _small()
    slower = [
        dataclasses.replace(
            p,
            layers=tuple(
                dataclasses.replace(
                    x,
                    samples=tuple(dataclasses.replace(s, step_time_s=2 * s.step_time_s) for s in x.samples),
                )
                for x in p.layers
            ),
        )
        if p.zero_stage == 1
        else p
        for p in profiles
    ]
    result = search_pipeline_plan(slower, cluster, global_batch_size=6)
    assert result.ok and result.zero_stage == 0 and result.plan.zero_stage == 0
    assert [(r.zero_stage, r.status) for r in result.stage_reports] == [(0, "chosen"), (1, "slower")]
    assert "lower predicted throughput than stage 0" in result.stage_reports[1].reason


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(global_batch_size=0), r"global_batch_size: expected an integer from 1 to"),
        (dict(zero_stage=5), r"zero_stage: expected 'auto' or one of 0, 1"),
        (dict(method="fast"), r"method: expected one of 'auto', 'exact', 'heuristic', found 'fast'"),
        (dict(max_stages=0), r"max_stages: expected None or an integer >= 1, found 0"),
    ],
)
def test_bad_arguments_are_value_errors(change, match):
    profiles, cluster = _small()
    with pytest.raises(ValueError, match=match):
        search_pipeline_plan(profiles, cluster, **{"global_batch_size": 4, **change})


def test_a_device_type_without_layer_profiles_is_a_value_error():
    profiles, _ = _small()
    cluster = simple_cluster({"a": 1, "c": 1})
    with pytest.raises(ValueError, match=r"found 'c' with no layer profile"):
        search_pipeline_plan(profiles, cluster, global_batch_size=4)
    with pytest.raises(ValueError, match=r"'exact' searches at most 6 ranks"):
        search_pipeline_plan(profiles, simple_cluster({"a": 7}), global_batch_size=8, method="exact")


def test_check_pipeline_plan_names_what_does_not_fit_the_cluster():
    profiles, cluster = _small()
    plan = search_pipeline_plan(profiles, cluster, global_batch_size=6).plan
    assert check_pipeline_plan(plan, cluster, profiles) == []
    other = Cluster(nodes=(ClusterNode(name="n", devices=(DeviceGroup(device_type="b", count=4),)),))
    problems = check_pipeline_plan(plan, other)
    assert "The plan has 3 ranks but the cluster has 4." in problems
    assert any(
        p.startswith("Device types differ from the cluster's at rank 0 (a in the plan, b in the cluster)")
        for p in problems
    )
    cramped = [dataclasses.replace(p, memory_capacity_bytes=p.base_memory_bytes + 10) for p in profiles]
    (problem,) = check_pipeline_plan(plan, cluster, cramped)
    assert problem.startswith("Stages do not fit their device's memory") and "pipeline 0 stage 0 (rank" in problem
    fewer = random_layer_profiles(np.random.default_rng(1), ["a", "b"], num_layers=3)
    assert check_pipeline_plan(plan, cluster, fewer) == [
        "The plan has 4 layers, but the layer profiles of a (3), b (3) have another number."
    ]
    short = dataclasses.replace(plan, global_batch_size=plan.global_batch_size + 1)
    assert check_pipeline_plan(short, cluster) == [
        "The pipelines run 6 samples per iteration, but the global batch is 7."
    ]


def test_a_heuristic_plan_of_a_larger_cluster_is_a_valid_plan_file():
    rng = np.random.default_rng(3)
    profiles = random_layer_profiles(rng, ["a", "b"], num_layers=8)
    cluster = simple_cluster({"a": 8, "b": 8}, ranks_per_node=4)
    network = modelled_network(bus_bandwidth_bytes_per_s=1e9, latency_s=1e-5, note="t")
    result = search_pipeline_plan(profiles, cluster, global_batch_size=96, network=network)
    assert result.ok and result.method == "heuristic" and result.layouts_evaluated > 10
    assert check_pipeline_plan(result.plan, cluster, profiles) == []
    assert pipeline_plan_from_dict(pipeline_plan_to_dict(result.plan)) == result.plan
    predicted = predict_pipeline(result.plan, profiles, network, cluster=cluster)
    assert predicted.iteration_time_s == pytest.approx(result.plan.predicted.iteration_time_s, rel=1e-12)
    # Every pipeline finishes within one micro-batch of its slowest stage of the slowest one.
    slowest = max(predicted.pipeline_time_s)
    for pipeline, time_s in zip(result.plan.pipelines, predicted.pipeline_time_s):
        stage = max(predicted.rank_stage_time_s[r] for r in pipeline.ranks)
        assert time_s > slowest - stage - 1e-12


def test_layer_profiles_of_different_depths_are_refused_naming_which():
    # Made in Python, the layer profiles have no files: the message names each count's types and stages.
    from poplar_ext.search.pipeline_cost import layer_profiles_by_stage

    rng = np.random.default_rng(0)
    five = random_layer_profiles(rng, ["a"], num_layers=5, zero_stages=(0, 1))
    six = random_layer_profiles(rng, ["b"], num_layers=6, zero_stages=(0,))
    six = [dataclasses.replace(p, model=five[0].model) for p in six]  # one model: only the depth differs
    with pytest.raises(
        ValueError,
        match=r"expected the same number of layers in every layer profile, found \[5, 6\]: 5 in a at stage 0, a at "
        r"stage 1; 6 in b at stage 0$",
    ):
        layer_profiles_by_stage([*five, *six])


def test_layer_profiles_of_different_depths_name_their_files(tmp_path):
    from poplar_ext.plan.pipeline_formats import load_layer_profiles, save_layer_profile
    from poplar_ext.search.pipeline_cost import layer_profiles_by_stage

    rng = np.random.default_rng(0)
    five = random_layer_profiles(rng, ["a"], num_layers=5, zero_stages=(0,))
    six = random_layer_profiles(rng, ["b"], num_layers=6, zero_stages=(0,))
    six = [dataclasses.replace(p, model=five[0].model) for p in six]
    for name, profile in (("a.json", five[0]), ("b.json", six[0])):
        save_layer_profile(profile, tmp_path / name)
    with pytest.raises(ValueError) as refused:
        layer_profiles_by_stage(load_layer_profiles(tmp_path))
    assert str(refused.value).endswith(
        f"5 in a at stage 0; 6 in b at stage 0; the files: 5 layers: {tmp_path / 'a.json'}; "
        f"6 layers: {tmp_path / 'b.json'}"
    )
