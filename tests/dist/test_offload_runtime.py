"""Each rank applies its plan's optimizer offload (issue 16's second lever): exact parameters at ZeRO 1-2.

3 ranks (cpu, cpu-slow, cpu-slow); the slow type offloads its optimizer to the host and
the fast one does not, with a client Adam (poplar-ext lets it step on the host), against
one process training the global batch. One forked group runs every case in sequence.
"""

from __future__ import annotations

import dataclasses
import os

import _training as t
import pytest
from harness import run_ranks

STEPS = 3
TYPES = ["cpu", "cpu-slow", "cpu-slow"]
OFFLOAD = [False, True, True]
ALLOCATIONS = {1: [(3, 2), (1, 3), (2, 1)], 2: [(3, 2), (1, 2), (2, 2)]}


def _run_all(files):
    import poplar_ext
    from poplar_ext.hardware.emulation import host_resident_optimizer_bytes

    rank = int(os.environ["RANK"])
    results = {}
    for stage in ALLOCATIONS:
        model = t.GPT(t.TINY)
        engine, _, loader, _ = poplar_ext.initialize(
            model=model,
            optimizer=t.make_optimizer("adam", model.parameters()),
            training_data=t.dataset(),
            config=t.ds_config(cluster=files["cluster"], plan=files[stage], stage=stage),
        )
        t.train_steps(engine, loader, STEPS)
        results[("offloading", stage)] = bool(getattr(engine.optimizer, "cpu_offload", False))
        results[("host bytes", stage)] = host_resident_optimizer_bytes(engine)
        changed = dataclasses.replace(
            engine.plan,
            ranks=tuple(dataclasses.replace(r, optimizer_offload=not r.optimizer_offload) for r in engine.plan.ranks),
        )
        try:
            engine.check_switch(changed)
            results[("switch refused", stage)] = None
        except ValueError as exc:
            results[("switch refused", stage)] = str(exc)
        params = t.full_parameters(engine)
        if rank == 0:
            results[("params", stage)] = params
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offload")
    files = {"cluster": t.write_cluster(tmp / "cluster.json")}
    for stage, allocation in ALLOCATIONS.items():
        files[stage] = t.write_plan(
            tmp / f"plan{stage}.json", allocation, stage=stage, device_types=TYPES, offload=OFFLOAD
        )
    return run_ranks(_run_all, world_size=3, tmp_path=tmp, args=(files,), timeout_s=300)


@pytest.mark.parametrize("stage", sorted(ALLOCATIONS))
def test_offloading_ranks_give_the_global_batch_parameters(results, stage):
    global_batch = sum(b * s for b, s in ALLOCATIONS[stage])
    expected, _ = t.reference_parameters("adam", global_batch, STEPS)
    assert t.max_difference(results[0][("params", stage)], expected) <= 1e-6


@pytest.mark.parametrize("stage", sorted(ALLOCATIONS))
def test_each_rank_offloads_as_its_plan_says(results, stage):
    assert [r[("offloading", stage)] for r in results] == OFFLOAD
    # What the emulation takes off an offloading rank's measured memory: its optimizer's host state.
    assert [r[("host bytes", stage)] > 0 for r in results] == OFFLOAD


def test_a_running_plan_keeps_each_ranks_offload(results):
    for result in results:
        for stage in ALLOCATIONS:
            assert "each rank keeps its optimizer_offload" in result[("switch refused", stage)]
