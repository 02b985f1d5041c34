"""Seeded synthetic profiles and clusters, for tests and the search-speed benchmark.

Not measurements and not a GPU model: every profile made here says
``"source": "modelled"`` and ``"synthetic": true`` in ``measured_with``. The micro-step
time follows the usual shape ``overhead + b / peak_rate`` (memory-bound at small
micro-batches, compute-bound at large ones), with seeded random parameters.
"""

from __future__ import annotations

import numpy as np

from .formats import ZERO_STAGES, Cluster, ClusterNode, DeviceGroup, ModelInfo, Profile, Sample

SYNTHETIC_MODEL = ModelInfo(name="synthetic", fingerprint="synthetic-model", num_parameters=1_000_000, dtype="float32")


def synthetic_profile(
    device_type: str,
    *,
    zero_stage: int,
    max_micro_batch_size: int,
    overhead_s: float,
    seconds_per_sample: float,
    optimizer_step_time_s: float = 0.01,
    world_size: int = 4,
    sizes: list[int] | None = None,
) -> Profile:
    """A profile with ``t(b) = overhead_s + seconds_per_sample * b`` at `sizes` (default: powers of two and the max)."""
    if sizes is None:
        sizes = sorted({min(1 << k, max_micro_batch_size) for k in range(max_micro_batch_size.bit_length() + 1)})
        sizes = [s for s in sizes if s >= 1] if max_micro_batch_size else []
    samples = tuple(
        Sample(micro_batch_size=b, micro_step_time_s=overhead_s + seconds_per_sample * b, peak_memory_bytes=1000 * b)
        for b in sizes
    )
    return Profile(
        device_type=device_type,
        memory_capacity_bytes=10**12,
        zero_stage=zero_stage,
        world_size=world_size,
        model=SYNTHETIC_MODEL,
        max_micro_batch_size=max_micro_batch_size,
        samples=samples,
        optimizer_step_time_s=optimizer_step_time_s,
        emulated=None,
        measured_with={"source": "modelled", "synthetic": True, "note": "search.synthetic, not a measurement"},
    )


def random_profiles(
    rng: np.random.Generator,
    device_types: list[str],
    *,
    zero_stages: tuple[int, ...] = ZERO_STAGES,
    max_cap: int = 64,
) -> list[Profile]:
    """One seeded random profile per (device type, stage)."""
    profiles = []
    for name in device_types:
        cap = int(rng.integers(1, max_cap + 1))
        overhead = float(rng.uniform(0.005, 0.05))
        per_sample = float(rng.uniform(0.001, 0.02))
        for stage in zero_stages:
            profiles.append(
                synthetic_profile(
                    name,
                    zero_stage=stage,
                    max_micro_batch_size=cap,
                    overhead_s=overhead * (1 + 0.2 * stage),
                    seconds_per_sample=per_sample,
                    optimizer_step_time_s=float(rng.uniform(0.0, 0.05)),
                )
            )
    return profiles


def simple_cluster(counts: dict[str, int], *, ranks_per_node: int = 8) -> Cluster:
    """Nodes of up to `ranks_per_node` devices, one device type per node, types in the given order."""
    nodes = []
    for name, count in counts.items():
        for first in range(0, count, ranks_per_node):
            nodes.append(
                ClusterNode(
                    name=f"{name}-node{first // ranks_per_node}",
                    devices=(DeviceGroup(device_type=name, count=min(ranks_per_node, count - first)),),
                )
            )
    return Cluster(nodes=tuple(nodes))
