"""What a GPU run ran on: the GPU's name, its driver, CUDA, torch and DeepSpeed, in every result file.

Read in a child process: CUDA initialised in the bench's own process would keep it from forking ranks
(`poplar_bench.local_ranks` refuses), and the child's answer is the same.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

_PROBE = r"""
import importlib.metadata, json, platform, torch

def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None

info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "deepspeed": version("deepspeed"), "poplar-ext": version("poplar-ext"), "gpu": None, "gpu_count": 0,
        "gpu_memory_bytes": None, "device_type": None, "compute_capability": None,
        "torch_arch_list": torch.cuda.get_arch_list() if torch.cuda.is_available() else []}
if torch.cuda.is_available():
    from poplar_ext.hardware.devices import hardware_device_type
    properties = torch.cuda.get_device_properties(0)
    info.update(gpu=properties.name, gpu_count=torch.cuda.device_count(), gpu_memory_bytes=properties.total_memory,
                device_type=hardware_device_type(torch.device("cuda", 0)),
                compute_capability=f"{properties.major}.{properties.minor}")
print(json.dumps(info))
"""


def driver_version() -> str | None:
    """The NVIDIA driver's version, from its /proc entry (nvidia-smi need not be installed)."""
    try:
        found = re.search(r"(?<!\S)\d+(?:\.\d+)+(?!\S)", Path("/proc/driver/nvidia/version").read_text())
    except OSError:
        return None
    return found and found.group()


def read_provenance(*, dry_run: bool) -> dict[str, Any]:
    """The run's provenance: GPU (or the CPU stand-in of a dry run), driver, CUDA, torch, DeepSpeed, Python."""
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"reading the GPU and library versions failed: {done.stderr[-2000:]}")
    info = json.loads(done.stdout.strip().splitlines()[-1])
    info["driver"] = driver_version()
    info["dry_run"] = dry_run
    if dry_run:
        info["devices"] = "CPU stand-ins (dry run): nothing here was measured on a GPU"
    elif info["gpu"] is None:
        info["devices"] = "no CUDA device visible: the CUDA steps fail and say so"
    else:
        info["devices"] = f"real: {info['gpu_count']} x {info['gpu']}"
    return info


def provenance_line(info: dict[str, Any]) -> str:
    """One line naming everything the run ran on, for markdown, logs and figures."""
    gpu = info["gpu"] or "no GPU"
    return (
        f"GPU {gpu} (driver {info['driver'] or '-'}, CUDA {info['cuda'] or '-'}); torch {info['torch']}, "
        f"DeepSpeed {info['deepspeed']}, Python {info['python']}; devices: {info['devices']}"
    )


def provenance_short(info: dict[str, Any]) -> str:
    """The same in a few words, for a title (a figure's)."""
    return (
        f"{info['gpu'] or 'no GPU (dry run on CPU)'} (driver {info['driver'] or '-'}, CUDA {info['cuda'] or '-'}; "
        f"torch {info['torch']}, DeepSpeed {info['deepspeed']})"
    )
