"""The runtime: a training job that runs a plan inside the real DeepSpeed engine.

Read in the order a job meets them:

* `config`: the ``poplar`` section of the DeepSpeed config, and the per-rank config DeepSpeed gets;
* `planning`: which plan the job runs (a plan file, or a search at start), checked on every rank;
* `initialize`: `poplar_ext.initialize`, DeepSpeed's initialize with the plan's per-rank batches;
* `engine`: `PoplarEngine`, the proxy that weights the loss, counts samples and logs;
* `weighting`: the one place a micro-batch loss is weighted for uneven batches;
* `data`: which samples each rank trains on (`PlanBatchSampler`);
* `checkpoint`: the plan and the data position inside DeepSpeed checkpoints.
"""

from poplar_ext.runtime.data import PlanBatchSampler
from poplar_ext.runtime.engine import PoplarEngine
from poplar_ext.runtime.initialize import initialize
from poplar_ext.runtime.planning import StalePlanWarning

__all__ = ["PlanBatchSampler", "PoplarEngine", "StalePlanWarning", "initialize"]
