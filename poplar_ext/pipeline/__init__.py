"""Pipelines on a plan: DeepSpeed's PipelineModule and PipelineEngine, pipelines side by side that may
differ in layer split, number of stages, micro-batch size and count, with exact global-batch gradients.

    model = PoplarPipelineModule(layers=layers, loss_fn=loss_fn, config="ds_config.json")
    engine, optimizer, loader, scheduler = poplar_ext.initialize(model=model, optimizer=..., training_data=data)
    loss = engine.train_batch()

`causal_lm_layers(model)` turns a Hugging Face causal LM (GPT-2, Llama, Qwen2, Mistral) into
such layers and its loss (`causal_lm`).

See docs/pipeline.md. `module` (the module, the plan's place for this rank), `grid` (the plan
as DeepSpeed's grid; the layers pipelines share), `engine` (the engine's seams), `planning`
and `job` (what is refused, before any collective), `initialize`, `checkpoint`.
"""

from poplar_ext.pipeline.causal_lm import causal_lm_layers
from poplar_ext.pipeline.engine import PoplarPipelineEngine
from poplar_ext.pipeline.module import PoplarPipelineModule

__all__ = ["PoplarPipelineEngine", "PoplarPipelineModule", "causal_lm_layers"]
