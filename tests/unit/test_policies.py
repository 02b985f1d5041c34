"""Allocation policies (poplar_ext/search/policies.py): exact optimality of poplar, properties of all three."""

import dataclasses
import itertools

import numpy as np
import pytest
from scipy.optimize import Bounds, LinearConstraint, milp

from poplar_bench.synthetic import random_profiles, synthetic_profile
from poplar_ext.search import poplar_independent
from poplar_ext.search.cost import build_stage_model
from poplar_ext.search.policies import allocate, best_global_batch


def random_model(rng, *, stage, num_ranks, num_types, max_cap):
    names = [f"gpu{i}" for i in range(num_types)]
    profiles = {p.device_type: p for p in random_profiles(rng, names, zero_stages=(stage,), max_cap=max_cap)}
    ranks = [names[int(i)] for i in rng.integers(0, num_types, num_ranks)]
    return build_stage_model(profiles, ranks, stage)


def exhaustive_best_time(model, batch):
    """Shortest iteration time over every allocation the stage allows (inf when none)."""
    caps = [model.devices[i].max_micro_batch_size for i in model.rank_device_index]
    best = np.inf
    if model.synchronised_micro_steps:
        for steps in (s for s in range(1, batch + 1) if batch % s == 0):
            for sizes in itertools.product(*[range(1, c + 1) for c in caps]):
                if sum(sizes) * steps == batch:
                    best = min(best, model.iteration_time_s(np.array(sizes), np.full(len(caps), steps)))
        return best
    options = [[(b, s) for b in range(1, c + 1) for s in range(1, batch // b + 1)] for c in caps]
    for combo in itertools.product(*options):
        if sum(b * s for b, s in combo) == batch:
            sizes, steps = zip(*combo)
            best = min(best, model.iteration_time_s(np.array(sizes), np.array(steps)))
    return best


def check_allocation(model, allocation, batch=None):
    sizes, steps = allocation.micro_batch_sizes, allocation.accumulation_steps
    caps = np.array([model.devices[i].max_micro_batch_size for i in model.rank_device_index])
    assert np.all(sizes >= 1) and np.all(steps >= 1)
    assert np.all(sizes <= caps)
    if batch is not None:
        assert int(np.sum(sizes * steps)) == batch
    if model.synchronised_micro_steps:
        assert len(set(steps.tolist())) == 1
    assert allocation.iteration_time_s == model.iteration_time_s(sizes, steps)


@pytest.mark.parametrize("seed", range(40))
def test_poplar_equals_exhaustive_optimum_on_small_clusters(seed):
    rng = np.random.default_rng(seed)
    stage = seed % 4
    model = random_model(
        rng, stage=stage, num_ranks=int(rng.integers(2, 4)), num_types=int(rng.integers(1, 3)), max_cap=4
    )
    batch = int(rng.integers(model.world_size, 13))
    result = allocate("poplar", model, batch)
    best = exhaustive_best_time(model, batch)
    if not np.isfinite(best):
        assert not result.ok and result.reason
        return
    check_allocation(model, result.allocation, batch)
    assert result.allocation.iteration_time_s == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("seed", range(12))
def test_poplar_auto_batch_beats_every_batch_up_to_the_maximum(seed):
    rng = np.random.default_rng(100 + seed)
    stage = seed % 4
    model = random_model(rng, stage=stage, num_ranks=int(rng.integers(2, 4)), num_types=2, max_cap=3)
    limit = int(rng.integers(model.world_size + 1, 16))
    result = best_global_batch("poplar", model, limit)
    check_allocation(model, result.allocation)
    assert model.world_size <= result.allocation.global_batch_size <= limit
    best_rate = max(
        batch / t
        for batch in range(model.world_size, limit + 1)
        if np.isfinite(t := exhaustive_best_time(model, batch))
    )
    assert result.allocation.samples_per_s == pytest.approx(best_rate, rel=1e-12)


@pytest.mark.parametrize("seed", range(12))
def test_proportional_auto_batch_beats_every_batch_up_to_the_maximum(seed):
    # Whale's split at every batch allowed: the automatic batch is at least as fast as each.
    rng = np.random.default_rng(150 + seed)
    model = random_model(
        rng, stage=seed % 4, num_ranks=int(rng.integers(1, 7)), num_types=int(rng.integers(1, 4)), max_cap=40
    )
    limit = int(rng.integers(model.world_size, 400))
    result = best_global_batch("proportional", model, limit)
    check_allocation(model, result.allocation)
    assert model.world_size <= result.allocation.global_batch_size <= limit
    every = [allocate("proportional", model, batch) for batch in range(model.world_size, limit + 1)]
    best_rate = max(r.allocation.samples_per_s for r in every if r.ok)
    assert result.allocation.samples_per_s >= best_rate * (1 - 1e-12)


@pytest.mark.parametrize("seed", range(25))
@pytest.mark.parametrize("policy", ["poplar", "uniform", "proportional"])
def test_allocations_are_exact_capped_and_follow_the_stage_rule(seed, policy):
    rng = np.random.default_rng(1000 + seed)
    model = random_model(
        rng, stage=seed % 4, num_ranks=int(rng.integers(1, 40)), num_types=int(rng.integers(1, 5)), max_cap=32
    )
    batch = model.world_size * int(rng.integers(1, 20))
    result = allocate(policy, model, batch)
    if result.ok:
        check_allocation(model, result.allocation, batch)
    else:
        assert result.reason.endswith(".")
    auto = best_global_batch(policy, model, None)
    check_allocation(model, auto.allocation)


@pytest.mark.parametrize("seed", range(25))
def test_poplar_is_never_slower_than_the_baselines(seed):
    rng = np.random.default_rng(2000 + seed)
    model = random_model(
        rng, stage=seed % 4, num_ranks=int(rng.integers(2, 30)), num_types=int(rng.integers(2, 5)), max_cap=32
    )
    batch = model.world_size * int(rng.integers(1, 12))
    poplar = allocate("poplar", model, batch)
    assert poplar.ok
    for policy in ("uniform", "proportional"):
        other = allocate(policy, model, batch)
        if other.ok:
            assert poplar.allocation.iteration_time_s <= other.allocation.iteration_time_s * (1 + 1e-12)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("policy", ["poplar", "uniform", "proportional"])
@pytest.mark.parametrize("batch", [48, 97, 512])
def test_identical_devices_split_evenly_and_faster_devices_never_get_less(stage, policy, batch):
    # fast dominates slow everywhere (strictly faster, at least as much memory)
    profiles = {
        "fast": synthetic_profile(
            "fast", zero_stage=stage, max_micro_batch_size=24, overhead_s=0.02, seconds_per_sample=0.004
        ),
        "slow": synthetic_profile(
            "slow", zero_stage=stage, max_micro_batch_size=12, overhead_s=0.03, seconds_per_sample=0.01
        ),
    }
    model = build_stage_model(profiles, ["slow", "fast"] * 3 + ["fast"], stage)
    result = allocate(policy, model, batch)
    if not result.ok:
        assert policy == "uniform" and batch % 7
        return
    samples = result.allocation.micro_batch_sizes * result.allocation.accumulation_steps
    types = np.array([model.devices[i].device_type for i in model.rank_device_index])
    fast, slow = types == "fast", types == "slow"
    assert samples[fast].min() >= samples[slow].max()
    if model.synchronised_micro_steps or policy != "poplar":
        sizes = result.allocation.micro_batch_sizes
        assert sizes[fast].max() - sizes[fast].min() <= 1 and sizes[slow].max() - sizes[slow].min() <= 1


def test_infeasible_cases_have_reasons():
    profiles = {
        "a": synthetic_profile("a", zero_stage=2, max_micro_batch_size=2, overhead_s=0.1, seconds_per_sample=0.01)
    }
    model = build_stage_model(profiles, ["a", "a"], 2)
    result = allocate("poplar", model, 1)
    assert not result.ok and "smaller than the 2 ranks" in result.reason
    # 7 is prime and above the 2 * 2 samples one micro-step can hold
    result = allocate("poplar", model, 7)
    assert not result.ok and "No accumulation count s divides the global batch 7" in result.reason
    result = allocate("uniform", model, 5)
    assert not result.ok and "not a multiple of the 2 ranks" in result.reason
    independent = build_stage_model({"a": dataclasses.replace(profiles["a"], zero_stage=0)}, ["a", "a"], 0)
    assert allocate("poplar", independent, 7).allocation.global_batch_size == 7


def test_unknown_policy_is_a_value_error():
    profiles = {
        "a": synthetic_profile("a", zero_stage=0, max_micro_batch_size=2, overhead_s=0.1, seconds_per_sample=0.01)
    }
    with pytest.raises(ValueError, match=r"policy: expected one of 'uniform', 'proportional', 'poplar', found 'best'"):
        allocate("best", build_stage_model(profiles, ["a"], 0), 4)


def test_large_cluster_is_exact_and_even():
    rng = np.random.default_rng(7)
    names = [f"gpu{i}" for i in range(6)]
    for stage in (0, 2):
        profiles = {p.device_type: p for p in random_profiles(rng, names, zero_stages=(stage,))}
        model = build_stage_model(profiles, [names[i % 6] for i in range(4096)], stage)
        for batch in (4096 * 16 + 7, None):
            result = allocate("poplar", model, batch) if batch else best_global_batch("poplar", model)
            check_allocation(model, result.allocation, batch)


@pytest.mark.parametrize("batch", [4096, 3 * 4096 + 1, 200_003])
def test_stage_0_with_a_huge_slack_stays_exact(batch):
    # The size-1 step of a slow type pins the time; the big type could run 100x more than
    # needed, so the exact sum must come from the fast two-level construction.
    profiles = {
        "pin": synthetic_profile("pin", zero_stage=0, max_micro_batch_size=1, overhead_s=0.1, seconds_per_sample=0.02),
        "big": synthetic_profile(
            "big", zero_stage=0, max_micro_batch_size=700, overhead_s=0.001, seconds_per_sample=0.0005
        ),
    }
    model = build_stage_model(profiles, ["pin", "big"] * 2048, 0)
    result = allocate("poplar", model, batch)
    check_allocation(model, result.allocation, batch)


def milp_best_time(model, batch):
    """The optimum under the cost model by scipy.optimize.milp (binary choice per rank)."""
    world = model.world_size
    tables = [model.devices[i].step_time_table_s for i in model.rank_device_index]
    best = np.inf
    if model.synchronised_micro_steps:
        # per accumulation count s: binary x[r, b]; minimise z >= t_r(b) for the chosen b
        for steps in (s for s in range(1, batch + 1) if batch % s == 0):
            options = [(r, b) for r in range(world) for b in range(1, len(tables[r]) + 1)]
            best = min(best, _solve(options, tables, world, batch // steps, lambda b: b, steps))
        return best
    # stages 0/1: binary x[r, (b, s)] with b * s samples; minimise z >= s * t_r(b)
    options = [
        (r, (b, s)) for r in range(world) for b in range(1, len(tables[r]) + 1) for s in range(1, batch // b + 1)
    ]
    return _solve(options, tables, world, batch, lambda bs: bs[0] * bs[1], 1)


def _solve(options, tables, world, samples, work_of, steps):
    def busy(r, choice):
        if isinstance(choice, tuple):
            return choice[1] * tables[r][choice[0] - 1]
        return tables[r][choice - 1]

    n = len(options) + 1  # last variable: z
    cost = np.zeros(n)
    cost[-1] = 1.0
    one_each = np.zeros((world, n))
    total = np.zeros((1, n))
    makespan = np.zeros((world, n))
    for k, (r, choice) in enumerate(options):
        one_each[r, k] = 1
        total[0, k] = work_of(choice)
        makespan[r, k] = busy(r, choice)
    makespan[:, -1] = -1
    constraints = [
        LinearConstraint(one_each, 1, 1),
        LinearConstraint(total, samples, samples),
        LinearConstraint(makespan, -np.inf, 0),
    ]
    integrality = np.r_[np.ones(n - 1), 0]
    result = milp(
        cost,
        constraints=constraints,
        integrality=integrality,
        bounds=Bounds(np.r_[np.zeros(n - 1), 0], np.r_[np.ones(n - 1), np.inf]),
    )
    return steps * result.fun if result.status == 0 else np.inf


@pytest.mark.parametrize("seed", range(8))
def test_poplar_equals_the_milp_optimum_on_larger_clusters(seed):
    rng = np.random.default_rng(500 + seed)
    stage = seed % 4
    model = random_model(rng, stage=stage, num_ranks=int(rng.integers(4, 7)), num_types=3, max_cap=8)
    batch = int(rng.integers(model.world_size, 4 * model.world_size))
    result = allocate("poplar", model, batch)
    best = milp_best_time(model, batch)
    if not np.isfinite(best):
        assert not result.ok
        return
    check_allocation(model, result.allocation, batch)
    # milp solves in floating point: equal up to its tolerance, never better than poplar
    assert result.allocation.iteration_time_s - model.boundary_s == pytest.approx(best, rel=1e-6)


def min_max_busy_s(model, batch):
    """Shortest busy time of the busiest rank over every split of `batch` (stages 0/1), by dynamic programming.

    ``shortest[w]``: one rank's shortest busy time for w samples (w = b * s, the cost
    model's float product); ranks are added one at a time with a (min, max) convolution.
    """
    best = None
    for index in model.rank_device_index:
        table = model.devices[index].step_time_table_s
        shortest = np.full(batch + 1, np.inf)
        for size in range(1, min(len(table), batch) + 1):
            steps = np.arange(1, batch // size + 1)
            shortest[size * steps] = np.minimum(shortest[size * steps], steps * table[size - 1])
        if best is None:
            best = shortest
            continue
        best = np.array([np.min(np.maximum(best[: w + 1], shortest[w::-1])) for w in range(batch + 1)])
    return best[batch]


@pytest.mark.parametrize("method", ["bitsets", "residues", "two-level"])
def test_every_exact_method_of_stages_0_and_1_finds_the_optimum(monkeypatch, method):
    # Force the way `_exact_at` decides at every time the search tries, on cases small
    # enough for the dynamic-programming oracle (which shares no code with the search).
    # Many seeds in one test: some corners (the rank that takes up the rest of the
    # deficit running out of micro-steps) come up in about one case in seventy.
    if method == "bitsets":
        monkeypatch.setattr(poplar_independent, "SMALL_DELTA", 10**12)
    else:
        monkeypatch.setattr(poplar_independent, "SMALL_DELTA", -1)
    if method == "two-level":
        monkeypatch.setattr(poplar_independent, "RESIDUE_MAX_MODULUS", 0)
    for seed in range(300):
        rng = np.random.default_rng(3000 + seed)
        model = random_model(
            rng,
            stage=seed % 2,
            num_ranks=int(rng.integers(1, 7)),
            num_types=int(rng.integers(1, 4)),
            max_cap=int(rng.integers(1, 9)),
        )
        batch = int(rng.integers(model.world_size, 500))
        result = allocate("poplar", model, batch)
        check_allocation(model, result.allocation, batch)
        busy = model.rank_busy_times_s(result.allocation.micro_batch_sizes, result.allocation.accumulation_steps)
        assert float(busy.max()) == min_max_busy_s(model, batch), f"seed {seed}, batch {batch}"
