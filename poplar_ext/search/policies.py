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


def _proportional_split(model: StageModel, total: int) -> list[list[tuple[int, int]]] | None:
    """Split `total` samples per micro-step over ranks in proportion to throughput."""
    counts = model.counts
    caps = np.array([d.max_micro_batch_size for d in model.devices], dtype=np.int64)
    if total < counts.sum() or total > int(counts @ caps):
        return None
    weights = _proportional_weights(model)

    def shares(scale: float) -> np.ndarray:
        return np.clip(scale * weights, 1.0, caps)

    lo, hi = 0.0, float(caps.max() / weights.min())
    for _ in range(200):
        mid = (lo + hi) / 2
        if counts @ shares(mid) < total:
            lo = mid
        else:
            hi = mid
    exact = counts * shares(hi)
    amounts = np.clip(np.floor(exact).astype(np.int64), counts, counts * caps)
    # Largest remainder over type totals (ranks of one type are interchangeable); the
    # loop also absorbs the bisection's last-digit error, so it may run more than once.
    order = sorted(range(len(counts)), key=lambda i: (-(exact[i] - amounts[i]), i))
    left = total - int(amounts.sum())
    while left > 0:
        for i in order:
            if left > 0 and amounts[i] < counts[i] * caps[i]:
                amounts[i] += 1
                left -= 1
    while left < 0:
        for i in reversed(order):
            if left < 0 and amounts[i] > counts[i]:
                amounts[i] -= 1
                left += 1
    return [_even_split(int(a), int(n)) for a, n in zip(amounts, counts)]


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
    weights = _proportional_weights(model)
    caps = np.array([d.max_micro_batch_size for d in model.devices])
    scale = float(np.min(caps / weights))
    per_step = int(model.counts @ np.maximum(1, np.floor(scale * weights + 1e-9)).astype(np.int64))
    per_step = min(per_step, max_batch)
    if per_step < model.world_size:
        return infeasible(batch_problem(model, max_batch, upper_bound=True))
    steps = max(1, max_batch // per_step)
    split = _proportional_split(model, per_step)
    assert split is not None, "per_step lies between the world size and the total cap"
    return at_steps(model, split, steps)


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
