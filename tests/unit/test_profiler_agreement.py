"""Out-of-memory at an engine's start is agreed by all ranks before any collective it could hang
(the model placed on the device, micro-batch 1 before the first boundary); one process, the
agreement faked with another rank's outcome."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from poplar_ext.profiler import measure
from poplar_ext.profiler.measure import MeasureSettings, StageMeasurement, place_model

OOM = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (forced by the test)")


class _Engine:
    """Records each forward with the accumulation boundary it ran under; the first forward runs out."""

    def __init__(self) -> None:
        self.boundary = False
        self.forwards: list[bool] = []

    def set_gradient_accumulation_boundary(self, boundary: bool) -> None:
        self.boundary = boundary

    def __call__(self, batch):
        self.forwards.append(self.boundary)
        raise OOM


def _single_rank(monkeypatch, others: float = 0.0) -> None:
    """agree_max over this rank and another whose every value is `others`."""
    monkeypatch.setattr(measure, "agree_max", lambda values, device: [max(v, others) for v in values])
    monkeypatch.setattr(measure, "gather_objects", lambda obj: [obj, None])


def test_micro_batch_one_runs_out_outside_the_boundary_and_is_agreed(monkeypatch) -> None:
    _single_rank(monkeypatch)
    engine = _Engine()
    layout = SimpleNamespace(
        device=torch.device("cpu"), my_type="V100-16GB", type_names=("V100-16GB",), emulations={"V100-16GB": None}
    )
    stage = StageMeasurement(
        layout=layout,
        zero_stage=0,
        types_to_measure=("V100-16GB",),
        build_engine=lambda _stage: engine,
        make_batch=lambda size: torch.zeros(size),
        loss_fn=lambda eng, batch: eng(batch),
        settings=MeasureSettings(),
    )
    assert stage._start_engine({}) is False
    # Never a forward under the boundary, whose gradient reduction the other ranks would wait in.
    assert engine.forwards == [False]


class _Model(torch.nn.Linear):
    def __init__(self, fails: bool) -> None:
        super().__init__(2, 2)
        self.fails = fails

    def to(self, *args, **kwargs):
        if self.fails:
            raise OOM
        return super().to(*args, **kwargs)


def test_a_rank_out_of_memory_placing_the_model_abandons_the_stage(monkeypatch) -> None:
    _single_rank(monkeypatch)
    with pytest.raises(measure._StageAbandoned, match="a real out-of-memory placing the model on the device"):
        place_model(_Model(fails=True), torch.device("cpu"))


def test_a_rank_that_placed_its_model_abandons_too_when_another_ran_out(monkeypatch) -> None:
    _single_rank(monkeypatch, others=float(measure._REAL_OOM))
    with pytest.raises(measure._StageAbandoned):
        place_model(_Model(fails=False), torch.device("cpu"))


def test_placing_fits_on_every_rank(monkeypatch) -> None:
    _single_rank(monkeypatch)
    model = _Model(fails=False)
    assert place_model(model, torch.device("cpu")) is model
