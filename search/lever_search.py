"""The best memory levers per device type, found exactly without trying all 4^k settings.

At ZeRO stages 0-2 the ``poplar`` policy may give each device type any of its profiled
settings of the memory levers (`search.levers`): up to ``4 ** types`` settings. The
answer is defined by the enumeration (`evaluate_settings` over `lever_choices`): the
policy (exact for one setting) on every setting, fewest levers first, then in order of
type and `LEVERS_ORDER`; a later setting replaces the best only when strictly better.
`search_levers` returns that same outcome while running the policy on a handful:

* Each (type, setting) is priced once (`search.cost.device_cost`); a setting's cost
  model is assembled from those.
* The boundary is the largest optimizer step among the chosen settings. Fixing that
  largest step at some value B, every type may take any of its settings whose step is
  at most B, and each type's best micro-step time at each micro-batch is the lower
  envelope of those settings' tables (non-decreasing, as each table is). At a fixed
  micro-step (or busy) time the types are separable: a type's most samples is the
  envelope's. That gives, per B, the exact optimum at stages 2 (one accumulation
  count: feasibility is capacity) and bounds at stages 0-1 (exact sums), and a
  setting that reaches it (every type at its most samples): seeds.
* A branch and bound in the enumeration's order finishes the job. A setting can match
  or beat the incumbent only if, for its own largest step, its capacity (the sum over
  types of what each can run) reaches a requirement at some time (`_Requirements`).
  Per requirement, the most capacity a subtree's settings can have with a given number
  of levers is a small knapsack over types (`_Tables`); with an automatic batch and no
  maximum, each setting's batch is also capped by its own default maximum (a sum over
  types too: a second knapsack). Subtrees that meet no requirement are skipped, every
  other setting is evaluated by the policy itself.

Why it returns the enumeration's outcome: the requirements are necessary conditions
(a skipped setting cannot beat the incumbent, nor tie it from an earlier place in the
order), and every setting not skipped is evaluated in the enumeration's order with the
enumeration's rule; the seeds only make the incumbent good early. Both cost models of
a setting are the same floats as the enumeration's (same pricing, same assembly), and
the requirements use the cost model's float expressions, so ties are ties.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .allocation import PolicyResult, divisors
from .cost import DeviceCost, StageCommunication, StageModel, assemble_stage_model, build_stage_model, device_cost
from .formats import MAX_GLOBAL_BATCH_SIZE, Cluster
from .levers import Levers, Variants, fits, lever_count, lever_options
from .network import NetworkProfile
from .policies import AUTO_ACCUMULATION_STEPS, allocate, best_global_batch
from .poplar_independent import (
    MAX_BREAKPOINTS,
    FlatTables,
    capacity_levels,
    first_steps_from,
    level_count,
    steps_within,
)

Combo = tuple[int, ...]
"""A setting: per device type, the index of its option in `lever_options`."""

_NONE = -np.inf
"""No capacity: a type's option is not allowed under a requirement, or runs no sample in time."""


@dataclass(frozen=True, kw_only=True)
class StageOutcome:
    """The policy's best allocation at one stage, with the memory levers each device type uses."""

    model: StageModel | None
    """The cost model of the allocation's setting (None when no setting fits the model)."""
    outcome: PolicyResult
    """The allocation, or why there is none."""
    levers: dict[str, Levers]
    """The memory levers per device type of the allocation."""


def better(candidate: PolicyResult, best: PolicyResult | None, *, fixed_batch: bool) -> bool:
    """Strictly better (fixed batch: shorter iteration; automatic batch: more samples/s): ties keep the earlier."""
    if best is None or not best.ok:
        return candidate.ok or best is None
    if not candidate.ok:
        return False
    a, b = candidate.allocation, best.allocation
    return a.iteration_time_s < b.iteration_time_s if fixed_batch else a.samples_per_s > b.samples_per_s


def run_policy(
    policy: str, model: StageModel, global_batch_size: int | None, max_global_batch_size: int | None
) -> PolicyResult:
    """`allocate` for a fixed global batch, `best_global_batch` for an automatic one."""
    if global_batch_size is not None:
        return allocate(policy, model, global_batch_size)
    return best_global_batch(policy, model, max_global_batch_size)


def evaluate_settings(
    settings: Sequence[dict[str, Levers]],
    variants: dict[str, Variants],
    cluster: Cluster,
    zero_stage: int,
    policy: str,
    global_batch_size: int | None,
    max_global_batch_size: int | None,
    network: NetworkProfile | None = None,
) -> StageOutcome:
    """The policy on every setting of `settings`, in order: the first strictly best wins (the enumeration).

    A setting in which the model fits no micro-batch of some type is reported only when
    it comes first. Each setting is one cost model and the policies are exact per model,
    so over all of `lever_choices` this is the exact optimum of the joint choice.
    """
    best: StageOutcome | None = None
    for setting in settings:
        chosen = {t: variants[t][levers] for t, levers in setting.items()}
        too_big = [t for t, profile in chosen.items() if profile.max_micro_batch_size == 0]
        if too_big:
            if best is None:
                reason = f"The model does not fit {', '.join(too_big)} at stage {zero_stage} (max_micro_batch_size 0)."
                best = StageOutcome(model=None, outcome=PolicyResult(allocation=None, reason=reason), levers=setting)
            continue
        model = build_stage_model(chosen, cluster.rank_device_types, zero_stage, network)
        outcome = run_policy(policy, model, global_batch_size, max_global_batch_size)
        if better(outcome, None if best is None else best.outcome, fixed_batch=global_batch_size is not None):
            best = StageOutcome(model=model, outcome=outcome, levers=setting)
    assert best is not None, "at least one setting"
    return best


def search_levers(
    variants: dict[str, Variants],
    cluster: Cluster,
    zero_stage: int,
    *,
    global_batch_size: int | None,
    max_global_batch_size: int | None,
    network: NetworkProfile | None = None,
) -> StageOutcome:
    """``poplar``'s best allocation at `zero_stage` (0-2) over every per-type setting of the memory levers.

    The same outcome as `evaluate_settings` over ``lever_choices(variants, zero_stage,
    choose=True)`` (see the module docstring), without a limit on the number of
    settings. `variants` has every device type of `cluster`, in its order.
    """
    assert zero_stage in (0, 1, 2), "stage 3 allows two settings: all checkpointed or none"
    options = lever_options(variants)
    if not all(fits(v, o[0]) for v, o in zip(variants.values(), options)):
        first = {t: o[0] for t, o in zip(variants, options)}
        return evaluate_settings(
            [first], variants, cluster, zero_stage, "poplar", global_batch_size, max_global_batch_size, network
        )
    return _LeverSearch(variants, options, cluster, zero_stage, global_batch_size, max_global_batch_size, network).run()


# ----------------------------------------------------------------------------------
# Requirements and their knapsack over types
# ----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, eq=False)
class _Requirements:
    """Each row r: settings whose every optimizer step is at most ``betas[beta[r]]`` and whose
    capacity at ``time_s[r]`` is at least ``need[r]`` samples. A setting that can still win meets a row."""

    beta: np.ndarray
    """Index into `_LeverSearch.betas`."""
    time_s: np.ndarray
    """Micro-step time (stage 2: capacity is the sum of the largest micro-batches within it) or busy
    time (stages 0-1: the sum of the most samples each rank can run within it); inf: any."""
    need: np.ndarray
    """Samples."""
    batch_need: np.ndarray | None = None
    """Automatic batch without a maximum: the least global batch of a setting meeting the row, which its own
    default maximum (`search.policies`) must reach; None: no such condition."""

    @staticmethod
    def none() -> _Requirements:
        empty = np.zeros(0)
        return _Requirements(beta=np.zeros(0, dtype=np.int64), time_s=empty, need=empty)

    def batch_needs(self) -> np.ndarray:
        return np.zeros(len(self.need)) if self.batch_need is None else self.batch_need

    @staticmethod
    def concat(parts: list[_Requirements]) -> _Requirements:
        if not parts:
            return _Requirements.none()
        return _Requirements(
            beta=np.concatenate([p.beta for p in parts]),
            time_s=np.concatenate([p.time_s for p in parts]),
            need=np.concatenate([p.need for p in parts]),
            batch_need=np.concatenate([p.batch_needs() for p in parts]),
        )


@dataclass(frozen=True, kw_only=True, eq=False)
class _Tables:
    """Requirements laid out for the branch and bound over the types with a choice (`free`)."""

    need: np.ndarray
    """(R,) samples."""
    base: np.ndarray
    """(R,) capacity of the types without a choice."""
    values: list[np.ndarray]
    """Per free type j, (R, options): the capacity of each option (-inf where not allowed)."""
    suffix: list[np.ndarray]
    """Per j, (R, levers + 1): the most capacity of free types j.. using exactly that many levers."""
    batch_need: np.ndarray
    """(R,) the least default maximum batch (0: none)."""
    batch_values: list[np.ndarray]
    """Per free type j, (options,): each option's share of the default maximum batch; the types
    without a choice are in `batch_suffix`'s every entry."""
    batch_suffix: list[np.ndarray]
    """Per j, (levers + 1,): the largest default maximum of free types j.. (and the others) using exactly that
    many levers. Maximised apart from the capacity: a relaxation, still necessary."""

    def viable(self, j: int, prefix: np.ndarray, batch_prefix: float, levers_left: int) -> bool:
        """Whether some completion of a prefix (free types before j fixed, capacity `prefix`, default maximum
        `batch_prefix`) with exactly `levers_left` more levers meets some requirement."""
        if not len(self.need) or levers_left < 0 or levers_left >= self.suffix[j].shape[1]:
            return False
        meets = self.base + prefix + self.suffix[j][:, levers_left] >= self.need
        return bool(np.any(meets & (batch_prefix + self.batch_suffix[j][levers_left] >= self.batch_need)))


def _largest_time_within(limit_s: float, boundary_s: float, *, strict: bool) -> float:
    """The largest float T with ``T + boundary_s <= limit_s`` (``<`` when `strict`), as the cost model adds them."""
    time_s = limit_s - boundary_s

    def ok(t: float) -> bool:
        total = t + boundary_s
        return total < limit_s if strict else total <= limit_s

    while not ok(time_s):
        time_s = float(np.nextafter(time_s, -np.inf))
    while ok(float(np.nextafter(time_s, np.inf))):
        time_s = float(np.nextafter(time_s, np.inf))
    return time_s


def _least_batch_reaching(rate: float, time_s: np.ndarray, *, strict: bool) -> np.ndarray:
    """Per iteration time, the smallest integer batch B >= 1 with ``B / time >= rate`` (``>`` when `strict`),
    as the samples/s of an allocation is computed."""
    batch = np.maximum(1.0, np.floor(rate * time_s) - 2.0)
    for _ in range(8):
        short = batch / time_s <= rate if strict else batch / time_s < rate
        if not np.any(short):
            return batch
        batch = batch + short
    raise AssertionError("float division is within a few units of the product")


def _last_level_within(
    levels: np.ndarray, steps: np.ndarray, boundary_s: float, limit_s: float, *, strict: bool
) -> np.ndarray:
    """Per accumulation count s, the index of the last level T with ``s * T + boundary_s <= limit_s``
    (``<`` when `strict`) as the cost model computes it; -1 when none."""

    def within(i: np.ndarray) -> np.ndarray:
        total = steps * levels[np.clip(i, 0, len(levels) - 1)] + boundary_s
        return (i >= 0) & (i < len(levels)) & (total < limit_s if strict else total <= limit_s)

    at = np.searchsorted(levels, (limit_s - boundary_s) / steps, side="right") - 1
    while np.any(up := within(at + 1)):
        at = at + up
    while np.any(down := (at >= 0) & ~within(at)):
        at = at - down
    return at


def most_work(table: np.ndarray, time_s: np.ndarray) -> np.ndarray:
    """Per time, the most samples one rank with micro-step times `table` runs within it (stages 0-1):
    the largest ``b * s`` with ``s * t(b) <= T`` (the cost model's float product); inf for an infinite time.

    One pass over the rank's breakpoints ``s * t(b)`` between the smallest and largest time, then a
    lookup per time: thousands of times cost about as much as one.
    """
    most = np.full(len(time_s), np.inf)
    finite = np.isfinite(time_s)
    if not np.any(finite):
        return most
    times_s = time_s[finite]
    sizes = np.arange(1, len(table) + 1)
    first = first_steps_from(float(times_s.min()), table)
    per_size = np.maximum(0, steps_within(float(times_s.max()), table) - first + 1)
    if int(per_size.sum()) > MAX_BREAKPOINTS:
        most[finite] = [float(np.max(sizes * steps_within(t, table))) for t in times_s]
        return most
    size_index = np.repeat(np.arange(len(table)), per_size)
    steps = first[size_index] + np.arange(len(size_index)) - np.repeat(np.cumsum(per_size) - per_size, per_size)
    breakpoints_s = steps * table[size_index]
    order = np.argsort(breakpoints_s, kind="stable")
    running = np.maximum.accumulate(steps[order] * sizes[size_index[order]]) if len(order) else np.zeros(0)
    below = int(np.max(sizes * (first - 1)))  # the (b, s) finished before the smallest time
    at = np.searchsorted(breakpoints_s[order], times_s, side="right")
    most[finite] = np.maximum(below, np.where(at > 0, running[np.maximum(at - 1, 0)] if len(order) else 0, 0))
    return most


# ----------------------------------------------------------------------------------
# The search
# ----------------------------------------------------------------------------------
class _LeverSearch:
    """One stage's branch and bound (see the module docstring)."""

    def __init__(
        self,
        variants: dict[str, Variants],
        options: list[list[Levers]],
        cluster: Cluster,
        zero_stage: int,
        global_batch_size: int | None,
        max_global_batch_size: int | None,
        network: NetworkProfile | None,
    ) -> None:
        self.types = list(variants)
        self.options = options
        self.rank_device_types = cluster.rank_device_types
        self.world_size = cluster.world_size
        self.zero_stage = zero_stage
        self.synchronised = zero_stage >= 2
        self.batch = global_batch_size
        self.max_batch = max_global_batch_size
        self.counts = [cluster.type_counts()[t] for t in self.types]
        priced = [
            [
                device_cost(
                    variants[t][levers],
                    device_type=t,
                    num_ranks=n,
                    zero_stage=zero_stage,
                    world_size=self.world_size,
                    network=network,
                )
                for levers in type_options
            ]
            for t, n, type_options in zip(self.types, self.counts, options)
        ]
        self.devices: list[list[DeviceCost]] = [[d for d, _ in row] for row in priced]
        self.communication: list[list[StageCommunication | None]] = [[c for _, c in row] for row in priced]
        self.step_s = [[d.optimizer_step_time_s for d in row] for row in self.devices]
        self.levers = [[lever_count(levers) for levers in row] for row in options]
        # Without a maximum each setting's automatic batch goes up to its own default
        # (`search.policies`); the largest of those bounds them all.
        largest = sum(n * max(len(d.step_time_table_s) for d in row) for n, row in zip(self.counts, self.devices))
        self.batch_limit = max_global_batch_size or min(AUTO_ACCUMULATION_STEPS * largest, MAX_GLOBAL_BATCH_SIZE)
        # At stages 0-2 the communication depends on the model only: one boundary term for every setting.
        first = self.communication[0][0]
        self.communication_boundary_s = 0.0 if first is None else first.boundary_s
        smallest_boundary = max(min(row) for row in self.step_s)
        self.betas = sorted({s for row in self.step_s for s in row if s >= smallest_boundary})
        self.free = [d for d, row in enumerate(options) if len(row) > 1]
        self.fixed_levers = sum(self.levers[d][0] for d in range(len(options)) if d not in self.free)
        self.free_levers = sum(max(self.levers[d]) for d in self.free)
        self.cache: dict[Combo, PolicyResult] = {}
        self.best: tuple[Combo, PolicyResult] | None = None
        self.proven = False
        self.tables: tuple[_Tables, _Tables] | None = None
        self.envelopes: dict[float, StageModel] = {}

    # -- settings ----------------------------------------------------------------
    def model(self, combo: Combo) -> StageModel:
        devices = [self.devices[d][o] for d, o in enumerate(combo)]
        return assemble_stage_model(devices, self.rank_device_types, self.zero_stage, self.communication[-1][combo[-1]])

    def key(self, combo: Combo) -> tuple[int, Combo]:
        """The enumeration's order: fewest levers, then by type and option."""
        return sum(self.levers[d][o] for d, o in enumerate(combo)), combo

    def boundary_s(self, beta: float) -> float:
        return beta + self.communication_boundary_s

    def value(self, outcome: PolicyResult) -> float | None:
        """Smaller is better: the iteration time (fixed batch) or minus samples/s (automatic batch)."""
        allocation = outcome.allocation
        if allocation is None:
            return None
        return allocation.iteration_time_s if self.batch is not None else -allocation.samples_per_s

    def evaluate(self, combo: Combo) -> None:
        """Run the policy on `combo` (once) and keep it when the enumeration would."""
        if combo in self.cache:
            return
        outcome = run_policy("poplar", self.model(combo), self.batch, self.max_batch)
        self.cache[combo] = outcome
        if self.best is None:
            self.best = (combo, outcome)
            return
        best_combo, best_outcome = self.best
        new, old = self.value(outcome), self.value(best_outcome)
        earlier_tie = new == old and self.key(combo) < self.key(best_combo)
        if better(outcome, best_outcome, fixed_batch=self.batch is not None) or earlier_tie:
            self.best = (combo, outcome)
            if new != old:
                self.tables = None  # the requirements follow the incumbent's value

    # -- the run -----------------------------------------------------------------
    def run(self) -> StageOutcome:
        self.evaluate(tuple(0 for _ in self.types))  # the enumeration's first setting
        assert self.best is not None
        if self.best[1].ok or (self.synchronised and self.batch is not None):
            # Otherwise no setting has a plan: below stage 2, or with an automatic batch, only a
            # batch smaller than the world size is infeasible, whatever the setting.
            self.seed()
        fewest = sum(row[0] for row in self.levers)
        for total in range(fewest, self.fixed_levers + self.free_levers + 1):
            self.branch(total)
        assert self.best is not None
        combo, outcome = self.best
        model = self.model(combo)
        return StageOutcome(model=model, outcome=outcome, levers=self.setting(combo))

    def setting(self, combo: Combo) -> dict[str, Levers]:
        return {t: self.options[d][o] for d, (t, o) in enumerate(zip(self.types, combo))}

    def branch(self, total: int) -> None:
        """Depth-first over the free types, in the enumeration's order, the settings using `total` levers."""
        stack: list[tuple[Combo, int, np.ndarray | None, _Tables | None]] = [((), 0, None, None)]
        while stack:
            prefix, used, parent, parent_tables = stack.pop()
            j = len(prefix)
            tie, strict = self.current_tables()
            tables = strict if self.after_best(total, prefix) else tie
            if parent is not None and parent_tables is tables:  # the parent's sum, one type more
                capacity = parent + tables.values[j - 1][:, prefix[-1]]
            else:
                capacity = sum((tables.values[i][:, o] for i, o in enumerate(prefix)), np.zeros(len(tables.need)))
            batch = sum(float(tables.batch_values[i][o]) for i, o in enumerate(prefix))
            if not tables.viable(j, capacity, batch, total - self.fixed_levers - used):
                continue
            if j == len(self.free):
                combo = [0] * len(self.types)
                for d, o in zip(self.free, prefix):
                    combo[d] = o
                self.evaluate(tuple(combo))
                continue
            d = self.free[j]
            stack.extend(
                ((*prefix, o), used + self.levers[d][o], capacity, tables)
                for o in reversed(range(len(self.options[d])))
            )

    def after_best(self, total: int, prefix: Combo) -> bool:
        """Whether every setting under this node comes after the incumbent in the enumeration's order."""
        assert self.best is not None
        best_total, best_combo = self.key(self.best[0])
        return (total, prefix) > (best_total, tuple(best_combo[d] for d in self.free[: len(prefix)]))

    def current_tables(self) -> tuple[_Tables, _Tables]:
        if self.tables is None:
            assert self.best is not None
            value = self.value(self.best[1])
            tie = self.tabulate(self.requirements(value, strict=False))
            strict = self.tabulate(_Requirements.none() if self.proven else self.requirements(value, strict=True))
            self.tables = (tie, strict)
        return self.tables

    def tabulate(self, requirements: _Requirements) -> _Tables:
        """Each option's capacity under each requirement, and the knapsack over the free types."""
        rows = len(requirements.need)
        limit = np.array(self.betas)[requirements.beta] if rows else np.zeros(0)
        values = [
            np.stack(
                [
                    np.where(
                        self.step_s[d][o] <= limit,
                        self.counts[d] * self.capacity(self.devices[d][o], requirements.time_s),
                        _NONE,
                    )
                    for o in range(len(self.options[d]))
                ],
                axis=1,
            )
            if rows
            else np.zeros((0, len(self.options[d])))
            for d in range(len(self.types))
        ]
        fixed = [d for d in range(len(self.types)) if d not in self.free]
        base = sum((values[d][:, 0] for d in fixed), np.zeros(rows))
        suffix = [np.full((rows, self.free_levers + 1), _NONE)]
        suffix[0][:, 0] = 0.0
        for d in reversed(self.free):
            below, here = suffix[0], np.full((rows, self.free_levers + 1), _NONE)
            for o, used in enumerate(self.levers[d]):
                shifted = values[d][:, o, None] + below[:, : self.free_levers + 1 - used]
                here[:, used:] = np.maximum(here[:, used:], shifted)
            suffix.insert(0, here)
        batch_values, batch_suffix = self.batch_knapsack()
        return _Tables(
            need=requirements.need,
            base=base,
            values=[values[d] for d in self.free],
            suffix=suffix,
            batch_need=requirements.batch_needs(),
            batch_values=batch_values,
            batch_suffix=batch_suffix,
        )

    def batch_knapsack(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Each free option's share of a setting's default maximum batch (`AUTO_ACCUMULATION_STEPS` micro-steps
        of every rank at its largest micro-batch), and per free type j the most of j.. with each lever count."""
        share = [
            np.array([AUTO_ACCUMULATION_STEPS * self.counts[d] * dev.max_micro_batch_size for dev in row], dtype=float)
            for d, row in enumerate(self.devices)
        ]
        fixed = sum(float(share[d][0]) for d in range(len(self.types)) if d not in self.free)
        suffix = [np.full(self.free_levers + 1, _NONE)]
        suffix[0][0] = fixed
        for d in reversed(self.free):
            below, here = suffix[0], np.full(self.free_levers + 1, _NONE)
            for o, used in enumerate(self.levers[d]):
                here[used:] = np.maximum(here[used:], share[d][o] + below[: self.free_levers + 1 - used])
            suffix.insert(0, here)
        return [share[d] for d in self.free], suffix

    def capacity(self, device: DeviceCost, time_s: np.ndarray) -> np.ndarray:
        """Samples one rank of `device` can take within each time (0 when none: then not allowed)."""
        table = device.step_time_table_s
        if self.synchronised:
            most = np.searchsorted(table, time_s, side="right").astype(float)
        else:
            most = most_work(table, time_s)
        return np.where(most >= 1, most, _NONE)

    # -- envelopes and seeds ---------------------------------------------------------
    def envelope(self, beta: float) -> StageModel:
        """The stage model in which each type runs each micro-batch on the fastest of its options whose
        optimizer step is at most `beta` (the lower envelope of their tables), with `beta`'s boundary.

        Non-decreasing like each table: a larger micro-batch leaves fewer options, each no faster.
        """
        if beta not in self.envelopes:
            devices = []
            for d, device_type in enumerate(self.types):
                allowed = [dev for dev, step in zip(self.devices[d], self.step_s[d]) if step <= beta]
                table = np.full(max(len(dev.step_time_table_s) for dev in allowed), np.inf)
                for dev in allowed:
                    own = dev.step_time_table_s
                    table[: len(own)] = np.minimum(table[: len(own)], own)
                devices.append(
                    DeviceCost(
                        device_type=device_type,
                        num_ranks=self.counts[d],
                        step_time_table_s=table,
                        optimizer_step_time_s=beta,
                        profile=allowed[0].profile,
                    )
                )
            self.envelopes[beta] = assemble_stage_model(
                devices, self.rank_device_types, self.zero_stage, self.communication[0][0]
            )
        return self.envelopes[beta]

    def richest(self, beta: float, time_s: float) -> Combo:
        """Per type, the option (optimizer step at most `beta`) that takes the most samples within `time_s`;
        the first of equals."""
        combo = []
        for d in range(len(self.types)):
            most = [
                self.capacity(dev, np.array([time_s]))[0] if step <= beta else _NONE
                for dev, step in zip(self.devices[d], self.step_s[d])
            ]
            combo.append(int(np.argmax(most)))
        return tuple(combo)

    def seed(self) -> None:
        """Per largest optimizer step, the envelope's bound and a setting that may reach it: evaluated best
        bound first while a bound beats the incumbent. When the incumbent reaches the best bound, no setting
        is strictly better (`proven`)."""
        bounds = sorted(found for beta in self.betas if (found := self.envelope_bound(beta)) is not None)
        if not bounds:
            return
        for bound, combo in bounds:
            assert self.best is not None
            incumbent = self.value(self.best[1])
            if incumbent is not None and bound >= incumbent:
                break
            self.evaluate(combo)
        assert self.best is not None
        incumbent = self.value(self.best[1])
        self.proven = incumbent is not None and incumbent <= bounds[0][0]
        self.tables = None

    def envelope_bound(self, beta: float) -> tuple[float, Combo] | None:
        """A lower bound on the value of every setting whose largest optimizer step is `beta`, and a setting
        that reaches it when the bound is attained (None: no such setting has a plan)."""
        envelope = self.envelope(beta)
        if self.synchronised:
            # Exact: at one micro-step time the types are separable (capacity), and the richest
            # setting at the envelope's time has the envelope's capacity there.
            outcome = run_policy("poplar", envelope, self.batch, self.max_batch)
            if outcome.allocation is None:
                return None
            time_s = float(envelope.rank_micro_step_times_s(outcome.allocation.micro_batch_sizes).max())
            value = self.value(outcome)
            assert value is not None
            return value, self.richest(beta, time_s)
        flat = FlatTables(envelope)
        if self.batch is not None:
            time_s = flat.min_time_for(self.batch, self.world_size)
            return time_s + envelope.boundary_s, self.richest(beta, time_s)
        return self.independent_rate_bound(beta, envelope, flat)

    def independent_rate_bound(self, beta: float, envelope: StageModel, flat: FlatTables) -> tuple[float, Combo]:
        """Stages 0-1, automatic batch: the most samples/s any setting of `beta` can reach, negated.

        An allocation busy for T runs at most the envelope's capacity at T, and at most the maximum batch:
        from the first time the capacity reaches the maximum, max / (T + boundary) bounds it; before, the
        best capacity level does (levels below `cut` cannot beat the incumbent)."""
        assert self.best is not None
        boundary_s = envelope.boundary_s
        at_max_s = flat.min_time_for(self.batch_limit, self.world_size)
        best_rate, best_time_s = self.batch_limit / (at_max_s + boundary_s), at_max_s
        incumbent = self.value(self.best[1])
        rate = 0.0 if incumbent is None else -incumbent
        ideal = envelope.ideal_samples_per_s
        low = max(rate * boundary_s / (ideal - rate) if ideal > rate else np.inf, flat.floor_s)
        if low < at_max_s:
            if level_count(envelope, low, at_max_s) > MAX_BREAKPOINTS:
                best_rate = max(best_rate, ideal * at_max_s / (at_max_s + boundary_s))
            else:
                times, capacity = capacity_levels(envelope, low, at_max_s)
                rates = np.where(capacity <= self.batch_limit, capacity / (times + boundary_s), -1.0)
                if len(rates) and rates.max() > best_rate:
                    best_rate, best_time_s = float(rates.max()), float(times[int(np.argmax(rates))])
        return -best_rate, self.richest(beta, best_time_s)

    # -- requirements ----------------------------------------------------------------
    def requirements(self, value: float | None, *, strict: bool) -> _Requirements:
        """Rows at least one of which every setting meets whose value is at most `value` (below it when
        `strict`); `value` None: every setting with a plan."""
        if value is None:
            if self.synchronised and self.batch is not None:
                return self.synchronised_fixed(None, strict=strict)
            return _Requirements.none()  # see `run`: then no setting has a plan
        if self.batch is not None:
            if self.synchronised:
                return self.synchronised_fixed(value, strict=strict)
            return _Requirements.concat(
                [
                    _Requirements(beta=np.array([index]), time_s=np.array([time_s]), need=np.array([self.batch]))
                    for index, beta in enumerate(self.betas)
                    if (time_s := _largest_time_within(value, self.boundary_s(beta), strict=strict)) > 0
                ]
            )
        if self.synchronised:
            return _Requirements.concat(
                [self.synchronised_rate(i, -value, strict=strict) for i in range(len(self.betas))]
            )
        return _Requirements.concat([self.independent_rate(i, -value, strict=strict) for i in range(len(self.betas))])

    def synchronised_fixed(self, value: float | None, *, strict: bool) -> _Requirements:
        """Stage 2, fixed batch B: a setting finishes within `value` only if, for some accumulation count s
        dividing B, its capacity reaches B / s at the last micro-step time T with ``s * T + boundary``
        within `value`."""
        assert self.batch is not None
        steps = divisors(self.batch)
        steps = steps[self.batch // steps >= self.world_size]
        per_step = (self.batch // steps).astype(float)
        levels = self.levels()
        parts = []
        for index, beta in enumerate(self.betas):
            boundary_s = self.boundary_s(beta)
            if value is None:
                at = np.full(len(steps), len(levels) - 1)
            else:
                at = _last_level_within(levels, steps, boundary_s, value, strict=strict)
            keep = at >= 0
            parts.append(
                _Requirements(beta=np.full(int(keep.sum()), index), time_s=levels[at[keep]], need=per_step[keep])
            )
        return _Requirements.concat(parts)

    def levels(self) -> np.ndarray:
        """Every micro-step time of every option, sorted: the times at which a capacity can change."""
        return np.unique(np.concatenate([dev.step_time_table_s for row in self.devices for dev in row]))

    def synchronised_rate(self, index: int, rate: float, *, strict: bool) -> _Requirements:
        """Stage 2, automatic batch: a setting reaches `rate` samples/s at micro-step time T only with
        s micro-steps of P samples, ``s * P <= max`` and ``s * P / (s * T + boundary) >= rate``; its capacity
        at T must reach the least such P (over s: near the most micro-steps the maximum allows)."""
        envelope = self.envelope(self.betas[index])
        boundary_s = envelope.boundary_s
        floor_s = max(float(d.step_time_table_s[0]) for d in envelope.devices)
        times = self.levels()
        times = times[times >= floor_s]
        slack = 1.0 - 1e-12  # covers the float rounding of s * T + boundary and of the division
        most_steps = np.floor((self.batch_limit / (rate * slack) - boundary_s) / times).astype(np.int64) + 1
        least = np.full(len(times), np.inf)
        for back in range(5):
            steps = most_steps - back
            usable = steps >= 1
            steps = np.maximum(steps, 1)
            batch = _least_batch_reaching(rate, steps * times + boundary_s, strict=strict)
            per_step = np.maximum(np.ceil(batch / steps), self.world_size)
            fits_max = usable & (per_step <= self.batch_limit // steps)
            least = np.where(fits_max, np.minimum(least, per_step), least)
        fewer = most_steps - 5  # below the window: each needs at least rate * (T + boundary / s)
        bound = np.ceil(rate * slack * (times + boundary_s / np.maximum(fewer, 1)))
        least = np.where(fewer >= 1, np.minimum(least, np.maximum(bound, self.world_size)), least)
        capacity = sum(
            d.num_ranks * np.searchsorted(d.step_time_table_s, times, side="right") for d in envelope.devices
        )
        keep = least <= capacity
        # s micro-steps of T: the batch is at least rate * (s * T + boundary) >= rate * (T + boundary).
        batch_need = np.floor(rate * slack * (times[keep] + boundary_s)) if self.max_batch is None else None
        return _Requirements(
            beta=np.full(int(keep.sum()), index), time_s=times[keep], need=least[keep], batch_need=batch_need
        )

    def independent_rate(self, index: int, rate: float, *, strict: bool) -> _Requirements:
        """Stages 0-1, automatic batch: a setting reaches `rate` only with a batch B within its capacity at
        its busy time T and ``B / (T + boundary) >= rate``. Between two of the envelope's capacity levels
        the least B is the one at the earlier, and the setting's capacity at most its capacity just
        before the later."""
        envelope = self.envelope(self.betas[index])
        flat = FlatTables(envelope)
        boundary_s = envelope.boundary_s
        slack = 1.0 - 1e-9  # covers the float rounding of capacities, rates and T + boundary
        ideal = envelope.ideal_samples_per_s
        if ideal < rate * slack:
            return _Requirements.none()
        # Capacity at T is at most ideal * T, so a setting reaching the rate is busy at least `cut`.
        cut = rate * slack * boundary_s / (ideal - rate * slack) if ideal > rate * slack else flat.floor_s
        high_s = self.batch_limit / (rate * slack) - boundary_s
        start_s = max(flat.previous_breakpoint(max(cut, flat.floor_s)), flat.floor_s)
        if start_s > high_s:
            return _Requirements.none()
        if level_count(envelope, start_s, high_s) > MAX_BREAKPOINTS:
            return _Requirements(beta=np.array([index]), time_s=np.array([np.inf]), need=np.array([0.0]))
        times, capacity = capacity_levels(envelope, start_s, high_s)
        need = np.maximum(_least_batch_reaching(rate, times + boundary_s, strict=strict), self.world_size)
        ends = np.append(np.nextafter(times[1:], -np.inf), high_s)
        keep = need <= np.minimum(capacity, self.batch_limit)
        return _Requirements(
            beta=np.full(int(keep.sum()), index),
            time_s=ends[keep],
            need=need[keep],
            batch_need=need[keep] if self.max_batch is None else None,
        )
