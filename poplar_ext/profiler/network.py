"""The job's network measured: collective times against message size, fitted; rank 0 writes the file. See
profiles/README.md ("Network file")."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from poplar_ext.collectives import (
    agree_max,
    decided_by_rank0,
    destroy_groups,
    new_groups,
    process_group_backend,
    timed_collective,
)
from poplar_ext.plan.network_format import (
    COLLECTIVES,
    CollectiveFit,
    CollectiveSample,
    NetworkProfile,
    NetworkScope,
    cluster_key,
    find_network,
    network_from_dict,
    network_path,
    network_to_dict,
    save_network,
)
from poplar_ext.profiler.layout import JobLayout
from poplar_ext.profiler.measure import measured_provenance
from poplar_ext.search.network import fit_collective

DEFAULT_MESSAGE_BYTES = (2**12, 2**16, 2**20, 2**23, 2**25)
"""4 KiB (latency) to 32 MiB (bandwidth): the sizes below any job's largest bucket."""

ZERO_BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's default ``reduce_bucket_size`` and ``allgather_bucket_size`` (elements)."""

MEMORY_FRACTION_FOR_MESSAGES = 8
"""The largest message timed takes at most 1/8 of the smallest device's memory (a collective holds
the message and a shard of it, NCCL its own buffers, beside what the rank already holds)."""


def message_sizes(ds_config: Mapping[str, Any], *, element_bytes: int, capacity_bytes: int) -> tuple[int, ...]:
    """Message sizes to time: `DEFAULT_MESSAGE_BYTES`, then x4 up to the largest ZeRO bucket of `ds_config`
    (DeepSpeed's default where absent or ``"auto"``), capped by `MEMORY_FRACTION_FOR_MESSAGES` of
    `capacity_bytes`: the buckets ZeRO sends are then priced from measured sizes."""
    zero = ds_config.get("zero_optimization")
    zero = zero if isinstance(zero, Mapping) else {}
    buckets = [zero.get(key, ZERO_BUCKET_ELEMENTS) for key in ("reduce_bucket_size", "allgather_bucket_size")]
    elements = max(int(b) if isinstance(b, (int, float)) else ZERO_BUCKET_ELEMENTS for b in buckets)
    largest = max(
        DEFAULT_MESSAGE_BYTES[0], min(elements * element_bytes, capacity_bytes // MEMORY_FRACTION_FOR_MESSAGES)
    )
    sizes = [size for size in DEFAULT_MESSAGE_BYTES if size < largest]
    while sizes and sizes[-1] * 4 < largest:
        sizes.append(sizes[-1] * 4)
    return (*sizes, largest)


def _fits(
    layout: JobLayout,
    message_bytes: tuple[int, ...],
    warmup: int,
    repeats: int,
    *,
    group: Any = None,
    timed: bool = True,
    group_size: int | None = None,
) -> dict[str, CollectiveFit]:
    """Every collective timed on `group` (None: the whole job) and fitted to the slowest rank's
    medians. Collective over the whole job: a rank outside the group passes ``timed=False`` and
    only joins the agreement on the slowest times."""
    fits = {}
    for collective in COLLECTIVES:
        medians = [0.0] * len(message_bytes)
        if timed:
            medians = []
            for size in message_bytes:
                times = [
                    timed_collective(collective, size, layout.device, group=group) for _ in range(warmup + repeats)
                ]
                medians.append(statistics.median(times[warmup:]))
        slowest = agree_max(medians, layout.device)
        samples = [CollectiveSample(message_bytes=size, time_s=max(t, 1e-9)) for size, t in zip(message_bytes, slowest)]
        fits[collective] = fit_collective(collective, group_size or layout.world_size, samples)
    return fits


def node_ranks(layout: JobLayout) -> list[list[int]]:
    """The ranks of each node of the job's cluster description, in rank order."""
    counts = [sum(g.count for g in node.devices) for node in layout.cluster.nodes]
    return [list(range(end - count, end)) for count, end in zip(counts, itertools.accumulate(counts))]


def _scopes(layout: JobLayout, message_bytes: tuple[int, ...], warmup: int, repeats: int) -> dict[str, NetworkScope]:
    """With several nodes: the collectives within each node (all nodes at once) and among one rank per node."""
    nodes = node_ranks(layout)
    if len(nodes) < 2:
        return {}
    scopes = {}
    leaders = [ranks[0] for ranks in nodes]
    *node_groups, leader_group = new_groups([*nodes, leaders])
    mine = next(index for index, ranks in enumerate(nodes) if layout.rank in ranks)

    def scope(group: Any, size: int, timed: bool) -> NetworkScope:
        fits = _fits(layout, message_bytes, warmup, repeats, group=group, timed=timed, group_size=size)
        return NetworkScope(group_size=size, collectives=fits)

    largest = max(len(ranks) for ranks in nodes)
    if largest >= 2:
        # Every node is timed at once; with nodes of several sizes the fit is the largest's
        # (the slowest rank's times count).
        scopes["within_node"] = scope(node_groups[mine], largest, timed=len(nodes[mine]) >= 2)
    scopes["between_nodes"] = scope(leader_group, len(nodes), timed=layout.rank in leaders)
    destroy_groups([*node_groups, leader_group], [*nodes, leaders], layout.rank)
    return scopes


def measure_network(
    layout: JobLayout, *, message_bytes: tuple[int, ...] = DEFAULT_MESSAGE_BYTES, warmup: int = 1, repeats: int = 3
) -> NetworkProfile:
    """Time every collective of `plan.network_format.COLLECTIVES` on the job's process group (collective),
    and, with several nodes, within each node and between nodes (`plan.network_format.SCOPES`)."""
    fits = _fits(layout, message_bytes, warmup, repeats)
    scopes = _scopes(layout, message_bytes, warmup, repeats)
    return NetworkProfile(
        cluster_key=cluster_key(layout.cluster),
        world_size=layout.world_size,
        num_nodes=len(layout.cluster.nodes),
        backend=process_group_backend(),
        collectives=fits,
        scopes=scopes,
        measured_with={
            **measured_provenance(),
            "torch": torch.__version__,
            "device": layout.device.type,
            "timing": "wall clock after a barrier, median of repeats, slowest rank",
            "warmup": warmup,
            "repeats": repeats,
        },
    )


def cached_or_measured_network(
    layout: JobLayout,
    cache_dir: Path,
    *,
    force: bool,
    message_bytes: tuple[int, ...] = DEFAULT_MESSAGE_BYTES,
    before_measuring: Callable[[], None] = lambda: None,
) -> tuple[NetworkProfile | None, str]:
    """The network file for this cluster from `cache_dir`, or measured (after `before_measuring`, every rank)
    and written there by rank 0 (collective), and a line for the progress log; None for a one-rank job."""
    if layout.world_size == 1:
        return None, "network: one rank, no collectives to measure"

    def cached() -> dict[str, Any] | None:
        network = None if force else find_network(cache_dir, layout.cluster)
        # A file measured over another backend (gloo on CPU, then NCCL on the GPUs) times another network.
        if network is None or network.backend != process_group_backend():
            return None
        return network_to_dict(network)

    # Rank 0 alone reads the file: a bad one is an error on every rank, not rank 0's alone.
    found = decided_by_rank0(cached, rank=layout.rank)
    path = network_path(cache_dir, layout.cluster)
    if found is not None:
        return network_from_dict(found, source=str(path)), f"network: from the cache ({path})"
    before_measuring()
    network = measure_network(layout, message_bytes=message_bytes)
    if layout.rank == 0:
        save_network(network, path)  # makes the network/ folder
    fit = network.collectives["all_reduce"]
    return network, (
        f"network: measured over {layout.world_size} ranks ({network.backend}): all-reduce "
        f"{fit.bus_bandwidth_bytes_per_s / 1e9:.2f} GB/s bus bandwidth, {fit.latency_s * 1e6:.0f} us per hop -> {path}"
    )
