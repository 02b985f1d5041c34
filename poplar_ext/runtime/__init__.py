"""The training core every engine shares, knowing nothing of which engine runs it (DEVELOPING.md's map)."""

from poplar_ext.runtime.data import PlanBatchSampler

__all__ = ["PlanBatchSampler"]
