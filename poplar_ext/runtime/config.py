"""The ``poplar`` section (each key: a field of `PoplarConfig`), and the per-rank config DeepSpeed gets.
See docs/training.md."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from poplar_ext.optimizer_offload import OFFLOAD_MODES, offload_deepspeed_optimizer
from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import MAX_GLOBAL_BATCH_SIZE, POLICIES, ZERO_STAGES, Plan, read_json
from poplar_ext.plan.validation import Node
from poplar_ext.profiler.calibration import CALIBRATION_ACTIONS
from poplar_ext.reductions import REDUCTIONS

SECTION = "poplar"

AUTO = "auto"
"""The value that leaves a batch size to poplar-ext (DeepSpeed's and Hugging Face's convention)."""

DICT_SOURCE = "<DeepSpeed config dict>"
"""How error messages name a DeepSpeed config given as a dict rather than a file."""


@dataclass(frozen=True, kw_only=True)
class RebalanceConfig:
    """``poplar.rebalance``: re-planning during training when devices drift (`poplar_ext.runtime.rebalance`)."""

    enabled: bool | None = None
    """Check for drift and switch plans. ``"auto"`` (None, the default): on wherever it can run,
    that is where ``poplar.profiles`` holds a profile of every device type at the plan's stage
    (the curves it re-plans from), compute can be measured (not on CUDA at ZeRO stages 2-3:
    `poplar_ext.runtime.rebalance.unmeasurable_reason`) and ``poplar.drop_last`` is false, off
    otherwise (said once in the log);
    its cost without drift is measured by ``poplar-bench drift`` (bench/results/drift.md). ``true``: on, and an
    error where it cannot run; ``false``: off. It also needs the engine's batch sampler (the
    dataloader `initialize` returns, or ``engine.create_batch_sampler``): a job that feeds
    batches of its own keeps its plan, with a note in the log."""
    check_interval_steps: int = 10
    """Every this many optimizer steps the ranks share their measured compute time against the
    prediction (two small collectives)."""
    threshold: float = 0.2
    """A rank has drifted when its measured compute time is off its prediction by more than this
    share, either way (0.2: slower than 1.2x its prediction, or faster than 1/1.2x)."""
    min_gain: float = 0.05
    """Switch plans only when the new plan's predicted iteration time is shorter by more than this
    share of the current plan's, both under the drifted speeds."""
    sustained_checks: int = 2
    """A drift counts only when it holds over this many consecutive checks (one noisy interval is no drift)."""


@dataclass(frozen=True, kw_only=True)
class CalibrationConfig:
    """``poplar.calibration``: cached profiles checked at start before a plan is searched from them
    (`poplar_ext.profiler.calibration`); only in the automatic mode, where initialize has the model and data."""

    action: str = "rescale"
    """What a device type whose timed micro-steps are off its cached profile by more than `threshold`
    gets: ``rescale`` (its curve's micro-step times scaled by measured / profiled), ``remeasure``
    (profiled again, the cache updated) or ``off`` (no check, nothing timed). The plan records which
    (``calibration`` in the plan and in ``engine.plan_history``) and the log says it."""
    threshold: float = 0.1
    """Largest |measured / profiled - 1| (median over the plan's micro-batch sizes) a profile is
    trusted with as it is (0.1: 10%)."""
    repeats: int = 3
    """Micro-steps timed per size (after one warm-up); all ranks at once, as training runs them."""


@dataclass(frozen=True, kw_only=True)
class PoplarConfig:
    """The validated ``poplar`` section."""

    cluster: Path | None = None
    """Cluster description: which device type (real or emulated) each rank has; read by rank 0
    alone and checked against every rank's hardware. None: discovered from the hardware."""
    plan: Path | None = None
    """A plan file; when absent, a plan is searched from `profiles` at start."""
    profiles: Path | None = None
    """Directory of profiles: searched when there is no plan (made when missing: the automatic mode measures
    into it), and used to check a plan (then it must exist: it is only read). Without a plan
    and without this, `default_profiles_dir` (the automatic mode: missing profiles are measured there)."""
    policy: str = "poplar"
    """Search policy when searching at start (a pipeline job's search has only ``poplar``). Beside a `plan` it
    must be the plan's own (a plan file fixes the allocation: another policy would not be applied), so it is
    best left out there."""
    global_batch_size: int | str | None = None
    """Samples per optimizer step over all ranks; ``"auto"``: the search picks the batch with the
    highest predicted throughput (refused beside a `plan`: nothing searches); None: the DeepSpeed config's
    (see `requested_global_batch_size`)."""
    max_global_batch_size: int | None = None
    """Upper bound for the batch the search picks under ``"auto"``; a global batch the config sets, or a
    plan file's, above it is an error (the config would say two things)."""
    zero_stage: int | str | None = None
    """``"auto"`` (the search picks), 0-3, or None (zero_optimization.stage decides, else auto)."""
    seed: int = 0
    """Seed of the per-epoch data shuffle."""
    shuffle: bool = True
    """Shuffle each epoch (False: samples in index order)."""
    drop_last: bool = False
    """End each pass over the loader at the epoch boundary, leaving the last ``num_samples mod B``
    samples of each epoch's order untrained in it; default: the last iteration of an epoch takes
    them and the first samples of the next epoch (see `poplar_ext.runtime.data`)."""
    loss_reduction: str = "mean"
    """How the loss given to backward reduces over the micro-batch: ``mean`` (of samples), ``sum``, or
    ``token_mean`` (of label tokens, ``-100`` ignored: the language-model loss; the optimizer then sees
    the mean over the global batch's tokens)."""
    log_interval_steps: int = 10
    """Log the true global batch and samples/s every this many optimizer steps (0: never), from step 2 (the
    first has no iteration time)."""
    cpu_threads: int | None = None
    """On CPU, torch intra-op threads for this process (``torch.set_num_threads``); None: leave
    torch's setting. Emulated device types need 1 (their compute is timed by the thread's CPU time)."""
    steady_cpu_allocator: bool = False
    """On CPU, keep glibc's freed memory for reuse (the allocator the profiler times under);
    process-wide, see `poplar_ext.hardware.memory.steady_cpu_allocator`."""
    optimizer_offload: str = "off"
    """What the automatic mode's profiling measures offloaded (`profile_model`'s ``optimizer_offload``):
    ``off``, ``smallest`` (the device type(s) with the least memory, at stages 1-2, so the search may
    choose it for them) or ``both`` (every type). Only profiles the directory lacks are measured."""
    rebalance: RebalanceConfig = RebalanceConfig()
    """Re-planning during training when devices drift (``poplar.rebalance``, see `RebalanceConfig`)."""
    calibration: CalibrationConfig = CalibrationConfig()
    """Cached profiles checked at start (``poplar.calibration``, see `CalibrationConfig`)."""
    source: str = DICT_SOURCE
    """The DeepSpeed config file the section came from (not a key of the section: for messages)."""
    profiles_defaulted: bool = False
    """True when `profiles` is `default_profiles_dir` because the section named neither a plan nor profiles."""
    policy_given: bool = False
    """True when the section names `policy` (checked against a plan file's)."""

    @property
    def profiles_setting(self) -> str:
        """Where `profiles` was set, for messages: ``poplar.profiles``, ``$POPLAR_PROFILES_DIR`` or the user cache."""
        if not self.profiles_defaulted:
            return f"{self.source}: {SECTION}.profiles"
        where = f"${PROFILES_DIR_VARIABLE}" if os.environ.get(PROFILES_DIR_VARIABLE) else "the user cache"
        return f"{where} (the automatic mode's profiles: {self.source} names no {SECTION}.plan or {SECTION}.profiles)"

    @property
    def data_order(self) -> dict[str, Any]:
        """The options fixing the order of the data stream: ``seed``, ``shuffle``, ``drop_last``."""
        return {"seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def batch_above_bound(self, request: GlobalBatchRequest) -> FormatError | None:
        """Either engine's refusal where `max_global_batch_size` is below the global batch `request` asks for,
        alike on every rank; None within it, without it, or with no number (auto, none)."""
        limit, field = self.max_global_batch_size, f"{SECTION}.max_global_batch_size"
        if limit is None or not isinstance(request.size, int) or request.size <= limit:
            return None
        expected = f"at least the global batch ({request.size}, from {request.origin}) or no {field}"
        return FormatError(self.source, field, expected, f"number {limit}")


_DERIVED = ("source", "profiles_defaulted", "policy_given")
"""`PoplarConfig` fields that are no keys of the section."""
_KEYS = tuple(f.name for f in fields(PoplarConfig) if f.name not in _DERIVED)


def _path(node: Node | None, base_dir: Path) -> Path | None:
    if node is None:
        return None
    if not isinstance(node.value, str) or not node.value:
        raise node.fail("a path (a non-empty string)")
    path = Path(node.value).expanduser()  # "~/profiles" as a shell and POPLAR_PROFILES_DIR read it
    return path if path.is_absolute() else base_dir / path


def _batch_or_auto(node: Node, *, beside_plan: bool) -> int | str:
    if node.value == AUTO and not beside_plan:
        return AUTO
    if node.value == AUTO:  # it asks the search at start for the batch; beside a plan file nothing searches
        where = f"beside {SECTION}.plan"
        raise node.fail(
            f"a number or none {where} (the plan's global batch; {AUTO!r} lets a search at start pick one)",
            raw_found=f"{AUTO!r} {where}",
        )
    if isinstance(node.value, bool) or not isinstance(node.value, int) or not 1 <= node.value <= MAX_GLOBAL_BATCH_SIZE:
        raise node.fail(f"an integer from 1 to {MAX_GLOBAL_BATCH_SIZE} or {AUTO!r}")
    return node.value


def _enabled(node: Node) -> bool | None:
    if node.value == AUTO:
        return None
    if not isinstance(node.value, bool):
        raise node.fail(f"true, false or {AUTO!r}")
    return node.value


def _parsed(node: Node, defaults: Any, parsers: dict[str, Callable[[Node], Any]]) -> dict[str, Any]:
    """Each key of `parsers` read from `node` by its parser, else `defaults`'."""
    return {
        key: getattr(defaults, key) if (child := node.optional(key)) is None else parse(child)
        for key, parse in parsers.items()
    }


def _subsection(node: Node, cls: type, parsers: dict[str, Callable[[Node], Any]]) -> Any:
    """A nested section (``rebalance``, ``calibration``): an object of `cls`'s keys, each read by its parser."""
    node.obj().keys_within(tuple(f.name for f in fields(cls)))
    return cls(**_parsed(node, cls(), parsers))


_REBALANCE_PARSERS = {
    "enabled": _enabled,
    "check_interval_steps": lambda n: n.integer(minimum=1),
    "threshold": lambda n: n.number(positive=True, maximum=10.0),
    "min_gain": lambda n: n.number(minimum=0.0, maximum=10.0),
    "sustained_checks": lambda n: n.integer(minimum=1, maximum=1000),
}
_CALIBRATION_PARSERS = {
    "action": lambda n: n.string(choices=CALIBRATION_ACTIONS),
    "threshold": lambda n: n.number(positive=True, maximum=10.0),
    "repeats": lambda n: n.integer(minimum=1, maximum=100),
}


PROFILES_DIR_VARIABLE = "POPLAR_PROFILES_DIR"
"""Where the automatic mode keeps profiles when the ``poplar`` section names neither a plan nor profiles."""


def default_profiles_dir() -> Path:
    """``$POPLAR_PROFILES_DIR``, else ``$XDG_CACHE_HOME/poplar-ext/profiles`` (``~/.cache`` when unset): the
    profiles of a job whose ``poplar`` section names neither a plan nor profiles, reused by the next job."""
    configured = os.environ.get(PROFILES_DIR_VARIABLE)
    if configured:
        return Path(configured).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "poplar-ext" / "profiles"


def poplar_config_from_dict(section: Any, *, base_dir: Path, source: str = DICT_SOURCE) -> PoplarConfig:
    """Validate the ``poplar`` section; raises `FormatError` (a ValueError) naming `source` (the DeepSpeed config
    file) and the field."""
    root = Node(section, source, SECTION)
    if not isinstance(section, dict):
        raise root.fail("an object ({} for the automatic mode: the hardware read, profiled and a plan searched)")
    root.keys_within(_KEYS)
    cluster = _path(root.optional("cluster"), base_dir)
    plan = _path(root.optional("plan"), base_dir)
    profiles = _path(root.optional("profiles"), base_dir)
    profiles_defaulted = plan is None and profiles is None
    if profiles_defaulted:
        profiles = default_profiles_dir()
    zero_stage_node = root.optional("zero_stage")
    zero_stage = None if zero_stage_node is None else zero_stage_node.value
    if zero_stage_node is not None and zero_stage != "auto":
        if type(zero_stage) is not int or zero_stage not in ZERO_STAGES:
            raise zero_stage_node.fail("'auto' or an integer from 0 to 3")
    # In the section's order: where several fields are wrong, the message names the first.
    parsers = {
        "policy": lambda n: n.string(choices=POLICIES),
        "global_batch_size": lambda n: _batch_or_auto(n, beside_plan=plan is not None),
        "max_global_batch_size": lambda n: n.integer(minimum=1, maximum=MAX_GLOBAL_BATCH_SIZE),
        "seed": lambda n: n.integer(minimum=0),
        "shuffle": Node.boolean,
        "drop_last": Node.boolean,
        "loss_reduction": lambda n: n.string(choices=REDUCTIONS),
        "log_interval_steps": lambda n: n.integer(minimum=0),
        "cpu_threads": lambda n: n.integer(minimum=1),
        "steady_cpu_allocator": Node.boolean,
        "optimizer_offload": lambda n: n.string(choices=OFFLOAD_MODES),
        "rebalance": lambda n: _subsection(n, RebalanceConfig, _REBALANCE_PARSERS),
        "calibration": lambda n: _subsection(n, CalibrationConfig, _CALIBRATION_PARSERS),
    }
    return PoplarConfig(
        cluster=cluster,
        plan=plan,
        profiles=profiles,
        profiles_defaulted=profiles_defaulted,
        policy_given=root.optional("policy") is not None,
        zero_stage=zero_stage,
        source=source,
        **_parsed(root, PoplarConfig(), parsers),
    )


def load_deepspeed_config(config: Any = None, *, config_params: Any = None, args: Any = None) -> tuple[dict, Path, str]:
    """The DeepSpeed config as a dict, the directory relative paths start from, and its name for messages, from
    what ``deepspeed.initialize`` accepts: `config` (dict or path), `config_params` or ``args.deepspeed_config``."""
    sources = [
        ("config", config),
        ("config_params", config_params),
        ("args.deepspeed_config", getattr(args, "deepspeed_config", None)),
    ]
    given = [(name, value) for name, value in sources if value is not None]
    if len(given) != 1:
        names = [name for name, _ in given] or ["none"]
        raise ValueError(
            "DeepSpeed config: expected exactly one of config=, config_params= or args.deepspeed_config, "
            f"found {', '.join(names)}"
        )
    name, value = given[0]
    if isinstance(value, dict):
        return copy.deepcopy(value), Path.cwd(), DICT_SOURCE
    if not isinstance(value, (str, Path)):
        raise ValueError(f"{name}: expected a dict or the path of a JSON file, found {type(value).__name__}")
    path = Path(value)
    try:
        data = read_json(path)
    except FormatError as exc:
        raise FormatError(exc.source, exc.field, f"{exc.expected} (given as {name})", exc.found) from exc
    Node(data, str(path)).obj()
    return data, path.resolve().parent, str(path)


def configured_zero_stage(ds_config: dict, *, source: str = DICT_SOURCE) -> int | None:
    """The ZeRO stage the DeepSpeed config sets explicitly, or None (the plan decides)."""
    root = Node(ds_config, source)
    if "zero_optimization" not in ds_config:
        return None
    stage = root.field("zero_optimization").obj().optional("stage")
    return None if stage is None else stage.integer(minimum=0, maximum=3)


def requested_zero_stage(poplar_config: PoplarConfig, ds_config: dict) -> int | None:
    """The ZeRO stage to train at, or None for the plan's (or the search's) choice: ``poplar.zero_stage``, which
    must agree with zero_optimization.stage (``"auto"``: none there), else zero_optimization.stage."""
    configured = configured_zero_stage(ds_config, source=poplar_config.source)
    requested = poplar_config.zero_stage
    if requested is None:
        return configured
    if configured is not None and requested != configured:
        raise FormatError(
            poplar_config.source,
            f"{SECTION}.zero_stage",
            f"{configured} (as zero_optimization.stage) or no zero_optimization.stage",
            f"{requested!r} beside zero_optimization.stage {configured}",
        )
    return None if requested == "auto" else requested


@dataclass(frozen=True, kw_only=True)
class GlobalBatchRequest:
    """The global batch a job asks for, and which setting says so."""

    size: int | str | None
    """Samples per optimizer step; ``"auto"`` (the search picks); None (nothing set: a plan decides)."""
    origin: str
    """The setting it comes from, for messages (e.g. ``train_batch_size``)."""
    left_auto: tuple[str, ...] = ()
    """Without a size: the DeepSpeed batch keys left ``"auto"`` (only the Trainer and accelerate fill them in)."""


_DEEPSPEED_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _deepspeed_batch_value(root: Node, key: str) -> int | None:
    node = root.optional(key)
    if node is None or node.value == AUTO:  # Hugging Face's "auto": left to whoever fills it in
        return None
    return node.integer(minimum=1, maximum=MAX_GLOBAL_BATCH_SIZE)


def deepspeed_train_batch_size(ds_config: dict, *, source: str = DICT_SOURCE) -> int | None:
    """The DeepSpeed config's ``train_batch_size``; None where absent or ``"auto"``; `FormatError` for no batch."""
    return _deepspeed_batch_value(Node(ds_config, source).obj(), "train_batch_size")


def deepspeed_global_batch_size(ds_config: dict, *, world_size: int, source: str = DICT_SOURCE) -> GlobalBatchRequest:
    """The global batch DeepSpeed would train with this config on `world_size` ranks: ``train_batch_size``, else
    ``train_micro_batch_size_per_gpu x gradient_accumulation_steps (default 1) x world_size``; ``"auto"`` counts as
    unset (an ``"auto"`` accumulation count leaves the batch unset). All three set must agree, as in DeepSpeed.
    """
    root = Node(ds_config, source).obj()
    total, micro, accumulation = (_deepspeed_batch_value(root, key) for key in _DEEPSPEED_BATCH_KEYS)
    if None not in (total, micro, accumulation) and total != micro * accumulation * world_size:
        raise root.child("train_batch_size").fail(
            f"train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size "
            f"({micro} x {accumulation} x {world_size} = {micro * accumulation * world_size}), as DeepSpeed requires"
        )
    if total is not None:
        return GlobalBatchRequest(size=total, origin="train_batch_size")
    # Whoever fills "auto" (the Trainer, accelerate) decides it; a search without a batch says which keys.
    left_auto = tuple(key for key in _DEEPSPEED_BATCH_KEYS if ds_config.get(key) == AUTO)
    if micro is None or "gradient_accumulation_steps" in left_auto:  # an "auto" count: the filled-in one decides
        return GlobalBatchRequest(size=None, origin="", left_auto=left_auto)
    steps = 1 if accumulation is None else accumulation
    return GlobalBatchRequest(
        size=micro * steps * world_size,
        origin=f"train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size ({micro} x {steps} x "
        f"{world_size})",
    )


def requested_global_batch_size(poplar_config: PoplarConfig, ds_config: dict, *, world_size: int) -> GlobalBatchRequest:
    """The global batch the job trains: ``poplar.global_batch_size``, else DeepSpeed's; a `FormatError` where
    both are set and differ (``"auto"`` beside a DeepSpeed batch too)."""
    deepspeed = deepspeed_global_batch_size(ds_config, world_size=world_size, source=poplar_config.source)
    requested = poplar_config.global_batch_size
    if requested is None:
        return _at_least_one_per_rank(deepspeed, world_size, source=poplar_config.source)
    if deepspeed.size is not None and requested != deepspeed.size:
        raise FormatError(
            poplar_config.source,
            f"{SECTION}.global_batch_size",
            f"the DeepSpeed config's global batch ({deepspeed.size}, from {deepspeed.origin}) or no "
            f"{SECTION}.global_batch_size",
            repr(requested),
        )
    request = GlobalBatchRequest(size=requested, origin=f"{SECTION}.global_batch_size")
    return _at_least_one_per_rank(request, world_size, source=poplar_config.source)


def _at_least_one_per_rank(request: GlobalBatchRequest, world_size: int, *, source: str) -> GlobalBatchRequest:
    """`request`, or a FormatError for a batch below one sample per rank (known before any profiling)."""
    if isinstance(request.size, int) and request.size < world_size:
        raise FormatError(
            source, request.origin, f"at least one sample per rank ({world_size} ranks)", repr(request.size)
        )
    return request


def refuse_unweighted_modes(ds_config: dict, *, source: str = DICT_SOURCE) -> None:
    """FormatError for the DeepSpeed modes the loss weights and the iteration count do not hold under."""
    if ds_config.get("gradient_allreduce_op", "mean") != "mean":
        raise FormatError(
            source,
            "gradient_allreduce_op",
            "'mean' (the loss weights take DeepSpeed's mean over the ranks: a sum makes every gradient the number "
            "of ranks times the global batch's)",
            repr(ds_config["gradient_allreduce_op"]),
        )
    if ds_config.get("managed_gradient_accumulation", True) is not True:
        raise FormatError(
            source,
            "managed_gradient_accumulation",
            "true (poplar-ext ends each rank's iteration at DeepSpeed's accumulation boundary, which DeepSpeed "
            "reports only while it steps otherwise: no iteration would be counted, nor a data position saved)",
            repr(ds_config["managed_gradient_accumulation"]),
        )


def nominal_deepspeed_config(ds_config: dict, plan: Plan, rank: int, *, source: str = DICT_SOURCE) -> dict:
    """The config DeepSpeed gets on `rank`: valid on its own, with this rank's batch values.

    DeepSpeed only checks ``train_batch_size == micro * accumulation * W`` locally, so each rank's nominal
    train_batch_size is ``b_r * s_r * W`` (a user's must equal the plan's global batch). A rank planned with
    ``optimizer_offload`` gets ``zero_optimization.offload_optimizer``, a user's ``offload_optimizer`` stays as it
    is on the other ranks; the throughput timer is not synchronised (`unsynchronised_throughput_timer`).
    """
    given = ds_config.get("train_batch_size")
    if given is not None and given != AUTO and given != plan.global_batch_size:
        raise FormatError(
            source, "train_batch_size", f"the plan's global batch ({plan.global_batch_size}) or no value", repr(given)
        )
    rank_plan = plan.ranks[rank]
    nominal = copy.deepcopy(ds_config)
    nominal["train_micro_batch_size_per_gpu"] = rank_plan.micro_batch_size
    nominal["gradient_accumulation_steps"] = rank_plan.gradient_accumulation_steps
    nominal["train_batch_size"] = rank_plan.samples_per_iteration * plan.world_size
    zero = nominal.setdefault("zero_optimization", {})
    zero["stage"] = plan.zero_stage
    unsynchronised_throughput_timer(nominal, source=source)
    if rank_plan.optimizer_offload:
        offload_deepspeed_optimizer(nominal)
    return nominal


def throughput_timer_synchronized(ds_config: dict, *, source: str = DICT_SOURCE) -> bool:
    """Whether DeepSpeed's throughput timer is to synchronise the device: only where the user's
    ``timers.throughput.synchronized`` says so. It runs around every micro-step where DeepSpeed did not build the
    dataloader, and synchronised it would wait for the device twice per micro-step, stalling the queue of kernels
    (poplar-ext times compute itself).
    """
    section = ds_config
    for field in ("timers", "timers.throughput"):
        section = section.get(field.rsplit(".", 1)[-1], {})
        if not isinstance(section, dict):
            raise FormatError(source, field, "an object", type(section).__name__)
    return bool(section.get("synchronized", False))


def unsynchronised_throughput_timer(ds_config: dict, *, source: str = DICT_SOURCE) -> None:
    """Set ``timers.throughput.synchronized`` in `ds_config` to `throughput_timer_synchronized`'s answer."""
    synchronized = throughput_timer_synchronized(ds_config, source=source)
    ds_config.setdefault("timers", {}).setdefault("throughput", {})["synchronized"] = synchronized


__all__ = [
    "AUTO",
    "DICT_SOURCE",
    "SECTION",
    "GlobalBatchRequest",
    "PoplarConfig",
    "RebalanceConfig",
    "configured_zero_stage",
    "PROFILES_DIR_VARIABLE",
    "deepspeed_global_batch_size",
    "deepspeed_train_batch_size",
    "default_profiles_dir",
    "load_deepspeed_config",
    "nominal_deepspeed_config",
    "poplar_config_from_dict",
    "requested_global_batch_size",
    "requested_zero_stage",
    "throughput_timer_synchronized",
    "unsynchronised_throughput_timer",
]
