"""`decided_by_rank0` (poplar_ext.collectives): what rank 0's decision raises, every rank raises alike.

The same type and message on every rank (a ValueError or TypeError as itself, anything else as a RuntimeError
naming it), so that `poplar_ext.elastic` ends or restarts every rank of a job alike; rank 0's chained to the
exception it raised, whose traceback shows where it failed. One forked group of 2 ranks, no engine.
"""

from __future__ import annotations

import pytest
from harness import run_ranks

from poplar_ext.plan.errors import FormatError


def _bad_field():
    raise FormatError("plan.json", "ranks[1].micro_batch_size", "an integer >= 1", "0")


def _bad_code():
    return len(7)


def _missing_file():
    open("/nonexistent/poplar/plan.json")


def _decisions():
    import torch.distributed as dist

    from poplar_ext.collectives import decided_by_rank0

    seen = {}
    for decide in (_bad_field, _bad_code, _missing_file):
        try:
            decided_by_rank0(decide, rank=dist.get_rank())
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            cause = exc.__cause__
            seen[decide.__name__] = (type(exc).__name__, str(exc), cause and type(cause).__name__)
    return seen


@pytest.fixture(scope="module")
def decisions(tmp_path_factory):
    return run_ranks(_decisions, world_size=2, tmp_path=tmp_path_factory.mktemp("rank0"), timeout_s=120)


@pytest.mark.parametrize(
    ("decide", "kind", "message", "cause"),
    [
        (
            "_bad_field",
            "ValueError",
            "plan.json: ranks[1].micro_batch_size: expected an integer >= 1, found 0",
            "FormatError",
        ),
        ("_bad_code", "TypeError", "object of type 'int' has no len()", "TypeError"),
        (
            "_missing_file",
            "RuntimeError",
            "rank 0 failed: FileNotFoundError: [Errno 2] No such file or directory: '/nonexistent/poplar/plan.json'",
            "FileNotFoundError",
        ),
    ],
)
def test_every_rank_raises_rank0s_error_alike(decisions, decide, kind, message, cause):
    assert decisions[0][decide] == (kind, message, cause)  # rank 0's own, chained
    assert decisions[1][decide] == (kind, message, None)
