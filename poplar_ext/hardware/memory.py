"""Peak memory of one block of work (`MeasuredPeak`), the memory a rank may use, glibc's allocator. See
profiles/README.md ("Peak memory") and docs/deepspeed-notes.md (measuring)."""

from __future__ import annotations

import ctypes
import functools
import gc
import os
from pathlib import Path
from typing import Any

import torch

_PROC_STATUS = Path("/proc/self/status")
_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")

OUT_OF_MEMORY_MESSAGES: tuple[str, ...] = (
    # CUDA's caching allocator, the runtime ("CUDA error: out of memory") and NCCL
    # ("Cuda failure 2 'out of memory'") word it the same way.
    "out of memory",
    # The CUDA driver's own name for it (driver API, Triton).
    "cuda_error_out_of_memory",
    # CPU: "DefaultCPUAllocator: can't allocate memory: you tried to allocate ...".
    "can't allocate memory",
    # cuBLAS creating a handle or its workspace: "CUBLAS_STATUS_ALLOC_FAILED when
    # calling `cublasCreate(handle)`"; cuDNN likewise.
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
)
"""What a `RuntimeError`'s message (lower-cased) contains when an allocation failed. Only
allocation failures: cuDNN's CUDNN_STATUS_INTERNAL_ERROR and other statuses are also
raised for bugs and bad inputs, and a probe that took them for out-of-memory would
silently record a smaller largest size instead of failing."""


def is_out_of_memory(exc: BaseException) -> bool:
    """True for the errors a too-large micro-batch produces (real, not emulated): `torch.OutOfMemoryError`,
    `MemoryError`, and a `RuntimeError` whose message holds one of `OUT_OF_MEMORY_MESSAGES`."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(message in str(exc).lower() for message in OUT_OF_MEMORY_MESSAGES)


@functools.cache
def _libc_function(name: str) -> Any:
    """The allocator's function `name` among the process's own symbols (glibc's, or a preloaded allocator's), or
    None where there is none (musl, macOS; Windows has no such lookup). By name (`ctypes.util.find_library`) the
    lookup would start `ldconfig` at every peak reset."""
    try:
        return getattr(ctypes.CDLL(None), name, None)
    except (OSError, TypeError):
        return None


def _malloc_trim() -> None:
    # Without it glibc keeps freed pages resident and the "reset" high-water mark
    # starts from a stale level; absent libc (musl, macOS) the mark is only coarser.
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)


# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX_BYTES = 32 * 2**20  # glibc refuses larger values on 64-bit
_TRIM_THRESHOLD_BYTES = 2**30
_DEFAULT_THRESHOLD_BYTES = 128 * 2**10  # glibc's default for both


def _mallopt(mmap_threshold_bytes: int, trim_threshold_bytes: int) -> bool:
    mallopt = _libc_function("mallopt")
    return (
        mallopt is not None
        and bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes))
        and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes))
    )


def steady_cpu_allocator() -> bool:
    """Make glibc keep freed memory for reuse instead of returning it after every step (process-wide;
    False where the C library has no ``mallopt``).

    By default each micro-step on CPU faults its activation memory in again: the kernel's page zeroing
    counts as CPU time (up to half of it on small models), depending on the sizes run before. With fixed
    thresholds every step reuses the same pages, as a GPU's caching allocator does."""
    return _mallopt(_MMAP_THRESHOLD_MAX_BYTES, _TRIM_THRESHOLD_BYTES)


def default_cpu_allocator() -> bool:
    """glibc's default thresholds (128 KiB), fixed (no dynamic mmap threshold): what `steady_cpu_allocator`
    undoes. Resident memory then follows live memory, so a high-water mark is the live peak (process-wide;
    False where the C library has no ``mallopt``)."""
    return _mallopt(_DEFAULT_THRESHOLD_BYTES, _DEFAULT_THRESHOLD_BYTES)


class MeasuredPeak:
    """Peak memory of the block it wraps: ``with MeasuredPeak(device) as peak: ...; peak.bytes``.

    On CPU glibc tracks live memory inside it (slower: time the steps outside it), steady after it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bytes = 0
        """The peak, in bytes (set when the block ends, also when it raised)."""

    def __enter__(self) -> MeasuredPeak:
        if self.device.type == "cpu":
            default_cpu_allocator()
        else:
            # The peak is the caching allocator's reserved memory (see `peak_memory_bytes`):
            # blocks cached by earlier work would count as this block's.
            torch.cuda.empty_cache()
        reset_peak_memory(self.device)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.bytes = peak_memory_bytes(self.device)
        if self.device.type == "cpu":
            steady_cpu_allocator()


def _read_status_kib(field: str) -> int:
    for line in _PROC_STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            # "VmHWM:    123456 kB"
            return int(line.split()[1])
    raise RuntimeError(f"{_PROC_STATUS}: no {field} line (not a Linux /proc?)")


def resident_memory_bytes() -> int:
    """This process's resident memory now (VmRSS), in bytes (Linux)."""
    return _read_status_kib("VmRSS") * 1024


def cpu_peak_supported() -> bool:
    """Whether this process can reset and read its resident high-water mark (Linux)."""
    return _PROC_STATUS.exists() and _PROC_CLEAR_REFS.exists()


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak measurement on `device` (call right before the measured block)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    if device.type != "cpu":
        raise ValueError(f"device: expected a 'cpu' or 'cuda' device, found {device}")
    _malloc_trim()
    _PROC_CLEAR_REFS.write_text("5")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory on `device` since the last `reset_peak_memory`, in bytes.

    CUDA: the caching allocator's peak *reserved* memory: fragmentation and cached blocks are memory a
    micro-batch at the edge also needs. The CUDA context and NCCL's buffers (`non_torch_bytes`) are not in it."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    if device.type != "cpu":
        raise ValueError(f"device: expected a 'cpu' or 'cuda' device, found {device}")
    return _read_status_kib("VmHWM") * 1024


def non_torch_bytes(*, total_bytes: int, free_bytes: int, reserved_bytes: int) -> int:
    """Device memory in use but not by torch's allocator (the CUDA context, NCCL's buffers, other processes),
    from ``torch.cuda.mem_get_info`` and ``torch.cuda.memory_reserved``."""
    if not 0 <= free_bytes <= total_bytes:
        raise ValueError(f"free_bytes: expected 0..{total_bytes}, found {free_bytes}")
    return max(0, total_bytes - free_bytes - reserved_bytes)


def device_overhead_bytes(device: torch.device) -> int:
    """`non_torch_bytes` of `device` now (0 on the CPU, whose peak counts the whole process)."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return non_torch_bytes(
        total_bytes=int(total), free_bytes=int(free), reserved_bytes=int(torch.cuda.memory_reserved(device))
    )


def physical_memory_bytes() -> int:
    """Total physical RAM of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def release_memory(device: torch.device) -> None:
    """Give freed memory back after an out-of-memory, so the next trial starts clean."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        _malloc_trim()


def allocated_device_bytes(device: torch.device) -> int | None:
    """The bytes torch's allocator holds for tensors on a CUDA `device` now; None on CPU (no such count)."""
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else None
