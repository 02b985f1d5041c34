"""The profiler's compute window on CPU ends where training's does: at DeepSpeed's gradient reduction."""

from __future__ import annotations

import time
from types import SimpleNamespace

from poplar_ext.profiler.measure import StageMeasurement


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class _Engine:
    """Stands for a DeepSpeed engine whose backward reduces gradients (ZeRO 2-3) inside a micro-step."""

    reductions = 0

    def allreduce_gradients(self) -> None:
        type(self).reductions += 1
        _burn(0.2)  # the reduction's CPU time: communication, not compute


def _measurement(engine: _Engine) -> StageMeasurement:
    measurement = object.__new__(StageMeasurement)
    measurement.engine = engine
    measurement.layout = SimpleNamespace(device=SimpleNamespace(type="cpu"))
    measurement.zero_stage = 2

    def micro_step(size: int, *, boundary: bool) -> None:
        _burn(0.05)  # forward and backward up to the reduction
        engine.allreduce_gradients()
        _burn(0.01)

    measurement._micro_step = micro_step
    return measurement


def test_the_reduction_is_not_counted_as_compute():
    engine = _Engine()
    elapsed_s = _measurement(engine)._time_compute_window(4)
    assert 0.04 <= elapsed_s < 0.15, elapsed_s
    assert _Engine.reductions == 1 and "allreduce_gradients" not in vars(engine), "the engine's own method again"


def test_without_a_reduction_the_whole_micro_step_counts():
    class NoReduction(_Engine):
        pass

    engine = NoReduction()
    measurement = _measurement(engine)
    measurement._micro_step = lambda size, *, boundary: _burn(0.05)
    assert 0.04 <= measurement._time_compute_window(4) < 0.15


def test_a_trial_line_says_each_sizes_outcome_and_what_a_rebuild_left():
    from poplar_ext.profiler.api import trial_outcome_text
    from poplar_ext.profiler.measure import TrialEvent

    event = TrialEvent(
        zero_stage=1,
        phase="probe",
        sizes={"H200-141GB": 64, "V100-16GB": 8},
        remaining_trials_estimate=3,
        fits={"H200-141GB": True, "V100-16GB": False},
        peak_memory_bytes={"H200-141GB": 3 * 2**30},
        memory_after_rebuild_bytes=2**30,
    )
    assert trial_outcome_text(event) == (
        "H200-141GB micro-batch 64: peak 3.00 GiB, V100-16GB micro-batch 8: out of memory "
        "(engine rebuilt: 1.00 GiB in use after)"
    )


def test_a_model_that_cannot_take_the_batch_is_told_to_pass_loss_fn():
    # The elastic restart recipe with a model of one's own whose batches are tuples (issue 36, item 11).
    import pytest
    import torch

    from poplar_ext.profiler.measure import default_loss

    model = torch.nn.Sequential(torch.nn.Linear(2, 1))
    batch = (torch.zeros(3, 2), torch.zeros(3, 1), torch.zeros(3))
    with pytest.raises(
        TypeError, match=r"takes 2 positional arguments but 4 were given.*model\(\*batch\) with 3 items"
    ):
        default_loss(model, batch)
    with pytest.raises(TypeError, match="pass loss_fn=lambda engine, batch: loss to poplar_ext.initialize"):
        default_loss(model, batch)
    with pytest.raises(TypeError, match="under accelerate, to PoplarAccelerator"):
        default_loss(model, batch)
    assert default_loss(lambda x: x.sum(), torch.ones(2)) == 2.0


def test_a_model_output_that_is_no_loss_is_refused_naming_loss_fn():
    # DeepSpeed's backward asserts a one-element tensor: poplar-profile showed its 80-line traceback.
    import pytest
    import torch

    from poplar_ext.profiler.measure import default_loss

    with pytest.raises(ValueError, match=r"^loss_fn: expected the model's output from model\(batch\) to be a one-elem"):
        default_loss(torch.nn.Linear(2, 3), torch.zeros(4, 2))
    with pytest.raises(ValueError, match=r"found a tensor of shape \(4, 3\); .* poplar-profile: --loss MODULE:FN"):
        default_loss(torch.nn.Linear(2, 3), torch.zeros(4, 2))
    with pytest.raises(ValueError, match=r"found tuple"):
        default_loss(lambda x: (x, x), torch.zeros(2))
    assert default_loss(lambda x: x.sum().reshape(1), torch.ones(2)) == 2.0  # one element: what DeepSpeed takes


def test_a_type_that_fits_no_micro_batch_is_told_why_in_its_progress_line():
    # "cpu-slow: largest micro-batch 0, 0 sizes" said nothing of the 100 MB emulated memory below the engine's own.
    from types import SimpleNamespace

    from poplar_ext.profiler.api import _fits_nothing

    layout = SimpleNamespace(capacities_bytes={"cpu-slow": 2**29})
    warmup = {"smallest_failing": None, "optimizer_step_peak_memory_bytes": 2**30}
    assert _fits_nothing(warmup, layout, "cpu-slow") == (
        " (no micro-batch fits its 0.50 GiB: its warm-up ran out of memory, the optimizer step alone peaking at "
        "1.00 GiB)"
    )
    first = {"smallest_failing": 1, "optimizer_step_peak_memory_bytes": None}
    assert (
        _fits_nothing(first, layout, "cpu-slow")
        == " (no micro-batch fits its 0.50 GiB: micro-batch 1 ran out of memory)"
    )
