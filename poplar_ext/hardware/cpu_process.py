"""Process-wide settings for ranks that train or measure on the CPU.

poplar-ext changes none of them behind the user's back. The programs that own their
process apply them (`poplar-profile`, `poplar-bench`, the tests);
`poplar_ext.initialize` applies them only when the ``poplar`` section asks
(``cpu_threads``, ``steady_cpu_allocator``) and logs what it did; `profile_model`
uses one torch thread while it measures and gives the previous count back.

Why they matter on CPU:

* One torch intra-op thread per rank: emulation and the profiler time compute by
  the computing thread's CPU time (`poplar_ext.hardware.emulation`), which misses
  work done on other threads, and ranks sharing a few cores do not fight over them.
* glibc's allocator kept steady (`poplar_ext.hardware.memory.steady_cpu_allocator`):
  without it every micro-step faults its activation memory in again, which the
  profiles (measured with it) do not contain.
* DeepSpeed's CPU shared-memory op (`skip_deepspeed_shm_op`): DeepSpeed compiles it
  when the first process group starts on a CPU machine (about 50 s on 2 cores),
  and only its inference all-reduce uses it, never ZeRO training.
"""

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
    import torch

    previous = limit_cpu_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def skip_deepspeed_shm_op() -> None:
    """Tell DeepSpeed not to build its CPU shared-memory op (call before its process group starts).

    DeepSpeed reads `deepspeed.ops.__compatible_ops__` when its communication backend
    starts and builds the op only where it is marked compatible; the dict is built
    once per process and kept, so marking it there holds. The op serves
    ``deepspeed.comm.inference_all_reduce`` alone; ZeRO training uses the process
    group's own collectives.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[DEEPSPEED_SHM_OP] = False


__all__ = ["DEEPSPEED_SHM_OP", "cpu_threads", "limit_cpu_threads", "skip_deepspeed_shm_op"]
