"""Re-balancing during training (poplar_ext.runtime.rebalance) on 3 forked CPU ranks.

* Forced switches every 2 optimizer steps to random valid plans (uneven accumulation
  at stages 0/1) train exactly what one process replaying the same global batches
  trains, every sample once.
* A device that a ``slowdown_schedule`` makes 4x slower mid-run triggers exactly one
  re-plan, which moves samples away from it; without the schedule, none. Every rank is
  emulated and steady at synthetic profiles, so what the checks see does not depend on
  the machine's load.
"""

from __future__ import annotations

import json
import random

import _training as t
import pytest
import torch
from harness import run_ranks

STAGES = (0, 1, 2, 3)
GLOBAL_BATCH = 12
TYPES = ["cpu", "cpu-slow", "cpu-slow"]


def random_allocation(rng: random.Random, stage: int) -> list[tuple[int, int]]:
    """(micro_batch_size, accumulation steps) per rank summing to GLOBAL_BATCH; one count at stages 2/3."""
    if stage >= 2:
        steps = rng.choice([s for s in (1, 2, 4) if GLOBAL_BATCH // s >= 3])
        cuts = sorted(rng.sample(range(1, GLOBAL_BATCH // steps), 2))
        sizes = [cuts[0], cuts[1] - cuts[0], GLOBAL_BATCH // steps - cuts[1]]
        return [(b, steps) for b in sizes]
    cuts = sorted(rng.sample(range(1, GLOBAL_BATCH), 2))
    shares = [cuts[0], cuts[1] - cuts[0], GLOBAL_BATCH - cuts[1]]
    allocation = []
    for n in shares:
        steps = rng.choice([d for d in range(1, n + 1) if n % d == 0])
        allocation.append((n // steps, steps))
    return allocation


def _forced(config_path: str, stage: int, switches: list[list[tuple[int, int]]]) -> dict:
    import os

    import torch

    import poplar_ext
    from poplar_ext.plan.formats import load_plan, plan_from_dict, plan_to_dict

    model = t.GPT(t.TINY)
    engine, *_ = poplar_ext.initialize(
        model=model, optimizer=t.make_optimizer("adam", model.parameters()), config=config_path
    )
    data = t.dataset()
    seen: list[list[int]] = []
    loader = torch.utils.data.DataLoader(
        data, batch_sampler=t.RecordingSampler(engine.create_batch_sampler(len(data)), seen)
    )
    template = plan_to_dict(load_plan(os.path.join(os.path.dirname(config_path), f"plan{stage}.json")))
    for allocation in switches:
        t.train_steps(engine, loader, 2)
        ranks = [
            dict(r, micro_batch_size=b, gradient_accumulation_steps=s)
            for r, (b, s) in zip(template["ranks"], allocation)
        ]
        engine.rebalance_to(plan_from_dict(dict(template, ranks=ranks)), reason="forced by the test")
        assert engine.rank_plan.micro_batch_size == allocation[engine.deepspeed_engine.global_rank][0]
    t.train_steps(engine, loader, 2)
    return {
        "seen": seen,
        "params": t.full_parameters(engine) if torch.distributed.get_rank() == 0 else None,
        "history": [(h["start_step"], h["reason"]) for h in engine.plan_history],
        "steps": engine.global_steps,
    }


@pytest.mark.parametrize("stage", STAGES)
def test_forced_switches_keep_gradients_exact_and_every_sample_once(tmp_path, stage):
    cluster = t.write_cluster(tmp_path / "cluster.json", fast=1, slow=2, slowdown=1.0)
    rng = random.Random(stage)
    first = random_allocation(rng, stage)
    t.write_plan(tmp_path / f"plan{stage}.json", first, stage=stage, device_types=TYPES)
    config = t.ds_config(cluster=cluster, plan=tmp_path / f"plan{stage}.json", stage=stage)
    (tmp_path / "ds.json").write_text(json.dumps(config))
    switches = [random_allocation(rng, stage) for _ in range(2)]
    results = run_ranks(
        _forced,
        world_size=3,
        tmp_path=tmp_path / "ranks",
        args=(str(tmp_path / "ds.json"), stage, switches),
        timeout_s=240,
    )

    steps = 2 * (len(switches) + 1)
    expected, _ = t.reference_parameters("adam", GLOBAL_BATCH, steps)
    assert t.max_difference(results[0]["params"], expected) <= 1e-6
    trained = sorted(i for r in results for batch in r["seen"] for i in batch)
    stream = t.SampleStream(num_samples=t.NUM_SAMPLES, seed=0).indices(0, steps * GLOBAL_BATCH)
    assert trained == sorted(stream), "the iterations of the stream, every position once"
    history = results[0]["history"]
    assert [step for step, _ in history] == [0, 2, 4] and all(r["history"] == history for r in results)
    assert all(r["steps"] == steps for r in results)


class _Indexed(torch.utils.data.Dataset):
    """The test data set's items with their index: what trained is read from the batches themselves."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return index, self.data[index]


def _forced_fetching_ahead(config_path: str, switches: list[list[tuple[int, int]]]) -> dict:
    import os

    import torch

    import poplar_ext
    from poplar_ext.plan.formats import load_plan, plan_from_dict, plan_to_dict

    model = t.GPT(t.TINY)
    engine, *_ = poplar_ext.initialize(
        model=model, optimizer=t.make_optimizer("adam", model.parameters()), config=config_path
    )
    data = _Indexed(t.dataset())
    # As a DataLoader's workers do (forked ranks cannot start them): 4 micro-batches are
    # taken from the sampler ahead of training, so when a switch is agreed the samplers
    # have handed out later iterations already and it waits for the first none has started.
    loader = torch.utils.data.DataLoader(data, batch_sampler=engine.create_batch_sampler(len(data)))

    def ahead(depth: int = 4):
        import collections

        fetched = collections.deque()
        for batch in loader:
            fetched.append(batch)
            if len(fetched) > depth:
                yield fetched.popleft()
        yield from fetched

    stream = ahead()
    trained: list[list[int]] = []

    def train(steps: int) -> None:
        nonlocal stream
        done = 0
        while done < steps:
            try:
                indices, tokens = next(stream)
            except StopIteration:
                stream = ahead()
                continue
            trained.append(indices.tolist())
            engine.backward(engine(tokens))
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            done += boundary

    template = plan_to_dict(load_plan(os.path.join(os.path.dirname(config_path), "plan1.json")))
    requested = []
    for allocation in switches:
        train(2)
        requested.append(engine.global_steps)
        ranks = [
            dict(r, micro_batch_size=b, gradient_accumulation_steps=s)
            for r, (b, s) in zip(template["ranks"], allocation)
        ]
        engine.rebalance_to(plan_from_dict(dict(template, ranks=ranks)), reason="forced by the test")
    train(2 * len(switches) + 2 - engine.global_steps)
    return {
        "trained": trained,
        "requested": requested,
        "history": [h["start_step"] for h in engine.plan_history],
        "params": t.full_parameters(engine) if torch.distributed.get_rank() == 0 else None,
    }


def test_a_switch_waits_for_data_fetched_ahead(tmp_path):
    first, switches = [(2, 2), (4, 1), (2, 2)], [[(4, 1), (1, 4), (4, 1)], [(3, 2), (2, 1), (2, 2)]]
    t.write_plan(tmp_path / "plan1.json", first, stage=1, device_types=TYPES)
    cluster = t.write_cluster(tmp_path / "cluster.json", fast=1, slow=2, slowdown=1.0)
    (tmp_path / "ds.json").write_text(json.dumps(t.ds_config(cluster=cluster, plan=tmp_path / "plan1.json", stage=1)))
    results = run_ranks(
        _forced_fetching_ahead,
        world_size=3,
        tmp_path=tmp_path / "ranks",
        args=(str(tmp_path / "ds.json"), switches),
        timeout_s=240,
    )
    steps = 2 * len(switches) + 2
    history, requested = results[0]["history"], results[0]["requested"]
    assert all(r["history"] == history for r in results), "every rank switched at the same step"
    assert len(history) == 1 + len(switches) and all(s >= r for s, r in zip(history[1:], requested))
    assert any(s > r for s, r in zip(history[1:], requested)), (
        f"no switch waited for fetched data: {history} {requested}"
    )
    expected, _ = t.reference_parameters("adam", GLOBAL_BATCH, steps)
    assert t.max_difference(results[0]["params"], expected) <= 1e-6
    trained = sorted(i for r in results for batch in r["trained"] for i in batch)
    assert trained == sorted(t.SampleStream(num_samples=t.NUM_SAMPLES, seed=0).indices(0, steps * GLOBAL_BATCH))


def _save_then_resume(config_path: str, checkpoints: str, stage: int, switched: list[tuple[int, int]]) -> dict:
    import os

    import torch

    import poplar_ext
    from poplar_ext.plan.formats import load_plan, plan_from_dict, plan_to_dict

    template = plan_to_dict(load_plan(os.path.join(os.path.dirname(config_path), f"plan{stage}.json")))
    data = t.dataset()
    model = t.GPT(t.TINY)
    engine, *_ = poplar_ext.initialize(
        model=model, optimizer=t.make_optimizer("adam", model.parameters()), config=config_path
    )
    loader = torch.utils.data.DataLoader(data, batch_sampler=engine.create_batch_sampler(len(data)))
    t.train_steps(engine, loader, 2)
    ranks = [
        dict(r, micro_batch_size=b, gradient_accumulation_steps=s) for r, (b, s) in zip(template["ranks"], switched)
    ]
    engine.rebalance_to(plan_from_dict(dict(template, ranks=ranks)), reason="forced by the test")
    t.train_steps(engine, loader, 2)
    engine.save_checkpoint(checkpoints)
    saved_history = engine.plan_history

    model = t.GPT(t.TINY)
    resumed, *_ = poplar_ext.initialize(
        model=model, optimizer=t.make_optimizer("adam", model.parameters()), config=config_path
    )
    resumed.load_checkpoint(checkpoints)
    allocation = [(r.micro_batch_size, r.gradient_accumulation_steps) for r in resumed.plan.ranks]
    history = resumed.plan_history
    loader = torch.utils.data.DataLoader(data, batch_sampler=resumed.create_batch_sampler(len(data)))
    t.train_steps(resumed, loader, 2)
    return {
        "allocation": allocation,
        "same_history": history == saved_history,
        "history": [(h["start_step"], h["reason"]) for h in history],
        "params": t.full_parameters(resumed) if torch.distributed.get_rank() == 0 else None,
    }


def test_a_resume_continues_under_the_last_plan_with_its_history(tmp_path):
    stage, first, switched = 1, [(2, 2), (4, 1), (2, 2)], [(4, 1), (1, 4), (4, 1)]
    t.write_plan(tmp_path / f"plan{stage}.json", first, stage=stage, device_types=TYPES)
    cluster = t.write_cluster(tmp_path / "cluster.json", fast=1, slow=2, slowdown=1.0)
    (tmp_path / "ds.json").write_text(
        json.dumps(t.ds_config(cluster=cluster, plan=tmp_path / f"plan{stage}.json", stage=stage))
    )
    results = run_ranks(
        _save_then_resume,
        world_size=3,
        tmp_path=tmp_path / "ranks",
        args=(str(tmp_path / "ds.json"), str(tmp_path / "checkpoints"), stage, switched),
        timeout_s=240,
    )
    assert all(r["allocation"] == switched for r in results), "the re-balanced plan, not the plan file's"
    assert all(r["same_history"] for r in results), results[0]["history"]
    assert [step for step, _ in results[0]["history"]] == [0, 2]
    expected, _ = t.reference_parameters("adam", GLOBAL_BATCH, 6)
    assert t.max_difference(results[0]["params"], expected) <= 1e-6


DRIFT_STEP = 4
STEPS = 12
DRIFT_BATCH = 24
# Enough compute per sample that a rank's time follows its samples (the tiny model's is
# mostly fixed per-call overhead, where moving samples changes little).
DRIFT_MODEL = t.GPTConfig(vocab_size=256, sequence_length=32, num_layers=2, num_heads=2, hidden_size=64)
DRIFT_SAMPLES = 100


def _drifting(config: dict) -> dict:
    import torch

    import poplar_ext
    from poplar_ext.models.toy_gpt import SyntheticTokens

    model = t.GPT(DRIFT_MODEL)
    data = SyntheticTokens(
        num_samples=DRIFT_SAMPLES, sequence_length=DRIFT_MODEL.sequence_length, vocab_size=DRIFT_MODEL.vocab_size
    )
    engine, _, _, _ = poplar_ext.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01), training_data=data, config=config
    )
    first = [(r.micro_batch_size, r.gradient_accumulation_steps) for r in engine.plan.ranks]
    seen: list[list[int]] = []
    loader = torch.utils.data.DataLoader(
        data, batch_sampler=t.RecordingSampler(engine.create_batch_sampler(len(data)), seen)
    )
    with t.logged_lines("poplar_ext.runtime.rebalance") as logged:
        t.train_steps(engine, loader, STEPS)
    monitor = engine._rebalancer.monitor
    return {
        "logged": logged,
        "first": first,
        "last": [(r.micro_batch_size, r.gradient_accumulation_steps) for r in engine.plan.ranks],
        "history": [(h["start_step"], h["reason"]) for h in engine.plan_history],
        "seen": seen,
        "checks": None if monitor is None else list(monitor.checks),
        "scales": None if monitor is None else monitor.rank_scales,
    }


@pytest.fixture(scope="module")
def drift_profiles(tmp_path_factory):
    """Synthetic ZeRO-1 profiles of the drift model, the slow type 2x the fast: the plan at start and each
    re-plan come from clean curves, not from curves measured on a loaded machine."""
    directory = tmp_path_factory.mktemp("drift") / "profiles"
    slowdowns = {"cpu-fast": 1.0, "cpu-slow": 2.0}
    return t.write_steady_profiles(directory, t.GPT(DRIFT_MODEL), slowdowns, fast_s_per_sample=0.008)


def _drift_config(tmp_path, profiles, schedule, *, enabled=True) -> dict:
    cluster = json.loads(
        t.write_cluster(tmp_path / "cluster.json", fast=1, slow=2, slowdown=2.0, fast_type="cpu-fast").read_text()
    )
    if schedule:
        cluster["device_types"]["cpu-fast"]["emulation"]["slowdown_schedule"] = schedule
    (tmp_path / "cluster.json").write_text(json.dumps(cluster))
    config = t.ds_config(
        cluster=tmp_path / "cluster.json",
        plan=None,
        stage=1,
        profiles=str(profiles),
        # Threshold 1.0 (2x off): the 4x drift is far beyond it, steady compute (1.0x) far below.
        rebalance={"enabled": enabled, "check_interval_steps": 2, "threshold": 1.0, "sustained_checks": 2},
        # The plan at start from the synthetic curves as written: calibration would rescale them by wall
        # times of a loaded machine.
        calibration={"action": "off"},
    )
    if enabled == "auto":
        del config["poplar"]["rebalance"]["enabled"]  # the default
    config["train_batch_size"] = DRIFT_BATCH
    return config


def _trained_once(results) -> bool:
    from poplar_ext.runtime.data import SampleStream

    trained = sorted(i for r in results for batch in r["seen"] for i in batch)
    return trained == sorted(SampleStream(num_samples=DRIFT_SAMPLES, seed=0).indices(0, STEPS * DRIFT_BATCH))


def test_a_scheduled_drift_triggers_exactly_one_replan(tmp_path, drift_profiles):
    # Rank 0, which trains the most samples, runs 4x slower from optimizer step 4 on.
    results = run_ranks(
        _drifting,
        world_size=3,
        tmp_path=tmp_path / "ranks",
        args=(_drift_config(tmp_path, drift_profiles, [[DRIFT_STEP, 4.0, 0]]),),
        timeout_s=300,
    )
    first = results[0]
    assert len(first["history"]) == 2, (first["history"], first["logged"], first["checks"])
    start_step, reason = first["history"][1]
    # Checks at steps 6 and 8 see the drift (two sustained checks); the switch is at 8.
    assert start_step == DRIFT_STEP + 4 and "rank 0" in reason, first["history"]
    before, after = first["first"], first["last"]
    assert after[0][0] * after[0][1] < before[0][0] * before[0][1], (
        f"samples move away from the slowed rank: {before} -> {after}"
    )
    assert all(r["history"] == first["history"] and r["last"] == after for r in results), "every rank switched alike"
    # The slowed rank's curve is scaled by its factor, the others not: steady emulation makes every rank's
    # compute its profile's times its slowdown, whatever the machine's load.
    assert first["scales"] == pytest.approx([4.0, 1.0, 1.0], rel=1e-9), first["checks"]
    assert _trained_once(results), "every position of the stream once, across the switch"


def test_no_drift_no_replan_and_on_by_default_where_the_profiles_are(tmp_path, drift_profiles):
    results = run_ranks(
        _drifting,
        world_size=3,
        tmp_path=tmp_path / "ranks",
        args=(_drift_config(tmp_path, drift_profiles, None, enabled="auto"),),
        timeout_s=300,
    )
    assert [c["step"] for c in results[0]["checks"]] == list(range(2, STEPS + 1, 2)), "checked every 2 steps"
    assert len(results[0]["history"]) == 1, (results[0]["history"], results[0]["logged"], results[0]["checks"])
    assert results[0]["first"] == results[0]["last"] and _trained_once(results)
