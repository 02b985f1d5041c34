"""Regenerate the shipped example profiles, cluster and network (MODELLED by `poplar_bench.gpu_model`, not measured).

``python -m poplar_bench.example_profiles``; see docs/bench.md (outside poplar-bench; modelled GPUs).
"""

import argparse
import dataclasses
from pathlib import Path

from poplar_ext.plan.formats import ZERO_STAGES, Cluster, ClusterNode, DeviceGroup, save_cluster, save_profile
from poplar_ext.plan.network_format import cluster_key, network_path, save_network
from poplar_ext.plan.pipeline_formats import layer_profiles_dir, save_layer_profile

from .gpu_layer_model import modelled_layer_profile, two_level_network
from .gpu_model import ModelShape, gpu_spec, modelled_profile

HERE = Path(__file__).resolve().parents[1] / "poplar_ext" / "search" / "example_profiles"
SHAPE = ModelShape(
    name="gpt2-small-124m", num_layers=12, hidden_size=768, num_heads=12, sequence_length=1024, vocab_size=50257
)
DEVICES = {"A100-80GB": 4, "V100-16GB": 4}


def main(directory: Path = HERE) -> None:
    for name in DEVICES:
        stem = f"{SHAPE.name}.{name.lower()}"
        for stage in ZERO_STAGES:
            profile = modelled_profile(gpu_spec(name), SHAPE, zero_stage=stage, world_size=sum(DEVICES.values()))
            save_profile(profile, directory / f"{stem}.stage{stage}.json")
        layers = modelled_layer_profile(gpu_spec(name), SHAPE, zero_stage=0)
        save_layer_profile(layers, layer_profiles_dir(directory) / f"{stem}.stage0.json")
    cluster = Cluster(
        nodes=tuple(
            ClusterNode(name=f"node{i}", devices=(DeviceGroup(device_type=name, count=count),))
            for i, (name, count) in enumerate(DEVICES.items())
        )
    )
    save_cluster(cluster, directory / "cluster.json")
    network = two_level_network(gpus_per_node=max(DEVICES.values()))
    save_network(dataclasses.replace(network, cluster_key=cluster_key(cluster)), network_path(directory, cluster))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output-dir", type=Path, default=HERE, help=f"where they are written (default: the shipped ones, {HERE})"
    )
    main(parser.parse_args().output_dir)
