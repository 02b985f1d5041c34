"""The shipped example: GPT-2 small on 4 A100-80GB + 4 V100-16GB, MODELLED profiles (each file says so;
`poplar_bench.example_profiles` regenerates them), the package ``poplar_ext.search.example_profiles``.
See docs/search.md."""

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
