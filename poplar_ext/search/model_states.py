"""A model's static memory per ZeRO stage (parameters, gradients, optimizer state), a lower bound before any
engine (docs/profiling.md)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from poplar_ext.plan.formats import ZERO_STAGES

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes of one parameter (or gradient) in each training dtype."""

OPTIMIZER_STATE_BYTES = {
    **dict.fromkeys(("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam", "lamb", "fusedlamb"), 8),
    **dict.fromkeys(("adagrad", "lion", "sgd"), 4),
}
"""fp32 optimizer state per parameter, by lower-cased optimizer type: Adam's two moments, one
momentum for the others (SGD counted with momentum)."""

DEFAULT_OPTIMIZER_STATE_BYTES = 8
"""An optimizer not in the table (or one the script builds): counted as Adam, the common case."""


@dataclass(frozen=True, kw_only=True)
class ModelStates:
    """One rank's static memory at one ZeRO stage, in bytes on its device."""

    zero_stage: int
    """The ZeRO stage the figure is for."""
    parameters_bytes: int
    """The training-dtype parameters this rank holds (its shard at stage 3)."""
    gradients_bytes: int
    """The training-dtype gradients this rank holds (its shard at stages 2-3)."""
    optimizer_bytes: int
    """Optimizer moments, plus fp32 master weights and gradients in a 16-bit run (its shard from stage
    1; 0 when offloaded to the host)."""

    @property
    def device_bytes(self) -> int:
        """Everything above: the least memory the device needs before any activation."""
        return self.parameters_bytes + self.gradients_bytes + self.optimizer_bytes


def optimizer_state_bytes(ds_config: Mapping[str, Any]) -> int:
    """fp32 optimizer state per parameter for the DeepSpeed config's ``optimizer.type``
    (`DEFAULT_OPTIMIZER_STATE_BYTES` when it has none: the script passes its own)."""
    section = ds_config.get("optimizer")
    name = section.get("type") if isinstance(section, Mapping) else None
    if not isinstance(name, str):
        return DEFAULT_OPTIMIZER_STATE_BYTES
    return OPTIMIZER_STATE_BYTES.get(name.lower(), DEFAULT_OPTIMIZER_STATE_BYTES)


def model_states(
    *,
    num_parameters: int,
    zero_stage: int,
    world_size: int,
    dtype: str,
    optimizer_bytes_per_parameter: int = DEFAULT_OPTIMIZER_STATE_BYTES,
    optimizer_offload: bool = False,
    num_trainable_parameters: int | None = None,
) -> ModelStates:
    """One rank's static memory for a model of `num_parameters` at `zero_stage` over `world_size` ranks.

    Shards round up (a rank holds at least its share). `optimizer_offload` puts the optimizer part on
    the host (DeepSpeed's ``offload_optimizer``, stages 1-2). `num_trainable_parameters` (default: all)
    have gradients and optimizer state; frozen ones only their weights.
    """
    trainable = num_parameters if num_trainable_parameters is None else num_trainable_parameters
    if num_parameters < 0:
        raise ValueError(f"num_parameters: expected an integer >= 0, found {num_parameters}")
    if not 0 <= trainable <= num_parameters:
        raise ValueError(f"num_trainable_parameters: expected 0..{num_parameters}, found {trainable}")
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage: expected one of {', '.join(map(str, ZERO_STAGES))}, found {zero_stage}")
    if world_size < 1:
        raise ValueError(f"world_size: expected an integer >= 1, found {world_size}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPE_BYTES)}, found {dtype!r}")
    width = DTYPE_BYTES[dtype]
    # A 16-bit run keeps fp32 master weights and fp32 gradients beside the moments.
    optimizer_per_parameter = optimizer_bytes_per_parameter + (0 if width == 4 else 8)

    def share(count: int, per_parameter: int, sharded: bool) -> int:
        return -(-count * per_parameter // world_size) if sharded else count * per_parameter

    return ModelStates(
        zero_stage=zero_stage,
        parameters_bytes=share(num_parameters, width, zero_stage >= 3),
        gradients_bytes=share(trainable, width, zero_stage >= 2),
        optimizer_bytes=0 if optimizer_offload else share(trainable, optimizer_per_parameter, zero_stage >= 1),
    )


def cannot_hold(states: ModelStates, *, capacity_bytes: int) -> bool:
    """True when `capacity_bytes` is below the model states alone."""
    return states.device_bytes > capacity_bytes


def shortfall(states: ModelStates, *, capacity_bytes: int) -> str:
    """Why `capacity_bytes` cannot hold `states`, for messages (the estimate, its parts, the capacity)."""
    return (
        f"ZeRO stage {states.zero_stage} needs at least {gib(states.device_bytes)} for the model states alone "
        f"(parameters {gib(states.parameters_bytes)}, gradients {gib(states.gradients_bytes)}, optimizer "
        f"{gib(states.optimizer_bytes)}), more than its memory of {gib(capacity_bytes)}"
    )


def gib(num_bytes: float) -> str:
    """`num_bytes` for people: ``12.3 GiB``."""
    return f"{num_bytes / 2**30:.1f} GiB"
