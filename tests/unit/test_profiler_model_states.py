"""The profiler skips a ZeRO stage a device type cannot hold (model states alone), before any engine."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from poplar_ext.plan.formats import ModelInfo
from poplar_ext.profiler import api
from poplar_ext.profiler.cache import JobKey
from poplar_ext.profiler.layout import JobLayout
from poplar_ext.profiler.measure import MeasureSettings

GIB = 2**30


def _session(tmp_path, *, zero_stages=(0,), emulations=None) -> api._Session:
    emulations = emulations or {"A100-80GB": None, "V100-16GB": None}
    config = {"optimizer": {"type": "AdamW"}}
    layout = JobLayout(
        rank=0,
        world_size=2,
        device=torch.device("cpu"),
        cluster=None,
        rank_types=("A100-80GB", "V100-16GB"),
        emulations=emulations,
        capacities_bytes={"A100-80GB": 79 * GIB, "V100-16GB": 15 * GIB},
        hardware={"A100-80GB": "a100", "V100-16GB": "v100"},
        hosts={"A100-80GB": "node0", "V100-16GB": "node0"},
    )
    return api._Session(
        options=SimpleNamespace(
            ds_config=config,
            cache_dir=tmp_path,
            sequence_length=None,
            make_batch=None,
            loss_fn=None,
        ),
        settings=MeasureSettings(),
        layout=layout,
        # The main case: a 1B-parameter model in bf16, 20 bytes per parameter at ZeRO 0.
        model=ModelInfo(name="gpt-1b", fingerprint="f" * 16, num_parameters=10**9, dtype="bfloat16"),
        toggle=None,
        job_key=JobKey.of_job(
            config,
            None,
            emulations=emulations,
            model_fingerprint="f" * 16,
            world_size=2,
            dtype="bfloat16",
            sequence_length=None,
        ),
        offload_types=(),
        runs=(),
        spare_models=[],
        trainable_parameters=10**9,
    )


def _no_engine(**_kwargs):
    raise AssertionError("an engine was built for a stage a device type cannot hold")


def test_a_stage_too_large_for_one_type_builds_no_engine_and_records_why(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(api, "StageMeasurement", _no_engine)
    lines: list[str] = []
    session = _session(tmp_path)
    reporter = api._ProgressReporter(sink=lines.append, layout=session.layout, stages_left=1)

    produced = api._measure_run(session, api._Run(0, False, False), {}, reporter)

    # The V100's profile fits nothing and says why; the A100 cannot run ZeRO 0 in this job.
    assert list(produced) == [("V100-16GB", api._Run(0, False, False))]
    profile = produced[("V100-16GB", api._Run(0, False, False))]
    assert profile["max_micro_batch_size"] == 0 and profile["samples"] == []
    probe = profile["measured_with"]["largest_micro_batch_probe"]
    assert probe["skipped"] == (
        "ZeRO stage 0 needs at least 18.6 GiB for the model states alone (parameters 1.9 GiB, "
        "gradients 1.9 GiB, optimizer 14.9 GiB), more than its memory of 15.0 GiB"
    )
    assert any("A100-80GB not profiled: skipped for V100-16GB" in line for line in lines)
    assert reporter.stages_left == 0, "the skipped stage no longer counts in the time left"


def test_a_stage_every_type_holds_is_measured(tmp_path, monkeypatch) -> None:
    built = []

    class Measured:
        def __init__(self, **kwargs):
            built.append(kwargs["zero_stage"])

        def run(self):
            return {}

    monkeypatch.setattr(api, "StageMeasurement", Measured)
    session = _session(tmp_path)
    reporter = api._ProgressReporter(sink=None, layout=session.layout, stages_left=1)
    # At ZeRO 3 over 2 ranks: 10 bytes per parameter, 9.3 GiB, inside both.
    assert api._measure_run(session, api._Run(3, False, False), {}, reporter) == {}
    assert built == [3]


@pytest.mark.parametrize(("offload", "device_bytes"), [(False, 12 * 10**9), (True, 4 * 10**9)])
def test_optimizer_offload_is_counted_on_the_host(tmp_path, offload, device_bytes) -> None:
    # ZeRO 1 over 2 ranks: bf16 weights and gradients whole, 16 bytes of optimizer per parameter halved.
    assert _session(tmp_path).model_states(api._Run(1, False, offload)).device_bytes == device_bytes


def test_an_emulated_type_is_left_to_the_measurement(tmp_path) -> None:
    session = _session(tmp_path)
    emulated = dataclasses.replace(session.layout, emulations={"A100-80GB": None, "V100-16GB": object()})
    session = dataclasses.replace(session, layout=emulated)
    assert api._types_too_small(session, api._Run(0, False, False)) == {}


def test_a_drift_schedule_does_not_keep_a_stored_profile_from_being_found(tmp_path) -> None:
    # Profiles are stored without the drift schedule (it is training's): the key looked up must match them.
    from poplar_ext.hardware.emulation import Emulation
    from poplar_ext.profiler.cache import ProfileKey
    from poplar_ext.profiler.measure import TypeStageResult

    drifting = Emulation(slowdown=2.0, memory_capacity_bytes=15 * GIB, slowdown_schedule=((5, 4.0, None),))
    session = _session(tmp_path, emulations={"A100-80GB": None, "V100-16GB": drifting})
    run = api._Run(0, False, False)
    result = TypeStageResult(
        device_type="V100-16GB", complete=True, max_micro_batch_size=0, samples=(), optimizer_step_time_s=0.0, probe={}
    )
    stored = api._make_profile(result, session, run, stage_seconds=1.0)
    assert ProfileKey.of_profile(stored) == session.key("V100-16GB", run)


def test_each_trial_line_names_the_run_its_memory_levers_included(tmp_path) -> None:
    from poplar_ext.profiler.measure import TrialEvent

    lines: list[str] = []
    reporter = api._ProgressReporter(sink=lines.append, layout=_session(tmp_path).layout, stages_left=2)
    for run in (api._Run(1, False, False), api._Run(1, True, True)):
        reporter.stage_started(run.title, ["A100-80GB"])
        reporter.trial(TrialEvent(zero_stage=1, phase="probe", sizes={"A100-80GB": 1}, remaining_trials_estimate=1))
    # Otherwise the two runs' lines read alike, their peaks told apart by nothing.
    assert lines[1].startswith("ZeRO-1 probe: A100-80GB micro-batch 1")
    assert lines[3].startswith(
        "ZeRO-1 with activation checkpointing and optimizer offload probe: A100-80GB micro-batch 1"
    )


def test_the_timing_names_the_emulated_slowdown_on_emulated_types_alone(tmp_path) -> None:
    from poplar_ext.hardware.emulation import Emulation
    from poplar_ext.profiler.measure import TypeStageResult

    emulated = Emulation(slowdown=2.0, memory_capacity_bytes=15 * GIB)
    session = _session(tmp_path, emulations={"A100-80GB": None, "V100-16GB": emulated})
    run = api._Run(0, False, False)

    def timing(device_type: str) -> str:
        result = TypeStageResult(
            device_type=device_type,
            complete=True,
            max_micro_batch_size=0,
            samples=(),
            optimizer_step_time_s=0.0,
            probe={},
        )
        return api._make_profile(result, session, run, stage_seconds=1.0).measured_with["timing"]

    # A real CPU's times are its thread's CPU time as measured: no slowdown multiplies them.
    assert timing("A100-80GB") == "the computing thread's CPU time, median"
    assert timing("V100-16GB") == "the computing thread's CPU time (x the emulated slowdown), median"


def test_the_measuring_line_gives_each_types_memory_in_gib_as_the_peaks(tmp_path) -> None:
    from poplar_ext.hardware.emulation import Emulation
    from poplar_ext.profiler.measure import TrialEvent

    # An emulated capacity is declared in bytes and labelled in GB (2.0 GB); the peaks are in GiB.
    emulated = Emulation(slowdown=3.0, memory_capacity_bytes=2 * 10**9)
    session = _session(tmp_path, emulations={"A100-80GB": None, "V100-16GB": emulated})
    layout = dataclasses.replace(session.layout, capacities_bytes={"A100-80GB": 79 * GIB, "V100-16GB": 2 * 10**9})
    lines: list[str] = []
    reporter = api._ProgressReporter(sink=lines.append, layout=layout, stages_left=1)
    reporter.stage_started("ZeRO-0", iter(["A100-80GB", "V100-16GB"]))
    reporter.trial(
        TrialEvent(
            zero_stage=0,
            phase="probe",
            sizes={"V100-16GB": 8},
            remaining_trials_estimate=1,
            fits={"V100-16GB": True},
            peak_memory_bytes={"V100-16GB": 19 * 10**8},
        )
    )
    assert lines[0] == (
        "ZeRO-0: measuring A100-80GB (real), V100-16GB (emulated: 3x slower, 2.0 GB); "
        "memory for micro-batches: A100-80GB 79.00 GiB, V100-16GB 1.86 GiB"
    )
    assert lines[1].startswith("ZeRO-0 probe: V100-16GB micro-batch 8: peak 1.77 GiB;"), lines


def test_sizes_asked_above_a_types_largest_micro_batch_are_named(tmp_path, monkeypatch) -> None:
    from poplar_ext.plan.formats import Sample
    from poplar_ext.profiler.measure import TypeStageResult

    def _sample(b: int) -> Sample:
        return Sample(micro_batch_size=b, micro_step_time_s=0.01 * b, peak_memory_bytes=GIB + b)

    class Measured:
        def __init__(self, **kwargs):
            pass

        def run(self):
            samples = tuple(_sample(b) for b in (1, 2, 8, 12))
            fits = {"A100-80GB": 12, "V100-16GB": 64}
            return {
                t: TypeStageResult(
                    device_type=t,
                    complete=True,
                    max_micro_batch_size=largest,
                    samples=samples if largest == 12 else (*samples, _sample(64)),
                    optimizer_step_time_s=0.01,
                    probe={},
                )
                for t, largest in fits.items()
            }

    monkeypatch.setattr(api, "StageMeasurement", Measured)
    session = _session(tmp_path, zero_stages=(3,))
    session = dataclasses.replace(session, settings=MeasureSettings(micro_batch_sizes=(1, 2, 8, 64, 32)))
    lines: list[str] = []
    reporter = api._ProgressReporter(sink=lines.append, layout=session.layout, stages_left=1)
    api._measure_run(session, api._Run(3, False, False), {}, reporter)
    written = {line.split(":")[1].strip(): line for line in lines if "largest micro-batch" in line}
    # 32 and 64 were asked for; the A100's 12 is its largest: they were left out, which its line now says.
    assert written["A100-80GB"].endswith("; --micro-batch-sizes 32,64 above its largest micro-batch, not measured")
    assert "--micro-batch-sizes" not in written["V100-16GB"], written
