"""Where a pipeline plan puts every rank, as DeepSpeed's grid; and the layers the pipelines share.
See docs/pipeline.md."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from deepspeed.runtime.pipe.topology import PipelineParallelGrid, ProcessTopology

from poplar_ext.collectives import broadcast_in_group, new_groups, sum_in_group
from poplar_ext.plan.pipeline_formats import PipelinePlan


class PlanGrid(PipelineParallelGrid):
    """DeepSpeed's grid for the pipeline of `plan` that holds `rank` (collective: every rank builds its own)."""

    def __init__(self, plan: PipelinePlan, *, rank: int) -> None:
        # PipelineParallelGrid.__init__ is not called: it builds DeepSpeed's rectangle.
        self.global_rank, self.world_size = rank, plan.world_size
        pipeline_index, self.stage_id = plan.place_of(rank)
        mine = list(plan.pipelines[pipeline_index].ranks)
        topology = ProcessTopology(axes=["pipe", "data"], dims=[len(mine), 1])
        topology.mapping = {topology.ProcessCoord(pipe=s, data=0): r for s, r in enumerate(mine)}
        self._topo = topology
        self.data_parallel_size, self.pipe_parallel_size = 1, len(mine)
        self.model_parallel_size = self.slice_parallel_size = 1
        self.data_parallel_id = 0
        self.is_first_stage, self.is_last_stage = self.stage_id == 0, self.stage_id == len(mine) - 1
        pipelines = [list(p.ranks) for p in plan.pipelines]
        alone = [[r] for r in range(plan.world_size)]
        groups = new_groups(pipelines + alone)
        self.pp_group, self.pp_proc_group = mine, groups[pipeline_index]
        alone_group = groups[len(pipelines) + rank]
        self.pipe_groups = [mine]
        # DeepSpeed's "model-parallel" group is the pipeline (as in its own grid without tensor slicing).
        self.ds_model_proc_group, self.ds_model_world_size = self.pp_proc_group, len(mine)
        self.ds_model_rank = self.stage_id
        # DeepSpeed's data-parallel group is this rank alone: the sum across pipelines is LayerSegments'.
        self.dp_group, self.dp_groups, self.dp_proc_group = [rank], [[r] for r in mine], alone_group
        self.slice_group, self.slice_proc_group = [rank], alone_group
        self.p2p_groups = [[r, mine[(i + 1) % len(mine)]] for i, r in enumerate(mine)]


def _holder(plan: PipelinePlan, pipeline_index: int, layer: int) -> int:
    """The rank of pipeline `pipeline_index` whose stage holds `layer`."""
    return next(s.rank for s in plan.pipelines[pipeline_index].stages if s.first_layer <= layer <= s.last_layer)


TIED_PREFIX = "tied_modules."
"""Where DeepSpeed's PipelineModule keeps the modules of TiedLayerSpecs (``tied_modules.<key>``)."""


def _parameters_by_layer(module: torch.nn.Module) -> dict[int, list[torch.nn.Parameter]]:
    """A PipelineModule's parameters by global layer index (DeepSpeed names them ``<layer index>.<name>``),
    tied modules' left out (they belong to a key, not to a layer)."""
    by_layer: dict[int, list[torch.nn.Parameter]] = {}
    for name, parameter in module.named_parameters():
        if not name.startswith(TIED_PREFIX):
            by_layer.setdefault(int(name.split(".", 1)[0]), []).append(parameter)
    return by_layer


def tied_holders(plan: PipelinePlan, layers: list[int]) -> list[int]:
    """Every rank whose stage runs any of `layers` (a tied module's), pipeline 0's first."""
    return list(dict.fromkeys(_holder(plan, p, layer) for p in range(len(plan.pipelines)) for layer in layers))


class LayerSegments:
    """Runs of layers held by the same ranks (one per pipeline), and tied modules (`tied`: key -> the
    layers using it), each with its process group (collective)."""

    def __init__(self, plan: PipelinePlan, *, rank: int, tied: dict[str, list[int]] | None = None) -> None:
        self.rank = rank
        layers_by_holders: dict[tuple[int, ...], list[int]] = {}
        for layer in range(plan.num_layers):
            holders = tuple(_holder(plan, p, layer) for p in range(len(plan.pipelines)))
            layers_by_holders.setdefault(holders, []).append(layer)
        self.segments = [(list(holders), layers) for holders, layers in layers_by_holders.items()]
        """``(holders, layers)``: the ranks holding these layers, pipeline 0's first; the same list on every rank."""
        # One pipeline: every segment is one rank, and nothing is shared.
        self.ties = [(key, tied_holders(plan, layers)) for key, layers in sorted((tied or {}).items())]
        """``(key, holders)``: the ranks holding each tied module, pipeline 0's first; the same on every rank."""
        every = [holders for holders, _ in self.segments] + [holders for _, holders in self.ties]
        shared = [holders for holders in every if len(holders) > 1]
        groups = iter(new_groups(shared))
        self._groups = [next(groups) if len(holders) > 1 else None for holders, _ in self.segments]
        self._tie_groups = [next(groups) if len(holders) > 1 else None for _, holders in self.ties]

    def _mine(
        self, module: torch.nn.Module, *, ties_only: bool = False
    ) -> Iterator[tuple[list[int], Any, list[torch.nn.Parameter]]]:
        by_layer = _parameters_by_layer(module)
        for (holders, layers), group in zip([] if ties_only else self.segments, self._groups):
            if group is not None and self.rank in holders:
                yield holders, group, [p for layer in layers for p in by_layer.get(layer, [])]
        for (key, holders), group in zip(self.ties, self._tie_groups):
            if group is not None and self.rank in holders:
                yield holders, group, list(module.tied_modules[key].parameters())

    def broadcast_parameters(self, module: torch.nn.Module, *, ties_only: bool = False) -> None:
        """Every copy of a layer set to pipeline 0's (as DeepSpeed's engine broadcasts its replicas' weights);
        `ties_only`: of the tied modules only (after a checkpoint is loaded: DeepSpeed saves a tied module
        in the file of a layer that uses it without a ``forward_fn``, the first of the key here)."""
        with torch.no_grad():
            for holders, group, parameters in self._mine(module, ties_only=ties_only):
                for parameter in parameters:
                    broadcast_in_group(parameter.data, src=holders[0], group=group)

    def sum_gradients(
        self, module: torch.nn.Module, *, gradient_of: Callable[[torch.nn.Parameter], torch.Tensor] | None = None
    ) -> None:
        """Each layer's gradient summed over the pipelines holding it (one flat tensor per segment), in place in the
        tensor `gradient_of(parameter)` (DeepSpeed's bf16 optimizer keeps it apart from ``.grad``; ZeRO's
        ``grad_accum`` only where its dtype differs); default `grad_or_zeros`."""
        gradient_of = gradient_of or grad_or_zeros
        for _, group, parameters in self._mine(module):
            _sum_flat([gradient_of(p) for p in parameters if p.requires_grad], group)


def grad_or_zeros(parameter: torch.nn.Parameter) -> torch.Tensor:
    """``.grad``, zeros where none: a layer unused by this pipeline's forward still takes part in the sum."""
    if parameter.grad is None:
        parameter.grad = torch.zeros_like(parameter)
    return parameter.grad


def _sum_flat(gradients: list[torch.Tensor], group: Any) -> None:
    if gradients:
        flat = torch.cat([g.reshape(-1) for g in gradients])
        sum_in_group(flat, group)
        for g, summed in zip(gradients, flat.split([g.numel() for g in gradients])):
            g.copy_(summed.view_as(g))


__all__ = ["LayerSegments", "PlanGrid"]
