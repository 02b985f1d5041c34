"""poplar-ext: DeepSpeed ZeRO with per-rank micro-batches for mixed GPU clusters.

The package tree is the data flow: `plan` (the formats every part shares: profiles,
clusters, plans), `search` (profiles -> plan; numpy and scipy only), `hardware` (what each
rank runs on), `profiler` (profiles of each device type), `runtime` (the training core every
engine shares), `zero` and `pipeline` (a plan trained on DeepSpeed ZeRO or on DeepSpeed
pipelines; `engines` picks one), `integrations` (the Hugging Face Trainer, TRL, accelerate).
`collectives` holds every collective the package issues; `models` the toy models of the demo
and the examples. DEVELOPING.md draws the tree.

Importing `poplar_ext` imports no torch: the names below load their modules on first use,
so that `poplar_ext.plan` and `poplar_ext.search` work where torch is not installed.

Logs go to the ``poplar_ext`` logger, which only has a `logging.NullHandler`: the
application decides where they go.
"""

import importlib
import logging
from typing import Any

logging.getLogger(__name__).addHandler(logging.NullHandler())

_LAZY = {
    "discover_cluster": "poplar_ext.hardware.discovery",
    "profile_model": "poplar_ext.profiler",
    "PlanBatchSampler": "poplar_ext.runtime",
    "PoplarEngine": "poplar_ext.zero",
    "StalePlanWarning": "poplar_ext.zero",
    "initialize": "poplar_ext.engines",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'poplar_ext' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = ["PlanBatchSampler", "PoplarEngine", "StalePlanWarning", "discover_cluster", "initialize", "profile_model"]
