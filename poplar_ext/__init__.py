"""poplar-ext: DeepSpeed ZeRO with per-rank micro-batches for mixed GPU clusters; `initialize` stands in for
`deepspeed.initialize`. Importing it imports no torch (the names below load lazily). See DEVELOPING.md."""

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
