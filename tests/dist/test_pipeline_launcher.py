"""The pipeline example end to end under torchrun (4 ranks, CPU/gloo, two of an emulated type).

Two pipelines of two stages that differ in layer split, micro-batch size and count
(examples/plan_pipeline.json); the checkpoint it saves at the end holds, in each pipeline's
folder, the parameters of one process training the same global batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from harness import assert_launch_finished, free_port

from poplar_ext.models.toy_pipeline import RegressionData, mse, toy_sequential
from poplar_ext.runtime.data import SampleStream

REPO = Path(__file__).resolve().parents[2]
STEPS, NUM_SAMPLES, GLOBAL_BATCH, CLIP = 3, 25, 18, 1.0  # examples/plan_pipeline.json, ds_config_pipeline.json


def _replay() -> dict[str, torch.Tensor]:
    model = toy_sequential()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data, stream = RegressionData(num_samples=NUM_SAMPLES), SampleStream(num_samples=NUM_SAMPLES, seed=0)
    for step in range(STEPS):
        indices = stream.indices(step * GLOBAL_BATCH, GLOBAL_BATCH)
        optimizer.zero_grad()
        mse(model(data.inputs[indices]), data.targets[indices]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
    return {name: p.detach() for name, p in model.state_dict().items()}


def test_the_pipeline_example_under_torchrun(tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(free_port()),
        str(REPO / "examples" / "pipeline_train.py"),
        "--deepspeed_config", str(REPO / "examples" / "ds_config_pipeline.json"),
        "--steps", str(STEPS), "--num-samples", str(NUM_SAMPLES),
        "--save-dir", str(tmp_path / "checkpoints"), "--result", str(tmp_path / "result.json"),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    log = done.stdout + done.stderr
    # The checkpoint's state file (written once every rank saved) and rank 0's summary after it are the job's last
    # acts: gloo's exit race may abort a rank after them (pytorch/pytorch#179291, docs/fault-tolerance.md).
    checkpoints = tmp_path / "checkpoints"
    latest = checkpoints / "latest"
    state_file = checkpoints / (latest.read_text().strip() if latest.is_file() else "-") / "poplar_state.json"
    assert_launch_finished(done.returncode, log, [state_file, tmp_path / "result.json"], log[-4000:])
    assert (
        "rank 3: cpu-slow (emulated: 2x slower, 2.0 GB), pipeline 1 stage 1 of 2 (layers 2-5), micro-batch 3 x 2" in log
    )
    summary = json.loads((tmp_path / "result.json").read_text())
    assert (summary["steps"], summary["global_batch_size"], summary["data_position"]) == (3, 18, 54)
    expected = _replay()
    tag = tmp_path / "checkpoints" / (tmp_path / "checkpoints" / "latest").read_text().strip()
    assert json.loads((tag / "poplar_state.json").read_text())["data_position"] == 54
    for pipeline in ("pipeline0", "pipeline1"):
        found = {}
        for layer in range(6):
            state = torch.load(tag / pipeline / f"layer_{layer:02d}-model_states.pt")
            found.update({f"{layer}.{key}": value for key, value in state.items()})
        assert found.keys() == expected.keys()
        assert max(float((found[k] - v).abs().max()) for k, v in expected.items()) <= 1e-5
