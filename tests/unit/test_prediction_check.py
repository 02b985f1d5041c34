"""bench.prediction_check: the summary of demo reports across stages and rank counts (no runs)."""

from __future__ import annotations

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
    assert summary["goal_met"] is False, "0.2 exceeds the 10% goal"


def test_the_goal_holds_only_when_every_case_and_policy_is_within_ten_percent():
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
