"""The job's network measured: collective times against message size, fitted (`search.network`).

Run by every rank, after the layout is agreed and before the stages are measured:
each of the three collectives ZeRO issues, at a few message sizes from 4 KiB to
32 MiB, timed after a barrier; the slowest rank's median counts (a collective ends
when its last rank does). About a second on CPU ranks with gloo. Rank 0 writes the
file beside the profiles, keyed by the cluster (`search.network.cluster_key`), and a
later run on the same cluster reuses it.
"""

from __future__ import annotations

import platform
import statistics
from datetime import datetime, timezone
from pathlib import Path

import torch

from poplar_ext.collectives import (
    agree_max,
    broadcast_from_rank0,
    process_group_backend,
    timed_collective,
)
from poplar_ext.profiler.layout import JobLayout
from search.network import (
    COLLECTIVES,
    CollectiveSample,
    NetworkProfile,
    cluster_key,
    find_network,
    fit_collective,
    network_from_dict,
    network_path,
    network_to_dict,
    save_network,
)

DEFAULT_MESSAGE_BYTES = (2**12, 2**16, 2**20, 2**23, 2**25)
"""4 KiB (latency) to 32 MiB (bandwidth)."""


def measure_network(
    layout: JobLayout, *, message_bytes: tuple[int, ...] = DEFAULT_MESSAGE_BYTES, warmup: int = 1, repeats: int = 3
) -> NetworkProfile:
    """Time every collective of `search.network.COLLECTIVES` on the job's process group (collective)."""
    fits = {}
    for collective in COLLECTIVES:
        medians = []
        for size in message_bytes:
            times = [timed_collective(collective, size, layout.device) for _ in range(warmup + repeats)][warmup:]
            medians.append(statistics.median(times))
        slowest = agree_max(medians, layout.device)
        samples = [CollectiveSample(message_bytes=size, time_s=max(t, 1e-9)) for size, t in zip(message_bytes, slowest)]
        fits[collective] = fit_collective(collective, layout.world_size, samples)
    return NetworkProfile(
        cluster_key=cluster_key(layout.cluster),
        world_size=layout.world_size,
        num_nodes=len(layout.cluster.nodes),
        backend=process_group_backend(),
        collectives=fits,
        measured_with={
            "source": "measured",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": layout.device.type,
            "timing": "wall clock after a barrier, median of repeats, slowest rank",
            "warmup": warmup,
            "repeats": repeats,
        },
    )


def cached_or_measured_network(layout: JobLayout, cache_dir: Path, *, force: bool) -> tuple[NetworkProfile | None, str]:
    """The network file for this cluster from `cache_dir`, or measured and written there by rank 0 (collective).

    Returns the network (None for a one-rank job: it has no collectives) and a line
    for the progress log.
    """
    if layout.world_size == 1:
        return None, "network: one rank, no collectives to measure"
    found = None
    if layout.rank == 0 and not force:
        network = find_network(cache_dir, layout.cluster)
        found = None if network is None else network_to_dict(network)
    found = broadcast_from_rank0(found)
    path = network_path(cache_dir, layout.cluster)
    if found is not None:
        return network_from_dict(found, source=str(path)), f"network: from the cache ({path})"
    network = measure_network(layout)
    if layout.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_network(network, path)
    fit = network.collectives["all_reduce"]
    return network, (
        f"network: measured over {layout.world_size} ranks ({network.backend}): all-reduce "
        f"{fit.bus_bandwidth_bytes_per_s / 1e9:.2f} GB/s bus bandwidth, {fit.latency_s * 1e6:.0f} us per hop -> {path}"
    )
