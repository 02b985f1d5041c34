"""Layers split over a pipeline's stages: the balanced split by dynamic programming, and a given split priced.

A pipeline's shape is the device type of each stage in order and, for each boundary
between stages, the price of the link between both ranks (within a node, or between
their nodes: `pipeline_cost.Links`), so that a heavy boundary lands on a fast link. For a
micro-batch size b and a memory regime (how many micro-batches each stage keeps in
flight), `balanced_split` finds the split of the layers into contiguous stages that
minimises the slowest stage's time (`search.pipeline_cost`: compute plus transfers)
among the splits that fit every stage's memory, exactly, by dynamic programming::

    best[s][j] = min over i < j of max(best[s - 1][i], cost_s(i, j))

where ``cost_s(i, j)`` is stage s holding layers i..j-1 (infinite when they do not fit
its device). The pipeline's time ``(m + S - 1) x`` its slowest stage only depends on the
split through that maximum, so for a given shape, size and regime this split is optimal.
All sizes are solved at once (numpy over ``(sizes, i, j)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .pipeline_cost import TRANSFERS_PER_BOUNDARY, LayerTable, LinkPrice, Links


@dataclass(frozen=True)
class Shape:
    """A pipeline's stages as the split sees them."""

    device_types: tuple[str, ...]
    """Each stage's device type, in stage order."""
    transfer_prices: tuple[LinkPrice, ...]
    """For each boundary between stages s and s + 1, one transfer's price over the link between their ranks."""

    @property
    def num_stages(self) -> int:
        return len(self.device_types)


def shape_of(ranks: Sequence[int], rank_device_types: Sequence[str], links: Links) -> Shape:
    return Shape(
        device_types=tuple(map(rank_device_types.__getitem__, ranks)), transfer_prices=links.transfer_prices(ranks)
    )


@dataclass(frozen=True, kw_only=True, eq=False)
class _TypeCosts:
    """One device type's stage costs at every size and layer range, before transfers and memory regime."""

    compute_s: np.ndarray
    """``[size, i, j]``: layers i..j-1 (inf where j <= i)."""
    most_kept: np.ndarray
    """``[i, j]``: the most micro-batch samples (in-flight count x size) whose activations fit beside layers i..j-1."""
    leaving_bytes: np.ndarray
    """``[l]``: what a boundary before layer l carries per sample (0 before layer 0)."""

    @classmethod
    def of(cls, table: LayerTable, sizes: np.ndarray) -> _TypeCosts:
        prefix = table.time_prefix_s[sizes - 1]
        order = np.arange(table.num_layers + 1)
        empty = order[None, :] <= order[:, None]
        compute = np.where(empty[None], np.inf, prefix[:, None, :] - prefix[:, :, None])
        free = table.free_bytes - (table.static_prefix_bytes[None, :] - table.static_prefix_bytes[:, None])
        kept = table.activation_prefix_bytes[None, :] - table.activation_prefix_bytes[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            most = np.where(kept > 0, np.floor_divide(free, np.maximum(kept, 1)).astype(float), np.inf)
        most = np.where(free < 0, -1.0, most)
        leaving = np.concatenate([[0.0], table.output_bytes.astype(float)])
        return cls(compute_s=compute, most_kept=most, leaving_bytes=leaving)


def stage_cost_s(
    shape: Shape,
    stage: int,
    costs: dict[str, _TypeCosts],
    sizes: np.ndarray,
    in_flight: int,
) -> np.ndarray:
    """``[size, i, j]``: stage `stage` holding layers i..j-1 (inf where j <= i or it does not fit memory)."""
    own = costs[shape.device_types[stage]]
    b = sizes.astype(float)[:, None]
    extra = np.zeros((len(sizes), 1, 1))

    def both_ways_s(price: LinkPrice) -> np.ndarray:
        """``[size, l]``: one micro-batch's transfers over a boundary before layer l."""
        return TRANSFERS_PER_BOUNDARY * (price.latency_s + b * own.leaving_bytes * price.seconds_per_byte)

    if stage > 0:
        extra = extra + both_ways_s(shape.transfer_prices[stage - 1])[:, :, None]
    if stage < shape.num_stages - 1:
        extra = extra + both_ways_s(shape.transfer_prices[stage])[:, None, :]
    too_big = (in_flight * sizes.astype(float))[:, None, None] > own.most_kept[None]
    return np.where(too_big, np.inf, own.compute_s + extra)


@dataclass(frozen=True, kw_only=True, eq=False)
class BalancedSplits:
    """The balanced split of one shape at every size: its slowest stage and its stage boundaries."""

    sizes: np.ndarray
    slowest_stage_s: np.ndarray
    """Per size; inf where no split fits memory."""
    choices: list[np.ndarray]
    """``choices[s - 1][size, j]``: where stage s starts when stages s.. end at layer j - 1."""

    def first_layers(self, size_index: int) -> tuple[int, ...]:
        """Each stage's first layer at ``sizes[size_index]``."""
        num_layers = self.choices[0].shape[1] - 1 if self.choices else None
        if num_layers is None:
            return (0,)
        firsts = []
        j = num_layers
        for choice in reversed(self.choices):
            j = int(choice[size_index, j])
            firsts.append(j)
        return (0, *reversed(firsts))


def balanced_split(
    shape: Shape,
    tables: dict[str, LayerTable],
    sizes: np.ndarray,
    in_flight: Sequence[int] | None = None,
    *,
    cache: dict[str, _TypeCosts] | None = None,
) -> BalancedSplits:
    """The min-max split (module docstring) at every size in `sizes`; `in_flight` per stage
    defaults to 1F1B with at least S micro-batches (stage s keeps S - s). `cache` keeps each
    type's costs between calls with the same tables and sizes."""
    stages = shape.num_stages
    flights = list(in_flight) if in_flight is not None else [stages - s for s in range(stages)]
    costs = cache if cache is not None else {}
    for device_type in set(shape.device_types) - set(costs):
        costs[device_type] = _TypeCosts.of(tables[device_type], sizes)
    best = stage_cost_s(shape, 0, costs, sizes, flights[0])[:, 0, :]
    choices = []
    for s in range(1, stages):
        candidates = np.maximum(best[:, :, None], stage_cost_s(shape, s, costs, sizes, flights[s]))
        choice = np.argmin(candidates, axis=1)
        best = np.take_along_axis(candidates, choice[:, None, :], axis=1)[:, 0, :]
        choices.append(choice)
    return BalancedSplits(sizes=sizes, slowest_stage_s=best[:, -1], choices=choices)


# ----------------------------------------------------------------------------------
# A given split
# ----------------------------------------------------------------------------------
UNLIMITED = np.iinfo(np.int64).max // 4
"""No memory limit on the number of micro-batches."""


def split_costs(
    shape: Shape,
    first_layers: Sequence[int],
    tables: dict[str, LayerTable],
    sizes: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """For a given split: per size, the slowest stage's time and memory's limit on the micro-batch count.

    The limit: stage s keeps ``min(m, S - s)`` micro-batches, so a size at which stage s
    holds only k < S - s of them allows m <= k; 0 where not even one fits.
    """
    stages = shape.num_stages
    bounds = [*first_layers, tables[shape.device_types[0]].num_layers]
    slowest = np.zeros(len(sizes))
    limit = np.full(len(sizes), UNLIMITED, dtype=np.int64)
    for s in range(stages):
        table = tables[shape.device_types[s]]
        i, j = bounds[s], bounds[s + 1]
        time_s = table.time_prefix_s[sizes - 1, j] - table.time_prefix_s[sizes - 1, i]
        for boundary, layer in ((s - 1, i - 1), (s, j - 1)):
            if 0 <= boundary < stages - 1:
                price = shape.transfer_prices[boundary]
                time_s = time_s + TRANSFERS_PER_BOUNDARY * (
                    price.latency_s + sizes * float(table.output_bytes[layer]) * price.seconds_per_byte
                )
        slowest = np.maximum(slowest, time_s)
        free = table.free_bytes - int(table.static_prefix_bytes[j] - table.static_prefix_bytes[i])
        kept = int(table.activation_prefix_bytes[j] - table.activation_prefix_bytes[i])
        if free < 0:
            fits = np.full(len(sizes), -1, dtype=np.int64)
        elif kept == 0:
            continue
        else:
            fits = free // (sizes.astype(np.int64) * kept)
        limit = np.where(fits < stages - s, np.minimum(limit, fits), limit)
    return slowest, np.maximum(limit, 0)
