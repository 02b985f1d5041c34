"""Layer profiles of GPUs we cannot measure, from the same analytic model as `poplar_bench.gpu_model` (labelled
modelled), and the network the pipeline comparison prices with. See docs/bench.md (modelled GPUs)."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

from poplar_ext.plan.formats import ModelInfo, content_fingerprint
from poplar_ext.plan.network_format import COLLECTIVES, CollectiveFit, NetworkProfile, NetworkScope
from poplar_ext.plan.pipeline_formats import LayerCost, LayerProfile, LayerSample

from .gpu_model import Assumptions, GpuSpec, ModelShape, gpu_spec, modelled_with
from .gpu_model import modelled_network as whole_job_network

LAYER_MODEL_VERSION = "bench.gpu_layer_model/1"
LAYER_SAMPLE_SIZES = (1, 2, 4, 8, 16, 32, 64)
"""Micro-batch sizes written into each layer (the model is linear in b: the fit extends it exactly)."""
INTRA_NODE_BYTES_PER_S = 25e9
"""Assumed bus bandwidth among the GPUs of one node: PCIe 4.0 x16-class, the low end
(NVLink nodes move more; the T4 and V100S PCIe 3.0 nodes about half)."""


@dataclass(frozen=True, kw_only=True)
class ModelledLayer:
    """One layer of the analytic model (docs/bench.md, "Modelled GPUs")."""

    name: str
    parameters: int
    flops_per_sample: float
    kept_bytes_per_sample: int
    output_bytes_per_sample: int


_FIELDS = ("name", "parameters", "flops_per_sample", "kept_bytes_per_sample", "output_bytes_per_sample")


def model_layers(shape: ModelShape) -> list[ModelledLayer]:
    """The embedding, the blocks and the head of `shape`, as a ``PipelineModule`` lists them."""
    s, h, v = shape.sequence_length, shape.hidden_size, shape.vocab_size
    # Name, parameters, FLOPs per sample (forward + backward), kept and sent bytes per sample.
    rows = (
        ("Embedding", v * h + s * h, 0.0, 8 * s, 2 * s * h),
        ("Block", 12 * h * h, 72.0 * s * h * h + 12.0 * s * s * h, 34 * s * h, 2 * s * h),
        ("Head", v * h, 6.0 * s * v * h, 10 * s * v + 2 * s * h, 4),
    )
    embedding, block, head = (ModelledLayer(**dict(zip(_FIELDS, row))) for row in rows)
    return [embedding] + [block] * shape.num_layers + [head]


def modelled_layer_profile(
    spec: GpuSpec, shape: ModelShape, *, zero_stage: int = 0, assumptions: Assumptions | None = None
) -> LayerProfile:
    """A `LayerProfile` of `shape` on `spec` (ZeRO stage 0 or 1: the same costs), labelled modelled."""
    assumptions = assumptions or Assumptions()
    layers = model_layers(shape)
    rate, bandwidth = spec.peak_flops * spec.mfu, spec.memory_bandwidth_bytes_per_s
    return LayerProfile(
        device_type=spec.name,
        memory_capacity_bytes=spec.memory_capacity_bytes,
        zero_stage=zero_stage,
        model=ModelInfo(
            name=f"{shape.name}-untied-head",
            fingerprint=content_fingerprint({**asdict(shape), "head": "untied"}),
            num_parameters=sum(layer.parameters for layer in layers),
            dtype="float16",
            sequence_length=shape.sequence_length,
        ),
        layers=tuple(
            LayerCost(
                index=i,
                name=layer.name,
                samples=tuple(
                    LayerSample(
                        micro_batch_size=b,
                        step_time_s=layer.flops_per_sample * b / rate
                        + (6.0 * layer.parameters / bandwidth + assumptions.kernel_overhead_s / len(layers)),
                    )
                    for b in LAYER_SAMPLE_SIZES
                ),
                parameter_bytes=2 * layer.parameters,
                optimizer_state_bytes=14 * layer.parameters,
                activation_bytes_per_sample=layer.kept_bytes_per_sample,
                output_bytes_per_sample=layer.output_bytes_per_sample,
                optimizer_step_time_s=layer.parameters * assumptions.optimizer_bytes_per_parameter / bandwidth,
            )
            for i, layer in enumerate(layers)
        ),
        base_memory_bytes=assumptions.reserved_bytes,
        emulated=None,
        measured_with=modelled_with(
            LAYER_MODEL_VERSION,
            spec,
            shape,
            assumptions,
            note="analytic model from vendor datasheet figures, not a measurement; see poplar_bench.gpu_layer_model",
        ),
    )


def modelled_layer_profiles(
    device_types: list[str] | tuple[str, ...],
    shape: ModelShape,
    *,
    zero_stages: tuple[int, ...] = (0,),
    assumptions: Assumptions | None = None,
) -> list[LayerProfile]:
    """One modelled layer profile per device type and stage; unknown types raise ValueError."""
    return [
        modelled_layer_profile(gpu_spec(name), shape, zero_stage=stage, assumptions=assumptions)
        for name in dict.fromkeys(device_types)
        for stage in zero_stages
    ]


def two_level_network(
    assumptions: Assumptions | None = None,
    *,
    gpus_per_node: int,
    intra_node_bytes_per_s: float = INTRA_NODE_BYTES_PER_S,
) -> NetworkProfile:
    """`poplar_bench.gpu_model.modelled_network` with within-node and between-node scopes (labelled modelled)."""
    assumptions = assumptions or Assumptions()
    job = whole_job_network(assumptions)

    def fits(bandwidth: float) -> dict[str, CollectiveFit]:
        fit = CollectiveFit(latency_s=assumptions.network_latency_s, bus_bandwidth_bytes_per_s=bandwidth)
        return dict.fromkeys(COLLECTIVES, fit)

    note = f"{job.measured_with['note']}; within a node {intra_node_bytes_per_s / 1e9:.0f} GB/s ({LAYER_MODEL_VERSION})"
    return dataclasses.replace(
        job,
        measured_with={**job.measured_with, "note": note},
        scopes={
            "within_node": NetworkScope(group_size=max(2, gpus_per_node), collectives=fits(intra_node_bytes_per_s)),
            "between_nodes": NetworkScope(group_size=2, collectives=fits(assumptions.network_bytes_per_s)),
        },
    )
