"""The training core every engine shares (DEVELOPING.md's map). A few pieces still serve one engine: `reshard`
and `checkpoint.resume_decision` ZeRO's, `rebalance.PipelineDriftMonitor` and `weighting.pipeline_loss_weight`
pipelines'.

Importing it imports no torch (`PlanBatchSampler` loads lazily): ``python -m poplar_ext.runtime.reshard --help``
answers at once."""

from poplar_ext import _lazy_attributes

_LAZY = {"PlanBatchSampler": "poplar_ext.runtime.data"}

__getattr__, __dir__ = _lazy_attributes(__name__, _LAZY, globals())

__all__ = ["PlanBatchSampler"]
