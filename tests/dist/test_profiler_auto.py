"""Fully automatic mode: initialize with no plan and no profiles measures, searches, trains."""

from __future__ import annotations

import json
import math

import _training as t
import pytest
from harness import run_ranks

from poplar_ext.plan.formats import load_profiles

GLOBAL_BATCH = 8  # also the largest micro-batch profiled: 6 sizes a run, against 7 and a third more compute at 12
SMALLEST_SECTION_BATCH = 4  # its test checks where the profiles go and that the job trains: fewer sizes to profile
CONFIG = t.GPTConfig(vocab_size=256, sequence_length=32, num_layers=2, num_heads=2, hidden_size=64)


def _train_from_nothing(cluster_path: str, profiles_dir: str) -> dict:
    import torch

    import poplar_ext
    from poplar_ext.models.toy_gpt import SyntheticTokens

    # Enough compute per sample that the time curves rise with the micro-batch.
    model = t.GPT(CONFIG)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = SyntheticTokens(num_samples=64, sequence_length=CONFIG.sequence_length, vocab_size=CONFIG.vocab_size)
    config = {
        # No zero_optimization.stage: the search chooses it. Hugging Face's "auto"
        # batch values leave the batch to poplar (a TypeError in automatic mode once).
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10_000,
        "poplar": {
            "cluster": cluster_path,
            "profiles": profiles_dir,
            "global_batch_size": GLOBAL_BATCH,
            "log_interval_steps": 0,
        },
    }
    engine, _, loader, _ = poplar_ext.initialize(model=model, optimizer=optimizer, training_data=data, config=config)
    losses = []
    for tokens in loader:
        loss = engine(tokens.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        if engine.global_steps == 3:
            break
    return {
        "plan": [(r.micro_batch_size, r.gradient_accumulation_steps) for r in engine.plan.ranks],
        "stage": engine.plan.zero_stage,
        "global_batch": engine.plan.global_batch_size,
        "steps": engine.global_steps,
        "losses": losses,
        "calibration": engine.plan.calibration,
        "history_calibration": engine.plan_history[0]["plan"].get("calibration"),
    }


def _train_twice(cluster_path: str, profiles_dir: str) -> list[dict]:
    """From nothing, then again from the profiles the first run cached (checked at start: calibration)."""
    return [_train_from_nothing(cluster_path, profiles_dir) for _ in range(2)]


def _train_from_the_smallest_section(cluster_path: str, cache_home: str) -> dict:
    """The smallest section the docs show (a cluster file, one CPU thread): profiles in the user's cache."""
    import os

    import torch

    import poplar_ext
    from poplar_ext.models.toy_gpt import SyntheticTokens

    os.environ.pop("POPLAR_PROFILES_DIR", None)
    os.environ["XDG_CACHE_HOME"] = cache_home
    model = t.GPT(CONFIG)
    data = SyntheticTokens(num_samples=64, sequence_length=CONFIG.sequence_length, vocab_size=CONFIG.vocab_size)
    section = {"cluster": cluster_path, "cpu_threads": 1}
    config = {
        "train_batch_size": SMALLEST_SECTION_BATCH,
        # A stage of the user's: one stage profiled (the first job profiles all four, for the search).
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "poplar": section,
    }
    engine, _, loader, _ = poplar_ext.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), training_data=data, config=config
    )
    for tokens in loader:
        engine.backward(engine(tokens.to(engine.device)))
        engine.step()
        if engine.global_steps == 2:
            break
    return {"steps": engine.global_steps, "profiles": str(engine.poplar_config.profiles)}


def _two_types() -> dict:
    return {
        "schema_version": 1,
        "nodes": [
            {"name": "n0", "devices": [{"device_type": "fast", "count": 1}, {"device_type": "slow", "count": 1}]}
        ],
        "device_types": {
            "fast": {"emulation": {"slowdown": 1.0, "memory_capacity_bytes": 8 * 10**9}},
            "slow": {"emulation": {"slowdown": 3.0, "memory_capacity_bytes": 8 * 10**9}},
        },
    }


def _both_jobs(cluster_path: str, profiles_dir: str, cache_home: str) -> dict:
    """Both tests' jobs in one forked group, each from nothing into its own folder: one fork, process group and
    first engine's one-off costs for both. The second sets the user's cache (XDG_CACHE_HOME) once the first,
    which names its folder, has ended."""
    twice = _train_twice(cluster_path, profiles_dir)
    return {"twice": twice, "smallest": _train_from_the_smallest_section(cluster_path, cache_home)}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    tmp_path = tmp_path_factory.mktemp("profiler_auto")
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps(_two_types()))
    folders = {"profiles": tmp_path / "profiles", "cache_home": tmp_path / "cache"}
    args = (str(cluster), str(folders["profiles"]), str(folders["cache_home"]))
    ranks = run_ranks(_both_jobs, world_size=2, tmp_path=tmp_path, args=args, timeout_s=300)
    return {"ranks": ranks, **folders}


def test_initialize_profiles_searches_and_trains_from_nothing(jobs) -> None:
    both, profiles_dir = [r["twice"] for r in jobs["ranks"]], jobs["profiles"]
    results = [runs[0] for runs in both]
    written = {(p.device_type, p.zero_stage) for p in load_profiles(profiles_dir)}
    assert written == {(d, s) for d in ("fast", "slow") for s in (0, 1, 2, 3)}, "every stage profiled for the search"
    first = results[0]
    assert all(r["plan"] == first["plan"] and r["stage"] == first["stage"] for r in results)
    assert first["global_batch"] == GLOBAL_BATCH and first["steps"] == 3
    (fast_b, fast_s), (slow_b, slow_s) = first["plan"]
    assert fast_b * fast_s >= slow_b * slow_s, "the 3x slower type never gets more samples"
    assert all(math.isfinite(x) for r in results for x in r["losses"])
    # The second job's profiles came from the cache: each type was timed at start against its curve.
    assert first["calibration"] == {}, "fresh profiles are not checked"
    again = [runs[1] for runs in both]
    assert again[0]["calibration"] == again[1]["calibration"], "every rank has the same plan"
    checks = again[0]["calibration"]
    assert set(checks) == {"fast", "slow"}
    assert all(c["outcome"] in ("trusted", "rescaled") and c["measured_over_profiled"] > 0 for c in checks.values())
    assert again[0]["history_calibration"] == checks and again[0]["steps"] == 3


def test_the_smallest_section_the_docs_show_trains_with_profiles_in_the_users_cache(jobs) -> None:
    results, cache_home = [r["smallest"] for r in jobs["ranks"]], jobs["cache_home"]
    expected = cache_home / "poplar-ext" / "profiles"
    assert [r["steps"] for r in results] == [2, 2]
    assert all(r["profiles"] == str(expected) for r in results)
    assert {(p.device_type, p.zero_stage) for p in load_profiles(expected)} == {("fast", 1), ("slow", 1)}
