"""Layer profiles measured: each layer of a pipeline model timed and sized on its own. See profiles/README.md
("Layer profile")."""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from poplar_ext.hardware.compute_clock import time_compute
from poplar_ext.hardware.emulation import EMULATED_TIMES
from poplar_ext.hardware.memory import resident_memory_bytes
from poplar_ext.plan.formats import Emulation, ModelInfo
from poplar_ext.plan.pipeline_formats import PIPELINE_ZERO_STAGES, LayerCost, LayerProfile, LayerSample
from poplar_ext.profiler.measure import map_tensors, measured_provenance
from poplar_ext.profiler.options import ProfileOptions
from poplar_ext.profiler.sizes import dense_sizes

PipelineLossFn = Callable[[Any, Any], torch.Tensor]
"""DeepSpeed's pipeline loss: ``loss_fn(outputs, labels) -> loss``."""

DEFAULT_LARGEST_LAYER_MICRO_BATCH = 64
"""Without `micro_batch_sizes`, layers are timed at 1, 2, 3, 4, 6, ... up to this (or the
`micro_batch_size_limit`, when smaller): layers are timed alone, with no memory probe."""


@dataclass(frozen=True, kw_only=True)
class PipelineLayers:
    """A pipeline model as the profiler measures it: its layers in order and its loss."""

    builders: tuple[Callable[[], nn.Module], ...]
    """Each builds one layer (a LayerSpec's ``build``, or the module itself)."""
    loss_fn: PipelineLossFn | None
    """The pipeline's ``loss_fn(outputs, labels)``; None: the last layer's output summed."""


def is_pipeline_model(model: Any) -> bool:
    """True for a DeepSpeed `PipelineModule` (a `PoplarPipelineModule` too) or a list of layers
    (LayerSpecs or modules): what `profile_layers` measures layer by layer."""
    from deepspeed.pipe import PipelineModule

    return isinstance(model, PipelineModule) or (
        isinstance(model, (list, tuple)) and len(model) > 0 and all(_is_layer(x) for x in model)
    )


def _is_layer(item: Any) -> bool:
    """What DeepSpeed's PipelineModule takes as a layer: a LayerSpec (a TiedLayerSpec too), a module, or a
    callable such as ``lambda x: torch.flatten(x, 1)`` (a layer without parameters)."""
    from deepspeed.pipe import LayerSpec

    return isinstance(item, (LayerSpec, nn.Module)) or (callable(item) and not isinstance(item, type))


class CallableLayer(nn.Module):
    """A callable layer of a pipeline (a function, a lambda) as a module the profiler can time."""

    def __init__(self, function: Callable[..., Any]) -> None:
        super().__init__()
        self.function = function
        self.layer_name = getattr(function, "__name__", type(function).__name__)

    def forward(self, *inputs: Any) -> Any:
        return self.function(*inputs)


class TiedUse(nn.Module):
    """One use of a tied module (a TiedLayerSpec), called through the spec's ``forward_fn`` where it has one;
    its parameters count for every use (each stage holding one holds the module)."""

    def __init__(self, module: nn.Module, forward_fn: Callable[..., Any] | None) -> None:
        super().__init__()
        self.module, self.forward_fn = module, forward_fn
        self.layer_name = f"{type(module).__name__} (tied)"

    def forward(self, *inputs: Any) -> Any:
        return self.module(*inputs) if self.forward_fn is None else self.forward_fn(self.module, *inputs)


def _builder(item: Any) -> Callable[[], nn.Module]:
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    # A module given as a layer (or wrapped by a TiedLayerSpec) is the model's own: timing steps an
    # optimizer on the layer, which must not move the weights the job then trains. A copy is measured.
    if isinstance(item, TiedLayerSpec):
        return lambda: TiedUse(copy.deepcopy(item.build()), item.forward_fn)
    if isinstance(item, LayerSpec):
        return item.build
    if isinstance(item, nn.Module):
        return lambda: copy.deepcopy(item)
    return lambda: CallableLayer(item)


def pipeline_layers(model: Any, *, loss_fn: PipelineLossFn | None = None) -> PipelineLayers:
    """The layers of `model`: a PipelineModule's layer list (its ``loss_fn`` unless `loss_fn` is
    given), a list of LayerSpecs or modules, or an ``nn.Sequential``'s children."""
    from deepspeed.pipe import PipelineModule

    if isinstance(model, PipelineModule):
        items, loss_fn = list(model._layer_specs), loss_fn or model.loss_fn
    elif isinstance(model, nn.Sequential):
        items = list(model.children())
    elif isinstance(model, (list, tuple)) and model:
        items = list(model)
    else:
        raise ValueError(
            "model: expected a PipelineModule, a list of layers (LayerSpecs, modules or callables), or an "
            f"nn.Sequential to profile layer by layer, found {type(model).__name__}"
        )
    for index, item in enumerate(items):
        if not _is_layer(item):
            raise ValueError(
                f"model: layer {index}: expected a LayerSpec, an nn.Module or a callable, found {type(item).__name__}"
            )
    return PipelineLayers(builders=tuple(_builder(item) for item in items), loss_fn=loss_fn)


def layers_fingerprint(pipeline: PipelineLayers) -> str:
    """Which model layer profiles belong to: `model_fingerprint` of the layers as one ``nn.Sequential``
    (each built once, on the CPU where a LayerSpec builds there)."""
    from poplar_ext.profiler.fingerprint import model_fingerprint

    return model_fingerprint(nn.Sequential(*(build() for build in pipeline.builders)))


def layer_micro_batch_sizes(micro_batch_sizes: Sequence[int] | None, micro_batch_size_limit: int) -> tuple[int, ...]:
    """The given sizes up to the limit (as the whole model's sweep keeps them), else `dense_sizes` up to the limit
    or `DEFAULT_LARGEST_LAYER_MICRO_BATCH`."""
    if micro_batch_sizes is not None:
        kept = tuple(sorted({b for b in micro_batch_sizes if b <= micro_batch_size_limit}))
        if not kept:
            raise ValueError(
                f"--micro-batch-sizes: expected a size of at most --max-micro-batch-size ({micro_batch_size_limit}), "
                f"found {sorted(set(micro_batch_sizes))}"
            )
        return kept
    return tuple(dense_sizes(min(micro_batch_size_limit, DEFAULT_LARGEST_LAYER_MICRO_BATCH)))


@dataclass(frozen=True, kw_only=True)
class LayerMeasurement:
    """What `measure_layers` needs besides the layers: the data, the optimizer and how much to measure."""

    make_batch: Callable[[int], Any]
    """``make_batch(b)`` -> ``(inputs, labels)`` of a micro-batch of b samples (DeepSpeed's pipeline
    convention; anything else is taken as inputs without labels)."""
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    micro_batch_sizes: tuple[int, ...]
    warmup_micro_steps: int = ProfileOptions.warmup_micro_steps
    repeats: int = ProfileOptions.repeats
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    """The dtype the job trains in (DeepSpeed's ``bf16`` or ``fp16`` section): each layer is cast to it, as
    DeepSpeed casts a stage's parameters, and so are the batch's floating-point inputs (DeepSpeed casts none: a
    job's data comes in its dtype, a profiling batch may not); the optimizer steps fp32 master copies beside
    it, as DeepSpeed's mixed-precision optimizers do."""


def _tensors(value: Any) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def pipeline_loss(output: Any, labels: Any, loss_fn: PipelineLossFn | None) -> torch.Tensor:
    """The last layer's loss: ``loss_fn(output, labels)``, or without one the output summed."""
    return loss_fn(output, labels) if loss_fn is not None else sum(t.sum() for t in _tensors(output))


def _received(tensor: torch.Tensor) -> torch.Tensor:
    """The activation a stage receives: a leaf, with a gradient where it is floating point."""
    leaf = tensor.detach()
    return leaf.requires_grad_(True) if leaf.is_floating_point() else leaf


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class _LayerRun:
    """One forward + backward of one layer: its compute time, kept activation bytes and output."""

    time_s: float
    kept_bytes: int
    output: Any


def _run_layer(
    layer: nn.Module, inputs: Any, labels: Any, *, last: bool, loss_fn: PipelineLossFn | None, device: torch.device
) -> _LayerRun:
    leaf = map_tensors(_received, inputs, walk_dicts=False)
    parameter_storages = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    kept: dict[int, int] = {}

    # What the forward gets: a copy, so that an in-place first operation (``ReLU(inplace=True)``) works,
    # as it does on DeepSpeed's stages, whose input is not a leaf there.
    stage_input = map_tensors(lambda t: t.clone() if t.requires_grad else t, leaf, walk_dicts=False)
    # The copy stands for the received activation: saved, it is the input the stage keeps anyway.
    same_as_input = {
        copied.untyped_storage().data_ptr(): received.untyped_storage().data_ptr()
        for copied, received in zip(_tensors(stage_input), _tensors(leaf))
    }

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage().data_ptr()
        storage = same_as_input.get(storage, storage)
        if storage not in parameter_storages:
            kept[storage] = max(kept.get(storage, 0), tensor.numel() * tensor.element_size())
        return tensor

    result: dict[str, Any] = {}

    def forward() -> None:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            output = layer(stage_input)
            result["output"] = output
            if last:
                result["loss"] = pipeline_loss(output, labels, loss_fn)

    def backward() -> None:
        if last:
            result["loss"].backward()
            return
        outputs = [t for t in _tensors(result["output"]) if t.requires_grad]
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])

    time_s = time_compute(device, forward) + time_compute(device, backward)
    # A stage keeps the activation it received until its backward: the layer's input counts.
    for t in _tensors(leaf):
        kept[t.untyped_storage().data_ptr()] = max(kept.get(t.untyped_storage().data_ptr(), 0), _nbytes([t]))
    output = map_tensors(lambda t: t.to(device).detach(), result["output"], walk_dicts=False)
    return _LayerRun(time_s=time_s, kept_bytes=sum(kept.values()), output=output)


def measure_layers(
    pipeline: PipelineLayers,
    measurement: LayerMeasurement,
    *,
    slowdown: float = 1.0,
) -> list[dict[str, Any]]:
    """Each layer's `LayerCost` fields (as a dict), measured in this process (not collective); times x
    `slowdown` (an emulated type's; at least 1)."""
    device = measurement.device
    layers = [builder().to(device=device, dtype=measurement.dtype) for builder in pipeline.builders]
    last = len(layers) - 1
    times: list[dict[int, list[float]]] = [{b: [] for b in measurement.micro_batch_sizes} for _ in layers]
    kept_per_sample = [0] * len(layers)
    output_per_sample = [0] * len(layers)
    factor = max(1.0, slowdown)
    for b in measurement.micro_batch_sizes:
        batch = map_tensors(lambda t: t.to(device), measurement.make_batch(b), walk_dicts=False)
        paired = isinstance(batch, (tuple, list)) and len(batch) == 2
        inputs, labels = batch if paired else (batch, None)
        inputs = map_tensors(
            lambda t: t.to(measurement.dtype) if t.is_floating_point() else t, inputs, walk_dicts=False
        )
        for step in range(measurement.warmup_micro_steps + measurement.repeats):
            x = inputs
            for index, layer in enumerate(layers):
                try:
                    run = _run_layer(layer, x, labels, last=index == last, loss_fn=pipeline.loss_fn, device=device)
                except Exception as exc:
                    raise _with_layer(exc, index, layer, x, batch=None if paired else batch) from exc
                layer.zero_grad(set_to_none=True)
                if step >= measurement.warmup_micro_steps:
                    times[index][b].append(run.time_s * factor)
                kept_per_sample[index] = max(kept_per_sample[index], -(-run.kept_bytes // b))
                output_per_sample[index] = max(output_per_sample[index], -(-_nbytes(_tensors(run.output)) // b))
                x = run.output
    return [
        {
            "index": index,
            "name": getattr(layer, "layer_name", type(layer).__name__),
            "samples": [
                {"micro_batch_size": b, "step_time_s": max(statistics.median(times[index][b]), 1e-9)}
                for b in measurement.micro_batch_sizes
            ],
            "parameter_bytes": _nbytes(list(layer.parameters())),
            "activation_bytes_per_sample": kept_per_sample[index],
            "output_bytes_per_sample": output_per_sample[index],
            **_optimizer_figures(layer, pipeline, measurement, factor, index == last),
        }
        for index, layer in enumerate(layers)
    ]


def _described(value: Any) -> str:
    """``a tensor of shape (4, 32) int64``, ``a dict with keys input_ids, labels``, ``a tuple of 3``."""
    if torch.is_tensor(value):
        return f"a tensor of shape {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, dict):
        return f"a dict with keys {', '.join(map(str, value))}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _with_layer(exc: Exception, index: int, layer: nn.Module, given: Any, *, batch: Any) -> Exception:
    """`exc` of layer `index` said again, of its own type (a user's error stays one on every rank: a restarting
    launcher's job ends): the layer, the error, what it was given and, for a batch that is not a pair, what a
    layer profile's batch is. `exc` itself where its type cannot be made from a message, or out of memory."""
    name = getattr(layer, "layer_name", type(layer).__name__)
    text = f"layer {index} ({name}): {exc}; its input: {_described(given)}"
    if batch is not None:
        text += (
            f"; the batch (make_batch, poplar-profile's --batch) is {_described(batch)}: expected (inputs, labels), "
            "the first layer's input and the loss's labels"
        )
    if isinstance(exc, torch.OutOfMemoryError):
        return exc
    try:
        said = type(exc)(text)
    except Exception:  # noqa: BLE001 - an exception whose constructor takes more than a message: as it was
        return exc
    return said if str(said) == text else exc


def _optimizer_figures(
    layer: nn.Module, pipeline: PipelineLayers, measurement: LayerMeasurement, factor: float, last: bool
) -> dict[str, Any]:
    """The layer's optimizer state (gradients included) and its step time (median, x the slowdown); in a half
    precision, the step of fp32 master copies, which count with their gradients besides the layer's own."""
    parameters = [p for p in layer.parameters() if p.requires_grad]
    if not parameters:
        return {"optimizer_state_bytes": 0, "optimizer_step_time_s": 0.0}
    # In a half precision the layer keeps its own gradients (as large as its parameters) besides fp32 master
    # copies and their gradients, which the optimizer steps.
    half_bytes = _nbytes(parameters) if measurement.dtype != torch.float32 else 0
    if half_bytes:
        parameters = [p.detach().float().requires_grad_(True) for p in parameters]
    optimizer = measurement.optimizer_factory(parameters)
    for p in parameters:
        p.grad = torch.zeros_like(p)
    steps = [time_compute(measurement.device, optimizer.step) for _ in range(measurement.repeats + 1)]
    # Gradients plus the optimizer's per-parameter state after a step.
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    masters_bytes = _nbytes(parameters) if half_bytes else 0
    return {
        "optimizer_state_bytes": _nbytes([p.grad for p in parameters if p.grad is not None])
        + _nbytes(state)
        + masters_bytes
        + half_bytes,
        "optimizer_step_time_s": statistics.median(steps[1:]) * factor,
    }


def base_memory_bytes(device: torch.device) -> int:
    """What a stage takes before any layer: the process's resident memory on CPU, torch's allocation on CUDA."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return resident_memory_bytes()


def layer_profile(
    costs: list[dict[str, Any]],
    *,
    device_type: str,
    zero_stage: int,
    memory_capacity_bytes: int,
    base_memory: int,
    model: ModelInfo,
    emulation: Emulation | None,
    provenance: dict[str, Any],
) -> LayerProfile:
    """The `LayerProfile` of measured `costs` at `zero_stage` (0 or 1)."""
    if zero_stage not in PIPELINE_ZERO_STAGES:
        raise ValueError(f"zero_stage: expected 0 or 1 for a layer profile, found {zero_stage}")
    return LayerProfile(
        device_type=device_type,
        memory_capacity_bytes=memory_capacity_bytes,
        zero_stage=zero_stage,
        model=model,
        layers=tuple(LayerCost(**{**c, "samples": tuple(LayerSample(**s) for s in c["samples"])}) for c in costs),
        base_memory_bytes=base_memory,
        emulated=emulation,
        measured_with={
            **measured_provenance(),
            "device": "emulated" if emulation is not None else "real",
            "timing": "each layer alone: forward + backward by the compute clock"
            + (EMULATED_TIMES if emulation is not None else "")
            + ", median",
            "memory": "parameters and optimizer state from the tensors; kept activations from autograd's saved "
            "tensors (input included); output from the layer's output",
            "zero1": "the same measurement as stage 0: a pipeline's data-parallel group is one rank",
            **provenance,
        },
    )
