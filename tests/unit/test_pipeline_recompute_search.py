"""Activation checkpointing per pipeline stage (issue 34): the plan's field, its price in the cost model, the
search choosing it where a stage does not fit without it, its place in poplar-search's output."""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
from _pipeline_brute_force import brute_force

from poplar_bench.synthetic import simple_cluster
from poplar_ext.hardware.emulation import PIPELINE_BACKWARD_KEY, PIPELINE_FORWARD_KEY, pipeline_reference
from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import ModelInfo, Prediction, write_json_atomic
from poplar_ext.plan.pipeline_formats import (
    LayerCost,
    LayerProfile,
    LayerSample,
    Pipeline,
    PipelinePlan,
    PipelineStage,
    layer_profiles_dir,
    pipeline_plan_from_dict,
    pipeline_plan_to_dict,
    save_layer_profile,
    save_pipeline_plan,
)
from poplar_ext.search.cli import main
from poplar_ext.search.pipeline_cost import RECOMPUTE_SHARE, predict_pipeline, stage_block_times
from poplar_ext.search.pipeline_drift import predict_drifted, recount_pipelines
from poplar_ext.search.pipeline_search import check_pipeline_plan, search_pipeline_plan

MODEL = ModelInfo(name="toy", fingerprint="sha256:toy", num_parameters=10_000, dtype="float32")
BASE = 1000
HEAD_BYTES = 10**6
"""Layer 3's parameters: more than the small type holds, so it is always the last stage's."""
KEPT = (100, 1000, 1000, 1000)
"""Activations kept per sample: layer 0's are small (its input is the data), the others' ten times more."""
OUTPUT = 10
SMALL_ROOM = 2500
"""What the small type holds beside its base: one sample of layers 0-2 checkpointed with 2 in flight
(100 + 2100 bytes), not without (2 x 2100), nor layers 0-1 without (2 x 1100 fits: 2200)."""


def _profile(device_type: str, seconds_per_sample: float, capacity: int) -> LayerProfile:
    layers = tuple(
        LayerCost(
            index=i,
            name="Block",
            samples=tuple(LayerSample(micro_batch_size=b, step_time_s=seconds_per_sample * b) for b in (1, 2, 4, 8)),
            parameter_bytes=HEAD_BYTES if i == 3 else 0,
            optimizer_state_bytes=0,
            activation_bytes_per_sample=KEPT[i],
            output_bytes_per_sample=OUTPUT,
            optimizer_step_time_s=0.0,
        )
        for i in range(4)
    )
    return LayerProfile(
        device_type=device_type,
        memory_capacity_bytes=capacity,
        zero_stage=0,
        model=MODEL,
        layers=layers,
        base_memory_bytes=BASE,
        emulated=None,
        measured_with={"source": "modelled"},
    )


# "small" is fast (10 ms per layer and sample) with little memory; "big" slower (35 ms) with plenty.
PROFILES = [_profile("small", 0.01, BASE + SMALL_ROOM), _profile("big", 0.035, 10**9)]
CLUSTER = simple_cluster({"small": 1, "big": 1}, ranks_per_node=2)
BATCH = 8


def _plan(pipelines: list[Pipeline]) -> PipelinePlan:
    return PipelinePlan(
        policy="poplar",
        zero_stage=0,
        global_batch_size=sum(p.samples_per_iteration for p in pipelines),
        num_layers=4,
        pipelines=tuple(pipelines),
        predicted=Prediction(iteration_time_s=1.0, samples_per_s=1.0, ideal_samples_per_s=1.0),
        profile_fingerprints={},
    )


def _stages(last_of_small: int, *, checkpointed: bool) -> tuple[PipelineStage, ...]:
    small = PipelineStage(
        rank=0, device_type="small", first_layer=0, last_layer=last_of_small, activation_checkpointing=checkpointed
    )
    return small, PipelineStage(rank=1, device_type="big", first_layer=last_of_small + 1, last_layer=3)


CHECKPOINTED = _plan([Pipeline(stages=_stages(2, checkpointed=True), micro_batch_size=1, num_micro_batches=8)])
PLAIN = _plan([Pipeline(stages=_stages(2, checkpointed=False), micro_batch_size=1, num_micro_batches=8)])


# ----------------------------------------------------------------------------------
# The format
# ----------------------------------------------------------------------------------
def test_the_field_is_written_only_where_true_and_old_plans_read_without_it(tmp_path):
    data = pipeline_plan_to_dict(CHECKPOINTED)
    stages = data["pipelines"][0]["stages"]
    assert stages[0]["activation_checkpointing"] is True and "activation_checkpointing" not in stages[1]
    assert pipeline_plan_from_dict(data) == CHECKPOINTED
    save_pipeline_plan(CHECKPOINTED, tmp_path / "plan.json")
    assert json.loads((tmp_path / "plan.json").read_text()) == data
    # A plan without the field (every plan before it) checkpoints nothing, and is written as it was.
    plain = pipeline_plan_to_dict(PLAIN)
    assert all("activation_checkpointing" not in s for p in plain["pipelines"] for s in p["stages"])
    assert not any(s.activation_checkpointing for s in pipeline_plan_from_dict(plain).pipelines[0].stages)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_checkpointing_that_is_not_true_or_false_is_refused_naming_the_field(value):
    data = copy.deepcopy(pipeline_plan_to_dict(CHECKPOINTED))
    data["pipelines"][0]["stages"][0]["activation_checkpointing"] = value
    if value is None:  # null reads as absent, as every optional field of the formats
        assert not pipeline_plan_from_dict(data).pipelines[0].stages[0].activation_checkpointing
        return
    with pytest.raises(FormatError, match=r"^plan\.json: pipelines\[0\]\.stages\[0\]\.activation_checkpointing: "):
        pipeline_plan_from_dict(data, source="plan.json")
    with pytest.raises(FormatError, match="expected true or false"):
        pipeline_plan_from_dict(data, source="plan.json")


# ----------------------------------------------------------------------------------
# The cost model
# ----------------------------------------------------------------------------------
def test_a_checkpointed_stage_keeps_its_inputs_and_runs_its_forward_again():
    plain, checkpointed = predict_pipeline(PLAIN, PROFILES), predict_pipeline(CHECKPOINTED, PROFILES)
    # Stage 0 keeps min(8, 2) = 2 micro-batches of 1 sample: all of layers 0-2's activations each, or
    # checkpointed its input each (the data: layer 0's kept 100 bytes) but the one recomputed, whose
    # activations are all there during its backward.
    assert plain.rank_memory_bytes[0] == BASE + 2 * sum(KEPT[:3])
    assert checkpointed.rank_memory_bytes[0] == BASE + 1 * KEPT[0] + sum(KEPT[:3])
    assert checkpointed.rank_memory_bytes[1] == plain.rank_memory_bytes[1]
    # The recompute: a forward, a third of the layers' 3 x 10 ms, per micro-batch; the last stage unchanged.
    assert RECOMPUTE_SHARE == pytest.approx(1 / 3)
    assert checkpointed.rank_recompute_time_s == pytest.approx((8 * 0.01, 0.0))
    assert checkpointed.rank_compute_time_s[0] == pytest.approx(plain.rank_compute_time_s[0] + 8 * 0.01)
    assert checkpointed.rank_activation_checkpointing == (True, False)
    assert plain.rank_recompute_time_s == (0.0, 0.0)
    # The slowest stage is now the checkpointed one: (8 + 2 - 1) x 40 ms, not x 35 ms.
    assert plain.iteration_time_s == pytest.approx(9 * 0.035)
    assert checkpointed.iteration_time_s == pytest.approx(9 * 0.04)


def test_a_later_stages_input_is_the_previous_layers_output():
    stages = (
        PipelineStage(rank=0, device_type="big", first_layer=0, last_layer=0),
        PipelineStage(rank=1, device_type="small", first_layer=1, last_layer=3, activation_checkpointing=True),
    )
    profiles = [_profile("small", 0.01, 10**9), PROFILES[1]]
    plan = _plan([Pipeline(stages=stages, micro_batch_size=2, num_micro_batches=4)])
    # The last stage keeps 1 micro-batch in flight: the recomputed one; a 3-stage pipeline's middle keeps 2.
    assert predict_pipeline(plan, profiles).rank_memory_bytes[1] == BASE + HEAD_BYTES + 2 * sum(KEPT[1:])
    three = _plan(
        [
            Pipeline(
                stages=(stages[0], dataclasses.replace(stages[1], last_layer=2), _three_last()),
                micro_batch_size=2,
                num_micro_batches=4,
            )
        ]
    )
    memory = predict_pipeline(three, [*profiles, _profile("other", 0.01, 10**9)]).rank_memory_bytes[1]
    assert memory == BASE + 2 * (1 * OUTPUT + KEPT[1] + KEPT[2])


def _three_last() -> PipelineStage:
    return PipelineStage(rank=2, device_type="other", first_layer=3, last_layer=3)


def test_emulated_stages_run_the_recompute_in_their_backward():
    blocks = stage_block_times(CHECKPOINTED, PROFILES)
    assert blocks[0]["compute_s"] == pytest.approx(0.03) and blocks[0]["recompute_s"] == pytest.approx(0.01)
    assert blocks[1]["recompute_s"] == 0.0
    reference = pipeline_reference(
        stage_compute_s=0.03, optimizer_step_s=0.0, profile_slowdown=1.0, source="t", recompute_s=0.01
    )
    assert reference.block_time_s(PIPELINE_FORWARD_KEY) == pytest.approx(0.01)
    assert reference.block_time_s(PIPELINE_BACKWARD_KEY) == pytest.approx(0.02 + 0.01)


def test_a_plan_fits_with_its_checkpointing_and_not_without():
    assert check_pipeline_plan(CHECKPOINTED, CLUSTER, PROFILES) == []
    (problem,) = check_pipeline_plan(PLAIN, CLUSTER, PROFILES)
    assert "pipeline 0 stage 0 (rank 0, small" in problem and "checkpointed stage's inputs" in problem


# ----------------------------------------------------------------------------------
# The search
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["exact", "heuristic"])
def test_the_search_checkpoints_only_the_stage_that_does_not_fit_without(method):
    result = search_pipeline_plan(PROFILES, CLUSTER, global_batch_size=BATCH, method=method)
    assert result.ok, result.message
    # The fast small type takes layers 0-2, 2 micro-batches in flight: only checkpointed do they fit.
    (pipeline,) = result.plan.pipelines
    assert [(s.device_type, s.first_layer, s.last_layer) for s in pipeline.stages] == [("small", 0, 2), ("big", 3, 3)]
    assert [s.activation_checkpointing for s in pipeline.stages] == [True, False]
    assert (pipeline.micro_batch_size, pipeline.num_micro_batches) == (1, 8)
    # Predicted with the recompute: 9 steps of the checkpointed stage's 30 + 10 ms (35 ms without it).
    assert result.plan.predicted.iteration_time_s == pytest.approx(9 * 0.03 * (1 + RECOMPUTE_SHARE))
    assert predict_pipeline(result.plan, PROFILES).iteration_time_s == pytest.approx(
        result.plan.predicted.iteration_time_s
    )
    assert "activation checkpointing on 1 stage (rank 0)" in result.message
    assert check_pipeline_plan(result.plan, CLUSTER, PROFILES) == []


def test_nothing_is_checkpointed_where_every_stage_fits_without():
    roomy = [dataclasses.replace(p, memory_capacity_bytes=10**9) for p in PROFILES]
    result = search_pipeline_plan(roomy, CLUSTER, global_batch_size=BATCH, method="exact")
    assert not any(s.activation_checkpointing for p in result.plan.pipelines for s in p.stages)
    assert "activation checkpointing" not in result.message


@pytest.mark.parametrize(
    "smalls,room,big_s,batch",
    [(1, 2300, 0.035, 4), (1, 3000, 0.05, 12), (1, 4100, 0.1, 8), (2, 3000, 0.02, 6), (2, 3000, 0.05, 6)],
)
def test_the_exact_search_reaches_the_brute_force_optimum_with_checkpointing(smalls, room, big_s, batch):
    # With two small ranks the optimum is one 3-stage pipeline whose middle stage is checkpointed.
    profiles = [_profile("small", 0.01, BASE + room), _profile("big", big_s, 10**9)]
    cluster = simple_cluster({"small": smalls, "big": 1}, ranks_per_node=3)
    best, plan = brute_force(profiles, cluster, batch)
    assert any(s.activation_checkpointing for p in plan.pipelines for s in p.stages), "the case needs checkpointing"
    result = search_pipeline_plan(profiles, cluster, global_batch_size=batch, method="exact")
    assert result.plan.predicted.iteration_time_s == pytest.approx(best, rel=1e-12)
    assert check_pipeline_plan(result.plan, cluster, profiles) == []


def test_re_counting_a_drifted_plan_keeps_and_prices_its_checkpointing():
    drifted = predict_drifted(CHECKPOINTED, PROFILES, CLUSTER, [2.0, 1.0])
    assert drifted.rank_recompute_time_s[0] == pytest.approx(2 * 8 * 0.01)
    # The count is re-searched with stage 0 checkpointed, as it runs: without, no count of 1 sample fits.
    replan = recount_pipelines(CHECKPOINTED, PROFILES, CLUSTER, [2.0, 1.0], min_gain=0.0)
    assert replan.status == "not_better" and replan.plan.pipelines == CHECKPOINTED.pipelines
    assert replan.new_iteration_time_s == pytest.approx(drifted.iteration_time_s)
    assert recount_pipelines(PLAIN, PROFILES, CLUSTER, [2.0, 1.0], min_gain=0.0).status == "infeasible"


# ----------------------------------------------------------------------------------
# poplar-search
# ----------------------------------------------------------------------------------
def _files(tmp_path):
    directory = layer_profiles_dir(tmp_path / "profiles")
    directory.mkdir(parents=True)
    for profile in PROFILES:
        save_layer_profile(profile, directory / f"{profile.device_type}.json")
    cluster = {
        "schema_version": 1,
        "nodes": [
            {"name": "n0", "devices": [{"device_type": "small", "count": 1}, {"device_type": "big", "count": 1}]}
        ],
    }
    write_json_atomic(cluster, tmp_path / "cluster.json")
    return ["--profiles", str(tmp_path / "profiles"), "--cluster", str(tmp_path / "cluster.json")]


def test_poplar_search_shows_and_writes_the_checkpointed_stage(capsys, tmp_path):
    files = _files(tmp_path)
    out_plan = tmp_path / "plan.json"
    argv = [*files, "--parallelism", "pipeline", "--global-batch-size", str(BATCH), "--output", str(out_plan)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "activation checkpointing on 1 stage (rank 0)" in out and "recompute s/iter" in out
    row = next(line for line in out.splitlines() if " small " in line)
    assert row.split()[-1] == "0.08"  # 8 micro-batches x a third of 30 ms
    written = json.loads(out_plan.read_text())
    assert written["pipelines"][0]["stages"][0]["activation_checkpointing"] is True
    assert main([*files, "--parallelism", "pipeline", "--global-batch-size", str(BATCH), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["pipelines"][0]["stages"][0]["activation_checkpointing"] is True
    assert main([*files, "--predict", str(out_plan)]) == 0
    out = capsys.readouterr().out
    assert "recompute s" in out
    row = next(line for line in out.splitlines() if " small " in line)
    assert "0.08" in row.split()
    assert main([*files, "--predict", str(out_plan), "--format", "json"]) == 0
    prediction = json.loads(capsys.readouterr().out)["prediction"]
    assert prediction["rank_recompute_time_s"] == pytest.approx([0.08, 0.0])
    assert prediction["rank_activation_checkpointing"] == [True, False]
    assert np.isclose(prediction["iteration_time_s"], 9 * 0.04)
