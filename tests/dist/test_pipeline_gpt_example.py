"""examples/pipeline_gpt.py end to end under torchrun (4 ranks, CPU/gloo, two of an emulated type).

No plan file: the layer profiles of the GPT-2 (its head tied to its embedding) are measured at
the first start, rank 0 searches the plan and every rank trains it; the losses the run returns
(the global batch's token mean) are those of one process training the Hugging Face model on the
same global batches with the same AdamW.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import assert_launch_finished, free_port

pytest.importorskip("transformers", reason="a Hugging Face model: pip install 'poplar-ext[hf]'")

import _hf_common as hf  # noqa: E402

from poplar_ext.models.hugging_face import PaddedTokens  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "pipeline_gpt.py"
STEPS, NUM_SAMPLES, GLOBAL_BATCH, CLIP, LR = 3, 60, 24, 1.0, 1e-3  # examples/ds_config_pipeline_gpt.json


def _example():
    spec = importlib.util.spec_from_file_location("pipeline_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference_losses() -> list[float]:
    example = _example()
    model = example.gpt2(4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    data = PaddedTokens(num_samples=NUM_SAMPLES, vocab_size=example.VOCAB_SIZE, length=example.SEQUENCE_LENGTH)
    losses, _ = hf.train_in_one_process(model, optimizer, data, global_batch=GLOBAL_BATCH, steps=STEPS, clip=CLIP)
    return losses


def test_the_gpt_pipeline_example_searches_its_plan_and_trains_the_models_loss(tmp_path):
    for name in ("ds_config_pipeline_gpt.json", "cluster_pipeline.json"):  # profiles are written beside them
        shutil.copy(REPO / "examples" / name, tmp_path / name)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(free_port()),
        str(EXAMPLE), "--deepspeed_config", str(tmp_path / "ds_config_pipeline_gpt.json"),
        "--steps", str(STEPS), "--num-samples", str(NUM_SAMPLES), "--result", str(tmp_path / "result.json"),
    ]  # fmt: skip
    output = tmp_path / "torchrun.log"
    with output.open("w") as out:
        ranks = subprocess.Popen(command, cwd=tmp_path, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                 stdout=out, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        try:
            # Computed while the ranks start (seconds of imports each): the parent would otherwise wait idle.
            reference = _reference_losses()
            returncode = ranks.wait(timeout=300)
        finally:
            if ranks.poll() is None:
                ranks.kill()
                ranks.wait()
    log = output.read_text()
    # Rank 0's summary follows the last (collective) step: gloo's exit race may abort a rank after it
    # (pytorch/pytorch#179291, docs/fault-tolerance.md).
    assert_launch_finished(returncode, log, [tmp_path / "result.json"], log[-4000:])
    assert sorted(p.name.split("-", 2)[2] for p in (tmp_path / "profiles" / "layers").glob("*.json")) == [
        "cpu-slow-zero0.json",
        "cpu-zero0.json",
    ]
    summary = json.loads((tmp_path / "result.json").read_text())
    assert (summary["steps"], summary["global_batch_size"]) == (STEPS, GLOBAL_BATCH)
    example = _example()
    layers = len(example.causal_lm_layers(example.gpt2(4)).layers)
    for stages in summary["pipelines"]:  # each pipeline holds every layer once, in order
        assert stages[0][0] == 0 and stages[-1][1] == layers - 1
        assert all(after[0] == before[1] + 1 for before, after in zip(stages, stages[1:]))
    assert sum(b * s for b, s in summary["micro_batches"]) == GLOBAL_BATCH
    assert summary["losses"] == pytest.approx(reference, abs=1e-4)
