"""Device names: one ordered table, warnings and explicit fallbacks for unknown names."""

from __future__ import annotations

import warnings

import pytest
import torch

from poplar_ext.hardware.devices import (
    UnknownDeviceWarning,
    declared_type_problem,
    hardware_description,
    hardware_device_type,
    normalize_device_name,
)

GiB = 2**30


@pytest.mark.parametrize(
    ("reported", "memory_gib", "expected"),
    [
        ("NVIDIA A100-SXM4-80GB", 79.2, "A100-80GB"),
        ("NVIDIA A100 80GB PCIe", 79.2, "A100-PCIe-80GB"),
        ("NVIDIA A100-SXM4-40GB", 39.4, "A100-40GB"),
        ("NVIDIA A100-PCIE-40GB", 39.4, "A100-PCIe-40GB"),
        ("NVIDIA H100 80GB HBM3", 79.1, "H100-80GB"),
        ("NVIDIA H100 PCIe", 79.1, "H100-PCIe-80GB"),
        ("NVIDIA H100 NVL", 93.1, "H100-94GB"),
        ("NVIDIA H200", 139.8, "H200-141GB"),
        # A GH200's name states its host memory (480 GB LPDDR5X): the two HBM sizes told apart by the report.
        ("NVIDIA GH200 480GB", 97871 / 1024, "GH200-96GB"),
        ("NVIDIA GH200 144G HBM3e", 142.0, "GH200-144GB"),
        ("NVIDIA A800-SXM4-80GB", 79.2, "A800-80GB"),
        ("Tesla V100-SXM2-16GB", 15.8, "V100-16GB"),
        ("Tesla V100-SXM2-32GB", 31.7, "V100-32GB"),
        ("Tesla V100S-PCIE-32GB", 31.7, "V100S-32GB"),
        ("Tesla T4", 14.7, "T4-16GB"),
        ("NVIDIA A10G", 22.0, "A10G-24GB"),
        ("NVIDIA A10", 22.0, "A10-24GB"),
        ("NVIDIA L4", 22.0, "L4-24GB"),
        ("NVIDIA GeForce RTX 4090", 23.6, "RTX4090-24GB"),
        ("NVIDIA GeForce RTX 3090", 23.7, "RTX3090-24GB"),
        # A MIG slice reports its own memory: the whole GPU's size comes from the name.
        ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", 4.8, "A100-40GB-MIG-1g.5gb"),
        ("NVIDIA A100-SXM4-80GB MIG 3g.40gb", 39.5, "A100-80GB-MIG-3g.40gb"),
        ("NVIDIA A100 80GB PCIe MIG 7g.80gb", 79.2, "A100-PCIe-80GB-MIG-7g.80gb"),
        ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", 39.5, "H100-80GB-MIG-3g.40gb"),
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb+me", 9.8, "H100-80GB-MIG-1g.10gb-me"),
        # A GH200's "480GB" is its host memory, not the GPU's: the slice is sized by its own memory.
        ("NVIDIA GH200 480GB MIG 1g.12gb", 11.0, "GH200-96GB-MIG-1g.12gb"),
        ("NVIDIA GH200 480GB MIG 7g.96gb", 93.0, "GH200-96GB-MIG-7g.96gb"),
        # The 144 GB part's name says so: every slice of it is of that GPU, however small.
        ("NVIDIA GH200 144G HBM3e MIG 1g.18gb", 16.5, "GH200-144GB-MIG-1g.18gb"),
    ],
)
def test_known_names_are_normalised_without_a_warning(reported: str, memory_gib: float, expected: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert normalize_device_name(reported, total_memory_bytes=int(memory_gib * GiB)) == expected


def test_an_unknown_name_warns_and_falls_back_to_its_cleaned_name_and_memory() -> None:
    with pytest.warns(UnknownDeviceWarning, match="unknown device 'NVIDIA GeForce RTX 2080 Ti'"):
        name = normalize_device_name("NVIDIA GeForce RTX 2080 Ti", total_memory_bytes=11_000_000_000)
    assert name == "GeForce-RTX-2080-Ti-11GB"


@pytest.mark.parametrize(
    ("reported", "memory_bytes", "expected"),
    [
        # What torch reports (total_memory): the nominal GiB less what the driver reserves.
        ("NVIDIA GeForce RTX 2080 Ti", 11019 * 2**20, "GeForce-RTX-2080-Ti-11GB"),
        ("NVIDIA GeForce RTX 3060", 12050 * 2**20, "GeForce-RTX-3060-12GB"),
        ("NVIDIA Z100", int(79.2 * GiB), "Z100-80GB"),  # an A100 80GB's report: named as the table names it
        # With ECC on the driver keeps more: a T4's, an L4's and an H200's reports under other names.
        ("NVIDIA Z4", 15109 * 2**20, "Z4-16GB"),
        ("NVIDIA Z14", 23034 * 2**20, "Z14-24GB"),
        ("NVIDIA Z200", 149557477376, "Z200-141GB"),
        ("NVIDIA Z9000", 300 * GiB, "Z9000-300GB"),  # above every sold size: the whole GiB above
        ("NVIDIA Z300", 183359 * 2**20, "Z300-180GB"),  # a B200's report
        # Variants of a card the table names are other cards: not the table's RTX3090-24GB or RTX4090-24GB.
        ("NVIDIA GeForce RTX 3090 Ti", 24247 * 2**20, "GeForce-RTX-3090-Ti-24GB"),
        ("NVIDIA GeForce RTX 4090 D", 24082 * 2**20, "GeForce-RTX-4090-D-24GB"),
        ("NVIDIA GeForce RTX 4090 Laptop GPU", 16376 * 2**20, "GeForce-RTX-4090-Laptop-GPU-16GB"),
    ],
)
def test_a_fallback_names_the_nominal_memory_as_the_table_does(reported, memory_bytes, expected) -> None:
    with pytest.warns(UnknownDeviceWarning):
        assert normalize_device_name(reported, total_memory_bytes=memory_bytes) == expected


def test_a_mig_slice_is_never_the_type_of_a_whole_gpu() -> None:
    # Even a slice that has all of the GPU's memory (7g) has its own type: the
    # profiles of the whole card do not hold for it.
    whole = normalize_device_name("NVIDIA A100-SXM4-80GB", total_memory_bytes=int(79.2 * GiB))
    slice_type = normalize_device_name("NVIDIA A100-SXM4-80GB MIG 7g.80gb", total_memory_bytes=int(79.2 * GiB))
    assert slice_type != whole
    assert slice_type.startswith(whole)


def test_an_unknown_mig_slice_warns_and_keeps_its_slice_in_the_type() -> None:
    with pytest.warns(UnknownDeviceWarning):
        name = normalize_device_name("NVIDIA B300 MIG 2g.45gb", total_memory_bytes=45 * 10**9)
    assert name.endswith("-MIG-2g.45gb")


@pytest.mark.parametrize(
    ("reported", "memory_bytes", "expected"),
    [
        # One size each: the whole GPU's where its name states one (as the table's A100-80GB-MIG-1g.10gb), and
        # the slice's in its profile; the slice's reported memory is not appended (it was X1-96GB-11GB-MIG-...).
        ("NVIDIA X1 96GB MIG 1g.12gb", 11 * GiB, "X1-96GB-MIG-1g.12gb"),
        ("NVIDIA B300 MIG 2g.45gb", 45 * 10**9, "B300-MIG-2g.45gb"),
    ],
)
def test_an_unknown_mig_slice_is_named_with_no_second_size(reported, memory_bytes, expected) -> None:
    with pytest.warns(UnknownDeviceWarning, match=f"using the device type '{expected}'"):
        assert normalize_device_name(reported, total_memory_bytes=memory_bytes) == expected


def test_an_unknown_mig_slice_warns_with_the_whole_gpu_size_its_name_gives_in_gib() -> None:
    # The name's "96GB" is a nominal GiB size, as in the table's names (A100-80GB: 80 GiB less what the driver keeps).
    with pytest.warns(UnknownDeviceWarning, match=r"\(96\.0 GiB\)"):
        normalize_device_name("NVIDIA X1 96GB MIG 1g.12gb", total_memory_bytes=11 * GiB)


def test_an_empty_name_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="reported_name: expected the device name the hardware reports"):
        normalize_device_name("  ", total_memory_bytes=GiB)


def test_a_non_positive_memory_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="total_memory_bytes: expected an integer >= 1, found 0"):
        normalize_device_name("Tesla T4", total_memory_bytes=0)


def test_the_cpu_is_cpu() -> None:
    assert hardware_device_type(torch.device("cpu")) == "cpu"
    assert hardware_description(torch.device("cpu")).startswith("CPU ")


def test_an_emulated_type_is_declared_and_a_real_one_read_from_the_hardware() -> None:
    from poplar_ext.plan.formats import Emulation

    emulation = Emulation(slowdown=3.0, memory_capacity_bytes=10**9)
    assert declared_type_problem("slow", emulation, hardware_device_type(torch.device("cpu"))) is None
    assert declared_type_problem("cpu", None, "cpu") is None


@pytest.mark.parametrize("declared", ["cpu", "A100-80GB"])
def test_an_emulated_type_named_as_a_real_one_is_a_problem(declared) -> None:
    # Profiles are keyed by the type's name: an emulated "A100-80GB" measured on a CPU replaced the real one's.
    from poplar_ext.plan.formats import Emulation

    problem = declared_type_problem(declared, Emulation(slowdown=2.0, memory_capacity_bytes=10**9), "cpu")
    assert problem is not None and f"declares {declared!r} emulated, the name of a real type" in problem
    assert f"name it e.g. '{declared}-emulated'" in problem


def test_a_real_rank_declared_as_another_device_is_a_problem() -> None:
    problem = declared_type_problem("slow", None, hardware_device_type(torch.device("cpu")))
    assert problem == (
        "the cluster description says 'slow'; name it 'cpu' as its hardware reports it, or declare it emulated under "
        "device_types"
    )


def test_a_cpu_is_described_from_proc_cpuinfo_without_asking_platform_processor(monkeypatch):
    # On Linux platform.processor() runs `uname -p` in a child process: a rank with its process group up
    # asks it only where /proc/cpuinfo names no model.
    import platform
    from pathlib import Path

    import torch

    from poplar_ext.hardware.devices import hardware_description

    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    model = next((line for line in lines if line.startswith("model name")), None)
    if model is None:
        pytest.skip("/proc/cpuinfo names no CPU model here")
    asked = []
    monkeypatch.setattr(platform, "processor", lambda: asked.append(True) or "from uname")
    assert hardware_description(torch.device("cpu")) == f"CPU {model.split(':', 1)[1].strip()} ({platform.machine()})"
    assert asked == []
