"""poplar_bench.drift's report from rank results (no processes), and its command line."""

from __future__ import annotations

import pytest

from poplar_bench.cli import main as bench_main
from poplar_bench.drift import RUNS, DriftSettings, render_markdown, summarize


def _rank_results(
    settings: DriftSettings, iteration_s: dict[str, list[float]], *, hook_s: float = 0.01, replans: int = 1
) -> list[dict]:
    history = [{"start_step": 0, "reason": "plan", "allocation": [(8, 8), (4, 8), (2, 8)]}]
    results = []
    for rank in range(3):
        runs = {}
        for run in RUNS:
            extra = [{"start_step": 12, "reason": "re-balanced", "allocation": [(4, 8), (6, 8), (2, 8)]}] * (
                replans if run == "adaptive-drift" else 0
            )
            runs[run] = {
                "iteration_s": iteration_s[run],
                "rebalance_hook_s": hook_s if run.startswith("adaptive") else 0.0,
                "history": history + extra,
                "warmup_iterations": 1,
            }
        results.append(
            {
                "rank": rank,
                "device_type": f"t{rank}",
                "runs": runs,
                "slowdown": 1.0,
                # best standalone throughputs 100, 50, 25 samples/s: ideal 175, 115 while rank 0 is 2.5x slower
                "standalone": [
                    {"micro_batch_size": 10, "micro_step_time_s": [10.0 / ([100.0, 50.0, 25.0][rank] * f)] * 3}
                    for f in (0.5, 1.0)
                ],
            }
        )
    return results


def test_the_ideal_follows_the_drift_and_the_goals_are_judged():
    settings = DriftSettings(drift_at=4, recover_at=12, drift_iterations=16, check_interval_steps=2)
    batch = settings.global_batch_size
    steady = [batch / 160.0] * 16  # 160 samples/s against an ideal of 175
    # Adaptive: slow right after the drift, at 0.95 of the drifted ideal (115) from step 8 on.
    adaptive = [batch / 160.0] * 3 + [batch / 80.0] * 4 + [batch / (0.95 * 115.0)] * 5 + [batch / 160.0] * 4
    static = [batch / 160.0] * 3 + [batch / 80.0] * 8 + [batch / 160.0] * 5
    summary = summarize(
        settings,
        _rank_results(
            settings,
            {
                "static-drift": static,
                "adaptive-drift": adaptive,
                "static-steady": steady,
                "adaptive-steady": steady,
            },
        ),
    )
    drift = summary["runs"]["adaptive-drift"]
    assert drift["steps_done"][:2] == [1, 2]
    assert drift["ideal_samples_per_s"][2] == pytest.approx(175.0) and drift["ideal_samples_per_s"][3] == pytest.approx(
        115.0
    )
    assert drift["ideal_samples_per_s"][11] == pytest.approx(175.0), "recovered at step 12"
    share_goal, cost_goal, replan_goal = summary["goals"]
    assert share_goal["met"] and share_goal["value"] == pytest.approx(0.95)
    assert cost_goal["value"] == pytest.approx(0.01 / sum(steady)) and cost_goal["met"] == (0.01 / sum(steady) <= 0.01)
    assert replan_goal["met"] and drift["replans"] == 1
    text = render_markdown(summary)
    assert "| adaptive-drift | 1 |" in text and "from step 12" in text


def test_a_slow_adaptive_run_misses_the_goal():
    settings = DriftSettings(drift_at=4, recover_at=12, drift_iterations=16, check_interval_steps=2)
    batch = settings.global_batch_size
    slow = [batch / 160.0] * 3 + [batch / 80.0] * 8 + [batch / 160.0] * 5
    summary = summarize(settings, _rank_results(settings, {run: slow for run in RUNS}, hook_s=1.0, replans=0))
    assert [goal["met"] for goal in summary["goals"]] == [False, False, True]


def test_the_drift_command_refuses_a_schedule_that_ends_before_it_starts(capsys):
    assert bench_main(["drift", "--drift-at", "10", "--recover-at", "5"]) == 2
    assert "expected 0 < drift_at < recover_at" in capsys.readouterr().err


def test_the_drift_command_names_the_options_of_a_schedule_it_refuses(capsys):
    # The settings' field drift_iterations is the option --iterations: each refusal names the options too.
    assert bench_main(["drift", "--recover-at", "100", "--iterations", "36"]) == 2
    assert "found 8, 100, 36 (--drift-at, --recover-at, --iterations)" in capsys.readouterr().err
    assert bench_main(["drift", "--factor", "0.5"]) == 2
    assert "factor: expected a number >= 1, found 0.5 (--factor)" in capsys.readouterr().err


def test_drift_trainer_runs_through_the_trainer_into_its_own_report_and_cache(tmp_path, monkeypatch):
    from poplar_bench import drift

    called = {}

    def no_run(settings, *, out_dir, name):
        called.update(settings=settings, out_dir=out_dir, name=name)
        return []

    monkeypatch.setattr(drift, "run_drift", no_run)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert bench_main(["drift", "--trainer", "--output-dir", str(tmp_path / "out")]) == 0
    assert called["name"] == "drift_trainer" and called["settings"].loop == "trainer"
    # The Trainer's ranks carry transformers: their emulated capacities and profiles are not the demo's.
    assert called["settings"].profiles_dir() == tmp_path / "poplar-ext" / "demo" / "trainer" / "profiles"
    assert bench_main(["drift", "--output-dir", str(tmp_path / "out")]) == 0
    assert called["name"] == "drift" and called["settings"].loop == "plain"
    assert called["settings"].profiles_dir() == tmp_path / "poplar-ext" / "demo" / "profiles"


def test_the_report_says_what_trained_and_on_which_machine():
    settings = DriftSettings(drift_at=4, recover_at=12, drift_iterations=16, check_interval_steps=2, loop="trainer")
    steady = [settings.global_batch_size / 160.0] * 16
    summary = summarize(settings, _rank_results(settings, {run: steady for run in RUNS}))
    summary.update(
        total_s=95.0,
        load_average_at_start=[2.5, 2.0, 1.5],
        machine={"hostname": "vm", "cpu": "AMD EPYC", "usable_cpus": 2, "gpus": None, "load_average": [3.0, 2.2, 1.6]},
    )
    text = render_markdown(summary)
    assert text.startswith("# Drift: static poplar against adaptive re-balancing through the Hugging Face Trainer")
    assert "Training: PoplarTrainer" in text and "4 layers, width 128" in text
    assert "load average (1 / 5 / 15 min) 2.5 / 2.0 / 1.5 at the start, 3.0 / 2.2 / 1.6 at the end" in text
    with pytest.raises(ValueError, match="loop: expected one of plain, trainer"):
        DriftSettings(loop="accelerate")


class _EmptyLoader:
    """A loader whose passes yield nothing; a third pass means the stream spins (fails instead of hanging)."""

    passes = 0

    def __iter__(self):
        self.passes += 1
        assert self.passes < 3, "the stream asked for pass after empty pass"
        return iter(())


def test_an_endless_stream_over_an_empty_loader_fails_at_once_naming_it():
    from poplar_bench.local_ranks import endless_batches

    stream = endless_batches([[1], [2]], "the two-batch loader")
    assert [next(stream) for _ in range(5)] == [[1], [2], [1], [2], [1]]
    with pytest.raises(RuntimeError, match="the empty loader: a pass over it yielded no batch"):
        next(endless_batches(_EmptyLoader(), "the empty loader"))


def test_the_drift_command_refuses_a_schedule_too_short_to_judge_the_adaptive_goal(capsys, tmp_path, monkeypatch):
    from poplar_bench import drift

    monkeypatch.setattr(drift, "run_drift", lambda *a, **k: pytest.fail("the runs started"))
    # --drift-at 2 --recover-at 4 --check-interval-steps 1 ran a whole launch, then reported the goal as
    # "median share over iterations 5-4 (static: nan) ... None (NOT met)": no iteration to judge.
    argv = ["drift", "--iterations", "6", "--drift-at", "2", "--recover-at", "4", "--check-interval-steps", "1"]
    argv += ["--output-dir", str(tmp_path), "--cache-dir", str(tmp_path / "cache")]
    assert bench_main(argv) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("poplar-bench drift: error: ") and "expected recover_at > drift_at + 2 x check_interval" in err
    )
    assert "found 2, 4, 1" in err
    DriftSettings(drift_at=2, recover_at=5, drift_iterations=6, check_interval_steps=1)  # one iteration to judge
