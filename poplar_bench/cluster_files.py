"""The shipped cluster descriptions (poplar_bench/clusters/*.json): Poplar's pairs of GPU generations, half of the
ranks of each type on nodes of up to 8 GPUs, 8 to 4096 GPUs. `python -m poplar_bench.cluster_files` rewrites them;
a unit test checks they equal `shipped_clusters()`."""

from __future__ import annotations

import json
from pathlib import Path

from poplar_ext.plan.formats import Cluster, ClusterNode, DeviceGroup, save_cluster

CLUSTER_DIR = Path(__file__).resolve().parent / "clusters"
PAIRS: tuple[tuple[str, str], ...] = (
    ("A100-80GB", "A100-40GB"),
    ("V100-16GB", "T4-16GB"),
    ("A800-80GB", "V100S-32GB"),
)
WORLD_SIZES: tuple[int, ...] = (8, 64, 512, 4096)
GPUS_PER_NODE = 8


def pair_cluster(first: str, second: str, *, world_size: int, gpus_per_node: int = GPUS_PER_NODE) -> Cluster:
    """`world_size` GPUs, half `first` then half `second`, on nodes of one type each."""
    if world_size < 2 or world_size % 2:
        raise ValueError(f"world_size: expected an even integer >= 2, found {world_size!r}")
    per_type = world_size // 2
    per_node = min(gpus_per_node, per_type)
    if per_type % per_node:
        raise ValueError(
            f"world_size: expected half of it ({per_type}) to be a multiple of gpus_per_node ({per_node}), found "
            f"{world_size}"
        )
    nodes = [
        ClusterNode(
            name=f"{device_type.lower()}-node{index:04d}",
            devices=(DeviceGroup(device_type=device_type, count=per_node),),
        )
        for device_type in (first, second)
        for index in range(per_type // per_node)
    ]
    return Cluster(nodes=tuple(nodes))


def shipped_clusters() -> dict[str, Cluster]:
    """File name (e.g. ``a100-80gb+a100-40gb-x64.json``) -> cluster, for every shipped pair and size, in order."""
    return {
        f"{first.lower()}+{second.lower()}-x{size}.json": pair_cluster(first, second, world_size=size)
        for first, second in PAIRS
        for size in WORLD_SIZES
    }


def write_uniform_cpu_job(
    directory: Path,
    *,
    world_size: int,
    micro_batch_size: int,
    accumulation_steps: int,
    zero_stage: int,
    suffix: str = "",
) -> tuple[Path, Path]:
    """``cluster<suffix>.json`` and ``plan<suffix>.json`` in `directory`: a uniform plan on real CPU ranks of one
    node, for the benches that measure rather than predict (the plan's prediction is a placeholder)."""
    cluster = {
        "schema_version": 1,
        "nodes": [{"name": "localhost", "devices": [{"device_type": "cpu", "count": world_size}]}],
    }
    plan = {
        "schema_version": 1,
        "policy": "uniform",
        "zero_stage": zero_stage,
        "global_batch_size": world_size * micro_batch_size * accumulation_steps,
        "ranks": [
            {
                "rank": r,
                "device_type": "cpu",
                "micro_batch_size": micro_batch_size,
                "gradient_accumulation_steps": accumulation_steps,
            }
            for r in range(world_size)
        ],
        "predicted": {"iteration_time_s": 1.0, "samples_per_s": 1.0, "ideal_samples_per_s": 1.0},
        "profile_fingerprints": {},
    }
    paths = directory / f"cluster{suffix}.json", directory / f"plan{suffix}.json"
    for path, data in zip(paths, (cluster, plan)):
        path.write_text(json.dumps(data))
    return paths


if __name__ == "__main__":
    for name, cluster in shipped_clusters().items():
        save_cluster(cluster, CLUSTER_DIR / name)
        print(CLUSTER_DIR / name)
