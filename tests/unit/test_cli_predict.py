"""`poplar-search --predict PLAN`: a given plan, ZeRO or pipeline, priced from the profiles."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from poplar_ext.plan.formats import load_profiles, save_profile
from poplar_ext.search.cli import main
from poplar_ext.search.examples import example_cluster_file, example_profiles_dir


def _searched(tmp_path, capsys, *extra: str) -> dict:
    out = tmp_path / "plan.json"
    assert main(["--example", "--global-batch-size", "512", "--output", str(out), *extra]) == 0
    capsys.readouterr()
    return {"path": out, "plan": json.loads(out.read_text())}


@pytest.mark.parametrize("parallelism", ["zero", "pipeline"])
def test_a_searched_plan_is_priced_as_the_search_predicted_it(tmp_path, capsys, parallelism):
    searched = _searched(tmp_path, capsys, "--parallelism", parallelism)
    assert main(["--example", "--predict", str(searched["path"]), "--format", "json"]) == 0
    priced = json.loads(capsys.readouterr().out)
    assert priced["parallelism"] == parallelism and priced["network_priced"] is True
    predicted = searched["plan"]["predicted"]
    assert priced["prediction"]["iteration_time_s"] == pytest.approx(predicted["iteration_time_s"], rel=1e-9)
    assert priced["prediction"]["samples_per_s"] == pytest.approx(predicted["samples_per_s"], rel=1e-9)


@pytest.mark.parametrize("parallelism", ["zero", "pipeline"])
def test_json_is_the_short_spelling_of_format_json(tmp_path, capsys, parallelism):
    searched = _searched(tmp_path, capsys, "--parallelism", parallelism)
    printed = []
    for spelling in (["--format", "json"], ["--json"]):
        assert main(["--example", "--predict", str(searched["path"]), *spelling]) == 0
        printed.append(json.loads(capsys.readouterr().out))
    assert printed[0] == printed[1] and printed[0]["parallelism"] == parallelism
    assert main(["--example", "--json", "--format", "table"]) == 2  # one output format at a time
    assert "not allowed with" in capsys.readouterr().err


def test_the_zero_table_says_where_each_ranks_time_goes(tmp_path, capsys):
    searched = _searched(tmp_path, capsys)
    assert main(["--example", "--predict", str(searched["path"])]) == 0
    out = capsys.readouterr().out
    for column in ("compute s", "communication s", "busy s", "idle"):
        assert column in out
    assert "A100-80GB" in out and "V100-16GB" in out
    assert "boundary" in out and "optimizer step" in out and "collectives" in out


def test_the_pipeline_table_shows_every_stage_and_the_pipelines_times(tmp_path, capsys):
    searched = _searched(tmp_path, capsys, "--parallelism", "pipeline")
    assert main(["--example", "--predict", str(searched["path"])]) == 0
    out = capsys.readouterr().out
    assert "transfers s" in out and "all-reduce ends s" in out and "pipelines (1F1B) s:" in out
    stages = sum(len(p["stages"]) for p in searched["plan"]["pipelines"])
    rows = [line for line in out.splitlines() if "A100-80GB" in line or "V100-16GB" in line]
    assert len(rows) == stages


def test_without_a_network_file_communication_is_not_priced_apart(tmp_path, capsys):
    searched = _searched(tmp_path, capsys)
    assert main(["--example", "--predict", str(searched["path"]), "--no-network"]) == 0
    assert "no network file" in capsys.readouterr().out


def test_search_options_are_refused_with_predict(tmp_path, capsys):
    searched = _searched(tmp_path, capsys)
    command = ["--example", "--predict", str(searched["path"]), "--policy", "all", "--output", "x.json"]
    assert main(command) == 2
    assert "--policy, --output: not used with --predict" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_a_bad_plan_names_its_file_and_field(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema_version": 1}))
    assert main(["--example", "--predict", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "zero_stage" in err


@pytest.mark.parametrize("text", ["null", "5", '"pipelines"'])
def test_a_plan_file_that_is_not_an_object_is_bad_input(tmp_path, capsys, text):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    assert main(["--example", "--predict", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: (top level): expected an object" in err and "internal error" not in err


def test_a_pipeline_plan_whose_stage_does_not_fit_is_bad_input_as_a_zero_one(tmp_path, capsys):
    # A ZeRO plan beyond a profile's largest micro-batch is refused; a pipeline stage beyond its memory alike.
    plan = _searched(tmp_path, capsys, "--parallelism", "pipeline")["plan"]
    plan["pipelines"][0]["micro_batch_size"] *= 1000
    plan["global_batch_size"] = sum(p["micro_batch_size"] * p["num_micro_batches"] for p in plan["pipelines"])
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(plan))
    assert main(["--example", "--predict", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"{path}: expected stages that fit their device's memory" in captured.err
    assert "pipeline 0 stage 0 (rank " in captured.err


@pytest.mark.parametrize("cluster", [True, False])
@pytest.mark.parametrize("broken", ["stage 2 counts", "stage 3 checkpointing"])
def test_a_zero_plan_that_breaks_its_stages_rules_is_bad_input_as_check_plan_says(tmp_path, capsys, cluster, broken):
    plan = _searched(tmp_path, capsys)["plan"]
    plan["zero_stage"] = 2 if broken == "stage 2 counts" else 3
    for rank in plan["ranks"]:
        rank["gradient_accumulation_steps"] = 3 if rank["rank"] == 0 and broken == "stage 2 counts" else 1
        rank["activation_checkpointing"] = rank["device_type"] == "A100-80GB" and broken == "stage 3 checkpointing"
    plan["global_batch_size"] = sum(r["micro_batch_size"] * r["gradient_accumulation_steps"] for r in plan["ranks"])
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(plan))
    # Stage 3 profiles with checkpointing as well, so that only the rule can refuse the plan.
    profiles = tmp_path / "profiles"
    shutil.copytree(example_profiles_dir(), profiles, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    for profile in load_profiles(profiles):
        if profile.zero_stage == 3:
            save_profile(
                dataclasses.replace(profile, activation_checkpointing=True), profiles / f"{profile.device_type}.ck.json"
            )
    where = ["--profiles", str(profiles)] + (["--cluster", str(example_cluster_file())] if cluster else [])
    assert main([*where, "--predict", str(path)]) == 2
    captured = capsys.readouterr()
    expected = "gradient_accumulation_steps on every rank" if broken == "stage 2 counts" else "activation_checkpointing"
    assert captured.out == "" and f"{path}: expected a plan that keeps its stage's rules: ZeRO stage" in captured.err
    assert expected in captured.err


def test_a_plan_of_a_device_type_without_profiles_is_bad_input(tmp_path, capsys):
    searched = _searched(tmp_path, capsys)
    plan = searched["plan"]
    for rank in plan["ranks"]:
        rank["device_type"] = "H200-141GB"
    path = tmp_path / "other.json"
    path.write_text(json.dumps(plan))
    assert main(["--example", "--predict", str(path)]) == 2
    assert "H200-141GB" in capsys.readouterr().err


def test_both_searches_return_one_result_type_that_says_its_parallelism():
    from poplar_ext.plan.formats import load_cluster, load_profiles
    from poplar_ext.plan.pipeline_formats import PipelinePlan, layer_profiles_dir, load_layer_profiles
    from poplar_ext.search import SearchResult, search_pipeline_plan, search_plan
    from poplar_ext.search.examples import example_cluster_file, example_profiles_dir

    cluster = load_cluster(example_cluster_file())
    zero = search_plan(load_profiles(example_profiles_dir()), cluster, global_batch_size=512)
    layers = load_layer_profiles(layer_profiles_dir(example_profiles_dir()))
    pipeline = search_pipeline_plan(layers, cluster, global_batch_size=512)
    assert type(zero) is SearchResult and type(pipeline) is SearchResult
    assert (zero.parallelism, zero.method, zero.layouts_evaluated) == ("zero", "exact", None)
    assert pipeline.parallelism == "pipeline" and isinstance(pipeline.plan, PipelinePlan)
    assert pipeline.method in ("exact", "heuristic") and pipeline.layouts_evaluated >= 1
    assert zero.ok and pipeline.ok and pipeline.policy == "poplar"


@pytest.mark.parametrize("parallelism", ["zero", "pipeline"])
def test_a_cluster_that_is_not_the_plans_is_bad_input(tmp_path, capsys, parallelism):
    searched = _searched(tmp_path, capsys, "--parallelism", parallelism)
    cluster = tmp_path / "four.json"
    devices = [{"device_type": "V100-16GB", "count": 2}, {"device_type": "A100-80GB", "count": 2}]
    cluster.write_text(json.dumps({"schema_version": 1, "nodes": [{"name": "a", "devices": devices}]}))
    network = next((example_profiles_dir() / "network").glob("*.json"))
    command = ["--profiles", str(example_profiles_dir()), "--cluster", str(cluster), "--network", str(network)]
    assert main([*command, "--predict", str(searched["path"])]) == 2
    err = capsys.readouterr().err
    assert str(cluster) in err and "8 ranks but the cluster has 4" in err and "rank 0" in err


def test_a_plan_of_another_cluster_under_example_is_told_to_name_its_own(tmp_path, capsys):
    cluster = tmp_path / "four.json"
    devices = [{"device_type": "V100-16GB", "count": 2}, {"device_type": "A100-80GB", "count": 2}]
    cluster.write_text(json.dumps({"schema_version": 1, "nodes": [{"name": "a", "devices": devices}]}))
    plan = tmp_path / "plan4.json"
    assert main(["--example", "--cluster", str(cluster), "--global-batch-size", "64", "--output", str(plan)]) == 0
    capsys.readouterr()
    assert main(["--example", "--predict", str(plan)]) == 2
    assert "(the example's: give the plan's own with --cluster)" in capsys.readouterr().err
    assert main(["--example", "--cluster", str(cluster), "--predict", str(plan)]) == 0


def test_without_a_cluster_the_zero_boundary_is_shown_as_profiled_not_as_0_s_of_collectives(tmp_path, capsys):
    # The network file is found by the cluster: without --cluster the collectives are inside the measured boundary.
    searched = _searched(tmp_path, capsys)
    predict = ["--profiles", str(example_profiles_dir()), "--predict", str(searched["path"])]
    assert main(predict) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("boundary ") and " s as profiled (optimizer step and collectives not told apart: no " in last
    assert "collectives 0 s" not in last, last
    assert main([*predict, "--format", "json"]) == 0
    priced = json.loads(capsys.readouterr().out)
    assert priced["network_priced"] is False and priced["prediction"]["boundary_separated"] is False
    assert last.endswith("not told apart: no --cluster or --network to find a network file by)"), last
    assert priced["prediction"]["boundary_communication_s"] is None and priced["prediction"]["optimizer_step_s"] is None
    assert priced["prediction"]["boundary_s"] > 0
    # With the cluster, its network file prices the collectives apart.
    assert main(["--example", "--predict", str(searched["path"]), "--format", "json"]) == 0
    with_cluster = json.loads(capsys.readouterr().out)["prediction"]
    assert with_cluster["boundary_separated"] is True and with_cluster["boundary_communication_s"] > 0


@pytest.mark.parametrize("cause", ["no file for this cluster", "--no-network"])
def test_the_unpriced_boundary_says_why_where_the_cluster_was_given(tmp_path, capsys, cause):
    # With --cluster given, the table blamed a missing --cluster.
    searched = _searched(tmp_path, capsys)
    profiles = tmp_path / "profiles"
    shutil.copytree(example_profiles_dir(), profiles)
    if cause == "--no-network":
        flags = ["--no-network"]
        why = "--no-network"
    else:
        shutil.rmtree(profiles / "network")
        flags = []
        why = f"no network file in {profiles} measured on this cluster"
    command = ["--profiles", str(profiles), "--cluster", str(example_cluster_file())]
    assert main([*command, "--predict", str(searched["path"]), *flags]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.endswith(f"not told apart: {why})"), last


@pytest.mark.parametrize("stage", [1, 3])
def test_without_a_network_a_micro_steps_collectives_are_not_shown_as_0_s(tmp_path, capsys, stage):
    # Stages 2-3 measured their micro-step collectives inside the micro-step; stages 0-1 have none there.
    searched = _searched(tmp_path, capsys, "--zero-stage", str(stage))
    predict = ["--profiles", str(example_profiles_dir()), "--predict", str(searched["path"])]
    assert main(predict) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if "GB " in line]
    assert main([*predict, "--format", "json"]) == 0
    priced = json.loads(capsys.readouterr().out)["prediction"]
    if stage == 3:
        assert all(row[4:6] == ["-", "-"] for row in rows), rows
        assert priced["micro_step_communication_s"] is None and priced["rank_compute_time_s"] is None
    else:
        assert all(row[5] == "0" for row in rows), rows
        assert priced["micro_step_communication_s"] == 0 and priced["rank_compute_time_s"] == priced["rank_busy_time_s"]


def test_the_predict_and_cluster_help_say_the_network_is_not_priced_apart_without_a_cluster(capsys):
    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--cluster is optional here, but without it (or --network) the network is not priced apart" in text
    assert "optional with --predict, but without it the network file in --profiles is not found" in text


def test_a_micro_batch_above_its_profiles_largest_is_refused_naming_the_rank(tmp_path, capsys):
    # The refusal named the device type and the sizes found, not which of its ranks the plan gave too many.
    searched = _searched(tmp_path, capsys, "--zero-stage", "1")
    plan = searched["plan"]
    too_big = 10_000
    last = plan["ranks"][-1]
    plan["global_batch_size"] += (too_big - last["micro_batch_size"]) * last["gradient_accumulation_steps"]
    last["micro_batch_size"] = too_big
    path = tmp_path / "oversize.json"
    path.write_text(json.dumps(plan))
    assert main(["--example", "--predict", str(path)]) == 2
    err = capsys.readouterr().err
    assert "micro_batch_size: expected 1 to " in err and f"on {last['device_type']} at ZeRO stage 1, found " in err
    assert f"..{too_big}; outside it: rank {last['rank']} ({too_big})" in err, err
