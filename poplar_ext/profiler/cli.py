"""``poplar-profile``: the model's options, then one option per `ProfileOptions` field; the work is
`profile_with`'s. Usage: docs/profiling.md and profiles/README.md."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from poplar_ext.plan import kinds
from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import OFFLOAD_STAGES, load_cluster, read_json, save_cluster
from poplar_ext.plan.validation import did_you_mean
from poplar_ext.profiler.options import (
    BUILT_IN_SEQUENCE_LENGTHS,
    HF_MAX_SEQUENCE_LENGTH,
    NO_OPTIMIZER,
    ProfileOptions,
    at_least,
    log_progress,
    read_callable,
)
from poplar_ext.search.cli_common import CommandParser, printing
from poplar_ext.section import SECTION, PoplarConfig, poplar_config_from_dict

BUILTIN_MODELS = ("toy-gpt", "gpt2-small")
HF_PREFIX = "hf:"
"""``--model hf:CONFIG_CLASS``: a transformers model built from its config (random weights)."""

HF_PER_LAYER = (
    "--per-layer: expected a pipeline model to profile layer by layer, found --model {model}, a whole Hugging Face "
    "model (profiled whole: leave --per-layer out); for layer profiles of a causal LM give --model MODULE:FACTORY "
    "returning poplar_ext.pipeline.causal_lm_layers(model).layers, --batch MODULE:FACTORY returning (input_ids, "
    "labels) and --loss MODULE:NAME naming a poplar_ext.pipeline.causal_lm.CausalLMLoss() (docs/profiling.md)"
)
"""Why ``--model hf:... --per-layer`` is refused before any rank joins (its model is no list of layers)."""
DISCOVERED_CLUSTER_FILE = "cluster.json"
"""Where, in the output directory, a run without --cluster writes the cluster it discovered."""
SECTION_DEFAULTS = {"cluster": "cluster", "cache_dir": "profiles"}
"""The `ProfileOptions` fields whose option defaults to the DeepSpeed config's poplar section: the section's key."""
GIVEN = "given_options"
"""The parsed arguments' set of the `SECTION_DEFAULTS` fields whose option was given."""


class UsageError(ValueError):
    """Bad command-line input: reported in one line, exit status 2."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommandOptions(ProfileOptions):
    """`ProfileOptions` with what the command alone does with them."""

    cluster_setting: str | None = None
    """``poplar.cluster of FILE`` where `cluster` is the file the --deepspeed_config's poplar section names (not
    --cluster's): one not there yet is written with the cluster read from the hardware (profile first, then
    train with that config). None: --cluster, or no cluster."""


class _Given(argparse.Action):
    """Stores the option's value and records that it was given: the section's value is the default only where it
    was not, and a value equal to the field's default cannot tell."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, GIVEN, getattr(namespace, GIVEN, frozenset()) | {self.dest})


class _Parser(CommandParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage dump
        raise UsageError(message.removeprefix("argument "))


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The argument parser (standalone, or filled into a subcommand's `parser`): the model's options, then
    one per `ProfileOptions` field."""
    parser = parser or _Parser(
        prog="poplar-profile",
        description=(
            "Measure each device type of the job at each ZeRO stage (micro-step time curve, "
            "optimizer-step time, peak memory, largest micro-batch) and write one profile per "
            "(model, device type, stage, activation checkpointing, optimizer offload). Run it under the deepspeed "
            "launcher or torchrun, like training; profiles already in --output-dir with the same keys are reused."
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
        "measurement). Its poplar section, if any, is checked as training checks it, and gives --cluster and "
        "--output-dir their defaults",
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
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument(
        "--optimizer",
        dest="optimizer",
        type=_argparse_type(read_callable),
        metavar="MODULE:FACTORY",
        help="optimizer_factory(parameters) -> the torch optimizer, for a --deepspeed_config without an 'optimizer' "
        "section: the one a training script that builds its own optimizer passes to initialize (e.g. "
        "torch.optim.AdamW(parameters, lr=1e-3)), so that the profiles are keyed as that job looks them up "
        "(default: the config's 'optimizer' section)",
    )
    _add_field_options(parser)
    _add_model_options(parser)
    # Appended by the deepspeed launcher; the rank comes from the environment.
    parser.add_argument(
        "--local_rank", "--local-rank", dest="local_rank", type=int, default=None, help=argparse.SUPPRESS
    )
    return parser


def _add_field_options(parser: argparse.ArgumentParser) -> None:
    """One option per `ProfileOptions` field not built by hand: its flag, reader, default and help (its
    ``cli_help``, else its docstring)."""
    helps = _field_docstrings()
    for f in dataclasses.fields(ProfileOptions):
        if f.metadata["cli"] is None:
            continue
        spec = dict(f.metadata["cli"])
        flag, read = _flag(f.name), spec.pop("read")
        del spec["flag"]
        if read is not None:
            spec["type"] = _argparse_type(read)
        text = f.metadata["cli_help"] or helps[f.name]
        shown = None
        if f.default is True:  # a --flag/--no-flag pair: the default is the flag, not Python's True
            shown = flag
        elif f.default is not None and f.default is not False:
            shown = ",".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
        if f.name in SECTION_DEFAULTS:
            spec["action"] = _Given
            if shown is None:  # a shown default keeps its words: the help's body says the section comes first
                shown = f"{SECTION}.{SECTION_DEFAULTS[f.name]} in the --deepspeed_config file, where it has one"
        if shown is not None:
            text += f" (default: {shown})"
        parser.add_argument(flag, dest=f.name, default=f.default, help=text.replace("%", "%%"), **spec)


def _flag(name: str) -> str:
    """The option of the `ProfileOptions` field `name`."""
    return _field(name).metadata["cli"]["flag"] or "--" + name.replace("_", "-")


def _field(name: str) -> dataclasses.Field[Any]:
    """The `ProfileOptions` field `name`."""
    return next(f for f in dataclasses.fields(ProfileOptions) if f.name == name)


def _field_docstrings() -> dict[str, str]:
    """Each `ProfileOptions` field's docstring on one line (a field's docstring is in the source only)."""
    body = ast.parse(inspect.getsource(ProfileOptions)).body[0].body  # type: ignore[attr-defined]
    return {
        field.target.id: " ".join(doc.value.value.split()).replace("`", "")
        for field, doc in zip(body, body[1:])
        if isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(field.target, ast.Name)
    }


def _argparse_type(read: Callable[[str], Any]) -> Callable[[str], Any]:
    """`read` as argparse's type: its ValueError the option's one-line error."""

    def convert(text: str) -> Any:
        try:
            return read(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    hf = parser.add_argument_group("Hugging Face models (--model hf:CONFIG_CLASS)")
    hf.add_argument(
        "--hf-config",
        default=None,
        metavar="KEY=VALUE,...",
        help="the config's sizes, e.g. n_layer=12,n_embd=768,n_head=12,vocab_size=50257 (values as JSON; a key "
        "the config class does not use is refused, and so is a size below 1)",
    )
    hf.add_argument(
        "--hf-task",
        default=None,
        choices=("causal-lm", "masked-lm"),
        help="the model head and its labels (default: causal-lm)",
    )
    toy = parser.add_argument_group("built-in models (--model toy-gpt)")
    positive = _argparse_type(at_least(1))
    toy_options = {"layers": "transformer blocks", "hidden_size": "width", "heads": "attention heads"}
    for dest, what in {**toy_options, "vocab_size": "token ids"}.items():
        default = _MODEL_OPTIONS[dest][1]
        toy.add_argument("--" + dest.replace("_", "-"), type=positive, metavar="N", help=f"{what} (default: {default})")


_MODEL_OPTIONS = {
    "layers": ("toy-gpt", 2),
    "hidden_size": ("toy-gpt", 128),
    "heads": ("toy-gpt", 4),
    "vocab_size": ("toy-gpt", 1024),
    "hf_config": (HF_PREFIX + "CONFIG_CLASS", ""),
    "hf_task": (HF_PREFIX + "CONFIG_CLASS", "causal-lm"),
}
"""Each model option's dest: the --model that uses it, and its default (None in the parser: given or not)."""


def _fill_model_options(args: argparse.Namespace) -> None:
    """The model options' defaults filled in; `UsageError` for one given that `--model` does not use (it
    would be ignored: ``--model gpt2-small --layers 4`` profiles gpt2-small's 12 layers)."""
    for dest, (used_by, default) in _MODEL_OPTIONS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
        elif not (args.model.startswith(HF_PREFIX) if used_by.startswith(HF_PREFIX) else args.model == used_by):
            flag = "--" + dest.replace("_", "-")
            raise UsageError(f"{flag}: only with --model {used_by}, not {args.model}; leave it out")


def _imported(spec: str, *, option: str) -> Callable[..., Any]:
    try:
        return read_callable(spec)
    except ValueError as exc:
        raise UsageError(f"{option}: {exc}") from None


def _builtin_model(args: argparse.Namespace) -> tuple[Callable[[], Any], Callable[[int], Any], str, int]:
    from poplar_ext.models.toy_gpt import GPT, GPTConfig

    if args.model == "gpt2-small":
        cfg = GPTConfig.gpt2_small(sequence_length=args.sequence_length or BUILT_IN_SEQUENCE_LENGTHS["gpt2-small"])
    else:
        if args.hidden_size % args.heads:
            raise UsageError(f"--hidden-size: expected a multiple of --heads ({args.heads}), found {args.hidden_size}")
        cfg = GPTConfig(
            vocab_size=args.vocab_size,
            sequence_length=args.sequence_length or BUILT_IN_SEQUENCE_LENGTHS["toy-gpt"],
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
        if str(exc).startswith("--"):  # model_from_config's own messages name their option
            raise UsageError(str(exc)) from None
        # transformers' refusal of the config for the task goes on with every config class the task takes
        text = str(exc).splitlines()[0] if len(str(exc)) > 500 else " ".join(str(exc).split())
        raise UsageError(f"--model {args.model} (--hf-task {args.hf_task}): {text}") from None
    except Exception as exc:  # transformers' own checks of the values (huggingface_hub's strict dataclasses)
        if not isinstance(exc, TypeError) and type(exc).__module__.split(".")[0] not in (
            "huggingface_hub",
            "transformers",
        ):
            raise
        raise UsageError(f"--hf-config: {type(exc).__name__}: {' '.join(str(exc).split())}") from None
    vocab_size = int(probe.config.vocab_size)
    context = getattr(probe.config, "max_position_embeddings", None) or getattr(probe.config, "n_positions", None)
    if (
        args.sequence_length is not None
        and context
        and args.sequence_length > int(context)
        and _position_table(probe, int(context))
    ):
        # Past its positions the model fails in every rank's first forward (GPT-2, BERT: "index out of range");
        # one without a table of learned positions (rotary: Llama, Qwen2, Mistral) runs longer samples.
        key = "n_positions" if "n_positions" in probe.config.to_dict() else "max_position_embeddings"
        raise UsageError(
            f"--sequence-length: expected at most {int(context)}, the positions of {config_class} ({key}), found "
            f"{args.sequence_length}; give --hf-config {key}={args.sequence_length}, or a shorter --sequence-length"
        )
    sequence_length = args.sequence_length or min(HF_MAX_SEQUENCE_LENGTH, int(context or HF_MAX_SEQUENCE_LENGTH))
    del probe

    def make_batch(micro_batch_size: int) -> Any:
        return random_lm_batch(vocab_size, micro_batch_size, sequence_length, task=args.hf_task)

    name = f"{config_class.removesuffix('Config').lower()}-{args.hf_task}"
    return (lambda: model_from_config(config_class, sizes, task=args.hf_task)), make_batch, name, sequence_length


def _position_table(model: Any, positions: int) -> bool:
    """Whether `model` has a table of learned positions: an embedding beside its token embedding of at least
    `positions` rows (GPT-2's ``wpe``, BERT's ``position_embeddings``, OPT's ``embed_positions``), which a longer
    sample indexes past. A rotary model (Llama, Qwen2, Mistral) has none and runs longer samples."""
    import torch

    tokens = model.get_input_embeddings()
    return any(
        isinstance(m, torch.nn.Embedding) and m is not tokens and m.num_embeddings >= positions for m in model.modules()
    )


def parse_command(argv: Sequence[str] | None = None) -> CommandOptions:
    """The command line checked, as `ProfileOptions` (a `CommandOptions`; `cluster` None: `run` discovers it);
    `UsageError` (one line) on bad input."""
    args = build_parser().parse_args(argv)
    if args.checkpointing_toggle is not None and args.activation_checkpointing == "off":
        raise UsageError("--checkpointing-toggle: not used with --activation-checkpointing off; leave one out")
    if args.checkpointing_toggle is not None:
        from poplar_ext.activation_checkpointing import check_toggle_signature  # imports torch: not at start

        try:
            check_toggle_signature(args.checkpointing_toggle, name="--checkpointing-toggle")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    _fill_model_options(args)
    if args.per_layer and args.model.startswith(HF_PREFIX):
        raise UsageError(HF_PER_LAYER.format(model=args.model))
    sizes, limit = args.micro_batch_sizes, args.micro_batch_size_limit
    above = [size for size in sizes or () if size > limit]
    noting = not args.quiet and int(os.environ.get("RANK", "0")) == 0
    if above and noting:  # the limit holds given sizes too
        log_progress(
            f"--micro-batch-sizes: {','.join(map(str, above))} above --max-micro-batch-size ({limit}), not measured"
        )
    if args.optimizer_offload != "off" and not set(args.zero_stages) & set(OFFLOAD_STAGES) and noting:
        stages = ",".join(map(str, args.zero_stages))
        log_progress(
            f"--optimizer-offload {args.optimizer_offload}: nothing offloaded at --zero-stages {stages} (DeepSpeed "
            f"offloads the optimizer at stages {' and '.join(map(str, OFFLOAD_STAGES))} only)"
        )
    ds_config = _deepspeed_config(Path(args.deepspeed_config), optimizer_given=args.optimizer is not None)
    taken = _take_section_defaults(args, _poplar_section(ds_config, Path(args.deepspeed_config)), noting=noting)
    model_factory, make_batch, name, sequence_length = _model(args)
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(ProfileOptions) if f.metadata["cli"] is not None}
    given |= {"model_name": args.model_name or name, "sequence_length": sequence_length}
    return CommandOptions(
        **given,
        progress=None if args.quiet else log_progress,
        model_factory=model_factory,
        make_batch=make_batch,
        ds_config=ds_config,
        optimizer_factory=args.optimizer,
        cluster_setting=taken.get("cluster"),
    )


def _deepspeed_config(config_path: Path, *, optimizer_given: bool = False) -> dict[str, Any]:
    try:
        ds_config = read_json(config_path)  # names the file for unreadable, non-UTF-8 or invalid JSON
    except FormatError as exc:
        raise UsageError(f"--deepspeed_config: {exc}") from None
    if not isinstance(ds_config, dict):
        raise UsageError(
            f"--deepspeed_config: expected a JSON object in {config_path}, found {type(ds_config).__name__}"
        )
    try:  # another of the project's files given here: named for what it is, not for its missing optimizer
        kinds.refuse_other_format(ds_config, str(config_path), kinds.DEEPSPEED_CONFIG.reader)
    except FormatError as exc:
        raise UsageError(f"--deepspeed_config: {exc}") from None
    if "optimizer" not in ds_config and not optimizer_given:
        raise UsageError(
            f"--deepspeed_config: {config_path}: {NO_OPTIMIZER}; or pass --optimizer MODULE:FACTORY, the optimizer "
            "a script that builds its own trains with"
        )
    if "optimizer" in ds_config and optimizer_given:
        # DeepSpeed refuses an optimizer in both places too; a job trains with one of them.
        raise UsageError(
            f"--optimizer: expected either it or an 'optimizer' section in {config_path}, found both (the script's "
            "own optimizer: --optimizer and no section; the config's: the section alone)"
        )
    unfilled = _unfilled_auto_fields(ds_config)
    if unfilled:
        # DeepSpeed takes no "auto": the first engine would fail deep inside it (gradient_clipping: a TypeError in
        # its step), and bf16/fp16 "enabled": "auto" would read as enabled, the profiles keyed in another dtype.
        raise UsageError(
            f'--deepspeed_config: {config_path}: {", ".join(unfilled)}: expected a value, found "auto" (Hugging '
            "Face's Trainer and accelerate fill it when they start; poplar-profile runs neither): write the value "
            "the job trains with (the Trainer's: gradient_clipping its max_grad_norm, 1.0 by default; bf16/fp16 "
            "enabled as its --bf16/--fp16), in this file or a copy of it for profiling. The batch keys may stay "
            '"auto": each measurement sets them'
        )
    return ds_config


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
"""The DeepSpeed config's batch keys: set per measurement (`poplar_ext.profiler.measure.stage_ds_config`), so an
"auto" there is never read."""


def _unfilled_auto_fields(ds_config: dict[str, Any]) -> list[str]:
    """The dotted fields of `ds_config` holding Hugging Face's ``"auto"``, other than the batch keys and the poplar
    section (whose ``global_batch_size`` takes "auto" of its own)."""
    found: list[str] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}.{key}" if path else str(key))
        elif isinstance(value, list):
            for index, item in enumerate(value):
                walk(item, f"{path}[{index}]")
        elif value == "auto":
            found.append(path)

    for key, value in ds_config.items():
        if key not in (*_BATCH_KEYS, SECTION):
            walk(value, str(key))
    return found


def _poplar_section(ds_config: dict[str, Any], config_path: Path) -> PoplarConfig | None:
    """The config's poplar section checked as training checks it, its paths from the config's folder as training
    reads them (None: it has none); `UsageError` naming the file and the field."""
    if SECTION not in ds_config:
        return None
    try:
        return poplar_config_from_dict(
            ds_config[SECTION], base_dir=config_path.resolve().parent, source=str(config_path)
        )
    except FormatError as exc:
        raise UsageError(f"--deepspeed_config: {exc}") from None


def _take_section_defaults(args: argparse.Namespace, section: PoplarConfig | None, *, noting: bool) -> dict[str, str]:
    """Each `SECTION_DEFAULTS` option not given takes the section's value, so that the profiles and the cluster are
    training's; one given that differs is noted (training will not read what it names). The value is checked as
    the option's reader checks the option (`UsageError` naming the section's field). Returns each option taken
    from the section (its dest): ``poplar.KEY of FILE``."""
    taken: dict[str, str] = {}
    if section is None:
        return taken
    for dest, key in SECTION_DEFAULTS.items():
        value = getattr(section, key)
        # Only a path the section names: not the automatic mode's directory, which stands in for none.
        if value is None or (key == "profiles" and section.profiles_defaulted):
            continue
        if dest not in getattr(args, GIVEN, ()):
            try:  # e.g. --output-dir's: a file is no directory (found now, not after the launcher)
                _field(dest).metadata["cli"]["read"](str(value))
            except ValueError as exc:
                raise UsageError(f"--deepspeed_config: {section.source}: {SECTION}.{key}: {exc}") from None
            setattr(args, dest, value)
            taken[dest] = f"{SECTION}.{key} of {section.source}"
        elif noting and Path(getattr(args, dest)).resolve() != value.resolve():
            log_progress(
                f"{_flag(dest)} {getattr(args, dest)} (the command line) used, not {SECTION}.{key} of "
                f"{section.source} ({value}), which training uses"
            )
    return taken


def _model(args: argparse.Namespace) -> tuple[Callable[[], Any], Callable[[int], Any], str | None, int | None]:
    """The model factory, the batch maker, the model's name and its sequence length (None: not known)."""
    if args.model in BUILTIN_MODELS or args.model.startswith(HF_PREFIX):
        if args.batch is not None:
            kind = "the built-in model" if args.model in BUILTIN_MODELS else "the model"
            raise UsageError(f"--batch: {kind} {args.model} makes its own batches; leave --batch out")
        build = _hf_model if args.model.startswith(HF_PREFIX) else _builtin_model
        return build(args)
    hint = did_you_mean(args.model, BUILTIN_MODELS)
    if ":" not in args.model and (hint or args.batch is not None):  # a misspelt built-in name, or no model at all
        raise UsageError(
            f"--model: expected MODULE:FACTORY (e.g. mymodels:build), found {args.model!r}; or a built-in model: "
            f"{', '.join(BUILTIN_MODELS)}{hint}; or {HF_PREFIX}CONFIG"
        )
    if args.batch is None:
        raise UsageError("--batch: required with a --model of your own (MODULE:FACTORY taking the micro-batch size)")
    model_factory = _imported(args.model, option="--model")
    make_batch = _imported(args.batch, option="--batch")
    return model_factory, make_batch, None, args.sequence_length


def run(options: ProfileOptions) -> list[Any]:
    """Profile as `options` say (collective); returns the profiles. Without a cluster, the one read from
    the hardware is measured and written beside the profiles (for poplar-search); a poplar.cluster not there
    yet (`CommandOptions.cluster_setting`) is written with it."""
    from deepspeed.accelerator import get_accelerator

    from poplar_ext.collectives import decided_by_rank0, process_group_rank
    from poplar_ext.hardware.cpu_process import skip_deepspeed_shm_op
    from poplar_ext.hardware.devices import join_job
    from poplar_ext.hardware.discovery import discover_cluster
    from poplar_ext.profiler import profile_with
    from poplar_ext.profiler.cache import writable_directory

    if get_accelerator().device_name() == "cpu":
        # This command owns its process: spare it DeepSpeed's compile of an op that
        # only inference uses (see poplar_ext.hardware.cpu_process).
        skip_deepspeed_shm_op()

    _require_launcher()
    join_job()
    rank = process_group_rank()[0]
    setting = getattr(options, "cluster_setting", None)
    unwritten = setting is not None and decided_by_rank0(lambda: not Path(options.cluster).exists(), rank=rank)
    if options.cluster is None:
        cluster = discover_cluster()
        target = Path(options.cache_dir) / DISCOVERED_CLUSTER_FILE
        if not decided_by_rank0(lambda: _holds_cluster(target, cluster), rank=rank):  # UsageError: another one
            writable_directory(Path(options.cache_dir), rank=rank, name="--output-dir")
            if rank == 0:
                save_cluster(cluster, target)
        if rank == 0 and options.progress is not None:
            options.progress(f"the cluster read from the hardware: {target}")
        options = dataclasses.replace(options, cluster=cluster)
    elif unwritten:  # the section's cluster.json, which this run makes: training reads it from there
        cluster, target = discover_cluster(), Path(options.cluster)
        decided_by_rank0(lambda: _write_section_cluster(cluster, target, setting), rank=rank)
        if rank == 0 and options.progress is not None:
            options.progress(f"the cluster read from the hardware: {target} ({setting}, not there yet)")
        options = dataclasses.replace(options, cluster=cluster)
    return profile_with(options, cache_dir_name="--output-dir")


def _require_launcher() -> None:
    """`UsageError` for a command started by hand: DeepSpeed's MPI discovery would fail with a traceback
    ending in ``No module named 'mpi4py'``."""
    from poplar_ext.collectives import launched

    if launched():
        return
    raise UsageError(
        "no launcher: expected the environment torchrun or the deepspeed launcher sets (RANK, WORLD_SIZE, "
        "MASTER_ADDR), found none; run it as torchrun --nproc_per_node N -m poplar_ext.profiler ... "
        "(one device: --nproc_per_node 1)"
    )


def _write_section_cluster(cluster: Any, path: Path, setting: str) -> None:
    """`cluster` written as `path` (its folder made), or `UsageError` naming `setting` (``poplar.cluster of
    FILE``): a path rank 0 cannot write."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_cluster(cluster, path)
    except OSError as exc:
        raise UsageError(
            f"--deepspeed_config: {setting}: expected a file rank 0 can write the cluster read from the hardware "
            f"into, found {path} ({exc.strerror or exc}); write it there, or give --cluster"
        ) from None


def _holds_cluster(path: Path, cluster: Any) -> bool:
    """Whether `path` holds `cluster` already (a complete cache may sit in a directory rank 0 cannot write);
    `UsageError` where writing the hardware's would lose what it holds: a cluster with emulated types (written
    by hand), or a file that is no cluster. An earlier run's hardware cluster (other hosts, other ranks) is
    replaced."""
    if not path.is_file():
        return False
    move = "move it away to have the hardware's written there"
    try:
        existing = load_cluster(path)
    except OSError:
        return False  # written again: the write says why it cannot
    except FormatError as exc:
        raise UsageError(
            f"--output-dir: {path} exists and is no cluster description ({exc}); mend it, or {move}"
        ) from None
    if existing == cluster:
        return True
    if any(existing.emulation_of(t) is not None for t in existing.type_counts()):
        raise UsageError(
            f"--output-dir: {path} holds another cluster ({_type_text(existing)}) than the hardware's "
            f"({_type_text(cluster)}); pass --cluster {path} to profile the cluster it describes, or {move}"
        )
    return False


def _type_text(cluster: Any) -> str:
    """``2 x cpu, 1 x cpu-slow (emulated)``."""
    return ", ".join(
        f"{count} x {t}{' (emulated)' if cluster.emulation_of(t) is not None else ''}"
        for t, count in cluster.type_counts().items()
    )


def summary(profiles: Sequence[Any]) -> str:
    """One line per profile, for the end of a run."""
    lines = ["device type       stage  checkpointing  optimizer offload  largest micro-batch  sizes  optimizer step"]
    for p in profiles:
        lines.append(
            f"{p.device_type:<17} {p.zero_stage:>5}  {'on' if p.activation_checkpointing else 'off':>13}  "
            f"{'on' if p.optimizer_offload else 'off':>17}  "
            f"{p.max_micro_batch_size:>19}  {len(p.samples):>5}  {p.optimizer_step_time_s * 1e3:>11.1f} ms"
        )
    # Whether each type was measured on itself or emulated (a CPU made slower, its memory capped): the table's
    # names are the cluster's, which say neither.
    devices = {p.device_type: _device_label(p) for p in profiles}
    if devices:
        lines.append(f"devices: {', '.join(devices.values())}")
    return "\n".join(lines)


def _device_label(profile: Any) -> str:
    """``cpu (real)``, ``slow (emulated: 3x slower, 1.5 GB)`` (`poplar_ext.hardware.emulation.device_label`)."""
    from poplar_ext.hardware.emulation import device_label

    return device_label(profile.device_type, profile.emulated)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``poplar-profile``; returns the exit status (stdout's failures as every CLI's: `printing`)."""
    return printing("poplar-profile", _profile, argv)


def _noting_pipeline(factory: Callable[[], Any], noted: list[bool]) -> Callable[[], Any]:
    """`factory`, noting in `noted` whether its first model is a pipeline model (one that gets layer profiles
    only, and no whole-model profile: `profile_with` returns [] for it)."""

    def build() -> Any:
        model = factory()
        if not noted:
            from poplar_ext.profiler.layers import is_pipeline_model

            noted.append(is_pipeline_model(model))
        return model

    return build


def _profile(argv: Sequence[str] | None) -> int:
    pipeline: list[bool] = []
    try:  # UsageError is a ValueError
        options = parse_command(argv)
        if dataclasses.is_dataclass(options):  # a stand-in (tests) has no model to note
            options = dataclasses.replace(options, model_factory=_noting_pipeline(options.model_factory, pipeline))
        profiles = run(options)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in ("torch", "deepspeed"):
            raise
        sys.stderr.write(
            f"poplar-profile: error: expected torch and deepspeed installed, found no module {exc.name!r}: profiling "
            "trains the model (pip install poplar-ext with its dependencies; the --no-deps install serves "
            "poplar-search alone)\n"
        )
        return 2
    except (ValueError, FormatError) as exc:
        # One write: every rank prints it, and print's two writes let the ranks' lines run together.
        sys.stderr.write(f"poplar-profile: error: {exc}\n")
        sys.stderr.flush()
        return 2
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if not profiles and pipeline == [False]:
        # Every stage asked for was abandoned before any type was measured (each progress line says why): the
        # same on every rank, since every rank returns the same profiles. A model never built is not known to be
        # no pipeline model: the line below, as before.
        if rank0:
            stages = ",".join(map(str, options.zero_stages))
            why = "run it without --quiet to see why" if options.progress is None else "the lines above say why"
            sys.stderr.write(
                f"poplar-profile: no profile written: no device type could be measured at --zero-stages {stages} "
                f"(e.g. a real out-of-memory at micro-batch 1); {why}\n"
            )
        return 1
    if rank0:
        # A pipeline model gets layer profiles only (their progress lines name each file).
        print(summary(profiles) if profiles else f"layer profiles in {Path(options.cache_dir) / 'layers'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
