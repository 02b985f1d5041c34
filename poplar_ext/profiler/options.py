"""`ProfileOptions`: `profile_model`'s keywords and poplar-profile's options (each field's docstring its help,
or its ``cli_help`` where the docstring's Python wording does not fit a command line); every default stated once.
See docs/profiling.md."""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from poplar_ext.optimizer_offload import OFFLOAD_MODES
from poplar_ext.plan.formats import ZERO_STAGES, Cluster

if TYPE_CHECKING:
    import torch

    from poplar_ext.activation_checkpointing import CheckpointingToggle

Progress = Callable[[str], None]

LossFn = Callable[[Any, Any], "torch.Tensor"]
"""``loss_fn(engine, batch) -> loss``: one forward through the engine, a scalar loss."""

CHECKPOINTING_MODES = ("auto", "both", "off")
"""`ProfileOptions.activation_checkpointing`: both variants where the model can do both, both or
an error, or only without checkpointing."""

BUILT_IN_SEQUENCE_LENGTHS = {"gpt2-small": 512, "toy-gpt": 64}
"""The built-in models' tokens per sample where `ProfileOptions.sequence_length` is left out."""
HF_MAX_SEQUENCE_LENGTH = 128
"""An ``hf:`` model's tokens per sample where left out: its config's context length, at most this."""

NO_OPTIMIZER = (
    "optimizer: expected an 'optimizer' section (the optimizer training uses: its step is part of every profile), "
    "found none"
)
"""A DeepSpeed config without an optimizer: what `profile_model` and poplar-profile say."""


def log_progress(line: str) -> None:
    """The default progress sink: one line on stderr (called on rank 0 only)."""
    print(f"[poplar-profile] {line}", file=sys.stderr, flush=True)


def _option(
    default: Any,
    flag: str | None = None,
    *,
    read: Callable[[str], Any] | None = None,
    cli_help: str | None = None,
    **kwargs: Any,
) -> Any:
    """A field with its poplar-profile option: `flag` (None: ``--field-name``), `read` the option's text into
    the value (ValueError: wrong text), `cli_help` its help where the docstring speaks of the Python API (None,
    True, exceptions; None: the docstring), `kwargs` argparse's."""
    return field(default=default, metadata={"cli": {"flag": flag, "read": read, **kwargs}, "cli_help": cli_help})


def _by_hand(default: Any = MISSING) -> Any:
    """A field with no option of its own: poplar-profile builds it from other options, or not at all."""
    return field(default=default, metadata={"cli": None})


def _integers(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, found {text!r}") from None
    if not values:
        raise ValueError(f"expected at least one integer, found {text!r}")
    return values


def _read_stages(text: str) -> tuple[int, ...]:
    """``0,2`` -> (0, 2): distinct ZeRO stages, sorted."""
    stages = _integers(text)
    if any(s not in ZERO_STAGES for s in stages) or len(set(stages)) != len(stages):
        raise ValueError(f"expected distinct stages among 0,1,2,3, found {text!r}")
    return tuple(sorted(stages))


def _read_sizes(text: str) -> tuple[int, ...]:
    """``1,2,4`` -> (1, 2, 4): micro-batch sizes."""
    sizes = _integers(text)
    if min(sizes) < 1:
        raise ValueError(f"expected integers >= 1, found {text!r}")
    return sizes


def at_least(minimum: int) -> Callable[[str], int]:
    """The reader of an integer option that is `minimum` or more."""

    def read(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"expected an integer, found {text!r}") from None
        if value < minimum:
            raise ValueError(f"expected an integer >= {minimum}, found {value}")
        return value

    return read


def _read_seconds(text: str) -> float | None:
    """Seconds; 0 is None (the process groups keep their own timeout)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds < math.inf:
        raise ValueError(f"expected a number of seconds >= 0 (0: the groups' own timeout), found {text!r}")
    return seconds or None


def _read_directory(text: str) -> Path:
    """A directory, or a path where none exists yet; ``~`` is the home folder, as the poplar section reads it."""
    if not text:  # an unset shell variable: not the current folder
        raise ValueError("expected a directory, found an empty path")
    path = Path(text).expanduser()  # "--output-dir=~/x" reaches us unexpanded: the shell expands only a word's start
    if path.exists() and not path.is_dir():
        raise ValueError(f"expected a directory, found the file {path}")
    return path


def read_callable(spec: str) -> Callable[..., Any]:
    """``MODULE:NAME`` -> that callable, imported (modules where the command runs included)."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"expected MODULE:FACTORY (e.g. mymodels:build), found {spec!r}")
    # Like `python -m`: modules next to where the command is run are importable.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r}: {exc}") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"module {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"expected a callable at {spec!r}, found {type(target).__name__}")
    return target


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    """`profile_model`'s arguments: the model, the job, and how much to measure."""

    model_factory: Callable[[], torch.nn.Module] = _by_hand()
    """Builds a fresh model (called once per engine measured, plus once for the fingerprint); its
    forward returns the loss unless `loss_fn` is given."""
    make_batch: Callable[[int], Any] = _by_hand()
    """``make_batch(micro_batch_size)`` -> one micro-batch (a tensor, tuple or dict of tensors; moved
    to the device by the profiler). It is never called when every profile comes from the cache."""
    ds_config: Mapping[str, Any] | str | os.PathLike[str] = _by_hand()
    """The DeepSpeed config (dict or JSON file); batch sizes and the stage are set per engine,
    everything else (dtype, optimizer, offload) is used as it is."""
    cluster: Cluster | str | os.PathLike[str] | None = _option(
        None,
        read=Path,
        metavar="FILE",
        cli_help="The cluster description file (read by rank 0 alone): the device type of every rank, and the "
        "emulation of emulated types; real types must be what the hardware reports. Left out: the cluster is read "
        "from the hardware and written as cluster.json in --output-dir, for poplar-search (a cluster.json there "
        "with emulated types is refused, never replaced). The --deepspeed_config file's poplar.cluster comes "
        "first, where its poplar section names one (a file not there yet is written with the cluster read from "
        "the hardware).",
    )
    """The cluster description, or its file (read by rank 0 alone), or None to discover it from the
    hardware (poplar-profile then writes it as cluster.json beside the profiles, for poplar-search):
    the device type of every rank, and the emulation of emulated types. Real types must be what the
    hardware reports."""
    zero_stages: Iterable[int] = _option(ZERO_STAGES, read=_read_stages, metavar="LIST")
    """The ZeRO stages to profile (distinct, among 0-3; comma-separated on the command line)."""
    micro_batch_sizes: Iterable[int] | None = _option(
        None,
        read=_read_sizes,
        metavar="LIST",
        cli_help="Micro-batch sizes (samples) for the time curve, comma-separated, e.g. 1,2,4,8. Left out: 1, 2, "
        "3, 4, 6, 8, 12, ... up to the largest that fits (at most --max-micro-batch-size). Given: those up to a "
        "type's largest that fits, and that largest; each profile's progress line names the ones above it.",
    )
    """Sizes for the time curve; None: 1, 2, 3, 4, 6, 8, 12, ... up to the largest that fits."""
    cache_dir: str | os.PathLike[str] = _option(
        "profiles",
        "--output-dir",
        read=_read_directory,
        metavar="DIR",
        cli_help="The profile directory: profiles there with the same keys are reused, new ones written there by "
        "rank 0. The --deepspeed_config file's poplar.profiles comes first, where its poplar section names one.",
    )
    """The profile directory: profiles there with the same keys are reused, new ones written there by
    rank 0."""
    force: bool = _option(False, action="store_true")
    """Measure again even where a matching profile is in the profile directory."""
    progress: Progress | None = _by_hand(log_progress)
    """Called on rank 0 with one line per trial (device type, stage, size, estimated time left);
    None for silence."""
    loss_fn: LossFn | None = _option(
        None,
        "--loss",
        read=read_callable,
        metavar="MODULE:FN",
        cli_help="loss_fn(engine, batch) -> loss, for a model whose forward does not return the loss. Left out: "
        "the output's .loss, else the output itself. With layer profiles (see --per-layer) it is DeepSpeed's "
        "pipeline loss_fn(outputs, labels); left out there: the PipelineModule's own, else the last layer's "
        "output summed.",
    )
    """``loss_fn(engine, batch) -> loss`` when the model does not return it (None: the output's
    ``.loss``, else the output); for a pipeline model, see per_layer."""
    optimizer_factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = _by_hand(None)
    """Builds the optimizer from the parameters when the DeepSpeed config has no ``optimizer`` section."""
    model_name: str | None = _option(
        None,
        metavar="NAME",
        cli_help="The model's name in progress lines and profile file names. Left out: the built-in model's "
        "(gpt2-small, toy-gpt-LAYERSxWIDTH, or the config class's for hf:), else the model's class name.",
    )
    """For people and file names (None: the model's class name, or the built-in model's)."""
    sequence_length: int | None = _option(
        None,
        read=at_least(1),
        metavar="N",
        cli_help="Tokens per sample, part of the cache key. Left out: the built-in models' context length ("
        + ", ".join(f"{length} for {model}" for model, length in BUILT_IN_SEQUENCE_LENGTHS.items())
        + f"; hf: the config's, at most {HF_MAX_SEQUENCE_LENGTH}), else none (not a sequence model). An hf: model "
        "takes at most its config's positions (n_positions or max_position_embeddings) where it learns a table of "
        "them (GPT-2, BERT; a rotary one, e.g. Llama, takes more). With --batch, the length its "
        "micro-batch 1's token ids have (input_ids, or the first tensor of a tuple), or an error.",
    )
    """Tokens per sample, part of the cache key (None: not a sequence model; the built-in models:
    their context length, `BUILT_IN_SEQUENCE_LENGTHS`). Given, it is the length of make_batch(1)'s token ids
    (`poplar_ext.profiler.auto.sequence_length_of`), or the first measurement raises ValueError."""
    warmup_micro_steps: int = _option(1, "--warmup", read=at_least(0), metavar="N")
    """Unmeasured micro-steps at each size before the measured ones."""
    repeats: int = _option(3, read=at_least(1), metavar="N")
    """Measured micro-steps per size (their median is the sample's time)."""
    micro_batch_size_limit: int = _option(256, "--max-micro-batch-size", read=at_least(1), metavar="N")
    """The probe never tries a larger micro-batch."""
    measure_network: bool = _option(True, "--network", action=argparse.BooleanOptionalAction)
    """Also time the collectives ZeRO issues (all-reduce, reduce-scatter, all-gather from 4 KiB: to 32 MiB
    on CPU, about a second; on GPUs to the config's largest ZeRO bucket, at most 1/8 of the smallest
    device's memory) on the job's process group and write a network file beside the profiles
    (network/network-*.json, `poplar_ext.profiler.network`; reused when measured on the same
    cluster), with which the search prices communication."""
    activation_checkpointing: str = _option(
        "auto",
        choices=CHECKPOINTING_MODES,
        cli_help="auto measures each device type and stage without and with activation checkpointing where the "
        "model can do both (the built-in GPT, Hugging Face models, or a model with --checkpointing-toggle), so the "
        "search can choose per device type; both does so and stops with an error when the model cannot; off "
        "measures without only (half the time).",
    )
    """``auto`` measures each type and stage without and with activation checkpointing where the
    model can do both (the built-in GPT, Hugging Face models, or checkpointing_toggle given), so
    the search can choose per device type; ``both`` does so or raises ValueError when the model
    cannot; ``off`` measures without only (half the time)."""
    checkpointing_toggle: CheckpointingToggle | None = _option(
        None,
        read=read_callable,
        metavar="MODULE:FN",
        cli_help="toggle(model, enabled) that turns activation checkpointing on or off in a model of your own "
        "(poplar_ext.activation_checkpointing); training needs the same one. Left out: only the built-in and "
        "Hugging Face models are measured with checkpointing.",
    )
    """``toggle(model, enabled)`` that turns activation checkpointing on or off in a model of your
    own (`poplar_ext.activation_checkpointing`); pass the same one to `initialize`."""
    optimizer_offload: str = _option("off", choices=OFFLOAD_MODES)
    """``off`` measures without only; ``smallest`` also measures the device type(s) with the
    least memory with the optimizer offloaded to the host (DeepSpeed's ``offload_optimizer``, at
    ZeRO stages 1-2), so the search can choose it for them; ``both`` does so for every type. An
    offloaded profile's memory leaves out the host's optimizer state and fp32 master weights (on
    CPU, for an emulated type, they are taken off the measured peak); its boundary includes the
    host's optimizer step."""
    per_layer: bool | None = _option(
        None,
        action=argparse.BooleanOptionalAction,
        cli_help="--per-layer writes layer profiles for the pipeline search into DIR/layers/ (DIR: --output-dir) "
        "for an nn.Sequential too, beside its whole-model profiles; --no-per-layer never writes them (every model "
        "is profiled whole). Left out: a pipeline model (a PipelineModule or PoplarPipelineModule, or a list of "
        "LayerSpecs or modules) gets layer profiles only, any other model none. With layer profiles --batch "
        "returns (inputs, labels) and --loss is DeepSpeed's pipeline loss_fn(outputs, labels). A Hugging Face causal "
        "LM: a --model returning causal_lm_layers(model).layers (--model hf:... is profiled whole).",
    )
    """Layer profiles for the pipeline search (`poplar_ext.profiler.per_layer`, written to
    ``<profile directory>/layers/``): None measures them when the model is a pipeline model (a
    PipelineModule or PoplarPipelineModule, or a list of LayerSpecs or modules), which then gets
    no whole-model profile; True also for an ``nn.Sequential``, beside its whole-model profiles;
    False never. With a pipeline model, or True, loss_fn is DeepSpeed's pipeline ``loss_fn(outputs,
    labels)`` (None: the PipelineModule's own, else the last layer's output summed) and
    make_batch returns ``(inputs, labels)``, for an ``nn.Sequential``'s whole-model profiles too."""
    collective_timeout_s: float | None = _option(
        300.0,
        "--collective-timeout",
        read=_read_seconds,
        metavar="SECONDS",
        cli_help="While profiling, every process group's collectives time out after this many seconds instead of "
        "the group's own timeout (DeepSpeed's default: 30 minutes), so that a rank lost outside the agreed points "
        "(an out-of-memory in a collective DeepSpeed issues, a crash) ends the job in minutes through NCCL's "
        "asynchronous error handling; 0 keeps the groups' own. It must exceed the longest trial of the slowest "
        "device type (the other ranks wait that long in its agreement).",
    )
    """While profiling, every process group's collectives time out after this many seconds instead
    of the group's own timeout (DeepSpeed's default: 30 minutes), so that a rank lost outside the
    agreed points (an out-of-memory in a collective DeepSpeed issues, a crash) ends the job in
    minutes through NCCL's asynchronous error handling; None (0 on the command line) keeps the
    groups' own. It must exceed the longest trial of the slowest device type (the other ranks wait
    that long in its agreement)."""
