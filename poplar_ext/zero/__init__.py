"""The ZeRO engine: a plan trained inside DeepSpeed's own ``DeepSpeedEngine``, every rank holding
the model, with its own micro-batch size and accumulation count.

Read in the order a job meets them:

* `planning`: which plan the job runs (a plan file, or a search at start), checked on every rank;
* `initialize`: DeepSpeed's initialize with the plan's per-rank batches (what `poplar_ext.initialize`
  calls for a model that is not a `poplar_ext.pipeline.PoplarPipelineModule`);
* `engine`: `PoplarEngine`, the proxy that weights the loss, counts samples and logs.

It builds on the engine-independent core in `poplar_ext.runtime` (config, loss weight, data,
re-balancing, checkpoint state), as `poplar_ext.pipeline` does. See docs/design.md.
"""

from poplar_ext.zero.engine import PoplarEngine
from poplar_ext.zero.planning import StalePlanWarning

__all__ = ["PoplarEngine", "StalePlanWarning"]
