"""Which samples each rank trains on: one seeded stream, cut into per-rank micro-batches (docs/design.md)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch.utils.data

from poplar_ext.plan.formats import Plan
from poplar_ext.plan.pipeline_formats import PipelinePlan


def rank_offsets(samples_per_rank: Sequence[int]) -> list[int]:
    """Start of each rank's chunk within an iteration: ranks' chunks in rank order."""
    return [0, *itertools.accumulate(samples_per_rank)][:-1]


class SampleStream:
    """Epoch permutations laid end to end; `indices(start, count)` reads a window."""

    def __init__(self, *, num_samples: int, seed: int = 0, shuffle: bool = True) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples: expected an integer >= 1, found {num_samples}")
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        # The last permutation used: reads move forward through one epoch at a time.
        self._cached_epoch = -1
        self._cached_order: np.ndarray | None = None

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The sample order of `epoch` (a permutation of ``range(num_samples)``)."""
        if epoch != self._cached_epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                order = np.arange(self.num_samples)
            self._cached_epoch, self._cached_order = epoch, order
        assert self._cached_order is not None
        return self._cached_order

    def indices(self, start: int, count: int) -> list[int]:
        """Sample indices at stream positions ``[start, start + count)``."""
        assert start >= 0 and count >= 0
        out: list[int] = []
        position, end = start, start + count
        while position < end:
            epoch, offset = divmod(position, self.num_samples)
            take = min(end - position, self.num_samples - offset)
            out.extend(self.epoch_order(epoch)[offset : offset + take].tolist())
            position += take
        return out


def plan_shares(plan: Plan | PipelinePlan) -> tuple[list[int], list[int]]:
    """Each member's micro-batch size and count per iteration: a ZeRO plan's ranks, a pipeline plan's pipelines."""
    if isinstance(plan, PipelinePlan):
        return [p.micro_batch_size for p in plan.pipelines], [p.num_micro_batches for p in plan.pipelines]
    return [r.micro_batch_size for r in plan.ranks], [r.gradient_accumulation_steps for r in plan.ranks]


class PlanBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Yields one rank's micro-batches (lists of sample indices): ``DataLoader(dataset, batch_sampler=sampler)``.

    Each item is one micro-batch of `micro_batch_size` samples, `gradient_accumulation_steps` of them per
    iteration; every rank builds its own from the same plan and seed. One pass (``iter``) is the rest of the
    current epoch, or `iterations_per_pass` iterations; `set_position` moves to a checkpointed position.
    """

    def __init__(
        self,
        *,
        num_samples: int,
        micro_batch_sizes: Sequence[int],
        gradient_accumulation_steps: Sequence[int],
        rank: int,
        seed: int = 0,
        shuffle: bool = True,
        consumed_samples: int = 0,
        iterations_per_pass: int | None = None,
        drop_last: bool = False,
    ) -> None:
        if len(micro_batch_sizes) != len(gradient_accumulation_steps) or not micro_batch_sizes:
            raise ValueError(
                "micro_batch_sizes and gradient_accumulation_steps: expected one entry per rank in each, found "
                f"{len(micro_batch_sizes)} and {len(gradient_accumulation_steps)}"
            )
        if not 0 <= rank < len(micro_batch_sizes):
            raise ValueError(f"rank: expected 0..{len(micro_batch_sizes) - 1}, found {rank}")
        self.stream = SampleStream(num_samples=num_samples, seed=seed, shuffle=shuffle)
        self.rank = rank
        self.micro_batch_size = micro_batch_sizes[rank]
        """Samples in each of this rank's micro-batches (b_r)."""
        self.gradient_accumulation_steps = gradient_accumulation_steps[rank]
        """This rank's micro-batches per iteration (s_r); after `switch_plan`, the new plan's, also while
        earlier iterations still run the old one (`split` gives an iteration's own)."""
        samples_per_rank = [b * s for b, s in zip(micro_batch_sizes, gradient_accumulation_steps)]
        self.global_batch_size = sum(samples_per_rank)
        """Samples per iteration over all ranks (B)."""
        check_holds_global_batch(num_samples, self.global_batch_size, "num_samples")
        self._world_size = len(samples_per_rank)
        if iterations_per_pass is not None and iterations_per_pass < 1:
            raise ValueError(f"iterations_per_pass: expected an integer >= 1, found {iterations_per_pass}")
        self.iterations_per_pass = iterations_per_pass
        """Iterations in one pass, or None: a pass is the rest of the current epoch."""
        self.drop_last = drop_last
        """End each epoch's last pass at the epoch boundary (see docs/design.md)."""
        self._iterations_per_epoch = num_samples // self.global_batch_size
        self._origin = 0
        """Stream position of iteration 0 (not 0 after a resume under another global batch)."""
        self.next_iteration = 0
        """The iteration the next pass starts at (advances as micro-batches are yielded)."""
        self._splits: list[tuple[int, int, int, int]] = [
            (0, self.micro_batch_size, self.gradient_accumulation_steps, rank_offsets(samples_per_rank)[rank])
        ]
        """``(from_position, b, s, offset)``: this rank's share of every iteration that starts at or after
        the stream position, the last such entry winning (`switch_plan` appends)."""
        self.generated_until = 0
        """Stream position after the last iteration this sampler has begun handing out (a DataLoader with
        workers runs ahead of training): a plan switch can start no earlier."""
        self.trained_position: Callable[[], int] | None = None
        """Where training has reached: the stream position of the first iteration no optimizer step trained,
        set by the engine that follows this sampler (`EngineCore._add_sampler`); None for a sampler of its own.
        A pass that begins after earlier passes handed out more than was trained (a DataLoader's workers and
        accelerate's loader read ahead; the loop left the pass early) starts there, so that the iterations
        handed out but never trained are handed out again rather than skipped."""
        self._read_ahead = False
        """Passes have moved `next_iteration` since the last `set_position` or `set_epoch`."""
        self.set_position(consumed_samples)

    @classmethod
    def from_plan(cls, plan: Plan | PipelinePlan, *, rank: int, num_samples: int, **options) -> PlanBatchSampler:
        """The sampler of `rank` under `plan` (options as in the constructor; of a pipeline plan, `rank` is
        the pipeline's index)."""
        sizes, steps = plan_shares(plan)
        return cls(
            num_samples=num_samples, micro_batch_sizes=sizes, gradient_accumulation_steps=steps, rank=rank, **options
        )

    @property
    def consumed_samples(self) -> int:
        """Stream position where the next iteration starts (samples of all ranks consumed)."""
        return self.iteration_start(self.next_iteration)

    def set_position(self, consumed_samples: int) -> None:
        """Continue from a stream position saved in a checkpoint: the next iteration starts there, any position.
        With `drop_last` (iterations on this batch's grid in each epoch) it is the grid's first at or after the
        position, or the next epoch's first where the rest of the epoch holds no whole iteration."""
        if isinstance(consumed_samples, bool) or not isinstance(consumed_samples, int) or consumed_samples < 0:
            raise ValueError(
                f"consumed_samples: expected a stream position (an integer >= 0), found {consumed_samples!r}"
            )
        batch = self.global_batch_size
        if not self.drop_last:
            self._origin, self.next_iteration = consumed_samples % batch, consumed_samples // batch
        else:
            self._origin, self.next_iteration = 0, self._first_iteration_from(consumed_samples)
        self.generated_until = self.consumed_samples
        self._read_ahead = False

    def iteration_start(self, iteration: int) -> int:
        """Stream position of the first sample of `iteration`."""
        if not self.drop_last:
            return self._origin + iteration * self.global_batch_size
        epoch, within = divmod(iteration, self._iterations_per_epoch)
        return epoch * self.stream.num_samples + within * self.global_batch_size

    def epoch_of(self, iteration: int) -> int:
        """The epoch `iteration` belongs to: the one it starts in."""
        if self.drop_last:
            return iteration // self._iterations_per_epoch
        return self.iteration_start(iteration) // self.stream.num_samples

    def first_iteration_of(self, epoch: int) -> int:
        """The first iteration that starts in `epoch`."""
        if self.drop_last:
            return epoch * self._iterations_per_epoch
        return max(0, -(-(epoch * self.stream.num_samples - self._origin) // self.global_batch_size))

    def set_epoch(self, epoch: int) -> None:
        """Move to the first iteration of pass `epoch` (how a trainer that counts epochs resumes)."""
        if epoch < 0:
            raise ValueError(f"epoch: expected an integer >= 0, found {epoch}")
        per_pass = self.iterations_per_pass
        self.next_iteration = self.first_iteration_of(epoch) if per_pass is None else epoch * per_pass
        self._read_ahead = False

    def _first_iteration_from(self, position: int) -> int:
        """The first iteration that starts at or after stream `position`."""
        if not self.drop_last:
            return max(0, -(-(position - self._origin) // self.global_batch_size))
        epoch, within = divmod(position, self.stream.num_samples)
        iteration = -(-within // self.global_batch_size)  # the grid's first iteration at or after the position
        if iteration >= self._iterations_per_epoch:
            epoch, iteration = epoch + 1, 0
        return epoch * self._iterations_per_epoch + iteration

    def begin_pass(self) -> None:
        """Where the next pass starts: back at the first iteration training has not reached where earlier passes
        handed out more (see `trained_position`); a position set by `set_position` or `set_epoch` since is kept.
        Iterating calls it; a wrapper that reads `next_iteration` before iterating calls it first."""
        if self._read_ahead and self.trained_position is not None:
            self.next_iteration = min(self.next_iteration, self._first_iteration_from(self.trained_position()))
        self._read_ahead = False

    def _pass_end(self) -> int:
        """The iteration after the last one of the pass that starts at `next_iteration`."""
        if self.iterations_per_pass is not None:
            return self.next_iteration + self.iterations_per_pass
        return self.first_iteration_of(self.epoch_of(self.next_iteration) + 1)

    def switch_plan(self, plan: Plan | PipelinePlan, *, from_position: int) -> None:
        """Train `plan`'s share for this rank from the iteration that starts at stream position `from_position` on.

        The plan re-balances the same global batch among the same ranks (a pipeline plan: pipelines; the
        iterations keep their places in the stream, every sample still used once), every rank at the same
        position, an iteration start at or after `generated_until` (what a DataLoader took cannot change).
        """
        b, s, offset = self._share(plan)
        if from_position < self.generated_until or (from_position - self._origin) % self.global_batch_size:
            raise ValueError(
                f"from_position: expected an iteration start at or after {self.generated_until}, found {from_position}"
            )
        self._splits.append((from_position, b, s, offset))
        self.micro_batch_size, self.gradient_accumulation_steps = b, s

    def restart_plan(self, plan: Plan | PipelinePlan) -> None:
        """Train `plan`'s share for this rank at every iteration, the switches scheduled before forgotten: what an
        engine that restores a checkpoint's position trains from there (its plan now; the switches of the run
        before the load, at positions the resumed stream reaches again, are not this run's)."""
        b, s, offset = self._share(plan)
        self._splits = [(0, b, s, offset)]
        self.micro_batch_size, self.gradient_accumulation_steps = b, s

    def _share(self, plan: Plan | PipelinePlan) -> tuple[int, int, int]:
        """``(b, s, offset)`` of this rank under `plan`; ValueError unless it splits this sampler's global batch
        among its ranks."""
        sizes, steps = plan_shares(plan)
        per_rank = [b * s for b, s in zip(sizes, steps)]
        if len(per_rank) != self._world_size or sum(per_rank) != self.global_batch_size:
            raise ValueError(
                f"plan: expected {self._world_size} ranks and the global batch {self.global_batch_size}, "
                f"found {len(per_rank)} ranks and {sum(per_rank)}"
            )
        return sizes[self.rank], steps[self.rank], rank_offsets(per_rank)[self.rank]

    def split(self, iteration: int) -> tuple[int, int, int]:
        """``(b, s, offset)`` of this rank in `iteration` under the plan that trains it: micro-batch size,
        micro-batches and where its chunk starts in the iteration (`micro_batch_size` and
        `gradient_accumulation_steps` are the last plan's already once a switch is scheduled)."""
        start = self.iteration_start(iteration)
        # The first split starts at position 0: some split always matches.
        return next((b, s, offset) for from_position, b, s, offset in reversed(self._splits) if from_position <= start)

    def micro_batches(self, iteration: int) -> list[list[int]]:
        """This rank's micro-batches in `iteration` (pure: depends only on the plans and their switch positions)."""
        b, s, offset = self.split(iteration)
        chunk = self.stream.indices(self.iteration_start(iteration) + offset, b * s)
        return [chunk[k * b : (k + 1) * b] for k in range(s)]

    def __iter__(self) -> Iterator[list[int]]:
        self.begin_pass()
        for iteration in range(self.next_iteration, self._pass_end()):
            # Read when the iteration begins, not when the pass does: a plan switch
            # (`switch_plan`) between iterations applies to the next one.
            batches = self.micro_batches(iteration)
            self.generated_until = max(self.generated_until, self.iteration_start(iteration) + self.global_batch_size)
            yield from batches[:-1]
            # Advanced before the last micro-batch is handed out: a consumer that
            # breaks right after it has finished the iteration.
            self.next_iteration, self._read_ahead = iteration + 1, True
            yield batches[-1]

    def iterations(self) -> Iterator[list[list[int]]]:
        """One pass an iteration at a time: each item is this rank's micro-batches of one iteration, with the
        bookkeeping of iterating the sampler (`generated_until`, `next_iteration`); a plan switch between
        iterations applies to the next one."""
        self.begin_pass()
        for iteration in range(self.next_iteration, self._pass_end()):
            batches = self.micro_batches(iteration)
            self.generated_until = max(self.generated_until, self.iteration_start(iteration) + self.global_batch_size)
            self.next_iteration, self._read_ahead = iteration + 1, True
            yield batches

    def iterations_in_pass(self) -> int:
        """Iterations in the next pass."""
        return self._pass_end() - self.next_iteration

    def __len__(self) -> int:
        """Micro-batches in the next pass."""
        first, end = self.next_iteration, self._pass_end()
        if len(self._splits) == 1:
            return (end - first) * self.gradient_accumulation_steps
        return sum(self.split(iteration)[1] for iteration in range(first, end))


class IterationSampler(torch.utils.data.Sampler[list[list[int]]]):
    """A `PlanBatchSampler` handed to a DataLoader an iteration at a time (a list of micro-batches each), so a loop
    counting items counts optimizer steps whatever the accumulation count, also across plan switches (the Hugging
    Face Trainer fixes its step count when it starts); the dataset takes lists (`MicroBatchesDataset`)."""

    def __init__(self, sampler: PlanBatchSampler) -> None:
        self.plan_sampler = sampler

    def __iter__(self) -> Iterator[list[list[int]]]:
        return self.plan_sampler.iterations()

    def __len__(self) -> int:
        return self.plan_sampler.iterations_in_pass()

    def set_epoch(self, epoch: int) -> None:
        """The plan sampler's `set_epoch` (a trainer that counts passes moves it)."""
        self.plan_sampler.set_epoch(epoch)


class MicroBatchesDataset(torch.utils.data.Dataset):
    """`dataset` read a micro-batch at a time: item ``indices`` is the list of those samples (with
    `IterationSampler` and a collate function per micro-batch, a DataLoader yields an iteration per item)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __getitem__(self, indices: list[int]) -> list[Any]:
        read_many = getattr(self.dataset, "__getitems__", None)  # Hugging Face datasets read rows in one call
        return list(read_many(indices)) if read_many else [self.dataset[i] for i in indices]

    def __len__(self) -> int:
        return len(self.dataset)


class IterationLoader:
    """A DataLoader of one rank's micro-batches, handed over an iteration at a time: before the first micro-batch
    of an iteration it calls ``before_iteration(micro_batches)`` (e.g. to agree on its label tokens)."""

    def __init__(
        self,
        loader: Any,
        *,
        micro_batches_per_iteration: int | Callable[[], int],
        before_iteration: Callable[[list[Any]], None],
    ) -> None:
        self.loader = loader
        self.micro_batches_per_iteration = micro_batches_per_iteration
        """A count, or a function that says it when an iteration begins (it follows plan switches)."""
        self.before_iteration = before_iteration

    def __iter__(self) -> Iterator[Any]:
        group: list[Any] = []
        size = 0
        for batch in self.loader:
            if not group:
                size = self.micro_batches_per_iteration
                size = size() if callable(size) else size
            group.append(batch)
            if len(group) == size:
                self.before_iteration(group)
                yield from group
                group = []
        assert not group, "a pass holds whole iterations"

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["loader"], name)


def check_plan_dataset(dataset: Any, what: str, *, otherwise: str = "give a map-style Dataset") -> None:
    """ValueError naming `what` unless `dataset` is map-style (or None): the plan's sampler cuts its indices."""
    if dataset is not None and (
        isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__")
    ):
        raise ValueError(
            f"{what}: expected a map-style dataset (with __len__ and __getitem__), found {type(dataset).__name__}, "
            "which has no indices to split: the plan's sampler cuts range(len(dataset)) into each rank's "
            f"micro-batches, of the plan's sizes; {otherwise}"
        )


def check_holds_global_batch(num_samples: int, global_batch_size: int, name: str) -> None:
    """ValueError naming `name` for a data set of fewer than `global_batch_size` samples."""
    if num_samples < global_batch_size:
        raise ValueError(
            f"{name}: expected at least the global batch ({global_batch_size} samples), found {num_samples}: "
            "one iteration would train some samples twice; use a larger data set or a smaller global batch"
        )


def plan_dataloader(
    training_data: Any,
    sampler: torch.utils.data.Sampler,
    *,
    collate_fn: Any,
    device: torch.device,
    num_workers: int = 0,
) -> torch.utils.data.DataLoader:
    """The training DataLoader of a plan's `sampler`; on CUDA its batches in pinned host memory, so that copying
    them to the GPU does not wait for a staging copy."""
    return torch.utils.data.DataLoader(
        training_data,
        batch_sampler=sampler,
        collate_fn=collate_fn,
        pin_memory=torch.device(device).type == "cuda",
        num_workers=num_workers,
    )
