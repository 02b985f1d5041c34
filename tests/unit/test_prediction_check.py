"""poplar_bench.prediction_check: the summary of demo reports across stages and rank counts (no runs)."""

from __future__ import annotations

import dataclasses

import pytest

from poplar_bench.cli import build_parser
from poplar_bench.prediction_check import (
    DEFAULT_CASES,
    PredictionCase,
    render_markdown,
    repetition_errors,
    summarize,
)


def _report(ranks: int, policies: dict[str, tuple[float, list[float]] | None]) -> dict:
    entries = []
    for name, timing in policies.items():
        if timing is None:
            entries.append({"policy": name, "status": "infeasible"})
            continue
        predicted_s, measured_s = timing
        entries.append(
            {
                "policy": name,
                "status": "ok",
                "share_of_ideal": 0.9,
                "predicted": {"iteration_time_s": predicted_s},
                "measured": {
                    "iteration_time_s": {"median": sorted(measured_s)[len(measured_s) // 2], "repetitions": measured_s}
                },
            }
        )
    return {"scenarios": [{"device_types": {f"t{i}": {} for i in range(ranks)}, "policies": entries}]}


def test_errors_are_per_measured_repetition_and_summarised_by_the_median_of_their_size():
    entry = _report(2, {"poplar": (1.0, [1.25, 0.8, 1.0])})["scenarios"][0]["policies"][0]
    assert repetition_errors(entry) == pytest.approx([-0.2, 0.25, 0.0])
    summary = summarize([(PredictionCase(name="a", zero_stage=2), _report(2, {"poplar": (1.0, [1.25, 0.8, 1.0])}))])
    (row,) = summary["rows"]
    assert row["ranks"] == 2 and row["zero_stage"] == 2 and row["repetitions"] == 3
    assert row["median_abs_error"] == pytest.approx(0.2), "median of |errors| 0.2, 0.25, 0"
    assert row["median_error"] == pytest.approx(0.0)
    assert summary["goal_met"] is False, "0.2 exceeds the 5% goal"


def test_the_goal_holds_only_when_every_case_and_policy_is_within_five_percent():
    good = _report(3, {"uniform": (1.0, [1.02, 0.99, 1.05]), "poplar": (2.0, [2.1, 2.0, 1.95]), "proportional": None})
    bad = _report(4, {"poplar": (1.0, [1.3, 1.25, 1.2])})
    assert summarize([(PredictionCase(name="good", zero_stage=0), good)])["goal_met"] is True
    summary = summarize(
        [(PredictionCase(name="good", zero_stage=0), good), (PredictionCase(name="bad", zero_stage=3), bad)]
    )
    assert summary["goal_met"] is False
    assert summary["worst_median_abs_error"] == pytest.approx(1 - 1 / 1.25)
    text = render_markdown(summary)
    assert "| bad | 3 | 4 | poplar | 3 | 20.0% | -20.0% | 0.900 |" in text
    assert "| good | 0 | 3 | proportional | infeasible |" in text and "goal NOT met" in text


def test_the_report_gives_the_load_and_the_cpus_without_guessing_who_else_ran():
    report = {
        **_report(2, {"poplar": (1.0, [1.0, 1.0, 1.0])}),
        "machine": {"load_average": [0.4, 0.5, 0.6], "usable_cpus": 2},
    }
    text = render_markdown(summarize([(PredictionCase(name="a", zero_stage=1), report)]))
    assert "Load average (1 min) at the end of each case: 0.4 (2 usable CPUs; the ranks' own load included)." in text
    assert "other sessions" not in text


def test_nothing_measured_is_not_a_met_goal():
    assert summarize([(PredictionCase(name="x", zero_stage=1), _report(2, {"poplar": None}))])["goal_met"] is False


def test_the_default_cases_cover_every_stage_and_two_to_four_ranks():
    assert {case.zero_stage for case in DEFAULT_CASES} == {0, 1, 2, 3}
    assert {3 if case.slowdowns is None else len(case.slowdowns) for case in DEFAULT_CASES} == {2, 3, 4}


def test_the_predictions_command_parses_and_refuses_zero_rounds(capsys):
    args = build_parser().parse_args(["predictions", "--rounds", "2"])
    assert args.rounds == 2 and args.command == "predictions"
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["predictions", "--rounds", "0"])
    assert exited.value.code == 2 and "--rounds" in capsys.readouterr().err


def test_cases_are_drawn_from_the_seed_alone():
    from poplar_bench.prediction_check import draw_cases

    assert draw_cases(7, 6, cores=2) == draw_cases(7, 6, cores=2)
    assert draw_cases(7, 6, cores=2) != draw_cases(8, 6, cores=2)
    assert draw_cases(7, 3, cores=2) == draw_cases(7, 6, cores=2)[:3], "more cases extend the same draw"
    with pytest.raises(ValueError, match="count"):
        draw_cases(7, 0)


@pytest.mark.parametrize("cores", [2, 8])
def test_drawn_cases_stay_within_the_validity_range_and_span_stages_and_rank_counts(cores):
    from poplar_bench.demo_config import devices_from_slowdowns
    from poplar_bench.prediction_check import (
        GLOBAL_BATCH_SIZES,
        MAX_SLOWDOWN,
        MIN_CORE_DEMAND,
        MIN_SLOWDOWN,
        draw_cases,
        max_core_demand,
    )

    cases = draw_cases(3, 40, cores=cores)
    assert len({case.name for case in cases}) == 40
    for case in cases:
        assert case.zero_stage in (0, 1, 2, 3) and 2 <= len(case.slowdowns) <= 4
        assert all(MIN_SLOWDOWN <= s <= MAX_SLOWDOWN for s in case.slowdowns)
        assert MIN_CORE_DEMAND <= case.core_demand <= max_core_demand(cores) <= cores / 2
        assert case.global_batch_size in GLOBAL_BATCH_SIZES
    assert {case.zero_stage for case in cases} == {0, 1, 2, 3}
    assert {len(case.slowdowns) for case in cases} == {2, 3, 4}
    if cores == 2:  # on 8 cores 4 ranks at the least slowdown keep 2.7 busy: the range is the slowdowns'
        demands = sorted(case.core_demand for case in cases)
        assert demands[0] < 0.4 and demands[-1] > 0.8, "spans the range"
        devices_from_slowdowns(list(cases[0].slowdowns))  # the demo accepts them


def test_the_report_keeps_the_seed_and_cases_and_names_the_worst_case():
    from poplar_bench.prediction_check import draw_cases

    first, second = draw_cases(11, 2, cores=2)
    summary = summarize(
        [
            (first, _report(2, {"poplar": (1.0, [1.02, 1.0, 0.98])})),
            (second, _report(3, {"uniform": (1.0, [1.3, 1.25, 1.2])})),
        ],
        seed=11,
    )
    assert summary["seed"] == 11 and [c["name"] for c in summary["cases"]] == [first.name, second.name]
    assert summary["cases"][0]["slowdowns"] == list(first.slowdowns)
    assert summary["worst"]["case"] == second.name and summary["worst"]["policy"] == "uniform"
    text = render_markdown(summary)
    assert "Cases drawn from seed 11" in text and f"({second.name}, uniform)" in text


def test_the_predictions_command_draws_by_default_and_runs_the_fixed_cases_on_request():
    args = build_parser().parse_args(["predictions", "--seed", "5", "--cases", "4"])
    assert (args.seed, args.cases, args.fixed, args.rounds) == (5, 4, False, 3)
    assert build_parser().parse_args(["predictions", "--fixed"]).fixed is True


def test_the_check_cost_is_the_slowest_rank_per_repeat_with_the_sizes_timed():
    from poplar_bench.calibration_cost import render_check_cost, summarize_check_cost

    found = {"t0": {"outcome": "trusted", "measured_over_profiled": 1.02, "sizes": [22]}}
    ranks = [
        {"profiles_from_cache": True, "check_s": [3.0, 2.0, 2.5], "checks": found},
        {"profiles_from_cache": True, "check_s": [3.1, 1.9, 2.7], "checks": found},
    ]
    summary = summarize_check_cost(ranks, devices="emulated", load_average={"before": [1.0], "after": [2.0]})
    assert summary["check_s"] == [3.1, 2.0, 2.7] and summary["median_check_s"] == 2.7
    text = render_check_cost(summary)
    assert "3.10 s, 2.00 s, 2.70 s; median **2.70 s**" in text
    assert "profiles from the cache; sizes timed and findings: t0 at 22: 1.02 trusted" in text
    assert "before: [1.0], after: [2.0]" in text


def test_the_demo_checks_its_profiles_at_poplars_sizes_only():
    from poplar_bench.demo_worker import calibration_sizes
    from poplar_bench.synthetic import simple_cluster, synthetic_profile
    from poplar_ext.profiler.calibration import plan_sizes
    from poplar_ext.search import search_plan

    profiles = [
        synthetic_profile(t, zero_stage=1, max_micro_batch_size=48, overhead_s=0.01, seconds_per_sample=s)
        for t, s in (("fast", 0.001), ("slow", 0.004))
    ]
    cluster = simple_cluster({"fast": 1, "slow": 1})
    results = {
        policy: search_plan(profiles, cluster, global_batch_size=150, zero_stage=1, policy=policy)
        for policy in ("uniform", "proportional", "poplar")
    }
    assert calibration_sizes(results) == plan_sizes([results["poplar"].plan])
    assert plan_sizes([r.plan for r in results.values()]) != calibration_sizes(results), "the policies differ"
    without = {**results, "poplar": dataclasses.replace(results["poplar"], plan=None)}
    assert calibration_sizes(without) == plan_sizes([results["uniform"].plan, results["proportional"].plan])


def test_calibration_check_only_times_the_check_alone(tmp_path, monkeypatch):
    from poplar_bench import calibration_cost, cli

    calls = []
    monkeypatch.setattr(calibration_cost, "run_check_cost", lambda **kwargs: calls.append(kwargs) or [])
    monkeypatch.setattr(calibration_cost, "run_calibration_check", lambda **kwargs: calls.append(("demo", kwargs)))
    assert cli.main(["calibration", "--check-only", "--repeats", "2", "--output-dir", str(tmp_path)]) == 0
    assert calls == [{"out_dir": tmp_path, "repeats": 2, "cache_dir": None}]


def test_the_calibration_report_says_what_the_check_cost_and_found():
    from poplar_bench.calibration_cost import render_markdown as render_calibration
    from poplar_bench.calibration_cost import summarize as summarize_calibration

    unchecked = _report(3, {"poplar": (1.0, [1.2, 1.25, 1.3])})
    unchecked |= {"timings_s": {"rank0_profile_s": 0.5}, "machine": {"load_average": [6.0, 5.0, 4.0]}}
    unchecked["scenarios"][0] |= {"profiles_from_cache": True, "calibration": {}}
    unchecked["scenarios"][0]["policies"][0]["prediction_error"] = -0.2
    checked = {**unchecked, "timings_s": {"rank0_calibration_s": 2.5, "rank1_calibration_s": 3.0}}
    checked["scenarios"] = [
        {**unchecked["scenarios"][0], "calibration": {"t0": {"outcome": "rescaled", "measured_over_profiled": 1.25}}}
    ]
    summary = summarize_calibration([("cached, unchecked", unchecked), ("cached, checked", checked)])
    first, second = summary["runs"]
    assert first["calibration_s"] is None and second["calibration_s"] == 3.0, "the slowest rank's check"
    assert second["prediction_error"] == {"poplar": -0.2}
    text = render_calibration(summary)
    assert "| cached, checked | cached | 3.0 | t0 1.25 rescaled |" in text
    assert "| cached, unchecked | cached |  | not checked |" in text and "| -20.0% | 6.0 |" in text


def test_the_demo_counts_a_profile_kept_for_its_world_size_as_cached(tmp_path):
    # The demo's profiles folder serves runs of 3 and 6 ranks: the profiler moves a kept 3-rank profile back, a
    # reuse that the report must not call a measurement (nor skip calibration="cached" for).
    from poplar_bench.demo_worker import _cached_fingerprints
    from poplar_bench.synthetic import synthetic_profile
    from poplar_ext.plan.formats import save_profile
    from poplar_ext.profiler.cache import parked_profiles_dir

    kept = synthetic_profile("fast", zero_stage=1, max_micro_batch_size=4, overhead_s=0.001, seconds_per_sample=0.01)
    save_profile(kept, parked_profiles_dir(tmp_path, 3) / "fast.json")
    assert _cached_fingerprints(tmp_path, 3) == {kept.fingerprint}
    assert _cached_fingerprints(tmp_path, 6) == set()


def test_the_calibration_reports_give_the_machines_cpus_without_guessing_who_else_ran():
    # Both said "2 cores"/"2 CPUs, shared with other sessions" whatever the machine and whoever ran beside.
    from poplar_bench.calibration_cost import render_check_cost, render_markdown, summarize, summarize_check_cost

    report = _report(3, {"poplar": (1.0, [1.0])})
    report |= {"timings_s": {}, "machine": {"usable_cpus": 16, "load_average": [0.1, 0.2, 0.3]}}
    report["scenarios"][0] |= {"profiles_from_cache": False, "calibration": {}}
    text = render_markdown(summarize([("fresh", report)]))
    assert "16 usable CPUs" in text and "2 cores" not in text and "other sessions" not in text
    rank = {"check_s": [1.0], "profiles_from_cache": True, "checks": {}}
    summary = summarize_check_cost(
        [rank], devices="d", load_average={"before": [0.1], "after": [0.2]}, machine={"usable_cpus": 16}
    )
    text = render_check_cost(summary)
    assert "(16 usable CPUs; the ranks' own load included)" in text and "other sessions" not in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["predictions", "--fixed", "--seed", "3"], "--seed has no effect with --fixed"),
        (["predictions", "--fixed", "--cases", "2", "--seed", "4"], "--seed and --cases have no effect with --fixed"),
        (["calibration", "--repeats", "3"], "--repeats has no effect without --check-only"),
        (["calibration", "--check-only", "--rounds", "1"], "--rounds has no effect with --check-only"),
    ],
)
def test_an_option_the_chosen_mode_ignores_is_refused_before_any_work(argv, message, tmp_path, monkeypatch, capsys):
    # Each ran the whole bench (minutes) as if the option had not been given.
    from poplar_bench import calibration_cost, cli, prediction_check

    for module, name in (
        (prediction_check, "run_prediction_check"),
        (calibration_cost, "run_check_cost"),
        (calibration_cost, "run_calibration_check"),
    ):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("the bench started"))
    assert cli.main([*argv, "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"poplar-bench {argv[0]}: error: ") and message in err


def test_the_options_of_each_mode_still_run_it(tmp_path, monkeypatch):
    from poplar_bench import calibration_cost, cli, prediction_check

    calls = []
    monkeypatch.setattr(prediction_check, "run_prediction_check", lambda cases, **k: calls.append(len(cases)) or [])
    monkeypatch.setattr(calibration_cost, "run_check_cost", lambda **k: calls.append(k["repeats"]) or [])
    monkeypatch.setattr(calibration_cost, "run_calibration_check", lambda **k: calls.append(k["rounds"]) or [])
    out = ["--output-dir", str(tmp_path)]
    assert cli.main(["predictions", "--fixed", *out]) == 0
    assert cli.main(["predictions", "--seed", "3", "--cases", "2", *out]) == 0
    assert cli.main(["calibration", "--check-only", "--repeats", "4", *out]) == 0
    assert cli.main(["calibration", "--rounds", "5", *out]) == 0
    assert calls == [len(prediction_check.DEFAULT_CASES), 2, 4, 5]


def test_a_case_whose_ranks_fail_is_named_in_the_summary_and_the_other_cases_still_count(tmp_path, monkeypatch, capsys):
    # A failed case ended the command with a traceback, and no prediction_check.json or .md was written: the cases
    # measured before it (minutes each) were summarised nowhere, and the ones after it never ran.
    import json

    from poplar_bench import cli, demo
    from poplar_bench.local_ranks import RankFailure, RankOutcome
    from poplar_bench.prediction_check import draw_cases

    first, second = draw_cases(11, 2, cores=2)

    def fake_demo(settings, *, out_dir, name):
        if name == first.name:
            error = "Traceback ...\nEmulatedOutOfMemoryError: over"
            raise RankFailure([RankOutcome(rank=1, ok=False, value=None, error=error, exit_code=1, log_path=None)])
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{name}.json"
        path.write_text(json.dumps(_report(len(second.slowdowns), {"poplar": (1.0, [1.0, 1.01, 0.99])})))
        return [path]

    monkeypatch.setattr(demo, "run_demo", fake_demo)
    code = cli.main(["predictions", "--seed", "11", "--cases", "2", "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert f"poplar-bench predictions: 1 of 2 cases failed ({first.name})" in err and "Traceback" not in err
    summary = json.loads((tmp_path / "prediction_check.json").read_text())
    assert [c["name"] for c in summary["cases"]] == [second.name, first.name]
    assert summary["failed_cases"] == [
        {"case": first.name, "error": "rank 1 (exit code 1): EmulatedOutOfMemoryError: over"}
    ]
    assert [r["case"] for r in summary["rows"] if "median_abs_error" in r] == [second.name]
    assert summary["goal_met"] is False, "a case not measured cannot meet the goal"
    text = (tmp_path / "prediction_check.md").read_text()
    assert f"| {first.name} | {first.zero_stage} | {len(first.slowdowns)} | every policy | failed: rank 1" in text
    assert f"**1 of 2 cases failed** and were not measured (the goal is not met without them): {first.name}." in text
