"""The network file: collective times and their ring-model fit, read and written. See profiles/README.md
("Network file")."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import (
    MAX_BANDWIDTH_BYTES_PER_S,
    MAX_BYTES,
    MAX_TIME_S,
    MAX_WORLD_SIZE,
    Cluster,
    cluster_to_dict,
    content_fingerprint,
    int_reader,
    json_ready,
    list_reader,
    number_reader,
    read_json,
    read_measured_with,
    read_object,
    read_root,
    read_values,
    write_json_atomic,
)
from poplar_ext.plan.validation import Node

NETWORK_SCHEMA_VERSION = 1
NETWORK_KIND = "network"
"""The ``kind`` field that tells a network file from a profile in the same directory."""
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


@dataclass(frozen=True, kw_only=True)
class CollectiveSample:
    """One measured message size."""

    message_bytes: int
    """Bytes of the whole tensor (reduce-scatter input, all-gather output)."""
    time_s: float
    """Median time of the collective, the slowest rank's."""


@dataclass(frozen=True, kw_only=True)
class CollectiveFit:
    """One collective's ring-model fit (profiles/README.md, "Network file") and the samples it was fitted to."""

    latency_s: float
    """Cost of one ring hop (seconds)."""
    bus_bandwidth_bytes_per_s: float
    """Bus bandwidth in the nccl-tests sense (bytes per second)."""
    samples: tuple[CollectiveSample, ...] = ()
    """What was measured (empty for a modelled network)."""


SCOPES = ("within_node", "between_nodes")
"""Where a multi-node job's collectives were also timed: among the ranks of each node (all
nodes at once), and among one rank per node."""


@dataclass(frozen=True, kw_only=True)
class NetworkScope:
    """The collectives timed on part of the job's ranks."""

    group_size: int
    """Ranks in each group timed (a node's ranks; or the number of nodes)."""
    collectives: dict[str, CollectiveFit]


@dataclass(frozen=True, kw_only=True)
class NetworkProfile:
    """The collectives of one cluster's process group."""

    cluster_key: str
    """`cluster_key` of the cluster it was measured on: the cache key."""
    world_size: int
    """Ranks in the process group measured."""
    num_nodes: int
    """Nodes that group spanned (1: every ring hop was within a node)."""
    backend: str
    """Process-group backend (``nccl``, ``gloo``): NCCL overlaps collectives with compute, gloo on CPU does not."""
    collectives: dict[str, CollectiveFit]
    """One fit per name in `COLLECTIVES`."""
    measured_with: dict[str, Any]
    """Provenance: ``source`` is ``measured`` or ``modelled``; the rest is free-form."""
    scopes: dict[str, NetworkScope] = field(default_factory=dict)
    """With several nodes: the same collectives within a node and between nodes (`SCOPES`)."""
    schema_version: int = NETWORK_SCHEMA_VERSION

    @property
    def source(self) -> str:
        return self.measured_with["source"]

    @property
    def overlaps_compute(self) -> bool:
        """Whether collectives issued on a side stream can run during compute (CUDA streams: NCCL)."""
        return self.backend == "nccl"

    def time_s(self, collective: str, message_bytes: float, world_size: int) -> float:
        """Predicted time of one `collective` of `message_bytes` over `world_size` ranks."""
        return ring_time_s(self.collectives[collective], collective, message_bytes, world_size)


def ring_time_s(
    fit: CollectiveFit, collective: str, message_bytes: float, world_size: int, bandwidth: float | None = None
) -> float:
    """The ring model's time of `collective` by `fit`, at `bandwidth` (bytes/s) where given: a slower link."""
    hops, volume = ring_factors(collective, world_size)
    bandwidth = fit.bus_bandwidth_bytes_per_s if bandwidth is None else bandwidth
    return hops * fit.latency_s + volume * message_bytes / bandwidth


def ring_factors(collective: str, world_size: int) -> tuple[int, float]:
    """(ring hops, bytes sent per byte of the tensor) of `collective` over `world_size` ranks."""
    if collective not in COLLECTIVES:
        raise ValueError(f"collective: expected one of {', '.join(COLLECTIVES)}, found {collective!r}")
    w = int(world_size)
    if w <= 1:
        return 0, 0.0
    if collective == "all_reduce":
        return 2 * (w - 1), 2 * (w - 1) / w
    return w - 1, (w - 1) / w


def cluster_key(cluster: Cluster) -> str:
    """Cache key of a network file: the cluster description (nodes, types, ranks) it was measured on.

    An emulation's ``slowdown_schedule`` (drift during training) does not change the network, nor do the
    nodes' declared ``uplink_bandwidth_bytes_per_s`` (the same machines: declaring their links keeps the file).
    """
    data = cluster_to_dict(cluster)
    for info in data["device_types"].values():
        if info.get("emulation"):
            info["emulation"].pop("slowdown_schedule", None)
    for node in data["nodes"]:
        node.pop("uplink_bandwidth_bytes_per_s", None)
    return content_fingerprint(data)


NETWORK_DIRECTORY = "network"
"""Sub-directory of a profile directory that holds its network files: kept out of the
profile directory's own ``*.json`` so that each file there is one device type's profile."""


def network_path(directory: str | os.PathLike[str], cluster: Cluster) -> Path:
    """Where the network file of `cluster` lives in the profile directory `directory`."""
    return Path(directory) / NETWORK_DIRECTORY / f"network-{cluster_key(cluster).split(':')[-1][:12]}.json"


# -- JSON ----------------------------------------------------------------------------
def network_to_dict(network: NetworkProfile) -> dict[str, Any]:
    data = json_ready(dataclasses.asdict(network))
    if not network.scopes:
        del data["scopes"]  # a one-node file is written as before scopes existed
    return {"schema_version": data.pop("schema_version"), "kind": NETWORK_KIND, **data}


def _fits(node: Node) -> dict[str, CollectiveFit]:
    sample = {"message_bytes": int_reader(1, MAX_BYTES), "time_s": number_reader(positive=True, maximum=MAX_TIME_S)}
    fit = {
        "latency_s": number_reader(0.0, MAX_TIME_S),
        "bus_bandwidth_bytes_per_s": number_reader(positive=True, maximum=MAX_BANDWIDTH_BYTES_PER_S),
        "samples": list_reader(lambda n: read_object(n, CollectiveSample, **sample), max_length=1000),
    }
    node.obj().keys_within(COLLECTIVES)
    return {name: read_object(node.field(name), CollectiveFit, **fit) for name in COLLECTIVES}


def network_from_dict(data: Any, *, source: str = "<network>") -> NetworkProfile:
    """Validate parsed JSON and build a `NetworkProfile`; raises `FormatError`."""
    root = read_root(data, source, NetworkProfile, NETWORK_SCHEMA_VERSION, "kind")
    root.field("kind").string(choices=(NETWORK_KIND,))
    scope = {"group_size": int_reader(2, MAX_WORLD_SIZE), "collectives": _fits}
    values = read_values(
        root,
        NetworkProfile,
        collectives=_fits,
        scopes=lambda n: {k: read_object(v, NetworkScope, **scope) for k, v in n.obj().keys_within(SCOPES).entries()},
        measured_with=read_measured_with,
        cluster_key=Node.string,
        world_size=int_reader(1, MAX_WORLD_SIZE),
        num_nodes=int_reader(1, MAX_WORLD_SIZE),
        backend=_backend,
    )
    return NetworkProfile(**values)


def _backend(node: Node) -> str:
    """A torch process-group backend as torch names it (lower case): ``"NCCL"`` would be priced as not overlapping."""
    name = node.string()
    if name != name.lower():
        raise node.fail(f"a backend as torch names it, in lower case (here {name.lower()!r})")
    return name


def load_network(path: str | os.PathLike[str]) -> NetworkProfile:
    """Read one network file; `FormatError` names the file and field on bad input."""
    return network_from_dict(read_json(path), source=str(path))


def save_network(network: NetworkProfile, path: str | os.PathLike[str]) -> None:
    write_json_atomic(network_to_dict(network), path)


def find_network(directory: str | os.PathLike[str], cluster: Cluster) -> NetworkProfile | None:
    """The network file of the profile directory `directory` measured on `cluster`, or None."""
    path = network_path(directory, cluster)
    if not path.is_file():
        return None
    network = load_network(path)
    if network.cluster_key != cluster_key(cluster):
        raise FormatError(str(path), "cluster_key", cluster_key(cluster), network.cluster_key)
    return network
