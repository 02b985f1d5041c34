"""The job's devices as the hardware reports them, gathered from every rank (`discover_cluster`). See docs/design.md
(the hardware is the truth) and docs/training.md."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from poplar_ext.hardware.devices import (
    declared_type_problem,
    hardware_description,
    hardware_device_type,
)
from poplar_ext.hardware.memory import physical_memory_bytes
from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import Cluster, ClusterNode, DeviceGroup, cluster_from_dict, cluster_to_dict, load_cluster


@dataclass(frozen=True, kw_only=True)
class DeviceFacts:
    """What one rank's hardware says about the device it runs on."""

    rank: int
    """The rank (process group numbering)."""
    host: str
    """Host name of the rank's machine (what node names and messages show)."""
    node: str
    """Which machine and network namespace the rank runs in (`node_key`): containers that
    share a host name on two machines have two keys, ranks of one container one."""
    device_type: str
    """Device type through the device table (`poplar_ext.hardware.devices`), e.g. ``A100-80GB``; ``cpu``."""
    hardware: str
    """One line for people: the name the hardware reports, memory, capability."""
    memory_bytes: int
    """Total memory of the physical device (the machine's RAM for a CPU rank)."""
    device_id: str
    """Which physical device on the host: the CUDA device's UUID, or ``cpu``."""
    compute_capability: tuple[int, int] | None
    """(major, minor) of a CUDA device, e.g. (8, 0) for an A100; None for a CPU rank."""
    cuda_arch_list: tuple[str, ...]
    """What the rank's torch build has kernels for (``torch.cuda.get_arch_list()``), e.g.
    ``sm_80``, ``compute_90``; empty for a CPU rank."""


_BOOT_ID_FILES = ("/proc/sys/kernel/random/boot_id", "/etc/machine-id")
"""Where a machine's identity is read, first readable wins. The boot id comes first: it
is the kernel's, so every container on a machine sees the same one, while a container
image may carry a copied /etc/machine-id."""


def node_key(host: str, machine_id: str, network_namespace: str) -> str:
    """The node key of a rank: its host name, machine identity and network namespace."""
    return f"{host}/{machine_id}/{network_namespace}"


def local_node_key() -> str:
    """This rank's node key (`node_key`), read from the kernel (no collective)."""
    try:
        namespace = os.readlink("/proc/self/ns/net")
    except OSError:
        # Without /proc (not Linux) the host name and machine identity must do.
        namespace = "unknown"
    machine_id = "unknown"
    for path in _BOOT_ID_FILES:
        with contextlib.suppress(OSError), open(path, encoding="utf-8") as f:
            machine_id = f.read().strip() or machine_id
        if machine_id != "unknown":
            break
    return node_key(socket.gethostname(), machine_id, namespace)


def local_device_facts(device: torch.device, *, rank: int) -> DeviceFacts:
    """This rank's facts, read from the hardware (no collective)."""
    capability, archs, physical_id = None, (), "cpu"
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        memory = int(properties.total_memory)
        capability = (int(properties.major), int(properties.minor))
        archs = tuple(torch.cuda.get_arch_list())
        uuid = getattr(properties, "uuid", None)
        # Without a UUID, the index among the devices this process sees (CUDA_VISIBLE_DEVICES
        # may hide the others, so two processes' indices can name the same card).
        physical_id = str(uuid) if uuid is not None else f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')}:{device.index}"
    else:
        memory = physical_memory_bytes()
    return DeviceFacts(
        rank=rank,
        host=socket.gethostname(),
        node=local_node_key(),
        device_type=hardware_device_type(device),
        hardware=hardware_description(device),
        memory_bytes=memory,
        device_id=physical_id,
        compute_capability=capability,
        cuda_arch_list=archs,
    )


def gather_device_facts(device: torch.device) -> list[DeviceFacts]:
    """Every rank's facts in rank order, on every rank (collective)."""
    from poplar_ext.collectives import gather_objects, process_group_rank

    rank, _ = process_group_rank()
    return gather_objects(local_device_facts(device, rank=rank))


def cluster_from_facts(facts: list[DeviceFacts]) -> Cluster:
    """The cluster description of the job the facts came from, in rank order.

    A node is a run of consecutive ranks with one node key; a host whose ranks are not consecutive, or
    a host name several machines share, appears once per run (``host#2``, ...)."""
    assert [f.rank for f in facts] == list(range(len(facts))), "facts come in rank order"
    seen: Counter = Counter()
    nodes = []
    for _, run in itertools.groupby(facts, key=lambda fact: fact.node):
        members = list(run)
        host = members[0].host
        seen[host] += 1
        groups = itertools.groupby(members, key=lambda fact: fact.device_type)
        devices = tuple(DeviceGroup(device_type=t, count=len(list(ranks))) for t, ranks in groups)
        nodes.append(ClusterNode(name=host if seen[host] == 1 else f"{host}#{seen[host]}", devices=devices))
    return Cluster(nodes=tuple(nodes))


def cluster_mismatches(cluster: Cluster, facts: list[DeviceFacts]) -> list[str]:
    """Why `cluster` does not describe the job's hardware: one sentence per problem ([] when it does)."""
    if cluster.world_size != len(facts):
        return [f"The cluster description names {cluster.world_size} ranks but the job has {len(facts)}."]
    problems = []
    for fact, declared in zip(facts, cluster.rank_device_types):
        problem = declared_type_problem(declared, cluster.emulation_of(declared), fact.device_type)
        if problem is not None:
            problems.append(f"Rank {fact.rank} on {fact.host} has {fact.hardware} ({problem}).")
    if not any(cluster.emulation_of(t) for t in cluster.type_counts()):
        problems += node_split_mismatch(cluster, facts)
    return problems


def node_split_mismatch(cluster: Cluster, facts: list[DeviceFacts]) -> list[str]:
    """Where a cluster of real types groups the ranks into nodes other than the machines they run on: the
    search prices the network and pipeline links by the nodes. (Emulated types may stand for nodes that
    share one machine.)"""
    declared = _rank_nodes(cluster)
    machines = _rank_nodes(cluster_from_facts(facts))
    if len(set(zip(declared, machines))) == len(set(machines)) == len(set(declared)):
        return []
    apart = len({name for _, name in machines}) > len({f.node for f in facts})
    # A node's ranks are consecutive: a machine whose ranks the launcher placed apart (cyclic placement) is one
    # node per run of its ranks, as the discovered cluster names them (host#2).
    how = "one node per run of consecutive ranks on a machine" if apart else "one node per machine"
    return [
        f"Its nodes ({_node_split(declared)}) are not the machines the ranks run on ({_node_split(machines)}): "
        f"declare {how}, or leave the cluster out to read it from the hardware."
    ]


def _rank_nodes(cluster: Cluster) -> list[tuple[int, str]]:
    """Each rank's node: (index, name); an index each, as two nodes may share a name."""
    return [
        (i, node.name) for i, node in enumerate(cluster.nodes) for group in node.devices for _ in range(group.count)
    ]


def _node_split(rank_nodes: list[tuple[int, str]]) -> str:
    """``a: ranks 0-2; b: rank 3``: a node's ranks are consecutive (cluster files and `cluster_from_facts`)."""
    ranks: dict[tuple[int, str], list[int]] = {}
    for rank, node in enumerate(rank_nodes):
        ranks.setdefault(node, []).append(rank)
    return "; ".join(
        f"{name}: ranks {r[0]}-{r[-1]}" if len(r) > 1 else f"{name}: rank {r[0]}" for (_, name), r in ranks.items()
    )


_ARCH = re.compile(r"^(sm|compute)_(\d+)(\d)([a-z]?)$")
BF16_MIN_CAPABILITY = (8, 0)
"""bf16 arithmetic needs Ampere (8.0) or newer; older devices emulate it, slowly or not at all."""


def has_kernels_for(capability: tuple[int, int], arch_list: tuple[str, ...] | list[str]) -> bool:
    """Whether a torch build with `arch_list` runs on a device of `capability`.

    ``sm_XY`` runs on X.Y and later minors of major X; ``compute_XY`` (PTX) on any device >= X.Y;
    an arch-specific entry (``sm_90a``, ``compute_100a``) on exactly that capability."""
    for found in filter(None, map(_ARCH.match, arch_list)):
        built = (int(found[2]), int(found[3]))
        if found[4]:
            covered = built == capability
        else:
            covered = built <= capability and (found[1] != "sm" or built[0] == capability[0])
        if covered:
            return True
    return False


def check_device_support(facts: list[DeviceFacts], *, bf16: bool, source: str) -> None:
    """Raise one ValueError naming every rank whose device cannot run the job (the same on every rank,
    from the gathered facts); `bf16`: the job trains in bf16; `source`: what the message names."""
    problems = []
    for fact in facts:
        if fact.compute_capability is None:
            continue
        capability = ".".join(str(part) for part in fact.compute_capability)
        where = f"Rank {fact.rank} on {fact.host} has {fact.hardware} (compute capability {capability})"
        if not has_kernels_for(fact.compute_capability, fact.cuda_arch_list):
            archs = " ".join(fact.cuda_arch_list) or "none"
            problems.append(
                f"{where}, but its torch build has kernels only for {archs}: install a torch build whose "
                f"`torch.cuda.get_arch_list()` covers sm_{capability.replace('.', '')} (an older CUDA "
                "build for an older device), or leave the device out of the job."
            )
        elif bf16 and fact.compute_capability < BF16_MIN_CAPABILITY:
            problems.append(
                f"{where}, below the 8.0 that bf16 needs: train the job in fp16 "
                "(`fp16.enabled` instead of `bf16.enabled`), or leave the device out of the job."
            )
    if problems:
        raise ValueError(f"{source}: the job's devices cannot run it: " + " ".join(problems))


def memory_capacity_bytes(facts: list[DeviceFacts], rank: int) -> int:
    """The memory `rank` may use: its device's total, shared among the ranks on that device."""
    mine = facts[rank]
    sharing = sum(1 for f in facts if (f.node, f.device_id) == (mine.node, mine.device_id))
    return mine.memory_bytes // sharing


def agreed_cluster(
    cluster: Cluster | str | os.PathLike[str] | None,
    facts: list[DeviceFacts],
    *,
    rank: int,
    broadcast: Callable[[Any], Any] | None = None,
    name: str = "cluster",
) -> Cluster:
    """The job's cluster description, the same on every rank, checked against the hardware.

    `cluster`: a description, a cluster file (read by rank 0 alone), or None (built from `facts`). A real
    type that is not what the hardware reports: one ValueError on every rank. `name`: the setting's name
    in messages (``poplar.cluster``, ``--cluster``)."""
    from poplar_ext.collectives import broadcast_from_rank0, decided_by_rank0

    def decide() -> dict[str, Any]:
        if cluster is None:
            found = cluster_from_facts(facts)
        elif isinstance(cluster, Cluster):
            found = cluster
        else:
            try:
                found = load_cluster(cluster)
            except FormatError as exc:
                raise ValueError(f"{name}: {exc}") from exc
        problems = cluster_mismatches(found, facts)
        if problems:
            source = name if isinstance(cluster, Cluster) else str(cluster or "the discovered cluster")
            raise ValueError(f"{name}: {source} does not match the hardware: " + " ".join(problems))
        return cluster_to_dict(found)

    data = decided_by_rank0(decide, rank=rank, broadcast=broadcast or broadcast_from_rank0)
    return cluster_from_dict(data, source="<cluster agreed by rank 0>")


def discover_cluster() -> Cluster:
    """The running job's cluster description from every rank's hardware (collective; emulated types cannot
    be discovered: declare them in a cluster file)."""
    from poplar_ext.hardware.devices import join_job

    return cluster_from_facts(gather_device_facts(join_job()))
