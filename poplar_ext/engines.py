"""`poplar_ext.initialize`: DeepSpeed pipelines for a `PoplarPipelineModule`, DeepSpeed ZeRO for any other model
(an engine is one more folder and one more branch here). See docs/design.md ("Engines over one core")."""

from __future__ import annotations

from typing import Any

from poplar_ext.elastic import ends_job_on_user_error


@ends_job_on_user_error
def initialize(
    args: Any = None,
    model: Any = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: dict | str | None = None,
    mesh_param: Any = None,
    config_params: dict | str | None = None,
    loss_fn: Any = None,
    checkpointing_toggle: Any = None,
) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize`` with the plan of the config's ``poplar`` section (collective).

    Same arguments and return values as DeepSpeed's: ``(engine, optimizer, training_dataloader, lr_scheduler)``; the
    dataloader (None without `training_data`) yields this rank's micro-batches. A
    `poplar_ext.pipeline.PoplarPipelineModule` gets a `PoplarPipelineEngine` (its plan was settled when the module was
    built); any other model a `PoplarEngine` over DeepSpeed ZeRO, where `loss_fn` and `checkpointing_toggle` serve its
    automatic profiling and the plan's activation checkpointing (`poplar_ext.zero.initialize.initialize`). Raises
    ValueError, on every rank alike and before any collective, for a bad config or a plan that cannot run; under
    torchrun's restarting agent, a ValueError or TypeError it raises ends the job instead of a restart
    (`poplar_ext.elastic`)."""
    common = dict(
        args=args, model=model, optimizer=optimizer, model_parameters=model_parameters, training_data=training_data,
        lr_scheduler=lr_scheduler, mpu=mpu, dist_init_required=dist_init_required, collate_fn=collate_fn,
        config=config, config_params=config_params, mesh_param=mesh_param,
    )  # fmt: skip
    zero_only = dict(distributed_port=distributed_port, loss_fn=loss_fn, checkpointing_toggle=checkpointing_toggle)
    from poplar_ext.pipeline.module import PoplarPipelineModule

    if isinstance(model, PoplarPipelineModule):
        # The pipeline module was built with its process group, profiles and layers: these would be
        # ignored, which a user who passed them would not expect.
        given = [name for name, value in zero_only.items() if value is not None]
        if given:
            raise ValueError(
                f"poplar_ext.initialize: {', '.join(given)}: expected None for a PoplarPipelineModule (the module "
                "was built with its process group and layer profiles), found a value"
            )
        from poplar_ext.pipeline.initialize import initialize_pipeline

        return initialize_pipeline(**common)
    from poplar_ext.zero.initialize import initialize as initialize_zero

    return initialize_zero(**common, **zero_only)
