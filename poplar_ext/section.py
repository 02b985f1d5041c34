"""The ``poplar`` section of a DeepSpeed config (each key: a field of `PoplarConfig`): its fields, checked, and
its paths resolved; read alike by training (`poplar_ext.runtime.config`) and poplar-profile. See docs/training.md."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from poplar_ext.optimizer_offload import OFFLOAD_MODES
from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import MAX_GLOBAL_BATCH_SIZE, POLICIES, ZERO_STAGES
from poplar_ext.plan.validation import Node
from poplar_ext.reductions import REDUCTIONS

SECTION = "poplar"

AUTO = "auto"
"""The value that leaves a batch size to poplar-ext (DeepSpeed's and Hugging Face's convention)."""

DICT_SOURCE = "<DeepSpeed config dict>"
"""How error messages name a DeepSpeed config given as a dict rather than a file."""

CALIBRATION_ACTIONS = ("rescale", "remeasure", "off")
"""What a profile off by more than the threshold gets: its curve rescaled, measured again, or nothing
(``off`` also skips the timing)."""


@dataclass(frozen=True, kw_only=True)
class GlobalBatchRequest:
    """The global batch a job asks for, and which setting says so."""

    size: int | str | None
    """Samples per optimizer step; ``"auto"`` (the search picks); None (nothing set: a plan decides)."""
    origin: str
    """The setting it comes from, for messages (e.g. ``train_batch_size``)."""
    left_auto: tuple[str, ...] = ()
    """Without a size: the DeepSpeed batch keys left ``"auto"`` (only the Trainer and accelerate fill them in)."""


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
    the mean over the global batch's tokens). Read by `poplar_ext.initialize`'s engine and `PoplarAccelerator`; a
    Hugging Face Trainer weights its loss as its ``loss_is_scaled_for_ga`` says (docs/trainer.md)."""
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
