"""The pipeline formats: pipeline plans and layer profiles, read, written and refused with the field named."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import Cluster, ClusterNode, DeviceGroup, ModelInfo, Plan, plan_from_dict
from poplar_ext.plan.pipeline_formats import (
    LayerCost,
    LayerProfile,
    LayerSample,
    PipelinePlan,
    any_plan_from_dict,
    cluster_problems,
    layer_profile_from_dict,
    layer_profile_to_dict,
    load_any_plan,
    load_layer_profiles,
    pipeline_plan_from_dict,
    pipeline_plan_to_dict,
    save_layer_profile,
    save_pipeline_plan,
)

PREDICTED = {"iteration_time_s": 1.0, "samples_per_s": 20.0, "ideal_samples_per_s": 25.0}


def _stage(rank, device_type, first, last):
    return {"rank": rank, "device_type": device_type, "first_layer": first, "last_layer": last}


def _plan() -> dict:
    """A 2-stage pipeline (ranks 0 and 2, split 3 + 1 layers) beside a 1-stage one (rank 1)."""
    return {
        "schema_version": 1,
        "parallelism": "pipeline",
        "policy": "poplar",
        "zero_stage": 1,
        "global_batch_size": 20,
        "num_layers": 4,
        "pipelines": [
            {"stages": [_stage(0, "a", 0, 2), _stage(2, "b", 3, 3)], "micro_batch_size": 2, "num_micro_batches": 6},
            {"stages": [_stage(1, "a", 0, 3)], "micro_batch_size": 4, "num_micro_batches": 2},
        ],
        "predicted": PREDICTED,
        "profile_fingerprints": {"a": "sha256:1"},
    }


def test_a_pipeline_plan_reads_back_what_was_written(tmp_path):
    plan = pipeline_plan_from_dict(_plan())
    assert plan.world_size == 3 and plan.rank_device_types == ("a", "a", "b")
    assert plan.place_of(2) == (0, 1) and plan.place_of(1) == (1, 0)
    assert plan.pipelines[0].boundaries == (0, 3, 4) and plan.pipelines[0].samples_per_iteration == 12
    save_pipeline_plan(plan, tmp_path / "plan.json")
    assert load_any_plan(tmp_path / "plan.json") == plan
    assert pipeline_plan_to_dict(plan) == json.loads((tmp_path / "plan.json").read_text())


def test_a_plan_says_what_it_trains_and_each_kind_is_read_by_its_own_reader():
    assert isinstance(any_plan_from_dict(_plan()), PipelinePlan)
    zero = {
        "schema_version": 1,
        "policy": "poplar",
        "zero_stage": 1,
        "global_batch_size": 4,
        "ranks": [{"rank": 0, "device_type": "a", "micro_batch_size": 2, "gradient_accumulation_steps": 2}],
        "predicted": PREDICTED,
        "profile_fingerprints": {},
    }
    assert isinstance(any_plan_from_dict(zero), Plan)
    assert isinstance(plan_from_dict({**zero, "parallelism": "zero"}), Plan)
    with pytest.raises(FormatError, match=r"p.json: parallelism: expected one of 'zero', found string 'pipeline'"):
        plan_from_dict(_plan(), source="p.json")
    # Where either kind is read, a misspelt parallelism is told both kinds, not the ZeRO reader's one.
    for plan in ({**_plan(), "parallelism": "pipelines"}, {**zero, "parallelism": "Zero"}):
        with pytest.raises(FormatError, match=r"parallelism: expected one of 'zero', 'pipeline', found string"):
            any_plan_from_dict(plan, source="p.json")


def test_either_kind_of_plan_is_held_to_its_cluster_by_one_check():
    pipelines = pipeline_plan_from_dict(_plan())  # ranks a, a, b
    ranks = [
        {"rank": r, "device_type": t, "micro_batch_size": 4, "gradient_accumulation_steps": 1}
        for r, t in enumerate("aab")
    ]
    zero = plan_from_dict(
        {
            "schema_version": 1,
            "policy": "poplar",
            "zero_stage": 1,
            "global_batch_size": 12,
            "ranks": ranks,
            "predicted": PREDICTED,
            "profile_fingerprints": {},
        }
    )
    assert zero.rank_device_types == pipelines.rank_device_types == ("a", "a", "b")
    fits = Cluster(
        nodes=(
            ClusterNode(
                name="n", devices=(DeviceGroup(device_type="a", count=2), DeviceGroup(device_type="b", count=1))
            ),
        )
    )
    other = Cluster(nodes=(ClusterNode(name="n", devices=(DeviceGroup(device_type="b", count=4),)),))
    for plan in (zero, pipelines):
        assert cluster_problems(plan, fits) == []
        assert cluster_problems(plan, other) == [
            "The plan has 3 ranks but the cluster has 4.",
            "Device types differ from the cluster's at rank 0 (a in the plan, b in the cluster), "
            "rank 1 (a in the plan, b in the cluster).",
        ]
    # A pipeline plan built in code may leave out a rank: said before the types, which need every rank.
    first = pipelines.pipelines[0]
    missing = dataclasses.replace(pipelines, pipelines=(first,))
    assert cluster_problems(missing, fits) == ["The plan's stages do not hold every rank from 0 to 1 exactly once."]


def _broken(change) -> dict:
    data = copy.deepcopy(_plan())
    change(data)
    return data


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda d: d["pipelines"][0]["stages"][1].update(first_layer=2),
            r"pipelines\[0\]\.stages\[1\]\.first_layer: expected 3 \(the stages cover the layers in order",
        ),
        (
            lambda d: d["pipelines"][0]["stages"][1].update(last_layer=2, first_layer=3),
            r"pipelines\[0\]\.stages\[1\]\.last_layer: expected .*(a layer at or after first_layer \(3\)|3)",
        ),
        (
            lambda d: d["pipelines"][1]["stages"][0].update(last_layer=2),
            r"pipelines\[1\]\.stages\[0\]\.last_layer: expected 3, the model's last layer",
        ),
        (
            lambda d: d["pipelines"][1]["stages"][0].update(rank=0),
            r"pipelines: expected every rank from 0 to 2 in exactly one stage \(missing: \[1\], "
            r"in more than one stage: \[0\]\)",
        ),
        (lambda d: d.update(zero_stage=2), r"zero_stage: expected ZeRO stage 0 or 1 \(DeepSpeed's pipeline engine"),
        (
            lambda d: d.update(global_batch_size=21),
            r"global_batch_size: expected the sum over pipelines of micro_batch_size \* num_micro_batches \(20\)",
        ),
        (lambda d: d["pipelines"][0].update(num_micro_batches=0), r"pipelines\[0\]\.num_micro_batches: expected"),
        (lambda d: d.update(parallelism="tensor"), r"parallelism: expected one of 'pipeline'"),
    ],
)
def test_a_bad_pipeline_plan_is_refused_naming_the_file_and_field(change, match):
    with pytest.raises(FormatError, match=r"^plan\.json: " + match):
        pipeline_plan_from_dict(_broken(change), source="plan.json")


def test_many_misplaced_ranks_are_refused_with_a_short_message():
    # 4096 one-stage pipelines on ranks 0..2047, each twice: the message shows a few ranks of each list, not all.
    data = _plan()
    one = {"stages": [_stage(0, "a", 0, 3)], "micro_batch_size": 1, "num_micro_batches": 1}
    data["pipelines"] = [copy.deepcopy(one) for _ in range(4096)]
    for index, pipeline in enumerate(data["pipelines"]):
        pipeline["stages"][0]["rank"] = index // 2
    with pytest.raises(FormatError) as caught:
        pipeline_plan_from_dict(data, source="plan.json")
    message = str(caught.value)
    assert len(message) < 500, message[:500]
    assert "(missing: [2048, 2049, 2050, " in message and "(2048 ranks)" in message
    assert "in more than one stage: [0, 1, 2, " in message


def _layer_profile(device_type="a", zero_stage=0) -> LayerProfile:
    layer = LayerCost(
        index=0,
        name="Block",
        samples=(LayerSample(micro_batch_size=1, step_time_s=0.01), LayerSample(micro_batch_size=4, step_time_s=0.03)),
        parameter_bytes=4096,
        optimizer_state_bytes=8192,
        activation_bytes_per_sample=1000,
        output_bytes_per_sample=256,
        optimizer_step_time_s=0.001,
    )
    return LayerProfile(
        device_type=device_type,
        memory_capacity_bytes=10**9,
        zero_stage=zero_stage,
        model=ModelInfo(name="toy", fingerprint="sha256:x", num_parameters=1024, dtype="float32"),
        layers=(layer, LayerCost(**{**layer.__dict__, "index": 1})),
        base_memory_bytes=10**6,
        emulated=None,
        measured_with={"source": "modelled"},
    )


def test_layer_profiles_live_in_the_layers_folder_of_a_profile_directory(tmp_path):
    profile = _layer_profile()
    save_layer_profile(profile, tmp_path / "layers" / "toy-a-zero0.json")
    assert load_layer_profiles(tmp_path) == [profile] == load_layer_profiles(tmp_path / "layers")
    assert layer_profile_from_dict(layer_profile_to_dict(profile)) == profile
    with pytest.raises(FormatError, match="expected a directory of layer profiles, found no such directory"):
        load_layer_profiles(tmp_path / "nowhere")
    with pytest.raises(FormatError, match="expected a directory of layer profiles, found a file"):
        load_layer_profiles(tmp_path / "layers" / "toy-a-zero0.json")
    file = tmp_path / "layers" / "toy-a-zero0.json"
    with pytest.raises(FormatError, match=f"found a path under the file {file}"):  # --profiles FILE: FILE/layers
        load_layer_profiles(file / "layers")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: d["layers"][1].update(index=0), r"layers\[1\]\.index: expected 1 \(layers listed in order from 0\)"),
        (lambda d: d.update(zero_stage=3), r"zero_stage: expected ZeRO stage 0 or 1"),
        (
            lambda d: d["layers"][0]["samples"][1].update(micro_batch_size=1),
            r"layers\[0\]\.samples\[1\]\.micro_batch_size: expected a micro_batch_size larger",
        ),
        (lambda d: d["layers"][0].update(output_bytes_per_sample=-1), r"layers\[0\]\.output_bytes_per_sample"),
        (lambda d: d["measured_with"].update(source="guessed"), r"measured_with\.source: expected one of"),
    ],
)
def test_a_bad_layer_profile_is_refused_naming_the_field(change, match):
    data = layer_profile_to_dict(_layer_profile())
    change(data)
    with pytest.raises(FormatError, match=r"^l\.json: " + match):
        layer_profile_from_dict(data, source="l.json")


@pytest.mark.parametrize("version", [1.0, None, "1", True, 1.5])
@pytest.mark.parametrize("kind", ["pipeline plan", "layer profile"])
def test_a_pipeline_format_wants_an_integer_schema_version(kind, version):
    if kind == "pipeline plan":
        data, read = _plan(), pipeline_plan_from_dict
    else:
        data, read = layer_profile_to_dict(_layer_profile()), layer_profile_from_dict
    data["schema_version"] = version
    with pytest.raises(FormatError, match=r"^f\.json: schema_version: expected an integer, found "):
        read(data, source="f.json")
    data["schema_version"] = 2
    with pytest.raises(FormatError, match=r"^f\.json: schema_version: expected schema_version 1, found number 2$"):
        read(data, source="f.json")
