"""Per-rank data: exactly once per epoch for any allocation, deterministic, resumable."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from poplar_ext.runtime.data import PlanBatchSampler, SampleStream, rank_offsets

allocations = st.lists(
    st.tuples(st.integers(1, 7), st.integers(1, 4)), min_size=1, max_size=5
)  # (micro_batch_size, gradient_accumulation_steps) per rank


def _samplers(allocation, num_samples, seed=3, **options):
    sizes = [b for b, _ in allocation]
    steps = [s for _, s in allocation]
    return [
        PlanBatchSampler(
            num_samples=num_samples, micro_batch_sizes=sizes, gradient_accumulation_steps=steps, rank=r, seed=seed, **options
        )
        for r in range(len(allocation))
    ]


def _iteration(samplers, iteration):
    """Sample indices of one iteration over all ranks, in stream order."""
    return [i for s in samplers for batch in s.micro_batches(iteration) for i in batch]


def test_rank_offsets():
    assert rank_offsets([6, 2, 4]) == [0, 6, 8]


@settings(max_examples=60, deadline=None)
@given(allocation=allocations, num_samples=st.integers(1, 60), epochs=st.integers(1, 3))
def test_every_sample_exactly_once_per_epoch(allocation, num_samples, epochs):
    samplers = _samplers(allocation, num_samples)
    global_batch = samplers[0].global_batch_size
    used = []
    iteration = 0
    while len(used) < epochs * num_samples:
        used.extend(_iteration(samplers, iteration))
        iteration += 1
    for epoch in range(epochs):
        chunk = used[epoch * num_samples : (epoch + 1) * num_samples]
        assert sorted(chunk) == list(range(num_samples))
    # Every micro-batch is full: no remainder is dropped or padded.
    for s in samplers:
        assert all(len(b) == s.micro_batch_size for b in s.micro_batches(0))
    assert global_batch == sum(b * s for b, s in allocation)


@settings(max_examples=40, deadline=None)
@given(allocation=allocations, num_samples=st.integers(1, 40), stop=st.integers(0, 6), total=st.integers(1, 8))
def test_resume_continues_with_the_same_samples(allocation, num_samples, stop, total):
    uninterrupted = [list(s) for s in _samplers(allocation, num_samples, iterations_per_pass=total + stop)]
    first = [list(s) for s in _samplers(allocation, num_samples, iterations_per_pass=stop)] if stop else None
    consumed = stop * sum(b * s for b, s in allocation)
    resumed = [list(s) for s in _samplers(allocation, num_samples, consumed_samples=consumed, iterations_per_pass=total)]
    for rank, (b, s) in enumerate(allocation):
        head = first[rank] if first else []
        assert head + resumed[rank] == uninterrupted[rank]
        assert len(resumed[rank]) == total * s


def test_rank_yields_its_chunk_in_micro_batches():
    sampler = PlanBatchSampler(
        num_samples=100, micro_batch_sizes=[2, 3], gradient_accumulation_steps=[3, 1], rank=1, shuffle=False
    )
    assert sampler.micro_batches(0) == [[6, 7, 8]]
    assert sampler.micro_batches(2) == [[24, 25, 26]]
    assert len(sampler) == 12  # ceil(100 / 9) iterations of one micro-batch


def test_an_iteration_straddles_the_epoch_boundary():
    stream = SampleStream(num_samples=5, seed=1)
    window = stream.indices(3, 4)
    assert window[:2] == stream.epoch_order(0)[3:].tolist()
    assert window[2:] == stream.epoch_order(1)[:2].tolist()


def test_epochs_are_shuffled_differently_and_deterministically():
    a, b = SampleStream(num_samples=50, seed=7), SampleStream(num_samples=50, seed=7)
    assert a.epoch_order(0).tolist() == b.epoch_order(0).tolist()
    assert a.epoch_order(0).tolist() != a.epoch_order(1).tolist()
    assert SampleStream(num_samples=50, seed=8).epoch_order(0).tolist() != a.epoch_order(0).tolist()


def test_passes_continue_the_stream():
    (sampler,) = _samplers([(2, 2)], num_samples=10, iterations_per_pass=2)
    first, second = list(sampler), list(sampler)
    assert Counter(i for b in first + second[:1] for i in b) == Counter(range(10))
    assert sampler.consumed_samples == 16


def test_breaking_after_an_iteration_keeps_the_position():
    (sampler,) = _samplers([(2, 2)], num_samples=10)
    iterator = iter(sampler)
    next(iterator), next(iterator)
    assert sampler.consumed_samples == 4


def test_works_as_a_dataloader_batch_sampler():
    data = torch.arange(20).float()
    (sampler,) = _samplers([(4, 1)], num_samples=20, shuffle=False)
    batches = list(torch.utils.data.DataLoader(data, batch_sampler=sampler))
    assert [b.tolist() for b in batches[:2]] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_position_not_on_an_iteration_boundary():
    with pytest.raises(ValueError, match=r"consumed_samples: expected a non-negative multiple of the global batch \(6\), found 4"):
        _samplers([(3, 1), (3, 1)], num_samples=20, consumed_samples=4)


def test_rank_outside_the_allocation():
    with pytest.raises(ValueError, match="rank: expected 0..1, found 2"):
        PlanBatchSampler(num_samples=5, micro_batch_sizes=[1, 1], gradient_accumulation_steps=[1, 1], rank=2)


def test_allocation_lists_of_different_lengths():
    with pytest.raises(ValueError, match="one entry per rank in each, found 2 and 1"):
        PlanBatchSampler(num_samples=5, micro_batch_sizes=[1, 1], gradient_accumulation_steps=[1], rank=0)


def test_empty_data_set():
    with pytest.raises(ValueError, match="num_samples: expected an integer >= 1, found 0"):
        SampleStream(num_samples=0)
