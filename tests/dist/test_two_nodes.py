"""Two nodes without a shared filesystem, simulated on one machine by two torchrun invocations.

Each "node" runs in its own working directory; only the first holds the cluster and
plan files the DeepSpeed config names, the second has the config alone. Rank 0
reads, decides and broadcasts, so the job trains the uneven plan, and its parameters
equal a single process training the global batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import _training as t
import torch
from harness import assert_launch_finished, free_port

HERE = Path(__file__).resolve().parent
STEPS = 3
ALLOCATION = [(3, 2), (1, 3)]  # ZeRO-1: per-rank micro-batch and accumulation (B = 9)


def _node_dir(root: Path, name: str, *, with_files: bool) -> Path:
    node = root / name
    node.mkdir()
    if with_files:
        t.write_cluster(node / "cluster.json", fast=1, slow=1)
        t.write_plan(node / "plan.json", ALLOCATION, stage=1, device_types=["cpu", "cpu-slow"])
    config = t.ds_config(cluster=Path("cluster.json"), plan=Path("plan.json"), stage=1)
    (node / "ds.json").write_text(json.dumps(config))
    return node


def test_only_the_first_node_has_the_files(tmp_path):
    nodes = [_node_dir(tmp_path, "node0", with_files=True), _node_dir(tmp_path, "node1", with_files=False)]
    port = free_port()
    env = dict(
        os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    )
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node_rank",
                str(index),
                "--nproc_per_node",
                "1",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                str(HERE / "two_nodes_train.py"),
                "--deepspeed_config",
                "ds.json",
                "--steps",
                str(STEPS),
                "--result",
                str(node / "result.pt"),
            ],
            cwd=node,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for index, node in enumerate(nodes)
    ]
    outputs = []
    for process in processes:
        try:
            outputs.append(process.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise
    markers = [node / f"done-rank{index}" for index, node in enumerate(nodes)]
    for process, output in zip(processes, outputs):
        assert_launch_finished(process.returncode, output, markers, output[-4000:])
    result = torch.load(nodes[0] / "result.pt", weights_only=False)
    assert result["plan"] == ALLOCATION
    assert result["devices"] == ["cpu (real)", "cpu-slow (emulated: 1.5x slower, 2.0 GB)"]
    expected, _ = t.reference_parameters("sgd", sum(b * s for b, s in ALLOCATION), STEPS)
    assert t.max_difference(result["params"], expected) <= 1e-5
