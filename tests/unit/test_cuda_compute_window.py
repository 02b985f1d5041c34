"""Where a micro-step's compute window ends and which clock times it, per device kind and ZeRO stage.

No GPU here: CUDA events are stood in for by marks on this thread's CPU clock, so the
decisions (which clock, where the window ends, which types are timed together) run as on a GPU.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from poplar_ext.profiler import api
from poplar_ext.profiler.measure import MeasureSettings, StageMeasurement, _TrialOutcome


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class _FakeCudaEvent:
    """A CUDA event whose time is this thread's CPU time when recorded."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.at_s: float | None = None

    def record(self) -> None:
        self.at_s = time.thread_time()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _FakeCudaEvent) -> float:
        return (end.at_s - self.at_s) * 1000.0


class _Engine:
    """A DeepSpeed engine whose micro-step reduces gradients (0.2 s, communication) after 0.05 s of compute."""

    def allreduce_gradients(self) -> None:
        _burn(0.2)


def _measurement(device_kind: str, zero_stage: int, types: tuple[str, ...] = ("A",)) -> StageMeasurement:
    measurement = object.__new__(StageMeasurement)
    measurement.layout = SimpleNamespace(
        device=SimpleNamespace(type=device_kind), emulations={t: None for t in types}, my_type="A"
    )
    measurement.zero_stage = zero_stage
    measurement.types_to_measure = types
    measurement.settings = MeasureSettings()
    engine = _Engine()
    measurement.engine = engine

    def micro_step(size: int, *, boundary: bool) -> None:
        _burn(0.05)  # forward and backward
        engine.allreduce_gradients()

    measurement._micro_step = micro_step
    return measurement


@pytest.fixture
def fake_cuda_events(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeCudaEvent)


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_on_cuda_the_window_ends_at_the_gradient_reduction(fake_cuda_events, zero_stage):
    elapsed_s = _measurement("cuda", zero_stage)._timed_micro_step(4)
    assert 0.04 <= elapsed_s < 0.2, f"expected the compute before the reduction (0.05 s), found {elapsed_s:.3f} s"


def test_on_cuda_at_zero_3_the_whole_micro_step_is_timed_and_says_it_holds_communication(fake_cuda_events):
    # The parameter all-gathers run all through forward and backward: no window leaves them out,
    # so the profile says its times include communication and the cost model subtracts all of it.
    measurement = _measurement("cuda", 3)
    assert measurement._timed_micro_step(4) >= 0.24
    assert measurement.window.includes_communication and not measurement.window.ends_at_reduction


@pytest.mark.parametrize(
    ("device_kind", "zero_stage", "clock", "at_once", "includes"),
    [
        ("cpu", 0, "thread", True, False),
        ("cpu", 2, "thread", True, False),
        ("cpu", 3, "thread", True, False),
        ("cuda", 0, "cuda", True, False),
        ("cuda", 1, "cuda", True, False),
        ("cuda", 2, "cuda", False, False),
        ("cuda", 3, "cuda", False, True),
    ],
)
def test_the_window_per_device_kind_and_stage(device_kind, zero_stage, clock, at_once, includes):
    window = _measurement(device_kind, zero_stage).window
    assert (window.clock, window.types_at_once, window.includes_communication) == (clock, at_once, includes)
    assert window.to_dict()["includes_communication"] is includes


def _trials_of_time_sizes(device_kind: str, zero_stage: int, sizes: dict[str, list[int]]) -> list[dict[str, int]]:
    measurement = _measurement(device_kind, zero_stage, types=tuple(sizes))
    trials: list[dict[str, int]] = []

    def trial(sizes_of_trial: dict[str, int], *, memory: bool = True) -> _TrialOutcome:
        trials.append(dict(sizes_of_trial))
        flags = {t: 0 for t in sizes} | {"__unmeasured__": 0}
        return _TrialOutcome(flags=flags, peaks={}, own_times_s=[1.0], rebuild=False)

    measurement._start_engine = lambda records: True
    measurement._drop_engine = lambda: None
    measurement._trial = trial
    measurement.time_sizes(sizes)
    return trials


def test_calibration_on_cuda_at_zero_2_3_times_one_type_at_a_time():
    for zero_stage in (2, 3):
        trials = _trials_of_time_sizes("cuda", zero_stage, {"A": [1, 2], "B": [4]})
        assert trials == [{"A": 1}, {"A": 2}, {"B": 4}], f"ZeRO {zero_stage}: {trials}"


def test_calibration_on_cpu_and_at_zero_0_1_times_every_type_at_once():
    for device_kind, zero_stage in (("cpu", 2), ("cpu", 3), ("cuda", 0), ("cuda", 1)):
        trials = _trials_of_time_sizes(device_kind, zero_stage, {"A": [1, 2], "B": [4]})
        assert trials == [{"A": 1, "B": 4}, {"A": 2}], f"{device_kind} ZeRO {zero_stage}: {trials}"


@dataclasses.dataclass(frozen=True)
class _Options:
    zero_stages: tuple[int, ...] = ()
    cluster: object = None
    make_batch: object = None
    loss_fn: object = None
    ds_config: object = dataclasses.field(default_factory=dict)


def _settings_calibration_times_with(monkeypatch, device_kind: str, zero_stage: int) -> MeasureSettings:
    used: list[MeasureSettings] = []

    class Measurement:
        def __init__(self, *, settings, **_):
            used.append(settings)

        def time_sizes(self, sizes):
            return {}

    monkeypatch.setattr(api, "_checked", lambda options: (options, MeasureSettings()))
    monkeypatch.setattr(api, "join_job", lambda: SimpleNamespace(type=device_kind))
    monkeypatch.setattr(api, "_measuring_process", lambda device: nullcontext())
    monkeypatch.setattr(
        api, "build_layout", lambda cluster, device, bf16: SimpleNamespace(type_names=("A",), my_type="A")
    )
    monkeypatch.setattr(api, "_start_session", lambda options, settings, layout: None)
    monkeypatch.setattr(api, "StageMeasurement", Measurement)
    monkeypatch.setattr(api, "gather_objects", lambda obj: [obj])
    api.time_micro_steps(_Options(), {"A": [1]}, zero_stage=zero_stage)
    return used[0]


@pytest.mark.parametrize(
    ("device_kind", "zero_stage", "as_training"),
    [("cuda", 0, True), ("cuda", 1, True), ("cuda", 2, False), ("cuda", 3, False), ("cpu", 1, True), ("cpu", 2, False)],
)
def test_calibration_times_as_training_only_where_no_collective_is_waited_in(
    monkeypatch, device_kind, zero_stage, as_training
):
    assert _settings_calibration_times_with(monkeypatch, device_kind, zero_stage).as_training is as_training


@pytest.mark.parametrize(
    ("device_kind", "zero_stage", "includes"), [("cuda", 2, False), ("cuda", 3, True), ("cpu", 3, False)]
)
def test_the_profile_records_how_its_compute_was_timed(device_kind, zero_stage, includes):
    from poplar_bench.synthetic import SYNTHETIC_MODEL
    from poplar_ext.plan.formats import Sample
    from poplar_ext.profiler.measure import TypeStageResult

    layout = SimpleNamespace(
        device=SimpleNamespace(type=device_kind),
        emulations={"A": None},
        capacities_bytes={"A": 2**30},
        world_size=2,
        hosts={"A": "h"},
        hardware={"A": {}},
        ranks_of=lambda t: [0, 1],
    )
    session = SimpleNamespace(
        layout=layout,
        settings=MeasureSettings(),
        job_key=SimpleNamespace(torch_version="t", deepspeed_version="d", ds_config_fingerprint="c"),
        model=SYNTHETIC_MODEL,
        network=None,
    )
    result = TypeStageResult(
        device_type="A",
        complete=True,
        max_micro_batch_size=1,
        samples=(Sample(micro_batch_size=1, micro_step_time_s=0.1, peak_memory_bytes=1),),
        optimizer_step_time_s=0.1,
        probe={},
    )
    run = SimpleNamespace(zero_stage=zero_stage, checkpointing=False, offload=False)
    measured_with = api._make_profile(result, session, run, stage_seconds=1.0).measured_with
    assert measured_with["micro_step_times_include_communication"] is includes
    assert measured_with["compute_window"]["clock"] == ("cuda" if device_kind == "cuda" else "thread")
    assert measured_with["compute_window"]["ends_at"] == ("micro-step end" if includes else "gradient reduction")


@pytest.mark.parametrize("my_type", ["fast", "slow"])
def test_calibration_times_each_rank_with_its_own_types_checkpointing(monkeypatch, my_type):
    built = []

    class Session:
        def build_engine(self, run):
            built.append(run)

    class Measurement:
        def __init__(self, *, build_engine, **_):
            self.build_engine = build_engine

        def time_sizes(self, sizes):
            self.build_engine(1)
            return {}

    monkeypatch.setattr(api, "_checked", lambda options: (options, MeasureSettings()))
    monkeypatch.setattr(api, "join_job", lambda: SimpleNamespace(type="cpu"))
    monkeypatch.setattr(api, "_measuring_process", lambda device: nullcontext())
    layout = SimpleNamespace(type_names=("fast", "slow"), my_type=my_type)
    monkeypatch.setattr(api, "build_layout", lambda cluster, device, bf16: layout)
    monkeypatch.setattr(api, "_start_session", lambda options, settings, layout: Session())
    monkeypatch.setattr(api, "StageMeasurement", Measurement)
    monkeypatch.setattr(api, "gather_objects", lambda obj: [obj])
    api.time_micro_steps(
        _Options(), {"fast": [2], "slow": [1]}, zero_stage=1, activation_checkpointing={"fast": True, "slow": False}
    )
    assert [run.checkpointing for run in built] == [my_type == "fast"]
