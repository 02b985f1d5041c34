"""`PoplarPipelineModule`: DeepSpeed's PipelineModule, its stages taken from a pipeline plan (docs/pipeline.md)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from deepspeed.pipe import PipelineModule, TiedLayerSpec
from deepspeed.runtime.activation_checkpointing import checkpointing

from poplar_ext.pipeline.grid import LayerSegments, PlanGrid
from poplar_ext.pipeline.job import PipelineJob, prepare_pipeline_job
from poplar_ext.reductions import Reduction
from poplar_ext.runtime.config import load_deepspeed_config
from poplar_ext.runtime.weighting import label_tokens, loss_shifts_labels, pipeline_loss_weight

logger = logging.getLogger(__name__)


class WeightedLoss:
    """A pipeline's micro-batch loss times its weight, for its last stage's backward (`loss_fn` None: the last
    layer's output, DeepSpeed's convention). ``token_mean``: per label token (``s_p * n``), the tokens counted in
    `tokens` for the engine to divide the iteration's gradients by."""

    def __init__(
        self, loss_fn: Callable[[Any, Any], Any] | None, weight: float, *, reduction: Reduction = "mean"
    ) -> None:
        self.loss_fn = loss_fn
        self.weight = weight
        self.reduction = reduction
        self.shifts_labels = loss_fn is not None and loss_shifts_labels(loss_fn)
        self.tokens = 0
        """token_mean: label tokens of the micro-batches weighted since the engine last took them."""
        self.evaluation: torch.Tensor | None = None
        self._micro_batch_size = 1
        self.refused: str | None = None
        """token_mean: why labels could not be counted, for the engine to raise on every rank alike."""
        # DeepSpeed's module prints the loss function's name.
        self.__name__ = (
            "the last layer's output" if loss_fn is None else getattr(loss_fn, "__name__", type(loss_fn).__name__)
        )

    def __call__(self, outputs: Any, labels: Any) -> Any:
        loss = outputs if self.loss_fn is None else self.loss_fn(outputs, labels)
        if self.evaluation is not None:
            return self._evaluated(loss, labels)
        if getattr(loss, "dtype", None) in (torch.float16, torch.bfloat16):
            # Weighted in fp32, as the ZeRO path's weight_loss: a weight like 8/14 rounded to bf16's 8
            # significant bits is off by up to 0.4%; fp16's loss scale multiplies the result, in fp32 too.
            loss = loss.float()
        if self.reduction != "token_mean":
            return loss * self.weight
        tokens = self._label_tokens(labels)
        self.tokens += tokens
        return loss * (self.weight * tokens)

    def _label_tokens(self, labels: Any) -> int:
        # Raised here, on the last stages alone, it would leave the other stages waiting in the schedule:
        # the engine raises it on every rank after the all-reduce that sums the tokens instead.
        try:
            return label_tokens(labels, shifted=self.shifts_labels)
        except ValueError as exc:
            self.refused = str(exc)
            return 0

    @contextmanager
    def evaluating(self, *, device: Any, micro_batch_size: int) -> Iterator[torch.Tensor]:
        """Inside: each loss returned unweighted (DeepSpeed's eval_batch), and added to the tensor yielded,
        ``[sum of loss x count, count, 0]`` (float64), the count a micro-batch's samples (mean; sum: the loss
        unmultiplied) or label tokens (token_mean; the last element for the engine's `refused`). `micro_batch_size`:
        the samples where labels hold no tensor."""
        self.evaluation = torch.zeros(3, dtype=torch.float64, device=device)
        self.refused = None
        self._micro_batch_size = micro_batch_size
        try:
            yield self.evaluation
        finally:
            self.evaluation = None

    def _evaluated(self, loss: Any, labels: Any) -> Any:
        # DeepSpeed's eval_batch averages its micro-batches' losses alike; the engine needs each one's
        # share of the evaluated batch over every pipeline instead (docs/pipeline.md, Evaluation).
        assert self.evaluation is not None
        if self.reduction == "token_mean":
            count = self._label_tokens(labels)
        else:
            count = _samples(labels, default=self._micro_batch_size)
        self.evaluation[0] += loss.detach().double() * (1 if self.reduction == "sum" else count)
        self.evaluation[1] += count
        return loss


def _samples(labels: Any, *, default: int) -> int:
    """A micro-batch's samples: its labels' first dimension (their first tensor where they are a tuple, list or
    dict), else `default`."""
    if isinstance(labels, dict):
        labels = list(labels.values())
    if isinstance(labels, (tuple, list)):
        labels = next((item for item in labels if isinstance(item, torch.Tensor)), None)
    if isinstance(labels, torch.Tensor) and labels.dim() > 0:
        return int(labels.shape[0])
    return default


def _refuse_placement(**arguments: Any) -> None:
    given = [name for name, value in arguments.items() if value is not None]
    if given:
        raise ValueError(
            f"PoplarPipelineModule: expected no {', '.join(given)}, found {', '.join(given)} given; the pipeline "
            "plan (poplar.plan) says how many stages each pipeline has and which layers each stage holds"
        )


def _tied_layers(layers: list[Any]) -> dict[str, list[int]]:
    """Each TiedLayerSpec key and the indices of the layers using it."""
    tied: dict[str, list[int]] = {}
    for index, layer in enumerate(layers):
        if isinstance(layer, TiedLayerSpec):
            tied.setdefault(layer.key, []).append(index)
    return tied


def _stage_checkpointing(
    job: PipelineJob, interval: int, func: Callable[..., Any] | None
) -> tuple[int, Callable[..., Any]]:
    """DeepSpeed's ``activation_checkpoint_interval`` and function for this rank's stage (docs/pipeline.md);
    ValueError, alike on every rank, where the user's interval meets a plan that checkpoints stages."""
    planned = [
        f"pipelines[{p}].stages[{s}]"
        for p, pipeline in enumerate(job.plan.pipelines)
        for s, stage in enumerate(pipeline.stages)
        if stage.activation_checkpointing
    ]
    section = job.ds_config.get("pipeline")
    configured = section.get("activation_checkpoint_interval", 0) if isinstance(section, dict) else 0
    if planned and (interval or configured):
        name = "activation_checkpoint_interval"
        name = name if interval else f"{job.source}: pipeline.{name}"
        raise ValueError(
            f"PoplarPipelineModule: {name}: expected 0 with a plan that checkpoints stages ({planned[0]}"
            f"{f' and {len(planned) - 1} more' if len(planned) > 1 else ''}: activation_checkpointing), found "
            f"{interval or configured}; the plan says which stages recompute their activations: leave the interval "
            "unset, or use a plan without activation_checkpointing"
        )
    stage = job.pipeline.stages[job.stage_index]
    if not stage.activation_checkpointing:
        return interval, func or checkpointing.checkpoint
    logger.info(
        "rank %d: activation checkpointing on its stage (layers %d-%d), as the plan says",
        job.rank,
        stage.first_layer,
        stage.last_layer,
    )
    return stage.num_layers, func or checkpointing.non_reentrant_checkpoint


def _embeds_tokens(layer: Any) -> bool:
    """Whether `layer` (a built layer) is an ``nn.Embedding`` or wraps one alone (`TokenEmbedding`): its inputs are
    token ids."""
    if isinstance(layer, torch.nn.Embedding):
        return True
    children = list(layer.children()) if isinstance(layer, torch.nn.Module) else []
    return len(children) == 1 and isinstance(children[0], torch.nn.Embedding)


@contextmanager
def _built_on(grid: PlanGrid) -> Iterator[None]:
    # DeepSpeed falls short here: PipelineModule.__init__ builds its grid inline (runtime/pipe/module.py) and
    # takes no grid argument. The name it looks up is replaced for that call only.
    from deepspeed.runtime.pipe import module as deepspeed_pipe_module

    original = deepspeed_pipe_module.PipelineParallelGrid
    deepspeed_pipe_module.PipelineParallelGrid = lambda **_: grid
    try:
        yield
    finally:
        deepspeed_pipe_module.PipelineParallelGrid = original


class PoplarPipelineModule(PipelineModule):
    """DeepSpeed's PipelineModule with the stage boundaries and this rank's place from the plan (collective).

    Arguments are DeepSpeed's, and `config` (a dict or a JSON file) or `args`: the DeepSpeed config with a
    ``poplar`` section naming a pipeline plan, or ``poplar.profiles`` to search one at start; `training_data`
    (the dataset `poplar_ext.initialize` gets) lets missing layer profiles be measured first (with the config's
    optimizer: Adam, AdamW or SGD). ``num_stages``, ``topology`` and ``partition_method`` are refused (the plan
    says them). Raises the same ValueError on every rank when the plan cannot run. `poplar_job` holds the plan.
    """

    def __init__(
        self,
        layers: Any,
        *,
        loss_fn: Callable[[Any, Any], Any] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], None] | None = None,
        base_seed: int = 1234,
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] | None = None,
        checkpointable_layers: list[str] | None = None,
        dynamic_shape: bool = False,
        config: dict | str | None = None,
        args: Any = None,
        training_data: Any = None,
        num_stages: int | None = None,
        topology: Any = None,
        partition_method: str | None = None,
    ) -> None:
        _refuse_placement(num_stages=num_stages, topology=topology, partition_method=partition_method)
        layers = list(layers)
        job = prepare_pipeline_job(
            load_deepspeed_config(config, args=args),
            num_layers=len(layers),
            layers=layers,
            loss_fn=loss_fn,
            training_data=training_data,
        )
        grid = PlanGrid(job.plan, rank=job.rank)
        pipeline = job.pipeline
        weight = pipeline_loss_weight(
            micro_batch_size=pipeline.micro_batch_size,
            num_micro_batches=pipeline.num_micro_batches,
            global_batch_size=job.plan.global_batch_size,
            reduction=job.poplar_config.loss_reduction,
        )
        self._plan_boundaries = list(pipeline.boundaries)
        interval, checkpoint = _stage_checkpointing(job, activation_checkpoint_interval, activation_checkpoint_func)
        with _built_on(grid):
            super().__init__(
                layers,
                topology=grid.topology(),
                loss_fn=WeightedLoss(loss_fn, weight, reduction=job.poplar_config.loss_reduction),
                seed_layers=seed_layers,
                seed_fn=seed_fn,
                base_seed=base_seed,
                activation_checkpoint_interval=interval,
                activation_checkpoint_func=checkpoint,
                checkpointable_layers=checkpointable_layers,
                dynamic_shape=dynamic_shape,
            )
        self.poplar_job: PipelineJob = job
        """The plan and this rank's place in it (the same plan on every rank)."""
        self.layer_segments = LayerSegments(job.plan, rank=job.rank, tied=_tied_layers(layers))
        """The layers the pipelines share, and the groups their gradients are summed in."""
        self.layer_segments.broadcast_parameters(self)

    def _partition_layers(self, method: str = "uniform") -> None:
        # DeepSpeed computes a stage's boundaries here and only here, before any layer is
        # built (PipelineModule.__init__); its methods split every pipeline alike.
        self.parts = list(self._plan_boundaries)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    def _synchronize_tied_weights(self) -> None:
        # DeepSpeed calls this after building (no tied groups of its own here: nothing to do before
        # layer_segments exists) and after loading a checkpoint (collective: every rank loads), where
        # a tied module used only through a forward_fn on this stage was in no file of its layers.
        segments = getattr(self, "layer_segments", None)
        if segments is not None:
            segments.broadcast_parameters(self, ties_only=True)

    def _is_checkpointable(self, funcs: list[Any]) -> bool:
        # DeepSpeed's reentrant checkpoint of the block that reads the data from a token embedding (layer 0 on a
        # first stage) detaches it: token ids cannot require a gradient, so the stage's backward fails ("element
        # 0 of tensors does not require grad"). DeepSpeed leaves that block out for its own GPT pipes alone
        # (PipelineModule._is_checkpointable, by class name); here for any model whose first layer embeds tokens.
        reentrant = self.activation_checkpoint_func is not checkpointing.non_reentrant_checkpoint
        first = self._local_start == 0 and funcs and funcs[0] is self.forward_funcs[0]
        if reentrant and first and _embeds_tokens(funcs[0]):
            return False
        return super()._is_checkpointable(funcs)

    def _index_tied_modules(self) -> dict:
        # DeepSpeed makes a tied module's groups here from its own grid, per pipeline depth; pipelines of
        # other splits would create other groups (a mismatch in new_group). LayerSegments sums tied
        # gradients over every pipeline instead, so DeepSpeed gets no tied groups. What it still needs:
        # a copy that is not this pipeline's first is marked replicated, so that a gradient norm over
        # the pipeline counts the module once (DeepSpeed's own mark, read by its ZeRO optimizer too).
        for key, indices in _tied_layers(self._layer_specs).items():
            stages = sorted({self.stage_owner(index) for index in indices})
            if key in self.tied_modules and self.stage_id != stages[0]:
                for parameter in self.tied_modules[key].parameters():
                    parameter.ds_pipe_replicated = True
        return {}
