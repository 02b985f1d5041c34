"""poplar-ext: DeepSpeed ZeRO with per-rank micro-batches for mixed GPU clusters."""

from poplar_ext.engine import PoplarEngine, initialize

__all__ = ["PoplarEngine", "initialize"]
