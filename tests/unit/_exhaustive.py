"""The exhaustive optimum the search's memory-lever tests compare with (tests/unit)."""

from __future__ import annotations

import itertools

import numpy as np

from poplar_bench.synthetic import simple_cluster
from poplar_ext.plan.levers import LEVERS_ORDER
from poplar_ext.search.api import check_plan, predict, search_plan
from poplar_ext.search.cost import build_stage_model


def brute_force(profiles, cluster, stage, batch):
    """Shortest iteration over every lever setting the stage allows and every allocation (inf when none)."""
    types = list(cluster.type_counts())
    by_key = {(p.device_type, p.levers): p for p in profiles}
    options = [[levers for levers in LEVERS_ORDER if (t, levers) in by_key] for t in types]
    settings = list(itertools.product(*options))
    if stage == 3:
        settings = [s for s in settings if len({levers[0] for levers in s}) == 1]
    best, best_setting = np.inf, None
    for setting in settings:
        chosen = {t: by_key[(t, levers)] for t, levers in zip(types, setting)}
        if any(p.max_micro_batch_size == 0 for p in chosen.values()):
            continue
        model = build_stage_model(chosen, cluster.rank_device_types, stage)
        caps = [model.devices[i].max_micro_batch_size for i in model.rank_device_index]
        if model.synchronised_micro_steps:
            candidates = (
                (sizes, (steps,) * len(caps))
                for steps in range(1, batch + 1)
                if batch % steps == 0
                for sizes in itertools.product(*[range(1, c + 1) for c in caps])
                if sum(sizes) * steps == batch
            )
        else:
            per_rank = [[(b, s) for b in range(1, c + 1) for s in range(1, batch // b + 1)] for c in caps]
            candidates = (
                tuple(zip(*combo)) for combo in itertools.product(*per_rank) if sum(b * s for b, s in combo) == batch
            )
        for sizes, steps in candidates:
            time_s = model.iteration_time_s(np.array(sizes), np.array(steps))
            if time_s < best:
                best, best_setting = time_s, dict(zip(types, setting))
    return best, best_setting


def random_cluster(rng, names):
    """One rank of each type, sometimes two of the first; and a global batch of at least one sample per rank."""
    counts = {name: 1 for name in names}
    counts[names[0]] += int(rng.integers(0, 2))
    cluster = simple_cluster(counts)
    return cluster, int(rng.integers(cluster.world_size, 13))


def assert_search_is_exact(profiles, cluster, stage, batch):
    """poplar's plan reaches the exhaustive optimum (or both find none); returns the plan (None: infeasible)."""
    import pytest

    result = search_plan(profiles, cluster, global_batch_size=batch, zero_stage=stage)
    best, _ = brute_force(profiles, cluster, stage, batch)
    if not np.isfinite(best):
        assert not result.ok and result.message
        return None
    assert result.ok, result.message
    assert result.plan.predicted.iteration_time_s == pytest.approx(best, rel=1e-12)
    # The plan is priced with the profiles of the levers it carries.
    assert predict(result.plan, profiles).iteration_time_s == pytest.approx(best, rel=1e-12)
    assert check_plan(result.plan, cluster, profiles) == []
    return result.plan
