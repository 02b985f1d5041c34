"""torchrun with restarts left ends a job whose configuration is wrong at its first start (issue 36, item 11).

Before, the agent restarted the worker until --max-restarts: the same refusal every time.
"""

from __future__ import annotations

import json
import subprocess
import sys

from harness import free_port

SCRIPT = """
import sys
from pathlib import Path

import torch

import poplar_ext

with open(sys.argv[1], "a") as starts:
    starts.write("start\\n")
model = torch.nn.Linear(2, 1)
poplar_ext.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=sys.argv[2])
"""


def test_a_refused_configuration_is_not_restarted(tmp_path):
    script, starts, config = tmp_path / "train.py", tmp_path / "starts.txt", tmp_path / "ds.json"
    script.write_text(SCRIPT)
    config.write_text(json.dumps({"train_batch_size": 4, "poplar": {"plan": str(tmp_path / "missing-plan.json")}}))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--max-restarts", "3",
        "--master_port", str(free_port()), str(script), str(starts), str(config),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode != 0
    assert starts.read_text().count("start") == 1, done.stderr[-3000:]
    assert "missing-plan.json" in done.stdout + done.stderr
    assert "asking the launcher" in done.stdout + done.stderr
