"""Which ranks form which pipeline in which order: every layout, or the heuristic's candidates (docs/search.md)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from poplar_ext.plan.formats import Cluster

from .allocation import divisors

Layout = tuple[tuple[int, ...], ...]

MIXED_SMALL_COUNTS = 8
"""Besides the divisors of the type counts, mixed layouts try 1..this many pipelines."""


def rank_nodes(cluster: Cluster) -> tuple[int, ...]:
    return tuple(index for index, node in enumerate(cluster.nodes) for g in node.devices for _ in range(g.count))


def _ordered_partitions(items: Sequence[int]) -> Iterator[list[list[int]]]:
    """Every way to put `items` into sequences (each item once, each sequence non-empty)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _ordered_partitions(rest):
        yield [[first], *partition]
        for index, sequence in enumerate(partition):
            for position in range(len(sequence) + 1):
                yield [
                    *partition[:index],
                    [*sequence[:position], first, *sequence[position:]],
                    *partition[index + 1 :],
                ]


def all_layouts(cluster: Cluster, max_stages: int) -> list[Layout]:
    """Every layout with at most `max_stages` stages per pipeline, once per class of interchangeable ranks."""
    labels = list(zip(cluster.rank_device_types, rank_nodes(cluster)))
    layouts: dict[tuple, Layout] = {}
    for partition in _ordered_partitions(list(range(cluster.world_size))):
        if max(len(p) for p in partition) <= max_stages:
            key = tuple(sorted(tuple(labels[r] for r in p) for p in partition))
            layouts.setdefault(key, tuple(tuple(p) for p in sorted(partition, key=lambda p: (-len(p), p))))
    return list(layouts.values())


def _homogeneous(ranks_of: dict[str, list[int]], max_stages: int) -> Iterator[Layout]:
    options = [[s for s in divisors(len(ranks)).tolist() if s <= max_stages] for ranks in ranks_of.values()]
    for stage_counts in itertools.product(*options):
        pipelines = []
        for ranks, stages in zip(ranks_of.values(), stage_counts):
            pipelines += [tuple(ranks[k : k + stages]) for k in range(0, len(ranks), stages)]
        yield tuple(pipelines)


def _mixed(ranks_of: dict[str, list[int]], max_stages: int) -> Iterator[Layout]:
    counts = {t: len(r) for t, r in ranks_of.items()}
    groups = set(range(1, MIXED_SMALL_COUNTS + 1))
    for count in counts.values():
        groups.update(divisors(count).tolist())
    for g in sorted(g for g in groups if g <= max(counts.values())):
        for spread in (False, True):
            shares = _shares(counts, g, spread)
            if shares is None or max(sum(s.values()) for s in shares) > max_stages:
                continue
            for order in itertools.permutations(counts):
                yield _assign(ranks_of, shares, order)


def _shares(counts: dict[str, int], g: int, spread: bool) -> list[dict[str, int]] | None:
    """Ranks of each type per pipeline: g alike ones, the rest one more pipeline or spread over the first."""
    per = {t: c // g for t, c in counts.items()}
    left = {t: c - g * per[t] for t, c in counts.items()}
    if spread:
        shares = [{t: per[t] + (q < left[t]) for t in counts} for q in range(g)]
    else:
        shares = [dict(per) for _ in range(g)] + ([left] if sum(left.values()) else [])
    if any(sum(s.values()) == 0 for s in shares) or (spread and not sum(left.values())):
        return None
    return shares


def _assign(ranks_of: dict[str, list[int]], shares: list[dict[str, int]], order: tuple[str, ...]) -> Layout:
    """Pipelines with these shares, each type's ranks taken in rank order, stages in blocks of `order`."""
    taken = dict.fromkeys(ranks_of, 0)
    pipelines = []
    for share in shares:
        ranks = []
        for t in order:
            ranks += ranks_of[t][taken[t] : taken[t] + share[t]]
            taken[t] += share[t]
        pipelines.append(tuple(ranks))
    return tuple(pipelines)


MIXED_SUBSETS_MAX_TYPES = 4
"""Up to this many device types, mixed pipelines are also made of every subset of the types (the others in
homogeneous pipelines beside them); beyond, of all types only."""


def _type_subsets(types: list[str]) -> list[tuple[str, ...]]:
    if len(types) > MIXED_SUBSETS_MAX_TYPES:
        return [tuple(types)]
    return [subset for size in range(2, len(types) + 1) for subset in itertools.combinations(types, size)]


def candidate_layouts(cluster: Cluster, max_stages: int) -> list[Layout]:
    """The heuristic's layouts (docs/search.md), each once."""
    ranks_of: dict[str, list[int]] = {}
    for rank, device_type in enumerate(cluster.rank_device_types):
        ranks_of.setdefault(device_type, []).append(rank)
    generated = list(_homogeneous(ranks_of, max_stages))
    for subset in _type_subsets(list(ranks_of)):
        rest = list(_homogeneous({t: r for t, r in ranks_of.items() if t not in subset}, max_stages))
        generated += [a + b for a in _mixed({t: ranks_of[t] for t in subset}, max_stages) for b in rest]
    layouts: dict[Layout, Layout] = {}
    for layout in generated:
        layouts.setdefault(tuple(sorted(layout)), layout)
    return list(layouts.values())
