"""Seeded synthetic profiles and clusters, for tests and the search-speed benchmark: not measurements and not a
GPU model (``measured_with``: ``"source": "modelled"``, ``"synthetic": true``). Micro-step times follow
``overhead + b / peak_rate`` with seeded random parameters."""

from __future__ import annotations

import dataclasses

import numpy as np

from poplar_ext.plan.formats import (
    OFFLOAD_STAGES,
    ZERO_STAGES,
    Cluster,
    ClusterNode,
    DeviceGroup,
    ModelInfo,
    Profile,
    Sample,
)
from poplar_ext.plan.levers import LEVERS_ORDER
from poplar_ext.plan.pipeline_formats import LayerCost, LayerProfile, LayerSample

from .gpu_model import sample_sizes

SYNTHETIC_MODEL = ModelInfo(name="synthetic", fingerprint="synthetic-model", num_parameters=1_000_000, dtype="float32")
_SYNTHETIC = {"source": "modelled", "synthetic": True, "note": "poplar_bench.synthetic, not a measurement"}


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
    samples = tuple(
        Sample(micro_batch_size=b, micro_step_time_s=overhead_s + seconds_per_sample * b, peak_memory_bytes=1000 * b)
        for b in (sample_sizes(max_micro_batch_size) if sizes is None else sizes)
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
        measured_with=dict(_SYNTHETIC),
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


SYNTHETIC_LAYERED_MODEL = ModelInfo(
    name="synthetic-layers", fingerprint="synthetic-layers", num_parameters=1_000_000, dtype="float32"
)


def random_layer_profiles(
    rng: np.random.Generator,
    device_types: list[str],
    *,
    num_layers: int,
    zero_stages: tuple[int, ...] = (0,),
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16),
) -> list[LayerProfile]:
    """Seeded layer profiles of one random model on each device type (and stage): a layer's time is ``work x
    (overhead_s + seconds_per_sample x b)``; memory drawn so that some types cannot hold the whole model and
    micro-batches are capped."""
    work = rng.uniform(0.5, 2.0, num_layers)
    parameters = rng.integers(10**6, 10**7, num_layers)
    kept = rng.integers(10**5, 10**6, num_layers)
    output = rng.integers(10**4, 10**5, num_layers)
    profiles = []
    for name in device_types:
        overhead_s, per_sample_s = float(rng.uniform(0.001, 0.005)), float(rng.uniform(0.001, 0.01))
        base = 10**6
        capacity = base + int(rng.uniform(0.3, 1.5) * 4 * parameters.sum() + rng.uniform(2, 20) * kept.sum())
        layers = tuple(
            LayerCost(
                index=i,
                name="Block",
                samples=tuple(
                    LayerSample(micro_batch_size=b, step_time_s=float(work[i] * (overhead_s + per_sample_s * b)))
                    for b in sizes
                ),
                parameter_bytes=int(parameters[i]),
                optimizer_state_bytes=int(3 * parameters[i]),
                activation_bytes_per_sample=int(kept[i]),
                output_bytes_per_sample=int(output[i]),
                optimizer_step_time_s=float(rng.uniform(0.0, 0.002)),
            )
            for i in range(num_layers)
        )
        profiles += [
            LayerProfile(
                device_type=name,
                memory_capacity_bytes=capacity,
                zero_stage=stage,
                model=SYNTHETIC_LAYERED_MODEL,
                layers=layers,
                base_memory_bytes=base,
                emulated=None,
                measured_with=dict(_SYNTHETIC),
            )
            for stage in zero_stages
        ]
    return profiles


def random_lever_profiles(
    rng: np.random.Generator,
    device_types: list[str],
    *,
    zero_stages: tuple[int, ...] = ZERO_STAGES,
    max_cap: int = 64,
) -> list[Profile]:
    """Per (device type, stage) a seeded random profile with every memory lever the stage allows: checkpointing
    slows micro-steps and fits more samples, offload fits more and lengthens the boundary, both multiply."""
    profiles = []
    for name in device_types:
        cap = int(rng.integers(1, max_cap + 1))
        overhead = float(rng.uniform(0.005, 0.05))
        per_sample = float(rng.uniform(0.001, 0.02))
        optimizer_s = float(rng.uniform(0.0, 0.05))
        recompute, checkpointed_room = float(rng.uniform(1.2, 1.5)), float(rng.uniform(2.0, 4.0))
        offload_s, offloaded_room = float(rng.uniform(0.005, 0.1)), float(rng.uniform(1.2, 2.0))
        for stage in zero_stages:
            for checkpointing, offload in LEVERS_ORDER:
                if offload and stage not in OFFLOAD_STAGES:
                    continue
                slower = recompute if checkpointing else 1.0
                room = (checkpointed_room if checkpointing else 1.0) * (offloaded_room if offload else 1.0)
                profile = synthetic_profile(
                    name,
                    zero_stage=stage,
                    max_micro_batch_size=int(cap * room),
                    overhead_s=overhead * (1 + 0.2 * stage) * slower,
                    seconds_per_sample=per_sample * slower,
                    optimizer_step_time_s=optimizer_s + (offload_s if offload else 0.0),
                )
                profiles.append(
                    dataclasses.replace(profile, activation_checkpointing=checkpointing, optimizer_offload=offload)
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
