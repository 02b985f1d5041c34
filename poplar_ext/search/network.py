"""Networks beside measured ones: the ring model fitted to collective times, and one from assumed figures.
See docs/search.md."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy.optimize import nnls

from poplar_ext.plan.network_format import (
    COLLECTIVES,
    MAX_BANDWIDTH_BYTES_PER_S,
    CollectiveFit,
    CollectiveSample,
    NetworkProfile,
    ring_factors,
)


def fit_collective(collective: str, world_size: int, samples: Sequence[CollectiveSample]) -> CollectiveFit:
    """Non-negative least squares of ``time = hops * latency + volume * bytes / bandwidth``, weighted by 1 / time so
    that small messages (latency) and large ones (bandwidth) count alike."""
    hops, volume = ring_factors(collective, world_size)
    if hops == 0 or not samples:
        return CollectiveFit(latency_s=0.0, bus_bandwidth_bytes_per_s=MAX_BANDWIDTH_BYTES_PER_S, samples=tuple(samples))
    sizes = np.array([s.message_bytes for s in samples], dtype=float)
    times = np.array([s.time_s for s in samples], dtype=float)
    weights = 1.0 / np.maximum(times, 1e-12)
    design = np.column_stack([np.full_like(sizes, hops), volume * sizes]) * weights[:, None]
    (latency_s, seconds_per_byte), _ = nnls(design, times * weights)
    bandwidth = (
        MAX_BANDWIDTH_BYTES_PER_S if seconds_per_byte <= 0 else min(1.0 / seconds_per_byte, MAX_BANDWIDTH_BYTES_PER_S)
    )
    return CollectiveFit(latency_s=float(latency_s), bus_bandwidth_bytes_per_s=float(bandwidth), samples=tuple(samples))


def modelled_network(
    *,
    bus_bandwidth_bytes_per_s: float,
    latency_s: float,
    backend: str = "nccl",
    world_size: int = 1,
    num_nodes: int = 1,
    note: str,
) -> NetworkProfile:
    """A network from assumed figures (every collective alike), labelled modelled."""
    if not (bus_bandwidth_bytes_per_s > 0 and math.isfinite(bus_bandwidth_bytes_per_s)):
        raise ValueError(f"bus_bandwidth_bytes_per_s: expected a number > 0, found {bus_bandwidth_bytes_per_s!r}")
    if not latency_s >= 0:
        raise ValueError(f"latency_s: expected a number >= 0, found {latency_s!r}")
    fit = CollectiveFit(latency_s=latency_s, bus_bandwidth_bytes_per_s=bus_bandwidth_bytes_per_s)
    return NetworkProfile(
        cluster_key="modelled",
        world_size=world_size,
        num_nodes=num_nodes,
        backend=backend,
        collectives={name: fit for name in COLLECTIVES},
        measured_with={"source": "modelled", "note": note},
    )
