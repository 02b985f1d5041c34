"""Layer profiles and pipeline plans, read (validated) and written. See profiles/README.md and docs/pipeline.md."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .errors import FormatError
from .formats import (
    MAX_BYTES,
    MAX_GLOBAL_BATCH_SIZE,
    MAX_MICRO_BATCH_SIZE,
    MAX_TIME_S,
    MAX_WORLD_SIZE,
    MIN_TIME_S,
    POLICIES,
    Cluster,
    Emulation,
    ModelInfo,
    Plan,
    Prediction,
    check_increasing,
    content_fingerprint,
    emulation_to_dict,
    field_names,
    int_reader,
    json_ready,
    listed,
    mark_loaded,
    not_a_directory,
    number_reader,
    plan_from_dict,
    read_emulation,
    read_fingerprints,
    read_json,
    read_measured_with,
    read_model_info,
    read_object,
    read_prediction,
    read_root,
    read_total,
    read_values,
    write_json_atomic,
)
from .validation import Node

LAYER_PROFILE_SCHEMA_VERSION = 1
PIPELINE_PLAN_SCHEMA_VERSION = 1
PARALLELISMS = ("zero", "pipeline")
"""What a plan trains: ZeRO data parallelism (every rank the whole model) or pipelines."""
PIPELINE_ZERO_STAGES = (0, 1)
"""DeepSpeed's pipeline engine refuses ZeRO stages 2 and 3."""
PIPELINE_POLICY = "poplar"
"""The pipeline search's one policy: the policy of the plans it makes (another is refused, not ignored)."""
LAYERS_DIR = "layers"
"""Where a profile directory keeps its layer profiles."""
MAX_LAYERS = 100_000


def _pipeline_zero_stage(node: Node) -> int:
    stage = node.integer(minimum=0, maximum=3)
    if stage not in PIPELINE_ZERO_STAGES:
        raise node.fail("ZeRO stage 0 or 1 (DeepSpeed's pipeline engine refuses stages 2 and 3)")
    return stage


# -- Layer profiles ------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LayerSample:
    """One layer at one micro-batch size."""

    micro_batch_size: int
    step_time_s: float
    """Forward + backward of this layer for one micro-batch (median)."""


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """What one layer costs a stage that holds it."""

    index: int
    """Position in the model's layer list (DeepSpeed's PipelineModule order), from 0."""
    name: str
    """The layer's kind, for people (e.g. ``Block``)."""
    samples: tuple[LayerSample, ...]
    parameter_bytes: int
    """The layer's parameters in the training dtype."""
    optimizer_state_bytes: int
    """Everything else the layer's parameters keep on the rank that holds it: their gradients, master weights and
    optimizer state."""
    activation_bytes_per_sample: int
    """Activations the layer keeps for backward, per sample of an in-flight micro-batch."""
    output_bytes_per_sample: int
    """The layer's output per sample: what a stage boundary after it sends forward (and its gradient back)."""
    optimizer_step_time_s: float
    """The optimizer step for the layer's parameters."""


@dataclass(frozen=True, kw_only=True)
class LayerProfile:
    """One device type at one ZeRO stage for one model, layer by layer: the pipeline search's input."""

    device_type: str
    memory_capacity_bytes: int
    zero_stage: int
    model: ModelInfo
    layers: tuple[LayerCost, ...]
    base_memory_bytes: int
    """Memory a stage needs whatever its layers (the framework, buffers): the rest holds layers."""
    emulated: Emulation | None
    measured_with: dict[str, Any]
    """Provenance: ``source`` is ``measured`` or ``modelled``; the rest is free-form."""
    schema_version: int = LAYER_PROFILE_SCHEMA_VERSION

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def source(self) -> str:
        return self.measured_with["source"]

    @property
    def fingerprint(self) -> str:
        """Content hash: plans record which profiles made them."""
        return content_fingerprint(layer_profile_to_dict(self))


def _layer(node: Node, index: int) -> LayerCost:
    sample = {
        "micro_batch_size": int_reader(1, MAX_MICRO_BATCH_SIZE),
        "step_time_s": number_reader(MIN_TIME_S, MAX_TIME_S),
    }
    sample_nodes = node.obj().keys_within(field_names(LayerCost)).field("samples").items(min_length=1)
    samples = tuple(read_object(n, LayerSample, **sample) for n in sample_nodes)
    check_increasing(sample_nodes, [s.micro_batch_size for s in samples], show_previous=False)
    size = int_reader(0, MAX_BYTES)
    layer = LayerCost(
        **read_values(
            node,
            LayerCost,
            index=int_reader(0),
            name=Node.string,
            parameter_bytes=size,
            optimizer_state_bytes=size,
            activation_bytes_per_sample=size,
            output_bytes_per_sample=size,
            optimizer_step_time_s=number_reader(0.0, MAX_TIME_S),
        ),
        samples=samples,
    )
    if layer.index != index:
        raise node.field("index").fail(f"{index} (layers listed in order from 0)")
    return layer


def layer_profile_from_dict(data: Any, *, source: str = "<layer profile>") -> LayerProfile:
    """Validate parsed JSON and build a `LayerProfile`; raises `FormatError`."""
    root = read_root(data, source, LayerProfile, LAYER_PROFILE_SCHEMA_VERSION, integer=True)
    model = read_model_info(root.field("model"))
    layers = root.field("layers").items(min_length=1, max_length=MAX_LAYERS)
    values = read_values(
        root,
        LayerProfile,
        ("emulated",),
        measured_with=read_measured_with,
        device_type=Node.string,
        memory_capacity_bytes=int_reader(1, MAX_BYTES),
        zero_stage=_pipeline_zero_stage,
        base_memory_bytes=int_reader(0, MAX_BYTES),
        emulated=read_emulation,
    )
    return LayerProfile(**values, model=model, layers=tuple(_layer(node, i) for i, node in enumerate(layers)))


def layer_profile_to_dict(profile: LayerProfile) -> dict[str, Any]:
    data = json_ready(asdict(profile))
    if profile.emulated is None:
        del data["emulated"]
    else:
        data["emulated"] = emulation_to_dict(profile.emulated)
    return data


def layer_profiles_dir(profiles_dir: str | os.PathLike[str]) -> Path:
    """``<profiles>/layers``: where a profile directory keeps its layer profiles."""
    return Path(profiles_dir) / LAYERS_DIR


def load_layer_profile(path: str | os.PathLike[str]) -> LayerProfile:
    return mark_loaded(layer_profile_from_dict(read_json(path), source=str(path)), path)


def load_layer_profiles(directory: str | os.PathLike[str]) -> list[LayerProfile]:
    """Every layer profile in `directory` (a profile directory's ``layers/``, or that folder itself)."""
    directory = Path(directory)
    if (directory / LAYERS_DIR).is_dir():
        directory = directory / LAYERS_DIR
    if not directory.is_dir():
        raise FormatError(str(directory), "(directory)", "a directory of layer profiles", not_a_directory(directory))
    return [load_layer_profile(path) for path in sorted(directory.glob("*.json"))]


def save_layer_profile(profile: LayerProfile, path: str | os.PathLike[str]) -> None:
    write_json_atomic(layer_profile_to_dict(profile), path)


# -- Pipeline plans ------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class PipelineStage:
    """One stage of a pipeline: a rank and the layers it holds."""

    rank: int
    device_type: str
    first_layer: int
    last_layer: int
    """Included: the stage holds layers ``first_layer`` to ``last_layer``."""
    activation_checkpointing: bool = False
    """The stage recomputes its forward in its backward: it keeps only its input per in-flight micro-batch
    (written only when true; a plan without it checkpoints no stage)."""

    @property
    def num_layers(self) -> int:
        return self.last_layer - self.first_layer + 1


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """One copy of the model, trained as a pipeline of stages (1F1B)."""

    stages: tuple[PipelineStage, ...]
    """In stage order: the first holds layer 0."""
    micro_batch_size: int
    num_micro_batches: int
    """Micro-batches this pipeline trains per iteration (DeepSpeed's gradient_accumulation_steps)."""

    @property
    def samples_per_iteration(self) -> int:
        return self.micro_batch_size * self.num_micro_batches

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(stage.rank for stage in self.stages)

    @property
    def boundaries(self) -> tuple[int, ...]:
        """DeepSpeed's ``parts``: the first layer of each stage, then the number of layers."""
        return tuple(stage.first_layer for stage in self.stages) + (self.stages[-1].last_layer + 1,)


@dataclass(frozen=True, kw_only=True)
class PipelinePlan:
    """Pipelines side by side in data parallel; every rank in exactly one of them."""

    policy: str
    zero_stage: int
    global_batch_size: int
    num_layers: int
    pipelines: tuple[Pipeline, ...]
    predicted: Prediction
    profile_fingerprints: dict[str, str]
    parallelism: str = "pipeline"
    schema_version: int = PIPELINE_PLAN_SCHEMA_VERSION

    @property
    def world_size(self) -> int:
        return sum(len(p.stages) for p in self.pipelines)

    def place_of(self, rank: int) -> tuple[int, int]:
        """``(pipeline index, stage index)`` of `rank`."""
        for p, pipeline in enumerate(self.pipelines):
            for s, stage in enumerate(pipeline.stages):
                if stage.rank == rank:
                    return p, s
        raise ValueError(f"rank {rank}: expected a rank of the plan (0 to {self.world_size - 1})")

    @property
    def rank_device_types(self) -> tuple[str, ...]:
        """Each rank's device type, in rank order."""
        types = {stage.rank: stage.device_type for p in self.pipelines for stage in p.stages}
        return tuple(types[r] for r in range(self.world_size))


def _stage(node: Node, num_layers: int) -> PipelineStage:
    layer = int_reader(0, num_layers - 1)
    rank = int_reader(0, MAX_WORLD_SIZE - 1)
    stage = read_object(
        node,
        PipelineStage,
        first_layer=layer,
        last_layer=layer,
        rank=rank,
        device_type=Node.string,
        activation_checkpointing=Node.boolean,
    )
    if stage.last_layer < stage.first_layer:
        raise node.field("last_layer").fail(f"a layer at or after first_layer ({stage.first_layer})")
    return stage


def _pipeline(node: Node, num_layers: int) -> Pipeline:
    stage_nodes = (
        node.obj().keys_within(field_names(Pipeline)).field("stages").items(min_length=1, max_length=num_layers)
    )
    stages = tuple(_stage(n, num_layers) for n in stage_nodes)
    expected_first = 0
    for stage, stage_node in zip(stages, stage_nodes):
        if stage.first_layer != expected_first:
            raise stage_node.field("first_layer").fail(
                f"{expected_first} (the stages cover the layers in order, each from where the last ended)"
            )
        expected_first = stage.last_layer + 1
    if expected_first != num_layers:
        raise stage_nodes[-1].field("last_layer").fail(f"{num_layers - 1}, the model's last layer (num_layers)")
    counts = {
        "micro_batch_size": int_reader(1, MAX_MICRO_BATCH_SIZE),
        "num_micro_batches": int_reader(1, MAX_GLOBAL_BATCH_SIZE),
    }
    return Pipeline(**read_values(node, Pipeline, **counts), stages=stages)


def pipeline_plan_from_dict(data: Any, *, source: str = "<pipeline plan>") -> PipelinePlan:
    """Validate parsed JSON and build a `PipelinePlan`; raises `FormatError`. Checks its own consistency (every rank
    0..N-1 in one stage, stages covering the layers in order, the global batch the pipelines' sum, ZeRO stage 0 or 1);
    cluster and memory where known (`search.pipeline_search.check_pipeline_plan`, the runtime)."""
    root = read_root(data, source, PipelinePlan, PIPELINE_PLAN_SCHEMA_VERSION, integer=True)
    root.field("parallelism").string(choices=("pipeline",))
    num_layers = root.field("num_layers").integer(minimum=1, maximum=MAX_LAYERS)
    pipeline_nodes = root.field("pipelines").items(min_length=1, max_length=MAX_WORLD_SIZE)
    pipelines = tuple(_pipeline(n, num_layers) for n in pipeline_nodes)
    stages_of_rank = Counter(stage.rank for p in pipelines for stage in p.stages)
    world_size = sum(stages_of_rank.values())
    missing = [r for r in range(world_size) if r not in stages_of_rank]
    if missing:  # a rank in two stages leaves another rank of 0..N-1 out
        repeated = sorted(r for r, count in stages_of_rank.items() if count > 1)
        raise root.field("pipelines").fail(
            f"every rank from 0 to {world_size - 1} in exactly one stage (missing: {_ranks_text(missing)}, "
            f"in more than one stage: {_ranks_text(repeated)})"
        )
    total = sum(p.samples_per_iteration for p in pipelines)
    values = read_values(
        root,
        PipelinePlan,
        global_batch_size=lambda n: read_total(n, total, "pipelines of micro_batch_size * num_micro_batches"),
        predicted=read_prediction,
        policy=lambda n: n.string(choices=POLICIES),
        zero_stage=_pipeline_zero_stage,
        profile_fingerprints=read_fingerprints,
    )
    return PipelinePlan(**values, num_layers=num_layers, pipelines=pipelines)


def _ranks_text(ranks: list[int], limit: int = 8) -> str:
    """``[1, 4]``; a long list cut after `limit` ranks, with its length (a message stays one line)."""
    if not ranks:
        return "none"
    return str(ranks) if len(ranks) <= limit else f"[{', '.join(map(str, ranks[:limit]))}, ...] ({len(ranks)} ranks)"


def pipeline_plan_to_dict(plan: PipelinePlan) -> dict[str, Any]:
    data = json_ready(asdict(plan))
    # Only where true: a plan that checkpoints nothing is written as before the field existed.
    for pipeline in data["pipelines"]:
        for stage in pipeline["stages"]:
            if not stage["activation_checkpointing"]:
                del stage["activation_checkpointing"]
    return data


def save_pipeline_plan(plan: PipelinePlan, path: str | os.PathLike[str]) -> None:
    write_json_atomic(pipeline_plan_to_dict(plan), path)


def load_pipeline_plan(path: str | os.PathLike[str]) -> PipelinePlan:
    return pipeline_plan_from_dict(read_json(path), source=str(path))


def plan_parallelism(data: Any) -> str:
    """``zero`` or ``pipeline``: what a parsed plan trains (absent: ``zero``, as every plan before pipelines)."""
    if isinstance(data, dict) and data.get("parallelism", "zero") == "pipeline":
        return "pipeline"
    return "zero"


def any_plan_from_dict(data: Any, *, source: str = "<plan>") -> Plan | PipelinePlan:
    """A ZeRO plan or a pipeline plan, by its ``parallelism``."""
    parallelism = Node(data, source).obj().optional("parallelism")
    if parallelism is not None:
        parallelism.string(choices=PARALLELISMS)  # each reader alone names only its own kind
    if plan_parallelism(data) == "pipeline":
        return pipeline_plan_from_dict(data, source=source)
    return plan_from_dict(data, source=source)


def load_any_plan(path: str | os.PathLike[str]) -> Plan | PipelinePlan:
    return any_plan_from_dict(read_json(path), source=str(path))


def cluster_problems(plan: Plan | PipelinePlan, cluster: Cluster) -> list[str]:
    """Sentences on `plan`'s ranks against `cluster`'s: every rank once (pipelines), their number, their types."""
    if isinstance(plan, PipelinePlan):
        ranks = sorted(stage.rank for p in plan.pipelines for stage in p.stages)
        if ranks != list(range(len(ranks))):
            return [f"The plan's stages do not hold every rank from 0 to {len(ranks) - 1} exactly once."]
    problems = []
    if plan.world_size != cluster.world_size:
        problems.append(f"The plan has {plan.world_size} ranks but the cluster has {cluster.world_size}.")
    wrong = [
        f"rank {rank} ({planned} in the plan, {actual} in the cluster)"
        for rank, (planned, actual) in enumerate(zip(plan.rank_device_types, cluster.rank_device_types))
        if planned != actual
    ]
    if wrong:
        problems.append(f"Device types differ from the cluster's at {listed(wrong)}.")
    return problems
