"""The training core every engine shares, knowing nothing of which engine runs it (DEVELOPING.md's map).

Importing it imports no torch (`PlanBatchSampler` loads lazily): ``python -m poplar_ext.runtime.reshard --help``
answers at once."""

from poplar_ext import _lazy_attributes

_LAZY = {"PlanBatchSampler": "poplar_ext.runtime.data"}

__getattr__, __dir__ = _lazy_attributes(__name__, _LAZY, globals())

__all__ = ["PlanBatchSampler"]
