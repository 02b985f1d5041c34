"""The example profiles and cluster shipped with poplar-search.

GPT-2 small on 4 A100-80GB and 4 V100-16GB at ZeRO stages 0-3, MODELLED from datasheet
figures (`poplar_bench.example_profiles` regenerates them); each file says so. They are
the package ``poplar_ext.search.example_profiles``, in a checkout and in a wheel alike.
"""

from __future__ import annotations

from pathlib import Path

_EXAMPLES = Path(__file__).resolve().parent / "example_profiles"


def example_profiles_dir() -> Path:
    """The directory of the example profiles."""
    if not (_EXAMPLES / "cluster.json").is_file():
        raise FileNotFoundError(f"{_EXAMPLES}: expected the example profiles and their cluster.json, found none")
    return _EXAMPLES


def example_cluster_file() -> Path:
    """The cluster the example profiles describe (8 GPUs: 4 A100-80GB, 4 V100-16GB)."""
    return example_profiles_dir() / "cluster.json"
