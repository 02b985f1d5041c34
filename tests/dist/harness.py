"""Run a function on N real ranks (CPU, gloo) forked from the pytest process.

Why forking: a fresh ``deepspeed`` launch costs ~18 s (importing deepspeed, then the
lazy imports of the first ``deepspeed.initialize``). Ranks forked from a process that
already imported deepspeed, torch._dynamo and deepspeed's muon optimizer start in
~1 s, and one forked group can build many engines in sequence.

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
timeout already initialised (``deepspeed.init_distributed`` then reuses it), so a
rank stuck in a collective fails after `pg_timeout_s` instead of hanging.
Each rank writes its return value, or its exception's traceback, to a file under
`tmp_path` (a rank that gloo aborts cannot report any other way), and its stdout
and stderr to ``rank{N}.log`` there. The parent joins every rank with `timeout_s`
and kills what is left. `run_ranks` returns the per-rank values in rank order, or
raises `RankFailure` listing every failed rank's error, exit code and log tail.
Use `run_ranks_outcomes` to inspect failures instead of raising.

Never call this after CUDA was initialised in the parent: a forked child cannot use
CUDA then (it raises `RuntimeError` at once in that case).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

LOG_TAIL_LINES = 30


@dataclass(frozen=True, kw_only=True)
class RankOutcome:
    """What one rank did."""

    rank: int
    ok: bool
    """True when the function returned on this rank."""
    value: Any
    """The function's return value (None unless `ok`)."""
    error: str
    """The traceback, or why no result came back (killed, aborted); "" when `ok`."""
    exit_code: int | None
    """The process exit code (negative: killed by that signal; None: did not exit in time)."""
    log_path: Path
    """The rank's captured stdout and stderr."""

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last `lines` lines of the rank's log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


class RankFailure(AssertionError):
    """One or more ranks failed; the message holds every failed rank's error and log tail."""

    def __init__(self, outcomes: list[RankOutcome]) -> None:
        self.outcomes = outcomes
        parts = []
        for o in outcomes:
            if not o.ok:
                parts.append(
                    f"--- rank {o.rank} (exit code {o.exit_code}) ---\n{o.error}\n"
                    f"--- rank {o.rank} log tail ---\n{o.log_tail()}"
                )
        super().__init__("ranks failed:\n" + "\n".join(parts))


def preimport_for_fork() -> None:
    """Import what every rank would otherwise import after the fork (the slow part).

    Idempotent: Python's import system makes a second call a no-op.
    """
    import deepspeed  # noqa: F401
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    import torch._dynamo  # noqa: F401

    from poplar_ext.hardware.cpu_process import skip_deepspeed_shm_op

    # The ranks train on CPU: DeepSpeed's inference-only shared-memory op would cost
    # a ~50 s compile on a fresh machine.
    skip_deepspeed_shm_op()


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    init_process_group: bool,
    pg_timeout_s: float,
) -> None:
    result_path = Path(out_dir) / f"rank{rank}.result"
    log_fd = os.open(Path(out_dir) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    # pytest's capture replaced sys.stdout/stderr by objects writing to its own files.
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    exit_code = 0
    # DeepSpeed calls gc.collect() in every ZeRO-3 initialize (and elsewhere): what the fork
    # copied from pytest need not be traversed each time (~1.5 s a call otherwise).
    gc.freeze()
    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
        )
        import torch
        import torch.distributed as dist

        # One thread per rank: ranks share the machine's few cores.
        torch.set_num_threads(1)
        if init_process_group:
            dist.init_process_group(
                "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
            )
        try:
            value = fn(*args, **kwargs)
            payload = ("ok", value)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure must reach the parent as text
        payload = ("error", traceback.format_exc())
        exit_code = 1
    try:
        with open(result_path, "wb") as f:
            pickle.dump(payload, f)
    except Exception:  # noqa: BLE001 - e.g. an unpicklable return value
        with open(result_path, "wb") as f:
            pickle.dump(("error", traceback.format_exc()), f)
        exit_code = 1
    # os._exit skips Python's buffer flushing: flush the rank's output to its log first.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    # Skip the parent's atexit handlers and pytest's teardown that the fork copied.
    os._exit(exit_code)


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
) -> list[RankOutcome]:
    """Run ``fn(*args, **kwargs)`` on `world_size` forked ranks; one `RankOutcome` per rank.

    `fn` must be a top-level function (it is called in the forked child, not pickled).
    `timeout_s` bounds the whole group: ranks still running then are killed.
    """
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError("run_ranks: CUDA is initialised in this process; forked ranks could not use it")
    preimport_for_fork()
    out_dir = Path(tmp_path) / f"ranks-{os.getpid()}-{free_port()}"
    out_dir.mkdir(parents=True)
    port = free_port()
    ctx = multiprocessing.get_context("fork")
    processes = [
        ctx.Process(
            target=_rank_main,
            args=(fn, args, kwargs or {}, rank, world_size, port, str(out_dir), init_process_group, pg_timeout_s),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in processes:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    timed_out = {rank for rank, p in enumerate(processes) if p.is_alive()}
    for rank in sorted(timed_out):
        processes[rank].kill()
        processes[rank].join(5.0)
    outcomes = []
    for rank, p in enumerate(processes):
        log_path = out_dir / f"rank{rank}.log"
        result_path = out_dir / f"rank{rank}.result"
        if rank in timed_out:
            outcome = RankOutcome(
                rank=rank, ok=False, value=None, error=f"still running after {timeout_s:g} s: killed",
                exit_code=None, log_path=log_path,
            )
        elif not result_path.exists():
            outcome = RankOutcome(
                rank=rank, ok=False, value=None,
                error=f"died without a result (exit code {p.exitcode}; negative = signal)",
                exit_code=p.exitcode, log_path=log_path,
            )
        else:
            with open(result_path, "rb") as f:
                status, value = pickle.load(f)
            ok = status == "ok"
            outcome = RankOutcome(
                rank=rank, ok=ok, value=value if ok else None, error="" if ok else value,
                exit_code=p.exitcode, log_path=log_path,
            )
        outcomes.append(outcome)
    return outcomes


def run_ranks(fn: Callable[..., Any], *, world_size: int, tmp_path: str | os.PathLike[str], **options: Any) -> list[Any]:
    """Run `fn` on `world_size` ranks (see `run_ranks_outcomes` for `options`).

    Returns the per-rank return values in rank order; raises `RankFailure` naming
    every rank that failed, with its error and log tail.
    """
    outcomes = run_ranks_outcomes(fn, world_size=world_size, tmp_path=tmp_path, **options)
    if not all(o.ok for o in outcomes):
        raise RankFailure(outcomes)
    return [o.value for o in outcomes]


__all__ = ["RankFailure", "RankOutcome", "free_port", "preimport_for_fork", "run_ranks", "run_ranks_outcomes"]
