"""Profiles measured from inside `poplar_ext.initialize`, for the fully automatic mode. See docs/training.md."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from poplar_ext.plan.formats import Cluster, Plan, Profile
from poplar_ext.plan.levers import plan_levers
from poplar_ext.profiler.measure import sequence_length_of

if TYPE_CHECKING:
    from poplar_ext.profiler.cache import JobKey

MeasureMissing = Callable[..., list[Profile]]
"""``measure(missing, cluster, force=False) -> profiles``: the (device type, stage) pairs measured (`force`:
even cached ones), returning every profile at their stages (others its cache refused are measured too);
collective. `poplar_ext.zero.planning` calls one when profiles are missing or stale."""

TimeAtSizes = Callable[[Mapping[str, list[int]], Plan, Cluster], dict[str, dict[int, float]]]
"""``time_at_sizes(sizes, plan, cluster) -> {device type: {size: seconds}}``: `time_micro_steps` at `plan`'s
stage and memory levers; collective. `poplar_ext.zero.planning` calls one to check cached profiles."""


def _constructor_arguments(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults its constructor takes (torch's AdamW keeps ``decoupled_weight_decay``, refused)."""
    parameters = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in parameters}


def _optimizer_factory(optimizer: Any, ds_config: Mapping[str, Any]) -> Callable[[list], Any] | None:
    if "optimizer" in ds_config:
        return None  # DeepSpeed builds it from the config
    if optimizer is None:
        raise ValueError(
            "poplar: profiling the missing profiles needs an optimizer: give one in the DeepSpeed config "
            "('optimizer') or as initialize(optimizer=...)"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        # The user's optimizer holds the user's parameters: build the same kind for each copy.
        return lambda params: type(optimizer)(params, **_constructor_arguments(optimizer))
    if callable(optimizer):
        return optimizer  # DeepSpeed's own convention: a callable taking the parameters
    raise ValueError(f"optimizer: expected a torch optimizer or a callable, found {type(optimizer).__name__}")


def _emulations(cluster: Cluster) -> dict[str, Any]:
    return {t: cluster.emulation_of(t) for t in cluster.type_counts()}


def batches_of(training_data: Any, collate_fn: Callable[[list], Any] | None) -> Callable[[int], Any]:
    """``make_batch(b)``: the first b samples of `training_data` (repeated when it is smaller), put
    together by `collate_fn` (default: torch's default collate)."""
    if len(training_data) < 1:
        raise ValueError("training_data: expected at least one sample to build micro-batches from, found none")
    collate = collate_fn or torch.utils.data.default_collate

    def make_batch(micro_batch_size: int) -> Any:
        return collate([training_data[i % len(training_data)] for i in range(micro_batch_size)])

    return make_batch


def missing_layer_profiles_measurer(
    *,
    layers: list[Any],
    loss_fn: Callable[[Any, Any], Any] | None,
    training_data: Any,
    ds_config: Mapping[str, Any],
    profiles_dir: Any,
    micro_batch_size_limit: int,
    progress: Callable[[str], None] | None = None,
) -> Callable[[list[str], Cluster, tuple[int, ...]], None]:
    """``measure(device_types, cluster, stages)``: a pipeline model's missing layer profiles written into
    ``profiles_dir/layers/`` (collective), micro-batches as `missing_profiles_measurer`'s, the config's
    optimizer (the module is built before any optimizer), sizes up to `micro_batch_size_limit`. Its
    ``profiles_key(cluster, layers_fingerprint)`` is the `JobKey` its layer profiles get
    (`poplar_ext.profiler.cache.profiles_key`)."""
    from poplar_ext.profiler import log_progress
    from poplar_ext.profiler.cache import profiles_key as key_of
    from poplar_ext.profiler.options import ProfileOptions
    from poplar_ext.profiler.per_layer import optimizer_factory_from_config, profile_layers

    make_batch = batches_of(training_data, None)
    sequence_length = sequence_length_of(make_batch(1))

    def options(cluster: Cluster, stages: tuple[int, ...] = ()) -> ProfileOptions:
        # No optimizer_factory: the layers step the config's optimizer, keyed as poplar-profile --per-layer keys it.
        return ProfileOptions(
            model_factory=lambda: layers,
            make_batch=make_batch,
            ds_config=ds_config,
            cluster=cluster,
            zero_stages=stages,
            cache_dir=profiles_dir,
            progress=log_progress if progress is None else progress,
            loss_fn=loss_fn,
            micro_batch_size_limit=micro_batch_size_limit,
            measure_network=False,
            sequence_length=sequence_length,
        )

    def measure(device_types: list[str], cluster: Cluster, stages: tuple[int, ...]) -> None:
        # Every rank reads the same config: a ValueError here is raised alike before any rank measures.
        optimizer_factory_from_config(ds_config)
        profile_layers(options(cluster, stages), device_types=device_types)

    def profiles_key(cluster: Cluster, layers_fingerprint: str) -> JobKey:
        return key_of(options(cluster), layers_fingerprint, cluster.world_size, _emulations(cluster))

    measure.profiles_key = profiles_key  # type: ignore[attr-defined]  # which stored layer profiles are the job's
    return measure


def missing_profiles_measurer(
    *,
    model: torch.nn.Module,
    training_data: Any,
    collate_fn: Callable[[list], Any] | None,
    optimizer: Any,
    ds_config: Mapping[str, Any],
    profiles_dir: Any,
    micro_batch_size_limit: int | None,
    progress: Callable[[str], None] | None = None,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    checkpointing_toggle: Callable[[torch.nn.Module, bool], None] | None = None,
    optimizer_offload: str = "off",
    calibration_repeats: int = 3,
) -> MeasureMissing:
    """A `MeasureMissing` with initialize's model and data (collective); call it before DeepSpeed sees `model`
    (each measured stage gets a deep copy).

    Micro-batch ``b`` is `batches_of` `training_data` (its sequence length: `sequence_length_of` micro-batch 1's,
    in the key); the largest tried is `micro_batch_size_limit` (the
    global batch when known); the other arguments are `profile_model`'s. Its ``time_at_sizes`` attribute is
    a `TimeAtSizes` on the same model and data (`calibration_repeats` micro-steps per size); its
    ``profiles_key(cluster)`` the `JobKey` its profiles get (`poplar_ext.profiler.cache.profiles_key`).
    """
    from poplar_ext.profiler import log_progress, profile_model
    from poplar_ext.profiler.options import ProfileOptions

    make_batch = batches_of(training_data, collate_fn)
    sequence_length = sequence_length_of(make_batch(1))
    optimizer_factory = _optimizer_factory(optimizer, ds_config)
    size_limit = micro_batch_size_limit or ProfileOptions.micro_batch_size_limit

    def options(cluster: Cluster, **more: Any) -> dict[str, Any]:
        """`profile_model`'s keywords (`ProfileOptions`' fields) on initialize's model and data."""
        return dict(
            # initialize measures before DeepSpeed sees `model`: it is still as the user built it.
            model_factory=lambda: copy.deepcopy(model),
            make_batch=make_batch,
            ds_config=ds_config,
            cluster=cluster,
            optimizer_factory=optimizer_factory,
            loss_fn=loss_fn,
            model_name=type(model).__name__.lower(),
            sequence_length=sequence_length,
            checkpointing_toggle=checkpointing_toggle,
            **more,
        )

    def measure(missing: list[tuple[str, int]], cluster: Cluster, force: bool = False) -> list[Profile]:
        # Every one at those stages, not only `missing`: `profile_model` also measured again (and stored over)
        # the other types' profiles its cache refused; the caller's copies of those are no longer on disk.
        return profile_model(
            **options(
                cluster,
                zero_stages=sorted({stage for _, stage in missing}),
                cache_dir=profiles_dir,
                force=force,
                progress=log_progress if progress is None else progress,
                micro_batch_size_limit=size_limit,
                optimizer_offload=optimizer_offload,
            )
        )

    def time_at_sizes(sizes: Mapping[str, list[int]], plan: Plan, cluster: Cluster) -> dict[str, dict[int, float]]:
        from poplar_ext.profiler.api import time_micro_steps

        return time_micro_steps(
            ProfileOptions(**options(cluster, repeats=calibration_repeats)),
            sizes,
            zero_stage=plan.zero_stage,
            activation_checkpointing={t: levers[0] for t, levers in plan_levers(plan).items()},
            optimizer_offload=plan.ranks[0].optimizer_offload,
        )

    def profiles_key(cluster: Cluster) -> JobKey:
        from poplar_ext.profiler.cache import profiles_key as key_of
        from poplar_ext.profiler.fingerprint import model_fingerprint

        # The limit `measure` probes up to: a stored profile a lower one stopped is measured again (`JobKey.holds`).
        job = ProfileOptions(**options(cluster, micro_batch_size_limit=size_limit))
        return key_of(job, model_fingerprint(model), cluster.world_size, _emulations(cluster))

    measure.time_at_sizes = time_at_sizes  # type: ignore[attr-defined]  # the same inputs, for calibration
    measure.profiles_key = profiles_key  # type: ignore[attr-defined]  # which stored profiles are the job's
    return measure
