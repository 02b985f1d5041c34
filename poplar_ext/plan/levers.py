"""The memory levers (activation checkpointing, optimizer offload) chosen per device type. See profiles/README.md
("How the search reads a profile")."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from .formats import Levers, Plan, Profile

NO_LEVERS: Levers = (False, False)

LEVERS_ORDER: tuple[Levers, ...] = ((False, False), (True, False), (False, True), (True, True))
"""Fewest levers first; ``uniform`` and ``proportional`` take a type's first profiled one,
and among equally fast settings the search keeps the first (`lever_choices`' order)."""

LEVER_NAMES = ("activation_checkpointing", "optimizer_offload")
"""The plan's and the profile's field for each position of `Levers`."""

Variants = dict[Levers, Profile]
"""One device type's profiles at one stage, by `Profile.levers`."""


def lever_count(levers: Levers) -> int:
    """How many of the two levers `levers` uses (0, 1 or 2)."""
    return int(levers[0]) + int(levers[1])


def levers_summary(setting: dict[str, Levers]) -> str:
    """``activation checkpointing on A, B, optimizer offload on C`` for the types that use them ('' when none does)."""
    parts = []
    for index, name in enumerate(("activation checkpointing", "optimizer offload")):
        on = [t for t, levers in setting.items() if levers[index]]
        if on:
            parts.append(f"{name} on {', '.join(on)}")
    return ", ".join(parts)


def fits(variants: Variants, levers: Levers) -> bool:
    """Whether the type has a profile with `levers` in which the model fits (a micro-batch of at least one)."""
    variant = variants.get(levers)
    return variant is not None and variant.max_micro_batch_size > 0


def first_profiled(variants: Variants) -> Levers:
    """The type's first profiled setting in `LEVERS_ORDER` (what ``uniform`` and ``proportional`` run)."""
    return next(levers for levers in LEVERS_ORDER if levers in variants)


def lever_options(variants_by_type: dict[str, Variants]) -> list[list[Levers]]:
    """Per type, the settings a free choice tries: those that fit, in `LEVERS_ORDER` (the first profiled when
    none fits)."""
    return [
        [levers for levers in LEVERS_ORDER if fits(variants, levers)] or [first_profiled(variants)]
        for variants in variants_by_type.values()
    ]


def lever_choices(variants_by_type: dict[str, Variants], zero_stage: int, *, choose: bool) -> list[dict[str, Levers]]:
    """The per-type memory levers a search at `zero_stage` tries, fewest levers first.

    With `choose` (the ``poplar`` policy) every combination of the variants each type has that fit the model
    (`lever_options`), sorted by the number of levers used, stably, so that among equally fast settings the first has
    the fewest. At stage 3 activation checkpointing is all-or-none and no profile offloads: at most two settings.
    Without `choose` (``uniform``, ``proportional``: what DeepSpeed or Whale would run) one setting per type: its first
    profiled variant in `LEVERS_ORDER` (no lever where profiled so; at stage 3 the first checkpointing setting every
    type has). Empty at stage 3 when no single checkpointing setting has a profile for every type.

    At stages 0-2 with `choose` this is the whole product (``4 ** types`` settings when every type has all four):
    `search.lever_search` finds the same outcome without listing it (search_plan never lists it), and this list
    stays its definition and its tests' oracle.
    """
    types = list(variants_by_type)
    if zero_stage == 3:
        common = [on for on in (False, True) if all((on, False) in variants_by_type[t] for t in types)]
        fitting = [on for on in common if all(fits(variants_by_type[t], (on, False)) for t in types)] if choose else []
        return [dict.fromkeys(types, (on, False)) for on in (fitting or common[:1])]
    if not choose:
        return [{t: first_profiled(variants_by_type[t]) for t in types}]
    options = lever_options(variants_by_type)
    combos = [dict(zip(types, combo)) for combo in itertools.product(*options)]
    return sorted(combos, key=lambda combo: sum(lever_count(levers) for levers in combo.values()))


def plan_levers(plan: Plan) -> dict[str, Levers | None]:
    """``(activation_checkpointing, optimizer_offload)`` per device type of `plan` (None for a type whose
    ranks differ)."""
    settings: dict[str, Levers | None] = {}
    for r in plan.ranks:
        if settings.setdefault(r.device_type, r.levers) != r.levers:
            settings[r.device_type] = None
    return settings


def mixed_lever_types(plan: Plan, index: int) -> list[str]:
    """Device types whose ranks differ in lever `index` of `Levers`."""
    values: dict[str, set[bool]] = {}
    for r in plan.ranks:
        values.setdefault(r.device_type, set()).add(r.levers[index])
    return [t for t, seen in values.items() if len(seen) > 1]


def profiles_for_plan(plan: Plan, profiles: Sequence[Profile]) -> list[Profile]:
    """The `profiles` at the plan's stage with the memory levers the plan gives their device type (none for others)."""
    settings = plan_levers(plan)
    return [
        p
        for p in profiles
        if p.zero_stage == plan.zero_stage and p.levers == (settings.get(p.device_type) or NO_LEVERS)
    ]
