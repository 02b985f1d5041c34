"""What a job's ``poplar`` section asks of its process on CPU (threads, glibc's allocator), applied and
logged by the ZeRO and the pipeline paths alike (docs/training.md)."""

from __future__ import annotations

import logging

import torch

from poplar_ext.hardware.cpu_process import limit_cpu_threads
from poplar_ext.hardware.memory import steady_cpu_allocator
from poplar_ext.runtime.config import PoplarConfig

logger = logging.getLogger(__name__)


def on_cpu_accelerator() -> bool:
    """True when DeepSpeed's accelerator is the CPU (ranks train on CPU cores)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def apply_cpu_process_settings(poplar_config: PoplarConfig, *, on_cpu: bool, emulated: bool, rank: int) -> None:
    """What ``poplar.cpu_threads`` and ``poplar.steady_cpu_allocator`` ask for, logged; nothing else."""
    if poplar_config.cpu_threads is not None:
        previous = limit_cpu_threads(poplar_config.cpu_threads)
        logger.info(
            "poplar.cpu_threads: torch intra-op threads set to %d (were %d)", poplar_config.cpu_threads, previous
        )
    if poplar_config.steady_cpu_allocator and on_cpu:
        if steady_cpu_allocator():
            logger.info("poplar.steady_cpu_allocator: glibc now keeps freed memory for reuse (process-wide)")
        else:
            logger.warning(
                "poplar.steady_cpu_allocator: this C library has no mallopt (not glibc); allocator unchanged"
            )
    if emulated and on_cpu and torch.get_num_threads() > 1:
        logger.warning(
            "rank %d emulates its device type with %d torch threads, but emulation times compute by this thread's "
            "CPU time and misses the others: set poplar.cpu_threads to 1",
            rank,
            torch.get_num_threads(),
        )
