"""poplar-ext: DeepSpeed ZeRO with per-rank micro-batches for mixed GPU clusters."""

from poplar_ext.engine import PoplarEngine, initialize
from poplar_ext.profiler import profile_model

__all__ = ["PoplarEngine", "initialize", "profile_model"]
