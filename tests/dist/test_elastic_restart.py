"""A lost node restarts the job by itself: torchrun's elastic agent, two nodes on localhost.

Two agents (``--nnodes 1:2 --max-restarts 2``, c10d rendezvous) each start one rank of
examples/train.py, which checkpoints every CHECKPOINT_INTERVAL steps and starts from
the latest checkpoint it finds. The cluster is read from the hardware and the plan
searched at start (the automatic mode). Once a checkpoint exists the second node is
killed (agent and rank); the first agent's rank fails in its next collective, the
agent restarts it alone, and the job continues from the latest checkpoint on the one
rank that is left, with a plan for one rank, the data stream continued, and finishes
with exit code 0.

The first agent hosts the rendezvous store (``is_host``, the other agent is its client, so
that both start at once, as nodes do): torchrun's c10d rendezvous lives in that agent, so
it is the node that must survive (see the recipe in docs/fault-tolerance.md).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from harness import free_port

from poplar_ext.plan.formats import load_profiles
from poplar_ext.profiler.cache import parked_profiles_dir

REPO = Path(__file__).resolve().parents[2]
STEPS = 300
CHECKPOINT_INTERVAL = 150
GLOBAL_BATCH = 12


def _agent(tmp_path: Path, port: int, name: str, *, is_host: bool) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1:2",
        "--nproc_per_node",
        "1",
        "--max-restarts",
        "2",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"127.0.0.1:{port}",
        "--rdzv_id",
        "job",
        "--rdzv_conf",
        # The other pytest worker can starve an agent for seconds. A node is lost after 10 s without a
        # heartbeat (1 s x 2 once read a live agent as lost); the restart waits that once. The first round
        # waits 5 s for a second node (once, at 3 s, a late second node made two rounds and a 60 s timeout).
        f"last_call_timeout=5,keep_alive_interval=2,keep_alive_max_attempt=5,is_host={int(is_host)}",
        str(REPO / "examples" / "train.py"),
        "--deepspeed_config",
        "ds.json",
        "--steps",
        str(STEPS),
        "--checkpoint-dir",
        "checkpoints",
        "--checkpoint-interval-steps",
        str(CHECKPOINT_INTERVAL),
        "--result",
        f"result-{name}.json",
    ]
    log = open(tmp_path / f"{name}.log", "w")
    env = dict(
        os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", LOGLEVEL="INFO"
    )  # the agent says when it restarts
    return subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _kill_node(agent: subprocess.Popen) -> None:
    """The node is lost: its agent and its rank (torchrun starts ranks in sessions of their own)."""
    node = psutil.Process(agent.pid)
    for process in [node, *node.children(recursive=True)]:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    agent.wait(30)


def _latest_step(checkpoints: Path) -> int:
    try:
        return int((checkpoints / "latest").read_text().strip().removeprefix("global_step"))
    except (OSError, ValueError):
        return 0


def test_a_killed_node_restarts_the_job_on_the_node_left(tmp_path):
    (tmp_path / "ds.json").write_text(
        json.dumps(
            {
                "train_batch_size": GLOBAL_BATCH,
                "gradient_clipping": 1.0,
                "zero_optimization": {"stage": 1},
                "steps_per_print": 100_000,
                "poplar": {"profiles": "profiles", "cpu_threads": 1, "log_interval_steps": 0},
            }
        )
    )
    port = free_port()
    survivor = _agent(tmp_path, port, "node0", is_host=True)  # node0 hosts the rendezvous store
    lost = _agent(tmp_path, port, "node1", is_host=False)
    try:
        deadline = time.monotonic() + 180
        while _latest_step(tmp_path / "checkpoints") < CHECKPOINT_INTERVAL:
            for name, agent in (("node0", survivor), ("node1", lost)):
                assert agent.poll() is None, (tmp_path / f"{name}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "node1.log").read_text()[-3000:]
            time.sleep(0.05)
        _kill_node(lost)
        killed_after = _latest_step(tmp_path / "checkpoints")
        assert killed_after < STEPS, "the job ended before a node could be lost: raise STEPS"
        exit_code = survivor.wait(240)
    finally:
        for agent in (survivor, lost):
            if agent.poll() is None:
                _kill_node(agent)
    log = (tmp_path / "node0.log").read_text()
    assert exit_code == 0, log[-5000:]
    assert "will restart worker group" in log
    result = json.loads((tmp_path / "result-node0.json").read_text())
    assert result["steps"] == STEPS and result["world_size"] == 1
    assert (result["rank0_micro_batch_size"], result["rank0_gradient_accumulation_steps"]) == (GLOBAL_BATCH, 1)
    # the restarted rank began at a checkpoint saved while both nodes trained, and continued the stream there
    resumed_at = result["first_step"]
    assert resumed_at >= killed_after and resumed_at % CHECKPOINT_INTERVAL == 0
    moved = re.search(
        r"resumed from \S+ under another plan \(2 ranks then, 1 now\); the data continues at stream "
        r"position (\d+)",
        log,
    )
    assert moved is not None, log[-5000:]
    assert int(moved.group(1)) == resumed_at * GLOBAL_BATCH
    assert result["consumed_samples"] == STEPS * GLOBAL_BATCH
    # Profiled once per world size: the 1-rank profiles where the search reads, the 2-rank ones kept for a rejoin.
    profiles = tmp_path / "profiles"
    on_one, on_two = load_profiles(profiles), load_profiles(parked_profiles_dir(profiles, 2))
    assert on_one and {p.world_size for p in on_one} == {1}, sorted(profiles.rglob("*.json"))
    assert {p.world_size for p in on_two} == {2}, sorted(profiles.rglob("*.json"))
    assert sorted(p.key for p in on_two) == sorted(p.key for p in on_one)
