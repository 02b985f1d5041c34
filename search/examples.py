"""The example profiles and cluster shipped with poplar-search.

GPT-2 small on 4 A100-80GB and 4 V100-16GB at ZeRO stages 0-3, MODELLED from datasheet
figures (`poplar_bench.example_profiles` regenerates them); each file says so. In the
repository they are profiles/examples/; an installed wheel carries them as the package
``poplar_search.example_profiles``.
"""

from __future__ import annotations

from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parents[1] / "profiles" / "examples"
_INSTALLED = Path(__file__).resolve().parent / "example_profiles"


def example_profiles_dir() -> Path:
    """The directory of the example profiles (a wheel's copy, else the checkout's)."""
    for directory in (_INSTALLED, _CHECKOUT):
        if (directory / "cluster.json").is_file():
            return directory
    raise FileNotFoundError(
        f"the example profiles are neither in {_INSTALLED} (an installed wheel) nor in {_CHECKOUT} (a checkout)"
    )


def example_cluster_file() -> Path:
    """The cluster the example profiles describe (8 GPUs: 4 A100-80GB, 4 V100-16GB)."""
    return example_profiles_dir() / "cluster.json"


__all__ = ["example_cluster_file", "example_profiles_dir"]
