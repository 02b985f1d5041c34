"""The rank harness itself: results come back in rank order, failures name every rank."""

from __future__ import annotations

import os
import sys

import pytest
from harness import RankFailure, run_ranks, run_ranks_outcomes

from poplar_bench.local_ranks import run_command_ranks


def _sum_of_ranks(offset):
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(int(os.environ["RANK"]) + offset)])
    dist.all_reduce(value)
    return {"rank": int(os.environ["RANK"]), "world": dist.get_world_size(), "sum": float(value)}


def _fail_on_odd_ranks():
    rank = int(os.environ["RANK"])
    if rank % 2:
        raise ValueError(f"rank {rank} refuses")
    return rank


def _rank_one_hangs_in_a_collective():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        dist.all_reduce(torch.zeros(1))  # rank 0 never joins: gloo times out
    return "done"


def test_results_in_rank_order(tmp_path):
    results = run_ranks(_sum_of_ranks, world_size=3, tmp_path=tmp_path, args=(10,))
    assert results == [{"rank": r, "world": 3, "sum": 33.0} for r in range(3)]


def test_failures_name_every_failed_rank(tmp_path):
    with pytest.raises(RankFailure, match=r"(?s)rank 1 \(exit code 1\).*ValueError: rank 1 refuses.*rank 3 \(exit"):
        run_ranks(_fail_on_odd_ranks, world_size=4, tmp_path=tmp_path, init_process_group=False)


def test_a_rank_stuck_in_a_collective_fails_after_the_group_timeout(tmp_path):
    outcomes = run_ranks_outcomes(
        _rank_one_hangs_in_a_collective, world_size=2, tmp_path=tmp_path, pg_timeout_s=3, timeout_s=60
    )
    assert outcomes[0].ok and outcomes[0].value == "done"
    assert not outcomes[1].ok


_EXIT_WITH_THREE_TIMES_THE_RANK = """
import os, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} of {os.environ['WORLD_SIZE']}", file=sys.stderr)
if rank == 0:
    time.sleep(1)  # still running when rank 1 has failed
sys.exit(3 * rank)
"""


def test_command_ranks_each_run_to_their_own_exit_code(tmp_path):
    command = [sys.executable, "-c", _EXIT_WITH_THREE_TIMES_THE_RANK]
    outcomes = run_command_ranks(command, world_size=2, log_dir=tmp_path, timeout_s=60)
    # A launcher would have stopped rank 0 when rank 1 failed (torchrun does).
    assert [(o.ok, o.exit_code) for o in outcomes] == [(True, 0), (False, 3)]
    assert [o.log_tail() for o in outcomes] == ["rank 0 of 2", "rank 1 of 2"]
