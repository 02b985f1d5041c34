"""Which device type every rank of the job has, agreed collectively.

Every rank reads its own device (`poplar_ext.hardware.devices`), all ranks exchange what they
found, and each builds the same `JobLayout`; an error found on any rank is raised on
every rank, so none is left waiting in a collective.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import torch

from poplar_ext.collectives import gather_objects, process_group_rank
from poplar_ext.hardware.devices import hardware_description, rank_device_type
from poplar_ext.hardware.memory import device_memory_capacity_bytes
from search.formats import Cluster, Emulation


@dataclass(frozen=True, kw_only=True)
class JobLayout:
    """Which device type every rank of the job has, agreed by all ranks."""

    rank: int
    world_size: int
    device: torch.device
    """This rank's device."""
    rank_types: tuple[str, ...]
    """Device type of every rank, rank 0 first."""
    emulations: dict[str, Emulation | None]
    capacities_bytes: dict[str, int]
    """Memory of each type: the emulated capacity, or the smallest real one among its ranks."""
    hardware: dict[str, str]
    """What the first rank of each type runs on, for people."""
    hosts: dict[str, str]
    """Host name of the first rank of each type."""

    @property
    def type_names(self) -> tuple[str, ...]:
        """Device types in order of first appearance."""
        return tuple(dict.fromkeys(self.rank_types))

    @property
    def my_type(self) -> str:
        return self.rank_types[self.rank]

    def ranks_of(self, device_type: str) -> tuple[int, ...]:
        return tuple(r for r, t in enumerate(self.rank_types) if t == device_type)


def build_layout(cluster: Cluster, device: torch.device, *, local_world_size: int) -> JobLayout:
    """Agree on every rank's device type (collective). Raises the same ValueError on every rank."""
    rank, world_size = process_group_rank()
    if cluster.world_size != world_size:
        # Every rank reads the same cluster file: all raise here, before any collective.
        raise ValueError(
            f"cluster: expected a cluster description with {world_size} ranks (WORLD_SIZE), "
            f"found {cluster.world_size}"
        )
    mine: dict[str, Any] = {"host": socket.gethostname()}
    try:
        mine["type"], mine["emulation"] = rank_device_type(cluster, rank, device)
        mine["capacity"] = device_memory_capacity_bytes(device, local_world_size=local_world_size)
        mine["hardware"] = hardware_description(device)
    except ValueError as exc:
        mine["error"] = str(exc)
    everyone = gather_objects(mine)
    errors = [f"rank {r}: {info['error']}" for r, info in enumerate(everyone) if "error" in info]
    if errors:
        raise ValueError("; ".join(errors))
    rank_types = tuple(info["type"] for info in everyone)
    emulations: dict[str, Emulation | None] = {}
    capacities: dict[str, int] = {}
    hardware: dict[str, str] = {}
    hosts: dict[str, str] = {}
    for info in everyone:
        t = info["type"]
        if t not in emulations:
            emulations[t] = info["emulation"]
            hardware[t] = info["hardware"]
            hosts[t] = info["host"]
            capacities[t] = info["capacity"]
        capacities[t] = min(capacities[t], info["capacity"])
    for t, emulation in emulations.items():
        if emulation is not None:
            capacities[t] = emulation.memory_capacity_bytes
    return JobLayout(
        rank=rank,
        world_size=world_size,
        device=device,
        rank_types=rank_types,
        emulations=emulations,
        capacities_bytes=capacities,
        hardware=hardware,
        hosts=hosts,
    )


__all__ = ["JobLayout", "build_layout"]
