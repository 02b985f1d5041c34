"""The runtime on CUDA, able to fail: several ranks, uneven micro-batches, exact gradients.

Three ranks with uneven micro-batches (and uneven accumulation counts at stages 0/1)
against a reference of one process training the global batch:

* fp32: within 1e-5 of one process in plain torch (TF32 off);
* bf16: against one DeepSpeed rank training the global batch in bf16, with a
  tolerance that a *missing* loss weight (DeepSpeed's own 1/accumulation scaling,
  what a wrong weight gives) is shown to exceed, so the test can fail.

With three or more GPUs each rank has its own and NCCL runs; with fewer, the ranks
share the GPUs through a gloo process group with CUDA tensors (NCCL refuses two ranks
on one device); the harness chooses each rank's device before its group starts
(`poplar_ext.hardware.devices.join_job`). On CUDA the ranks are spawned (`START_METHOD`).

`poplar-bench gpu` runs the two equivalence tests and keeps the line each (dtype, stage)
appends to ``POPLAR_GPU_EXACT_LINES``; its dry run sets POPLAR_GPU_TIER_ON_CPU=1, which
runs them on CPU ranks (the same code, gloo, CPU tensors) so that a broken test fails CI
rather than the rare run on a GPU.

Outcome on a GPU: the equivalence tests passed on one NVIDIA H200 (three ranks sharing it,
torch 2.11, CUDA 13.0; bench/results/gpu/h200-run2); the launcher test passed there too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ON_CPU = os.environ.get("POPLAR_GPU_TIER_ON_CPU") == "1"
"""The dry run of `poplar-bench gpu`: the equivalence tests on CPU ranks."""

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() or ON_CPU),
        reason="CUDA is not available: the GPU tier (several ranks, fp32 and bf16 equivalence, launcher on GPUs) "
        "needs a CUDA device",
    ),
]

EXACT_LINES = os.environ.get("POPLAR_GPU_EXACT_LINES")
"""A file each (dtype, stage) result is appended to as a JSON line (set by `poplar-bench gpu`)."""

STEPS = 3
WORLD_SIZE = 3
ALL_STAGES = (0, 1, 2, 3)
MUTATION_STAGES = (0, 3)
"""The stages at which the missing-loss-weight mutation runs: it must exceed the bf16 tolerance there."""
FP32_TOLERANCE = 1e-5
START_METHOD = "spawn" if torch.cuda.is_available() else "fork"
"""How the ranks start. On the GPU machine, ranks forked from the pytest process died at their first CUDA
call ("CUDA error: initialization error", H200, torch 2.11) although torch.cuda.is_initialized() was false
there: something in that process had initialised the CUDA driver. Spawned ranks do not inherit it."""
REPO = Path(__file__).resolve().parents[2]
BF16_TOLERANCE = 2e-3
"""Largest parameter difference from the bf16 reference; the missing-weight run must exceed it."""


def _allocation(stage: int) -> list[tuple[int, int]]:
    return [(3, 2), (1, 3), (2, 1)] if stage < 2 else [(3, 2), (1, 2), (2, 2)]


def _shared_gpus() -> bool:
    return torch.cuda.device_count() < WORLD_SIZE


def collectives_used() -> str:
    """What the ranks' collectives ran on, for the results."""
    if not torch.cuda.is_available():
        return f"gloo, {WORLD_SIZE} CPU ranks (dry run on CPU: no CUDA tensor was involved)"
    if _shared_gpus():
        return (
            f"gloo with CUDA tensors, {WORLD_SIZE} ranks sharing {torch.cuda.device_count()} GPU(s): NCCL refuses two "
            "ranks on one device; gloo copies each CUDA tensor through host memory, so the numerics of the job on "
            "CUDA are checked, NCCL's kernels are not"
        )
    return f"nccl, {WORLD_SIZE} ranks on {WORLD_SIZE} GPUs"


def _append_line(record: dict) -> None:
    """One (dtype, stage) result appended to `EXACT_LINES` as soon as it is known (a time-out keeps it)."""
    if EXACT_LINES:
        with open(EXACT_LINES, "a") as lines:
            lines.write(json.dumps(record) + "\n")


def _train(files: dict, dtype: str, stages: tuple[int, ...], references: dict, check: dict) -> dict:
    """Each stage of `stages` trained by the plan; on rank 0, the largest difference from `references`,
    appended as a line per stage. `check`: the line's label, tolerance and whether the loss weight is left out."""
    import time

    import _training as t

    import poplar_ext

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    differences = {}
    for stage in stages:
        started = time.perf_counter()
        model = t.GPT(t.TINY)
        config = t.ds_config(cluster=files["cluster"], plan=files[stage], stage=stage)
        if dtype == "bf16":
            config["bf16"] = {"enabled": True}
        engine, _, loader, _ = poplar_ext.initialize(
            model=model, optimizer=t.make_optimizer("sgd", model.parameters()), training_data=t.dataset(), config=config
        )
        if check["missing_weight"]:
            # What a missing weight gives: DeepSpeed's own division by this rank's accumulation count.
            engine.backward = lambda loss, _engine=engine, **kwargs: _engine.deepspeed_engine.backward(loss)
        t.train_steps(engine, loader, STEPS)
        parameters = t.full_parameters(engine)  # collective at stage 3
        if int(os.environ["RANK"]) == 0:
            differences[stage] = t.max_difference(parameters, references[stage])
            _append_line(
                {
                    "check": check["label"],
                    "dtype": dtype,
                    "zero_stage": stage,
                    "allocation": _allocation(stage),
                    "max_difference": differences[stage],
                    "tolerance": check["tolerance"],
                    "within_tolerance": differences[stage] <= check["tolerance"],
                    "device": str(engine.device),
                    "collectives": collectives_used(),
                    "seconds": time.perf_counter() - started,
                }
            )
        del engine, loader, model
    return differences


def _bf16_reference(global_batches: dict[int, int]) -> dict:
    """One DeepSpeed rank training each stage's global batch in bf16 (the same numerics as the job)."""
    import _training as t
    import deepspeed

    torch.backends.cuda.matmul.allow_tf32 = False
    results = {}
    data = t.dataset()
    for stage, global_batch in global_batches.items():
        model = t.GPT(t.TINY)
        config = {
            "train_batch_size": global_batch,
            "train_micro_batch_size_per_gpu": global_batch,
            "gradient_clipping": t.CLIP,
            "zero_optimization": {"stage": stage},
            "bf16": {"enabled": True},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10_000,
        }
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=t.make_optimizer("sgd", model.parameters()), config=config
        )
        stream = t.SampleStream(num_samples=t.NUM_SAMPLES, seed=0)
        for step in range(STEPS):
            batch = torch.stack([data[i] for i in stream.indices(step * global_batch, global_batch)]).to(engine.device)
            engine.backward(engine(batch))
            engine.step()
        results[stage] = t.full_parameters(engine)
    return results


def _files(tmp_path: Path) -> dict:
    import _training as t

    # Emulated types (slowdown 1): the parent cannot read the GPU's name without initialising CUDA before the fork.
    files = {"cluster": t.write_cluster(tmp_path / "cluster.json", fast=1, slow=WORLD_SIZE - 1, fast_type="gpu-fast")}
    types = ["gpu-fast"] + ["cpu-slow"] * (WORLD_SIZE - 1)
    for stage in (0, 1, 2, 3):
        files[stage] = t.write_plan(tmp_path / f"plan{stage}.json", _allocation(stage), stage=stage, device_types=types)
    return files


def _run(tmp_path: Path, dtype: str, stages: tuple[int, ...], references: dict, check: dict) -> dict:
    from harness import run_ranks

    tmp_path.mkdir(parents=True, exist_ok=True)  # the bf16 test's runs each have their own folder
    # gloo (set up by the harness, each rank's device chosen first) when ranks share GPUs; otherwise
    # DeepSpeed sets up NCCL.
    return run_ranks(
        _train,
        world_size=WORLD_SIZE,
        tmp_path=tmp_path,
        args=(_files(tmp_path), dtype, stages, references, check),
        init_process_group=_shared_gpus(),
        timeout_s=600,
        start_method=START_METHOD,
    )[0]


def _global_batch(stage: int) -> int:
    return sum(b * s for b, s in _allocation(stage))


def test_fp32_equals_one_process_on_the_global_batch(tmp_path):
    import _training as t

    # One process in plain torch on the CPU: the parent must not touch CUDA before the ranks fork.
    references = {stage: t.reference_parameters("sgd", _global_batch(stage), STEPS)[0] for stage in ALL_STAGES}
    check = {"label": "fp32", "tolerance": FP32_TOLERANCE, "missing_weight": False}
    differences = _run(tmp_path, "fp32", ALL_STAGES, references, check)
    assert sorted(differences) == list(ALL_STAGES)
    for stage, difference in differences.items():
        assert difference <= FP32_TOLERANCE, f"stage {stage}: {difference}"


def test_bf16_equals_a_bf16_reference_and_a_missing_weight_does_not(tmp_path):
    from harness import run_ranks

    reference = run_ranks(
        _bf16_reference,
        world_size=1,
        tmp_path=tmp_path / "reference",
        args=({stage: _global_batch(stage) for stage in ALL_STAGES},),
        init_process_group=False,
        timeout_s=600,
        start_method=START_METHOD,
    )[0]
    exact_check = {"label": "bf16", "tolerance": BF16_TOLERANCE, "missing_weight": False}
    mutation_check = {
        "label": "bf16 without the loss weight (mutation)",
        "tolerance": BF16_TOLERANCE,
        "missing_weight": True,
    }
    exact = _run(tmp_path / "weighted", "bf16", ALL_STAGES, reference, exact_check)
    missing = _run(tmp_path / "unweighted", "bf16", MUTATION_STAGES, reference, mutation_check)
    assert sorted(exact) == list(ALL_STAGES) and sorted(missing) == list(MUTATION_STAGES)
    for stage, difference in exact.items():
        assert difference <= BF16_TOLERANCE, f"stage {stage}: {difference}"
    for stage, difference in missing.items():
        assert difference > BF16_TOLERANCE, f"stage {stage}: a missing weight ({difference}) would pass this test"


def _gpu_device_type() -> str:
    # In a child process: CUDA initialised here would keep the harness from forking ranks.
    code = (
        "import torch; from poplar_ext.hardware.devices import hardware_device_type; "
        "print(hardware_device_type(torch.device('cuda', 0)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(ON_CPU and not torch.cuda.is_available(), reason="dry run on CPU: the launcher test needs GPUs")
@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="the deepspeed launcher is not on PATH")
def test_launcher_on_cuda_with_bf16_and_the_cluster_read_from_the_hardware(tmp_path):
    from harness import free_port

    num_gpus = min(2, torch.cuda.device_count())
    device_type = _gpu_device_type()
    config = json.loads((REPO / "examples" / "ds_config.json").read_text())
    config["bf16"] = {"enabled": True}
    config["poplar"].pop("cluster", None)  # no cluster file: each rank's GPU is read from the hardware
    (tmp_path / "plan.json").write_text(
        json.dumps(
            {
                "schema_version": 1,
                "policy": "uniform",
                "zero_stage": 1,
                "global_batch_size": 8 * num_gpus,
                "ranks": [
                    {"rank": r, "device_type": device_type, "micro_batch_size": 4, "gradient_accumulation_steps": 2}
                    for r in range(num_gpus)
                ],
                "predicted": {"iteration_time_s": 1.0, "samples_per_s": 1.0, "ideal_samples_per_s": 1.0},
                "profile_fingerprints": {},
            }
        )
    )
    config["poplar"]["plan"] = str(tmp_path / "plan.json")
    (tmp_path / "ds.json").write_text(json.dumps(config))
    result = tmp_path / "result.json"
    command = [
        "deepspeed",
        "--num_gpus",
        str(num_gpus),
        "--master_port",
        str(free_port()),
        str(REPO / "examples" / "train.py"),
        "--deepspeed_config",
        str(tmp_path / "ds.json"),
        "--steps",
        "3",
        "--result",
        str(result),
    ]
    done = subprocess.run(command, cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    summary = json.loads(result.read_text())
    assert summary["consumed_samples"] == 3 * summary["global_batch_size"]
    assert summary["devices"] == [f"{device_type} (real)"] * num_gpus
    assert torch.isfinite(torch.tensor(summary["last_loss"]))
