"""Layers over a pipeline's stages: the balanced split (dynamic programming), a given split priced (docs/search.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .pipeline_cost import RECOMPUTE_SHARE, TRANSFERS_PER_BOUNDARY, LayerTable, LinkPrice, Links


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
    free_per_sample_bytes: np.ndarray
    """``[size, i, j]``: memory left beside layers i..j-1 per sample of a micro-batch (rounded down; negative
    where they do not fit)."""
    kept_bytes: np.ndarray
    """``[i, j]``: kept activations per sample of layers i..j-1."""
    input_bytes: np.ndarray
    """``[i]``: what a checkpointed stage from layer i keeps per sample of an in-flight micro-batch."""

    def checkpointed_fits(self, in_flight: int) -> np.ndarray:
        """``[size, i, j]``: whether layers i..j-1 checkpointed fit with `in_flight` micro-batches of each size."""
        needed = (in_flight - 1) * self.input_bytes.astype(float)[:, None] + self.kept_bytes
        return needed[None] <= self.free_per_sample_bytes

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
        return cls(
            compute_s=compute,
            most_kept=most,
            leaving_bytes=leaving,
            free_per_sample_bytes=np.floor_divide(free[None], sizes[:, None, None]),
            kept_bytes=kept,
            input_bytes=np.concatenate([table.input_bytes, [0]]),
        )


def stage_cost_s(
    shape: Shape,
    stage: int,
    costs: dict[str, _TypeCosts],
    sizes: np.ndarray,
    in_flight: int,
) -> np.ndarray:
    """``[size, i, j]``: stage `stage` holding layers i..j-1 (inf where j <= i or it does not fit memory, even
    checkpointed)."""
    own = costs[shape.device_types[stage]]
    b = sizes.astype(float)[:, None]
    extra = np.zeros((len(sizes), 1, 1))

    def both_ways_s(price: LinkPrice) -> np.ndarray:
        """``[size, l]``: one micro-batch's transfers over a boundary before layer l."""
        return TRANSFERS_PER_BOUNDARY * price.transfer_s(b * own.leaving_bytes)

    if stage > 0:
        extra = extra + both_ways_s(shape.transfer_prices[stage - 1])[:, :, None]
    if stage < shape.num_stages - 1:
        extra = extra + both_ways_s(shape.transfer_prices[stage])[:, None, :]
    fits = (in_flight * sizes.astype(float))[:, None, None] <= own.most_kept[None]
    if fits.all():
        return own.compute_s + extra
    if in_flight == 1:  # checkpointed, one micro-batch in flight keeps as much
        return np.where(fits, own.compute_s, np.inf) + extra
    recomputed = np.where(own.checkpointed_fits(in_flight), (1.0 + RECOMPUTE_SHARE) * own.compute_s, np.inf)
    return np.where(fits, own.compute_s, recomputed) + extra


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
        if not self.choices:
            return (0,)
        firsts, j = [], self.choices[0].shape[1] - 1
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
    """The min-max split (docs/search.md) at every size in `sizes`; `in_flight` per stage
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


# -- A given split
UNLIMITED = np.iinfo(np.int64).max // 4
"""No memory limit on the number of micro-batches."""


@dataclass(frozen=True, kw_only=True, eq=False)
class _SplitTerms:
    """A given split's stages at every size, each without and with activation checkpointing (``[stage, size]``)."""

    plain_s: np.ndarray
    """Compute and transfers per micro-batch."""
    checkpointed_s: np.ndarray
    """The same with the forward run again."""
    plain_limit: np.ndarray
    """Memory's limit on the micro-batch count (`UNLIMITED` where S - s in flight fit; 0 where none does)."""
    checkpointed_limit: np.ndarray
    """The same with only the inputs kept, and one micro-batch's activations while it is recomputed."""

    @classmethod
    def of(cls, shape: Shape, first_layers: Sequence[int], tables: dict[str, LayerTable], sizes: np.ndarray):
        stages = shape.num_stages
        bounds = [*first_layers, tables[shape.device_types[0]].num_layers]
        times = np.zeros((2, stages, len(sizes)))
        limits = np.zeros((2, stages, len(sizes)), dtype=np.int64)
        for s in range(stages):
            table = tables[shape.device_types[s]]
            i, j = bounds[s], bounds[s + 1]
            compute_s = table.time_prefix_s[sizes - 1, j] - table.time_prefix_s[sizes - 1, i]
            transfer_s = np.zeros(len(sizes))
            for boundary, layer in ((s - 1, i - 1), (s, j - 1)):
                if 0 <= boundary < stages - 1:
                    price = shape.transfer_prices[boundary]
                    transfer_s = transfer_s + TRANSFERS_PER_BOUNDARY * price.transfer_s(
                        sizes * float(table.output_bytes[layer])
                    )
            times[0, s] = compute_s + transfer_s
            times[1, s] = (1.0 + RECOMPUTE_SHARE) * compute_s + transfer_s
            free = table.free_bytes - int(table.static_prefix_bytes[j] - table.static_prefix_bytes[i])
            kept = int(table.activation_prefix_bytes[j] - table.activation_prefix_bytes[i])
            held = int(table.input_bytes[i])
            # Checkpointed: b x ((f - 1) x input + kept) = b x (f x input + kept - input).
            limits[0, s] = _count_limit(free, sizes, kept, 0, stages - s)
            limits[1, s] = _count_limit(free, sizes, held, kept - held, stages - s)
        return cls(plain_s=times[0], checkpointed_s=times[1], plain_limit=limits[0], checkpointed_limit=limits[1])


def _count_limit(free: int, sizes: np.ndarray, per_flight: int, once: int, most_in_flight: int) -> np.ndarray:
    """Per size b, the most micro-batches m whose ``b x (f x per_flight + once)`` fit `free` with
    ``f = min(m, most_in_flight)``: `UNLIMITED` where f = `most_in_flight` fits, 0 where f = 1 does not."""
    if free < 0:
        return np.zeros(len(sizes), dtype=np.int64)
    room = free // sizes.astype(np.int64) - once
    if per_flight == 0:
        flights = np.where(room >= 0, UNLIMITED, 0)
    else:
        flights = np.where(room >= 0, room // per_flight, 0)
    return np.where(flights >= most_in_flight, UNLIMITED, np.maximum(flights, 0)).astype(np.int64)


def split_costs(
    shape: Shape,
    first_layers: Sequence[int],
    tables: dict[str, LayerTable],
    sizes: np.ndarray,
    checkpointing: Sequence[bool] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """For a given split: per size, the slowest stage's time and memory's limit on the micro-batch count (stage s
    keeps ``min(m, S - s)``; 0: none fits), the stages `checkpointing` names priced checkpointed."""
    terms = _SplitTerms.of(shape, first_layers, tables, sizes)
    on = np.zeros(shape.num_stages, dtype=bool) if checkpointing is None else np.asarray(checkpointing, dtype=bool)
    slowest = np.max(np.where(on[:, None], terms.checkpointed_s, terms.plain_s), axis=0)
    limit = np.min(np.where(on[:, None], terms.checkpointed_limit, terms.plain_limit), axis=0)
    return slowest, limit


def split_options(
    shape: Shape, first_layers: Sequence[int], tables: dict[str, LayerTable], sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What a given split can run, each stage checkpointed only where the count needs it: entries
    ``(size, slowest stage's time, most micro-batches)``, one per limit of any stage (the choice changes only there)."""
    terms = _SplitTerms.of(shape, first_layers, tables, sizes)
    entries = []
    for cap in np.concatenate([terms.plain_limit, terms.checkpointed_limit]):
        plain = terms.plain_limit >= cap[None]
        usable = (cap >= 1) & np.all(plain | (terms.checkpointed_limit >= cap[None]), axis=0)
        slowest = np.max(np.where(plain, terms.plain_s, terms.checkpointed_s), axis=0)
        entries.append((sizes[usable], slowest[usable], cap[usable]))
    return tuple(np.concatenate(column) for column in zip(*entries))
