"""`optimizer_compute_window`: an emulated device's optimizer step is the ZeRO 1/2 partition updates alone,
the step's collectives (gradient norm, overflow check, all-gather) left out."""

from __future__ import annotations

import pytest

from poplar_ext.hardware.optimizer_window import optimizer_compute_window


class ZeroLike:
    """DeepSpeedZeroOptimizer's shape: a collective, each group's update, a collective."""

    def __init__(self, groups: int, events: list, *, fail_at: int | None = None) -> None:
        self.bit16_groups = [object()] * groups
        self.events, self.fail_at = events, fail_at

    def _optimizer_step(self, group_no: int) -> None:
        if group_no == self.fail_at:
            raise RuntimeError("update failed")
        self.events.append(f"update {group_no}")

    def step(self, *, overflow: bool = False) -> None:
        self.events.append("norm all-reduce")
        if not overflow:
            for group_no in range(len(self.bit16_groups)):
                self._optimizer_step(group_no)
        self.events.append("all-gather")


def _window(optimizer, events):
    return optimizer_compute_window(optimizer, start=lambda: events.append("start"), stop=lambda: events.append("stop"))


def test_the_window_holds_the_group_updates_and_none_of_the_collectives():
    events: list = []
    optimizer = ZeroLike(3, events)
    with _window(optimizer, events) as split:
        optimizer.step()
    assert split is True
    assert events == ["norm all-reduce", "start", "update 0", "update 1", "update 2", "stop", "all-gather"]
    assert "_optimizer_step" not in vars(optimizer), "the class's method again"


def test_a_step_that_skips_its_updates_opens_no_window():
    events: list = []
    optimizer = ZeroLike(2, events)
    with _window(optimizer, events):
        optimizer.step(overflow=True)
    assert events == ["norm all-reduce", "all-gather"]


def test_a_failing_update_closes_the_window_once():
    events: list = []
    optimizer = ZeroLike(3, events, fail_at=1)
    with pytest.raises(RuntimeError, match="update failed"), _window(optimizer, events):
        optimizer.step()
    assert events == ["norm all-reduce", "start", "update 0", "stop"]


def test_an_optimizer_it_cannot_split_is_left_alone():
    class Plain:
        def step(self) -> None:
            pass

    events: list = []
    optimizer = Plain()
    with _window(optimizer, events) as split:
        optimizer.step()
    assert split is False and events == [] and not hasattr(optimizer, "_optimizer_step")


def test_the_profilers_window_waits_for_queued_kernels_at_both_ends(monkeypatch):
    # On a GPU the step's first update is queued behind the gradients' last reduction: a window opened
    # without waiting for it would count that reduction as optimizer compute.
    import torch

    from poplar_ext.profiler.measure import _StepWindow

    events: list = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(f"synchronize {device}"))
    window = _StepWindow(torch.device("cuda", 0))
    window.start()
    events.append("update")
    window.stop()
    assert events == ["synchronize cuda:0", "update", "synchronize cuda:0"]
    cpu_events: list = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: cpu_events.append(device))
    cpu_window = _StepWindow(torch.device("cpu"))
    cpu_window.start()
    cpu_window.stop()
    assert cpu_events == [] and cpu_window.wall_s >= 0.0
