"""`poplar-search --parallelism pipeline|auto` (poplar_ext.search.pipeline_cli): tables, plans written, exit codes."""

import json
import shutil

import pytest
from test_cli import CLUSTER, EXAMPLES, examples_with, run

from poplar_ext.plan.formats import Plan, load_cluster
from poplar_ext.plan.pipeline_formats import PipelinePlan, load_any_plan, load_layer_profiles
from poplar_ext.search.pipeline_search import check_pipeline_plan
from poplar_ext.search.pipeline_sizing import MAX_SUMSET

NETWORK = next((EXAMPLES / "network").glob("*.json"))


def test_a_pipeline_plan_is_searched_printed_and_written(capsys, tmp_path):
    target = tmp_path / "plan.json"
    code, out, err = run(
        capsys, "--example", "--parallelism", "pipeline", "--global-batch-size", 256, "--output", target
    )
    assert code == 0 and err == ""
    assert out.startswith("pipelines at ZeRO stage 0") and "global batch 256" in out
    assert "pipelines  stage  ranks  device type  layers  micro-batch  micro-batches  busy s/iter  idle" in out
    plan = load_any_plan(target)
    assert isinstance(plan, PipelinePlan) and plan.global_batch_size == 256
    assert check_pipeline_plan(plan, load_cluster(CLUSTER), load_layer_profiles(EXAMPLES)) == []
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            assert f"{stage.first_layer}-{stage.last_layer}" in out


def test_auto_compares_both_and_writes_the_faster(capsys, tmp_path):
    target = tmp_path / "plan.json"
    code, out, _ = run(capsys, "--example", "--parallelism", "auto", "--global-batch-size", 512, "--output", target)
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["zero"], ["pipeline"])}
    assert set(rows) == {"zero", "pipeline"}
    chosen = next(name for name, row in rows.items() if row[1] == "chosen")
    # With the example's network ZeRO is faster at this batch.
    assert chosen == "zero" == min(rows, key=lambda name: float(rows[name][4]))
    assert isinstance(load_any_plan(target), Plan)
    code, out, _ = run(capsys, "--example", "--parallelism", "auto", "--format", "json")
    data = json.loads(out)
    assert data["chosen"] in ("zero", "pipeline") and data["zero"] and data["pipeline"]
    # Without a global batch the pipelines run the batch the ZeRO search chose.
    assert data["pipeline"]["global_batch_size"] == data["zero"]["global_batch_size"]
    assert data["pipeline"]["parallelism"] == "pipeline"


@pytest.mark.parametrize("no_network", ["--no-network", "no network file in --profiles"])
def test_auto_without_a_network_file_is_refused(capsys, tmp_path, no_network):
    # Without one a pipeline's transfers and all-reduces would cost nothing while ZeRO's collectives stay in its
    # profiles' times: the choice would lean to pipelines (with --no-network the example's flipped to them).
    profiles = tmp_path / "profiles"
    shutil.copytree(EXAMPLES, profiles)
    extra = [no_network] if no_network.startswith("--") else []
    if not extra:
        shutil.rmtree(profiles / "network")
    target = tmp_path / "plan.json"
    argv = ["--profiles", profiles, "--cluster", CLUSTER, "--parallelism", "auto", "--global-batch-size", 512]
    code, out, err = run(capsys, *argv, "--output", target, *extra)
    assert code == 2 and out == "" and not target.exists() and err.count("\n") == 1
    found = "--no-network" if extra else "none"
    assert f"--parallelism auto: expected a network file (--network FILE, or one in DIR/network/ measured on the " \
        f"cluster), found {found}" in err  # fmt: skip
    assert "--parallelism zero or pipeline" in err


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--parallelism", "pipeline"], "--global-batch-size: required with --parallelism pipeline"),
        (["--parallelism", "pipeline", "--global-batch-size", "8", "--zero-stage", "2"], "refuses stage 2"),
        (["--parallelism", "auto", "--policy", "uniform"], "--policy: expected poplar with --parallelism auto"),
        (
            ["--parallelism", "pipeline", "--global-batch-size", "512", "--max-global-batch-size", "100"],
            "--global-batch-size: expected at most --max-global-batch-size (100), found 512",
        ),
    ],
)
def test_arguments_pipelines_cannot_take_exit_2(capsys, argv, match):
    code, out, err = run(capsys, "--example", *argv)
    assert code == 2 and out == "" and match in err and err.count("\n") == 1


def test_a_bound_the_pipeline_batch_meets_is_accepted(capsys):
    code, _, err = run(capsys, "--example", "--parallelism", "pipeline", "--global-batch-size", "512",
                       "--max-global-batch-size", "1024")  # fmt: skip
    assert code == 0, err


def test_missing_or_bad_layer_profiles_exit_2_naming_the_file(capsys, tmp_path):
    profiles = tmp_path / "profiles"
    shutil.copytree(EXAMPLES, profiles)
    bad = next((profiles / "layers").glob("*.json"))
    data = json.loads(bad.read_text())
    data["layers"][3]["activation_bytes_per_sample"] = -5
    bad.write_text(json.dumps(data))
    code, out, err = run(capsys, "--profiles", profiles, "--cluster", CLUSTER, "--parallelism", "auto")
    assert code == 2 and out == ""
    assert f"{bad}: layers[3].activation_bytes_per_sample: expected" in err
    shutil.rmtree(profiles / "layers")
    code, _, err = run(capsys, "--profiles", profiles, "--cluster", CLUSTER, "--parallelism", "auto")
    assert code == 2 and f"{profiles / 'layers'}: (directory): expected a directory of layer profiles" in err


def test_a_pipeline_plan_that_cannot_be_made_exits_1_and_writes_nothing(capsys, tmp_path):
    profiles = tmp_path / "profiles"
    shutil.copytree(EXAMPLES, profiles)
    for path in (profiles / "layers").glob("*.json"):
        data = json.loads(path.read_text())
        data["memory_capacity_bytes"] = data["base_memory_bytes"] + 1
        path.write_text(json.dumps(data))
    target = tmp_path / "plan.json"
    code, out, err = run(
        capsys,
        "--profiles",
        profiles,
        "--cluster",
        CLUSTER,
        "--parallelism",
        "pipeline",
        "--global-batch-size",
        64,
        "--output",
        target,
    )
    assert code == 1 and out == "" and not target.exists()
    assert err.startswith("poplar-search: infeasible: pipeline: No pipeline plan.") and "memory" in err


def test_help_names_the_parallelisms(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "--parallelism" in out and "DIR/layers/" in out
    assert "It needs a network file (--network, or the one in DIR/network/" in " ".join(out.split())
    # The pipeline search's own limit on the global batch is stated with the others.
    assert f"pipelines up to {MAX_SUMSET}" in " ".join(out.split())


def test_auto_without_a_batch_keeps_the_zero_plan_when_its_batch_is_beyond_the_pipeline_search(capsys, tmp_path):
    # 9600 ranks: the ZeRO search's own batch is above the pipeline sizing's limit (MAX_SUMSET), which the
    # user never gave: the pipelines are not searched, the ZeRO plan stands.
    devices = [{"device_type": "A100-80GB", "count": 4}, {"device_type": "V100-16GB", "count": 4}]
    nodes = [{"name": f"n{i}", "devices": devices} for i in range(1200)]
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"schema_version": 1, "nodes": nodes}))
    argv = ["--profiles", EXAMPLES, "--cluster", cluster, "--parallelism", "auto", "--network", NETWORK]
    code, out, err = run(capsys, *argv, "--format", "json")
    assert code == 0 and err == ""
    data = json.loads(out)
    assert data["chosen"] == "zero" and data["pipeline"] is None
    assert data["zero"]["global_batch_size"] > MAX_SUMSET
    code, out, _ = run(capsys, *argv)
    pipeline_row = next(line for line in out.splitlines() if line.startswith("pipeline "))
    assert code == 0 and "infeasible" in pipeline_row and f"limit ({MAX_SUMSET})" in pipeline_row


def test_the_idle_column_is_the_share_of_the_slowest_pipeline_a_stage_waits(capsys, tmp_path):
    """As the ZeRO table's (of the slowest rank's busy time): the boundary is shown apart, not counted as idle.
    A single one-stage pipeline never waits; it read ~50% idle when the optimizer step counted."""
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"schema_version": 1, "nodes": [{"name": "a", "devices": [
        {"device_type": "A100-80GB", "count": 1}]}]}))  # fmt: skip
    plan = tmp_path / "plan.json"
    args = ["--profiles", EXAMPLES, "--network", NETWORK, "--parallelism", "pipeline", "--global-batch-size", 32]
    code, out, err = run(capsys, *args, "--cluster", one, "--output", plan)
    assert code == 0, err
    idle = [line.split()[8] for line in out.splitlines() if line.split()[:1] == ["0"]]
    assert idle == ["0.0%"], out
    code, out, err = run(capsys, "--profiles", EXAMPLES, "--cluster", one, "--predict", plan)
    assert code == 0, err
    rows = [line.split() for line in out.splitlines() if line.split()[:4] == ["0", "0", "0", "A100-80GB"]]
    assert len(rows) == 1 and rows[0][9] == "0.0%", out
    # Pipelines of two types: each stage's share of the slowest pipeline's 1F1B time, boundary apart.
    code, _, err = run(capsys, "--example", "--parallelism", "pipeline", "--global-batch-size", 256, "--output", plan)
    assert code == 0, err
    code, out, err = run(capsys, "--example", "--predict", plan, "--json")
    prediction = json.loads(out)["prediction"]
    code, out, err = run(capsys, "--example", "--predict", plan)
    rows = [line.split() for line in out.splitlines()]
    idle = {int(row[2]): row[9] for row in rows if len(row) > 9 and row[2].isdigit()}
    slowest = max(prediction["pipeline_time_s"])
    expected = {r: f"{100 * (1 - busy / slowest):.1f}%" for r, busy in enumerate(prediction["rank_busy_time_s"])}
    assert idle == expected and any(share != "0.0%" for share in idle.values()), out


def test_auto_without_layer_profiles_points_to_parallelism_zero(capsys, tmp_path):
    profiles = tmp_path / "profiles"
    shutil.copytree(EXAMPLES, profiles)
    shutil.rmtree(profiles / "layers")
    code, out, err = run(
        capsys, "--profiles", profiles, "--cluster", CLUSTER, "--parallelism", "auto", "--global-batch-size", 512
    )
    assert code == 2 and out == ""
    assert f"{profiles / 'layers'}: (directory): expected a directory of layer profiles, found no such" in err
    assert "--parallelism zero searches" in err and len(err.strip().splitlines()) == 1, err
    code, out, err = run(capsys, "--profiles", profiles, "--cluster", CLUSTER, "--global-batch-size", 512)
    assert code == 0, err


def test_auto_with_layer_profiles_alone_points_to_parallelism_pipeline(capsys, tmp_path):
    # A pipeline model's folder: poplar-profile wrote layers/ and no whole-model profile.
    profiles = tmp_path / "profiles"
    shutil.copytree(EXAMPLES / "layers", profiles / "layers")
    shutil.copytree(EXAMPLES / "network", profiles / "network")
    code, out, err = run(
        capsys, "--profiles", profiles, "--cluster", CLUSTER, "--parallelism", "auto", "--global-batch-size", 512
    )
    assert code == 2 and out == ""
    assert f"{profiles}: (directory): expected at least one profile *.json file, found none; " in err
    assert f"--parallelism pipeline searches {profiles / 'layers'} alone" in err and len(err.splitlines()) == 1, err
    code, out, err = run(
        capsys, "--profiles", profiles, "--cluster", CLUSTER, "--parallelism", "pipeline", "--global-batch-size", 512
    )
    assert code == 0, err


def test_model_picks_the_layer_profiles_too(capsys, tmp_path):
    # --model filtered the whole-model profiles only: the pipeline search took whatever layer profiles were there.
    layers = json.loads(next((EXAMPLES / "layers").glob("*.json")).read_text())["model"]
    common = ["--example", "--parallelism", "pipeline", "--global-batch-size", 512]
    code, out, err = run(capsys, *common, "--model", layers["name"])
    assert code == 0, err
    code, out, err = run(capsys, *common, "--model", "gpt2-small-124m")
    assert code == 2 and "--model: expected the name or fingerprint of a model in " in err
    assert f"layers, found 'gpt2-small-124m'; there: {layers['name']} ({layers['fingerprint']})" in err, err


def test_a_bf16_plan_the_search_put_at_zero_0_comes_with_a_note_that_its_checkpoints_will_not_resume(capsys, tmp_path):
    # A tiny GPT-2's bf16 layer profiles: the auto stage was 0 (stage 1 predicted the same), the job trained and
    # saved, and only its resume refused the optimizer state. The search now says so where it chooses.
    profiles = examples_with(tmp_path, "layers/*.json", lambda data: data["model"].update(dtype="bfloat16"))
    argv = ["--profiles", profiles, "--cluster", CLUSTER, "--parallelism", "pipeline", "--global-batch-size", 256]
    code, out, err = run(capsys, *argv)
    assert code == 0 and out.startswith("pipelines at ZeRO stage 0 (auto)")
    assert err == (
        "poplar-search: note: the plan is at ZeRO stage 0 from bfloat16 layer profiles: DeepSpeed 0.19.8 cannot "
        "load the optimizer state a bf16 pipeline saves at stage 0, so its checkpoints resume with the weights "
        "alone; --zero-stage 1 plans one that resumes exactly (ZeRO 1 shards nothing in a pipeline: no memory cost)\n"
    )
    code, out, err = run(capsys, *argv, "--zero-stage", "0")  # asked for: no note
    assert code == 0 and err == ""


@pytest.mark.parametrize(("dtype", "stage"), [("bfloat16", 1), ("float32", 0)])
def test_a_bf16_search_takes_zero_1_where_it_ties_with_zero_0(capsys, tmp_path, dtype, stage):
    # poplar-profile --per-layer writes stage 1 as stage 0's measurement: the auto stage tied and took 0, where a
    # bf16 pipeline's optimizer state cannot be loaded again. Other dtypes keep the lower stage.
    profiles = tmp_path / "profiles"
    shutil.copytree(EXAMPLES, profiles)
    for path in list((profiles / "layers").glob("*.json")):
        data = json.loads(path.read_text())
        data["model"]["dtype"] = dtype
        path.write_text(json.dumps(data))
        (path.parent / path.name.replace("stage0", "stage1")).write_text(json.dumps({**data, "zero_stage": 1}))
    argv = ["--profiles", profiles, "--cluster", CLUSTER, "--parallelism", "pipeline", "--global-batch-size", 256]
    code, out, err = run(capsys, *argv)
    assert code == 0 and out.startswith(f"pipelines at ZeRO stage {stage} (auto)"), out
    assert err == ""
