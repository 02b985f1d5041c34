"""The profiler: every device type of a job measured at each ZeRO stage, like training (`profile_model`,
`profile_layers`, ``poplar-profile``). See docs/profiling.md and profiles/README.md."""

from poplar_ext.profiler.api import profile_model, profile_with, training_dtype
from poplar_ext.profiler.options import ProfileOptions, log_progress

__all__ = ["ProfileOptions", "log_progress", "profile_model", "profile_with", "training_dtype"]
