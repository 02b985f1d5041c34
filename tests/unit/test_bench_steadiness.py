"""`poplar-bench demo --repetitions N` (issue 35): the runs' spreads against the goals, and the command line."""

from __future__ import annotations

import pytest

from poplar_bench import steadiness
from poplar_bench.cli import build_parser


def _report(share: float, errors: dict[str, float], overrun: float | None = 0.001) -> dict:
    policies = [
        {"policy": p, "status": "ok", "share_of_ideal": share if p == "poplar" else 0.5, "prediction_error": e}
        for p, e in errors.items()
    ] + [{"policy": "proportional", "status": "infeasible"}]
    return {
        "data_source": "measured on CPU ranks with EMULATED device types",
        "machine": {"hostname": "h"},
        "scenarios": [{"policies": policies, "emulation_overrun_share": overrun, "profiles_from_cache": False}],
    }


def test_spreads_are_largest_minus_smallest_and_held_to_the_goals():
    reports = [
        _report(0.96, {"uniform": 0.01, "poplar": -0.02}),
        _report(0.95, {"uniform": 0.00, "poplar": 0.02}),
        _report(0.965, {"uniform": -0.01, "poplar": 0.00}),
    ]
    summary = steadiness.summarize_steadiness(reports)
    assert summary["poplar_share_spread"] == pytest.approx(0.015)
    assert summary["prediction_error_spread"] == {"poplar": pytest.approx(0.04), "uniform": pytest.approx(0.02)}
    goals = {g["goal"]: g["met"] for g in summary["goals"]}
    assert goals == {
        "poplar share of the measured ideal: spread over the runs": True,
        "poplar prediction error: spread over the runs": False,  # 4 points
        "uniform prediction error: spread over the runs": True,
    }
    assert [r["run"] for r in summary["runs"]] == [1, 2, 3]
    text = steadiness.render_steadiness(summary)
    assert "| 2 | 0.950 | +0.020 | +0.000 | 0.10% |" in text
    assert "EMULATED" in text


def test_a_run_without_a_poplar_plan_fails_the_share_goal():
    reports = [_report(0.96, {"poplar": 0.0}), _report(0.96, {"uniform": 0.0})]
    goals = {g["goal"]: g["met"] for g in steadiness.summarize_steadiness(reports)["goals"]}
    assert goals["poplar share of the measured ideal: spread over the runs"] is False


def test_the_demo_takes_a_number_of_repetitions():
    parser = build_parser()
    assert parser.parse_args(["demo"]).repetitions == 1
    assert parser.parse_args(["demo", "--repetitions", "5"]).repetitions == 5
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--repetitions", "0"])


def test_the_summary_gives_the_time_and_machine_of_one_run():
    # The summary's line says "the last of N runs": its machine (load average included) came from the first.
    first, last = _report(0.96, {"poplar": 0.0}), _report(0.96, {"poplar": 0.0})
    first.update(created_utc="2026-11-29T10:00:00+00:00", machine={"hostname": "h", "load_average": [9.0]})
    last.update(created_utc="2026-11-29T11:00:00+00:00", machine={"hostname": "h", "load_average": [1.0]})
    summary = steadiness.summarize_steadiness([first, last])
    assert (summary["created_utc"], summary["machine"]) == (last["created_utc"], last["machine"])


def test_a_run_whose_ranks_fail_is_named_in_the_summary_and_the_others_still_count(tmp_path, monkeypatch, capsys):
    # A failed run ended `demo --repetitions N` with "poplar-bench demo: ranks failed: ..." and no summary: the runs
    # made before it (minutes each) were summarised nowhere, and the ones after it never ran.
    import json

    from poplar_bench import cli, demo
    from poplar_bench.local_ranks import RankFailure, RankOutcome

    made = []

    def fake_demo(settings, *, out_dir, name):
        made.append(name)
        if len(made) == 2:
            error = "Traceback ...\nRuntimeError: Connection closed by peer"
            raise RankFailure([RankOutcome(rank=2, ok=False, value=None, error=error, exit_code=1, log_path=None)])
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{name}.json"
        path.write_text(json.dumps(_report(0.96, {"poplar": 0.01})))
        return [path]

    monkeypatch.setattr(demo, "run_demo", fake_demo)
    assert cli.main(["demo", "--repetitions", "3", "--output-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "poplar-bench demo: 1 of 3 runs failed (run 2); the summary of every run" in err
    assert made == ["demo-1", "demo-2", "demo-3"]
    summary = json.loads((tmp_path / "demo-steadiness.json").read_text())
    assert [r["run"] for r in summary["runs"]] == [1, 2, 3] and summary["failed_runs"] == [2]
    assert summary["runs"][1]["failed"] == "rank 2 (exit code 1): RuntimeError: Connection closed by peer"
    assert not any(goal["met"] for goal in summary["goals"]), "a run not measured cannot show a steady instrument"
    text = (tmp_path / "demo-steadiness.md").read_text()
    assert "| 2 | failed: rank 2 (exit code 1): RuntimeError: Connection closed by peer |" in text
    assert "**1 of 3 runs failed** and were not measured (no goal is met without them): run 2." in text
