"""poplar-ext: DeepSpeed ZeRO with per-rank micro-batches for mixed GPU clusters."""
