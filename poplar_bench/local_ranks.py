"""Local ranks: processes on this machine started as the ranks of one job, and what each did. The seams on torch
elastic are marked "elastic:". See docs/bench.md (local ranks)."""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import (
    LogsDest,
    LogsSpecs,
    MultiprocessContext,
    ProcessFailure,
    RunProcsResult,
    SubprocessContext,
)

from poplar_ext.collectives import free_port, leave_process_group
from poplar_ext.hardware.cpu_process import limit_cpu_threads, skip_deepspeed_shm_op

LOG_TAIL_LINES = 30  # lines of each failed rank's log `RankFailure` shows
_WAKE_S = 0.2  # the longest the parent sleeps between looks at the ranks (it wakes at once when one exits)
_KILL_WAIT_S = 5  # how long the parent waits for a killed rank to be gone


@dataclass(frozen=True, kw_only=True)
class RankOutcome:
    """What one rank did (a function's rank or a command's)."""

    rank: int
    """The rank (its ``RANK``)."""
    ok: bool
    """True when the function returned on this rank (a command: exited with code 0)."""
    value: Any
    """The function's return value (None unless `ok`; always None for a command)."""
    error: str
    """The traceback, or why no result came back (killed, aborted, exit code); "" when `ok`."""
    exit_code: int | None
    """The process exit code (negative: killed by that signal; None: did not exit in time)."""
    log_path: Path | None
    """The rank's captured stdout and stderr (a command's stderr); None when it wrote to the console."""

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last `lines` lines of the rank's log."""
        if self.log_path is None:
            return "(written to the console)"
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


class RankFailure(RuntimeError):
    """One or more ranks failed; the message holds every failed rank's error, exit code and log tail."""

    def __init__(self, outcomes: list[RankOutcome]) -> None:
        self.outcomes = outcomes
        parts = [
            f"--- rank {o.rank} (exit code {o.exit_code}) ---\n{o.error}"
            + ("" if o.log_path is None else f"\n--- rank {o.rank} log tail ---\n{o.log_tail()}")
            for o in outcomes
            if not o.ok
        ]
        super().__init__("ranks failed:\n" + "\n".join(parts))


def preimport_for_fork() -> None:
    """Import what every forked rank would otherwise import after the fork (the slow part); idempotent."""
    import deepspeed  # noqa: F401
    import torch._dynamo  # noqa: F401  (imported lazily by the first deepspeed.initialize)

    # The ranks train on CPU: DeepSpeed's inference-only shared-memory op would cost
    # a ~50 s compile on a fresh machine.
    skip_deepspeed_shm_op()
    with contextlib.suppress(ImportError):  # a DeepSpeed without it: the first initialize is merely slower
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401  (same reason)


def endless_batches(loader: Iterable[Any], name: str) -> Iterator[Any]:
    """`loader`'s batches, pass after pass, for a loop of any length; a pass yielding nothing fails at once
    (RuntimeError naming `name`) where a plain repeat would spin for ever."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise RuntimeError(f"{name}: a pass over it yielded no batch")


def run_ranks(fn: Callable[..., Any], *, world_size: int, log_dir: str | os.PathLike[str], **options: Any) -> list[Any]:
    """Run `fn` on `world_size` local ranks (`options`: see `run_ranks_outcomes`); the values in rank order.
    Raises `RankFailure` naming every rank that failed, with its error, exit code and log tail."""
    outcomes = run_ranks_outcomes(fn, world_size=world_size, log_dir=log_dir, **options)
    if not all(o.ok for o in outcomes):
        raise RankFailure(outcomes)
    return [o.value for o in outcomes]


def run_ranks_outcomes(
    fn: Callable[..., Any],
    *,
    world_size: int,
    log_dir: str | os.PathLike[str],
    args: tuple = (),
    kwargs: dict | None = None,
    start_method: str = "fork",
    timeout_s: float = 120.0,
    init_process_group: bool = True,
    pg_timeout_s: float = 30.0,
    capture_output: bool = True,
    stop_after_failure_s: float | None = None,
) -> list[RankOutcome]:
    """Run ``fn(*args, **kwargs)`` (a top-level function) on `world_size` local ranks; a `RankOutcome` each.

    `log_dir` receives ``rank<N>.log`` (with `capture_output`) and ``rank<N>.error.json`` (a failed rank's
    traceback). `timeout_s` bounds the whole group; with `stop_after_failure_s`, the ranks still running that
    long after a rank failed are killed too (instead of waiting in a collective for the process-group timeout).
    """
    if start_method not in ("fork", "spawn"):
        raise ValueError(f"start_method: expected 'fork' or 'spawn', found {start_method!r}")
    if start_method == "fork":
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            raise RuntimeError("run_ranks: CUDA is initialised in this process; forked ranks could not use it")
        preimport_for_fork()
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_paths = {rank: log_dir / f"rank{rank}.log" if capture_output else None for rank in range(world_size)}
    pg_timeout = pg_timeout_s if init_process_group else None
    context = _FunctionRanks(
        name=getattr(fn, "__qualname__", "rank"),
        entrypoint=_rank_main,
        args={
            rank: (fn, args, kwargs or {}, _RankStart(path and str(path), start_method == "fork", pg_timeout))
            for rank, path in log_paths.items()
        },
        envs=_rank_environments(world_size),
        start_method=start_method,
        logs_specs=_RankFiles(log_dir, command_output=False),
    )
    return _run(context, log_paths, timeout_s=timeout_s, stop_after_failure_s=stop_after_failure_s)


def run_command_ranks(
    command: Sequence[str],
    *,
    world_size: int,
    log_dir: str | os.PathLike[str],
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
) -> list[RankOutcome]:
    """Run `command` (program and arguments) once per local rank; one `RankOutcome` per rank.

    Each rank has this process's environment, `env` and its rank's variables; its stderr goes to
    ``rank<N>.log``, its stdout to ``rank<N>.out`` in `log_dir`. Every rank runs until it exits or `timeout_s`
    has passed, so that each rank's own exit code is seen (a launcher stops the others at the first failure).
    """
    if not command:
        raise ValueError("command: expected a program and its arguments, found nothing")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    context = _CommandRanks(
        name=Path(command[0]).name,
        entrypoint=command[0],
        args={rank: tuple(command[1:]) for rank in range(world_size)},
        envs={rank: {**rank_env, **(env or {})} for rank, rank_env in _rank_environments(world_size).items()},
        logs_specs=_RankFiles(log_dir, command_output=True),
    )
    log_paths = {rank: log_dir / f"rank{rank}.log" for rank in range(world_size)}
    return _run(context, log_paths, timeout_s=timeout_s, stop_after_failure_s=None)


def _rank_environments(world_size: int) -> dict[int, dict[str, str]]:
    """Each rank's variables, as torchrun sets them for one node."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected an integer >= 1, found {world_size!r}")
    port = str(free_port())
    return {
        rank: {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
        for rank in range(world_size)
    }


# --- In the rank ---
@dataclass(frozen=True)
class _RankStart:
    """How `_rank_main` starts one rank."""

    log_path: str | None
    """Where the rank's stdout and stderr go (None: where the parent's went)."""
    forked: bool
    """The rank was forked (it holds a copy of the parent's heap)."""
    pg_timeout_s: float | None
    """The gloo process group's timeout (None: no group)."""


def _rank_main(fn: Callable[..., Any], args: tuple, kwargs: dict, start: _RankStart) -> bytes:
    """One rank: its output, one torch thread, its process group, then `fn`.

    Called inside elastic's error recording (``record``): what this raises becomes the rank's error file and
    exit code 1."""
    if start.log_path is not None:
        _write_output_to(start.log_path)
    if start.forked:
        # DeepSpeed calls gc.collect() in every ZeRO-3 initialize (and elsewhere): what the
        # fork copied from the parent need not be traversed each time (~1.5 s a call otherwise).
        gc.freeze()
    limit_cpu_threads(1)  # ranks share the machine's few cores
    if start.pg_timeout_s is not None:
        _join_process_group(start.pg_timeout_s)
    try:
        value = _call(fn, args, kwargs)
    finally:
        leave_process_group()
    # elastic: it would pickle the value outside its error recording, so that an
    # unpicklable value failed the rank with no traceback; pickled here, it is this
    # rank's error like any other.
    return pickle.dumps(value)


def _write_output_to(log_path: str) -> None:
    """This rank's stdout and stderr, Python's and the C libraries' alike, into its log file.

    elastic: its redirect follows ``sys.stdout.fileno()``, under pytest's capture pytest's file (or none);
    descriptors 1 and 2 pointed at one file keep stdout and stderr in the order they were written."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's stream
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's stream
    # elastic enabled the fault handler on the stderr it found: a crash's stack goes to the log.
    faulthandler.enable(file=sys.stderr, all_threads=True)


def _call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception:
        raise
    except BaseException as exc:
        # elastic records Exceptions only, and torch.multiprocessing ends a rank that got a
        # KeyboardInterrupt with exit code 0: either would leave the rank without its traceback.
        raise RuntimeError(f"the rank's function raised {exc!r}") from exc


def _join_process_group(timeout_s: float) -> None:
    """A gloo group over this rank's device (on a GPU machine, ranks beyond the GPUs share them:
    the device is chosen first, since DeepSpeed binds the group to the one LOCAL_RANK names)."""
    from poplar_ext.hardware.devices import join_job

    skip_deepspeed_shm_op()  # a spawned rank did not inherit the parent's `preimport_for_fork`
    join_job(dist_backend="gloo", timeout=timedelta(seconds=timeout_s), verbose=False)


# --- In the parent ---
class _RankFiles(LogsSpecs):
    """elastic: each rank's files flat in one folder, not elastic's tree per run and attempt.

    ``rank<N>.error.json``: elastic's traceback of a rank that raised. A command's stderr goes to ``rank<N>.log``,
    its stdout to ``rank<N>.out``; a function's rank writes its own log (`_write_output_to`), so elastic leaves
    its streams alone ("" is elastic's word for the console)."""

    def __init__(self, log_dir: Path, *, command_output: bool) -> None:
        super().__init__(log_dir=str(log_dir))
        self._command_output = command_output

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        root = Path(self.root_log_dir)
        error_files = {rank: str(root / f"rank{rank}.error.json") for rank in envs}
        for rank, env in envs.items():
            Path(error_files[rank]).unlink(missing_ok=True)  # a stale one would read as this run's error
            env["TORCHELASTIC_ERROR_FILE"] = error_files[rank]
        stdouts, stderrs = (
            {rank: str(root / f"rank{rank}.{ext}") if self._command_output else "" for rank in envs}
            for ext in ("out", "log")
        )
        return LogsDest(stdouts=stdouts, stderrs=stderrs, error_files=error_files)


class _EveryRank:
    """elastic: its contexts follow torchrun's all-or-nothing rule (the first failed rank ends the group, the
    agent restarts all of it); tests and benchmarks want each rank's own outcome, so every rank runs until it
    exits or is stopped. The seam is `_poll`, where elastic keeps its waiting policy (``PContext.wait`` calls it)."""

    error_files: dict[int, str]
    stdouts: dict[int, str]
    stderrs: dict[int, str]
    pids: Callable[[], dict[int, int]]

    def exit_codes(self) -> dict[int, int | None]:  # None while the rank runs
        raise NotImplementedError

    def received_values(self) -> dict[int, bytes]:
        return {}

    def wait_for_an_exit(self, timeout_s: float) -> None:
        time.sleep(min(timeout_s, 0.05))

    def _poll(self) -> RunProcsResult | None:
        codes = self.exit_codes()
        values = self.received_values()  # after the exit codes: a rank puts its value before it exits
        if any(code is None for code in codes.values()):
            return None
        pids = self.pids()
        failures = {
            rank: ProcessFailure(local_rank=rank, pid=pids[rank], exitcode=code, error_file=self.error_files[rank])
            for rank, code in codes.items()
            if code != 0
        }
        return RunProcsResult(return_values=values, failures=failures, stdouts=self.stdouts, stderrs=self.stderrs)


class _FunctionRanks(_EveryRank, MultiprocessContext):
    """elastic's context for function ranks, every rank to its end. It reads that context's own attributes
    (``_pc``, ``_ret_vals``, ``_return_values``, ``_worker_finished_event``) as in torch 2.13: an upgrade
    checks them."""

    def _start(self) -> None:
        # elastic holds a rank that returned until the parent has read every rank's value (its
        # result is all ranks' or none); here a rank exits once it has put its value:
        # SimpleQueue.put writes it into a pipe, which keeps it after the writer is gone.
        self._worker_finished_event.set()
        super()._start()

    def exit_codes(self) -> dict[int, int | None]:
        return {rank: process.exitcode for rank, process in enumerate(self._pc.processes)}

    def received_values(self) -> dict[int, bytes]:
        for rank, queue in self._ret_vals.items():
            if rank not in self._return_values and not queue.empty():
                self._return_values[rank] = queue.get()
        return dict(self._return_values)

    def wait_for_an_exit(self, timeout_s: float) -> None:
        running = {process.sentinel: process for process in self._pc.processes if process.exitcode is None}
        for sentinel in multiprocessing.connection.wait(list(running), timeout=timeout_s):
            # The sentinel is ready when the rank's descriptors close, while the kernel may
            # still be tearing down its (forked, large) address space: wait for the exit code
            # instead of polling for it on the cores the other ranks need.
            running[sentinel].join(timeout=1.0)

    def _close(self, death_sig: signal.Signals, timeout: int = 30) -> None:
        super()._close(death_sig, timeout)
        # torch.multiprocessing leaves the traceback of a rank that raised in a temporary
        # file (elastic reads the rank's error file instead).
        for path in self._pc.error_files if self._pc else []:
            Path(path).unlink(missing_ok=True)


class _CommandRanks(_EveryRank, SubprocessContext):
    """elastic's context for command ranks, every rank to its end."""

    def exit_codes(self) -> dict[int, int | None]:
        return {rank: handler.proc.poll() for rank, handler in self.subprocess_handlers.items()}


@contextmanager
def _callers_signal_handlers() -> Iterator[None]:
    """elastic: starting a context installs its SIGTERM, SIGINT, SIGHUP and SIGQUIT handlers in the caller
    (torchrun's agent owns its process); the caller's come back once the ranks have started (forked ranks keep
    elastic's: a signal ends them with a traceback)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:  # None: a handler installed from C, which Python cannot put back
                signal.signal(sig, handler)


def _run(
    context: _FunctionRanks | _CommandRanks,
    log_paths: dict[int, Path | None],
    *,
    timeout_s: float,
    stop_after_failure_s: float | None,
) -> list[RankOutcome]:
    """Start the ranks, wait for every one (within the limits), kill what is left; the outcomes."""
    try:
        with _callers_signal_handlers():
            context.start()
        why_stopped = _wait(context, timeout_s=timeout_s, stop_after_failure_s=stop_after_failure_s)
        stopped = {rank for rank, code in context.exit_codes().items() if code is None}
    finally:
        context.close(death_sig=signal.SIGKILL, timeout=_KILL_WAIT_S)
    values, codes = context.received_values(), context.exit_codes()
    command = isinstance(context, _CommandRanks)
    outcomes = []
    for rank in sorted(codes):
        exit_code = None if rank in stopped else codes[rank]
        ok = exit_code == 0 if command else values.get(rank) is not None
        error = "" if ok else (why_stopped if rank in stopped else _error_text(context, rank, exit_code))
        value = pickle.loads(values[rank]) if ok and not command else None
        outcomes.append(
            RankOutcome(rank=rank, ok=ok, value=value, error=error, exit_code=exit_code, log_path=log_paths[rank])
        )
    return outcomes


def _wait(context: _EveryRank, *, timeout_s: float, stop_after_failure_s: float | None) -> str:
    """Until every rank has exited or the group's time is up; why the ranks still running are stopped."""
    deadline = time.monotonic() + timeout_s
    why = f"still running after {timeout_s:g} s: killed"
    while context.wait(0) is None:  # elastic's wait(0): one look, through `_EveryRank._poll`
        now = time.monotonic()
        if now >= deadline:
            return why
        failed = [rank for rank, code in context.exit_codes().items() if code not in (None, 0)]
        if failed and stop_after_failure_s is not None and now + stop_after_failure_s < deadline:
            deadline = now + stop_after_failure_s
            why = f"stopped {stop_after_failure_s:g} s after rank {failed[0]} failed: killed"
        context.wait_for_an_exit(min(_WAKE_S, max(0.0, deadline - now)))
    return ""


def _error_text(context: _EveryRank, rank: int, exit_code: int | None) -> str:
    """The traceback elastic recorded for the rank, else what its exit code says."""
    if exit_code is None:
        return "did not exit after it was killed"
    failure = ProcessFailure(
        local_rank=rank, pid=context.pids()[rank], exitcode=exit_code, error_file=context.error_files[rank]
    )
    if isinstance(failure.message, dict):  # written by elastic's error handler
        return failure.message.get("extraInfo", {}).get("py_callstack") or failure.message.get("message", "")
    if exit_code < 0:
        return f"died without a result (exit code {exit_code}: {failure.signal_name()})"
    return f"died without a result (exit code {exit_code})"


__all__ = [
    "LOG_TAIL_LINES",
    "RankFailure",
    "RankOutcome",
    "endless_batches",
    "free_port",
    "preimport_for_fork",
    "run_command_ranks",
    "run_ranks",
    "run_ranks_outcomes",
]
