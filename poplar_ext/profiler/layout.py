"""Which device type every rank of the job has, agreed by every rank (`build_layout`). See docs/profiling.md."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from poplar_ext.collectives import gather_objects, process_group_rank
from poplar_ext.hardware.discovery import (
    agreed_cluster,
    check_device_support,
    gather_device_facts,
    memory_capacity_bytes,
)
from poplar_ext.hardware.memory import device_overhead_bytes
from poplar_ext.plan.formats import Cluster, Emulation


@dataclass(frozen=True, kw_only=True)
class JobLayout:
    """Which device type every rank of the job has, agreed by all ranks."""

    rank: int
    world_size: int
    device: torch.device
    """This rank's device."""
    cluster: Cluster
    """The job's cluster description (from the file, or discovered), checked against the hardware."""
    rank_types: tuple[str, ...]
    """Device type of every rank, rank 0 first."""
    emulations: dict[str, Emulation | None]
    capacities_bytes: dict[str, int]
    """Memory of each type for micro-batches: the emulated capacity, or the smallest real one among
    its ranks less what the CUDA context and NCCL's buffers take."""
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


def build_layout(cluster: Cluster | str | os.PathLike[str] | None, device: torch.device, *, bf16: bool) -> JobLayout:
    """Agree on the cluster (`agreed_cluster`) and every rank's device type (collective), every device
    checked to run torch's kernels and, with `bf16`, bf16; the same ValueError on every rank."""
    rank, world_size = process_group_rank()
    facts = gather_device_facts(device)
    check_device_support(facts, bf16=bf16, source="poplar-profile")
    agreed = agreed_cluster(cluster, facts, rank=rank, name="cluster")
    # After the first collectives, the CUDA context and NCCL's buffers exist: what they
    # take (outside torch's allocator, which the peaks measure) is no micro-batch's.
    overheads = gather_objects(device_overhead_bytes(device))
    rank_types = agreed.rank_device_types
    emulations: dict[str, Emulation | None] = {}
    capacities: dict[str, int] = {}
    hardware: dict[str, str] = {}
    hosts: dict[str, str] = {}
    for fact, t in zip(facts, rank_types):  # each type's first rank names its hardware and host
        capacity = memory_capacity_bytes(facts, fact.rank) - overheads[fact.rank]
        emulations.setdefault(t, agreed.emulation_of(t))
        hardware.setdefault(t, fact.hardware)
        hosts.setdefault(t, fact.host)
        capacities[t] = min(capacities.get(t, capacity), capacity)
    for t, emulation in emulations.items():
        if emulation is not None:
            capacities[t] = emulation.memory_capacity_bytes
    return JobLayout(
        rank=rank,
        world_size=world_size,
        device=device,
        cluster=agreed,
        rank_types=rank_types,
        emulations=emulations,
        capacities_bytes=capacities,
        hardware=hardware,
        hosts=hosts,
    )
