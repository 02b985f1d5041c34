"""The allocation policies ``uniform``, ``proportional`` and ``poplar`` behind one signature (docs/search.md)."""

from __future__ import annotations

import numpy as np

from poplar_ext.plan.formats import MAX_GLOBAL_BATCH_SIZE, POLICIES

from .allocation import Allocation, PolicyResult, at_steps, batch_problem, divisors, infeasible
from .cost import StageModel
from .poplar_independent import poplar_independent, poplar_independent_best
from .poplar_synchronised import poplar_synchronised, poplar_synchronised_best

AUTO_ACCUMULATION_STEPS = 8
"""Without a maximum global batch, the auto search looks at batches up to this many
micro-steps of every rank at its largest micro-batch."""

__all__ = ["AUTO_ACCUMULATION_STEPS", "Allocation", "PolicyResult", "allocate", "best_global_batch"]


# -- uniform
def _uniform(model: StageModel, global_batch_size: int) -> PolicyResult:
    world = model.world_size
    if global_batch_size % world:
        return infeasible(
            f"The global batch {global_batch_size} is not a multiple of the {world} ranks; "
            "uniform gives every rank the same micro-batch and accumulation count."
        )
    per_rank = global_batch_size // world
    smallest_cap = min(d.max_micro_batch_size for d in model.devices)
    sizes = divisors(per_rank)
    micro = int(sizes[sizes <= smallest_cap].max())
    return at_steps(model, [[(micro, d.num_ranks)] for d in model.devices], per_rank // micro)


def _uniform_best(model: StageModel, max_batch: int) -> PolicyResult:
    world = model.world_size
    smallest_cap = min(d.max_micro_batch_size for d in model.devices)
    micro = np.arange(1, smallest_cap + 1, dtype=np.int64)
    steps = max_batch // (world * micro)
    valid = steps >= 1
    if not np.any(valid):
        return infeasible(batch_problem(model, max_batch, upper_bound=True))
    slowest = np.max([d.step_time_table_s[:smallest_cap] for d in model.devices], axis=0)
    time = steps * slowest + model.boundary_s
    rate = np.where(valid, world * micro * steps / time, -1.0)
    best = int(np.argmax(rate))
    return at_steps(model, [[(int(micro[best]), d.num_ranks)] for d in model.devices], int(steps[best]))


# -- proportional (Whale)
def _proportional_weights(model: StageModel) -> np.ndarray:
    """Measured throughput of each type at its largest micro-batch (samples/s)."""
    return np.array([d.max_micro_batch_size / d.step_time_table_s[-1] for d in model.devices])


def _proportional_amounts(model: StageModel, totals: np.ndarray) -> np.ndarray:
    """Each type's samples per micro-step (one row per total, each from the world size to the total cap), in
    proportion to throughput: every rank's share clipped to [1, its cap], largest-remainder rounding."""
    counts = model.counts
    caps = np.array([d.max_micro_batch_size for d in model.devices], dtype=np.int64)
    weights = _proportional_weights(model)
    # The samples at a scale of the weights are linear between the scales where a share reaches 1 or its cap:
    # interpolating between those kinks gives each total's scale exactly.
    kinks = np.sort(np.concatenate([1.0 / weights, caps / weights]))
    scales = np.interp(totals, np.clip(np.outer(kinks, weights), 1, caps) @ counts, kinks)
    exact = counts * np.clip(np.outer(scales, weights), 1, caps)
    amounts = np.clip(np.floor(exact).astype(np.int64), counts, counts * caps)
    # The samples left go one each to the largest remainders, ties to the first type (ranks of one type are
    # interchangeable); a type at its cap takes none.
    remainders = np.where(amounts < counts * caps, exact - amounts, -1.0)
    places = np.argsort(np.argsort(-remainders, axis=1, kind="stable"), axis=1)
    return amounts + (places < (totals - amounts.sum(axis=1))[:, None])


def _proportional_split(model: StageModel, total: int) -> list[list[tuple[int, int]]] | None:
    """Split `total` samples per micro-step over ranks in proportion to throughput."""
    if total < model.world_size or total > model.total_max_micro_batch:
        return None
    amounts = _proportional_amounts(model, np.array([total]))[0]
    return [_even_split(int(a), int(n)) for a, n in zip(amounts, model.counts)]


def _even_split(amount: int, count: int) -> list[tuple[int, int]]:
    """`amount` samples over `count` identical ranks: sizes differ by at most one, larger first."""
    base, extra = divmod(amount, count)
    groups = [(base + 1, extra), (base, count - extra)]
    return [g for g in groups if g[1] > 0]


def _proportional(model: StageModel, global_batch_size: int) -> PolicyResult:
    for steps in divisors(global_batch_size):
        split = _proportional_split(model, global_batch_size // int(steps))
        if split is not None:
            return at_steps(model, split, int(steps))
    return infeasible(
        f"No accumulation count s divides the global batch {global_batch_size} so that B / s lies between "
        f"the {model.world_size} ranks and {model.total_max_micro_batch} (every rank at its largest micro-batch)."
    )


def _proportional_best(model: StageModel, max_batch: int) -> PolicyResult:
    # Every per-step total, each at as many micro-steps as fit under the maximum (more steps of one split only
    # spread the boundary further), in chunks: memory stays bounded at millions of totals.
    best_rate, best_amounts, best_steps = -1.0, None, 0
    last = min(model.total_max_micro_batch, max_batch)
    for first in range(model.world_size, last + 1, _TOTALS_PER_CHUNK):
        totals = np.arange(first, min(first + _TOTALS_PER_CHUNK - 1, last) + 1, dtype=np.int64)
        amounts = _proportional_amounts(model, totals)
        largest = -(-amounts // model.counts)  # a type's larger micro-batch sets its micro-step
        micro_s = np.max([d.step_time_table_s[largest[:, i] - 1] for i, d in enumerate(model.devices)], axis=0)
        steps = max_batch // totals
        rates = totals * steps / (steps * micro_s + model.boundary_s)
        best = int(np.argmax(rates))
        if rates[best] > best_rate:
            best_rate, best_amounts, best_steps = float(rates[best]), amounts[best], int(steps[best])
    split = [_even_split(int(a), int(n)) for a, n in zip(best_amounts, model.counts)]
    return at_steps(model, split, best_steps)


_TOTALS_PER_CHUNK = 2**16
"""Per-step totals `_proportional_best` prices at once (about 10 MB per device type)."""


# -- The one entry point per question
_RUN = {  # (exactly a global batch, the best global batch up to a maximum)
    "uniform": (_uniform, _uniform_best),
    "proportional": (_proportional, _proportional_best),
    "poplar synchronised": (poplar_synchronised, poplar_synchronised_best),
    "poplar independent": (poplar_independent, poplar_independent_best),
}


def _run(policy: str, model: StageModel, batch: int, *, best: bool) -> PolicyResult:
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {', '.join(map(repr, POLICIES))}, found {policy!r}")
    reason = batch_problem(model, batch, upper_bound=best)
    if reason:
        return infeasible(reason)
    if policy == "poplar":
        policy = "poplar synchronised" if model.synchronised_micro_steps else "poplar independent"
    exactly, best_up_to = _RUN[policy]
    return (best_up_to if best else exactly)(model, batch)


def allocate(policy: str, model: StageModel, global_batch_size: int) -> PolicyResult:
    """Allocate exactly `global_batch_size` samples per iteration with `policy`."""
    return _run(policy, model, global_batch_size, best=False)


def best_global_batch(policy: str, model: StageModel, max_global_batch_size: int | None = None) -> PolicyResult:
    """The allocation with the highest predicted samples/s over global batches up to a maximum (default:
    `AUTO_ACCUMULATION_STEPS` micro-steps of every rank at its largest micro-batch, at most `MAX_GLOBAL_BATCH_SIZE`)."""
    max_batch = max_global_batch_size
    if max_batch is None:  # held to the search's limit: a large cluster of large micro-batches can exceed it
        max_batch = min(AUTO_ACCUMULATION_STEPS * model.total_max_micro_batch, MAX_GLOBAL_BATCH_SIZE)
    return _run(policy, model, max_batch, best=True)
