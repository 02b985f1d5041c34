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


def _lazy_attributes(module_name: str, names: dict[str, str], namespace: dict[str, Any]) -> tuple[Any, Any]:
    """``__getattr__`` and ``__dir__`` for a package whose `names` (name: the module that defines it) load at
    their first use (PEP 562), so that importing the package imports no torch."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(names[name]), name)
        namespace[name] = value  # looked up once
        return value

    def __dir__() -> list[str]:
        return sorted([*namespace, *names])

    return __getattr__, __dir__


__getattr__, __dir__ = _lazy_attributes(__name__, _LAZY, globals())

__all__ = ["PlanBatchSampler", "PoplarEngine", "StalePlanWarning", "discover_cluster", "initialize", "profile_model"]
