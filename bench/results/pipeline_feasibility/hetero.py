"""The contained adaptation: pipelines that differ in layer split and number of stages.

DeepSpeed's classes are kept; three seams are used.

PlanGrid (a PipelineParallelGrid): DeepSpeed's grid for ONE pipeline of the plan, on global
    ranks, with data_parallel_size 1. PipelineParallelGrid.__init__ requires a rectangular
    num_stages x dp grid covering the world (topology.py:290-295, "Invalid Grid"), so only
    __init__ is replaced; every accessor is inherited and reads the topology, whose mapping
    sends (pipe=s, data=0) to the pipeline's s-th global rank, so stage_to_global and p2p
    (p2p.py:52, 73) address the right peer. Every rank creates every group in plan order:
    torch names a new group by a counter that every rank increments (distributed_c10d.py
    _process_group_name), so all ranks must make the same new_group calls.

PlanPipelineModule (a PipelineModule with explicit parts): PipelineModule.__init__ builds its
    grid inline (module.py:183) with no parameter to pass one; the module-global name is
    replaced for the duration of that call only.

SegmentReducePipelineEngine (a PipelineEngine): the data-parallel gradient reduction is
    DeepSpeedEngine.allreduce_gradients, called by name from PipelineEngine._exec_reduce_grads
    (engine.py:294) at the ReduceGrads instruction; it is overridden to first SUM every layer's
    gradient over the ranks that hold that layer, one per pipeline (SegmentReducer). With a
    micro-batch loss weighted by gas_p * b_p / B this is exactly the global-batch gradient.
    (_exec_reduce_grads itself is not overridable by name: _INSTRUCTION_MAP, engine.py:1360,
    holds PipelineEngine's function objects.) Also clip_fp32_gradients, whose DeepSpeed version
    takes the norm of stage 0 only (check_5_clipping).
"""

from __future__ import annotations

from unittest import mock

import torch
from common import BASE_SEED, ExplicitSplitModule, build_engine, ds_config, layer_specs, micro_batches, weighted_mse
from deepspeed import comm as dist
from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE
from deepspeed.runtime.pipe import module as ds_pipe_module
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.topology import PipelineParallelGrid, ProcessTopology


class PlanGrid(PipelineParallelGrid):
    """`pipelines`: each pipeline's global ranks in stage order (the same list on every rank)."""

    def __init__(self, pipelines):
        self.global_rank, self.world_size = dist.get_rank(), dist.get_world_size()
        mine = next(ranks for ranks in pipelines if self.global_rank in ranks)
        topo = ProcessTopology(axes=["pipe", "data"], dims=[len(mine), 1])
        topo.mapping = {topo.ProcessCoord(pipe=s, data=0): r for s, r in enumerate(mine)}
        self._topo = topo
        self.data_parallel_size, self.pipe_parallel_size = 1, len(mine)
        self.model_parallel_size = self.slice_parallel_size = 1
        self.stage_id, self.data_parallel_id = self.get_stage_id(), 0
        self.is_first_stage, self.is_last_stage = self.stage_id == 0, self.stage_id == len(mine) - 1
        for ranks in pipelines:
            group = dist.new_group(ranks=ranks)
            if ranks is mine:
                self.pp_group, self.pp_proc_group = list(ranks), group
        for r in range(self.world_size):
            group = dist.new_group(ranks=[r])
            if r == self.global_rank:
                alone = group
        self.pipe_groups = [list(mine)]
        self.ds_model_proc_group, self.ds_model_world_size = self.pp_proc_group, len(mine)
        self.ds_model_rank = self.stage_id
        self.dp_group, self.dp_groups, self.dp_proc_group = [self.global_rank], [[r] for r in mine], alone
        self.slice_group, self.slice_proc_group = [self.global_rank], alone
        self.p2p_groups = [[r, mine[(i + 1) % len(mine)]] for i, r in enumerate(mine)]


class PlanPipelineModule(ExplicitSplitModule):
    """A PipelineModule on a given grid (e.g. a PlanGrid) with explicit stage boundaries."""

    def __init__(self, layers, parts, grid, **kwargs):
        with mock.patch.object(ds_pipe_module, "PipelineParallelGrid", lambda **_: grid):
            super().__init__(layers, parts, topology=grid.topology(), **kwargs)


def owner(ranks, parts, layer):
    """The rank of a pipeline (ranks in stage order, boundaries `parts`) that holds `layer`."""
    return ranks[max(s for s in range(len(ranks)) if parts[s] <= layer)]


class SegmentReducer:
    """Sums each layer's gradient over the pipelines: one process group per distinct set of
    owner ranks (one rank per pipeline), created in layer order on every rank."""

    def __init__(self, pipelines, parts_per_pipeline):
        self.rank = dist.get_rank()
        layers_by_owners = {}
        for layer in range(parts_per_pipeline[0][-1]):
            owners = tuple(sorted(owner(r, p, layer) for r, p in zip(pipelines, parts_per_pipeline)))
            layers_by_owners.setdefault(owners, []).append(layer)
        self.segments = []  # (owner ranks, group, layers), same order on every rank
        for owners, layers in layers_by_owners.items():
            group = dist.new_group(ranks=list(owners)) if len(owners) > 1 else None
            self.segments.append((owners, group, layers))

    def all_reduce(self, module):
        by_layer = {}
        for name, param in module.named_parameters():
            by_layer.setdefault(int(name.split(".")[0]), []).append(param)
        for owners, group, layers in self.segments:
            if group is None or self.rank not in owners:
                continue
            params = [p for layer in layers for p in by_layer[layer]]
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=group)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()


class SegmentReducePipelineEngine(PipelineEngine):
    """A PipelineEngine whose boundary reduction first sums each layer over its holders (a
    SegmentReducer), then runs DeepSpeed's own over the 1-rank dp group: a no-op at ZeRO-0; at
    ZeRO-1 the hand-over of the gradients to the (unsharded) ZeRO optimizer."""

    segment_reducer: SegmentReducer | None = None

    def allreduce_gradients(self, bucket_size=MEMORY_OPT_ALLREDUCE_SIZE):
        if self.is_gradient_accumulation_boundary():
            self.segment_reducer.all_reduce(self.module)
        super().allreduce_gradients(bucket_size)

    def clip_fp32_gradients(self):
        """ZeRO-0 clipping over the norm of the whole model. DeepSpeed's clip_grad_norm_ counts
        only the gradients of model-parallel rank 0 (runtime/utils.py:392-396), which in a pipe
        grid is stage 0; here every stage's gradients count (every pipeline holds the same summed
        gradient, so every pipeline finds the same norm)."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        total = torch.stack([g.float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
        dist.all_reduce(total, group=self.grid.get_pipe_parallel_group())
        coef = min(1.0, self.gradient_clipping() / (total.sqrt().item() + 1e-6))
        for g in grads:
            g.mul_(coef)


def build_plan_engine(plan, *, zero_stage=0, optimizer="sgd", base_seed=BASE_SEED, config_extra=None):
    """This rank's engine for `plan`, a list of (global ranks in stage order, parts, micro-batch size,
    micro-batch count) per pipeline; each micro-batch loss weighted by gas * micro / B.
    Returns the engine and data(step), the rank's pipeline's micro-batches of that step."""
    rank = dist.get_rank()
    index = next(i for i, (ranks, *_) in enumerate(plan) if rank in ranks)
    _, parts, micro, gas = plan[index]
    global_size = sum(m * g for _, _, m, g in plan)
    start = sum(m * g for _, _, m, g in plan[:index])
    module = PlanPipelineModule(
        layer_specs(),
        parts,
        PlanGrid([r for r, *_ in plan]),
        loss_fn=weighted_mse(gas * micro / global_size),
        seed_layers=True,
        base_seed=base_seed,
    )
    reducer = SegmentReducer([r for r, *_ in plan], [p for _, p, *_ in plan])
    config = {**ds_config(micro, gas, dp=1, zero_stage=zero_stage), **(config_extra or {})}
    engine = build_engine(module, config, SegmentReducePipelineEngine, optimizer=optimizer)
    engine.segment_reducer = reducer
    return engine, lambda step: iter(micro_batches(step, global_size, start, micro, gas))
