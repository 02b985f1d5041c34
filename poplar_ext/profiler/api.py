"""`profile_model`: measure every device type of the job at every requested ZeRO stage.

Run by every rank of the job (deepspeed launcher, torchrun), like training. For each
stage it reuses the cached profiles whose keys match (`poplar_ext.profiler.cache`)
and measures the others inside one DeepSpeed engine per stage
(`poplar_ext.profiler.measure`). Rank 0 alone reads and writes the cache directory
(atomically) and sends the profiles to the others, so every rank returns the same list.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from poplar_ext.activation_checkpointing import (
    CheckpointingToggle,
    cannot_checkpoint_message,
    checkpointing_toggle,
)
from poplar_ext.collectives import broadcast_from_rank0
from poplar_ext.hardware.cpu_process import cpu_threads
from poplar_ext.hardware.devices import join_job
from poplar_ext.hardware.emulation import device_label
from poplar_ext.hardware.memory import default_cpu_allocator, steady_cpu_allocator
from poplar_ext.optimizer_offload import OFFLOAD_MODES, offload_deepspeed_optimizer
from poplar_ext.profiler.cache import (
    ProfileKey,
    ds_config_fingerprint,
    find_cached_profile,
    store_profile,
)
from poplar_ext.profiler.fingerprint import model_fingerprint
from poplar_ext.profiler.layout import JobLayout, build_layout
from poplar_ext.profiler.measure import (
    LossFn,
    MeasureSettings,
    StageMeasurement,
    TrialEvent,
    TypeStageResult,
    default_loss,
    stage_ds_config,
)
from poplar_ext.profiler.network import cached_or_measured_network
from poplar_search.formats import (
    ZERO_STAGES,
    Cluster,
    ModelInfo,
    Profile,
    profile_from_dict,
    profile_to_dict,
    read_json,
)
from poplar_search.levers import OFFLOAD_STAGES, levers_text

Progress = Callable[[str], None]

CHECKPOINTING_MODES = ("auto", "both", "off")
"""`profile_model`'s ``activation_checkpointing``: both variants where the model can do
both, both or an error, or only without checkpointing."""


def log_progress(line: str) -> None:
    """The default progress sink: one line on stderr (called on rank 0 only)."""
    print(f"[poplar-profile] {line}", file=sys.stderr, flush=True)


def training_dtype(ds_config: Mapping[str, Any]) -> str:
    """``bfloat16``, ``float16`` or ``float32``, as the DeepSpeed config trains."""
    for section, dtype in (("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp16", "float16")):
        value = ds_config.get(section)
        if isinstance(value, Mapping) and value.get("enabled", False):
            return dtype
    return "float32"


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

    def say(self, line: str) -> None:
        if self.sink is not None and self.layout.rank == 0:
            self.sink(line)

    def stage_started(self, stage: int, types: Iterable[str], *, title: str | None = None) -> None:
        if not self.started_at:
            self.started_at = time.monotonic()
        self.stages_left -= 1
        self.stage_trials = 0
        labels = ", ".join(device_label(t, self.layout.emulations[t]) for t in types)
        self.say(f"{title or f'ZeRO-{stage}'}: measuring {labels}")

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
        sizes = ", ".join(f"{t} micro-batch {b}" for t, b in event.sizes.items())
        self.say(f"ZeRO-{event.zero_stage} {event.phase}: {sizes}; about {left_s:.0f} s left")


def _validate(
    zero_stages: Iterable[int],
    cache_dir: str | os.PathLike[str],
    activation_checkpointing: str,
    optimizer_offload: str = "off",
) -> tuple[int, ...]:
    for name, value, modes in (
        ("activation_checkpointing", activation_checkpointing, CHECKPOINTING_MODES),
        ("optimizer_offload", optimizer_offload, OFFLOAD_MODES),
    ):
        if value not in modes:
            raise ValueError(f"{name}: expected one of {', '.join(map(repr, modes))}, found {value!r}")
    stages = tuple(zero_stages)
    if not stages or any(s not in ZERO_STAGES for s in stages) or len(set(stages)) != len(stages):
        raise ValueError(f"zero_stages: expected distinct stages among 0, 1, 2, 3, found {list(stages)}")
    if Path(cache_dir).exists() and not Path(cache_dir).is_dir():
        raise ValueError(f"cache_dir: expected a directory, found the file {cache_dir}")
    return tuple(sorted(stages))


def profile_model(
    *,
    model_factory: Callable[[], torch.nn.Module],
    make_batch: Callable[[int], Any],
    ds_config: Mapping[str, Any] | str | os.PathLike[str],
    cluster: Cluster | str | os.PathLike[str] | None = None,
    zero_stages: Iterable[int] = ZERO_STAGES,
    micro_batch_sizes: Iterable[int] | None = None,
    cache_dir: str | os.PathLike[str] = "profiles",
    force: bool = False,
    progress: Progress | None = log_progress,
    loss_fn: LossFn | None = None,
    optimizer_factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
    model_name: str | None = None,
    sequence_length: int | None = None,
    warmup_micro_steps: int = 1,
    repeats: int = 3,
    micro_batch_size_limit: int = 256,
    measure_network: bool = True,
    activation_checkpointing: str = "auto",
    checkpointing_toggle: CheckpointingToggle | None = None,
    optimizer_offload: str = "off",
) -> list[Profile]:
    """Profiles of every device type in the job at every stage of `zero_stages` (collective).

    Every rank calls it with the same arguments. For each (device type, stage) a
    cached profile in `cache_dir` with the same keys is returned as it is (unless
    `force`); the others are measured and written there by rank 0. Returns the same
    list, stage by stage in job order of device types, on every rank.

    model_factory: builds a fresh model (called once per stage measured, plus once
        for the fingerprint); its forward returns the loss unless `loss_fn` is given.
    make_batch: ``make_batch(micro_batch_size)`` -> one micro-batch (a tensor, tuple
        or dict of tensors; moved to the device here). It is never called when every
        profile comes from the cache.
    ds_config: the DeepSpeed config (dict or JSON file); batch sizes and the stage
        are set per engine, everything else (dtype, optimizer, offload) is used as is.
    cluster: the cluster description, or its file (read by rank 0 alone), or None to
        discover it from the hardware: device type of every rank, and the emulation of
        emulated types. Real types must be what the hardware reports.
    micro_batch_sizes: sizes for the time curve (default: 1, 2, 3, 4, 6, 8, 12, ...
        up to the largest that fits).
    progress: called on rank 0 with one line per trial (device type, stage, size,
        estimated time left); None for silence.
    loss_fn: ``loss_fn(engine, batch) -> loss`` when the model does not return it.
    optimizer_factory: builds the optimizer from the parameters when the DeepSpeed
        config has no ``optimizer`` section.
    model_name: for people and file names (default: the model's class name).
    sequence_length: tokens per sample, part of the cache key (None: not a sequence model).
    micro_batch_size_limit: the probe never tries a larger micro-batch.
    measure_network: also time the collectives ZeRO issues on the job's process group
        and write a network file beside the profiles (`poplar_ext.profiler.network`;
        reused from `cache_dir` when measured on the same cluster), with which the
        search prices communication.
    activation_checkpointing: ``"auto"`` (default) measures each type and stage
        without and with activation checkpointing where the model can do both (the
        built-in GPT, Hugging Face models, or `checkpointing_toggle` given), so the
        search can choose per device type; ``"both"`` does so or raises ValueError
        when the model cannot; ``"off"`` measures without only (half the time).
    checkpointing_toggle: ``toggle(model, enabled)`` for a model of your own
        (`poplar_ext.activation_checkpointing`); pass the same one to `initialize`.
    optimizer_offload: ``"off"`` (default) measures without only; ``"smallest"`` also
        measures the device type(s) with the least memory with the optimizer offloaded
        to the host (DeepSpeed's ``offload_optimizer``, at ZeRO stages 1-2), so the
        search can choose it for them; ``"both"`` does so for every type. An
        offloaded profile's memory leaves out the host's optimizer state and fp32
        master weights (on CPU, for an emulated type, they are taken off the
        measured peak); its boundary includes the host's optimizer step.

    On CPU it measures with one torch thread and glibc's steady allocator
    (`poplar_ext.hardware.cpu_process`), and on return gives the previous thread
    count back and leaves glibc's default thresholds (`memory.default_cpu_allocator`).
    """
    stages = _validate(zero_stages, cache_dir, activation_checkpointing, optimizer_offload)
    settings = MeasureSettings(
        warmup_micro_steps=warmup_micro_steps,
        repeats=repeats,
        micro_batch_size_limit=micro_batch_size_limit,
        micro_batch_sizes=None if micro_batch_sizes is None else tuple(micro_batch_sizes),
    )
    config_name = "ds_config"
    if not isinstance(ds_config, Mapping):
        config_name = str(ds_config)
        ds_config = read_json(ds_config)
        if not isinstance(ds_config, dict):
            raise ValueError(f"ds_config: expected a JSON object, found {type(ds_config).__name__}")
    if "optimizer" not in ds_config and optimizer_factory is None:
        # DeepSpeed would stop at its first engine with a bare "must provide optimizer" assertion.
        raise ValueError(
            f"{config_name}: optimizer: expected an 'optimizer' section (the optimizer training uses: its step is "
            "part of every profile), found none; add one, or pass optimizer_factory to profile_model"
        )
    cache_dir = Path(cache_dir)
    loss_fn = loss_fn or default_loss

    device = join_job()
    with _measuring_process(device):
        return _profile(
            model_factory=model_factory,
            make_batch=make_batch,
            ds_config=ds_config,
            cluster=cluster,
            stages=stages,
            settings=settings,
            cache_dir=cache_dir,
            force=force,
            progress=progress,
            loss_fn=loss_fn,
            optimizer_factory=optimizer_factory,
            model_name=model_name,
            sequence_length=sequence_length,
            device=device,
            measure_network=measure_network,
            activation_checkpointing=activation_checkpointing,
            toggle=checkpointing_toggle,
            optimizer_offload=optimizer_offload,
        )


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


def _profile(
    *,
    model_factory: Callable[[], torch.nn.Module],
    make_batch: Callable[[int], Any],
    ds_config: Mapping[str, Any],
    cluster: Cluster | str | os.PathLike[str] | None,
    stages: tuple[int, ...],
    settings: MeasureSettings,
    cache_dir: Path,
    force: bool,
    progress: Progress | None,
    loss_fn: LossFn,
    optimizer_factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None,
    model_name: str | None,
    sequence_length: int | None,
    device: torch.device,
    measure_network: bool,
    activation_checkpointing: str = "auto",
    toggle: CheckpointingToggle | None = None,
    optimizer_offload: str = "off",
) -> list[Profile]:
    import deepspeed

    layout = build_layout(cluster, device)
    if measure_network:
        _, line = cached_or_measured_network(layout, cache_dir, force=force)
        if layout.rank == 0 and progress is not None:
            progress(line)

    first_model: list[torch.nn.Module] = [model_factory()]
    fingerprint = model_fingerprint(first_model[0])
    switch = checkpointing_toggle(first_model[0], toggle)
    if switch is None and activation_checkpointing == "both":
        raise ValueError(cannot_checkpoint_message(first_model[0], wanted_by="activation_checkpointing 'both'"))
    variants = (False, True) if switch is not None and activation_checkpointing != "off" else (False,)
    model_info = ModelInfo(
        name=model_name or type(first_model[0]).__name__.lower(),
        fingerprint=fingerprint,
        num_parameters=sum(p.numel() for p in first_model[0].parameters()),
        dtype=training_dtype(ds_config),
        sequence_length=sequence_length,
    )
    versions = {"torch": torch.__version__, "deepspeed": deepspeed.__version__}
    config_fp = ds_config_fingerprint(ds_config)

    if optimizer_offload == "both":
        offload_types = tuple(layout.type_names)
    elif optimizer_offload == "smallest":
        least = min(layout.capacities_bytes[t] for t in layout.type_names)
        offload_types = tuple(t for t in layout.type_names if layout.capacities_bytes[t] == least)
    else:
        offload_types = ()

    def key(device_type: str, stage: int, checkpointing: bool, offload: bool) -> ProfileKey:
        return ProfileKey(
            model_fingerprint=fingerprint,
            device_type=device_type,
            emulation=layout.emulations[device_type],
            zero_stage=stage,
            world_size=layout.world_size,
            dtype=model_info.dtype,
            sequence_length=sequence_length,
            torch_version=versions["torch"],
            deepspeed_version=versions["deepspeed"],
            ds_config_fingerprint=config_fp,
            activation_checkpointing=checkpointing,
            optimizer_offload=offload,
        )

    runs = [
        (stage, checkpointing, offload)
        for stage in stages
        for checkpointing in variants
        for offload in ((False, True) if offload_types and stage in OFFLOAD_STAGES else (False,))
    ]

    def run_types(offload: bool) -> tuple[str, ...]:
        return offload_types if offload else tuple(layout.type_names)

    cached: dict[tuple[str, int, bool, bool], dict[str, Any]] = {}
    if layout.rank == 0 and not force:
        for stage, checkpointing, offload in runs:
            for t in run_types(offload):
                found = find_cached_profile(cache_dir, key(t, stage, checkpointing, offload))
                if found is not None:
                    cached[(t, stage, checkpointing, offload)] = profile_to_dict(found)
    cached = broadcast_from_rank0(cached)

    def build_engine(stage: int, checkpointing: bool, offload: bool) -> Any:
        model = first_model.pop() if first_model else model_factory()
        if model_fingerprint(model) != fingerprint:
            raise ValueError("model_factory: expected the same architecture on every call, found another one")
        if switch is not None:
            switch(model, checkpointing)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = None if optimizer_factory is None else optimizer_factory(params)
        config = stage_ds_config(ds_config, zero_stage=stage, world_size=layout.world_size)
        if offload:
            offload_deepspeed_optimizer(config)
        try:
            engine, *_ = deepspeed.initialize(
                model=model,
                model_parameters=params,
                optimizer=optimizer,
                config=config,
            )
        except AssertionError as exc:
            # DeepSpeed checks configs with assert; the same config fails alike on every rank.
            raise ValueError(f"ds_config: DeepSpeed refused it at ZeRO stage {stage}: {exc}") from exc
        return engine

    reporter = _ProgressReporter(
        sink=progress,
        layout=layout,
        stages_left=sum(1 for s, c, o in runs if any((t, s, c, o) not in cached for t in run_types(o))),
    )
    produced: dict[tuple[str, int, bool, bool], dict[str, Any]] = dict(cached)
    for stage, checkpointing, offload in runs:
        title = f"ZeRO-{stage}{levers_text(checkpointing, offload)}"
        for t in run_types(offload):
            if (t, stage, checkpointing, offload) in cached:
                reporter.say(f"{title}: {device_label(t, layout.emulations[t])} from the cache (not measured)")
        to_measure = tuple(t for t in run_types(offload) if (t, stage, checkpointing, offload) not in cached)
        if not to_measure:
            continue
        reporter.stage_started(stage, to_measure, title=title)
        started = time.monotonic()
        results = StageMeasurement(
            layout=layout,
            zero_stage=stage,
            types_to_measure=to_measure,
            build_engine=lambda stage, checkpointing=checkpointing, offload=offload: build_engine(
                stage, checkpointing, offload
            ),
            make_batch=make_batch,
            loss_fn=loss_fn,
            settings=settings,
            on_trial=reporter.trial,
        ).run()
        reporter.stage_finished()
        stage_seconds = time.monotonic() - started
        for t, result in results.items():
            if not result.complete:
                reporter.say(f"{title}: {t} not profiled: {result.probe.get('abandoned')}")
                continue
            profile = _make_profile(
                result,
                layout=layout,
                stage=stage,
                model=model_info,
                versions=versions,
                config_fp=config_fp,
                settings=settings,
                stage_seconds=stage_seconds,
                activation_checkpointing=checkpointing,
                optimizer_offload=offload,
            )
            if layout.rank == 0:
                path = store_profile(cache_dir, profile)
                reporter.say(
                    f"{title}: {t}: largest micro-batch {profile.max_micro_batch_size}, "
                    f"{len(profile.samples)} sizes, {stage_seconds:.1f} s -> {path}"
                )
            produced[(t, stage, checkpointing, offload)] = profile_to_dict(profile)
    produced = broadcast_from_rank0(produced if layout.rank == 0 else None)
    return [
        profile_from_dict(produced[(t, s, c, o)], source=f"<profile {t} ZeRO-{s}{levers_text(c, o)}>")
        for s, c, o in runs
        for t in layout.type_names
        if (t, s, c, o) in produced
    ]


def _make_profile(
    result: TypeStageResult,
    *,
    layout: JobLayout,
    stage: int,
    model: ModelInfo,
    versions: dict[str, str],
    config_fp: str,
    settings: MeasureSettings,
    stage_seconds: float,
    activation_checkpointing: bool = False,
    optimizer_offload: bool = False,
) -> Profile:
    t = result.device_type
    emulation = layout.emulations[t]
    cuda = layout.device.type == "cuda"
    return Profile(
        device_type=t,
        memory_capacity_bytes=layout.capacities_bytes[t],
        zero_stage=stage,
        world_size=layout.world_size,
        model=model,
        max_micro_batch_size=result.max_micro_batch_size,
        samples=result.samples,
        optimizer_step_time_s=result.optimizer_step_time_s,
        # Measured at the emulation's own slowdown: a drift schedule is training's, not the profile's.
        emulated=None if emulation is None else dataclasses.replace(emulation, slowdown_schedule=()),
        activation_checkpointing=activation_checkpointing,
        optimizer_offload=optimizer_offload,
        measured_with={
            "source": "measured",
            **versions,
            "python": platform.python_version(),
            "host": layout.hosts[t],
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "hardware": layout.hardware[t],
            "device": "emulated" if emulation is not None else "real",
            "ds_config_fingerprint": config_fp,
            "timing": "CUDA events, median"
            if cuda
            else "the computing thread's CPU time (x the emulated slowdown), median",
            # CUDA events see the collectives of a micro-step; a CPU rank's thread time does not.
            "micro_step_times_include_communication": cuda,
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


__all__ = ["log_progress", "profile_model", "training_dtype"]
