"""Which part of DeepSpeed's optimizer step is compute, so that an emulated device slows that part alone.

DeepSpeed's ZeRO 1/2 optimizer (``DeepSpeedZeroOptimizer.step``) first agrees the gradient norm and
the overflow check over the data-parallel group, then steps each parameter group's partition
(``_optimizer_step``), then all-gathers the updated partitions. Timed whole, the step's compute
clock counts the collectives too (gloo works in the calling thread; CUDA events span NCCL's
kernels), and an emulated device multiplied them by its slowdown: a 1.2M-parameter SGD shard
read 3-6 ms of CPU time and was emulated at 12x as 40-70 ms. `optimizer_compute_window` opens
the window at the first group's ``_optimizer_step`` and closes it after the last one, which
leaves the collectives out. Other optimizers (ZeRO 0's, the bf16 optimizer, ZeRO 3) are timed
whole, as before. The profiler and the ZeRO engine both time the step this way (docs/limits.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def _group_count(optimizer: Any) -> int | None:
    """How many ``_optimizer_step`` calls one step makes (None: an optimizer this module does not split)."""
    groups = getattr(optimizer, "bit16_groups", None)  # DeepSpeedZeroOptimizer (ZeRO 1/2)
    if groups is None or not callable(getattr(optimizer, "_optimizer_step", None)):
        return None
    return len(groups)


@contextmanager
def optimizer_compute_window(optimizer: Any, *, start: Callable[[], None], stop: Callable[[], None]) -> Iterator[bool]:
    """Inside it, `optimizer`'s step calls `start` before its first group's update and `stop` after its last
    (yields True); for an optimizer it cannot split, nothing is patched (yields False: the caller times the
    whole step). An exception inside a group's update stops the window too."""
    count = _group_count(optimizer)
    if not count:
        yield False
        return
    own = vars(optimizer).get("_optimizer_step")
    update = optimizer._optimizer_step
    calls, is_open = [0], [False]

    def close() -> None:
        if is_open[0]:
            is_open[0] = False
            stop()

    def timed_update(group_no: int) -> Any:
        if calls[0] == 0:
            is_open[0] = True
            start()
        calls[0] += 1
        try:
            return update(group_no)
        finally:
            if calls[0] == count:
                close()

    optimizer._optimizer_step = timed_update
    try:
        yield True
    finally:
        if own is None:
            del optimizer._optimizer_step  # the class's method again
        else:
            optimizer._optimizer_step = own
        close()  # an update that raised, or a step that skipped groups, leaves no window open


__all__ = ["optimizer_compute_window"]
