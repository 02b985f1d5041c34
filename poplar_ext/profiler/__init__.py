"""The profiler: every device type of a job measured at each ZeRO stage, like training.

Read in the order a measurement runs:

* `api`: `profile_model`, the public entry (collective: every rank calls it), and
  `profile_with`, the same with its arguments in one `ProfileOptions` (`options`);
* `layout`: which device type every rank has, agreed by all ranks;
* `fingerprint`: which model a profile belongs to;
* `cache`: profiles reused by what is inside them;
* `measure`: one DeepSpeed engine per stage, trials agreed by all ranks;
* `sizes`: which micro-batch sizes to try (the memory fit and the largest-size probe);
* `layers`, `per_layer`: layer profiles of a pipeline model (`profile_layers`, for the pipeline search);
* `auto`: profiles measured from inside `poplar_ext.initialize` (automatic mode);
* `cli`: ``poplar-profile`` (also ``deepspeed --module poplar_ext.profiler``).
"""

from poplar_ext.profiler.api import log_progress, profile_model, profile_with, training_dtype
from poplar_ext.profiler.options import ProfileOptions

__all__ = ["ProfileOptions", "log_progress", "profile_model", "profile_with", "training_dtype"]
