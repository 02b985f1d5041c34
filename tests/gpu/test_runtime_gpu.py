"""The runtime on CUDA: nccl, fp32 and bf16, uneven per-rank batches, the launcher.

Ranks: one per visible GPU (nccl allows one rank per GPU); with a single GPU the
job has one rank, which still runs an uneven micro-batch/accumulation plan through
the CUDA path. Ranks are forked before the parent touches CUDA (the harness checks).

Outcome so far: written in a session without a GPU; skipped there, never run on CUDA
yet. Replace this line with the outcome when they have run on a GPU machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="CUDA is not available: the GPU tier (nccl, bf16 equivalence, launcher on GPUs) needs a CUDA device",
    ),
]

STEPS = 3
REPO = Path(__file__).resolve().parents[2]


def _world_size() -> int:
    return max(1, min(3, torch.cuda.device_count()))


def _allocation(stage: int, world_size: int) -> list[tuple[int, int]]:
    uneven = [(3, 2), (1, 3), (2, 1)] if stage < 2 else [(3, 2), (1, 2), (2, 2)]
    return uneven[:world_size]


def _train(files, dtype):
    import _training as t
    import poplar_ext

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results = {}
    for stage in (0, 1, 2, 3):
        model = t.GPT(t.TINY)
        config = t.ds_config(cluster=files["cluster"], plan=files[stage], stage=stage)
        if dtype == "bf16":
            config["bf16"] = {"enabled": True}
        engine, _, loader, _ = poplar_ext.initialize(
            model=model, optimizer=t.make_optimizer("sgd", model.parameters()), training_data=t.dataset(), config=config
        )
        t.train_steps(engine, loader, STEPS)
        results[stage] = t.full_parameters(engine)
    return results


def _files(tmp_path: Path) -> dict:
    import _training as t

    world_size = _world_size()
    files = {"cluster": t.write_cluster(tmp_path / "cluster.json", fast=1, slow=world_size - 1, fast_type="gpu-fast")}
    types = ["gpu-fast"] + ["cpu-slow"] * (world_size - 1)
    for stage in (0, 1, 2, 3):
        files[stage] = t.write_plan(tmp_path / f"plan{stage}.json", _allocation(stage, world_size), stage=stage, device_types=types)
    return files


@pytest.mark.parametrize("dtype,tolerance", [("fp32", 1e-5), ("bf16", 5e-2)])
def test_equivalence_on_cuda(tmp_path, dtype, tolerance):
    import _training as t
    from harness import run_ranks

    world_size = _world_size()
    results = run_ranks(_train, world_size=world_size, tmp_path=tmp_path, args=(_files(tmp_path), dtype),
                        init_process_group=False, timeout_s=300)[0]
    for stage in (0, 1, 2, 3):
        global_batch = sum(b * s for b, s in _allocation(stage, world_size))
        expected, _ = t.reference_parameters("sgd", global_batch, STEPS)
        assert t.max_difference(results[stage], expected) <= tolerance, f"stage {stage}"


@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="the deepspeed launcher is not on PATH")
def test_launcher_on_cuda_with_bf16(tmp_path):
    from harness import free_port

    num_gpus = min(2, torch.cuda.device_count())
    config = json.loads((REPO / "examples" / "ds_config.json").read_text())
    config["bf16"] = {"enabled": True}
    for name in ("cluster", "plan"):
        config["poplar"][name] = str(REPO / "examples" / f"{name}.json")
    if num_gpus == 1:
        (tmp_path / "cluster.json").write_text(json.dumps(
            {"schema_version": 1, "nodes": [{"name": "gpu", "devices": [{"device_type": "gpu", "count": 1}]}]}))
        (tmp_path / "plan.json").write_text(json.dumps({
            "schema_version": 1, "policy": "uniform", "zero_stage": 1, "global_batch_size": 8,
            "ranks": [{"rank": 0, "device_type": "gpu", "micro_batch_size": 4, "gradient_accumulation_steps": 2}],
            "predicted": {"iteration_time_s": 1.0, "samples_per_s": 1.0, "ideal_samples_per_s": 1.0},
            "profile_fingerprints": {}}))
        config["poplar"]["cluster"], config["poplar"]["plan"] = str(tmp_path / "cluster.json"), str(tmp_path / "plan.json")
    (tmp_path / "ds.json").write_text(json.dumps(config))
    result = tmp_path / "result.json"
    command = ["deepspeed", "--num_gpus", str(num_gpus), "--master_port", str(free_port()),
               str(REPO / "examples" / "train.py"), "--deepspeed_config", str(tmp_path / "ds.json"),
               "--steps", "3", "--result", str(result)]
    done = subprocess.run(command, cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    summary = json.loads(result.read_text())
    assert summary["consumed_samples"] == 3 * summary["global_batch_size"]
    assert torch.isfinite(torch.tensor(summary["last_loss"]))
