"""The measurement loop: one DeepSpeed engine per ZeRO stage, trials agreed by all ranks (collective). See
profiles/README.md ("How profiles are measured") and docs/profiling.md."""

from __future__ import annotations

import copy
import gc
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import torch

from poplar_ext.collectives import agree_max, barrier, gather_objects
from poplar_ext.elastic import USER_ERRORS
from poplar_ext.hardware.compute_clock import ComputeSpan, ComputeWindow, compute_window
from poplar_ext.hardware.emulation import (
    ComputeSlowdown,
    EmulatedOutOfMemoryError,
    check_emulated_memory,
    host_resident_optimizer_bytes,
)
from poplar_ext.hardware.memory import MeasuredPeak, allocated_device_bytes, is_out_of_memory, release_memory
from poplar_ext.hardware.optimizer_window import optimizer_compute_window
from poplar_ext.plan.formats import Sample, read_json
from poplar_ext.profiler.layout import JobLayout
from poplar_ext.profiler.options import LossFn, ProfileOptions
from poplar_ext.profiler.sizes import LargestFitSearch, sweep_sizes

# Outcome of one trial on one rank; agreement takes the maximum over ranks.
_OK, _EMULATED_OOM, _REAL_OOM, _ERROR = range(4)

# Large enough that the engine never reaches an accumulation boundary on its own:
# the profiler places every boundary itself with set_gradient_accumulation_boundary.
_NOMINAL_ACCUMULATION_STEPS = 1_000_000


class _StepWindow:
    """Wall and compute time of the optimizer step's compute part (`optimizer_compute_window`)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.wall_s, self.cpu_s = device, 0.0, 0.0
        self._started = (0.0, 0.0)

    def start(self) -> None:
        self._synchronize()  # kernels queued before the step (the gradients' last reduction) are not its time
        self._started = (time.perf_counter(), time.thread_time())

    def stop(self) -> None:
        self._synchronize()
        wall, cpu = self._started
        self.wall_s += time.perf_counter() - wall
        self.cpu_s += time.thread_time() - cpu

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@dataclass(frozen=True, kw_only=True)
class MeasureSettings:
    """How much to measure (`ProfileOptions`' fields of the same names, whose defaults these are)."""

    warmup_micro_steps: int = ProfileOptions.warmup_micro_steps
    """Unmeasured micro-steps at each size before the measured ones."""
    repeats: int = ProfileOptions.repeats
    """Measured micro-steps per size (their median is the sample's time)."""
    micro_batch_size_limit: int = ProfileOptions.micro_batch_size_limit
    """Never try a micro-batch larger than this (the probe stops there)."""
    micro_batch_sizes: tuple[int, ...] | None = None
    """Sizes for the time curve; None: a dense geometric set up to the largest that fits."""
    memory_margin: float = 0.1
    """Fraction of a real device's memory kept free where probing past the prediction is unsafe."""
    as_training: bool = False
    """Time each micro-step as training runs it, an emulated rank padded to its slowdown and timed by wall
    clock, so that waiting for a core counts (calibration). False: own compute time x slowdown (profiling)."""

    def __post_init__(self) -> None:
        for name, minimum in (("warmup_micro_steps", 0), ("repeats", 1), ("micro_batch_size_limit", 1)):
            if getattr(self, name) < minimum:
                raise ValueError(f"{name}: expected an integer >= {minimum}, found {getattr(self, name)}")
        if self.micro_batch_sizes is not None and (
            not self.micro_batch_sizes or any(b < 1 for b in self.micro_batch_sizes)
        ):
            raise ValueError(
                f"micro_batch_sizes: expected a non-empty list of integers >= 1, found {list(self.micro_batch_sizes)}"
            )
        if not 0.0 <= self.memory_margin < 1.0:
            raise ValueError(f"memory_margin: expected a fraction in [0, 1), found {self.memory_margin}")

    @classmethod
    def of(cls, options: ProfileOptions) -> MeasureSettings:
        """The settings `options` ask for (checked: ValueError naming the field)."""
        sizes = options.micro_batch_sizes
        return cls(
            warmup_micro_steps=options.warmup_micro_steps,
            repeats=options.repeats,
            micro_batch_size_limit=options.micro_batch_size_limit,
            micro_batch_sizes=None if sizes is None else tuple(sizes),
        )


def measured_provenance() -> dict[str, Any]:
    """What every ``measured_with`` says: measured, with this Python, now."""
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return {"source": "measured", "python": platform.python_version(), "date": now}


def stage_ds_config(ds_config: Mapping[str, Any], *, zero_stage: int, world_size: int) -> dict[str, Any]:
    """The user's DeepSpeed config for one profiling engine at `zero_stage`: nominal batch keys (DeepSpeed
    never inspects the batch tensor), ``memory_breakdown`` off (it resets the CUDA peak counters itself)."""
    config = copy.deepcopy(dict(ds_config))
    config.pop("poplar", None)
    zero = dict(config.get("zero_optimization") or {})
    zero["stage"] = zero_stage
    config["zero_optimization"] = zero
    config["train_micro_batch_size_per_gpu"] = 1
    config["gradient_accumulation_steps"] = _NOMINAL_ACCUMULATION_STEPS
    config["train_batch_size"] = _NOMINAL_ACCUMULATION_STEPS * world_size
    config["memory_breakdown"] = False
    config["wall_clock_breakdown"] = False
    config["steps_per_print"] = 2**31 - 1
    return config


def read_ds_config(ds_config: Mapping[str, Any] | str | os.PathLike[str]) -> Mapping[str, Any]:
    """The DeepSpeed config: a mapping as it is, a file read; ValueError unless a JSON object."""
    if isinstance(ds_config, Mapping):
        return ds_config
    data = read_json(ds_config)
    if not isinstance(data, dict):
        raise ValueError(f"ds_config: expected a JSON object, found {type(data).__name__}")
    return data


def training_dtype(ds_config: Mapping[str, Any]) -> str:
    """``bfloat16``, ``float16`` or ``float32``, as the DeepSpeed config trains."""
    for section, dtype in (("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp16", "float16")):
        value = ds_config.get(section)
        if isinstance(value, Mapping) and value.get("enabled", False):
            return dtype
    return "float32"


def loss_of(output: Any) -> torch.Tensor:
    """The loss in a model's output: its ``.loss`` (Hugging Face), its ``"loss"`` entry, else the output."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    return output if loss is None else loss


def default_loss(engine: Any, batch: Any) -> torch.Tensor:
    """The loss (`loss_of`) of ``engine(**batch)``, ``engine(*batch)`` or ``engine(batch)``; a TypeError
    says to pass ``loss_fn=`` where the model cannot be called so."""
    if isinstance(batch, Mapping):
        call, shape = (lambda: engine(**batch)), f"model(**batch) with the keys {', '.join(map(str, batch))}"
    elif isinstance(batch, (tuple, list)):
        call, shape = (lambda: engine(*batch)), f"model(*batch) with {len(batch)} items"
    else:
        call, shape = (lambda: engine(batch)), "model(batch)"
    advice = (
        "pass loss_fn=lambda engine, batch: loss to poplar_ext.initialize, or to profile_model; under accelerate, to "
        "PoplarAccelerator; poplar-profile: --loss MODULE:FN"
    )
    try:
        loss = loss_of(call())
    except TypeError as exc:
        raise TypeError(
            f"{exc} (poplar-ext called {shape}, as it does by default to profile and time micro-steps; for a model "
            f"that takes its batch otherwise, or returns no loss, {advice})"
        ) from exc
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:  # DeepSpeed's backward would assert it: a traceback
        found = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"loss_fn: expected the model's output from {shape} to be a one-element loss (or to hold one as "
            f".loss), found {found}; for a model that returns no loss, {advice}"
        )
    return loss


def sequence_length_of(batch: Any) -> int | None:
    """Tokens per sample of a micro-batch, for the cache key (None: it holds no token ids): the last dimension of a
    mapping's ``input_ids`` (Hugging Face's), of the first of a tuple's tensors (inputs, then targets), or that of a
    token tensor alone less one: the built-in GPT's samples end with the last input's next-token target
    (``sequence_length + 1`` tokens, counted as poplar-profile's ``--sequence-length`` counts them)."""
    if isinstance(batch, Mapping):
        tokens, targets_in_it = batch.get("input_ids"), 0
    elif isinstance(batch, (tuple, list)) and batch:
        tokens, targets_in_it = batch[0], 0
    else:
        tokens, targets_in_it = batch, 1
    if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int64, torch.int32) or tokens.dim() < 1:
        return None
    return tokens.shape[-1] - targets_in_it or None


def map_tensors(function: Callable[[torch.Tensor], Any], value: Any, *, walk_dicts: bool = True) -> Any:
    """`value` with `function` applied to every tensor in it, nested in tuples, lists and (`walk_dicts`, made plain
    dicts) mappings; layer profiling leaves a mapping untouched, its type and its tensors' graphs kept."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if walk_dicts and isinstance(value, Mapping):
        return {k: map_tensors(function, v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(function, v, walk_dicts=walk_dicts) for v in value)
    return value


def move_to_device(batch: Any, device: torch.device) -> Any:
    """`batch` (tensors, possibly nested in tuples, lists, dicts) on `device`."""
    return map_tensors(lambda t: t.to(device), batch)


@dataclass(kw_only=True)
class TypeStageResult:
    """What was measured for one device type at one stage (identical on every rank)."""

    device_type: str
    complete: bool
    """False when the stage was abandoned before this type was fully measured."""
    max_micro_batch_size: int
    samples: tuple[Sample, ...]
    optimizer_step_time_s: float
    probe: dict[str, Any]
    """How the largest micro-batch was found (provenance, for people)."""


@dataclass(frozen=True, kw_only=True)
class TrialEvent:
    """One finished trial, for progress reports."""

    zero_stage: int
    phase: str
    """``probe`` (finding the largest micro-batch) or ``sweep`` (filling in the curve)."""
    sizes: dict[str, int]
    """Micro-batch size tried per device type."""
    remaining_trials_estimate: int
    """Rough count of trials left at this stage."""
    fits: dict[str, bool] = field(default_factory=dict)
    """Per device type tried: the micro-step ran without running out of memory (agreed by every rank)."""
    peak_memory_bytes: dict[str, int] = field(default_factory=dict)
    """Per device type that fitted: the agreed peak memory of its micro-step."""
    memory_after_rebuild_bytes: int | None = None
    """After a real out-of-memory: CUDA's allocated bytes once the engine was rebuilt (None on CPU or
    when nothing was rebuilt)."""


@dataclass
class _TrialOutcome:
    flags: dict[str, int]
    peaks: dict[str, int]
    own_times_s: list[float]
    rebuild: bool


@dataclass
class _TypeRecord:
    search: LargestFitSearch
    own_times_s: dict[int, list[float]] = field(default_factory=dict)
    peaks: dict[int, int] = field(default_factory=dict)
    warmup_failed: bool = False
    """The optimizer step at micro-batch 1 already ran out of memory: nothing fits."""
    boundary_peak_bytes: int | None = None
    """Peak memory of that first optimizer step (it allocates the optimizer state)."""
    out_of_memory_in_sweep: set[int] = field(default_factory=set)
    """Sizes below the largest that fits that ran out of memory in the sweep (memory not monotonic in the
    size): recorded, so that a cache lookup does not take the profile for one that skipped them."""


@dataclass(kw_only=True, eq=False)
class StageMeasurement:
    """One ZeRO stage: the engine, the trials and the records, on one rank."""

    layout: JobLayout
    zero_stage: int
    types_to_measure: tuple[str, ...]
    build_engine: Callable[[int], Any]
    make_batch: Callable[[int], Any]
    loss_fn: LossFn
    settings: MeasureSettings
    on_trial: Callable[[TrialEvent], None] | None = None
    engine: Any = field(default=None, init=False)
    _batches: dict[int, Any] = field(default_factory=dict, init=False)
    error: Exception | None = field(default=None, init=False)
    """This rank's error that is no out-of-memory, as `every_ranks_error` takes it."""

    def _batch(self, size: int) -> Any:
        if size not in self._batches:
            # Only the last size is kept: batches of large sizes hold memory.
            self._batches = {size: move_to_device(self.make_batch(size), self.layout.device)}
        return self._batches[size]

    def _drop_engine(self) -> None:
        getattr(self.engine, "destroy", lambda: None)()
        self.engine = None
        self._batches = {}
        release_memory(self.layout.device)

    def _micro_step(self, size: int, *, boundary: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(boundary)
        loss = self.loss_fn(self.engine, self._batch(size))
        self.engine.backward(loss, scale_wrt_gas=False)
        del loss
        self.engine.step()

    def _timed_micro_step(self, size: int) -> float:
        """Own time of one non-boundary micro-step, in seconds (as training spends it with `as_training`)."""
        if self.settings.as_training:
            return self._micro_step_as_trained(size)
        return self._time_compute_window(size) * self._slowdown

    @property
    def _slowdown(self) -> float:
        """This rank's emulated slowdown (1.0 for a real device; never below 1)."""
        return max(1.0, getattr(self.layout.emulations[self.layout.my_type], "slowdown", 1.0))

    @property
    def window(self) -> ComputeWindow:
        """How this stage's micro-steps are timed on this job's device kind (`compute_window`)."""
        return compute_window(self.layout.device.type, self.zero_stage)

    def _time_compute_window(self, size: int) -> float:
        """Compute time of one non-boundary micro-step on the window's clock, up to DeepSpeed's gradient
        reduction where the window ends there: as in training, the reduction is communication, priced
        from the network file, not compute for the slowdown to multiply."""
        window = self.window
        span = ComputeSpan(window.clock)
        if not window.ends_at_reduction:
            span.start()
            self._micro_step(size, boundary=False)
            span.end()
            return span.elapsed_s()
        engine = self.engine
        reduce = engine.allreduce_gradients
        own = vars(engine).get("allreduce_gradients")  # an instance's own, or the class's method

        def reduce_after_compute(*args: Any, **kwargs: Any) -> Any:
            span.end()
            return reduce(*args, **kwargs)

        engine.allreduce_gradients = reduce_after_compute
        span.start()
        try:
            self._micro_step(size, boundary=False)
        finally:
            if own is None:
                del engine.allreduce_gradients  # the class's method again (no bound method kept on it)
            else:
                engine.allreduce_gradients = own
        span.end()  # a no-op once the reduction ended it
        return span.elapsed_s()

    def _micro_step_as_trained(self, size: int) -> float:
        emulation = self.layout.emulations[self.layout.my_type]
        padded = ComputeSlowdown(emulation, clock="cuda" if self.layout.device.type == "cuda" else "thread")
        started = time.perf_counter()
        with padded:
            self._micro_step(size, boundary=False)
        return time.perf_counter() - started

    def _device_bytes(self, peak_bytes: int) -> int:
        """The part of a measured peak the device holds: on CPU an emulated device's offloaded optimizer
        lives in the same process, off its emulated memory."""
        if self.layout.device.type != "cpu" or self.layout.emulations[self.layout.my_type] is None:
            return peak_bytes
        return max(1, peak_bytes - host_resident_optimizer_bytes(self.engine))

    def _classify(self, exc: Exception) -> int:
        if isinstance(exc, EmulatedOutOfMemoryError):
            return _EMULATED_OOM
        if is_out_of_memory(exc):
            return _REAL_OOM
        self.error = exc
        return _ERROR

    def _agree(self, flag: int, peak: int, measured: bool) -> tuple[dict[str, int], dict[str, int], bool]:
        """All ranks' flags and peaks per type (MAX); raises on every rank after a non-OOM error."""
        types = self.layout.type_names
        slot = types.index(self.layout.my_type)
        values = [0.0] * (2 * len(types) + 2)
        if measured:
            values[slot] = float(flag)
            values[len(types) + slot] = float(peak)
        else:
            # A rank running the unmeasured micro-batch 1: only failures that end the stage count.
            values[-2] = float(flag)
        values[-1] = float(flag == _ERROR)
        agreed = agree_max(values, self.layout.device)
        if agreed[-1]:
            errors, kind = every_ranks_error(self.error)
            raise kind(f"profiling failed: {errors}") from self.error
        flags = {t: int(agreed[i]) for i, t in enumerate(types)}
        peaks = {t: int(agreed[len(types) + i]) for i, t in enumerate(types)}
        flags["__unmeasured__"] = int(agreed[-2])
        return flags, peaks, any(v == _REAL_OOM for v in flags.values())

    def _start_engine(self, records: dict[str, _TypeRecord]) -> bool:
        """Build the engine and take one optimizer step at micro-batch 1 (collective): it allocates the
        optimizer state, in every later peak. A type whose boundary peak exceeds its emulated memory fits
        nothing. False when the stage cannot run in this job."""
        self.engine = self.build_engine(self.zero_stage)
        if not self._first_micro_step_fits():
            return False
        my_type = self.layout.my_type
        measured = my_type in records and not records[my_type].warmup_failed
        flag, peak = self._memory_micro_step(1, measured, boundary=True)
        flags, peaks, real_oom = self._agree(flag, peak, measured=True)
        for t, record in records.items():
            if flags[t] != _OK:
                record.warmup_failed = True
            if record.boundary_peak_bytes is None:
                record.boundary_peak_bytes = peaks[t]
        self.engine.set_gradient_accumulation_boundary(False)
        return not real_oom

    def _first_micro_step_fits(self) -> bool:
        """Micro-batch 1 without the boundary, agreed by all ranks: False when a rank ran out of memory."""
        # At ZeRO 0/1 it communicates nothing: a rank whose activations do not fit fails here and still reaches
        # the agreement, not in the boundary's forward while the others wait in its gradient reduction. (The first
        # boundary step's optimizer state comes after that reduction, so its out-of-memory is caught before the
        # agreement too.)
        flag = _OK
        try:
            self._micro_step(1, boundary=False)
        except Exception as exc:  # noqa: BLE001 - classified; every rank must reach the agreement
            flag = self._classify(exc)
        _, _, real_oom = self._agree(flag, 0, measured=False)
        return not real_oom

    def _trial(self, sizes: dict[str, int], *, memory: bool = True) -> _TrialOutcome:
        my_type = self.layout.my_type
        measured = my_type in sizes
        size = sizes.get(my_type, 1)
        # Python's cyclic collector runs when allocation counts say so, not when the
        # work does: a collection inside one timed micro-step and not another is noise.
        # The young generations hold the last trial's garbage; a full collection
        # would walk every object torch and DeepSpeed made (~0.3 s).
        gc.collect(1)
        gc.disable()
        try:
            flag, peak, own_times = self._micro_steps(size, measured, memory=memory)
        finally:
            gc.enable()
        flags, peaks, real_oom = self._agree(flag, peak, measured=measured)
        return _TrialOutcome(flags=flags, peaks=peaks, own_times_s=own_times, rebuild=real_oom)

    def _micro_steps(self, size: int, measured: bool, *, memory: bool = True) -> tuple[int, int, list[float]]:
        """One memory micro-step (unless not `memory`), then warm-up and timed ones: (flag, peak, own times)."""
        # Memory has its own micro-step: on CPU tracking the live peak maps every block afresh, page faults that
        # would be timed as compute. Every rank runs every micro-step, also after an emulated out-of-memory
        # (ZeRO-2/3 communicate in each); a real one stops this rank (profiles/README.md).
        flag, peak = _OK, 0
        own_times: list[float] = []
        if memory:
            flag, peak = self._memory_micro_step(size, measured)
            if flag not in (_OK, _EMULATED_OOM):
                return flag, peak, own_times
        for index in range(self.settings.warmup_micro_steps + self.settings.repeats):
            try:
                elapsed_s = self._timed_micro_step(size)
            except Exception as exc:  # noqa: BLE001 - classified; every rank must reach the agreement
                flag = max(flag, self._classify(exc))
                break
            if index >= self.settings.warmup_micro_steps:
                own_times.append(elapsed_s)
        return flag, peak, own_times

    def _memory_micro_step(self, size: int, measured: bool, *, boundary: bool = False) -> tuple[int, int]:
        """One micro-step whose peak memory is measured: (flag, peak bytes); an emulated type over its
        memory is flagged (`check_emulated_memory`)."""
        my_type = self.layout.my_type
        peak = 0
        try:
            with MeasuredPeak(self.layout.device) as measured_peak:
                self._micro_step(size, boundary=boundary)
            peak = self._device_bytes(measured_peak.bytes)
            if measured:
                check_emulated_memory(self.layout.emulations[my_type], peak, device_type=my_type)
        except Exception as exc:  # noqa: BLE001 - classified; every rank must reach the agreement
            return self._classify(exc), peak
        return _OK, peak

    def _run_trial(self, sizes: dict[str, int], records: dict[str, _TypeRecord], phase: str) -> _TrialOutcome:
        outcome = self._trial(sizes)
        my_type = self.layout.my_type
        for t, size in sizes.items():
            fits = outcome.flags[t] == _OK
            if fits:
                records[t].peaks[size] = outcome.peaks[t]
                if t == my_type:
                    records[t].own_times_s[size] = outcome.own_times_s
            if phase == "probe":
                records[t].search.record(size, fits=fits, peak_memory_bytes=outcome.peaks[t] if fits else None)
            elif not fits:
                records[t].out_of_memory_in_sweep.add(size)
        if outcome.flags["__unmeasured__"] == _REAL_OOM:
            raise _StageAbandoned("a real out-of-memory on a rank running the unmeasured micro-batch 1")
        memory_after_rebuild = None
        if outcome.rebuild:
            self._drop_engine()
            if not self._start_engine(records):
                raise _StageAbandoned("a real out-of-memory at micro-batch 1 after a rebuild")
            memory_after_rebuild = allocated_device_bytes(self.layout.device)
        if self.on_trial is not None and self.layout.rank == 0:
            fits = {t: outcome.flags[t] == _OK for t in sizes}
            self.on_trial(
                TrialEvent(
                    zero_stage=self.zero_stage,
                    phase=phase,
                    sizes=dict(sizes),
                    remaining_trials_estimate=self._remaining_estimate(records),
                    fits=fits,
                    peak_memory_bytes={t: outcome.peaks[t] for t in sizes if fits[t]},
                    memory_after_rebuild_bytes=memory_after_rebuild,
                )
            )
        return outcome

    def _remaining_estimate(self, records: dict[str, _TypeRecord]) -> int:
        remaining = 0
        for record in records.values():
            s = record.search
            # The memory fit may predict far past the limit (or a failed size): no trial goes there.
            target = s.largest_fitting if s.next_size() is None else min(s.predicted or s.limit, s.ceiling)
            todo = [b for b in sweep_sizes(self.settings.micro_batch_sizes, max(target, 1)) if b not in record.peaks]
            remaining = max(remaining, len(todo) + (0 if s.next_size() is None else 2))
        return remaining

    def _measure_group(self, group: tuple[str, ...], records: dict[str, _TypeRecord]) -> None:
        while True:
            proposals = {t: records[t].search.next_size() for t in group if not records[t].warmup_failed}
            sizes = {t: b for t, b in proposals.items() if b is not None}
            if not sizes:
                break
            self._run_trial(sizes, records, "probe")
        todo = {
            t: [
                b
                for b in sweep_sizes(self.settings.micro_batch_sizes, records[t].search.largest_fitting)
                if b not in records[t].peaks
            ]
            for t in group
            if records[t].search.largest_fitting > 0 and not records[t].warmup_failed
        }
        for sizes in _side_by_side(todo):
            self._run_trial(sizes, records, "sweep")

    def _measure_boundary(self) -> float:
        """This rank's accumulation-boundary time beyond an ordinary micro-step (seconds), at micro-batch 1
        with a barrier before each timed part (no rank waits for another's forward): the boundary backward
        less an ordinary one, plus the optimizer step (an emulated type's: slowdown x its compute time)."""
        device, slowdown = self.layout.device, self._slowdown

        def timed(block: Callable[[], None]) -> tuple[float, float]:
            barrier()
            wall, cpu = time.perf_counter(), time.thread_time()
            block()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return time.perf_counter() - wall, time.thread_time() - cpu

        def backward(boundary: bool) -> Callable[[], None]:
            self.engine.set_gradient_accumulation_boundary(boundary)
            loss = self.loss_fn(self.engine, self._batch(1))
            return lambda: self.engine.backward(loss, scale_wrt_gas=False)

        ordinary_s, boundary_s, step_s = [], [], []
        for index in range(self.settings.warmup_micro_steps + self.settings.repeats):
            ordinary_wall, _ = timed(backward(False))
            self.engine.step()
            boundary_wall, _ = timed(backward(True))
            window = _StepWindow(device)
            with optimizer_compute_window(self.engine.optimizer, start=window.start, stop=window.stop) as split:
                step_wall, step_cpu = timed(self.engine.step)
            self.engine.set_gradient_accumulation_boundary(False)
            if index >= self.settings.warmup_micro_steps:
                ordinary_s.append(ordinary_wall)
                boundary_s.append(boundary_wall)
                # As training emulates it (ComputeSlowdown): the compute part of the step (a ZeRO 1/2
                # partition's update, without the step's collectives) lasts slowdown x its compute
                # time, or its wall time if that is longer. On CUDA the CPU time says nothing about
                # the kernels: the wall time is the compute time.
                part_wall, part_cpu = (window.wall_s, window.cpu_s) if split else (step_wall, step_cpu)
                compute_s = part_wall if device.type == "cuda" else part_cpu
                step_s.append(step_wall - part_wall + max(part_wall, slowdown * compute_s))
        reduction_s = max(0.0, statistics.median(boundary_s) - statistics.median(ordinary_s))
        return reduction_s + statistics.median(step_s)

    def run(self) -> dict[str, TypeStageResult]:
        """Measure every type in `types_to_measure` at this stage (collective)."""
        layout = self.layout
        records = {
            t: _TypeRecord(
                search=LargestFitSearch(
                    capacity_bytes=layout.capacities_bytes[t],
                    limit=self.settings.micro_batch_size_limit,
                    exact=self._probing_past_prediction_is_safe(t),
                    margin=self.settings.memory_margin,
                )
            )
            for t in self.types_to_measure
        }
        abandoned: str | None = None
        boundary_s: float | None = None
        try:
            if not self._start_engine(records):
                raise _StageAbandoned("a real out-of-memory at micro-batch 1")
            for group in self._groups():
                self._measure_group(group, records)
            boundary_s = self._measure_boundary()
        except _StageAbandoned as exc:
            abandoned = str(exc)
        finally:
            self._drop_engine()
        return self._results(records, boundary_s, abandoned)

    def time_sizes(self, sizes: Mapping[str, list[int]]) -> dict[int, float]:
        """This rank's median micro-step time at each size `sizes` gives its device type (collective).

        Trial i runs the i-th size of every type of a group at once, grouped as `run` sweeps (the other
        ranks run micro-batch 1 unmeasured); no probe, boundary or memory micro-step. A size that fails
        (a real out-of-memory) is left out.
        """
        my_type = self.layout.my_type
        mine: dict[int, float] = {}
        try:
            if not self._start_engine({}):
                raise _StageAbandoned("a real out-of-memory at micro-batch 1")
            for group in self._groups():
                for trial in _side_by_side({t: sizes[t] for t in group if t in sizes}):
                    outcome = self._trial(trial, memory=False)
                    if my_type in trial and outcome.flags[my_type] == _OK and outcome.own_times_s:
                        mine[trial[my_type]] = statistics.median(outcome.own_times_s)
        finally:
            self._drop_engine()
        return mine

    def _probing_past_prediction_is_safe(self, device_type: str) -> bool:
        # Emulated capacities are checked after the micro-step, outside any collective.
        # A real out-of-memory is caught where it strikes: safe at ZeRO-0/1, whose
        # ordinary micro-steps do not communicate, and on CUDA only (on CPU the
        # kernel's out-of-memory killer may strike first).
        if self.layout.emulations[device_type] is not None:
            return True
        return self.zero_stage in (0, 1) and self.layout.device.type == "cuda"

    def _groups(self) -> list[tuple[str, ...]]:
        # CPU time ignores waiting, and ZeRO-0/1 micro-steps do not communicate: all
        # types at once. Otherwise one type at a time, the others at micro-batch 1.
        if self.window.types_at_once:
            return [self.types_to_measure] if self.types_to_measure else []
        return [(t,) for t in self.types_to_measure]

    def _results(
        self, records: dict[str, _TypeRecord], boundary_s: float | None, abandoned: str | None
    ) -> dict[str, TypeStageResult]:
        mine = {
            "type": self.layout.my_type,
            "times": {b: statistics.median(v) for b, v in records[self.layout.my_type].own_times_s.items() if v}
            if self.layout.my_type in records
            else {},
            "boundary_s": boundary_s,
        }
        everyone = gather_objects(mine)
        results: dict[str, TypeStageResult] = {}
        for t, record in records.items():
            of_type = [e for e in everyone if e["type"] == t]
            search = record.search
            largest = 0 if record.warmup_failed else search.largest_fitting
            samples = []
            for size in sorted(record.peaks):
                times = [e["times"][size] for e in of_type if size in e["times"]]
                if size <= largest and times:
                    samples.append(
                        Sample(
                            micro_batch_size=size,
                            micro_step_time_s=max(statistics.median(times), 1e-9),
                            peak_memory_bytes=max(1, record.peaks[size]),
                        )
                    )
            boundaries = [e["boundary_s"] for e in of_type if e["boundary_s"] is not None]
            probe = {
                "largest_fitting": largest,
                "smallest_failing": search.smallest_failing,
                "predicted_largest": search.predicted,
                "limited_by_micro_batch_size_limit": search.limited_by_limit,
                "probed_past_prediction": search.exact,
                "optimizer_step_peak_memory_bytes": record.boundary_peak_bytes,
                "out_of_memory_in_sweep": sorted(record.out_of_memory_in_sweep),
            }
            if abandoned is not None:
                probe["abandoned"] = abandoned
            results[t] = TypeStageResult(
                device_type=t,
                complete=abandoned is None or record.warmup_failed,
                max_micro_batch_size=largest if samples else 0,
                samples=tuple(samples) if largest else (),
                optimizer_step_time_s=statistics.median(boundaries) if boundaries and largest else 0.0,
                probe=probe,
            )
        gc.collect()
        return results


def _side_by_side(sizes: Mapping[str, list[int]]) -> list[dict[str, int]]:
    """Trials of several types at once: trial i runs the i-th size of every type that has one."""
    count = max((len(v) for v in sizes.values()), default=0)
    return [{t: v[index] for t, v in sizes.items() if index < len(v)} for index in range(count)]


def place_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model` moved to `device`, agreed by all ranks (collective), before DeepSpeed builds its engine.

    DeepSpeed moves the model, then broadcasts it: a rank that cannot hold the parameters would fail
    there while the others wait. Here a real out-of-memory on any rank abandons the stage on every rank,
    another error is raised on every rank.
    """
    outcome, error = _OK, None
    try:
        model.to(device)
    except Exception as exc:  # noqa: BLE001 - every rank must reach the agreement
        outcome, error = (_REAL_OOM if is_out_of_memory(exc) else _ERROR), exc
    agreed = int(agree_max([float(outcome)], device)[0])
    if agreed == _OK:
        return model
    errors, kind = every_ranks_error(error)
    if agreed == _REAL_OOM:
        raise _StageAbandoned(f"a real out-of-memory placing the model on the device ({errors})")
    raise kind(f"profiling failed placing the model on the device: {errors}") from error


def described_error(exc: Exception) -> tuple[str, type[Exception] | None]:
    """`exc` as every rank receives it: its type and message, and the `USER_ERRORS` type it is, if any."""
    return f"{type(exc).__name__}: {exc}", next((kind for kind in USER_ERRORS if isinstance(exc, kind)), None)


def every_ranks_error(error: Exception | None) -> tuple[str, type[Exception]]:
    """Every rank's error (None where it had none; its `described_error` travels), one line, and the type every
    rank raises for them (collective): the first rank's `USER_ERRORS` type where any has one (the user's code, e.g.
    a model that cannot take its batch: `poplar_ext.elastic` ends a restarting launcher's job, which every restart
    would repeat), else RuntimeError (a lost peer, a device fault: restarted). Only the text travels: the rank that
    had `error` raises `from error`, its own traceback showing the user's line."""
    described = None if error is None else described_error(error)
    errors = [(rank, *e) for rank, e in enumerate(gather_objects(described)) if e]
    kind = next((kind for _, _, kind in errors if kind is not None), RuntimeError)
    return "; ".join(f"rank {rank}: {text}" for rank, text, _ in errors), kind


class _StageAbandoned(Exception):
    """A real device cannot run micro-batch 1 at this stage: nothing more can be measured."""
