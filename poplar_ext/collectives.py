"""The process group, and every collective poplar-ext issues (rank 0 decides, all receive). See docs/design.md
(decisions for the field) and docs/fault-tolerance.md (a finished job exits 0)."""

from __future__ import annotations

import atexit
import contextlib
import errno
import gc
import logging
import os
import random
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

logger = logging.getLogger(__name__)


def leave_process_group() -> None:
    """Destroy this process's default group if it is up, and free the gloo groups it leaves behind.

    An NCCL group is aborted instead when the process leaves on an uncaught exception: its communicators may be broken
    (a peer lost, a collective left half done), and destroying them waits for their pending work, which can hang;
    torch's ``_abort_process_group`` aborts every group without waiting."""
    if dist.is_available() and dist.is_initialized():
        # The interpreter sets sys.last_value for an uncaught exception before the exit handlers run.
        failed = getattr(sys, "last_value", None) is not None
        try:
            # A group with a backend per device (``undefined``) runs NCCL for CUDA tensors: aborted alike.
            if failed and process_group_backend() == "nccl":
                c10d._abort_process_group()
            else:
                dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - at exit nothing is left to tell but the log
            logger.debug("ending the process group at exit failed: %s: %s", type(exc).__name__, exc)
    # A gloo group's worker threads end only when the last Python reference to the group goes (destroy_process_group
    # unregisters it; shutdown does not stop gloo's threads), and objects holding groups sit in reference cycles that
    # only the collector frees. Left to the interpreter's final collection, a worker still releasing a finished
    # collective asks for the GIL while the interpreter is finalizing and the process aborts. Collected here, the
    # groups' destructors join their threads while the interpreter still serves them. Not every group: a ZeRO 1-3
    # DeepSpeed engine stays alive with its groups: torch's collector does not follow the hooks over its optimizer that
    # DeepSpeed registers on the parameters (post-accumulate-grad, at least).
    gc.collect()


class ShortCollectiveTimeouts:
    """Every process group this rank is in times out its collectives after `timeout_s` while inside ``with``, each
    group's own timeout again afterwards.

    Why: profiling runs out of memory on purpose. A rank that dies outside the agreed points (in an engine's build, in a
    collective DeepSpeed issues) leaves the others waiting in a collective until the group's timeout (30 minutes by
    DeepSpeed's default); with a short one, NCCL's watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default) tears
    the waiting ranks down within it, and the launcher ends the job. Groups made inside (each DeepSpeed engine's) get it
    at the next `apply`. torch's ``_set_pg_timeout`` (gloo and NCCL) does the setting."""

    def __init__(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: expected seconds > 0, found {timeout_s}")
        self.timeout_s = timeout_s
        self._previous: dict[Any, Any] = {}

    def apply(self) -> None:
        """Shorten the timeout of every group this rank is in that does not have it yet."""
        if not dist.is_initialized():
            return
        for group in list(c10d._world.pg_map):
            if group is c10d.GroupMember.NON_GROUP_MEMBER or group in self._previous:
                continue
            previous = _group_timeout(group)
            if previous is None:
                continue
            self._previous[group] = previous
            c10d._set_pg_timeout(timedelta(seconds=self.timeout_s), group)

    def __enter__(self) -> ShortCollectiveTimeouts:
        self.apply()
        return self

    def __exit__(self, *exc_info: object) -> None:
        for group, previous in self._previous.items():
            if group in c10d._world.pg_map:  # not destroyed meanwhile
                c10d._set_pg_timeout(previous, group)
        self._previous = {}


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group (and its subgroups) when the interpreter exits, if it is still up then; calling
    this again registers nothing new.

    Why: a gloo group still alive when the interpreter shuts down can abort a rank ("terminate called without an active
    exception", SIGABRT, exit -6) after the job finished and wrote everything (about 1 launch in 10 under CPU load,
    torch alone, pytorch/pytorch#179291), and the launcher then reports the whole job as failed. The group destroyed
    first, the race is gone. Harmless when the script destroyed it itself. No barrier: the handler also runs when a rank
    leaves on an exception, and waiting for the other ranks then could hang."""
    # unregister first: registering the same function twice would run it twice
    atexit.unregister(leave_process_group)
    atexit.register(leave_process_group)


PROCESS_GROUP_TIMEOUT_S = 600.0
"""How long a collective may wait for the other ranks before the job fails (unless the caller
passes ``timeout`` or sets DeepSpeed's ``DEEPSPEED_TIMEOUT``, in minutes): a rank that died outside
an agreed point ends the job in minutes instead of DeepSpeed's default 30."""


def _group_timeout(group: Any) -> timedelta | None:
    """The collective timeout of `group`'s backend, None where it says none."""
    devices = getattr(group, "_device_types", ())
    options = (getattr(group._get_backend(torch.device(d)), "options", None) for d in devices)
    return next((t for t in (getattr(o, "_timeout", None) for o in options) if t is not None), None)


def job_timeout_on_every_group() -> None:
    """Every process group of this rank made without a timeout of its own times out its collectives as the default
    group does: after the job's timeout (`process_group_options`).

    Why: DeepSpeed makes its engines' groups (the data-parallel group every gradient reduction goes through, its copy
    of the world group, a pipeline's) without a timeout, and torch gives those its own default, 30 minutes on gloo,
    not the job's: a rank that stopped answering without closing its connections (a node cut off, a stopped process)
    left the others waiting in a gradient reduction for 30 minutes, whatever ``DEEPSPEED_TIMEOUT`` said."""
    if not dist.is_initialized():
        return
    job = _group_timeout(c10d._get_default_group())
    if job is None:
        return
    for group in list(c10d._world.pg_map):
        if group is c10d.GroupMember.NON_GROUP_MEMBER:
            continue
        current = _group_timeout(group)
        if current is not None and current != job and current == c10d._get_default_timeout(dist.get_backend(group)):
            c10d._set_pg_timeout(job, group)


_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


MPI_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK")
"""What mpirun sets (Open MPI; MPICH, Intel MPI): DeepSpeed's MPI discovery reads the ranks from them."""


def launched() -> bool:
    """Whether a launcher gave this process its rank: torchrun's or the deepspeed launcher's ``RANK``, mpirun's
    variables, or a process group already up. Without one, DeepSpeed's MPI discovery fails deep inside."""
    in_environment = "RANK" in os.environ or any(v in os.environ for v in MPI_RANK_VARIABLES)
    return in_environment or (dist.is_available() and dist.is_initialized())


def discover_launch_environment(
    *, auto_mpi_discovery: bool = True, distributed_port: int = 29500, verbose: bool = True, **_: Any
) -> None:
    """Put rank, world size, master address and LOCAL_RANK into the environment where no launcher
    did (mpirun, AzureML, SageMaker), with DeepSpeed's own discovery, as ``deepspeed.init_distributed``
    would; the other keywords of `ensure_process_group` are accepted and ignored.

    Why before the group: the rank's device is chosen from LOCAL_RANK before the group starts
    (`poplar_ext.hardware.devices.join_job`)."""
    if dist.is_initialized() or not auto_mpi_discovery or all(v in os.environ for v in _LAUNCH_VARIABLES):
        return
    from deepspeed.comm import comm as ds_comm

    if ds_comm.in_aml() and not ds_comm.in_dlts():
        ds_comm.patch_aml_env_for_torch_nccl_backend(verbose=verbose)
    elif ds_comm.in_aws_sm():
        ds_comm.patch_aws_sm_env_for_torch_nccl_backend(verbose=verbose)
    elif any(v in os.environ for v in (*_LAUNCH_VARIABLES, *MPI_RANK_VARIABLES)):
        try:
            ds_comm.mpi_discovery(distributed_port=distributed_port, verbose=verbose)
        except ModuleNotFoundError as error:
            if error.name != "mpi4py":
                raise
            raise ValueError(_partial_launch_message()) from error
    else:
        _one_process_environment()


EPHEMERAL_PORTS_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FIXED_PORTS_FROM = 20000
"""The lowest port `free_port` picks outside the kernel's range (below: the ports services tend to use)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a process group's rendezvous.

    Taken outside the kernel's ephemeral range where there is room (`candidate_ports`): a port the kernel hands
    out (a bind to port 0, an outgoing connection, each of gloo's pair listeners) can be taken by another process
    between this probe and the launcher's bind, and once was, by a gloo job beside it (its client: "Connection
    reset by peer"). A port no program binds is still free then. Where there is no room, the kernel picks."""
    for port in candidate_ports():
        if _bound_port(port) is not None:
            return port
    return _bound_port(0)


def _bound_port(port: int) -> int | None:
    """The port a bind to `port` on 127.0.0.1 got (0: the kernel's pick); None where `port` is in use."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            if port and exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return None
            raise
        return probe.getsockname()[1]


def candidate_ports(tries: int = 100, least_room: int = 256) -> list[int]:
    """Up to `tries` ports at random (from the OS's randomness: forked processes share Python's state) below the
    ephemeral range, else above it, where either leaves `least_room` ports; else none."""
    try:
        low, high = (int(v) for v in EPHEMERAL_PORTS_FILE.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    for first, end in ((FIXED_PORTS_FROM, low), (high + 1, 65536)):
        if end - first >= least_room:
            return random.SystemRandom().sample(range(first, end), min(tries, end - first))
    return []


def _partial_launch_message() -> str:
    """Why DeepSpeed's MPI discovery ran, and what to change, where it failed for want of mpi4py."""
    mpirun = [v for v in MPI_RANK_VARIABLES if v in os.environ]
    if mpirun:
        return (
            f"the environment sets {', '.join(mpirun)} (mpirun's ranks): DeepSpeed's MPI discovery reads them "
            "through mpi4py, which is not installed: pip install mpi4py (or start the job with torchrun or the "
            "deepspeed launcher)"
        )
    found = [v for v in _LAUNCH_VARIABLES if v in os.environ]
    missing = [v for v in _LAUNCH_VARIABLES if v not in os.environ]
    return (
        f"the environment sets {', '.join(found)} but not {', '.join(missing)}: no launcher set this process's rank "
        "(torchrun and the deepspeed launcher set all of them), so DeepSpeed's MPI discovery ran, and it needs "
        "mpi4py, which is not installed. Start the script with torchrun or the deepspeed launcher; or unset "
        f"{', '.join(found)} to train as one process; or, under mpirun, pip install mpi4py"
    )


def _one_process_environment() -> None:
    """A script started by hand (``python train.py``) trains as one rank, as the Trainer and accelerate do,
    instead of failing in DeepSpeed's MPI discovery (``No module named 'mpi4py'``). The port is a free one:
    nothing else joins this group."""
    port = free_port()
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    logger.info("no launcher set RANK or WORLD_SIZE: training as one process (start several with torchrun)")


def process_group_options(init_options: dict[str, Any]) -> dict[str, Any]:
    """`init_options` with the job's timeout: the caller's ``timeout``, else DeepSpeed's from
    ``DEEPSPEED_TIMEOUT`` where set, else `PROCESS_GROUP_TIMEOUT_S`."""
    if "timeout" in init_options or "DEEPSPEED_TIMEOUT" in os.environ:
        return dict(init_options)
    return {**init_options, "timeout": timedelta(seconds=PROCESS_GROUP_TIMEOUT_S)}


def ensure_process_group(**init_options: Any) -> None:
    """Set up the process group (``deepspeed.init_distributed``, unless it exists), destroyed again
    at exit. `init_options` go to ``deepspeed.init_distributed`` (e.g. ``distributed_port``); the
    timeout is `process_group_options`'. Select this rank's device first
    (`poplar_ext.hardware.devices.join_job` does both, in that order).

    DeepSpeed's setup also discovers rank and world size under ``mpirun`` (its MPI
    mode), so read them afterwards (`process_group_rank`), not from the environment."""
    import deepspeed
    from deepspeed.comm import comm as ds_comm

    if not dist.is_initialized() or ds_comm.cdb is None:
        # A group the script started itself gets DeepSpeed's backend here too, so that its shared-memory
        # buffers are made now (and their names released), not later inside deepspeed.initialize.
        deepspeed.init_distributed(**process_group_options(init_options))
    destroy_process_group_at_exit()
    release_shared_memory_name()


_SHM_DIR = "/dev/shm"
_shm_name_released = False


def release_shared_memory_name() -> None:
    """Remove the name of DeepSpeed's shared-memory buffer for this rank once every rank has mapped it
    (collective where that buffer exists; once per process).

    DeepSpeed's CPU op (`deepspeed_shm_comm`, built where all ranks share one machine: ``LOCAL_SIZE`` equal to
    the world size) names a 69 MB buffer per rank in /dev/shm and never removes it: every job on that
    machine would keep its ranks' buffers in memory until it restarts. Every rank maps every other rank's
    buffer before DeepSpeed's setup returns, so after a barrier the names can go: the memory stays mapped
    while the ranks run and is freed when the last exits, however it exits."""
    global _shm_name_released
    if _shm_name_released or not dist.is_initialized() or not os.path.isdir(_SHM_DIR):
        return
    from deepspeed.comm import comm as ds_comm

    if getattr(getattr(ds_comm, "cdb", None), "shm_comm_op", None) is None:
        return
    _shm_name_released = True
    if os.environ.get("LOCAL_SIZE") != str(dist.get_world_size()):
        return  # DeepSpeed made no buffer (ranks on several machines)
    barrier()
    # DeepSpeed's name for it: deepspeed/ops/csrc/cpu/comm/shm.cpp, shm_initialize
    name = "deepspeed_allreduce_buffer_{}_{}_{}_{}".format(
        os.getuid(), os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), dist.get_rank()
    )
    with contextlib.suppress(FileNotFoundError):  # removed already (by hand, or a cleaner of /dev/shm)
        os.unlink(os.path.join(_SHM_DIR, name))


def broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (a picklable object); without a process group, `obj` (one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def decided_by_rank0(
    decide: Callable[[], Any], *, rank: int, broadcast: Callable[[Any], Any] = broadcast_from_rank0
) -> Any:
    """`decide()` run on rank 0 alone (it may read files only rank 0's node has), its result on
    every rank; what it raises is raised on every rank, so no rank waits for one that failed.

    The result must be picklable. Every rank raises the same type with the same message, so that a
    restarting launcher ends or restarts all alike (`poplar_ext.elastic`): a ValueError or TypeError
    (bad input, the user's code) as that type with its message, anything else as a RuntimeError naming
    it. Rank 0 raises it from its own exception, whose traceback shows where the decision failed."""
    outcome: dict[str, Any] | None = None
    failure: BaseException | None = None
    if rank == 0:
        try:
            outcome = {"result": decide()}
        except Exception as exc:  # noqa: BLE001 - the other ranks wait in the broadcast: tell them
            failure = exc
            outcome = _shared_error(exc, rank)
    outcome = broadcast(outcome)
    if "error" in outcome:
        raise outcome["kind"](outcome["error"]) from failure
    return outcome["result"]


def _shared_error(exc: BaseException, rank: int) -> dict[str, Any]:
    """`exc` as every rank raises it: a ValueError or TypeError as that type with its message, anything else as
    a RuntimeError naming the rank and the exception's type."""
    kind = next((k for k in (ValueError, TypeError) if isinstance(exc, k)), RuntimeError)
    message = str(exc) if kind is not RuntimeError else f"rank {rank} failed: {type(exc).__name__}: {exc}"
    return {"error": message, "kind": kind}


def raise_if_any_failed(failure: BaseException | None, *, rank: int) -> None:
    """Collective, in place of a barrier: every rank raises the lowest failing rank's `failure` (this rank's
    exception, or None), as `decided_by_rank0` raises rank 0's, so that no rank waits for one that failed in a
    collective it never reaches, nor goes on as if the work were done."""
    failed = [outcome for outcome in gather_objects(failure and _shared_error(failure, rank)) if outcome]
    if failed:
        raise failed[0]["kind"](failed[0]["error"]) from failure


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _reduced(values: list, dtype: torch.dtype, op: Any, device: Any) -> list:
    """`values` reduced element-wise over all ranks with `op` (collective; one process: as given)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=dtype, device=_collective_device(device))
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def _collective_device(device: Any) -> torch.device:
    """Where the default group reduces: NCCL reduces CUDA tensors only; gloo reduces CPU tensors. A group with a
    backend per device (``undefined``) is read as `process_group_backend` names it, NCCL where CUDA is available:
    its collectives on this rank's CUDA device, which the group sends through NCCL, not through gloo on the host."""
    return device if process_group_backend() == "nccl" else torch.device("cpu")


def agree_sum(value: int, device: Any) -> int:
    """The sum of `value` over all ranks (collective); `device` is this rank's ``torch.device``."""
    return int(_reduced([value], torch.int64, dist.ReduceOp.SUM, device)[0])


def agree_sums(values: list[float], device: Any) -> list[float]:
    """The element-wise sum of `values` over all ranks, in float64 (collective)."""
    return _reduced(values, torch.float64, dist.ReduceOp.SUM, device)


def agree_max(values: list[float], device: Any) -> list[float]:
    """The element-wise maximum of `values` over all ranks, in float64 (collective)."""
    return _reduced(values, torch.float64, dist.ReduceOp.MAX, device)


def timed_collective(collective: str, message_bytes: int, device: Any, *, group: Any = None) -> float:
    """Seconds this rank spends in one `collective` of a `message_bytes` tensor, after a barrier.

    ``all_reduce`` of the tensor, ``reduce_scatter`` of it into 1/W shards, ``all_gather`` of 1/W shards into it: the
    collectives ZeRO issues, as `plan.network_format` models them. float32 elements; the tensor is rounded up to a
    multiple of the world size. `group`: a subgroup (this rank must be in it), default the whole job."""
    world_size = dist.get_world_size(group)
    on = _collective_device(device)
    elements = -(-max(1, message_bytes // 4) // world_size) * world_size
    whole = torch.ones(elements, dtype=torch.float32, device=on)
    shard = torch.ones(elements // world_size, dtype=torch.float32, device=on)
    operations = {
        "all_reduce": lambda: dist.all_reduce(whole, group=group),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, whole, group=group),
        "all_gather": lambda: dist.all_gather_into_tensor(whole, shard, group=group),
    }
    if collective not in operations:
        raise ValueError(f"collective: expected one of {', '.join(operations)}, found {collective!r}")
    dist.barrier(group=group)
    if on.type == "cuda":
        torch.cuda.synchronize(on)
    started = time.perf_counter()
    operations[collective]()
    if on.type == "cuda":
        torch.cuda.synchronize(on)
    return time.perf_counter() - started


def new_groups(rank_lists: list[list[int]]) -> list[Any]:
    """A process group for each list of ranks. Collective: every rank creates every group, in the
    same order (torch.distributed's rule), also those it is not in."""
    return [dist.new_group(ranks) for ranks in rank_lists]


def destroy_groups(groups: list[Any], rank_lists: list[list[int]], rank: int) -> None:
    """Release the groups of `new_groups` that `rank` belongs to (it holds no others)."""
    for group, ranks in zip(groups, rank_lists):
        if rank in ranks:
            dist.destroy_process_group(group)


def sum_in_group(tensor: Any, group: Any = None) -> None:
    """Sum `tensor` in place over the ranks of `group` (default: every rank); this rank must be in it."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


def broadcast_in_group(tensor: Any, *, src: int, group: Any) -> None:
    """Overwrite `tensor` in place with global rank `src`'s, over the ranks of `group` (this rank among them)."""
    dist.broadcast(tensor, src=src, group=group)


def process_group_backend() -> str:
    """The default process group's backend (``nccl``, ``gloo``). A group with a backend per device (what
    ``dist.init_process_group()`` without one makes; torch names it ``undefined``; or one started with such a
    list, ``"cpu:gloo,cuda:nccl"``, which torch names by that string): the one of the device its collectives run
    on, CUDA where there is one and the group has a backend for it."""
    backend = str(dist.get_backend())
    if backend != "undefined" and ":" not in backend:
        return backend
    per_device = dict(part.split(":", 1) for part in str(dist.get_backend_config()).split(",") if ":" in part)
    device = "cuda" if torch.cuda.is_available() and "cuda" in per_device else "cpu"
    return per_device.get(device, backend)


def barrier() -> None:
    """Wait until every rank is here (nothing to wait for without a process group)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def process_group_rank() -> tuple[int, int]:
    """(rank, world size) as the process group numbers them."""
    return dist.get_rank(), dist.get_world_size()


__all__ = [
    "PROCESS_GROUP_TIMEOUT_S",
    "ShortCollectiveTimeouts",
    "agree_max",
    "agree_sum",
    "barrier",
    "broadcast_from_rank0",
    "broadcast_in_group",
    "candidate_ports",
    "decided_by_rank0",
    "destroy_process_group_at_exit",
    "discover_launch_environment",
    "ensure_process_group",
    "free_port",
    "gather_objects",
    "job_timeout_on_every_group",
    "leave_process_group",
    "new_groups",
    "process_group_options",
    "process_group_rank",
    "raise_if_any_failed",
    "release_shared_memory_name",
    "sum_in_group",
]
