"""Pipelines on a plan: DeepSpeed's PipelineModule and PipelineEngine, pipelines side by side that may
differ in layer split, number of stages, micro-batch size and count, with exact global-batch gradients.

    model = PoplarPipelineModule(layers=layers, loss_fn=loss_fn, config="ds_config.json")
    engine, optimizer, loader, scheduler = poplar_ext.initialize(model=model, optimizer=..., training_data=data)
    loss = engine.train_batch()

See docs/pipeline.md. `module` (the module, the plan's place for this rank), `grid` (the plan
as DeepSpeed's grid; the layers pipelines share), `engine` (the engine's seams), `planning`
and `job` (what is refused, before any collective), `initialize`, `checkpoint`.
"""

from poplar_ext.pipeline.engine import PoplarPipelineEngine
from poplar_ext.pipeline.module import PoplarPipelineModule

__all__ = ["PoplarPipelineEngine", "PoplarPipelineModule"]
