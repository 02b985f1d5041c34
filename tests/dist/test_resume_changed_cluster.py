"""Resume on a changed cluster under the real launcher (torchrun, CPU, gloo).

3 ranks of three emulated device types train 3 optimizer steps and checkpoint; the
job resumes on 2 ranks of two types with another plan and trains 3 more, at ZeRO
stages 0-3 (stages 1-3 reshard the optimizer state into DeepSpeed's universal
checkpoint format: poplar_ext.runtime.reshard; other optimizers, and 2 -> 3 ranks, are
in test_resume_any_optimizer.py). The parameters equal one process replaying the same 6 global batches,
no sample is trained twice, and the resumed run starts where the first stopped.

The resume is the torchrun launch; the first run, whose checkpoints no launcher changes, is
`resume_train.run_phase` on 3 forked ranks: a torchrun launch of 3 fresh interpreters cost ~10 s
more (imports), and checkpoints saved under torchrun are test_elastic_restart's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import _training as t
import pytest
import torch
from harness import assert_launch_finished, free_port, run_ranks
from resume_train import run_phase

HERE = Path(__file__).resolve().parent
STEPS = 3
GLOBAL_BATCH = 12
STAGES = (0, 1, 2, 3)
FIRST = {
    "types": ["a", "b", "c"],
    "slowdowns": [1.0, 1.5, 2.0],
    "plan": {
        0: [(2, 2), (2, 2), (4, 1)],
        1: [(2, 2), (2, 2), (4, 1)],
        2: [(2, 2), (1, 2), (3, 2)],
        3: [(2, 2), (1, 2), (3, 2)],
    },
}
RESUMED = {
    "types": ["a", "c"],
    "slowdowns": [1.0, 2.0],
    "plan": {0: [(3, 2), (6, 1)], 1: [(3, 2), (6, 1)], 2: [(4, 2), (2, 2)], 3: [(4, 2), (2, 2)]},
}


def _phase_files(root: Path, phase: str, spec: dict) -> None:
    directory = root / phase
    directory.mkdir(parents=True)
    devices = [{"device_type": name, "count": 1} for name in spec["types"]]
    emulations = {
        name: {"emulation": {"slowdown": s, "memory_capacity_bytes": 2_000_000_000}}
        for name, s in zip(spec["types"], spec["slowdowns"])
    }
    (directory / "cluster.json").write_text(
        json.dumps({"schema_version": 1, "nodes": [{"name": "n0", "devices": devices}], "device_types": emulations})
    )
    for stage in STAGES:
        plan = t.write_plan(
            directory / f"plan{stage}.json", spec["plan"][stage], stage=stage, device_types=spec["types"]
        )
        assert json.loads(plan.read_text())["global_batch_size"] == GLOBAL_BATCH
        config = t.ds_config(cluster=directory / "cluster.json", plan=plan, stage=stage)
        config["train_batch_size"] = GLOBAL_BATCH
        (directory / f"ds{stage}.json").write_text(json.dumps(config))


def _launch(root: Path, phase: str, world_size: int) -> None:
    env = dict(
        os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(world_size),
        "--master_port",
        str(free_port()),
        str(HERE / "resume_train.py"),
        "--phase",
        phase,
        "--root",
        str(root),
    ]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=420)
    output = done.stdout + done.stderr
    markers = [root / phase / f"done-rank{rank}" for rank in range(world_size)]
    assert_launch_finished(done.returncode, output, markers, f"{phase}:\n{output[-5000:]}")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    _phase_files(root, "first", FIRST)
    _phase_files(root, "resumed", RESUMED)
    run_ranks(run_phase, world_size=3, tmp_path=root, args=("first", root), timeout_s=300)
    _launch(root, "resumed", 2)
    return root


@pytest.mark.parametrize("stage", STAGES)
def test_parameters_equal_one_process_replaying_the_six_batches(root, stage):
    expected, _ = t.reference_parameters("adam", GLOBAL_BATCH, 2 * STEPS)
    params = torch.load(root / "resumed" / f"stage{stage}-params.pt", weights_only=False)
    assert t.max_difference(params, expected) <= 1e-5


@pytest.mark.parametrize("stage", STAGES)
def test_every_sample_once_and_the_resume_starts_where_the_first_run_stopped(root, stage):
    first = [json.loads((root / "first" / f"stage{stage}-rank{r}.json").read_text()) for r in range(3)]
    resumed = [json.loads((root / "resumed" / f"stage{stage}-rank{r}.json").read_text()) for r in range(2)]
    assert {r["end"] for r in first} == {STEPS * GLOBAL_BATCH} == {r["start"] for r in resumed}
    positions = []
    stream = t.SampleStream(num_samples=t.NUM_SAMPLES, seed=0)
    for ranks in (first, resumed):
        for rank in ranks:
            positions += [i for batch in rank["seen"] for i in batch]
    expected = stream.indices(0, 2 * STEPS * GLOBAL_BATCH)
    assert sorted(positions) == sorted(expected)  # each stream position once: no sample twice per epoch
    assert "under another plan (3 ranks then, 2 now)" in resumed[0]["history"][-1]
