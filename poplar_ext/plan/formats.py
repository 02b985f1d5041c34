"""Profiles, cluster descriptions and plans: read (validated, `FormatError`) and written, the writers producing
exactly what the loaders accept. See profiles/README.md."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
import stat
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import kinds
from .errors import FormatError
from .validation import MAX_JSON_DEPTH, Node, json_depth

PROFILE_SCHEMA_VERSION = 1
CLUSTER_SCHEMA_VERSION = 1
PLAN_SCHEMA_VERSION = 1
ZERO_STAGES = (0, 1, 2, 3)
POLICIES = ("uniform", "proportional", "poplar")

Levers = tuple[bool, bool]
"""``(activation_checkpointing, optimizer_offload)``: the memory levers one device type uses."""

OFFLOAD_STAGES = (1, 2)
"""The ZeRO stages at which poplar-ext offloads an optimizer (DeepSpeed lets ranks differ
there: bench/results/mixed_offload)."""


def levers_text(activation_checkpointing: bool, optimizer_offload: bool = False) -> str:
    """`` with activation checkpointing and optimizer offload`` (each only when set; '' for neither)."""
    names = ("activation checkpointing", "optimizer offload")
    used = [name for name, on in zip(names, (activation_checkpointing, optimizer_offload)) if on]
    return f" with {' and '.join(used)}" if used else ""


def listed(items: list[str], limit: int = 3) -> str:
    """The first `limit` items joined by commas, then how many more (for messages)."""
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def one_accumulation_count(zero_stage: int) -> bool:
    """Whether every rank must run the same number of micro-steps per iteration at `zero_stage`.

    DeepSpeed reduces gradients on every micro-step at ZeRO stages 2 and 3 (and gathers parameters in every forward at
    3): a rank with more micro-steps would wait in a collective no other rank enters. Stages 0 and 1 communicate at the
    boundary only, so their ranks may differ in accumulation count.
    """
    return zero_stage >= 2


PROFILE_SOURCES = ("measured", "modelled")
DTYPES = ("float32", "bfloat16", "float16")

# What the search can do, so that no input makes it run out of memory or time: every
# size in a file and every argument of the search is held to these, with a message.
MAX_GLOBAL_BATCH_SIZE = 2**31
"""Samples per iteration over all ranks."""
MAX_MICRO_BATCH_SIZE = 2**20
"""Samples per micro-step on one rank (the step-time table has one entry per size)."""
MAX_WORLD_SIZE = 2**16
"""Ranks in a cluster, a plan or a profile's job."""
MIN_TIME_S = 1e-9
"""Shortest micro-step or iteration time a file may state (the profiler's own floor)."""
MAX_TIME_S = 1e6
"""Longest time a file may state (about 11 days)."""
MAX_BYTES = 2**62
"""Largest memory size or parameter count a file may state."""
MAX_SLOWDOWN = 1e4
"""Largest compute slowdown of an emulated device type."""
MAX_BANDWIDTH_BYTES_PER_S = 1e15
"""Largest bandwidth a file may state (1 PB/s: free); a network fit with no measurable size dependence gets it."""


# -- Reading: every format's objects are read field by field by these ----------------
Reader = Callable[[Node], Any]


def int_reader(minimum: int | None = None, maximum: int | None = None) -> Reader:
    """A field's reader: an integer within the bounds."""
    return lambda node: node.integer(minimum=minimum, maximum=maximum)


def number_reader(minimum: float | None = None, maximum: float | None = None, *, positive: bool = False) -> Reader:
    """A field's reader: a number within the bounds (`positive`: above 0)."""
    return lambda node: node.number(minimum=minimum, maximum=maximum, positive=positive)


def field_names(cls: type) -> tuple[str, ...]:
    """The JSON keys of a format's object: its dataclass's fields (one source for both)."""
    return tuple(f.name for f in dataclasses.fields(cls))


def read_values(node: Node, cls: type, optional: tuple[str, ...] = (), **readers: Reader) -> dict[str, Any]:
    """`cls`'s fields read from `node` in the order of `readers`; a field with a default, or in `optional`
    (then None), may be absent or null (files written before it existed)."""
    values = {}
    for name, read in readers.items():
        spec = cls.__dataclass_fields__[name]  # type: ignore[attr-defined]
        has_default = spec.default is not dataclasses.MISSING or spec.default_factory is not dataclasses.MISSING
        child = node.optional(name) if has_default or name in optional else node.field(name)
        if child is not None:
            values[name] = read(child)
        elif not has_default:
            values[name] = None
    return values


def read_object(node: Node, cls: type, optional: tuple[str, ...] = (), **readers: Reader) -> Any:
    """A `cls` from an object holding no key but its fields (`read_values`)."""
    return cls(**read_values(node.obj().keys_within(field_names(cls)), cls, optional, **readers))


def read_root(data: Any, source: str, cls: type, version: int, *more_keys: str, integer: bool = False) -> Node:
    """The top-level object of a file of `cls`, its keys and its ``schema_version`` checked (`integer`: first
    an integer, as the pipeline formats have always asked: 1.0 is refused there); a file of another format is
    named as such (`kinds.refuse_other_format`), its keys not taken for misspelt ones."""
    root = Node(data, source).obj()
    kinds.refuse_other_format(data, source, cls.__name__)
    root.keys_within((*field_names(cls), *more_keys))
    found = root.field("schema_version")
    if integer:
        found.integer()
    if isinstance(found.value, bool) or found.value != version:
        raise found.fail(f"schema_version {version}")
    return root


def list_reader(read: Reader, **length: int) -> Reader:
    """A field's reader: a list (of `length`: ``min_length``, ``max_length``) of items each read by `read`."""
    return lambda node: tuple(read(item) for item in node.items(**length))


def check_increasing(nodes: list[Node], sizes: list[int], *, show_previous: bool = True) -> None:
    """Sample sizes strictly increasing: the curve fit relies on it, and a duplicate size means two
    measurements were merged wrongly upstream."""
    for node, size, previous in zip(nodes[1:], sizes[1:], sizes):
        if size <= previous:
            shown = f" ({previous})" if show_previous else ""
            raise node.field("micro_batch_size").fail(f"a micro_batch_size larger than the previous sample's{shown}")


def read_measured_with(node: Node) -> dict[str, Any]:
    """``measured_with``: free-form provenance with a ``source``, but JSON that the fingerprint can hash; the one
    other key the cost model reads, ``micro_step_times_include_communication``, a boolean where it is given."""
    node.obj().within_depth(MAX_JSON_DEPTH).field("source").string(choices=PROFILE_SOURCES)
    flag = node.optional("micro_step_times_include_communication")
    if flag is not None:
        flag.boolean()  # anything else was ignored for the clock's guess
    return dict(node.value)


def read_fingerprints(node: Node) -> dict[str, str]:
    """``profile_fingerprints``: device type -> the fingerprint of the profile a plan was made from."""
    return {name: child.string() for name, child in node.entries()}


def _offload(zero_stage: int) -> Reader:
    """``optimizer_offload``, which only ZeRO stages 1-2 may set."""

    def read(node: Node) -> bool:
        if node.boolean() and zero_stage not in OFFLOAD_STAGES:
            raise node.fail(f"false at ZeRO stage {zero_stage} (poplar-ext offloads the optimizer at stages 1-2 only)")
        return node.value

    return read


def _with_schema_version_first(data: dict[str, Any]) -> dict[str, Any]:
    """schema_version first: it is the first thing a reader of the file looks for."""
    return {"schema_version": data.pop("schema_version"), **data}


# -- Profiles ------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    """Identity of the model a profile was taken with."""

    name: str
    """Human-readable model name, e.g. ``gpt-124m``."""
    fingerprint: str
    """Hash of the architecture and parameter shapes; profiles of another model never mix."""
    num_parameters: int
    """Total parameter count."""
    dtype: str
    """Training dtype: ``float32``, ``bfloat16`` or ``float16``."""
    sequence_length: int | None = None
    """Tokens per sample for sequence models (None when it does not apply)."""


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One measured (or modelled) micro-batch size."""

    micro_batch_size: int
    """Samples in one micro-step on one rank."""
    micro_step_time_s: float
    """One forward + backward at this size on this device under this stage (median)."""
    peak_memory_bytes: int
    """Peak device memory during that micro-step."""


@dataclass(frozen=True, kw_only=True)
class Emulation:
    """How an emulated device type is made from a real one."""

    slowdown: float
    """Compute is slowed by this factor (1.0 = as fast as the real device)."""
    memory_capacity_bytes: int
    """The memory the emulated device pretends to have."""
    slowdown_schedule: tuple[tuple[int, float, int | None], ...] = ()
    """Drift during training: ``(optimizer_step, slowdown, rank)`` entries (JSON: ``[step, slowdown]`` for every rank of
    the type, ``[step, slowdown, rank]`` for one rank of it); from that optimizer step on the rank runs at that slowdown
    instead of `slowdown` (see `poplar_ext.hardware.emulation.scheduled_slowdown`). Empty: constant."""


@dataclass(frozen=True, kw_only=True)
class IncludedCommunication:
    """The collectives a profile's times hold, priced when it was measured from the network file measured
    with it (the cost model takes them out before it adds the job's own)."""

    micro_step_exposed_s: float
    """Per micro-step, collectives compute waits for (held only where the micro-step times include them)."""
    micro_step_overlapped_s: float
    """Per micro-step, collectives DeepSpeed overlaps with backward (stage 3 on GPUs)."""
    boundary_s: float
    """At the accumulation boundary: held by `Profile.optimizer_step_time_s`."""


@dataclass(frozen=True, kw_only=True)
class Profile:
    """One device type at one ZeRO stage for one model: the search's only input on speed."""

    device_type: str
    memory_capacity_bytes: int
    zero_stage: int
    world_size: int
    model: ModelInfo
    max_micro_batch_size: int
    """Largest micro-batch that fits; 0 means the model does not fit at this stage."""
    samples: tuple[Sample, ...]
    optimizer_step_time_s: float
    """Time of the accumulation boundary: optimizer step plus boundary collectives."""
    emulated: Emulation | None
    measured_with: dict[str, Any]
    """Provenance. ``source`` is ``measured`` or ``modelled``; the rest (library
    versions, host, hardware, date, or the analytic model used) is free-form."""
    activation_checkpointing: bool = False
    """Measured with activation checkpointing (each block's activations recomputed in
    backward instead of kept): slower micro-steps, larger micro-batches fit."""
    optimizer_offload: bool = False
    """Measured with the optimizer offloaded to the host (DeepSpeed's ``zero_optimization.offload_optimizer``; ZeRO
    stages 1-2 only): the optimizer state and fp32 master weights leave the device, the boundary takes longer."""
    included_communication: IncludedCommunication | None = None
    """The communication its times hold, priced at profiling (None: priced from the job's network file,
    which is right only where the profile was measured over the same network)."""
    schema_version: int = PROFILE_SCHEMA_VERSION

    @property
    def source(self) -> str:
        """``measured`` or ``modelled``."""
        return self.measured_with["source"]

    @property
    def key(self) -> tuple[str, int, bool, bool]:
        """``(device_type, zero_stage, activation_checkpointing, optimizer_offload)``: one profile per key and model."""
        return (self.device_type, self.zero_stage, self.activation_checkpointing, self.optimizer_offload)

    @property
    def levers(self) -> Levers:
        """``(activation_checkpointing, optimizer_offload)``: the memory levers it was measured with."""
        return (self.activation_checkpointing, self.optimizer_offload)

    @property
    def fingerprint(self) -> str:
        """Content hash of the whole profile: plans record which profiles made them."""
        data = profile_to_dict(self)
        # Profiles from before these fields hash as they did, so plans naming them stay valid.
        for lever in ("activation_checkpointing", "optimizer_offload"):
            if not data[lever]:
                del data[lever]
        return content_fingerprint(data)


MAX_SCHEDULE_ENTRIES = 10_000


def _schedule_entry(item: Node) -> tuple[int, float, int | None]:
    if not isinstance(item.value, list):
        raise item.fail("[optimizer_step, slowdown] or [optimizer_step, slowdown, rank]")
    values = item.items(min_length=2, max_length=3)
    step = values[0].integer(minimum=0)
    slowdown = values[1].number(positive=True, maximum=MAX_SLOWDOWN)
    return step, slowdown, values[2].integer(minimum=0, maximum=MAX_WORLD_SIZE - 1) if len(values) == 3 else None


def read_emulation(node: Node) -> Emulation:
    schedule = list_reader(_schedule_entry, max_length=MAX_SCHEDULE_ENTRIES)
    return read_object(
        node,
        Emulation,
        slowdown=number_reader(positive=True, maximum=MAX_SLOWDOWN),
        memory_capacity_bytes=int_reader(1, MAX_BYTES),
        slowdown_schedule=lambda n: tuple(sorted(schedule(n), key=lambda entry: entry[0])),
    )


def emulation_to_dict(emulation: Emulation) -> dict[str, Any]:
    """JSON form of an emulation; ``slowdown_schedule`` only when there is one (files without drift stay
    as they were)."""
    data: dict[str, Any] = {"slowdown": emulation.slowdown, "memory_capacity_bytes": emulation.memory_capacity_bytes}
    if emulation.slowdown_schedule:
        data["slowdown_schedule"] = [
            [step, slowdown] if rank is None else [step, slowdown, rank]
            for step, slowdown, rank in emulation.slowdown_schedule
        ]
    return data


def read_model_info(node: Node) -> ModelInfo:
    """The ``model`` object of a profile or a layer profile."""
    return read_object(
        node,
        ModelInfo,
        name=Node.string,
        fingerprint=Node.string,
        num_parameters=int_reader(1, MAX_BYTES),
        dtype=lambda n: n.string(choices=DTYPES),
        sequence_length=int_reader(1, MAX_BYTES),
    )


def profile_from_dict(data: Any, *, source: str = "<profile>") -> Profile:
    """Validate parsed JSON and build a `Profile`; raises `FormatError`."""
    root = read_root(data, source, Profile, PROFILE_SCHEMA_VERSION)
    model = read_model_info(root.field("model"))
    max_mbs_node = root.field("max_micro_batch_size")
    max_mbs = max_mbs_node.integer(minimum=0, maximum=MAX_MICRO_BATCH_SIZE)
    sample_nodes = root.field("samples").items(min_length=0 if max_mbs == 0 else 1)
    sample = {
        "micro_batch_size": int_reader(1, MAX_MICRO_BATCH_SIZE),
        "micro_step_time_s": number_reader(MIN_TIME_S, MAX_TIME_S),
    }
    samples = [read_object(node, Sample, **sample, peak_memory_bytes=int_reader(1, MAX_BYTES)) for node in sample_nodes]
    check_increasing(sample_nodes, [s.micro_batch_size for s in samples])
    if samples and samples[-1].micro_batch_size > max_mbs:
        raise max_mbs_node.fail(f"at least the largest sampled micro_batch_size ({samples[-1].micro_batch_size})")
    zero_stage = root.field("zero_stage").integer(minimum=0, maximum=3)
    included = {key: number_reader(0.0, MAX_TIME_S) for key in field_names(IncludedCommunication)}
    values = read_values(
        root,
        Profile,
        ("emulated",),
        measured_with=read_measured_with,
        device_type=Node.string,
        memory_capacity_bytes=int_reader(1, MAX_BYTES),
        world_size=int_reader(1, MAX_WORLD_SIZE),
        optimizer_step_time_s=number_reader(0.0, MAX_TIME_S),
        emulated=read_emulation,
        activation_checkpointing=Node.boolean,
        optimizer_offload=_offload(zero_stage),
        included_communication=lambda n: read_object(n, IncludedCommunication, **included),
    )
    return Profile(**values, zero_stage=zero_stage, model=model, max_micro_batch_size=max_mbs, samples=tuple(samples))


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    """The JSON form of a profile (the inverse of `profile_from_dict`)."""
    data = dataclasses.asdict(profile)
    data["samples"] = list(data["samples"])
    data["emulated"] = None if profile.emulated is None else emulation_to_dict(profile.emulated)
    if profile.included_communication is None:
        del data["included_communication"]  # as files written before it: their fingerprints stay
    return _with_schema_version_first(data)


# -- Cluster description -------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class DeviceGroup:
    """`count` devices of one type on a node."""

    device_type: str
    count: int


@dataclass(frozen=True, kw_only=True)
class ClusterNode:
    """One machine; its devices get consecutive ranks, as the deepspeed launcher numbers them."""

    name: str
    devices: tuple[DeviceGroup, ...]
    uplink_bandwidth_bytes_per_s: float | None = None
    """What the node's link to the other nodes carries (bytes per second; None: not declared). A transfer
    between two nodes runs at the slower uplink, a ring across nodes at the slowest (`search.pipeline_cost`)."""


@dataclass(frozen=True, kw_only=True)
class DeviceTypeInfo:
    """Extra facts about a device type; today only an optional emulation."""

    emulation: Emulation | None = None


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Which device type each rank has."""

    nodes: tuple[ClusterNode, ...]
    device_types: dict[str, DeviceTypeInfo] = field(default_factory=dict)
    schema_version: int = CLUSTER_SCHEMA_VERSION

    @property
    def rank_device_types(self) -> tuple[str, ...]:
        """Device type of every rank, rank 0 first (node order, then device order)."""
        return tuple(group.device_type for node in self.nodes for group in node.devices for _ in range(group.count))

    @property
    def world_size(self) -> int:
        return len(self.rank_device_types)

    def type_counts(self) -> dict[str, int]:
        """Number of ranks of each device type, in order of first appearance."""
        return dict(Counter(self.rank_device_types))

    def emulation_of(self, device_type: str) -> Emulation | None:
        """The emulation declared for `device_type`, or None when it is real."""
        info = self.device_types.get(device_type)
        return None if info is None else info.emulation


def cluster_from_dict(data: Any, *, source: str = "<cluster>") -> Cluster:
    """Validate parsed JSON and build a `Cluster`; raises `FormatError`."""
    root = read_root(data, source, Cluster, CLUSTER_SCHEMA_VERSION)
    names: set[str] = set()
    world_size = 0

    def name(node: Node) -> str:
        if node.string() in names:
            raise node.fail("a node name not used by an earlier node")
        names.add(node.value)
        return node.value

    def count(node: Node) -> int:
        nonlocal world_size
        world_size += node.integer(minimum=1, maximum=MAX_WORLD_SIZE)
        if world_size > MAX_WORLD_SIZE:
            raise node.fail(f"a count that keeps the cluster within {MAX_WORLD_SIZE} ranks (the search's limit)")
        return node.value

    group = {"device_type": Node.string, "count": count}
    nodes = list_reader(
        lambda node: read_object(
            node,
            ClusterNode,
            name=name,
            devices=list_reader(lambda g: read_object(g, DeviceGroup, **group), min_length=1),
            uplink_bandwidth_bytes_per_s=number_reader(positive=True, maximum=MAX_BANDWIDTH_BYTES_PER_S),
        ),
        min_length=1,
    )(root.field("nodes"))
    device_types: dict[str, DeviceTypeInfo] = {}
    types_node = root.optional("device_types")
    used = {g.device_type for n in nodes for g in n.devices}
    for type_name, info in types_node.entries() if types_node is not None else ():
        if type_name not in used:
            raise info.fail("a device type that some node uses", raw_found=f"{type_name!r}, which no node lists")
        device_types[type_name] = read_object(info, DeviceTypeInfo, emulation=read_emulation)
    cluster = Cluster(nodes=nodes, device_types=device_types)
    _check_schedule_ranks(cluster, types_node)
    return cluster


def _check_schedule_ranks(cluster: Cluster, types_node: Node | None) -> None:
    """A ``slowdown_schedule`` entry for one rank must name a rank of its device type."""
    for type_name, info in cluster.device_types.items():
        schedule = info.emulation.slowdown_schedule if info.emulation else ()
        ranks = {rank for _, _, rank in schedule if rank is not None}
        ranks_of_type = [r for r, t in enumerate(cluster.rank_device_types) if t == type_name]
        stray = min(ranks - set(ranks_of_type), default=None)
        if stray is not None and types_node is not None:
            shown = ", ".join(map(str, ranks_of_type[:8])) + (", ..." if len(ranks_of_type) > 8 else "")
            raise (
                types_node.child(type_name)
                .child("emulation")
                .child("slowdown_schedule")
                .fail(f"entries whose rank is one of {type_name!r}'s ranks ({shown})", raw_found=f"rank {stray}")
            )


def _node_to_dict(node: ClusterNode) -> dict[str, Any]:
    data: dict[str, Any] = {"name": node.name, "devices": [dataclasses.asdict(g) for g in node.devices]}
    # Written only when declared: a file without links reads, writes and hashes as before.
    if node.uplink_bandwidth_bytes_per_s is not None:
        data["uplink_bandwidth_bytes_per_s"] = node.uplink_bandwidth_bytes_per_s
    return data


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    """The JSON form of a cluster description."""
    return {
        "schema_version": cluster.schema_version,
        "nodes": [_node_to_dict(n) for n in cluster.nodes],
        "device_types": {
            name: {"emulation": None if info.emulation is None else emulation_to_dict(info.emulation)}
            for name, info in cluster.device_types.items()
        },
    }


# -- Plans ---------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class RankPlan:
    """What one rank runs each iteration."""

    rank: int
    device_type: str
    micro_batch_size: int
    gradient_accumulation_steps: int
    activation_checkpointing: bool = False
    """Whether this rank recomputes activations in backward (chosen per device type by the search)."""
    optimizer_offload: bool = False
    """Whether this rank keeps its optimizer state on the host (ZeRO stages 1-2; chosen per device type)."""

    @property
    def samples_per_iteration(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps

    @property
    def levers(self) -> Levers:
        """``(activation_checkpointing, optimizer_offload)``, as `Profile.levers`."""
        return (self.activation_checkpointing, self.optimizer_offload)


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What the cost model predicts for a plan."""

    iteration_time_s: float
    samples_per_s: float
    ideal_samples_per_s: float
    """Sum over ranks of each device's best standalone throughput under the same stage."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Per-rank allocation for one training job. Plain data: it never asks which rank runs it."""

    policy: str
    zero_stage: int
    global_batch_size: int
    ranks: tuple[RankPlan, ...]
    predicted: Prediction
    profile_fingerprints: dict[str, str]
    """Device type -> `Profile.fingerprint` of the profile the plan was made from."""
    calibration: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Device type -> what the check of a cached profile at start did (`poplar_ext.profiler.calibration`):
    ``{"outcome": "trusted" | "rescaled" | "remeasured" | "not checked", "measured_over_profiled": 1.23,
    "sizes": [8]}``. Empty: no profile was checked (a plan file, fresh profiles, or a search's plan)."""
    schema_version: int = PLAN_SCHEMA_VERSION

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def rank_device_types(self) -> tuple[str, ...]:
        """Each rank's device type, in rank order (as `Cluster`'s and `PipelinePlan`'s)."""
        return tuple(r.device_type for r in self.ranks)


def read_prediction(node: Node) -> Prediction:
    """The ``predicted`` object of a plan or a pipeline plan."""
    return read_object(node, Prediction, **dict.fromkeys(field_names(Prediction), number_reader(positive=True)))


def read_total(node: Node, total: int, what: str) -> int:
    """``global_batch_size``, which must be `total`, the sum over the plan's `what`."""
    if node.integer(minimum=1, maximum=MAX_GLOBAL_BATCH_SIZE) != total:
        raise node.fail(f"the sum over {what} ({total})")
    return total


def plan_from_dict(data: Any, *, source: str = "<plan>") -> Plan:
    """Validate parsed JSON and build a `Plan`; raises `FormatError`. Checks its own consistency (ranks 0..N-1 in
    order, samples summing to the global batch); cluster and memory where known (`search.check_plan`, the runtime)."""
    parallelism = Node(data, source).obj().optional("parallelism")
    if parallelism is not None:
        # pipeline plans have their own reader: poplar_ext.plan.pipeline_formats.any_plan_from_dict
        parallelism.string(choices=("zero",))
    root = read_root(data, source, Plan, PLAN_SCHEMA_VERSION, "parallelism")
    zero_stage = root.field("zero_stage").integer(minimum=0, maximum=3)
    ranks = []
    for index, node in enumerate(root.field("ranks").items(min_length=1, max_length=MAX_WORLD_SIZE)):
        rank = read_object(
            node,
            RankPlan,
            rank=int_reader(0),
            device_type=Node.string,
            micro_batch_size=int_reader(1, MAX_MICRO_BATCH_SIZE),
            gradient_accumulation_steps=int_reader(1, MAX_GLOBAL_BATCH_SIZE),
            activation_checkpointing=Node.boolean,
            optimizer_offload=_offload(zero_stage),
        )
        if rank.rank != index:
            raise node.field("rank").fail(f"rank {index} (ranks listed in order from 0)")
        ranks.append(rank)
    total = sum(r.samples_per_iteration for r in ranks)
    return Plan(
        **read_values(
            root,
            Plan,
            global_batch_size=lambda n: read_total(n, total, "ranks of micro_batch_size * gradient_accumulation_steps"),
            predicted=read_prediction,
            profile_fingerprints=read_fingerprints,
            policy=lambda n: n.string(choices=POLICIES),
            calibration=_calibration,
        ),
        zero_stage=zero_stage,
        ranks=tuple(ranks),
    )


CALIBRATION_OUTCOMES = ("trusted", "rescaled", "remeasured", "not checked")
"""`Plan.calibration`'s outcomes (`poplar_ext.profiler.calibration` decides them)."""


def _calibration(node: Node) -> dict[str, dict[str, Any]]:
    """``calibration`` (absent in plans written before it, or made without a check: empty)."""
    checks = {}
    for device_type, entry in node.entries():
        entry.obj().keys_within(("outcome", "measured_over_profiled", "sizes"))
        checks[device_type] = {
            "outcome": entry.field("outcome").string(choices=CALIBRATION_OUTCOMES),
            "measured_over_profiled": entry.field("measured_over_profiled").number(positive=True),
            "sizes": [size.integer(minimum=1, maximum=MAX_MICRO_BATCH_SIZE) for size in entry.field("sizes").items()],
        }
    return checks


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The JSON form of a plan."""
    data = dataclasses.asdict(plan)
    data["ranks"] = list(data["ranks"])
    if not plan.calibration:
        del data["calibration"]  # plans without a check read as before
    return _with_schema_version_first(data)


# -- Files ---------------------------------------------------------------------------
class _DuplicateKey(Exception):
    """A key given twice in a JSON object: ``args[0]``."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (json's default keeps the last one without a word)."""
    data = dict(pairs)
    if len(data) < len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(key for key, _ in pairs if key in seen or seen.add(key)))
    return data


def read_json(path: str | os.PathLike[str]) -> Any:
    """Parse a JSON file; unreadable files and bad JSON are `FormatError`s naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise FormatError(str(path), "(file)", "a readable JSON file", _unreadable(exc)) from exc
    except UnicodeDecodeError as exc:
        raise FormatError(
            str(path), "(file)", "a UTF-8 JSON file", f"a byte that is not UTF-8 at offset {exc.start}"
        ) from exc
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        # json's own words ("Expecting value") read oddly after "found"; a file cut short says so.
        cut_short = exc.pos >= len(text.rstrip())
        found = "the end of the file (it stops early)" if cut_short else f"a syntax error ({exc.msg})"
        raise FormatError(str(path), f"(line {exc.lineno}, column {exc.colno})", "valid JSON", found) from exc
    except _DuplicateKey as exc:
        raise FormatError(str(path), "(file)", "each key once in an object", f"the key {exc.args[0]!r} twice") from None
    except RecursionError:
        data = None
    if data is None and text.strip() != "null" or json_depth(data) > MAX_JSON_DEPTH:
        raise FormatError(str(path), "(file)", f"JSON nested at most {MAX_JSON_DEPTH} deep", "deeper nesting")
    return data


def _unreadable(exc: OSError) -> str:
    """What a file that cannot be read is, in words (an ``OSError``'s name and text for the rarer ones)."""
    if isinstance(exc, FileNotFoundError):
        return "no such file"
    if isinstance(exc, IsADirectoryError):
        return "a folder"
    if isinstance(exc, PermissionError):
        return "a file this user may not read"
    return f"{type(exc).__name__}: {exc.strerror or exc}"


def json_ready(data: dict[str, Any]) -> dict[str, Any]:
    """Tuples as lists: the dict equals what reading its JSON gives."""
    return json.loads(json.dumps(data))


def write_text_atomic(text: str, path: str | os.PathLike[str]) -> None:
    """Write `text` so that the file is either complete or untouched (temp file + rename). A new file gets
    the mode open() would give it (0666 less the umask, applied by the system); a replaced one keeps its own."""
    path = Path(os.path.realpath(path))  # a symlink's target is written, as open() would; the rename keeps the link
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # not mkstemp's private 0600
    try:
        with contextlib.suppress(FileNotFoundError):
            os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(data: Any, path: str | os.PathLike[str]) -> None:
    """Write JSON so that the file is either complete or untouched (temp file + rename)."""
    write_text_atomic(json.dumps(data, indent=2, sort_keys=False) + "\n", path)


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Load and validate one profile file."""
    return mark_loaded(profile_from_dict(read_json(path), source=str(path)), path)


_LOADED_FROM = "_poplar_loaded_from"


def mark_loaded(item: Any, path: str | os.PathLike[str]) -> Any:
    """`item` (a profile or layer profile just read from `path`) remembering its file for `loaded_from`."""
    # Not a dataclass field: JSON, equality and fingerprints stay the content's, and dataclasses.replace (a
    # rescaled or renamed profile, no longer the file's) drops it.
    object.__setattr__(item, _LOADED_FROM, str(path))
    return item


def loaded_from(item: Any) -> str | None:
    """The file a profile or layer profile was loaded from (`load_profiles`, `load_layer_profiles`, ...), or None
    for one made in Python."""
    return getattr(item, _LOADED_FROM, None)


def models_text(profiles: Any) -> str:
    """Each model of `profiles` (profiles or layer profiles) as ``name (fingerprint)``, followed by the files its
    profiles were loaded from where known (``: a.json, b.json``); ``; `` between models. For messages on mixed
    models: the fingerprints alone do not say which files to move."""
    files: dict[tuple[str, str], list[str]] = {}
    for profile in profiles:
        named = files.setdefault((profile.model.fingerprint, profile.model.name), [])
        path = loaded_from(profile)
        if path is not None:
            named.append(path)
    return "; ".join(
        f"{name} ({fingerprint})" + (f": {listed(sorted(paths))}" if paths else "")
        for (fingerprint, name), paths in sorted(files.items())
    )


def mixed_models(profiles: Any) -> tuple[int, str] | None:
    """How many models `profiles` (profiles or layer profiles) are of, and them as ``name (fingerprint), ...``,
    where they are more than one; None for one model. A model is its fingerprint: profiles of one fingerprint under
    two names (``poplar-profile --model hf:...``'s name beside the class name the automatic mode gives the stages it
    measures into the same folder) are one model's, its names joined by `` / ``."""
    models: dict[str, set[str]] = {}
    for profile in profiles:
        models.setdefault(profile.model.fingerprint, set()).add(profile.model.name)
    if len(models) < 2:
        return None
    return len(models), ", ".join(
        f"{' / '.join(sorted(names))} ({fingerprint})" for fingerprint, names in sorted(models.items())
    )


MEASURED_ALIKE = ("dtype", "sequence_length")
"""The `ModelInfo` fields a model's profiles share beside its fingerprint, which is taken from the model before
DeepSpeed casts it, not from the batch: one job trains in one of each, while a cache may keep one type's profiles in
one and another type's in another."""


def check_measured_alike(profiles: Any, kind: str) -> None:
    """A ValueError where `profiles` (of `kind`: the ones a search or prediction uses, one model's) differ in the
    model's dtype or sequence length: their times are not one job's, and the search would mix them unnoticed."""
    for name in MEASURED_ALIKE:
        values: dict[Any, list[str]] = {}
        for profile in profiles:
            path = loaded_from(profile)
            where = f"{profile.device_type} at stage {profile.zero_stage}" + (f" ({path})" if path else "")
            value = getattr(profile.model, name)
            if value is not None:  # a sequence length of None (data without token ids) goes with any, as cached
                values.setdefault(value, []).append(where)
        if len(values) > 1:
            found = "; ".join(
                f"{value} in {listed(wheres)}"
                for value, wheres in sorted(values.items(), key=lambda item: str(item[0]))
            )
            raise ValueError(
                f"{kind}s: expected one model.{name} over the {kind}s used, found {found}: a job trains in one "
                f"{name.replace('_', ' ')}; measure the {kind}s again in the job's (poplar-profile), or move the "
                "others out of the folder"
            )


def files_text(profiles: Any) -> str:
    """``; the files: `models_text```, appended to a message on mixed models that named them already; '' where
    no profile was loaded from a file."""
    return f"; the files: {models_text(profiles)}" if any(loaded_from(p) for p in profiles) else ""


def is_cluster_or_plan(data: Any) -> bool:
    """Whether parsed JSON is a cluster description, a plan, a network file or a DeepSpeed config (kept beside
    profiles, not one), or poplar-search's JSON of several plans."""
    if not isinstance(data, dict) or "device_type" in data:
        return False
    marked = any(key in data for key in ("nodes", "ranks", "pipelines")) or data.get("kind") == "network"
    return marked or kinds.recognised(data) in (kinds.DEEPSPEED_CONFIG, *kinds.SEARCH_OUTPUTS)


def not_a_directory(path: Path) -> str:
    """What a path that should be a directory is instead, for `FormatError`'s *found* (a folder inside
    a file, ``cluster.json/layers``, names the file)."""
    if path.exists():
        return "a file"
    blocking = next((parent for parent in path.parents if parent.exists()), None)
    return f"a path under the file {blocking}" if blocking is not None and blocking.is_file() else "no such directory"


def load_profiles(directory: str | os.PathLike[str]) -> list[Profile]:
    """Every ``*.json`` profile directly in `directory`, by file name; clusters, plans, network files and DeepSpeed
    configs beside them skipped. Two for the same `Profile.key` and model are an error (plans must not depend on
    file names)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FormatError(
            str(directory), "(directory)", "a directory of profile JSON files", not_a_directory(directory)
        )
    origin: dict[tuple[str, int, bool, bool, str], tuple[Path, Profile]] = {}
    for path in sorted(directory.glob("*.json")):
        data = read_json(path)
        if is_cluster_or_plan(data):
            continue
        profile = mark_loaded(profile_from_dict(data, source=str(path)), path)
        key = (*profile.key, profile.model.fingerprint)
        if key in origin:
            raise FormatError(
                str(path),
                "device_type",
                "one profile per (device type, ZeRO stage, activation checkpointing, optimizer offload, model)",
                f"a second profile for {key[0]!r} at stage {key[1]}{levers_text(key[2], key[3])} "
                f"(the first is {origin[key][0].name})",
            )
        origin[key] = path, profile
    if not origin:
        raise FormatError(str(directory), "(directory)", "at least one profile *.json file", "none")
    return [profile for _, profile in origin.values()]


def load_cluster(path: str | os.PathLike[str]) -> Cluster:
    """Load and validate a cluster description."""
    return cluster_from_dict(read_json(path), source=str(path))


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Load and validate a plan."""
    return plan_from_dict(read_json(path), source=str(path))


def save_profile(profile: Profile, path: str | os.PathLike[str]) -> None:
    write_json_atomic(profile_to_dict(profile), path)


def save_cluster(cluster: Cluster, path: str | os.PathLike[str]) -> None:
    write_json_atomic(cluster_to_dict(cluster), path)


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    write_json_atomic(plan_to_dict(plan), path)


def content_fingerprint(data: Any) -> str:
    """Stable short hash of JSON-able data (canonical key order)."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]
