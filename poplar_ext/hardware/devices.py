"""Device identity: the one table (`DEVICE_NAME_TABLE`) from what the hardware reports to a device type, read in
order, first match wins; emulated types are declared, not read. See profiles/README.md (cluster description)."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import re
import warnings
from dataclasses import dataclass

import torch

from poplar_ext.plan.formats import Emulation

CPU_DEVICE_TYPE = "cpu"
"""The device type of a rank that trains on the CPU (real, not emulated)."""


class UnknownDeviceWarning(UserWarning):
    """The hardware reported a name that `DEVICE_NAME_TABLE` does not know."""


@dataclass(frozen=True, kw_only=True)
class DeviceNameRule:
    """One row of the normalising table."""

    pattern: str
    """Regular expression searched (case-insensitively) in the name the hardware reports."""
    device_type: str
    """The device type a matching device gets, e.g. ``A100-80GB``."""
    min_memory_gib: float = 0.0
    """Match only devices with at least this much total memory (GiB): tells apart
    models whose reported name omits the memory size (``NVIDIA A100`` 40 vs 80 GB)."""


# Order matters: specific rows before general ones (V100S before V100, A100 80 GB before 40 GB, "A10" must
# not catch "A100"). Memory thresholds sit well below the larger nominal size (an 80 GB A100 reports ~79.2 GiB).
# PCIe rows come before the SXM ones, which keep the plain names ("NVIDIA H100 80GB HBM3"): PCIe cards run at
# a lower power limit (A100) or have fewer SMs and slower memory (H100), so their profiles differ.
DEVICE_NAME_TABLE: tuple[DeviceNameRule, ...] = (
    # A GH200's name states the superchip's host memory ("NVIDIA GH200 480GB"), not its HBM (96 or 144 GB).
    DeviceNameRule(pattern=r"\bGH200\b.*\b144G", device_type="GH200-144GB"),  # its MIG slices report less
    DeviceNameRule(pattern=r"\bGH200\b", device_type="GH200-144GB", min_memory_gib=120),
    DeviceNameRule(pattern=r"\bGH200\b", device_type="GH200-96GB"),
    DeviceNameRule(pattern=r"\bH200\b", device_type="H200-141GB"),
    DeviceNameRule(pattern=r"\bH100\b.*\bNVL\b", device_type="H100-94GB"),
    DeviceNameRule(pattern=r"\bH100\b.*\bPCIe\b", device_type="H100-PCIe-80GB"),
    DeviceNameRule(pattern=r"\bH100\b", device_type="H100-80GB"),
    DeviceNameRule(pattern=r"\bH800\b", device_type="H800-80GB"),
    DeviceNameRule(pattern=r"\bA800\b", device_type="A800-80GB", min_memory_gib=60),
    DeviceNameRule(pattern=r"\bA800\b", device_type="A800-40GB"),
    DeviceNameRule(pattern=r"\bA100\b.*\bPCIe\b", device_type="A100-PCIe-80GB", min_memory_gib=60),
    DeviceNameRule(pattern=r"\bA100\b.*\bPCIe\b", device_type="A100-PCIe-40GB"),
    DeviceNameRule(pattern=r"\bA100\b", device_type="A100-80GB", min_memory_gib=60),
    DeviceNameRule(pattern=r"\bA100\b", device_type="A100-40GB"),
    DeviceNameRule(pattern=r"\bV100S\b", device_type="V100S-32GB"),
    DeviceNameRule(pattern=r"\bV100\b", device_type="V100-32GB", min_memory_gib=24),
    DeviceNameRule(pattern=r"\bV100\b", device_type="V100-16GB"),
    DeviceNameRule(pattern=r"\bL40S\b", device_type="L40S-48GB"),
    DeviceNameRule(pattern=r"\bL40\b", device_type="L40-48GB"),
    DeviceNameRule(pattern=r"\bL4\b", device_type="L4-24GB"),
    DeviceNameRule(pattern=r"\bA10G\b", device_type="A10G-24GB"),
    DeviceNameRule(pattern=r"\bA10\b", device_type="A10-24GB"),
    DeviceNameRule(pattern=r"\bA40\b", device_type="A40-48GB"),
    DeviceNameRule(pattern=r"\bRTX A6000\b", device_type="RTXA6000-48GB"),
    # Nothing after the model number: a 3090 Ti, a 4090 D (fewer SMs) and a 4090 Laptop GPU (16 GB) are other cards.
    DeviceNameRule(pattern=r"\bRTX 4090(?!\s*\w)", device_type="RTX4090-24GB"),
    DeviceNameRule(pattern=r"\bRTX 3090(?!\s*\w)", device_type="RTX3090-24GB"),
    DeviceNameRule(pattern=r"\bT4\b", device_type="T4-16GB"),
    DeviceNameRule(pattern=r"\bP100\b", device_type="P100-16GB", min_memory_gib=14),
    DeviceNameRule(pattern=r"\bP100\b", device_type="P100-12GB"),
)

_VENDOR_PREFIXES = re.compile(r"^((nvidia|tesla|amd)\s+)+", re.IGNORECASE)


NOMINAL_MEMORY_GIB = (
    *(2, 3, 4, 5, 6, 8, 10, 11, 12, 16, 20, 24, 32, 40, 48, 64),
    *(80, 94, 96, 128, 141, 180, 186, 192, 256, 288),
)
"""The memory sizes cards are sold with (GiB), which a fallback device type names."""


def _cleaned_name(reported_name: str) -> str:
    """``NVIDIA GeForce RTX 2080 Ti`` -> ``GeForce-RTX-2080-Ti``."""
    name = _VENDOR_PREFIXES.sub("", reported_name.strip())
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-") or "unknown-device"


def fallback_device_type(reported_name: str, total_memory_bytes: int) -> str:
    """An unknown device's type: ``NVIDIA GeForce RTX 2080 Ti`` with 11 GB -> ``GeForce-RTX-2080-Ti-11GB``."""
    name = _cleaned_name(reported_name)
    # The driver reports a card's nominal size less what it reserves: a little (a 2080 Ti's 11 GiB as 10.76), or up to
    # 8% with ECC on (a T4's 16 as 14.75). The smallest sold size that holds it names it as the table would.
    memory_gib = total_memory_bytes / 2**30
    nominal = next((size for size in NOMINAL_MEMORY_GIB if size >= memory_gib), math.ceil(memory_gib))
    return f"{name}-{nominal}GB"


_MIG_SLICE = re.compile(r"\s+MIG\s+(\S+)\s*$", re.IGNORECASE)
_NAMED_MEMORY_GB = re.compile(r"\b(\d+)\s*GB\b", re.IGNORECASE)
_NAMED_MEMORY_NOT_THE_GPUS = re.compile(r"\bGH200\b", re.IGNORECASE)
"""Names whose "NNGB" is not the GPU's memory: a GH200's (``NVIDIA GH200 480GB``) is its host memory."""


def normalize_device_name(reported_name: str, *, total_memory_bytes: int) -> str:
    """The device type through `DEVICE_NAME_TABLE`; an unknown name warns and gets `fallback_device_type`.

    A MIG slice gets the whole GPU's type followed by ``-MIG-`` and its profile."""
    if not reported_name.strip():
        raise ValueError("reported_name: expected the device name the hardware reports, found an empty string")
    if total_memory_bytes < 1:
        raise ValueError(f"total_memory_bytes: expected an integer >= 1, found {total_memory_bytes}")
    # A MIG slice: ``NVIDIA A100-SXM4-40GB MIG 1g.5gb`` -> the whole GPU's name and the slice's profile (1g.5gb).
    whole_name, profile = reported_name, None
    found = _MIG_SLICE.search(reported_name)
    if found is not None:
        whole_name = reported_name[: found.start()]
        profile = re.sub(r"[^A-Za-z0-9.]+", "-", found.group(1)).strip("-")
    memory_gib = total_memory_bytes / 2**30
    named = None if _NAMED_MEMORY_NOT_THE_GPUS.search(whole_name) else _NAMED_MEMORY_GB.search(whole_name)
    if profile is not None and named is not None:
        # A slice reports its own memory; which model it was cut from (40 or 80 GB) is in the name, in
        # nominal GiB as the table's names.
        memory_gib = max(memory_gib, int(named.group(1)))
    suffix = "" if profile is None else f"-MIG-{profile}"
    for rule in DEVICE_NAME_TABLE:
        if memory_gib >= rule.min_memory_gib and re.search(rule.pattern, whole_name, re.IGNORECASE):
            return rule.device_type + suffix
    # A slice's profile (1g.12gb) states its memory: its type names no other (the whole GPU's only where the
    # name states it, as the table's A100-80GB-MIG-1g.10gb).
    fallback = _cleaned_name(whole_name) + suffix if profile else fallback_device_type(whole_name, total_memory_bytes)
    warnings.warn(
        f"unknown device {reported_name!r} ({memory_gib:.1f} GiB): using the device type {fallback!r}; "
        "add a row to poplar_ext.hardware.devices.DEVICE_NAME_TABLE to name it like the others",
        UnknownDeviceWarning,
        stacklevel=2,
    )
    return fallback


def hardware_device_type(device: torch.device) -> str:
    """The device type of `device` as its hardware reports it (``cpu`` for the CPU)."""
    if device.type == "cpu":
        return CPU_DEVICE_TYPE
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return normalize_device_name(props.name, total_memory_bytes=int(props.total_memory))
    raise ValueError(f"device: expected a 'cpu' or 'cuda' device, found {device}")


def hardware_description(device: torch.device) -> str:
    """One line for people: what the hardware is (recorded in profiles' provenance)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (
            f"{props.name}, {props.total_memory / 2**30:.1f} GiB, "
            f"compute capability {props.major}.{props.minor}, CUDA {torch.version.cuda}, "
            f"torch built for {' '.join(torch.cuda.get_arch_list()) or 'no CUDA architecture'}"
        )
    if device.type == "cpu":
        model = None
        with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
        # Only as the fallback: on Linux platform.processor() runs `uname -p` in a child process.
        return f"CPU {model or platform.processor() or 'unknown'} ({platform.machine()})"
    raise ValueError(f"device: expected a 'cpu' or 'cuda' device, found {device}")


REAL_DEVICE_TYPES = frozenset({CPU_DEVICE_TYPE, *(rule.device_type for rule in DEVICE_NAME_TABLE)})
"""The names the hardware's types get (`DEVICE_NAME_TABLE`): no emulated type may take one."""


def declared_type_problem(declared: str, emulation: Emulation | None, hardware_type: str) -> str | None:
    """Why a rank whose hardware is `hardware_type` cannot be the `declared` type, or None (the one rule:
    a real type is what the hardware reports, an emulated one whatever the cluster description declares)."""
    if emulation is not None and declared in REAL_DEVICE_TYPES:
        return (
            f"the cluster description declares {declared!r} emulated, the name of a real type: its profiles would "
            f"replace the real {declared!r} profiles in a shared cache; name it e.g. {declared + '-emulated'!r}"
        )
    if emulation is not None or declared == hardware_type:
        return None
    return (
        f"the cluster description says {declared!r}; name it {hardware_type!r} as its hardware reports it, "
        "or declare it emulated under device_types"
    )


LAUNCHER_LOCAL_RANK_VARIABLE = "POPLAR_LAUNCHER_LOCAL_RANK"
"""Where `select_job_device` keeps the launcher's LOCAL_RANK when it rewrites LOCAL_RANK to the device index."""

OPEN_MPI_LOCAL_RANK_VARIABLE = "OMPI_COMM_WORLD_LOCAL_RANK"
"""Open MPI's local rank: DeepSpeed's engine asserts LOCAL_RANK equals it where it is set."""


def cuda_device_index(local_rank: int, device_count: int) -> int:
    """The CUDA device a rank uses: its local rank modulo the devices it sees (ranks may share GPUs, or
    CUDA_VISIBLE_DEVICES give each process one)."""
    if device_count < 1:
        raise ValueError(f"device_count: expected at least one visible CUDA device, found {device_count}")
    if local_rank < 0:
        raise ValueError(f"LOCAL_RANK: expected an integer >= 0, found {local_rank}")
    return local_rank % device_count


def join_job(**init_options: object) -> torch.device:
    """This rank's device selected, then the process group set up (`init_options`: ``deepspeed.init_distributed``'s).

    The order matters on CUDA: DeepSpeed binds the group to ``cuda:$LOCAL_RANK`` when it
    starts it, so LOCAL_RANK must name a visible device by then (`select_job_device`)."""
    from poplar_ext.collectives import discover_launch_environment, ensure_process_group
    from poplar_ext.hardware.extension_builds import check_extension_build_locks

    # Before the group: a stale build lock would hang every rank inside DeepSpeed's setup.
    check_extension_build_locks()
    discover_launch_environment(**init_options)
    device = select_job_device()
    ensure_process_group(**init_options)
    return device


def select_job_device() -> torch.device:
    """This rank's device, made current; call before the process group starts (`join_job` does).

    DeepSpeed takes LOCAL_RANK as a CUDA device index (the group's ``device_id``, the engine's device,
    ZeRO-3's partitioning): where it differs from `cuda_device_index`, LOCAL_RANK is rewritten to the
    index and the launcher's value kept in ``POPLAR_LAUNCHER_LOCAL_RANK``. Under Open MPI's mpirun,
    ``OMPI_COMM_WORLD_LOCAL_RANK`` (equal to the launcher's LOCAL_RANK) is rewritten alike: DeepSpeed's
    engine asserts the two are equal."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cuda":
        return torch.device(accelerator.current_device_name())
    # The launcher's LOCAL_RANK (the original, when this already rewrote it).
    text = os.environ.get(LAUNCHER_LOCAL_RANK_VARIABLE, os.environ.get("LOCAL_RANK", "0"))
    try:
        local_rank = int(text)
    except ValueError:
        raise ValueError(f"LOCAL_RANK: expected an integer >= 0, found {text!r}") from None
    index = cuda_device_index(local_rank, torch.cuda.device_count())
    if str(index) != os.environ.get("LOCAL_RANK"):
        os.environ.setdefault(LAUNCHER_LOCAL_RANK_VARIABLE, os.environ.get("LOCAL_RANK", "0"))
        if os.environ.get(OPEN_MPI_LOCAL_RANK_VARIABLE) == os.environ.get("LOCAL_RANK"):
            os.environ[OPEN_MPI_LOCAL_RANK_VARIABLE] = str(index)
        os.environ["LOCAL_RANK"] = str(index)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
