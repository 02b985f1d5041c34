"""The compute part of DeepSpeed's optimizer step, which an emulated device slows alone. See
docs/deepspeed-notes.md (measuring) and docs/limits.md (emulation)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def optimizer_compute_window(optimizer: Any, *, start: Callable[[], None], stop: Callable[[], None]) -> Iterator[bool]:
    """Inside it, `optimizer`'s step calls `start` before its first group's update and `stop` after its last
    (yields True); for an optimizer it cannot split, nothing is patched (yields False: the caller times the
    whole step). An exception inside a group's update stops the window too."""
    # How many ``_optimizer_step`` calls one step makes: DeepSpeedZeroOptimizer's (ZeRO 1/2) groups.
    groups = getattr(optimizer, "bit16_groups", None)
    count = len(groups) if groups is not None and callable(getattr(optimizer, "_optimizer_step", None)) else 0
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
