"""The ``poplar`` section (each key: a field of `PoplarConfig`), and the per-rank config DeepSpeed gets.
See docs/training.md."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from poplar_ext.optimizer_offload import offload_deepspeed_optimizer
from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import MAX_GLOBAL_BATCH_SIZE, Plan, read_json
from poplar_ext.plan.validation import Node

# The section itself lives below the profiler (poplar_ext.section), which poplar-profile reads it with;
# its names are imported from here as ever.
from poplar_ext.section import (  # noqa: F401
    AUTO,
    CALIBRATION_ACTIONS,
    DICT_SOURCE,
    PROFILES_DIR_VARIABLE,
    SECTION,
    CalibrationConfig,
    GlobalBatchRequest,
    PoplarConfig,
    RebalanceConfig,
    default_profiles_dir,
    poplar_config_from_dict,
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


_FLOAT16_NAMES = ("fp16", "float16", "half", "torch.float16")
"""How DeepSpeed's config spells float16 (deepspeed/runtime/config.py ``DtypeEnum``)."""
DEEPSPEED_GRADIENT_CLIPPING_DEFAULT = 1.0
"""DeepSpeed 0.19.8's ``gradient_clipping`` where the config sets none (runtime/constants.py)."""


def clipping_in_effect(ds_config: dict) -> str | None:
    """``gradient_clipping`` of `ds_config` as an error's "found" names it (DeepSpeed's default where unset), or None
    where it is off (0 or less)."""
    clipping = ds_config.get("gradient_clipping", DEEPSPEED_GRADIENT_CLIPPING_DEFAULT)
    if isinstance(clipping, (int, float)) and not isinstance(clipping, bool) and clipping <= 0:
        return None
    return repr(clipping) if "gradient_clipping" in ds_config else f"none (DeepSpeed's default, {clipping!r})"


def refuse_unclipped_autocast_scaler(ds_config: dict, *, zero_stage: Any, source: str = DICT_SOURCE) -> None:
    """FormatError for ``torch_autocast`` in float16 with ``gradient_clipping`` (on by default) at ZeRO stages 1-3.

    There DeepSpeed 0.19.8's ZeRO optimizers scale the loss by their own ``torch.amp.GradScaler`` (65536 at first)
    but clip with their fp16 loss scale, 1: the norm they clip is the GradScaler's scale times the true one, and the
    scaler divides by its scale again after the clip, so every step moves the parameters by about
    gradient_clipping / 65536 of the clipped step (the same in plain DeepSpeed, on any number of ranks). At stage 0
    the engine's own GradScaler unscales before clipping. `zero_stage`: the stage trained (anything but 1-3, an
    unknown stage, checks nothing)."""
    autocast = ds_config.get("torch_autocast")
    if not isinstance(autocast, dict) or autocast.get("enabled") is not True:
        return
    if str(autocast.get("dtype")) not in _FLOAT16_NAMES or zero_stage not in (1, 2, 3):
        return
    found = clipping_in_effect(ds_config)
    if found is None:
        return
    raise FormatError(
        source,
        "gradient_clipping",
        f"0 beside torch_autocast.dtype {autocast.get('dtype')!r} at ZeRO stage {zero_stage} (DeepSpeed 0.19.8 "
        "clips the gradients there still multiplied by its GradScaler's scale, 65536 at first, and divides them by "
        "the scale after: every step is about 65536 times too small); or torch_autocast in bfloat16, or ZeRO stage 0",
        found + _AUTOCAST_SCALE_STUCK,
    )


_AUTOCAST_SCALE_STUCK = (
    "; bfloat16 or ZeRO stage 0 are the safe choices: at ZeRO stages 1-3 DeepSpeed skips its GradScaler's update "
    "on an overflow, so a first overflow can repeat at every step (seen on CPU at clipping 0)"
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
    refuse_unclipped_autocast_scaler(ds_config, zero_stage=plan.zero_stage, source=source)
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
    "clipping_in_effect",
    "configured_zero_stage",
    "PROFILES_DIR_VARIABLE",
    "deepspeed_global_batch_size",
    "deepspeed_train_batch_size",
    "default_profiles_dir",
    "load_deepspeed_config",
    "nominal_deepspeed_config",
    "poplar_config_from_dict",
    "refuse_unclipped_autocast_scaler",
    "requested_global_batch_size",
    "requested_zero_stage",
    "throughput_timer_synchronized",
    "unsynchronised_throughput_timer",
]
