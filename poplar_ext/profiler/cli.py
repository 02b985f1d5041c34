"""``poplar-profile``: measure every device type of a job at each ZeRO stage, like training.

Run it under the launcher that runs training, so that every rank measures its own
device::

    deepspeed --num_gpus 8 --module poplar_ext.profiler --deepspeed_config ds.json \\
        --cluster cluster.json --model mymodels:build_model --batch mymodels:make_batch

or with the built-in toy GPT (no downloads)::

    deepspeed --num_gpus 1 --module poplar_ext.profiler --deepspeed_config ds.json \\
        --cluster cluster.json --model toy-gpt --layers 12 --hidden-size 768 --heads 12

(``--module`` runs it as ``python -m``: ``$(which poplar-profile)`` also works where
that path is the real script, not a pyenv or conda shim the launcher cannot run;
with torchrun: ``torchrun --nproc_per_node 8 -m poplar_ext.profiler ...``.)

Thin: parsing and input checks here, into a `ProfileOptions`; the work in
`poplar_ext.profiler.profile_with`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from poplar_ext.optimizer_offload import OFFLOAD_MODES
from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import ZERO_STAGES
from poplar_ext.profiler.options import CHECKPOINTING_MODES, ProfileOptions, log_progress

BUILTIN_MODELS = ("toy-gpt", "gpt2-small")
HF_PREFIX = "hf:"
"""``--model hf:CONFIG_CLASS``: a transformers model built from its config (random weights)."""
DISCOVERED_CLUSTER_FILE = "cluster.json"
"""Where, in the output directory, a run without --cluster writes the cluster it discovered."""


_DEFAULT = ProfileOptions  # the command line's defaults are ProfileOptions' own


class UsageError(ValueError):
    """Bad command-line input: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage dump
        raise UsageError(message)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The argument parser (standalone, or filled into a subcommand's `parser`)."""
    parser = parser or _Parser(
        prog="poplar-profile",
        description=(
            "Measure each device type of the job at each ZeRO stage (micro-step time curve, "
            "optimizer-step time, peak memory, largest micro-batch) and write one profile per "
            "(model, device type, stage, activation checkpointing, optimizer offload). Run it under the deepspeed "
            "launcher or torchrun, like "
            "training; profiles already in --output-dir with the same keys are reused."
        ),
        epilog=(
            "Example: deepspeed --num_gpus 2 --module poplar_ext.profiler --deepspeed_config ds.json "
            "--cluster cluster.json --model toy-gpt --zero-stages 0,2 "
            "(torchrun: torchrun --nproc_per_node 2 -m poplar_ext.profiler ...)"
        ),
    )
    parser.add_argument(
        "--deepspeed_config",
        "--deepspeed-config",
        dest="deepspeed_config",
        required=True,
        metavar="FILE",
        help="the DeepSpeed JSON config training uses (dtype, optimizer, ZeRO settings; batch sizes are set per "
        "measurement)",
    )
    parser.add_argument(
        "--cluster",
        metavar="FILE",
        help="cluster description: the device type of every rank, and the emulation of emulated types; read by "
        "rank 0 alone and checked against every rank's hardware (default: discovered from the hardware and "
        "written as cluster.json next to the profiles, for poplar-search)",
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="MODULE:FACTORY",
        help="a zero-argument function that builds the model (its forward returns the loss, or an output with .loss); "
        f"one of {', '.join(BUILTIN_MODELS)}; or hf:CONFIG_CLASS (e.g. hf:GPT2Config) for a transformers model "
        "built from its config with --hf-config sizes and random weights (needs pip install 'poplar-ext[hf]')",
    )
    parser.add_argument(
        "--batch",
        metavar="MODULE:FACTORY",
        help="make_batch(micro_batch_size) -> one micro-batch; required unless --model is built in",
    )
    parser.add_argument(
        "--zero-stages",
        default=",".join(map(str, _DEFAULT.zero_stages)),
        metavar="LIST",
        help="comma-separated ZeRO stages to profile (default: %(default)s)",
    )
    parser.add_argument(
        "--output-dir", default=_DEFAULT.cache_dir, metavar="DIR", help="profile cache directory (default: %(default)s)"
    )
    parser.add_argument("--force", action="store_true", help="measure again even where a matching profile exists")
    parser.add_argument(
        "--no-network",
        action="store_true",
        help="do not time the collectives (by default all-reduce, reduce-scatter and all-gather are timed at 4 KiB-32 "
        "MiB, "
        "about a second, and written as network/network-*.json in the output directory, with which poplar-search "
        "prices communication)",
    )
    parser.add_argument(
        "--micro-batch-sizes",
        metavar="LIST",
        help="comma-separated sizes for the time curve (default: 1,2,3,4,6,8,12,... up to the largest that fits)",
    )
    parser.add_argument(
        "--max-micro-batch-size",
        type=int,
        default=_DEFAULT.micro_batch_size_limit,
        metavar="N",
        help="never try a larger micro-batch (default: %(default)s)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=_DEFAULT.repeats,
        metavar="N",
        help="timed micro-steps per size; the median counts (default: %(default)s)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=_DEFAULT.warmup_micro_steps,
        metavar="N",
        help="untimed micro-steps per size first (default: %(default)s)",
    )
    parser.add_argument(
        "--model-name", metavar="NAME", help="name in the profiles and file names (default: from the model)"
    )
    parser.add_argument(
        "--sequence-length",
        type=int,
        metavar="N",
        help="tokens per sample; part of the cache key (built-in models: their context length, default 512 for "
        "gpt2-small, 64 for toy-gpt)",
    )
    parser.add_argument(
        "--activation-checkpointing",
        default=_DEFAULT.activation_checkpointing,
        choices=CHECKPOINTING_MODES,
        help="auto: measure each type and stage without and with activation checkpointing where the model can do "
        "both (built-in models, Hugging Face models with gradient checkpointing, or --checkpointing-toggle), so that "
        "poplar-search can choose it per device type; both: the same, or an error when the model cannot; off: without "
        "only (half the time); default: %(default)s",
    )
    parser.add_argument(
        "--optimizer-offload",
        default=_DEFAULT.optimizer_offload,
        choices=OFFLOAD_MODES,
        help="off: measure without only; smallest: also measure the device type(s) with the least memory with the "
        "optimizer offloaded to the host (DeepSpeed's offload_optimizer, ZeRO stages 1-2), so that poplar-search can "
        "choose it for them; both: every type so; default: %(default)s",
    )
    parser.add_argument(
        "--per-layer",
        action="store_true",
        default=None,
        help="also write layer profiles (DIR/layers/, for poplar-search --parallelism pipeline|auto): each layer's "
        "forward + backward time against micro-batch size, its memory and its output bytes; automatic when --model "
        "builds a pipeline model (a PipelineModule or a list of LayerSpecs), which gets layer profiles only "
        "(--batch then returns (inputs, labels) and --loss is DeepSpeed's pipeline loss_fn(outputs, labels))",
    )
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=_DEFAULT.collective_timeout_s,
        metavar="SECONDS",
        help="while profiling, collectives time out after this long instead of the process group's own (30 minutes "
        "by DeepSpeed's default), so a rank lost outside the agreed points ends the job in minutes; 0 keeps the "
        "group's own; longer than the slowest type's longest trial; default: %(default)s",
    )
    parser.add_argument(
        "--checkpointing-toggle",
        metavar="MODULE:FN",
        help="toggle(model, enabled) that turns activation checkpointing on or off in a --model of your own "
        "(give the same function to poplar_ext.initialize as checkpointing_toggle)",
    )
    parser.add_argument(
        "--loss",
        metavar="MODULE:FN",
        help="loss_fn(engine, batch) -> loss when the model's output is not the loss and has no .loss",
    )
    hf = parser.add_argument_group("Hugging Face models (--model hf:CONFIG_CLASS)")
    hf.add_argument(
        "--hf-config",
        default="",
        metavar="KEY=VALUE,...",
        help="the config's sizes, e.g. n_layer=12,n_embd=768,n_head=12,vocab_size=50257 (values as JSON)",
    )
    hf.add_argument(
        "--hf-task",
        default="causal-lm",
        choices=("causal-lm", "masked-lm"),
        help="the model head and its labels (default: causal-lm)",
    )
    toy = parser.add_argument_group("built-in models (--model toy-gpt)")
    toy.add_argument("--layers", type=int, default=2, metavar="N", help="transformer blocks (default: 2)")
    toy.add_argument("--hidden-size", type=int, default=128, metavar="N", help="width (default: 128)")
    toy.add_argument("--heads", type=int, default=4, metavar="N", help="attention heads (default: 4)")
    toy.add_argument("--vocab-size", type=int, default=1024, metavar="N", help="token ids (default: 1024)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    # Appended by the deepspeed launcher; the rank comes from the environment.
    parser.add_argument(
        "--local_rank", "--local-rank", dest="local_rank", type=int, default=None, help=argparse.SUPPRESS
    )
    return parser


def _int_list(text: str, *, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UsageError(f"{option}: expected comma-separated integers, found {text!r}") from None
    if not values:
        raise UsageError(f"{option}: expected at least one integer, found {text!r}")
    return values


def _load_callable(spec: str, *, option: str) -> Callable[..., Any]:
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise UsageError(f"{option}: expected MODULE:FACTORY (e.g. mymodels:build), found {spec!r}")
    # Like `python -m`: modules next to where the command is run are importable.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"{option}: cannot import module {module_name!r}: {exc}") from None
    target = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise UsageError(f"{option}: module {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise UsageError(f"{option}: expected a callable at {spec!r}, found {type(target).__name__}")
    return target


def _builtin_model(args: argparse.Namespace) -> tuple[Callable[[], Any], Callable[[int], Any], str, int]:
    from poplar_ext.models.toy_gpt import GPT, GPTConfig

    if args.model == "gpt2-small":
        cfg = GPTConfig.gpt2_small(sequence_length=args.sequence_length or 512)
    else:
        for option, value in (
            ("--layers", args.layers),
            ("--hidden-size", args.hidden_size),
            ("--heads", args.heads),
            ("--vocab-size", args.vocab_size),
        ):
            if value < 1:
                raise UsageError(f"{option}: expected an integer >= 1, found {value}")
        if args.hidden_size % args.heads:
            raise UsageError(f"--hidden-size: expected a multiple of --heads ({args.heads}), found {args.hidden_size}")
        cfg = GPTConfig(
            vocab_size=args.vocab_size,
            sequence_length=args.sequence_length or 64,
            num_layers=args.layers,
            num_heads=args.heads,
            hidden_size=args.hidden_size,
        )

    def make_batch(micro_batch_size: int) -> Any:
        from poplar_ext.models.synthetic import random_tokens

        return random_tokens(cfg.vocab_size, (micro_batch_size, cfg.sequence_length + 1), seed=micro_batch_size)

    name = args.model if args.model == "gpt2-small" else f"toy-gpt-{cfg.num_layers}x{cfg.hidden_size}"
    return (lambda: GPT(cfg)), make_batch, name, cfg.sequence_length


def _config_sizes(text: str) -> dict[str, Any]:
    sizes: dict[str, Any] = {}
    for part in (p for p in text.split(",") if p.strip()):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--hf-config: expected KEY=VALUE pairs separated by commas, found {part!r}")
        try:
            sizes[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            sizes[key.strip()] = value  # a plain string, e.g. an activation name
    return sizes


def _hf_model(args: argparse.Namespace) -> tuple[Callable[[], Any], Callable[[int], Any], str, int]:
    try:
        from poplar_ext.models.hugging_face import model_from_config, random_lm_batch
    except ImportError as exc:
        raise UsageError(f"--model {args.model}: needs transformers (pip install 'poplar-ext[hf]'): {exc}") from None
    config_class = args.model[len(HF_PREFIX) :]
    sizes = _config_sizes(args.hf_config)
    try:
        probe = model_from_config(config_class, sizes, task=args.hf_task)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    vocab_size = int(probe.config.vocab_size)
    sequence_length = args.sequence_length or min(
        128, int(getattr(probe.config, "max_position_embeddings", None) or getattr(probe.config, "n_positions", 128))
    )
    del probe

    def make_batch(micro_batch_size: int) -> Any:
        return random_lm_batch(vocab_size, micro_batch_size, sequence_length, task=args.hf_task)

    name = f"{config_class.removesuffix('Config').lower()}-{args.hf_task}"
    return (lambda: model_from_config(config_class, sizes, task=args.hf_task)), make_batch, name, sequence_length


def parse_command(argv: Sequence[str] | None = None) -> ProfileOptions:
    """Parse and check the command line; raises `UsageError` (one line) on bad input.

    The options' `cluster` is the --cluster file, or None (`run` discovers it); their
    `progress` is None under --quiet.
    """
    args = build_parser().parse_args(argv)
    stages = _int_list(args.zero_stages, option="--zero-stages")
    if any(s not in ZERO_STAGES for s in stages) or len(set(stages)) != len(stages):
        raise UsageError(f"--zero-stages: expected distinct stages among 0,1,2,3, found {args.zero_stages!r}")
    sizes = None if args.micro_batch_sizes is None else _int_list(args.micro_batch_sizes, option="--micro-batch-sizes")
    if sizes is not None and min(sizes) < 1:
        raise UsageError(f"--micro-batch-sizes: expected integers >= 1, found {args.micro_batch_sizes!r}")
    _check_minimums(args)
    ds_config = _deepspeed_config(Path(args.deepspeed_config))
    output_dir = Path(args.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise UsageError(f"--output-dir: expected a directory, found the file {output_dir}")
    model_factory, make_batch, name, sequence_length = _model(args)
    return ProfileOptions(
        model_factory=model_factory,
        make_batch=make_batch,
        ds_config=ds_config,
        # The cluster file is read by rank 0 alone, inside the job (other nodes need not have it).
        cluster=None if args.cluster is None else Path(args.cluster),
        zero_stages=tuple(sorted(stages)),
        micro_batch_sizes=sizes,
        cache_dir=output_dir,
        force=args.force,
        progress=None if args.quiet else log_progress,
        loss_fn=None if args.loss is None else _load_callable(args.loss, option="--loss"),
        model_name=args.model_name or name,
        sequence_length=sequence_length,
        warmup_micro_steps=args.warmup,
        repeats=args.repeats,
        micro_batch_size_limit=args.max_micro_batch_size,
        measure_network=not args.no_network,
        activation_checkpointing=args.activation_checkpointing,
        checkpointing_toggle=_toggle(args),
        optimizer_offload=args.optimizer_offload,
        per_layer=args.per_layer,
        collective_timeout_s=args.collective_timeout or None,
    )


def _check_minimums(args: argparse.Namespace) -> None:
    for option, value, minimum in (
        ("--max-micro-batch-size", args.max_micro_batch_size, 1),
        ("--repeats", args.repeats, 1),
        ("--warmup", args.warmup, 0),
        ("--sequence-length", args.sequence_length if args.sequence_length is not None else 1, 1),
    ):
        if value < minimum:
            raise UsageError(f"{option}: expected an integer >= {minimum}, found {value}")


def _deepspeed_config(config_path: Path) -> dict[str, Any]:
    from poplar_ext.plan.formats import read_json

    try:
        ds_config = read_json(config_path)  # names the file for unreadable, non-UTF-8 or invalid JSON
    except FormatError as exc:
        raise UsageError(f"--deepspeed_config: {exc}") from None
    if not isinstance(ds_config, dict):
        raise UsageError(
            f"--deepspeed_config: expected a JSON object in {config_path}, found {type(ds_config).__name__}"
        )
    if "optimizer" not in ds_config:
        raise UsageError(
            f"--deepspeed_config: {config_path}: optimizer: expected an 'optimizer' section (the optimizer training "
            "uses: its step is part of every profile), found none"
        )
    return ds_config


def _model(args: argparse.Namespace) -> tuple[Callable[[], Any], Callable[[int], Any], str | None, int | None]:
    """The model factory, the batch maker, the model's name and its sequence length (None: not known)."""
    if args.model in BUILTIN_MODELS or args.model.startswith(HF_PREFIX):
        if args.batch is not None:
            kind = "the built-in model" if args.model in BUILTIN_MODELS else "the model"
            raise UsageError(f"--batch: {kind} {args.model} makes its own batches; leave --batch out")
        build = _hf_model if args.model.startswith(HF_PREFIX) else _builtin_model
        return build(args)
    if args.batch is None:
        raise UsageError("--batch: required with a --model of your own (MODULE:FACTORY taking the micro-batch size)")
    model_factory = _load_callable(args.model, option="--model")
    make_batch = _load_callable(args.batch, option="--batch")
    return model_factory, make_batch, None, args.sequence_length


def _toggle(args: argparse.Namespace) -> Callable[[Any, bool], None] | None:
    if args.checkpointing_toggle is None:
        return None
    if args.activation_checkpointing == "off":
        raise UsageError("--checkpointing-toggle: not used with --activation-checkpointing off; leave one out")
    return _load_callable(args.checkpointing_toggle, option="--checkpointing-toggle")


def run(options: ProfileOptions) -> list[Any]:
    """Profile as `options` say (collective: every rank runs it); returns the profiles.

    Without a cluster, the cluster read from the hardware is written beside the profiles
    (for poplar-search) and measured.
    """
    from deepspeed.accelerator import get_accelerator

    from poplar_ext.collectives import process_group_rank
    from poplar_ext.hardware.cpu_process import skip_deepspeed_shm_op
    from poplar_ext.hardware.discovery import discover_cluster
    from poplar_ext.plan.formats import save_cluster
    from poplar_ext.profiler import profile_with

    if get_accelerator().device_name() == "cpu":
        # This command owns its process: spare it DeepSpeed's compile of an op that
        # only inference uses (see poplar_ext.hardware.cpu_process).
        skip_deepspeed_shm_op()

    if options.cluster is None:
        cluster = discover_cluster()
        if process_group_rank()[0] == 0:
            target = Path(options.cache_dir) / DISCOVERED_CLUSTER_FILE
            save_cluster(cluster, target)
            if options.progress is not None:
                options.progress(f"the cluster read from the hardware: {target}")
        options = dataclasses.replace(options, cluster=cluster)
    return profile_with(options)


def summary(profiles: Sequence[Any]) -> str:
    """One line per profile, for the end of a run."""
    lines = ["device type       stage  checkpointing  optimizer offload  largest micro-batch  sizes  optimizer step"]
    for p in profiles:
        lines.append(
            f"{p.device_type:<17} {p.zero_stage:>5}  {'on' if p.activation_checkpointing else 'off':>13}  "
            f"{'on' if p.optimizer_offload else 'off':>17}  "
            f"{p.max_micro_batch_size:>19}  {len(p.samples):>5}  {p.optimizer_step_time_s * 1e3:>11.1f} ms"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``poplar-profile``; returns the exit status."""
    try:
        options = parse_command(argv)
    except UsageError as exc:
        print(f"poplar-profile: error: {exc}", file=sys.stderr)
        return 2
    try:
        profiles = run(options)
    except (ValueError, FormatError) as exc:
        print(f"poplar-profile: error: {exc}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        # A pipeline model gets layer profiles only (their progress lines name each file).
        print(summary(profiles) if profiles else f"layer profiles in {Path(options.cache_dir) / 'layers'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
