"""A job under torchrun's restarting agent ends at once on an error of its configuration or code (a ValueError or
TypeError while it is settled) instead of being restarted ``--max-restarts`` times; a lost node is still restarted.
See docs/fault-tolerance.md."""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

USER_ERRORS = (ValueError, TypeError)
"""What settling a job raises for its configuration or code: the same at every restart."""

F = TypeVar("F", bound=Callable[..., Any])


def restarts_left(env: Mapping[str, str] = os.environ) -> int:
    """How many more times the launcher would restart this worker: 0 outside torchrun's agent."""
    if "TORCHELASTIC_RUN_ID" not in env:
        return 0
    try:
        return int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


PROC = Path("/proc")
"""Where `launcher_process` reads the processes above this one (Linux's)."""


def launcher_process(parent: int, env: Mapping[str, str] = os.environ) -> int:
    """torchrun's agent among this worker's ancestors: `parent`, or where the worker's command runs the script
    through a wrapper (``torchrun --no-python ./run.sh``: a shell started with the worker's environment), the
    nearest ancestor whose environment is not a worker's of this run (its ``TORCHELASTIC_RUN_ID`` and
    ``TORCHELASTIC_RESTART_COUNT``). `parent` where ``/proc`` does not tell.

    Why: the wrapper, signalled in the agent's place, ends; the agent reads a worker stopped by a signal and
    restarts it, ``--max-restarts`` times."""
    marks = {
        f"TORCHELASTIC_RUN_ID={env.get('TORCHELASTIC_RUN_ID', '')}".encode(),
        f"TORCHELASTIC_RESTART_COUNT={env.get('TORCHELASTIC_RESTART_COUNT', '')}".encode(),
    }
    pid = parent
    for _ in range(8):  # a wrapper or two, not a deep tree
        try:
            if not marks <= set((PROC / str(pid) / "environ").read_bytes().split(b"\0")):
                return pid
            # /proc/PID/stat: "PID (name) STATE PPID ...", the name may hold spaces and parentheses
            pid = int((PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return parent
        if pid <= 1:
            return parent
    return parent


def end_restarting_launcher(
    error: BaseException,
    *,
    env: Mapping[str, str] = os.environ,
    kill: Callable[[int, int], None] = os.kill,
    parent: Callable[[], int] = os.getppid,
) -> bool:
    """Ask the restarting launcher to end the job because of `error`; True when it was asked (restarts left)."""
    left = restarts_left(env)
    if left <= 0:
        return False
    agent = launcher_process(parent(), env)
    message = (
        # One full stop between the error's sentence and this one (hardware mismatches end in their own).
        f"poplar-ext: {type(error).__name__}: {str(error).removesuffix('.')}. An error of the job's configuration "
        f"or code, which a restart would repeat: asking the launcher (process {agent}) to end the job instead of "
        f"restarting it {left} more times"
    )
    logger.error("%s", message)
    # On stderr too: the process is about to end, and the application may have configured no logging.
    print(message, file=sys.stderr, flush=True)
    kill(agent, signal.SIGTERM)
    return True


def ends_job_on_user_error(function: F) -> F:
    """`function` (which settles a job) ending a restarting launcher's job on `USER_ERRORS`, re-raised."""

    @functools.wraps(function)
    def settle(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except USER_ERRORS as error:
            # Settling places nest (poplar_ext.initialize around prepare_job): the launcher is asked once.
            if not getattr(error, "_poplar_launcher_asked", False):
                error._poplar_launcher_asked = True  # type: ignore[attr-defined]
                end_restarting_launcher(error)
            raise

    return settle  # type: ignore[return-value]
