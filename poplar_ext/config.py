"""The ``poplar`` section of a DeepSpeed config, and the per-rank config DeepSpeed gets.

A DeepSpeed JSON config plus a top-level section::

    "poplar": {
        "cluster": "cluster.json",        # required: device type of every rank
        "plan": "plan.json",              # a plan from poplar-search, or instead:
        "profiles": "profiles/",          # profiles to search a plan from at start
        "policy": "poplar",               # search policy (uniform, proportional, poplar)
        "global_batch_size": 96,          # for the search; default: train_batch_size
        "max_global_batch_size": null,    # for the search when no global batch is given
        "zero_stage": "auto",             # the search picks the stage; or 0-3; absent: the
                                          #   DeepSpeed config's zero_optimization.stage, else auto
        "seed": 0,                        # data shuffle seed
        "shuffle": true,
        "loss_reduction": "mean",         # how the training loss reduces over a micro-batch
        "log_interval_steps": 10          # true global batch and samples/s every N steps; 0: never
    }

Relative paths are relative to the config file's directory (to the working
directory when the config is a dict). DeepSpeed ignores unknown top-level keys, so
the same file also works with plain ``deepspeed.initialize``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from search.formats import POLICIES, Plan
from poplar_ext.weighting import REDUCTIONS

SECTION = "poplar"


@dataclass(frozen=True, kw_only=True)
class PoplarConfig:
    """The validated ``poplar`` section."""

    cluster: Path
    """Cluster description: which device type (real or emulated) each rank has."""
    plan: Path | None = None
    """A plan file; when absent, a plan is searched from `profiles` at start."""
    profiles: Path | None = None
    """Directory of profiles: searched when there is no plan, and used to check a plan."""
    policy: str = "poplar"
    """Search policy when searching at start."""
    global_batch_size: int | None = None
    """Global batch for the search; default: the DeepSpeed config's train_batch_size, else the search picks."""
    max_global_batch_size: int | None = None
    """Upper bound for the search when it picks the global batch."""
    zero_stage: int | str | None = None
    """``"auto"`` (the search picks), 0-3, or None (zero_optimization.stage decides, else auto)."""
    seed: int = 0
    """Seed of the per-epoch data shuffle."""
    shuffle: bool = True
    """Shuffle each epoch (False: samples in index order)."""
    loss_reduction: str = "mean"
    """``mean``: the loss given to backward is a mean over the micro-batch; ``sum``: a sum."""
    log_interval_steps: int = 10
    """Log the true global batch and samples/s every this many optimizer steps (0: never)."""


def _fail(key: str, expected: str, found: Any) -> ValueError:
    return ValueError(f"{SECTION}.{key}: expected {expected}, found {found!r}")


def _optional_int(section: dict, key: str, minimum: int) -> int | None:
    value = section.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(key, f"an integer >= {minimum}", value)
    return value


def _path(section: dict, key: str, base_dir: Path) -> Path | None:
    value = section.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise _fail(key, "a path (a non-empty string)", value)
    path = Path(value)
    return path if path.is_absolute() else base_dir / path


def poplar_config_from_dict(section: Any, *, base_dir: Path) -> PoplarConfig:
    """Validate the ``poplar`` section; raises ValueError naming the field."""
    if not isinstance(section, dict):
        raise ValueError(f"{SECTION}: expected an object with at least 'cluster' and 'plan' or 'profiles', found {section!r}")
    known = {f.name for f in fields(PoplarConfig)}
    unknown = sorted(set(section) - known)
    if unknown:
        raise _fail(unknown[0], f"one of the keys {sorted(known)}", "an unknown key")
    cluster = _path(section, "cluster", base_dir)
    if cluster is None:
        raise _fail("cluster", "the path of a cluster description", None)
    plan = _path(section, "plan", base_dir)
    profiles = _path(section, "profiles", base_dir)
    if plan is None and profiles is None:
        raise ValueError(f"{SECTION}: expected 'plan' (a plan file) or 'profiles' (a directory to search a plan from), found neither")
    policy = section.get("policy", "poplar")
    if policy not in POLICIES:
        raise _fail("policy", f"one of {list(POLICIES)}", policy)
    seed = section.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise _fail("seed", "an integer >= 0", seed)
    shuffle = section.get("shuffle", True)
    if not isinstance(shuffle, bool):
        raise _fail("shuffle", "true or false", shuffle)
    reduction = section.get("loss_reduction", "mean")
    if reduction not in REDUCTIONS:
        raise _fail("loss_reduction", "'mean' or 'sum'", reduction)
    log_interval = _optional_int(section, "log_interval_steps", 0)
    zero_stage = section.get("zero_stage")
    if zero_stage is not None and (type(zero_stage) not in (int, str) or zero_stage not in ("auto", 0, 1, 2, 3)):
        raise _fail("zero_stage", "'auto' or 0, 1, 2, 3", zero_stage)
    return PoplarConfig(
        cluster=cluster,
        plan=plan,
        profiles=profiles,
        policy=policy,
        global_batch_size=_optional_int(section, "global_batch_size", 1),
        max_global_batch_size=_optional_int(section, "max_global_batch_size", 1),
        seed=seed,
        shuffle=shuffle,
        loss_reduction=reduction,
        log_interval_steps=10 if log_interval is None else log_interval,
        zero_stage=zero_stage,
    )


def load_deepspeed_config(config: Any = None, *, config_params: Any = None, args: Any = None) -> tuple[dict, Path]:
    """The DeepSpeed config as a dict, and the directory relative paths start from.

    Accepts what ``deepspeed.initialize`` accepts: `config` (dict or path),
    `config_params` (its older name) or ``args.deepspeed_config`` (a path).
    """
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
        return copy.deepcopy(value), Path.cwd()
    if not isinstance(value, (str, Path)):
        raise ValueError(f"{name}: expected a dict or the path of a JSON file, found {type(value).__name__}")
    path = Path(value)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{name}: expected a readable JSON file, found {path} ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{name}: expected a JSON object in {path}, found {type(data).__name__}")
    return data, path.resolve().parent


def configured_zero_stage(ds_config: dict) -> int | None:
    """The ZeRO stage the DeepSpeed config sets explicitly, or None (the plan decides)."""
    stage = ds_config.get("zero_optimization", {}).get("stage")
    if stage is None:
        return None
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage: expected 0, 1, 2 or 3, found {stage!r}")
    return stage


def requested_zero_stage(poplar_config: PoplarConfig, ds_config: dict) -> int | None:
    """The ZeRO stage to train at, or None for the plan's (or the search's) choice.

    ``poplar.zero_stage`` wins when set; ``"auto"`` then needs zero_optimization.stage
    absent (the search may pick any stage), and a number must agree with it.
    Without ``poplar.zero_stage``, zero_optimization.stage decides; absent too: auto.
    """
    configured = configured_zero_stage(ds_config)
    requested = poplar_config.zero_stage
    if requested is None:
        return configured
    if configured is not None and requested != configured:
        raise ValueError(
            f"{SECTION}.zero_stage: expected {configured} (as zero_optimization.stage) or no zero_optimization.stage, "
            f"found {requested!r} beside zero_optimization.stage {configured}"
        )
    return None if requested == "auto" else requested


def nominal_deepspeed_config(ds_config: dict, plan: Plan, rank: int) -> dict:
    """The config DeepSpeed gets on `rank`: valid on its own, with this rank's batch values.

    DeepSpeed only checks ``train_batch_size == micro * accumulation * W`` locally, so
    each rank's nominal train_batch_size is ``b_r * s_r * W``; the true global batch is
    the plan's and is what poplar-ext logs. A ``train_batch_size`` in the user's config
    must equal the plan's global batch (it is then replaced).
    """
    given = ds_config.get("train_batch_size")
    if given is not None and given != plan.global_batch_size:
        raise ValueError(
            f"train_batch_size: expected the plan's global batch ({plan.global_batch_size}) or no value, found {given!r}"
        )
    rank_plan = plan.ranks[rank]
    nominal = copy.deepcopy(ds_config)
    nominal["train_micro_batch_size_per_gpu"] = rank_plan.micro_batch_size
    nominal["gradient_accumulation_steps"] = rank_plan.gradient_accumulation_steps
    nominal["train_batch_size"] = rank_plan.samples_per_iteration * plan.world_size
    nominal.setdefault("zero_optimization", {})["stage"] = plan.zero_stage
    return nominal


__all__ = [
    "PoplarConfig",
    "SECTION",
    "configured_zero_stage",
    "load_deepspeed_config",
    "nominal_deepspeed_config",
    "poplar_config_from_dict",
    "requested_zero_stage",
]
