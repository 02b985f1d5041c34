"""Pipelines on a plan: DeepSpeed's PipelineModule and PipelineEngine, pipelines side by side that may differ.

`PoplarPipelineModule`, `causal_lm_layers`. See docs/pipeline.md; each module's line: DEVELOPING.md's map.
"""

from poplar_ext.pipeline.causal_lm import causal_lm_layers
from poplar_ext.pipeline.engine import PoplarPipelineEngine
from poplar_ext.pipeline.module import PoplarPipelineModule

__all__ = ["PoplarPipelineEngine", "PoplarPipelineModule", "causal_lm_layers"]
