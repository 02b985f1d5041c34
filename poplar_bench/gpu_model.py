"""An analytic model of GPUs we cannot measure: profiles built from published specs (labelled modelled).

See docs/bench.md (modelled GPUs: micro-step time, accumulation boundary, memory).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from poplar_ext.plan.formats import OFFLOAD_STAGES, ZERO_STAGES, ModelInfo, Profile, Sample, content_fingerprint
from poplar_ext.plan.network_format import NetworkProfile
from poplar_ext.search import network as search_network

GIB = 1 << 30
MODEL_VERSION = "bench.gpu_model/1"


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """Published facts about one GPU type, plus the one assumption (MFU) made about it."""

    name: str
    """Device type name as used in cluster descriptions, e.g. ``A100-80GB``."""
    peak_flops: float
    """Dense FP16/BF16 tensor-core peak in FLOP/s (datasheet, no sparsity)."""
    memory_capacity_bytes: int
    """Device memory (datasheet size in GiB)."""
    memory_bandwidth_bytes_per_s: float
    """Device memory bandwidth (datasheet)."""
    mfu: float
    """Assumed achievable fraction of ``peak_flops`` on transformer training (not a datasheet figure)."""
    datasheet: str
    """Which datasheet variant the figures come from."""
    mfu_reason: str
    """Why that MFU was assumed."""


# Vendor datasheet figures (NVIDIA A100, A800, V100, V100S, T4 and H100 datasheets): name, peak FLOP/s,
# memory GiB, memory bandwidth bytes/s, assumed MFU. One table, looked up by exact name; unknown names are
# an error, never a silent default.
_FIGURES = (
    ("H100-80GB", 989e12, 80, 3.35e12, 0.40),
    ("A100-80GB", 312e12, 80, 2.039e12, 0.45),
    ("A100-40GB", 312e12, 40, 1.555e12, 0.45),
    ("A800-80GB", 312e12, 80, 2.039e12, 0.45),
    ("V100S-32GB", 130e12, 32, 1.134e12, 0.40),
    ("V100-16GB", 125e12, 16, 900e9, 0.40),
    ("T4-16GB", 65e12, 16, 320e9, 0.25),
)
_DATASHEETS = {
    "H100-80GB": "NVIDIA H100 SXM5 datasheet: 989 TFLOPS BF16 dense, 80 GB HBM3, 3.35 TB/s",
    "A100-80GB": "NVIDIA A100 SXM4 80GB datasheet: 312 TFLOPS BF16/FP16 dense, 80 GB HBM2e, 2,039 GB/s",
    "A100-40GB": "NVIDIA A100 SXM4 40GB datasheet: 312 TFLOPS BF16/FP16 dense, 40 GB HBM2, 1,555 GB/s",
    "A800-80GB": "NVIDIA A800 SXM4 80GB datasheet: 312 TFLOPS BF16/FP16 dense, 80 GB HBM2e, 2,039 GB/s",
    "V100S-32GB": "NVIDIA V100S PCIe datasheet: 130 TFLOPS FP16 tensor, 32 GB HBM2, 1,134 GB/s",
    "V100-16GB": "NVIDIA V100 SXM2 16GB datasheet: 125 TFLOPS FP16 tensor, 16 GB HBM2, 900 GB/s",
    "T4-16GB": "NVIDIA T4 datasheet: 65 TFLOPS FP16 mixed precision, 16 GB GDDR6, 320 GB/s",
}
_VOLTA = "Volta tensor cores reach a lower fraction than Ampere in reports (30-45%)"
_MFU_REASONS = {
    "H100-80GB": "typical reported MFU for GPT training without FP8 is 35-45%",
    "A100-80GB": "Megatron-style GPT training commonly reports 40-55% MFU on A100",
    "A100-40GB": "same compute as the 80GB part; same assumption",
    "A800-80GB": "an A100 with a slower NVLink; same compute, same assumption",
    "V100S-32GB": _VOLTA,
    "V100-16GB": _VOLTA,
    "T4-16GB": "the 70 W power cap keeps clocks well below boost under sustained tensor-core load",
}
GPU_SPECS: tuple[GpuSpec, ...] = tuple(
    GpuSpec(
        name=name,
        peak_flops=peak,
        memory_capacity_bytes=gib * GIB,
        memory_bandwidth_bytes_per_s=bandwidth,
        mfu=mfu,
        datasheet=_DATASHEETS[name],
        mfu_reason=_MFU_REASONS[name],
    )
    for name, peak, gib, bandwidth, mfu in _FIGURES
)


def _named(items: tuple[Any, ...], name: str, field: str, what: str) -> Any:
    """The item called `name`; ValueError listing the known names otherwise."""
    for item in items:
        if item.name == name:
            return item
    raise ValueError(f"{field}: expected one of {what} ({', '.join(i.name for i in items)}), found {name!r}")


def gpu_spec(name: str) -> GpuSpec:
    """The spec of GPU type `name`; ValueError listing the known types otherwise."""
    return _named(GPU_SPECS, name, "device_type", "the modelled GPU types")


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A GPT-style decoder, described by the sizes the analytic model needs."""

    name: str
    """Human-readable name written into profiles."""
    num_layers: int
    hidden_size: int
    num_heads: int
    sequence_length: int
    """Tokens per sample."""
    vocab_size: int

    @property
    def num_parameters(self) -> int:
        """Transformer blocks (12 h^2 per layer) plus token and position embeddings."""
        h = self.hidden_size
        return 12 * self.num_layers * h * h + self.vocab_size * h + self.sequence_length * h

    @property
    def flops_per_sample(self) -> float:
        """Forward + backward FLOPs of one sample: 6 P s for the matmuls, 12 L s^2 h for attention."""
        s, h = self.sequence_length, self.hidden_size
        return 6.0 * self.num_parameters * s + 12.0 * self.num_layers * s * s * h

    @property
    def activation_bytes_per_sample(self) -> int:
        """Activations kept for backward, 16-bit, fused attention (see docs/bench.md, "Modelled GPUs")."""
        s, h = self.sequence_length, self.hidden_size
        return 34 * s * h * self.num_layers + 10 * s * self.vocab_size

    @property
    def checkpointed_activation_bytes_per_sample(self) -> int:
        """With activation checkpointing per layer: each layer's 16-bit input kept, one layer's
        activations alive while it is recomputed, and the head's."""
        s, h = self.sequence_length, self.hidden_size
        return 2 * s * h * self.num_layers + 34 * s * h + 10 * s * self.vocab_size

    def kept_bytes_per_sample(self, activation_checkpointing: bool) -> int:
        """`checkpointed_activation_bytes_per_sample` or `activation_bytes_per_sample`."""
        if activation_checkpointing:
            return self.checkpointed_activation_bytes_per_sample
        return self.activation_bytes_per_sample

    @property
    def fingerprint(self) -> str:
        return content_fingerprint(asdict(self))


# Shapes from the GPT-2 and GPT-3 papers; used by the shipped simulations.
MODEL_SHAPES: tuple[ModelShape, ...] = (
    ModelShape(
        name="gpt2-xl-1.5b", num_layers=48, hidden_size=1600, num_heads=25, sequence_length=1024, vocab_size=50257
    ),
    ModelShape(name="gpt3-6.7b", num_layers=32, hidden_size=4096, num_heads=32, sequence_length=2048, vocab_size=50257),
)


def model_shape(name: str) -> ModelShape:
    """The preset model shape `name`; ValueError listing the presets otherwise."""
    return _named(MODEL_SHAPES, name, "model", "the model presets")


@dataclass(frozen=True, kw_only=True)
class Assumptions:
    """The model's assumptions that are not datasheet figures; all are written into every profile."""

    network_bytes_per_s: float = 12.5e9
    """Per-GPU network bandwidth for collectives (100 Gb/s InfiniBand per GPU): the ring's bus bandwidth."""
    network_latency_s: float = 0.0
    """Latency of one ring hop. None assumed: ZeRO's collectives move whole buckets of
    megabytes, and NCCL switches to trees on large clusters, where a flat ring's
    per-hop latency (a few microseconds x 4095 hops) would overstate it."""
    kernel_overhead_s: float = 0.010
    """Fixed per-micro-step cost: kernel launches, Python and framework overhead."""
    reserved_bytes: int = 2 * GIB
    """Memory unavailable to training: CUDA context, communication buffers, fragmentation."""
    optimizer_bytes_per_parameter: int = 28
    """Bytes the Adam update reads and writes per parameter of the local shard."""
    host_adam_parameters_per_s: float = 1.0e9
    """Parameters per second an offloaded Adam updates for one GPU's shard on its share of
    the host's cores: an assumed order of magnitude for a vectorised CPU Adam, not a measurement."""
    pcie_bytes_per_s: float = 12e9
    """Host-device copy bandwidth: PCIe 3.0 x16 in practice (V100 and T4 are PCIe 3.0 cards)."""


# Bytes per parameter on a rank's device (ZeRO paper, K = 12): (whole, divided over the ranks), per stage;
# with the optimizer offloaded (stages 1-2) the K bytes per parameter of the shard live on the host.
_STATE_BYTES = {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)}
_OFFLOADED_STATE_BYTES = {1: (4, 0), 2: (2, 2)}


def _check_offload(zero_stage: int, optimizer_offload: bool) -> None:
    if optimizer_offload and zero_stage not in OFFLOAD_STAGES:
        raise ValueError(f"optimizer_offload: expected ZeRO stage 1 or 2, found stage {zero_stage}")


def state_bytes(num_parameters: int, zero_stage: int, world_size: int, optimizer_offload: bool = False) -> float:
    """Parameters + gradients + optimizer states on one rank's device (`_STATE_BYTES`)."""
    _check_offload(zero_stage, optimizer_offload)
    if zero_stage not in _STATE_BYTES:
        raise ValueError(f"zero_stage: expected 0, 1, 2 or 3, found {zero_stage!r}")
    whole, divided = (_OFFLOADED_STATE_BYTES if optimizer_offload else _STATE_BYTES)[zero_stage]
    p = float(num_parameters)
    return whole * p + divided * p / world_size


RECOMPUTE_FLOPS_FACTOR = 4.0 / 3.0
"""Activation checkpointing runs the forward (a third of forward + backward) once more."""


def peak_memory_bytes(
    shape: ModelShape,
    zero_stage: int,
    world_size: int,
    micro_batch_size: int,
    assumptions: Assumptions,
    activation_checkpointing: bool = False,
    optimizer_offload: bool = False,
) -> int:
    """Modelled peak memory of one micro-step of `micro_batch_size` samples."""
    total = state_bytes(shape.num_parameters, zero_stage, world_size, optimizer_offload)
    if zero_stage == 3:
        # The current and the prefetched layer are gathered in full, 16-bit.
        total += 2 * 2 * 12 * shape.hidden_size**2
    total += micro_batch_size * shape.kept_bytes_per_sample(activation_checkpointing) + assumptions.reserved_bytes
    return int(math.ceil(total))


def modelled_network(assumptions: Assumptions | None = None) -> NetworkProfile:
    """The network these profiles assume, as a network file would hold it (labelled modelled): the same ring
    model prices the collectives inside the profiles, so the cost model takes out exactly what they hold."""
    assumptions = assumptions or Assumptions()
    return search_network.modelled_network(
        bus_bandwidth_bytes_per_s=assumptions.network_bytes_per_s,
        latency_s=assumptions.network_latency_s,
        backend="nccl",
        note=f"{MODEL_VERSION}: every GPU on its own {assumptions.network_bytes_per_s * 8 / 1e9:.0f} Gb/s link, "
        f"{assumptions.network_latency_s * 1e6:.0f} us per ring hop; a ring across nodes runs at the inter-node link",
    )


def _ring_s(num_bytes: float, world_size: int, assumptions: Assumptions) -> float:
    """One reduce-scatter or all-gather of `num_bytes` over a ring of `world_size` GPUs."""
    return modelled_network(assumptions).time_s("all_gather", num_bytes, world_size)


def micro_step_time_s(
    spec: GpuSpec,
    shape: ModelShape,
    zero_stage: int,
    world_size: int,
    micro_batch_size: int,
    assumptions: Assumptions,
    activation_checkpointing: bool = False,
) -> float:
    """Modelled forward + backward of `micro_batch_size` samples (see docs/bench.md, "Modelled GPUs"); with
    `activation_checkpointing` the forward runs again, and at stage 3 gathers the weights again."""
    factor = RECOMPUTE_FLOPS_FACTOR if activation_checkpointing else 1.0
    compute = factor * shape.flops_per_sample * micro_batch_size / (spec.peak_flops * spec.mfu)
    weight_bytes = 2.0 * shape.num_parameters
    comm = 0.0
    if zero_stage >= 2:
        comm += _ring_s(weight_bytes, world_size, assumptions)  # gradient reduce-scatter
    if zero_stage == 3:  # the gathers of the forward, (the recomputed forward,) the backward
        comm += (3 if activation_checkpointing else 2) * _ring_s(weight_bytes, world_size, assumptions)
    return compute + 3 * weight_bytes / spec.memory_bandwidth_bytes_per_s + assumptions.kernel_overhead_s + comm


def optimizer_step_time_s(
    spec: GpuSpec,
    shape: ModelShape,
    zero_stage: int,
    world_size: int,
    assumptions: Assumptions,
    optimizer_offload: bool = False,
) -> float:
    """Modelled accumulation boundary: the Adam update (on the host when offloaded, with the
    copies) plus the boundary collectives."""
    _check_offload(zero_stage, optimizer_offload)
    shard = shape.num_parameters / (1 if zero_stage == 0 else world_size)
    if optimizer_offload:
        update = shard / assumptions.host_adam_parameters_per_s + 4 * shard / assumptions.pcie_bytes_per_s
    else:
        update = shard * assumptions.optimizer_bytes_per_parameter / spec.memory_bandwidth_bytes_per_s
    # Stages 0-1: an all-reduce, or reduce-scatter + all-gather; stage 2: the updated parameters' all-gather.
    rings = {0: 2, 1: 2, 2: 1}.get(zero_stage, 0)
    return update + (rings * _ring_s(2.0 * shape.num_parameters, world_size, assumptions) if rings else 0.0)


def max_micro_batch_size(
    spec: GpuSpec,
    shape: ModelShape,
    zero_stage: int,
    world_size: int,
    assumptions: Assumptions,
    activation_checkpointing: bool = False,
    optimizer_offload: bool = False,
) -> int:
    """Largest micro-batch whose modelled peak fits the device; 0 when none does."""
    free = spec.memory_capacity_bytes - peak_memory_bytes(
        shape, zero_stage, world_size, 0, assumptions, optimizer_offload=optimizer_offload
    )
    return max(0, int(free // shape.kept_bytes_per_sample(activation_checkpointing)))


def sample_sizes(max_size: int) -> list[int]:
    """Powers of two below `max_size`, plus `max_size` itself: dense enough for the curve fit."""
    powers = [1 << k for k in range(max(0, max_size - 1).bit_length())]
    return powers + [max_size] if max_size >= 1 else powers


def modelled_with(version: str, spec: GpuSpec, shape: ModelShape, assumptions: Assumptions, **more: Any) -> dict:
    """A modelled profile's ``measured_with``: who modelled it, from which spec, shape and assumptions."""
    return {
        "source": "modelled",
        "model": version,
        **more,
        "gpu_spec": asdict(spec),
        "model_shape": asdict(shape),
        "assumptions": asdict(assumptions),
    }


def modelled_profile(
    spec: GpuSpec,
    shape: ModelShape,
    *,
    zero_stage: int,
    world_size: int,
    assumptions: Assumptions | None = None,
    activation_checkpointing: bool = False,
    optimizer_offload: bool = False,
) -> Profile:
    """A `Profile` for `spec` running `shape` at one ZeRO stage and world size, labelled modelled."""
    if world_size < 1:
        raise ValueError(f"world_size: expected an integer >= 1, found {world_size!r}")
    assumptions = assumptions or Assumptions()
    at = (shape, zero_stage, world_size)
    checkpointing, offload = activation_checkpointing, optimizer_offload
    largest = max_micro_batch_size(spec, *at, assumptions, checkpointing, offload)
    return Profile(
        device_type=spec.name,
        memory_capacity_bytes=spec.memory_capacity_bytes,
        zero_stage=zero_stage,
        world_size=world_size,
        model=ModelInfo(
            name=shape.name,
            fingerprint=shape.fingerprint,
            num_parameters=shape.num_parameters,
            dtype="float16",
            sequence_length=shape.sequence_length,
        ),
        max_micro_batch_size=largest,
        samples=tuple(
            Sample(
                micro_batch_size=b,
                micro_step_time_s=micro_step_time_s(spec, *at, b, assumptions, checkpointing),
                peak_memory_bytes=peak_memory_bytes(*at, b, assumptions, checkpointing, offload),
            )
            for b in sample_sizes(largest)
        ),
        optimizer_step_time_s=optimizer_step_time_s(spec, *at, assumptions, offload),
        emulated=None,
        activation_checkpointing=checkpointing,
        optimizer_offload=offload,
        # The modelled times hold their collectives (all exposed; see docs/bench.md, "Modelled GPUs").
        measured_with=modelled_with(
            MODEL_VERSION,
            spec,
            shape,
            assumptions,
            micro_step_times_include_communication=True,
            note="analytic model from vendor datasheet figures, not a measurement; see poplar_bench/gpu_model.py",
        ),
    )


def modelled_profiles(
    device_types: list[str] | tuple[str, ...],
    shape: ModelShape,
    *,
    world_size: int,
    zero_stages: tuple[int, ...] = ZERO_STAGES,
    assumptions: Assumptions | None = None,
    checkpointing: tuple[bool, ...] = (False,),
    offload: tuple[bool, ...] = (False,),
) -> list[Profile]:
    """Modelled profiles for every (device type, stage, activation checkpointing in `checkpointing`,
    optimizer offload in `offload` at stages 1-2); unknown device types raise ValueError."""
    specs = [gpu_spec(name) for name in dict.fromkeys(device_types)]
    return [
        modelled_profile(
            spec,
            shape,
            zero_stage=stage,
            world_size=world_size,
            assumptions=assumptions,
            activation_checkpointing=on,
            optimizer_offload=offloaded,
        )
        for spec in specs
        for stage in zero_stages
        for on in checkpointing
        for offloaded in offload
        if not offloaded or stage in OFFLOAD_STAGES
    ]
