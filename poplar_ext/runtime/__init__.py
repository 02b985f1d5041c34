"""The training core that every engine shares, knowing nothing of which engine runs it.

* `config`: the ``poplar`` section of the DeepSpeed config, and the per-rank config DeepSpeed gets;
* `weighting`: the one place a micro-batch loss is weighted for uneven batches;
* `data`: which samples each rank trains on (`PlanBatchSampler`), evaluation's batches (`evaluation`);
* `rebalance`: drift measured, a new plan agreed and switched at an iteration boundary;
* `checkpoint`, `reshard`: the plan and the data position inside DeepSpeed checkpoints, and what a
  resume under another plan carries over;
* `process_settings`: process-wide CPU settings, applied only when the config asks.

The engines over it: `poplar_ext.zero` (DeepSpeed ZeRO) and `poplar_ext.pipeline` (DeepSpeed
pipelines); `poplar_ext.initialize` picks one (`poplar_ext.engines`).
"""

from poplar_ext.runtime.data import PlanBatchSampler

__all__ = ["PlanBatchSampler"]
