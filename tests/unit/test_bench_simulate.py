"""`poplar_bench.simulate`: policies compared by prediction on modelled and given profiles."""

import dataclasses

import pytest

from poplar_bench import cluster_files, gpu_model, simulate, simulate_pipelines
from poplar_bench.report import render_markdown, write_report
from poplar_ext.plan.formats import Cluster, ClusterNode, DeviceGroup

SHAPE = gpu_model.model_shape("gpt2-xl-1.5b")


def _case(first="A100-80GB", second="A100-40GB", world_size=8, shape=SHAPE, **kwargs):
    cluster = cluster_files.pair_cluster(first, second, world_size=world_size)
    return simulate.modelled_case(cluster, shape, name=f"{first}+{second} x{world_size}", **kwargs)


@pytest.fixture(scope="module")
def scenario():
    return simulate.simulate_case(_case())


def _entries(scenario):
    return {e["policy"]: e for e in scenario["policies"]}


def test_every_policy_gets_a_plan_at_the_same_global_batch(scenario):
    entries = _entries(scenario)
    assert set(entries) == {"uniform", "proportional", "poplar"}
    assert {e["status"] for e in entries.values()} == {"ok"}
    assert {e["global_batch_size"] for e in entries.values()} == {16 * 8}
    for entry in entries.values():
        assert (
            sum(r["micro_batch_size"] * r["gradient_accumulation_steps"] * r["count"] for r in entry["ranks"]) == 16 * 8
        )


def test_poplar_is_predicted_no_slower_than_the_baselines(scenario):
    entries = _entries(scenario)
    poplar = entries["poplar"]["predicted"]["iteration_time_s"]
    assert poplar <= entries["uniform"]["predicted"]["iteration_time_s"] * (1 + 1e-9)
    assert poplar <= entries["proportional"]["predicted"]["iteration_time_s"] * (1 + 1e-9)
    assert entries["poplar"]["speedup_over_uniform"] >= 1.0
    assert entries["uniform"]["speedup_over_uniform"] == pytest.approx(1.0)


def test_share_of_ideal_is_a_fraction(scenario):
    for entry in scenario["policies"]:
        assert 0 < entry["share_of_ideal"] <= 1 + 1e-9


def test_per_rank_busy_times_fit_in_the_iteration(scenario):
    for entry in scenario["policies"]:
        assert sum(r["count"] for r in entry["ranks"]) == 8
        busy = [r["predicted_busy_s"] for r in entry["ranks"]]
        assert max(busy) <= entry["predicted"]["iteration_time_s"]
        assert entry["measured"] is None and entry["prediction_error"] is None


def test_modelled_devices_are_labelled_modelled_everywhere(scenario):
    assert {info["source"] for info in scenario["device_types"].values()} == {"modelled"}
    report = simulate.simulation_report([_case()])
    assert "modelled" in report["data_source"]
    assert any("MODELLED" in note and "A100-40GB" in note for note in report["notes"])


def test_curves_cover_every_device_type_at_the_featured_stage(scenario):
    assert set(scenario["curves"]) == {"A100-80GB", "A100-40GB"}
    for points in scenario["curves"].values():
        assert points and all(p["samples_per_s"] > 0 for p in points)


def test_infeasible_policies_are_reported_not_raised(tmp_path):
    # 6.7B parameters at ZeRO-0 fit neither a V100-16GB nor a T4.
    case = _case("V100-16GB", "T4-16GB", shape=gpu_model.model_shape("gpt3-6.7b"), zero_stage=0)
    scenario = simulate.simulate_case(case)
    assert {e["status"] for e in scenario["policies"]} == {"infeasible"}
    assert all(e["message"] for e in scenario["policies"])
    report = simulate.simulation_report([case])
    paths = write_report(report, tmp_path, "sim")
    assert "infeasible" in paths[1].read_text()


def test_profiles_modelled_elsewhere_are_not_credited_to_gpu_model():
    case = _case()
    relabelled = tuple(
        dataclasses.replace(p, measured_with={"source": "modelled", "model": "someone's spreadsheet"})
        for p in case.profiles
    )
    report = simulate.simulation_report([dataclasses.replace(case, profiles=relabelled, network=None)])
    assert any("MODELLED by someone's spreadsheet" in note for note in report["notes"])
    assert not any("gpu_model" in note for note in report["notes"])


def test_given_measured_profiles_are_labelled_measured():
    case = _case()
    relabelled = tuple(
        dataclasses.replace(p, measured_with={"source": "measured", "host": "test"}) for p in case.profiles
    )
    scenario = simulate.simulate_case(dataclasses.replace(case, profiles=relabelled))
    assert {info["source"] for info in scenario["device_types"].values()} == {"measured"}
    # Measured profiles were run on their devices: the report ran nothing, but not "on these GPUs".
    notes = simulate.simulation_report([dataclasses.replace(case, profiles=relabelled)], scaling=False)["notes"]
    assert notes[0] == (
        "Every figure is a prediction of the search's cost model; nothing was run on these GPUs for this report "
        "(its measured profiles were, before)."
    )
    modelled = simulate.simulation_report([case], scaling=False)["notes"]
    assert modelled[0] == "Every figure is a prediction of the search's cost model; nothing was run on these GPUs."


def test_profiles_measured_on_emulated_devices_are_said_to_be(monkeypatch):
    # The demo's cache (a real cpu and an emulated cpu-slow) read "nothing was run on these GPUs" and nothing else.
    from poplar_ext.plan.formats import Emulation

    case = _case()
    measured = simulate.simulate_case(
        dataclasses.replace(
            case, profiles=tuple(dataclasses.replace(p, measured_with={"source": "measured"}) for p in case.profiles)
        )
    )
    monkeypatch.setattr(simulate, "simulate_case", lambda case: measured)  # the notes alone: no search
    first = case.profiles[0].device_type
    relabelled = tuple(
        dataclasses.replace(
            p,
            measured_with={"source": "measured", "host": "test"},
            emulated=Emulation(slowdown=3.0, memory_capacity_bytes=2 * 10**9) if p.device_type == first else None,
        )
        for p in case.profiles
    )
    notes = simulate.simulation_report([dataclasses.replace(case, profiles=relabelled)], scaling=False)["notes"]
    assert notes[0] == (
        "Every figure is a prediction of the search's cost model; nothing was run on these devices for this report "
        "(its measured profiles were, before)."
    )
    assert notes[1] == (
        f"Profiles of {first} were measured on EMULATED devices (a CPU slowed down, its memory capped: "
        "poplar_ext.hardware.emulation), not on the devices they name."
    )


def test_a_large_cluster_simulates_and_reports_per_type_means(tmp_path):
    report = simulate.simulation_report([_case(world_size=8), _case(world_size=512)])
    assert report["scenarios"][1]["cluster"]["world_size"] == 512
    for entry in report["scenarios"][1]["policies"]:
        # Consecutive alike ranks are merged: a handful of entries, not 512.
        assert len(entry["ranks"]) <= 4 and sum(r["count"] for r in entry["ranks"]) == 512
    paths = write_report(report, tmp_path, "sim")
    assert paths[2].stat().st_size > 1000


def test_samples_per_rank_must_be_positive():
    with pytest.raises(ValueError, match=r"samples_per_rank: expected an integer >= 1, found 0"):
        _case(samples_per_rank=0)


def test_an_unmodelled_device_type_is_a_value_error():
    cluster = Cluster(nodes=(ClusterNode(name="n", devices=(DeviceGroup(device_type="MI300X", count=2),)),))
    with pytest.raises(ValueError, match=r"device_type: expected one of the modelled GPU types .* found 'MI300X'"):
        simulate.modelled_case(cluster, SHAPE, name="x")


def test_modelled_cases_price_communication_with_a_modelled_network_that_reproduces_the_profiles():
    case = _case()
    assert case.network is not None and case.network.source == "modelled"
    without = dataclasses.replace(case, network=None)
    priced, plain = simulate.simulate_case(case), simulate.simulate_case(without)
    # The modelled profiles hold their collectives at the cluster's size; the network
    # takes them out and puts them back: the same prediction at that size.
    for a, b in zip(_entries(priced).values(), _entries(plain).values()):
        assert a["predicted"]["iteration_time_s"] == pytest.approx(b["predicted"]["iteration_time_s"], rel=1e-9)


def test_the_scaling_series_reports_each_stage_per_size_and_where_it_stops_paying():
    slow_hops = gpu_model.Assumptions(network_latency_s=2e-3)  # latency grows with every ring hop
    cases = [
        dataclasses.replace(
            _case(world_size=w, assumptions=slow_hops), cluster_file=f"poplar_bench/clusters/pair-x{w}.json"
        )
        for w in (64, 8)
    ]
    (series,) = simulate.scaling_series(cases)
    assert series["name"] == "pair, gpt2-xl-1.5b"
    assert [row["world_size"] for row in series["rows"]] == [8, 64]
    for row in series["rows"]:
        feasible = {int(k): v for k, v in row["stages"].items() if v["status"] == "ok"}
        assert row["fastest_stage"] == max(feasible, key=lambda k: feasible[k]["samples_per_s_per_gpu"])
        assert all(0 < v["communication_share"] < 1 and 0 < v["share_of_ideal"] <= 1 for v in feasible.values())
    small, large = (row["stages"]["0"]["samples_per_s_per_gpu"] for row in series["rows"])
    assert large < 0.9 * small, "63 hops of 2 ms each cost more than 7"
    assert series["stops_paying_at_world_size"]["0"] == 64


def test_the_simulation_report_renders_the_scaling_tables(tmp_path):
    report = simulate.simulation_report([_case(world_size=8), _case(world_size=64)])
    assert report["scaling"] and any("network" in note for note in report["notes"])
    paths = write_report(report, tmp_path, "sim")
    markdown = next(p for p in paths if p.suffix == ".md").read_text()
    assert "## Each ZeRO stage as the cluster grows" in markdown and "| GPUs | stage 0 |" in markdown


@pytest.mark.parametrize(
    ("global_batches", "said"),
    [({8: 32, 16: 64}, "global batch = 4 samples per GPU"), ({8: 96, 16: 96}, "global batch = 96 samples")],
)
def test_the_scaling_tables_say_the_global_batch_they_ran(global_batches, said):
    from poplar_bench.report import render_scaling

    cases = [
        dataclasses.replace(
            _case(world_size=w), global_batch_size=b, cluster_file=f"poplar_bench/clusters/pair-x{w}.json"
        )
        for w, b in global_batches.items()
    ]
    (series,) = simulate.scaling_series(cases)
    assert [row["global_batch_size"] for row in series["rows"]] == list(global_batches.values())
    text = "\n".join(render_scaling([series]))
    assert said + "." in text and "16 samples per GPU" not in text


def test_stops_paying_says_where_a_stage_is_infeasible_instead_of_never():
    from poplar_bench.report import render_scaling

    def cell(rate):
        if rate is None:
            return {"status": "infeasible", "reason": "out of memory"}
        return {"status": "ok", "samples_per_s_per_gpu": rate, "share_of_ideal": 0.9, "communication_share": 0.1}

    rates = {8: (10.0, None, None, None), 16: (8.0, 6.0, None, None), 32: (7.0, 5.0, None, None)}  # stages 0-3
    rows = [
        {
            "world_size": w,
            "global_batch_size": 4 * w,
            "stages": {str(s): cell(r) for s, r in enumerate(stage_rates)},
            "fastest_stage": 0,
        }
        for w, stage_rates in rates.items()
    ]
    series = {"name": "pair, m", "rows": rows, "stops_paying_at_world_size": {"0": 16, "1": 32, "2": None, "3": None}}
    text = "\n".join(render_scaling([series]))
    assert "stage 0: 16 GPUs, " in text
    assert "stage 1: 32 GPUs (against 16 GPUs, its smallest feasible cluster)" in text
    assert "stage 2: infeasible at every size, stage 3: infeasible at every size." in text
    rows[-1]["stages"]["3"] = cell(3.0)  # feasible at the largest size alone: nothing to compare it with
    assert "stage 3: feasible only at 32 GPUs." in "\n".join(render_scaling([series]))


# ----------------------------------------------------------------------------------
# ZeRO or pipelines (poplar_bench/simulate_pipelines.py)
# ----------------------------------------------------------------------------------
MEDIUM = gpu_model.ModelShape(
    name="gpt2-medium", num_layers=24, hidden_size=1024, num_heads=16, sequence_length=1024, vocab_size=50257
)


@pytest.fixture(scope="module")
def versus():
    cluster = cluster_files.pair_cluster("A100-80GB", "A100-40GB", world_size=8)
    return {
        network: simulate_pipelines.compare(cluster, MEDIUM, network=network, global_batch_size=128, name="pair")
        for network in ("slow", "fast")
    }


def test_zero_and_pipelines_are_compared_at_one_batch_and_the_faster_wins(versus):
    for row in versus.values():
        assert row["zero"]["status"] == row["pipeline"]["status"] == "ok" and row["global_batch_size"] == 128
        rates = {k: row[k]["samples_per_s"] for k in ("zero", "pipeline")}
        assert row["winner"] == max(rates, key=rates.get)
        assert row["pipeline_over_zero"] == pytest.approx(rates["pipeline"] / rates["zero"])
        assert "pipeline" in row["pipeline"]["plan"] and row["zero"]["plan"].startswith("ZeRO-")


def test_a_slow_network_costs_zero_more_than_pipelines(versus):
    # ZeRO moves the whole model's gradients across nodes, a pipeline's rank its stage's only.
    slow, fast = versus["slow"], versus["fast"]
    assert slow["zero"]["samples_per_s"] < fast["zero"]["samples_per_s"]
    assert slow["pipeline_over_zero"] > fast["pipeline_over_zero"]
    assert (slow["winner"], fast["winner"]) == ("pipeline", "zero")


def test_the_comparison_is_rendered_and_labelled_modelled(versus):
    report = simulate.simulation_report([_case()], scaling=False, parallelism=list(versus.values()))
    assert report["parallelism"] and report["parallelism"][0]["network"] == "slow"
    markdown = render_markdown(report)
    assert "## ZeRO or pipelines (predicted)" in markdown and "MODELLED" in markdown
    assert "### Network slow: 10 Gb/s" in markdown and "### Network fast: 100 Gb/s" in markdown
    assert "- network slow, pipeline faster (1): pair x8 gpt2-medium" in markdown


def test_global_batch_size_reaches_the_zero_or_pipelines_comparison(tmp_path):
    import json

    from poplar_bench.cli import main

    cluster = cluster_files.CLUSTER_DIR / "a100-80gb+a100-40gb-x8.json"
    argv = ["simulate", "--cluster", str(cluster), "--model", SHAPE.name, "--global-batch-size", "96"]
    assert main([*argv, "--output-dir", str(tmp_path), "--name", "sim"]) == 0
    report = json.loads((tmp_path / "sim.json").read_text())
    assert [s["global_batch_size"] for s in report["scenarios"]] == [96]
    assert [row["global_batch_size"] for row in report["parallelism"]] == [96, 96]


def test_profiles_without_cluster_name_the_shipped_cluster_they_do_not_cover(tmp_path, capsys):
    from poplar_bench.cli import main
    from poplar_ext.search.examples import example_profiles_dir

    argv = ["simulate", "--profiles", str(example_profiles_dir()), "--output-dir", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "poplar_bench/clusters/a100-80gb+a100-40gb-x8.json (a shipped cluster" in err
    assert "'A100-40GB' has no profile" in err and "--cluster FILE" in err
    assert not list(tmp_path.iterdir())


def test_a_case_no_policy_can_plan_is_said_on_stderr(tmp_path, capsys):
    # The report is written all the same (its rows say why), but not with only its paths printed.
    import shutil

    from poplar_bench.cli import main
    from poplar_ext.search.examples import example_profiles_dir

    profiles = tmp_path / "profiles"
    shutil.copytree(example_profiles_dir(), profiles, ignore=shutil.ignore_patterns("*stage1.json", "layers"))
    argv = ["simulate", "--profiles", str(profiles), "--cluster", str(profiles / "cluster.json"), "--zero-stage", "1"]
    assert main([*argv, "--no-pipelines", "--output-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "poplar-bench simulate: " in err and ": no policy has a plan: " in err and "stage 1" in err, err
    assert (tmp_path / "simulation.json").is_file()
