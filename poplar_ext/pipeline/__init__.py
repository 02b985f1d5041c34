"""Pipelines on a plan: DeepSpeed's PipelineModule and PipelineEngine, side by side (docs/pipeline.md)."""

from poplar_ext.pipeline.causal_lm import causal_lm_layers
from poplar_ext.pipeline.engine import PoplarPipelineEngine
from poplar_ext.pipeline.module import PoplarPipelineModule

__all__ = ["PoplarPipelineEngine", "PoplarPipelineModule", "causal_lm_layers"]
