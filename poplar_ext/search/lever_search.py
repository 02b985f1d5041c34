"""The enumeration's best memory levers per type without trying all 4^k settings: envelopes seed, branch and
bound over the types (docs/search.md, "Memory levers", says why it is exact)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from poplar_ext.plan.formats import MAX_GLOBAL_BATCH_SIZE, Cluster, Levers
from poplar_ext.plan.levers import Variants, fits, lever_count, lever_options
from poplar_ext.plan.network_format import NetworkProfile

from .allocation import PolicyResult, divisors, infeasible
from .cost import DeviceCost, StageModel, assemble_stage_model, build_stage_model, device_cost
from .policies import AUTO_ACCUMULATION_STEPS, allocate, best_global_batch
from .poplar_independent import (
    MAX_BREAKPOINTS,
    FlatTables,
    capacity_levels,
    level_count,
    level_points,
    level_steps,
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
    """The policy on every setting of `settings`, in order: the first strictly best wins (the enumeration; a setting
    that fits no micro-batch of some type is reported only when first)."""
    best: StageOutcome | None = None
    for setting in settings:
        chosen = {t: variants[t][levers] for t, levers in setting.items()}
        too_big = [t for t, profile in chosen.items() if profile.max_micro_batch_size == 0]
        if too_big:
            if best is None:
                reason = f"The model does not fit {', '.join(too_big)} at stage {zero_stage} (max_micro_batch_size 0)."
                best = StageOutcome(model=None, outcome=infeasible(reason), levers=setting)
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
    """``poplar``'s best allocation at `zero_stage` (0-2) over every per-type setting of the memory levers: the
    outcome of `evaluate_settings` over ``lever_choices(variants, zero_stage, choose=True)`` (docs/search.md)."""
    assert zero_stage in (0, 1, 2), "stage 3 allows two settings: all checkpointed or none"
    options = lever_options(variants)
    if not all(fits(v, o[0]) for v, o in zip(variants.values(), options)):
        first = {t: o[0] for t, o in zip(variants, options)}
        return evaluate_settings(
            [first], variants, cluster, zero_stage, "poplar", global_batch_size, max_global_batch_size, network
        )
    return _LeverSearch(variants, options, cluster, zero_stage, global_batch_size, max_global_batch_size, network).run()


# -- Requirements and their knapsack over types
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
    """Automatic batch without a maximum: the least batch the setting's own default maximum must reach."""

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
    """Requirements laid out for the branch and bound over the types with a choice (`free`): a node keeps the rows
    some completion may still meet, with their slack (capacity minus need); a child needs only its parent's rows."""

    slack: np.ndarray
    """(R,) capacity of the types without a choice minus the need, in samples."""
    values: list[np.ndarray]
    """Per free type j, (options, R): the capacity of each option (-inf where not allowed)."""
    suffix: list[np.ndarray]
    """Per j (and one past the last: zeros), (R,): the most capacity free types j.. can add, any number of levers."""
    batch_slack: np.ndarray
    """(R,) the default maximum batch of the types without a choice minus the least one each row needs."""
    batch_values: list[np.ndarray]
    """Per free type j, (options,): each option's share of the default maximum batch."""
    batch_suffix: list[float]
    """Per j (and one past the last: 0), the largest default maximum free types j.. can add (a relaxation)."""

    def root(self, prefix: Combo) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every row, and the slacks once the first free types are fixed to `prefix`."""
        slack = self.slack + sum((self.values[i][o] for i, o in enumerate(prefix)), np.zeros(len(self.slack)))
        batch_slack = self.batch_slack + sum(float(self.batch_values[i][o]) for i, o in enumerate(prefix))
        return np.arange(len(slack)), slack, batch_slack

    def keep(self, j: int, rows: np.ndarray, slack: np.ndarray, batch_slack: np.ndarray) -> np.ndarray:
        """Which of `rows` some completion of free types j.. may still meet (a NaN slack: never)."""
        return (slack + self.suffix[j][rows] >= 0) & (batch_slack + self.batch_suffix[j] >= 0)


def _same_rows(old: _Requirements, new: _Requirements) -> np.ndarray:
    """Per row of `new`, the index of a row of `old` with the same largest optimizer step and time (-1: none)."""
    source = np.full(len(new.need), -1)
    for beta in np.unique(new.beta):
        old_rows = np.flatnonzero(old.beta == beta)
        if not len(old_rows):
            continue
        new_rows = np.flatnonzero(new.beta == beta)
        order = np.argsort(old.time_s[old_rows], kind="stable")
        times = old.time_s[old_rows[order]]
        at = np.minimum(np.searchsorted(times, new.time_s[new_rows]), len(times) - 1)
        found = times[at] == new.time_s[new_rows]
        source[new_rows[found]] = old_rows[order[at[found]]]
    return source


def _largest_time_within(limit_s: float, boundary_s: float) -> float:
    """The largest float T with ``T + boundary_s <= limit_s``, as the cost model adds them."""
    time_s = limit_s - boundary_s
    while time_s + boundary_s > limit_s:
        time_s = float(np.nextafter(time_s, -np.inf))
    while float(np.nextafter(time_s, np.inf)) + boundary_s <= limit_s:
        time_s = float(np.nextafter(time_s, np.inf))
    return time_s


def _least_batch_reaching(rate: float, time_s: np.ndarray) -> np.ndarray:
    """Per iteration time, the least integer batch B >= 1 with ``B / time >= rate`` (as samples/s is computed)."""
    batch = np.maximum(1.0, np.floor(rate * time_s) - 2.0)
    for _ in range(8):
        short = batch / time_s < rate
        if not np.any(short):
            return batch
        batch = batch + short
    raise AssertionError("float division is within a few units of the product")


def _last_level_within(levels: np.ndarray, steps: np.ndarray, boundary_s: float, limit_s: float) -> np.ndarray:
    """Per accumulation count s, the last level T with ``s * T + boundary_s <= limit_s`` in floats; -1: none."""

    def within(i: np.ndarray) -> np.ndarray:
        total = steps * levels[np.clip(i, 0, len(levels) - 1)] + boundary_s
        return (i >= 0) & (i < len(levels)) & (total <= limit_s)

    at = np.searchsorted(levels, (limit_s - boundary_s) / steps, side="right") - 1
    while np.any(up := within(at + 1)):
        at = at + up
    while np.any(down := (at >= 0) & ~within(at)):
        at = at - down
    return at


def most_work(table: np.ndarray, time_s: np.ndarray) -> np.ndarray:
    """Per time T, the most samples one rank with micro-step times `table` runs within it (stages 0-1): the largest
    ``b * s`` with ``s * t(b) <= T`` in floats (inf for an infinite T), from one pass over the breakpoints."""
    most = np.full(len(time_s), np.inf)
    finite = np.isfinite(time_s)
    if np.any(finite):
        most[finite] = _WorkCurve.over(table, time_s[finite]).at(time_s[finite])
    return most


@dataclass(frozen=True, kw_only=True, eq=False)
class _WorkCurve:
    """`most_work` of one rank in [low_s, high_s]: the sorted breakpoints ``s * t(b)`` and a running maximum."""

    table: np.ndarray
    low_s: float
    high_s: float
    breakpoints_s: np.ndarray | None
    """None: more than `MAX_BREAKPOINTS`; then each time is looked up on its own."""
    running: np.ndarray
    below: int
    """The most work of the (b, s) that finish before `low_s`."""

    @staticmethod
    def over(table: np.ndarray, times_s: np.ndarray) -> _WorkCurve:
        """The curve over the range of `times_s` (finite, not empty)."""
        low_s, high_s = float(times_s.min()), float(times_s.max())
        sizes = np.arange(1, len(table) + 1)
        first, per_size = level_steps(table, low_s, high_s)
        below = int(np.max(sizes * (first - 1)))
        if int(per_size.sum()) > MAX_BREAKPOINTS:
            return _WorkCurve(table=table, low_s=low_s, high_s=high_s, breakpoints_s=None, running=first, below=below)
        size_index, steps = level_points(first, per_size)
        breakpoints_s = steps * table[size_index]
        order = np.argsort(breakpoints_s, kind="stable")
        running = np.maximum.accumulate(steps[order] * sizes[size_index[order]]) if len(order) else np.zeros(0)
        return _WorkCurve(
            table=table, low_s=low_s, high_s=high_s, breakpoints_s=breakpoints_s[order], running=running, below=below
        )

    def covers(self, times_s: np.ndarray) -> bool:
        return self.low_s <= float(times_s.min()) and float(times_s.max()) <= self.high_s

    def at(self, times_s: np.ndarray) -> np.ndarray:
        """The most work at each of `times_s` (finite, within the range)."""
        if self.breakpoints_s is None:
            sizes = np.arange(1, len(self.table) + 1)
            return np.array([float(np.max(sizes * steps_within(t, self.table))) for t in times_s])
        if not len(self.running):
            return np.full(len(times_s), float(self.below))
        at = np.searchsorted(self.breakpoints_s, times_s, side="right")
        return np.maximum(self.below, np.where(at > 0, self.running[np.maximum(at - 1, 0)], 0)).astype(float)


# -- The search
class _LeverSearch:
    """One stage's branch and bound (see docs/search.md, "Memory levers")."""

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
        # Each (type, option) priced once: its device and the stage's communication.
        price = functools.partial(device_cost, zero_stage=zero_stage, world_size=self.world_size, network=network)
        priced = [
            [price(variants[t][levers], device_type=t, num_ranks=n) for levers in row]
            for t, n, row in zip(variants, self.counts, options)
        ]
        self.devices = [[d for d, _ in row] for row in priced]
        self.communication = [[c for _, c in row] for row in priced]
        self.step_s = [[d.optimizer_step_time_s for d in row] for row in self.devices]
        self.levers = [[lever_count(levers) for levers in row] for row in options]
        self.free = [d for d, row in enumerate(options) if len(row) > 1]
        self.fixed_levers = sum(self.levers[d][0] for d in range(len(options)) if d not in self.free)
        self.least_levers = [sum(min(self.levers[d]) for d in self.free[j:]) for j in range(len(self.free) + 1)]
        # Without a maximum each setting's automatic batch goes up to its own default (`search.policies`); the
        # largest of those bounds them all (`batch_limit`); each option's share of its setting's (`batch_share`).
        largest = sum(n * max(len(d.step_time_table_s) for d in row) for n, row in zip(self.counts, self.devices))
        self.batch_limit = max_global_batch_size or min(AUTO_ACCUMULATION_STEPS * largest, MAX_GLOBAL_BATCH_SIZE)
        self.batch_share = [
            np.array([AUTO_ACCUMULATION_STEPS * n * dev.max_micro_batch_size for dev in row], dtype=float)
            for n, row in zip(self.counts, self.devices)
        ]
        # At stages 0-2 the communication depends on the model only: one boundary term for every setting.
        first = self.communication[0][0]
        self.communication_boundary_s = 0.0 if first is None else first.boundary_s
        smallest_boundary = max(min(row) for row in self.step_s)
        self.betas = sorted({s for row in self.step_s for s in row if s >= smallest_boundary})
        self.cache: dict[Combo, PolicyResult] = {}
        self.best: tuple[Combo, PolicyResult] | None = None
        self.proven = False
        self.tables: _Tables | None = None
        self.last_rows: tuple[_Requirements, list[np.ndarray]] | None = None
        self.envelopes: dict[float, StageModel] = {}
        self.curves: dict[tuple[int, int], _WorkCurve] = {}

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

    def run(self) -> StageOutcome:
        self.evaluate(tuple(0 for _ in self.types))  # the enumeration's first setting
        assert self.best is not None
        if self.best[1].ok or (self.synchronised and self.batch is not None):
            # Otherwise no setting has a plan: below stage 2, or with an automatic batch, only a
            # batch smaller than the world size is infeasible, whatever the setting.
            self.seed()
        self.branch()
        assert self.best is not None
        combo, outcome = self.best
        model = self.model(combo)
        return StageOutcome(model=model, outcome=outcome, levers=self.setting(combo))

    def setting(self, combo: Combo) -> dict[str, Levers]:
        return {t: self.options[d][o] for d, (t, o) in enumerate(zip(self.types, combo))}

    def branch(self) -> None:
        """Depth-first over the free types' options, each node keeping the rows its settings may still meet; a node
        reached under older tables (the incumbent improved) starts again from every row."""
        stack: list[tuple[Combo, int, tuple | None]] = [((), 0, None)]
        while stack:
            prefix, used, parent = stack.pop()
            j = len(prefix)
            tables = self.current_tables()
            if parent is not None and parent[0] is tables:  # the parent's rows, one type more
                _, rows, slack, batch_slack = parent
                slack = slack + tables.values[j - 1][prefix[-1]][rows]
                batch_slack = batch_slack + float(tables.batch_values[j - 1][prefix[-1]])
            else:
                rows, slack, batch_slack = tables.root(prefix)
            keep = tables.keep(j, rows, slack, batch_slack)
            if not np.any(keep) or self.after_proven_best(prefix, used):
                continue
            if j == len(self.free):
                self.evaluate(self.combo(prefix))
                continue
            state = (tables, rows[keep], slack[keep], batch_slack[keep])
            d = self.free[j]
            stack.extend(((*prefix, o), used + self.levers[d][o], state) for o in reversed(range(len(self.options[d]))))

    def combo(self, prefix: Combo) -> Combo:
        """The setting with the free types' options `prefix` (the others have one)."""
        chosen = dict(zip(self.free, prefix))
        return tuple(chosen.get(d, 0) for d in range(len(self.types)))

    def after_proven_best(self, prefix: Combo, used: int) -> bool:
        """Whether nothing under a node (options `prefix`, `used` levers) can win: the incumbent is proven best and
        every setting under the node comes after it in the enumeration's order (so none wins a tie either)."""
        if not self.proven:
            return False
        assert self.best is not None
        if len(prefix) == len(self.free):
            return self.key(self.combo(prefix)) > self.key(self.best[0])
        least = self.fixed_levers + used + self.least_levers[len(prefix)]
        return least > self.key(self.best[0])[0]

    def current_tables(self) -> _Tables:
        if self.tables is None:
            assert self.best is not None
            self.tables = self.tabulate(self.requirements(self.value(self.best[1])))
        return self.tables

    def tabulate(self, requirements: _Requirements) -> _Tables:
        """Each option's capacity under each requirement, and per free type the most the types from it on add."""
        rows = len(requirements.need)
        limit = np.array(self.betas)[requirements.beta] if rows else np.zeros(0)
        values = self.row_values(requirements, limit)
        fixed = [d for d in range(len(self.types)) if d not in self.free]
        suffix = [np.zeros(rows)]
        batch_suffix = [0.0]
        for d in reversed(self.free):
            suffix.insert(0, suffix[0] + np.maximum.reduce(values[d]))
            batch_suffix.insert(0, batch_suffix[0] + float(self.batch_share[d].max()))
        return _Tables(
            slack=sum((values[d][0] for d in fixed), np.zeros(rows)) - requirements.need,
            values=[values[d] for d in self.free],
            suffix=suffix,
            batch_slack=sum(float(self.batch_share[d][0]) for d in fixed) - requirements.batch_needs(),
            batch_values=[self.batch_share[d] for d in self.free],
            batch_suffix=batch_suffix,
        )

    def row_values(self, requirements: _Requirements, limit: np.ndarray) -> list[np.ndarray]:
        """Per type, (options, R) each option's capacity at each row; rows kept from the last tables are copied."""
        if self.last_rows is None:
            source = np.full(len(requirements.need), -1)
            values = [np.empty((len(row), len(source))) for row in self.options]
        else:
            source = _same_rows(self.last_rows[0], requirements)
            values = [np.take(old, np.maximum(source, 0), axis=1) for old in self.last_rows[1]]
        todo = np.flatnonzero(source < 0)
        for d in range(len(self.types)):
            values[d][:, todo] = self.option_capacities(d, requirements.time_s[todo], limit[todo])
        self.last_rows = (requirements, values)
        return values

    def option_capacities(self, d: int, time_s: np.ndarray, limit: np.ndarray) -> np.ndarray:
        """(options, R) each option of type `d`'s capacity at each row (-inf: its optimizer step above the row's)."""
        columns = [
            np.where(step <= limit, self.counts[d] * self.capacity(d, o, time_s), _NONE)
            for o, step in enumerate(self.step_s[d])
        ]
        return np.stack(columns) if len(time_s) else np.zeros((len(columns), 0))

    def capacity(self, d: int, o: int, time_s: np.ndarray) -> np.ndarray:
        """Samples one rank of type `d` with option `o` takes within each time (-inf: none, so not allowed)."""
        table = self.devices[d][o].step_time_table_s
        if self.synchronised:
            most = np.searchsorted(table, time_s, side="right").astype(float)
        else:
            most = np.full(len(time_s), np.inf)
            finite = np.isfinite(time_s)
            if np.any(finite):
                curve = self.curves.get((d, o))
                if curve is None or not curve.covers(time_s[finite]):
                    curve = self.curves[d, o] = _WorkCurve.over(table, time_s[finite])
                most[finite] = curve.at(time_s[finite])
        return np.where(most >= 1, most, _NONE)

    def envelope(self, beta: float) -> StageModel:
        """The stage model of each type's lower envelope of its options with optimizer step at most `beta`, with
        `beta`'s boundary (non-decreasing: a larger micro-batch leaves fewer options, each no faster)."""
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
        """Per type, the first option (optimizer step at most `beta`) taking the most samples within `time_s`."""
        at = np.array([time_s])
        return tuple(
            int(np.argmax([self.capacity(d, o, at)[0] if step <= beta else _NONE for o, step in enumerate(steps)]))
            for d, steps in enumerate(self.step_s)
        )

    def seed(self) -> None:
        """Per largest optimizer step, the envelope's bound and a setting that may reach it, evaluated best bound first;
        an incumbent at the best bound is `proven` (the branch and bound then skips every setting after it).

        The one shortcut relying on the policies being exact: at stage 2 the bound is ``poplar``'s value on the
        envelope, a lower bound only because that policy is optimal on its model (else `proven` could be wrong).
        """
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
        that reaches it when the bound is attained (None: no such setting has a plan).

        At stage 2 the bound is the ``poplar`` policy's value on the envelope: a lower bound only because
        that policy is exact (see `seed`)."""
        envelope = self.envelope(beta)
        if self.synchronised:
            # The envelope's optimum: at one micro-step time the types are separable (capacity), and the
            # richest setting at the envelope's time has the envelope's capacity there.
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
        """Stages 0-1, automatic batch: the most samples/s any setting of `beta` can reach, negated (busy for T, it runs
        at most the envelope's capacity at T and at most the maximum batch)."""
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

    def requirements(self, value: float | None) -> _Requirements:
        """Rows one of which every setting of value at most `value` (None: any plan) meets, whatever its allocation."""
        if value is None:
            if self.synchronised and self.batch is not None:
                return self.synchronised_fixed(None)
            return _Requirements.none()  # see `run`: then no setting has a plan
        if self.batch is not None:
            if self.synchronised:
                return self.synchronised_fixed(value)
            return _Requirements.concat(
                [
                    _Requirements(beta=np.array([index]), time_s=np.array([time_s]), need=np.array([self.batch]))
                    for index, beta in enumerate(self.betas)
                    if (time_s := _largest_time_within(value, self.boundary_s(beta))) > 0
                ]
            )
        if self.synchronised:
            return _Requirements.concat([self.synchronised_rate(i, -value) for i in range(len(self.betas))])
        return _Requirements.concat([self.independent_rate(i, -value) for i in range(len(self.betas))])

    def synchronised_fixed(self, value: float | None) -> _Requirements:
        """Stage 2, fixed batch B: for some count s dividing B, capacity B / s at the last T with ``s * T + boundary``
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
                at = _last_level_within(levels, steps, boundary_s, value)
            keep = at >= 0
            parts.append(
                _Requirements(beta=np.full(int(keep.sum()), index), time_s=levels[at[keep]], need=per_step[keep])
            )
        return _Requirements.concat(parts)

    def levels(self) -> np.ndarray:
        """Every micro-step time of every option, sorted: the times at which a capacity can change."""
        return np.unique(np.concatenate([dev.step_time_table_s for row in self.devices for dev in row]))

    def synchronised_rate(self, index: int, rate: float) -> _Requirements:
        """Stage 2, automatic batch: capacity at micro-step time T reaching the least P with s micro-steps of P,
        ``s * P <= max`` and ``s * P / (s * T + boundary) >= rate``."""
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
            batch = _least_batch_reaching(rate, steps * times + boundary_s)
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

    def independent_rate(self, index: int, rate: float) -> _Requirements:
        """Stages 0-1, automatic batch: a batch B within capacity at busy time T with ``B / (T + boundary) >= rate``
        (between two envelope levels: the earlier's least B, the capacity just before the later)."""
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
        need = np.maximum(_least_batch_reaching(rate, times + boundary_s), self.world_size)
        ends = np.append(np.nextafter(times[1:], -np.inf), high_s)
        keep = need <= np.minimum(capacity, self.batch_limit)
        return _Requirements(
            beta=np.full(int(keep.sum()), index),
            time_s=ends[keep],
            need=need[keep],
            batch_need=need[keep] if self.max_batch is None else None,
        )
