"""Small distributed helpers: where this process sits in the job, and one broadcast."""

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


def broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (a picklable object), setting up the process group
    through ``deepspeed.init_distributed`` if it is not yet."""
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed()
    if dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


__all__ = ["RankInfo", "broadcast_from_rank0", "rank_info_from_env"]
