"""Out-of-memory at an engine's start is agreed by all ranks before any collective it could hang
(the model placed on the device, micro-batch 1 before the first boundary), and so is any other error,
raised alike on every rank; one process, the agreement faked with another rank's outcome."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from poplar_ext.profiler import measure
from poplar_ext.profiler.measure import MeasureSettings, StageMeasurement, place_model

OOM = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (forced by the test)")


class _Engine:
    """Records each forward with the accumulation boundary it ran under; each forward raises `error`."""

    def __init__(self, error: Exception | None = OOM) -> None:
        self.boundary = False
        self.forwards: list[bool] = []
        self.error = error

    def set_gradient_accumulation_boundary(self, boundary: bool) -> None:
        self.boundary = boundary

    def __call__(self, batch):
        self.forwards.append(self.boundary)
        if self.error is not None:
            raise self.error
        return batch.sum()

    def backward(self, loss, scale_wrt_gas: bool) -> None:
        pass

    def step(self) -> None:
        pass


def _single_rank(monkeypatch, others: float = 0.0, others_error: tuple | None = None) -> None:
    """agree_max over this rank and another whose every value is `others`, and whose error is `others_error`."""
    monkeypatch.setattr(measure, "agree_max", lambda values, device: [max(v, others) for v in values])
    monkeypatch.setattr(measure, "gather_objects", lambda obj: [obj, others_error])


def _stage(engine: _Engine) -> StageMeasurement:
    layout = SimpleNamespace(
        rank=0,
        device=torch.device("cpu"),
        my_type="V100-16GB",
        type_names=("V100-16GB",),
        emulations={"V100-16GB": None},
    )
    return StageMeasurement(
        layout=layout,
        zero_stage=0,
        types_to_measure=("V100-16GB",),
        build_engine=lambda _stage: engine,
        make_batch=lambda size: torch.zeros(size),
        loss_fn=lambda eng, batch: eng(batch),
        settings=MeasureSettings(),
    )


def test_micro_batch_one_runs_out_outside_the_boundary_and_is_agreed(monkeypatch) -> None:
    _single_rank(monkeypatch)
    engine = _Engine()
    stage = _stage(engine)
    assert stage._start_engine({}) is False
    # Never a forward under the boundary, whose gradient reduction the other ranks would wait in.
    assert engine.forwards == [False]


class _Model(torch.nn.Linear):
    def __init__(self, fails: bool, error: Exception = OOM) -> None:
        super().__init__(2, 2)
        self.fails = fails
        self.error = error

    def to(self, *args, **kwargs):
        if self.fails:
            raise self.error
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


KEYS = TypeError("forward() got an unexpected keyword argument 'labels'")
PEER = RuntimeError("[gloo] Connection closed by peer [10.0.0.2]:29500")


@pytest.mark.parametrize(
    ("mine", "others", "raised", "match"),
    [
        (KEYS, None, TypeError, r"^profiling failed: rank 0: TypeError: forward\(\) got an unexpected keyword"),
        (None, ("ValueError: labels: bad shape", ValueError), ValueError, r"^profiling failed: rank 1: ValueError"),
        (PEER, ("TypeError: forward()", TypeError), TypeError, r"rank 0: RuntimeError: .*; rank 1: TypeError"),
        (PEER, None, RuntimeError, r"^profiling failed: rank 0: RuntimeError: \[gloo\] Connection closed by peer"),
    ],
)
def test_an_error_of_the_users_code_on_any_rank_ends_a_restarting_launchers_job(
    monkeypatch, mine, others, raised, match
) -> None:
    # A model that cannot take its batch fails the same at every restart: raised on every rank as the user's
    # error type, which ends_job_on_user_error recognises; a lost peer stays a RuntimeError, restarted.
    import poplar_ext.elastic as elastic

    ended: list[BaseException] = []
    monkeypatch.setattr(elastic, "end_restarting_launcher", ended.append)
    _single_rank(monkeypatch, others=float(measure._ERROR if others else 0), others_error=others)
    settle = elastic.ends_job_on_user_error(_stage(_Engine(error=mine))._start_engine)
    with pytest.raises(raised, match=match) as failed:
        settle({})
    assert type(failed.value) is raised
    # The failing rank's own traceback (the user's line) is chained; another rank has only the text.
    assert failed.value.__cause__ is mine
    assert ended == ([failed.value] if raised is not RuntimeError else [])


def test_a_user_error_placing_the_model_is_raised_as_the_users(monkeypatch) -> None:
    _single_rank(monkeypatch, others=float(measure._ERROR), others_error=("TypeError: to() got dtype", TypeError))
    with pytest.raises(TypeError, match=r"placing the model on the device: rank 1: TypeError: to\(\) got dtype"):
        place_model(_Model(fails=False), torch.device("cpu"))


def test_the_rank_whose_placing_failed_chains_its_own_error(monkeypatch) -> None:
    _single_rank(monkeypatch)
    with pytest.raises(TypeError, match=r"rank 0: TypeError: forward\(\) got an unexpected") as failed:
        place_model(_Model(fails=True, error=KEYS), torch.device("cpu"))
    assert failed.value.__cause__ is KEYS
