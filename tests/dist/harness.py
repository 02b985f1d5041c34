"""Run a function on N real ranks (CPU, gloo) forked from the pytest process.

Thin wrappers over `poplar_bench.local_ranks` (the one local-rank launcher, shared with
the bench), which says how the ranks start and why: forked from a process that already
imported deepspeed, ranks start in ~1 s instead of ~18 s for a fresh launch, and one
forked group can build many engines in sequence.

Usage::

    from harness import run_ranks            # tests/dist is on sys.path in its tests

    def _train(stage):                       # top level of the test module
        import poplar_ext                    # rank/world come from the environment
        ...
        return {"loss": float(loss)}         # anything picklable

    def test_x(tmp_path):
        results = run_ranks(_train, world_size=3, tmp_path=tmp_path, kwargs={"stage": 2})
        assert results[0]["loss"] == ...

Each rank gets ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT`` (new per call),
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``, one torch thread,
and, unless ``init_process_group=False``, a gloo process group with a short
timeout already initialised (``deepspeed.init_distributed``; DeepSpeed's initialize
reuses it), so a rank stuck in a collective fails after `pg_timeout_s` instead of
hanging. Each rank's return value, or its exception's traceback, comes back to the
parent, and its stdout and stderr go to ``rank{N}.log`` in a new folder under
`tmp_path`. The parent waits for every rank with `timeout_s` and kills what is left.
`run_ranks` returns the per-rank values in rank order, or raises `RankFailure`
listing every failed rank's error, exit code and log tail. Use `run_ranks_outcomes`
to inspect failures instead of raising.

Never call this after CUDA was initialised in the parent: a forked child cannot use
CUDA then (it raises `RuntimeError` at once in that case).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from poplar_bench import local_ranks
from poplar_bench.local_ranks import LOG_TAIL_LINES, RankOutcome, free_port, preimport_for_fork


class RankFailure(local_ranks.RankFailure, AssertionError):
    """One or more ranks failed; the message holds every failed rank's error and log tail.

    An AssertionError too: ranks that fail make a failed test, not an error in the harness.
    """


def run_ranks_outcomes(
    fn: Callable[..., Any],
    *,
    world_size: int,
    tmp_path: str | os.PathLike[str],
    args: tuple = (),
    kwargs: dict | None = None,
    timeout_s: float = 120.0,
    pg_timeout_s: float = 30.0,
    init_process_group: bool = True,
    start_method: str = "fork",
) -> list[RankOutcome]:
    """Run ``fn(*args, **kwargs)`` on `world_size` forked ranks; one `RankOutcome` per rank.

    `fn` must be a top-level function (forked: it is called in the child, not pickled; "spawn": it and
    its arguments are pickled into a fresh interpreter per rank).
    `timeout_s` bounds the whole group: ranks still running then are killed.
    """
    out_dir = Path(tmp_path) / f"ranks-{os.getpid()}-{free_port()}"
    out_dir.mkdir(parents=True)
    return local_ranks.run_ranks_outcomes(
        fn,
        world_size=world_size,
        log_dir=out_dir,
        args=args,
        kwargs=kwargs,
        timeout_s=timeout_s,
        pg_timeout_s=pg_timeout_s,
        init_process_group=init_process_group,
        start_method=start_method,
    )


def run_ranks(
    fn: Callable[..., Any], *, world_size: int, tmp_path: str | os.PathLike[str], **options: Any
) -> list[Any]:
    """Run `fn` on `world_size` ranks (see `run_ranks_outcomes` for `options`).

    Returns the per-rank return values in rank order; raises `RankFailure` naming
    every rank that failed, with its error and log tail.
    """
    outcomes = run_ranks_outcomes(fn, world_size=world_size, tmp_path=tmp_path, **options)
    if not all(o.ok for o in outcomes):
        raise RankFailure(outcomes)
    return [o.value for o in outcomes]


EXIT_ABORT = "terminate called without an active exception"
"""What gloo's exit race (pytorch/pytorch#179291) prints when it aborts a rank at interpreter exit."""


def assert_launch_finished(returncode: int, output: str, done_markers: list[Path], context: str) -> None:
    """A launched job passed, or gloo's exit race aborted a rank only after every rank wrote its done marker
    (its last act: the job's results stand). Any other failure, or an abort before a marker, fails the test."""
    if returncode != 0:
        finished = all(marker.exists() for marker in done_markers)
        assert finished and EXIT_ABORT in output, context


__all__ = [
    "EXIT_ABORT",
    "LOG_TAIL_LINES",
    "RankFailure",
    "RankOutcome",
    "assert_launch_finished",
    "free_port",
    "preimport_for_fork",
    "run_ranks",
    "run_ranks_outcomes",
]
