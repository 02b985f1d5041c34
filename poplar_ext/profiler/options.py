"""`ProfileOptions`: what `profile_model` measures and how, one field per keyword argument.

`profile_model` builds one from its keywords; poplar-profile builds one from its
command line (`poplar_ext.profiler.cli`); both then run `poplar_ext.profiler.api.profile_with`.
Every default is stated here once: `profile_model`'s keyword defaults, the command
line's and the measurement's (`poplar_ext.profiler.measure.MeasureSettings`) are these.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from poplar_ext.plan.formats import ZERO_STAGES, Cluster

if TYPE_CHECKING:
    import torch

    from poplar_ext.activation_checkpointing import CheckpointingToggle
    from poplar_ext.profiler.measure import LossFn

Progress = Callable[[str], None]

CHECKPOINTING_MODES = ("auto", "both", "off")
"""`ProfileOptions.activation_checkpointing`: both variants where the model can do both, both or
an error, or only without checkpointing."""


def log_progress(line: str) -> None:
    """The default progress sink: one line on stderr (called on rank 0 only)."""
    print(f"[poplar-profile] {line}", file=sys.stderr, flush=True)


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    """`profile_model`'s arguments: the model, the job, and how much to measure."""

    model_factory: Callable[[], torch.nn.Module]
    """Builds a fresh model (called once per engine measured, plus once for the fingerprint); its
    forward returns the loss unless `loss_fn` is given."""
    make_batch: Callable[[int], Any]
    """``make_batch(micro_batch_size)`` -> one micro-batch (a tensor, tuple or dict of tensors; moved
    to the device by the profiler). It is never called when every profile comes from the cache."""
    ds_config: Mapping[str, Any] | str | os.PathLike[str]
    """The DeepSpeed config (dict or JSON file); batch sizes and the stage are set per engine,
    everything else (dtype, optimizer, offload) is used as it is."""
    cluster: Cluster | str | os.PathLike[str] | None = None
    """The cluster description, or its file (read by rank 0 alone), or None to discover it from the
    hardware: device type of every rank, and the emulation of emulated types. Real types must be
    what the hardware reports."""
    zero_stages: Iterable[int] = ZERO_STAGES
    """The ZeRO stages to profile (distinct, among 0-3)."""
    micro_batch_sizes: Iterable[int] | None = None
    """Sizes for the time curve; None: 1, 2, 3, 4, 6, 8, 12, ... up to the largest that fits."""
    cache_dir: str | os.PathLike[str] = "profiles"
    """The profile directory: matching profiles there are reused, new ones written there by rank 0."""
    force: bool = False
    """Measure again even where a matching profile is in `cache_dir`."""
    progress: Progress | None = log_progress
    """Called on rank 0 with one line per trial (device type, stage, size, estimated time left);
    None for silence."""
    loss_fn: LossFn | None = None
    """``loss_fn(engine, batch) -> loss`` when the model does not return it (None: the output's
    ``.loss``, else the output); for a pipeline model, see `per_layer`."""
    optimizer_factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None
    """Builds the optimizer from the parameters when the DeepSpeed config has no ``optimizer`` section."""
    model_name: str | None = None
    """For people and file names (None: the model's class name)."""
    sequence_length: int | None = None
    """Tokens per sample, part of the cache key (None: not a sequence model)."""
    warmup_micro_steps: int = 1
    """Unmeasured micro-steps at each size before the measured ones."""
    repeats: int = 3
    """Measured micro-steps per size (their median is the sample's time)."""
    micro_batch_size_limit: int = 256
    """The probe never tries a larger micro-batch."""
    measure_network: bool = True
    """Also time the collectives ZeRO issues on the job's process group and write a network file
    beside the profiles (`poplar_ext.profiler.network`; reused from `cache_dir` when measured on
    the same cluster), with which the search prices communication."""
    activation_checkpointing: str = "auto"
    """``"auto"`` measures each type and stage without and with activation checkpointing where the
    model can do both (the built-in GPT, Hugging Face models, or `checkpointing_toggle` given), so
    the search can choose per device type; ``"both"`` does so or raises ValueError when the model
    cannot; ``"off"`` measures without only (half the time)."""
    checkpointing_toggle: CheckpointingToggle | None = None
    """``toggle(model, enabled)`` for a model of your own (`poplar_ext.activation_checkpointing`);
    pass the same one to `initialize`."""
    optimizer_offload: str = "off"
    """``"off"`` measures without only; ``"smallest"`` also measures the device type(s) with the
    least memory with the optimizer offloaded to the host (DeepSpeed's ``offload_optimizer``, at
    ZeRO stages 1-2), so the search can choose it for them; ``"both"`` does so for every type. An
    offloaded profile's memory leaves out the host's optimizer state and fp32 master weights (on
    CPU, for an emulated type, they are taken off the measured peak); its boundary includes the
    host's optimizer step."""
    per_layer: bool | None = None
    """Layer profiles for the pipeline search (`poplar_ext.profiler.per_layer`, written to
    ``<cache_dir>/layers/``): None measures them when the model is a pipeline model (a
    PipelineModule or PoplarPipelineModule, or a list of LayerSpecs or modules), which then gets
    no whole-model profile; True also for an ``nn.Sequential``, beside its whole-model profiles;
    False never. With a pipeline model `loss_fn` is DeepSpeed's pipeline ``loss_fn(outputs,
    labels)`` (None: the PipelineModule's own, else the last layer's output summed) and
    `make_batch` returns ``(inputs, labels)``."""
    collective_timeout_s: float | None = 300.0
    """While profiling, every process group's collectives time out after this many seconds instead
    of the group's own timeout (DeepSpeed's default: 30 minutes), so that a rank lost outside the
    agreed points (an out-of-memory in a collective DeepSpeed issues, a crash) ends the job in
    minutes through NCCL's asynchronous error handling; None keeps the groups' own. It must exceed
    the longest trial of the slowest device type (the other ranks wait that long in its agreement)."""


__all__ = ["CHECKPOINTING_MODES", "ProfileOptions", "Progress", "log_progress"]
