"""Search speed: the bench's report shape, and large global batches searched exactly.

Timings are not asserted here (they live in poplar_bench/search_speed.py); these tests check
that the batch-independent search of stages 0/1 still finds the optimum when the
global batch is large, against oracles that share no code with it: a closed form for
one rank, every split for two ranks, and for more ranks a certificate that the batch
cannot be split at the last breakpoint below the found time.
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy.signal import fftconvolve

from poplar_bench.search_speed import run_search_speed, write_report
from poplar_bench.synthetic import random_profiles, synthetic_profile
from poplar_ext.plan.formats import load_cluster, load_profiles
from poplar_ext.search.cost import build_stage_model
from poplar_ext.search.policies import allocate

EXAMPLES = Path(__file__).resolve().parents[2] / "poplar_ext" / "search" / "example_profiles"


def test_report_has_every_cell_and_goal_and_is_written(tmp_path):
    report = run_search_speed(
        rank_counts=(8, 64),
        type_counts=(1, 2),
        repeats=1,
        large_batches=(2**31,),
        large_repeats=1,
        example_dir=EXAMPLES,
        lever_ranks=16,
        lever_types=3,
    )
    assert [(c["ranks"], c["device_types"]) for c in report["cells"]] == [(8, 1), (8, 2), (64, 1), (64, 2)]
    levers = report["lever_cells"]
    assert [(c["zero_stage"], c["global_batch_size"]) for c in levers] == [
        (stage, batch) for stage in (0, 1, 2) for batch in (32 * 16 + 7, None)
    ]
    assert all(c["ranks"] == 16 and c["settings"] == 4**3 and len(c["repetitions_s"]) == 1 for c in levers)
    cell = report["cells"][0]
    assert cell["fixed_batch"]["global_batch_size"] == 32 * 8 + 7
    assert len(cell["auto_batch"]["repetitions_s"]) == 1
    large = report["large_batch_cells"]
    assert {(c["problem"], c["zero_stage"], c["global_batch_size"]) for c in large} == {
        (problem, stage, 2**31)
        for problem in ("synthetic 4096 ranks x 6 types", "shipped example")
        for stage in range(4)
    }
    assert all(c["plan_global_batch_size"] == 2**31 and c["peak_memory_bytes"] > 0 for c in large)
    assert [g["goal"] for g in report["goals"]] == [
        "64 ranks (1 to 6 device types) under 0.05 s",
        "any global batch up to 2^31, every stage, 4096 ranks x 6 types and the shipped example under 1.0 s",
        "memory levers: 3 device types x 4 lever variants x 16 ranks, stages 0-2, fixed and automatic batch "
        "under 1.0 s",
    ]
    assert "modelled" in report["profiles_note"] and "synthetic" in report["profiles_note"]
    assert report["machine"]["libraries"]["numpy"]
    paths = write_report(report, tmp_path)
    assert json.loads(paths[0].read_text())["cells"] == report["cells"]
    markdown = paths[1].read_text()
    assert "| 64 | 2 |" in markdown and "| shipped example | 3 | 2147483648 |" in markdown
    assert "| 16 | 3 | 64 | 1 | automatic |" in markdown


def test_lever_cells_time_every_seeded_problem_and_report_the_slowest_per_stage(tmp_path):
    report = run_search_speed(
        rank_counts=(), type_counts=(), repeats=1, large_batches=(), lever_ranks=12, lever_types=2, lever_seeds=(3, 5)
    )
    levers = report["lever_cells"]
    assert [(c["seed"], c["zero_stage"], c["global_batch_size"]) for c in levers] == [
        (seed, stage, batch) for seed in (3, 5) for stage in (0, 1, 2) for batch in (32 * 12 + 7, None)
    ]
    assert "problems seeded 3, 5" in report["lever_method"]
    markdown = write_report(report, tmp_path)[1].read_text()
    assert "| 12 | 2 | 16 | 1 | automatic | 5 |" in markdown
    slowest = max(c["median_s"] for c in levers if c["zero_stage"] == 1 and c["global_batch_size"] is None)
    assert f"| 1 | automatic | 2 | {1000 * slowest:.1f} |" in markdown


# ----------------------------------------------------------------------------------
# Oracles that share no code with poplar_ext/search/poplar_independent.py
# ----------------------------------------------------------------------------------
def _most_steps(time_s, table):
    """Per size, the most micro-steps whose busy time (the cost model's float product) is <= time_s."""
    steps = np.floor(time_s / table).astype(np.int64)
    while np.any(too_many := steps * table > time_s):
        steps -= too_many
    while np.any(one_more := (steps + 1) * table <= time_s):
        steps += one_more
    return steps


def _shortest_busy_s(table, batch):
    """For every work w in 0..batch, the shortest busy time of one rank running w samples (w = b * s)."""
    best = np.full(batch + 1, np.inf)
    for size in range(1, min(len(table), batch) + 1):
        steps = np.arange(1, batch // size + 1)
        best[size * steps] = np.minimum(best[size * steps], steps * table[size - 1])
    return best


def _splits_at(model, time_s, batch):
    """Whether the ranks can run exactly `batch` samples, each busy at most `time_s`.

    Rank by rank, the set of reachable deficits below every rank's most work (masks
    over [0, capacity - batch], convolved one rank at a time).
    """
    ranks = [model.devices[i].step_time_table_s for i in model.rank_device_index]
    works = []
    for table in ranks:
        steps = _most_steps(time_s, table)
        if steps[0] < 1:
            return False
        works.append([(size, int(s)) for size, s in enumerate(steps.tolist(), start=1) if s >= 1])
    most = [max(size * s for size, s in w) for w in works]
    deficit = sum(most) - batch
    if deficit < 0:
        return False
    reach = np.zeros(deficit + 1)
    reach[0] = 1
    for top, options in zip(most, works):
        single = np.zeros(deficit + 1)
        for size, steps in options:
            lowest = max(1, math.ceil((top - deficit) / size))
            single[top - size * np.arange(lowest, steps + 1)] = 1
        reach = (fftconvolve(reach, single)[: deficit + 1] > 0.5).astype(float)
    return bool(reach[deficit] > 0)


def _previous_breakpoint(model, time_s):
    """The largest s * t(b) (s >= 1) of any type below `time_s`."""
    found = 0.0
    for device in model.devices:
        table = device.step_time_table_s
        steps = _most_steps(time_s, table)
        steps = np.where(steps * table >= time_s, steps - 1, steps)
        found = max(found, float(np.max(steps * table)))
    return found


def _check_exact_split(model, allocation, batch):
    sizes, steps = allocation.micro_batch_sizes, allocation.accumulation_steps
    caps = np.array([model.devices[i].max_micro_batch_size for i in model.rank_device_index])
    assert int(np.sum(sizes * steps)) == batch
    assert np.all(sizes >= 1) and np.all(steps >= 1) and np.all(sizes <= caps)
    return float(np.max(model.rank_busy_times_s(sizes, steps)))


def _one_type_model(rng, stage, num_ranks_by_type, max_cap):
    names = [f"gpu{i}" for i in range(len(num_ranks_by_type))]
    profiles = {p.device_type: p for p in random_profiles(rng, names, zero_stages=(stage,), max_cap=max_cap)}
    ranks = [name for name, count in zip(names, num_ranks_by_type) for _ in range(count)]
    return build_stage_model(profiles, ranks, stage)


# ----------------------------------------------------------------------------------
# Large global batches, few ranks: against the oracles
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(30))
def test_one_rank_any_batch_up_to_2_31_is_the_best_divisor(seed):
    rng = np.random.default_rng(4000 + seed)
    model = _one_type_model(rng, seed % 2, [1], max_cap=int(rng.integers(1, 200)))
    batch = int(rng.choice([2**31, 2**31 - 1, 10**9, 3 * 7 * 11 * 13 * 17 * 19 * 23 * 29, int(rng.integers(1, 2**31))]))
    table = model.devices[0].step_time_table_s
    best = min((batch // b) * table[b - 1] for b in range(1, min(len(table), batch) + 1) if batch % b == 0)
    assert _check_exact_split(model, allocate("poplar", model, batch).allocation, batch) == best


@pytest.mark.parametrize("seed", range(24))
def test_two_ranks_large_batch_is_the_best_of_every_split(seed):
    rng = np.random.default_rng(5000 + seed)
    counts = [2] if seed % 3 == 0 else [1, 1]
    model = _one_type_model(rng, seed % 2, counts, max_cap=int(rng.integers(2, 40)))
    batch = int(rng.integers(20_000, 200_000))
    first, second = (_shortest_busy_s(model.devices[i].step_time_table_s, batch) for i in model.rank_device_index)
    best = float(np.min(np.maximum(first[1:batch], second[batch - 1 : 0 : -1])))
    assert _check_exact_split(model, allocate("poplar", model, batch).allocation, batch) == best


@pytest.mark.parametrize("seed", range(12))
def test_a_few_ranks_with_a_large_batch_cannot_split_any_earlier(seed):
    # Caps that share a factor with each other and not with the batch: the batch only
    # splits once some rank leaves its best micro-batch, far above the capacity bound.
    rng = np.random.default_rng(6000 + seed)
    profiles = {
        name: synthetic_profile(
            name,
            zero_stage=seed % 2,
            max_micro_batch_size=cap,
            overhead_s=float(rng.uniform(0.005, 0.05)),
            seconds_per_sample=float(rng.uniform(0.001, 0.02)),
        )
        for name, cap in (("a", 6 * int(rng.integers(1, 8))), ("b", 6 * int(rng.integers(1, 8))))
    }
    ranks = ["a"] * int(rng.integers(1, 4)) + ["b"] * int(rng.integers(1, 4))
    model = build_stage_model(profiles, ranks, seed % 2)
    batch = int(rng.integers(10**6, 10**8)) // 6 * 6 + int(rng.integers(1, 6))
    busy_s = _check_exact_split(model, allocate("poplar", model, batch).allocation, batch)
    assert not _splits_at(model, _previous_breakpoint(model, busy_s), batch)


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("batch", [4_194_304, 10**9 + 7, 2**31])
def test_the_shipped_example_at_large_batches_cannot_split_any_earlier(stage, batch):
    profiles = {p.device_type: p for p in load_profiles(EXAMPLES) if p.zero_stage == stage}
    model = build_stage_model(profiles, load_cluster(EXAMPLES / "cluster.json").rank_device_types, stage)
    busy_s = _check_exact_split(model, allocate("poplar", model, batch).allocation, batch)
    assert not _splits_at(model, _previous_breakpoint(model, busy_s), batch)


def test_search_speed_shows_its_progress_on_stderr(capsys):
    run_search_speed(rank_counts=(8,), type_counts=(1, 2), repeats=1, large_batches=(), lever_ranks=16, lever_types=2)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "[poplar-bench search-speed] 8 ranks x 1 device types (1 repeats)",
        "[poplar-bench search-speed] 8 ranks x 2 device types (1 repeats)",
        "[poplar-bench search-speed] memory levers: 2 types x 16 ranks, seeds [0]",
    ], lines
