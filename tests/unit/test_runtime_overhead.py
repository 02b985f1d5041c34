"""The runtime-overhead report: paired block ratios, the goal, the markdown (synthetic timings)."""

from __future__ import annotations

import math

import pytest

from poplar_bench.runtime_overhead import measure_wrapper_cost, render_markdown, summarise


def _report(raw_blocks, wrapped_blocks):
    cpu = {"raw": [0.02] * 4, "wrapped": [0.0201] * 4}
    return summarise(
        {"raw": raw_blocks, "wrapped": wrapped_blocks}, cpu, blocks=len(raw_blocks), block_iterations=2, warmup=1
    )


def test_paired_blocks_cancel_drift():
    # The machine slows down over time; each wrapped block is 1% slower than its raw pair.
    raw = [[0.05 * k, 0.05 * k] for k in (1, 2, 3, 4)]
    wrapped = [[0.0505 * k, 0.0505 * k] for k in (1, 2, 3, 4)]
    report = _report(raw, wrapped)
    assert report["overhead_ratio"] == pytest.approx(1.01)
    assert report["goal"]["met"]
    assert report["cpu_time_ratio"] == pytest.approx(1.005)


def test_goal_not_met():
    report = _report([[0.05, 0.05]] * 4, [[0.06, 0.06]] * 4)
    assert not report["goal"]["met"]
    assert "goal <= 1.02: NOT met" in render_markdown(report)


def test_markdown_warns_when_blocks_scatter():
    report = _report(
        [[0.05, 0.05], [0.05, 0.05], [0.05, 0.05], [0.05, 0.05]],
        [[0.04, 0.04], [0.05, 0.05], [0.05, 0.05], [0.07, 0.07]],
    )
    assert "cannot resolve 2%" in render_markdown(report)


def test_wrapper_cost_is_measured():
    cost = measure_wrapper_cost(iterations=200, repeats=1)["added_cpu_per_iteration_s"]
    assert math.isfinite(cost)


def test_the_overhead_bench_shows_its_progress_on_stderr(monkeypatch, capsys):
    import poplar_bench.local_ranks as local_ranks
    from poplar_bench import runtime_overhead

    monkeypatch.setattr(local_ranks, "run_ranks", lambda *args, **kwargs: [{"blocks": {}, "cpu": {}}])
    monkeypatch.setattr(
        runtime_overhead, "summarise", lambda *args, **kwargs: {"raw_deepspeed": {"median_iteration_s": 1.0}}
    )
    monkeypatch.setattr(runtime_overhead, "measure_wrapper_cost", lambda: {"added_cpu_per_iteration_s": 0.01})
    report = runtime_overhead.run_overhead(blocks=3, block_iterations=2)
    assert report["wrapper_cost"]["fraction_of_raw_median_iteration"] == 0.01
    assert capsys.readouterr().err.splitlines() == [
        f"[poplar-bench overhead] {runtime_overhead.WORLD_SIZE} ranks: 3 blocks of 2 iterations per engine",
        "[poplar-bench overhead] the wrapper's own cost, around a no-op engine",
    ]
