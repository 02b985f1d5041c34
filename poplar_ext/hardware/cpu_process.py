"""Process-wide CPU settings (torch threads, DeepSpeed's shm op), applied only by programs that own their process,
by `initialize` when the ``poplar`` section asks and by `profile_model` while it measures. Why they matter:
docs/training.md (end), docs/deepspeed-notes.md (the shm op)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

DEEPSPEED_SHM_OP = "deepspeed_shm_comm"
"""The name DeepSpeed's op builder gives its CPU shared-memory communication op."""


def limit_cpu_threads(threads: int = 1) -> int:
    """Give torch `threads` intra-op threads in this process; returns the previous count."""
    import torch

    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads: expected an integer >= 1, found {threads!r}")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    return previous


@contextmanager
def cpu_threads(threads: int = 1) -> Iterator[None]:
    """`threads` torch intra-op threads inside the block, the previous count after it."""
    previous = limit_cpu_threads(threads)
    try:
        yield
    finally:
        limit_cpu_threads(previous)


def skip_deepspeed_shm_op() -> None:
    """Tell DeepSpeed not to build its CPU shared-memory op (call before its process group starts).

    DeepSpeed builds it where `deepspeed.ops.__compatible_ops__` (built once per process) marks it
    compatible; it serves ``deepspeed.comm.inference_all_reduce`` alone, not ZeRO training."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[DEEPSPEED_SHM_OP] = False
