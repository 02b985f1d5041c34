"""The profiler: every device type of a job measured at each ZeRO stage, like training (`profile_model`,
`profile_layers`, ``poplar-profile``). See docs/profiling.md and profiles/README.md.

Importing it imports no torch (the names below load lazily): ``poplar-profile --help`` and its bad-input
errors answer at once."""

from poplar_ext import _lazy_attributes

_LAZY = {
    "ProfileOptions": "poplar_ext.profiler.options",
    "log_progress": "poplar_ext.profiler.options",
    "profile_model": "poplar_ext.profiler.api",
    "profile_with": "poplar_ext.profiler.api",
    "training_dtype": "poplar_ext.profiler.api",
}


__getattr__, __dir__ = _lazy_attributes(__name__, _LAZY, globals())

__all__ = ["ProfileOptions", "log_progress", "profile_model", "profile_with", "training_dtype"]
