"""`profile_model` / `profile_with`: every device type of the job measured at each ZeRO stage (collective), cached
profiles reused; rank 0 writes, every rank returns the same list. See docs/profiling.md."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
import os
import statistics
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from poplar_ext.activation_checkpointing import (
    CheckpointingToggle,
    cannot_checkpoint_message,
    checkpointing_toggle,
)
from poplar_ext.collectives import ShortCollectiveTimeouts, broadcast_from_rank0, gather_objects, process_group_rank
from poplar_ext.hardware.compute_clock import compute_window
from poplar_ext.hardware.cpu_process import cpu_threads
from poplar_ext.hardware.devices import join_job
from poplar_ext.hardware.emulation import EMULATED_TIMES, device_label, without_drift
from poplar_ext.hardware.memory import default_cpu_allocator, steady_cpu_allocator
from poplar_ext.optimizer_offload import OFFLOAD_MODES, offload_deepspeed_optimizer
from poplar_ext.plan.formats import (
    OFFLOAD_STAGES,
    ZERO_STAGES,
    ModelInfo,
    Profile,
    levers_text,
    profile_from_dict,
    profile_to_dict,
)
from poplar_ext.plan.network_format import NetworkProfile
from poplar_ext.profiler.cache import (
    JobKey,
    ProfileKey,
    WritableBeforeMeasuring,
    cached_on_rank0,
    find_cached_profile,
    profiles_key,
    store_profile,
)
from poplar_ext.profiler.calibration import timed_as_training
from poplar_ext.profiler.fingerprint import model_fingerprint
from poplar_ext.profiler.layout import JobLayout, build_layout
from poplar_ext.profiler.measure import (
    MeasureSettings,
    StageMeasurement,
    TrialEvent,
    TypeStageResult,
    default_loss,
    measured_provenance,
    place_model,
    read_ds_config,
    sequence_length_of,
    stage_ds_config,
    training_dtype,
)
from poplar_ext.profiler.network import DEFAULT_MESSAGE_BYTES, cached_or_measured_network, message_sizes
from poplar_ext.profiler.options import CHECKPOINTING_MODES, NO_OPTIMIZER, ProfileOptions, Progress
from poplar_ext.search.cost import included_communication
from poplar_ext.search.model_states import (
    DTYPE_BYTES,
    ModelStates,
    cannot_hold,
    model_states,
    optimizer_state_bytes,
    shortfall,
)

logger = logging.getLogger(__name__)


@dataclass
class _ProgressReporter:
    """Turns trial events into log lines with an estimated time left."""

    sink: Progress | None
    layout: JobLayout
    stages_left: int
    started_at: float = 0.0
    trials_done: int = 0
    trials_per_stage: float | None = None
    stage_trials: int = 0
    title: str = ""
    """The run measured now, e.g. ``ZeRO-1 with activation checkpointing``: its trial lines say it."""

    def say(self, line: str) -> None:
        if self.sink is not None and self.layout.rank == 0:
            self.sink(line)

    def stage_started(self, title: str, types: Iterable[str]) -> None:
        if not self.started_at:
            self.started_at = time.monotonic()
        self.stages_left -= 1
        self.stage_trials = 0
        self.title = title
        types = list(types)
        labels = ", ".join(device_label(t, self.layout.emulations[t]) for t in types)
        # In GiB, as the trial lines give the peaks (a label's emulated capacity is in GB, as declared).
        memory = ", ".join(f"{t} {self.layout.capacities_bytes[t] / 2**30:.2f} GiB" for t in types)
        self.say(f"{title}: measuring {labels}; memory for micro-batches: {memory}")

    def stage_finished(self) -> None:
        self.trials_per_stage = (
            self.stage_trials if self.trials_per_stage is None else (self.trials_per_stage + self.stage_trials) / 2
        )

    def trial(self, event: TrialEvent) -> None:
        self.trials_done += 1
        self.stage_trials += 1
        elapsed = time.monotonic() - self.started_at
        per_trial = elapsed / self.trials_done
        later = self.stages_left * (self.trials_per_stage or self.stage_trials + event.remaining_trials_estimate)
        left_s = per_trial * (event.remaining_trials_estimate + later)
        self.say(f"{self.title} {event.phase}: {trial_outcome_text(event)}; about {left_s:.0f} s left")


def trial_outcome_text(event: TrialEvent) -> str:
    """Each size a trial ran and its outcome, and what a rebuild left: ``A100-80GB micro-batch 64: peak 41.2 GiB``."""

    def outcome(t: str) -> str:
        if t not in event.fits:
            return ""
        return f": peak {event.peak_memory_bytes.get(t, 0) / 2**30:.2f} GiB" if event.fits[t] else ": out of memory"

    text = ", ".join(f"{t} micro-batch {size}{outcome(t)}" for t, size in event.sizes.items())
    if event.memory_after_rebuild_bytes is not None:
        text += f" (engine rebuilt: {event.memory_after_rebuild_bytes / 2**30:.2f} GiB in use after)"
    return text


def profile_model(**options: Any) -> list[Profile]:
    """Profiles of every device type in the job at every stage of `zero_stages` (collective: every rank calls
    it alike and gets the same list, stage by stage in job order of device types).

    Its keywords are `ProfileOptions`' fields (its signature is theirs). A cached profile with the same
    keys is returned as it is (unless `force`); the others are measured and written by rank 0. On CPU it
    measures with one torch thread and glibc's steady allocator, and gives back the thread count and
    glibc's default thresholds after. A pipeline model (`ProfileOptions.per_layer`) gets layer profiles
    (``<cache_dir>/layers/``) and [] is returned.
    """
    return profile_with(ProfileOptions(**options))


# help(), IDEs and inspect see the keywords, stated once: the options' fields.
profile_model.__signature__ = inspect.signature(ProfileOptions).replace(  # type: ignore[attr-defined]
    return_annotation="list[Profile]"
)


def profile_with(options: ProfileOptions, *, cache_dir_name: str = "cache_dir") -> list[Profile]:
    """`profile_model` with its arguments in one `ProfileOptions` (poplar-profile's way in); collective.
    `cache_dir_name`: what an error names ``options.cache_dir`` (poplar-profile: ``--output-dir``)."""
    # Every batch measured (layer profiles' too) has the tokens per sample the profiles are keyed with.
    options = _with_checked_lengths(options)
    # Read once here: layer profiles take `options` as given, after `_checked` has read them (a generator, empty).
    sizes = options.micro_batch_sizes
    options = dataclasses.replace(
        options, zero_stages=tuple(options.zero_stages), micro_batch_sizes=None if sizes is None else tuple(sizes)
    )
    # Checked before anything is measured, layer profiles too (they take `options` as given: a pipeline's
    # loss_fn None is its own loss, not `default_loss`).
    checked, settings = _checked(options)
    device = join_job()
    # A cache that has everything is read from a directory rank 0 cannot write; anything to measure is refused.
    writable = WritableBeforeMeasuring(checked.cache_dir, rank=process_group_rank()[0], name=cache_dir_name)
    if options.per_layer is not False:
        from poplar_ext.profiler.layers import is_pipeline_model, pipeline_loss
        from poplar_ext.profiler.per_layer import profile_layers

        model = options.model_factory()
        pipeline_model = is_pipeline_model(model)
        if pipeline_model or options.per_layer:
            profile_layers(options, model=model, writable=writable)
        if pipeline_model:
            if options.measure_network:  # what prices the plan's transfers and all-reduces, as for any model
                with _measuring_process(device), _short_timeouts(checked, device):
                    _job_network(checked, build_layout(checked.cluster, device, bf16=_bf16(checked)), writable)
            return []  # a pipeline model has no whole-model profile
        # The session's first engine takes it: the model is built no more often than before.
        built, factory = [model], options.model_factory
        checked = dataclasses.replace(checked, model_factory=lambda: built.pop() if built else factory())
        if options.per_layer:
            # An nn.Sequential profiled per layer too: its whole-model micro-steps take the layers' batch,
            # ``(inputs, labels)``, and loss, ``loss_fn(outputs, labels)`` (None: the output summed), as they do.
            checked = dataclasses.replace(
                checked, loss_fn=lambda engine, batch: pipeline_loss(engine(batch[0]), batch[1], options.loss_fn)
            )
    with _measuring_process(device), _short_timeouts(checked, device) as timeouts:
        return _profile(checked, settings, device, writable, timeouts)


def _with_checked_lengths(options: ProfileOptions) -> ProfileOptions:
    """`options` whose ``make_batch``, at its first call, raises ValueError where micro-batch 1 has other tokens
    per sample (`poplar_ext.profiler.auto.sequence_length_of`) than ``sequence_length``: the profiles are keyed
    with it, and a job whose data has that length (micro-batch 1's, as the automatic mode reads a job's) would
    reuse times and memory measured on another. As given where no length is given; a batch without token ids
    is not checked."""
    expected, make_batch = options.sequence_length, options.make_batch
    if expected is None:
        return options
    checked_once: list[bool] = []

    def checked(micro_batch_size: int) -> Any:
        batch = make_batch(micro_batch_size)
        if not checked_once:
            found = sequence_length_of(batch if micro_batch_size == 1 else make_batch(1))
            if found is not None and found != expected:
                raise ValueError(
                    f"sequence_length: expected the micro-batches of make_batch (poplar-profile: --batch) to hold "
                    f"{expected} tokens per sample, as sequence_length (--sequence-length) keys the profiles, found "
                    f"{found} in make_batch(1); give the length its samples have"
                )
            checked_once.append(True)
        return batch

    return dataclasses.replace(options, make_batch=checked)


_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


@contextmanager
def _short_timeouts(options: ProfileOptions, device: torch.device) -> Iterator[ShortCollectiveTimeouts | None]:
    """`ProfileOptions.collective_timeout_s` on every group while profiling (None: the groups' own)."""
    if options.collective_timeout_s is None:
        yield None
        return
    if device.type == "cuda" and os.environ.get(_ASYNC_ERROR_HANDLING, "3") in ("0", "2"):
        # 0 leaves a timed-out collective hanging, 2 aborts it but keeps the process: then a rank
        # waiting for a lost one never exits and the launcher never ends the job.
        logger.warning(
            "%s=%s: a rank lost while profiling leaves the others waiting; unset it (torch's default, 3, "
            "tears a timed-out rank down)",
            _ASYNC_ERROR_HANDLING,
            os.environ[_ASYNC_ERROR_HANDLING],
        )
    with ShortCollectiveTimeouts(options.collective_timeout_s) as timeouts:
        yield timeouts


def _checked(options: ProfileOptions) -> tuple[ProfileOptions, MeasureSettings]:
    """`options` checked (ValueError naming the argument), the config read, the defaults filled in."""
    for name, value, modes in (
        ("activation_checkpointing", options.activation_checkpointing, CHECKPOINTING_MODES),
        ("optimizer_offload", options.optimizer_offload, OFFLOAD_MODES),
    ):
        if value not in modes:
            raise ValueError(f"{name}: expected one of {', '.join(map(repr, modes))}, found {value!r}")
    if options.collective_timeout_s is not None and not 0 < options.collective_timeout_s < math.inf:
        raise ValueError(f"collective_timeout_s: expected seconds > 0, or None, found {options.collective_timeout_s}")
    stages = tuple(options.zero_stages)
    if not stages or any(s not in ZERO_STAGES for s in stages) or len(set(stages)) != len(stages):
        raise ValueError(f"zero_stages: expected distinct stages among 0, 1, 2, 3, found {list(stages)}")
    if Path(options.cache_dir).exists() and not Path(options.cache_dir).is_dir():
        raise ValueError(f"cache_dir: expected a directory, found the file {options.cache_dir}")
    ds_config = read_ds_config(options.ds_config)
    if "optimizer" not in ds_config and options.optimizer_factory is None:
        # DeepSpeed would stop at its first engine with a bare "must provide optimizer" assertion.
        config_name = "ds_config" if isinstance(options.ds_config, Mapping) else str(options.ds_config)
        raise ValueError(f"{config_name}: {NO_OPTIMIZER}; add one, or pass optimizer_factory to profile_model")
    settings = MeasureSettings.of(options)
    checked = dataclasses.replace(
        options,
        ds_config=ds_config,
        zero_stages=tuple(sorted(stages)),
        micro_batch_sizes=settings.micro_batch_sizes,
        cache_dir=Path(options.cache_dir),
        loss_fn=options.loss_fn or default_loss,
    )
    return checked, settings


@contextmanager
def _measuring_process(device: torch.device) -> Iterator[None]:
    """On CPU: one torch thread and the steady allocator while measuring (see `profile_model`)."""
    if device.type != "cpu":
        yield
        return
    with cpu_threads(1):
        steady_cpu_allocator()
        try:
            yield
        finally:
            default_cpu_allocator()


@dataclass(frozen=True)
class _Run:
    """One engine's worth of measuring: a ZeRO stage with its memory levers."""

    zero_stage: int
    checkpointing: bool
    offload: bool

    @property
    def title(self) -> str:
        return f"ZeRO-{self.zero_stage}{levers_text(self.checkpointing, self.offload)}"


@dataclass(kw_only=True)
class _Session:
    """What the measurements of one `profile_with` call share, alike on every rank."""

    options: ProfileOptions
    """Checked (`_checked`): the config read, the stages sorted."""
    settings: MeasureSettings
    layout: JobLayout
    model: ModelInfo
    toggle: CheckpointingToggle | None
    """Switches activation checkpointing in a fresh model; None: the model cannot."""
    job_key: JobKey
    """What every profile of the session is keyed with (the versions and config fingerprint it records)."""
    offload_types: tuple[str, ...]
    """The device types also measured with the optimizer offloaded."""
    runs: tuple[_Run, ...]
    spare_models: list[torch.nn.Module]
    """The model built for the fingerprint, which the first engine takes instead of building one."""
    trainable_parameters: int
    """Parameters with gradients (and optimizer state), of `model`'s ``num_parameters``."""
    timeouts: ShortCollectiveTimeouts | None = None
    """The short collective timeouts, given to the groups each engine makes (None: not shortened)."""
    network: NetworkProfile | None = None
    """The network measured (or found) for this cluster: what the profiles' times hold is priced by it."""

    def model_states(self, run: _Run) -> ModelStates:
        """Every rank's static memory in `run` (`poplar_ext.search.model_states`)."""
        return model_states(
            num_parameters=self.model.num_parameters,
            num_trainable_parameters=self.trainable_parameters,
            zero_stage=run.zero_stage,
            world_size=self.layout.world_size,
            dtype=self.model.dtype,
            optimizer_bytes_per_parameter=optimizer_state_bytes(self.options.ds_config),
            optimizer_offload=run.offload,
        )

    def types_of(self, run: _Run) -> tuple[str, ...]:
        return self.offload_types if run.offload else self.layout.type_names

    def key(self, device_type: str, run: _Run) -> ProfileKey:
        return self.job_key.key(device_type, run.zero_stage, run.checkpointing, run.offload)

    def build_engine(self, run: _Run) -> Any:
        import deepspeed

        model = self.spare_models.pop() if self.spare_models else self.options.model_factory()
        if model_fingerprint(model) != self.model.fingerprint:
            raise ValueError("model_factory: expected the same architecture on every call, found another one")
        if self.toggle is not None:
            self.toggle(model, run.checkpointing)
        place_model(model, self.layout.device)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = None if self.options.optimizer_factory is None else self.options.optimizer_factory(params)
        config = stage_ds_config(self.options.ds_config, zero_stage=run.zero_stage, world_size=self.layout.world_size)
        if run.offload:
            offload_deepspeed_optimizer(config)
        try:
            engine, *_ = deepspeed.initialize(model=model, model_parameters=params, optimizer=optimizer, config=config)
        except AssertionError as exc:
            # DeepSpeed checks configs with assert; the same config fails alike on every rank.
            raise ValueError(f"ds_config: DeepSpeed refused it at ZeRO stage {run.zero_stage}: {exc}") from exc
        except ValueError as exc:
            # Its other refusals of the config (pydantic's validation errors, "Type fp16 is not supported on
            # your device"): named as the config's, on one line (pydantic's run over several).
            text = " ".join(str(exc).split())
            raise ValueError(f"ds_config: DeepSpeed refused it at ZeRO stage {run.zero_stage}: {text}") from exc
        if self.timeouts is not None:
            self.timeouts.apply()  # the engine's own groups (data parallel, ZeRO's)
        return engine


def _start_session(options: ProfileOptions, settings: MeasureSettings, layout: JobLayout) -> _Session:
    first_model = options.model_factory()
    toggle = checkpointing_toggle(first_model, options.checkpointing_toggle)
    if toggle is None and options.activation_checkpointing == "both":
        raise ValueError(cannot_checkpoint_message(first_model, wanted_by="activation_checkpointing 'both'"))
    variants = (False, True) if toggle is not None and options.activation_checkpointing != "off" else (False,)
    offload_types = _offload_types(layout, options.optimizer_offload)
    model = ModelInfo(
        name=options.model_name or type(first_model).__name__.lower(),
        fingerprint=model_fingerprint(first_model),
        num_parameters=sum(p.numel() for p in first_model.parameters()),
        dtype=training_dtype(options.ds_config),
        sequence_length=options.sequence_length,
    )
    return _Session(
        options=options,
        settings=settings,
        layout=layout,
        model=model,
        toggle=toggle,
        job_key=profiles_key(options, model.fingerprint, layout.world_size, layout.emulations),
        offload_types=offload_types,
        runs=tuple(
            _Run(stage, checkpointing, offload)
            for stage in options.zero_stages
            for checkpointing in variants
            for offload in ((False, True) if offload_types and stage in OFFLOAD_STAGES else (False,))
        ),
        spare_models=[first_model],
        trainable_parameters=sum(p.numel() for p in first_model.parameters() if p.requires_grad),
    )


def _offload_types(layout: JobLayout, optimizer_offload: str) -> tuple[str, ...]:
    """The device types `optimizer_offload` (``off``, ``smallest``, ``both``) measures offloaded too."""
    if optimizer_offload == "off":
        return ()
    least = min(layout.capacities_bytes[t] for t in layout.type_names)
    return tuple(t for t in layout.type_names if optimizer_offload == "both" or layout.capacities_bytes[t] == least)


def _bf16(options: ProfileOptions) -> bool:
    return training_dtype(options.ds_config) == "bfloat16"


def _job_network(options: ProfileOptions, layout: JobLayout, writable: WritableBeforeMeasuring) -> NetworkProfile:
    """The job's network file: cached for this cluster (unless `force`), else measured and written (collective)."""
    # On CPU, gloo stands in for a network it is not, and gigabyte messages would take minutes.
    sizes = (
        DEFAULT_MESSAGE_BYTES
        if layout.device.type == "cpu"
        else message_sizes(
            options.ds_config,
            element_bytes=DTYPE_BYTES[training_dtype(options.ds_config)],
            capacity_bytes=min(layout.capacities_bytes.values()),
        )
    )
    network, line = cached_or_measured_network(
        layout, options.cache_dir, force=options.force, message_bytes=sizes, before_measuring=writable
    )
    if layout.rank == 0 and options.progress is not None:
        options.progress(line)
    return network


def _profile(
    options: ProfileOptions,
    settings: MeasureSettings,
    device: torch.device,
    writable: WritableBeforeMeasuring,
    timeouts: ShortCollectiveTimeouts | None = None,
) -> list[Profile]:
    layout = build_layout(options.cluster, device, bf16=_bf16(options))
    network = _job_network(options, layout, writable) if options.measure_network else None
    session = dataclasses.replace(_start_session(options, settings, layout), timeouts=timeouts, network=network)
    keys = {(t, run): session.key(t, run) for run in session.runs for t in session.types_of(run)}
    # One measured with less than `settings` ask (a lower micro-batch limit, fewer micro-steps or sizes) is not.
    find = functools.partial(find_cached_profile, settings=settings)

    def on_miss(what: tuple[str, _Run], why: str) -> None:
        if options.progress is not None:
            t, run = what
            options.progress(f"{run.title}: {device_label(t, layout.emulations[t])} measured again: {why}")

    cached = broadcast_from_rank0(cached_on_rank0(layout.rank, options, keys, find, profile_to_dict, on_miss=on_miss))
    reporter = _ProgressReporter(
        sink=options.progress,
        layout=layout,
        stages_left=sum(1 for run in session.runs if _to_measure(session, run, cached)),
    )
    if reporter.stages_left:  # agreed: `cached` is rank 0's
        writable()
    produced = dict(cached)
    for run in session.runs:
        produced.update(_measure_run(session, run, cached, reporter))
    produced = broadcast_from_rank0(produced if layout.rank == 0 else None)
    return [
        profile_from_dict(produced[(t, run)], source=f"<profile {t} {run.title}>")
        for run in session.runs
        for t in layout.type_names
        if (t, run) in produced
    ]


_Produced = dict[tuple[str, _Run], dict[str, Any]]
"""Profiles (as dicts, sent between ranks) by device type and run."""


def _to_measure(session: _Session, run: _Run, cached: _Produced) -> tuple[str, ...]:
    return tuple(t for t in session.types_of(run) if (t, run) not in cached)


def _measure_run(session: _Session, run: _Run, cached: _Produced, reporter: _ProgressReporter) -> _Produced:
    """The run's profiles not in the cache, measured in one engine (collective); rank 0 stores them."""
    layout = session.layout
    for t in session.types_of(run):
        if (t, run) in cached:
            reporter.say(f"{run.title}: {device_label(t, layout.emulations[t])} from the cache (not measured)")
    to_measure = _to_measure(session, run, cached)
    if not to_measure:
        return {}
    too_small = _types_too_small(session, run)
    if too_small:
        return _skipped_run(session, run, to_measure, too_small, reporter)
    reporter.stage_started(run.title, to_measure)
    started = time.monotonic()
    results = StageMeasurement(
        layout=layout,
        zero_stage=run.zero_stage,
        types_to_measure=to_measure,
        build_engine=lambda _stage: session.build_engine(run),  # _stage is run.zero_stage
        make_batch=session.options.make_batch,
        loss_fn=session.options.loss_fn,
        settings=session.settings,
        on_trial=reporter.trial,
    ).run()
    reporter.stage_finished()
    stage_seconds = time.monotonic() - started
    produced: _Produced = {}
    for t, result in results.items():
        if not result.complete:
            reporter.say(f"{run.title}: {t} not profiled: {result.probe.get('abandoned')}")
            continue
        profile = _make_profile(result, session, run, stage_seconds=stage_seconds)
        produced[(t, run)] = profile_to_dict(profile)
        if layout.rank == 0:
            path = store_profile(session.options.cache_dir, profile)
            fits_nothing = "" if profile.max_micro_batch_size else _fits_nothing(result.probe, layout, t)
            reporter.say(
                f"{run.title}: {t}: largest micro-batch {profile.max_micro_batch_size}, "
                f"{len(profile.samples)} sizes, {stage_seconds:.1f} s -> {path}{fits_nothing}"
                + _sizes_above(session.settings.micro_batch_sizes, profile.max_micro_batch_size)
            )
    return produced


def _sizes_above(asked: Iterable[int] | None, largest: int) -> str:
    """For a profile's progress line: the sizes ``--micro-batch-sizes`` asked for above the type's largest
    micro-batch (none measured: they do not fit, or pass ``--max-micro-batch-size``), else ''."""
    above = sorted(b for b in asked or () if b > largest)
    if not above:
        return ""
    return f"; --micro-batch-sizes {','.join(map(str, above))} above its largest micro-batch, not measured"


def _fits_nothing(probe: dict[str, Any], layout: Any, device_type: str) -> str:
    """Why a type's profile fits no micro-batch, for its progress line (the profile's probe holds the figures)."""
    capacity_gib = layout.capacities_bytes[device_type] / 2**30
    failing, peak = probe.get("smallest_failing"), probe.get("optimizer_step_peak_memory_bytes")
    why = f"micro-batch {failing} ran out of memory" if failing else "its warm-up ran out of memory"
    step = f", the optimizer step alone peaking at {peak / 2**30:.2f} GiB" if peak else ""
    return f" (no micro-batch fits its {capacity_gib:.2f} GiB: {why}{step})"


def _types_too_small(session: _Session, run: _Run) -> dict[str, str]:
    """Real device type -> why it cannot hold `run`'s model states (every type: each rank builds the engine)."""
    # Decided alike on every rank from the agreed capacities, before an engine whose build could run out of
    # memory on some ranks only; emulated types are left to the measurement.
    states = session.model_states(run)
    layout = session.layout
    return {
        t: shortfall(states, capacity_bytes=layout.capacities_bytes[t])
        for t in layout.type_names
        if layout.emulations[t] is None and cannot_hold(states, capacity_bytes=layout.capacities_bytes[t])
    }


def _skipped_run(
    session: _Session, run: _Run, to_measure: tuple[str, ...], too_small: dict[str, str], reporter: _ProgressReporter
) -> _Produced:
    """A run no engine is built for: a type too small gets a profile that fits nothing (its reason in
    ``largest_micro_batch_probe.skipped``); the other types are not profiled."""
    reason = "; ".join(f"{t}: {why}" for t, why in too_small.items())
    reporter.stages_left -= 1  # counted among the stages to measure
    reporter.say(f"{run.title}: skipped, no engine built: {reason}")
    produced: _Produced = {}
    for t in to_measure:
        if t not in too_small:
            reporter.say(f"{run.title}: {t} not profiled: skipped for {', '.join(too_small)}")
            continue
        result = TypeStageResult(
            device_type=t,
            complete=True,
            max_micro_batch_size=0,
            samples=(),
            optimizer_step_time_s=0.0,
            probe={"skipped": too_small[t], "model_states_bytes": session.model_states(run).device_bytes},
        )
        profile = _make_profile(result, session, run, stage_seconds=0.0)
        if session.layout.rank == 0:
            store_profile(session.options.cache_dir, profile)
        produced[(t, run)] = profile_to_dict(profile)
    return produced


def _make_profile(result: TypeStageResult, session: _Session, run: _Run, *, stage_seconds: float) -> Profile:
    layout, settings, job_key = session.layout, session.settings, session.job_key
    t = result.device_type
    emulation = layout.emulations[t]
    cuda = layout.device.type == "cuda"
    window = compute_window(layout.device.type, run.zero_stage)
    profile = Profile(
        device_type=t,
        memory_capacity_bytes=layout.capacities_bytes[t],
        zero_stage=run.zero_stage,
        world_size=layout.world_size,
        model=session.model,
        max_micro_batch_size=result.max_micro_batch_size,
        samples=result.samples,
        optimizer_step_time_s=result.optimizer_step_time_s,
        emulated=without_drift(emulation),
        activation_checkpointing=run.checkpointing,
        optimizer_offload=run.offload,
        measured_with={
            **measured_provenance(),
            "torch": job_key.torch_version,
            "deepspeed": job_key.deepspeed_version,
            "host": layout.hosts[t],
            "hardware": layout.hardware[t],
            "device": "emulated" if emulation is not None else "real",
            "ds_config_fingerprint": job_key.ds_config_fingerprint,
            "timing": "CUDA events, median"
            if cuda
            else f"the computing thread's CPU time{EMULATED_TIMES if emulation is not None else ''}, median",
            # Which clock, where the window ends, whether types ran at once (compute_window); the
            # cost model subtracts the micro-step's communication only where the window holds it.
            "compute_window": window.to_dict(),
            "micro_step_times_include_communication": window.includes_communication,
            "memory": "torch.cuda.max_memory_reserved (allocated plus fragmentation); the CUDA context and NCCL "
            "buffers measured at start are off the capacity"
            if cuda
            else "process VmHWM",
            "warmup_micro_steps": settings.warmup_micro_steps,
            "repeats": settings.repeats,
            "ranks_measured": len(layout.ranks_of(t)),
            "largest_micro_batch_probe": result.probe,
            "stage_profiling_time_s": round(stage_seconds, 3),
        },
    )
    if session.network is None or not result.max_micro_batch_size:
        return profile  # no network to price it by (the cost model prices the job's), or nothing measured
    # What its times hold over the network measured with it, for a job that prices another network.
    return dataclasses.replace(profile, included_communication=included_communication(profile, session.network))


def time_micro_steps(
    options: ProfileOptions,
    sizes: Mapping[str, list[int]],
    *,
    zero_stage: int,
    activation_checkpointing: bool | Mapping[str, bool] = False,
    optimizer_offload: bool = False,
) -> dict[str, dict[int, float]]:
    """Device type -> micro-batch size -> median micro-step time over its ranks, for calibration (collective; the
    same dict on every rank). One engine at `zero_stage` with the given levers (`activation_checkpointing` per type,
    as a plan's, or one for all), built as profiling builds it; timed as training runs them where no collective is
    waited in (`calibration.timed_as_training`), else as profiling times them."""
    options, settings = _checked(dataclasses.replace(options, zero_stages=(zero_stage,)))
    device = join_job()
    settings = dataclasses.replace(settings, as_training=timed_as_training(zero_stage))
    with _measuring_process(device):
        layout = build_layout(options.cluster, device, bf16=_bf16(options))
        session = _start_session(options, settings, layout)
        if isinstance(activation_checkpointing, Mapping):
            activation_checkpointing = activation_checkpointing.get(layout.my_type, False)
        run = _Run(zero_stage, activation_checkpointing, optimizer_offload)
        wanted = {t: sorted(set(v)) for t, v in sizes.items() if t in layout.type_names and v}
        mine = StageMeasurement(
            layout=layout,
            zero_stage=zero_stage,
            types_to_measure=tuple(wanted),
            build_engine=lambda _stage: session.build_engine(run),
            make_batch=options.make_batch,
            loss_fn=options.loss_fn,
            settings=settings,
        ).time_sizes(wanted)
        gathered = gather_objects((layout.my_type, mine))
    by_type: dict[str, dict[int, list[float]]] = {}
    for device_type, times in gathered:
        for size, time_s in times.items():
            by_type.setdefault(device_type, {}).setdefault(size, []).append(time_s)
    return {t: {size: statistics.median(v) for size, v in per.items()} for t, per in by_type.items()}
