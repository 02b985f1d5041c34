"""The training core every engine shares, knowing nothing of which engine runs it.

`config`, `weighting`, `data`, `evaluation`, `rebalance`, `checkpoint`, `reshard`, `process_settings`: each
module's line in DEVELOPING.md's map. The engines over it: `poplar_ext.zero` and `poplar_ext.pipeline`.
"""

from poplar_ext.runtime.data import PlanBatchSampler

__all__ = ["PlanBatchSampler"]
