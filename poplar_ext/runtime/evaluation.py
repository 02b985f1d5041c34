"""Evaluation under a plan: every sample once, each rank's batch sized for its device (docs/trainer.md)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch.utils.data

from poplar_ext.plan.formats import Plan
from poplar_ext.runtime.data import rank_offsets

PADDING_INDEX = 0
"""The sample a rank without a real one evaluates in the last round (its rows are dropped)."""


def eval_batch_sizes(plan: Plan, *, smallest_batch_size: int) -> list[int]:
    """Each rank's evaluation batch: `smallest_batch_size` for the rank with the smallest plan
    micro-batch, the others in proportion to their plan micro-batch (see docs/trainer.md)."""
    if isinstance(smallest_batch_size, bool) or not isinstance(smallest_batch_size, int) or smallest_batch_size < 1:
        raise ValueError(f"per_device_eval_batch_size: expected an integer >= 1, found {smallest_batch_size!r}")
    smallest = min(r.micro_batch_size for r in plan.ranks)
    return [max(1, smallest_batch_size * r.micro_batch_size // smallest) for r in plan.ranks]


def evaluation_rounds(num_samples: int, batch_sizes: Sequence[int]) -> list[list[tuple[int, int]]]:
    """``rounds[k][r] = (start, count)``: the samples rank r evaluates in round k (count 0: none)."""
    if num_samples < 0:
        raise ValueError(f"num_samples: expected an integer >= 0, found {num_samples}")
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes: expected one integer >= 1 per rank, found {list(batch_sizes)}")
    per_round = sum(batch_sizes)
    full, remainder = divmod(num_samples, per_round)
    rounds = [_round(k * per_round, list(batch_sizes)) for k in range(full)]
    if remainder:
        rounds.append(_round(full * per_round, _shares(remainder, batch_sizes)))
    return rounds


def _round(start: int, counts: list[int]) -> list[tuple[int, int]]:
    return [(start + offset, count) for offset, count in zip(rank_offsets(counts), counts)]


def _shares(total: int, weights: Sequence[int]) -> list[int]:
    """`total` split in proportion to `weights` (largest remainder; each at most its weight, as total < sum)."""
    exact = [total * w / sum(weights) for w in weights]
    shares = [math.floor(x) for x in exact]
    by_fraction = sorted(range(len(weights)), key=lambda r: (shares[r] - exact[r], r))
    for r in by_fraction[: total - sum(shares)]:
        shares[r] += 1
    return shares


class EvalBatchSampler(torch.utils.data.Sampler[list[int]]):
    """One rank's evaluation batches (lists of sample indices), one per round (see docs/trainer.md)."""

    def __init__(self, *, num_samples: int, batch_sizes: Sequence[int], rank: int) -> None:
        if not 0 <= rank < len(batch_sizes):
            raise ValueError(f"rank: expected 0..{len(batch_sizes) - 1}, found {rank}")
        if num_samples < 1:
            raise ValueError(f"the evaluation data set: expected at least one sample, found {num_samples}")
        self.rank = rank
        self.rounds = evaluation_rounds(num_samples, batch_sizes)

    def real_counts(self, round_index: int) -> list[int]:
        """How many of each rank's rows in round `round_index` are real samples (the rest is padding)."""
        return [count for _, count in self.rounds[round_index]]

    def __iter__(self) -> Iterator[list[int]]:
        for shares in self.rounds:
            start, count = shares[self.rank]
            yield list(range(start, start + count)) if count else [PADDING_INDEX]

    def __len__(self) -> int:
        return len(self.rounds)
