"""`profile_layers`: every device type measured layer by layer (collective), in ``<profiles>/layers/``. See
profiles/README.md ("Layer profile")."""

from __future__ import annotations

import contextlib
import functools
import inspect
import platform
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from poplar_ext.collectives import broadcast_from_rank0, gather_objects
from poplar_ext.hardware.cpu_process import cpu_threads
from poplar_ext.hardware.devices import join_job
from poplar_ext.hardware.emulation import device_label
from poplar_ext.plan.formats import ModelInfo
from poplar_ext.plan.pipeline_formats import (
    PIPELINE_ZERO_STAGES,
    LayerProfile,
    layer_profile_from_dict,
    layer_profile_to_dict,
)
from poplar_ext.profiler.cache import (
    WritableBeforeMeasuring,
    cached_on_rank0,
    find_cached_layer_profile,
    profiles_key,
    store_layer_profile,
)
from poplar_ext.profiler.layers import (
    LayerMeasurement,
    base_memory_bytes,
    layer_micro_batch_sizes,
    layer_profile,
    layers_fingerprint,
    measure_layers,
    pipeline_layers,
)
from poplar_ext.profiler.layout import build_layout
from poplar_ext.profiler.measure import every_ranks_error, read_ds_config, training_dtype
from poplar_ext.profiler.options import ProfileOptions

_TORCH_OPTIMIZERS = {"adam": "AdamW", "adamw": "AdamW", "sgd": "SGD"}
"""DeepSpeed config optimizer types whose per-parameter state a torch optimizer of this name holds
alike (DeepSpeed's Adam is AdamW unless ``adam_w_mode`` is false: the same two moments)."""


def optimizer_factory_from_config(ds_config: Mapping[str, Any]) -> Callable[[list[nn.Parameter]], Any]:
    """A torch optimizer like the DeepSpeed config's ``optimizer`` (Adam, AdamW, SGD), to measure a
    layer's optimizer state and step without an engine; ValueError for another type."""
    section = ds_config.get("optimizer")
    kind = str(section.get("type", "")) if isinstance(section, Mapping) else ""
    if kind.lower() not in _TORCH_OPTIMIZERS:
        raise ValueError(
            f"ds_config: optimizer.type: expected Adam, AdamW or SGD to profile layers by their torch equivalent, "
            f"found {kind or 'none'}; pass optimizer_factory to profile layer by layer with another one"
        )
    cls = getattr(torch.optim, _TORCH_OPTIMIZERS[kind.lower()])
    accepted = inspect.signature(cls.__init__).parameters
    params = {k: v for k, v in (section.get("params") or {}).items() if k in accepted}
    return lambda parameters: cls(parameters, **params)


def profile_layers(
    options: ProfileOptions,
    *,
    model: Any = None,
    device_types: Collection[str] | None = None,
    writable: WritableBeforeMeasuring | None = None,
) -> list[LayerProfile]:
    """Layer profiles of every device type (or of `device_types`) at ZeRO stages 0/1 of `options.zero_stages`.

    Collective; the same list on every rank, stage by stage in job order of device types. `model`: what
    `options.model_factory` builds (built here when None). Cached ones with the same keys are reused; the
    others measured once `writable` (default: ``options.cache_dir``'s) says rank 0 can write them.
    """
    ds_config = read_ds_config(options.ds_config)
    stages = tuple(s for s in sorted(set(options.zero_stages)) if s in PIPELINE_ZERO_STAGES)
    if not stages:
        raise ValueError(
            f"zero_stages: expected 0 or 1 among them to profile layers (DeepSpeed's pipeline engine runs no other), "
            f"found {sorted(set(options.zero_stages))}"
        )
    device = join_job()
    layout = build_layout(options.cluster, device, bf16=training_dtype(ds_config) == "bfloat16")
    model = options.model_factory() if model is None else model
    pipeline = pipeline_layers(model, loss_fn=options.loss_fn)
    sizes = layer_micro_batch_sizes(options.micro_batch_sizes, options.micro_batch_size_limit)
    info = ModelInfo(
        name=options.model_name or ("pipeline" if isinstance(model, (list, tuple)) else type(model).__name__.lower()),
        fingerprint=layers_fingerprint(pipeline),
        num_parameters=max(1, sum(p.numel() for build in pipeline.builders for p in build().parameters())),
        dtype=training_dtype(ds_config),
        sequence_length=options.sequence_length,
    )
    job_key = profiles_key(options, info.fingerprint, layout.world_size, layout.emulations)
    wanted = [(t, s) for s in stages for t in layout.type_names if device_types is None or t in device_types]
    keys = {(t, stage): job_key.layer_key(t, stage, sizes) for t, stage in wanted}
    # One timed over fewer micro-steps than asked is measured again (its sizes are in the key).
    find = functools.partial(find_cached_layer_profile, settings=options)

    def on_miss(what: tuple[str, int], why: str) -> None:
        if options.progress is not None:
            t, stage = what
            options.progress(f"layers ZeRO-{stage}: {device_label(t, layout.emulations[t])} measured again: {why}")

    cached = broadcast_from_rank0(
        cached_on_rank0(layout.rank, options, keys, find, layer_profile_to_dict, on_miss=on_miss)
    )
    missing_types = tuple(dict.fromkeys(t for t, s in wanted if (t, s) not in cached))
    say = options.progress if layout.rank == 0 and options.progress is not None else lambda line: None
    for t, stage in wanted:
        if (t, stage) in cached:
            say(f"layers ZeRO-{stage}: {device_label(t, layout.emulations[t])} from the cache")
    if missing_types:
        (writable or WritableBeforeMeasuring(Path(options.cache_dir), rank=layout.rank))()
        labels = ", ".join(device_label(t, layout.emulations[t]) for t in missing_types)
        say(f"layers: measuring {labels} (each layer alone, on its type's first rank)")
    mine, error = None, None
    try:
        if layout.my_type in missing_types and layout.rank == layout.ranks_of(layout.my_type)[0]:
            mine = _measure_my_type(pipeline, options, layout, sizes, device)
    except Exception as exc:  # noqa: BLE001 - the other ranks wait in the gather below: every rank must learn of it
        error = exc
    errors, kind = every_ranks_error(error)
    if errors:
        raise kind(f"profiling layers failed: {errors}") from error
    measured = {m[0]: m for m in gather_objects(mine) if m is not None}
    produced = dict(cached)
    if layout.rank == 0:
        for t, stage in wanted:
            if (t, stage) in cached:
                continue
            _, costs, base = measured[t]
            profile = layer_profile(
                costs,
                device_type=t,
                zero_stage=stage,
                memory_capacity_bytes=layout.capacities_bytes[t],
                base_memory=base,
                model=info,
                emulation=job_key.emulations[t],
                provenance={
                    "torch": job_key.torch_version,
                    "deepspeed": job_key.deepspeed_version,
                    "ds_config_fingerprint": job_key.ds_config_fingerprint,
                    "host": layout.hosts[t],
                    "hardware": layout.hardware[t],
                    "warmup_micro_steps": options.warmup_micro_steps,
                    "repeats": options.repeats,
                    "platform": platform.platform(),
                    "measured_dtype": info.dtype,
                },
            )
            path = store_layer_profile(options.cache_dir, profile)
            say(f"layers ZeRO-{stage}: {t}: {profile.num_layers} layers, {len(sizes)} sizes -> {path}")
            produced[(t, stage)] = layer_profile_to_dict(profile)
    produced = broadcast_from_rank0(produced if layout.rank == 0 else None)
    return [layer_profile_from_dict(produced[w], source=f"<layer profile {w[0]} ZeRO-{w[1]}>") for w in wanted]


def _measure_my_type(pipeline: Any, options: ProfileOptions, layout: Any, sizes: Any, device: torch.device) -> tuple:
    """This rank's type measured layer by layer (its first rank's part): the type, the layer costs, base memory."""
    measurement = LayerMeasurement(
        make_batch=options.make_batch,
        optimizer_factory=options.optimizer_factory or optimizer_factory_from_config(read_ds_config(options.ds_config)),
        micro_batch_sizes=sizes,
        warmup_micro_steps=options.warmup_micro_steps,
        repeats=options.repeats,
        device=device,
        dtype=getattr(torch, training_dtype(read_ds_config(options.ds_config))),
    )
    emulation = layout.emulations[layout.my_type]
    # Several torch threads spin in the thread CPU time that times a CPU layer: one, as profile_with.
    with cpu_threads(1) if device.type == "cpu" else contextlib.nullcontext():
        base = base_memory_bytes(device)
        costs = measure_layers(pipeline, measurement, slowdown=1.0 if emulation is None else emulation.slowdown)
    return layout.my_type, costs, base
