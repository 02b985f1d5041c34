"""Peak memory measurement and out-of-memory recognition (CPU; CUDA parts in tests/gpu)."""

from __future__ import annotations

import subprocess

import pytest
import torch

from poplar_ext.hardware import memory

CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(not memory.cpu_peak_supported(), reason="needs Linux /proc/self/clear_refs")


def test_cpu_peak_sees_a_torch_allocation_and_resets_after_it_is_freed() -> None:
    memory.reset_peak_memory(CPU)
    before = memory.peak_memory_bytes(CPU)
    block = torch.ones(25_000_000)  # 100 MB, touched so it is resident
    during = memory.peak_memory_bytes(CPU)
    del block
    memory.reset_peak_memory(CPU)
    after = memory.peak_memory_bytes(CPU)
    assert during - before >= 95_000_000
    # The high-water mark is back near the starting level, not stuck at the spike.
    assert after - before < 20_000_000


def test_cpu_peak_keeps_a_spike_that_was_freed_before_reading() -> None:
    memory.reset_peak_memory(CPU)
    before = memory.peak_memory_bytes(CPU)
    spike = torch.ones(25_000_000)
    del spike
    assert memory.peak_memory_bytes(CPU) - before >= 95_000_000


def test_unsupported_device_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="device: expected a 'cpu' or 'cuda' device, found meta"):
        memory.reset_peak_memory(torch.device("meta"))


def test_a_cpu_allocation_failure_is_recognised_as_out_of_memory() -> None:
    with pytest.raises(RuntimeError) as info:
        torch.empty(10**15)  # 4 PB: refused by the allocator, nothing is touched
    assert memory.is_out_of_memory(info.value)


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (RuntimeError("CUDA error: out of memory"), True),
        (MemoryError(), True),
        (RuntimeError("shape mismatch"), False),
        (ValueError("out of memory"), False),
        # cuBLAS and cuDNN report a failed allocation (handle or workspace) with their own status.
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
        (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True),
        (RuntimeError("CUDA driver error: CUDA_ERROR_OUT_OF_MEMORY"), True),
        (
            RuntimeError(
                "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, NCCL version 2.21.5\n"
                "Last error:\nCuda failure 2 'out of memory'"
            ),
            True,
        ),
        # Not allocation failures: a bad kernel image, a wrong cuBLAS call, cuDNN's catch-all.
        (RuntimeError("CUDA error: no kernel image is available for execution on the device"), False),
        (RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, ...)`"), False),
        (RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"), False),
        (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"), False),
    ],
)
def test_out_of_memory_classification(exc: BaseException, expected: bool) -> None:
    assert memory.is_out_of_memory(exc) is expected


def test_a_peak_reset_and_the_allocator_settings_start_no_process(monkeypatch) -> None:
    # The profiler resets the peak at every trial, in a process that may hold CUDA and NCCL threads.
    def no_process(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess.Popen, "__init__", no_process)
    memory._libc_function.cache_clear()
    memory.reset_peak_memory(CPU)
    memory.steady_cpu_allocator()
    memory.default_cpu_allocator()


def test_steady_allocator_is_set_on_glibc() -> None:
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    assert memory.steady_cpu_allocator() is True


def test_what_the_cuda_context_and_nccl_take_is_measured_apart() -> None:
    gib = 2**30
    # 80 GiB card, 70 GiB free, torch holds 8 GiB: 2 GiB are the context, NCCL and the like.
    assert memory.non_torch_bytes(total_bytes=80 * gib, free_bytes=70 * gib, reserved_bytes=8 * gib) == 2 * gib
    assert memory.non_torch_bytes(total_bytes=80 * gib, free_bytes=80 * gib, reserved_bytes=0) == 0
    with pytest.raises(ValueError, match="free_bytes: expected 0"):
        memory.non_torch_bytes(total_bytes=gib, free_bytes=2 * gib, reserved_bytes=0)


def test_a_cpu_has_no_overhead_outside_its_peak() -> None:
    assert memory.device_overhead_bytes(CPU) == 0
