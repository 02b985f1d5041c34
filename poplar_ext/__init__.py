"""poplar-ext: DeepSpeed ZeRO with per-rank micro-batches for mixed GPU clusters.

The package tree is the data flow: `hardware` (what each rank runs on) feeds the
`profiler` (profiles of each device type), the search (the top-level ``search``
package, no torch) turns profiles into a plan, and the `runtime` trains that plan
in DeepSpeed. `collectives` holds every collective the package issues; `models`
holds the toy GPT used by the demo and the examples.

Logs go to the ``poplar_ext`` logger, which only has a `logging.NullHandler`: the
application decides where they go.
"""

import logging

from poplar_ext.hardware.discovery import discover_cluster
from poplar_ext.profiler import profile_model
from poplar_ext.runtime import PlanBatchSampler, PoplarEngine, StalePlanWarning, initialize

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["PlanBatchSampler", "PoplarEngine", "StalePlanWarning", "discover_cluster", "initialize", "profile_model"]
