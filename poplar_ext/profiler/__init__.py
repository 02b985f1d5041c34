"""The profiler: every device type of a job measured at each ZeRO stage, like training.

`profile_model` (`api`, collective) is the entry, `profile_layers` (`per_layer`) its per-layer counterpart,
``poplar-profile`` the `cli`; DEVELOPING.md's map lists the modules.
See docs/profiling.md and profiles/README.md ("How profiles are measured").
"""

from poplar_ext.profiler.api import profile_model, profile_with, training_dtype
from poplar_ext.profiler.options import ProfileOptions, log_progress

__all__ = ["ProfileOptions", "log_progress", "profile_model", "profile_with", "training_dtype"]
