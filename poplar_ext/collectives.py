"""Where this process sits in the job, and every collective poplar-ext issues.

Each collective is defined here once, so that the rule the design sets (rank 0
decides, all receive; no rank takes a branch into a collective that another rank
skips) can be read in one place:

* `broadcast_from_rank0`: rank 0's object on every rank (plans, profiles, errors);
* `gather_objects`: every rank's object on every rank (device facts, measurements);
* `agree_max`: the element-wise maximum of a list of numbers (trial outcomes);
* `barrier`: every rank waits for the others (before a timed block).

With one rank each is the identity and needs no process group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    """This process's place in the job, as the launcher (deepspeed, torchrun) set it."""

    rank: int
    """Global rank (RANK)."""
    local_rank: int
    """Rank on this node (LOCAL_RANK)."""
    world_size: int
    """Number of ranks (WORLD_SIZE)."""


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}: expected an integer, found {value!r}") from None


def rank_info_from_env() -> RankInfo:
    """RANK, LOCAL_RANK and WORLD_SIZE from the environment (a single process when unset)."""
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"environment: expected 0 <= RANK < WORLD_SIZE, found RANK={rank}, WORLD_SIZE={world_size}")
    return RankInfo(rank=rank, local_rank=_env_int("LOCAL_RANK", rank), world_size=world_size)


def local_world_size() -> int:
    """Ranks on this node, as the launcher says (LOCAL_WORLD_SIZE, or MPI's LOCAL_SIZE); 1 when unset."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(name):
            return _env_int(name, 1)
    return 1


def ensure_process_group() -> None:
    """Set up the default process group through ``deepspeed.init_distributed`` unless it exists."""
    import torch.distributed as dist

    if not dist.is_initialized():
        import deepspeed

        deepspeed.init_distributed()


def broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (a picklable object); sets up the process group if needed."""
    import torch.distributed as dist

    ensure_process_group()
    if dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order, on every rank."""
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def agree_max(values: list[float], device: Any) -> list[float]:
    """The element-wise maximum of `values` over all ranks; `device` is this rank's ``torch.device``."""
    import torch
    import torch.distributed as dist

    # NCCL reduces CUDA tensors only; gloo reduces CPU tensors.
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.tensor(values, dtype=torch.float64, device=on)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def barrier() -> None:
    """Wait until every rank is here."""
    import torch.distributed as dist

    dist.barrier()


def process_group_rank() -> tuple[int, int]:
    """(rank, world size) as the process group numbers them."""
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


__all__ = [
    "RankInfo",
    "agree_max",
    "barrier",
    "broadcast_from_rank0",
    "ensure_process_group",
    "gather_objects",
    "local_world_size",
    "process_group_rank",
    "rank_info_from_env",
]
