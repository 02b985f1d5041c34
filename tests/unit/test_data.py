"""Per-rank data: exactly once per epoch for any allocation, deterministic, resumable."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from poplar_ext.runtime.data import PlanBatchSampler, SampleStream, check_plan_dataset, rank_offsets

allocations = st.lists(
    st.tuples(st.integers(1, 7), st.integers(1, 4)), min_size=1, max_size=5
)  # (micro_batch_size, gradient_accumulation_steps) per rank


def _samplers(allocation, num_samples, seed=3, **options):
    sizes = [b for b, _ in allocation]
    steps = [s for _, s in allocation]
    return [
        PlanBatchSampler(
            num_samples=num_samples,
            micro_batch_sizes=sizes,
            gradient_accumulation_steps=steps,
            rank=r,
            seed=seed,
            **options,
        )
        for r in range(len(allocation))
    ]


def _iteration(samplers, iteration):
    """Sample indices of one iteration over all ranks, in stream order."""
    return [i for s in samplers for batch in s.micro_batches(iteration) for i in batch]


def test_rank_offsets():
    assert rank_offsets([6, 2, 4]) == [0, 6, 8]


@settings(max_examples=60, deadline=None)
@given(allocation=allocations, extra_samples=st.integers(0, 60), epochs=st.integers(1, 3))
def test_every_sample_exactly_once_per_epoch(allocation, extra_samples, epochs):
    num_samples = sum(b * s for b, s in allocation) + extra_samples  # at least one global batch
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
@given(allocation=allocations, extra_samples=st.integers(0, 40), stop=st.integers(0, 6), total=st.integers(1, 8))
def test_resume_continues_with_the_same_samples(allocation, extra_samples, stop, total):
    num_samples = sum(b * s for b, s in allocation) + extra_samples
    uninterrupted = [list(s) for s in _samplers(allocation, num_samples, iterations_per_pass=total + stop)]
    first = [list(s) for s in _samplers(allocation, num_samples, iterations_per_pass=stop)] if stop else None
    consumed = stop * sum(b * s for b, s in allocation)
    resumed = [
        list(s) for s in _samplers(allocation, num_samples, consumed_samples=consumed, iterations_per_pass=total)
    ]
    for rank, (_, s) in enumerate(allocation):
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


def test_a_position_under_another_global_batch_continues_the_stream():
    # Saved under a global batch of 4 after 1 iteration; resumed under 6: nothing skipped or repeated.
    (before,) = _samplers([(4, 1)], num_samples=20)
    first = next(iter(before))
    after, _ = _samplers([(3, 1), (3, 1)], num_samples=20, consumed_samples=4)
    assert after.consumed_samples == 4
    resumed = after.micro_batches(after.next_iteration)[0]
    assert resumed == after.stream.indices(4, 3) and not set(first) & set(resumed)


def test_drop_last_moves_an_off_grid_position_to_the_next_epoch():
    (sampler,) = _samplers([(4, 1)], num_samples=10, drop_last=True, consumed_samples=5)
    assert sampler.consumed_samples == 10
    with pytest.raises(ValueError, match=r"consumed_samples: expected a stream position \(an integer >= 0\), found -1"):
        sampler.set_position(-1)


def test_drop_last_continues_an_off_grid_position_at_the_next_iteration_of_its_epoch():
    """A resume under another global batch (12 then, 10 now) at position 12 of a 100-sample epoch: the grid's
    next iteration (20) starts, not the next epoch (which would skip 88 samples)."""
    (sampler,) = _samplers([(10, 1)], num_samples=100, drop_last=True)
    for position, start in ((12, 20), (20, 20), (90, 90), (91, 100), (112, 120)):
        sampler.set_position(position)
        assert (position, sampler.consumed_samples) == (position, start)


def test_rank_outside_the_allocation():
    with pytest.raises(ValueError, match="rank: expected 0..1, found 2"):
        PlanBatchSampler(num_samples=5, micro_batch_sizes=[1, 1], gradient_accumulation_steps=[1, 1], rank=2)


def test_allocation_lists_of_different_lengths():
    with pytest.raises(ValueError, match="one entry per rank in each, found 2 and 1"):
        PlanBatchSampler(num_samples=5, micro_batch_sizes=[1, 1], gradient_accumulation_steps=[1], rank=0)


def test_empty_data_set():
    with pytest.raises(ValueError, match="num_samples: expected an integer >= 1, found 0"):
        SampleStream(num_samples=0)


def test_a_data_set_smaller_than_the_global_batch_is_an_error():
    with pytest.raises(
        ValueError,
        match=r"num_samples: expected at least the global batch \(12 samples\), found 10: one iteration would train "
        r"some samples twice",
    ):
        _samplers([(3, 2), (2, 3)], num_samples=10)


def _pass(samplers):
    """One pass over every rank's loader, as indices in stream order, and the iterations it had."""
    per_rank = [list(s) for s in samplers]
    iterations = len(per_rank[0]) // samplers[0].gradient_accumulation_steps
    used = []
    for i in range(iterations):
        for rank, s in enumerate(samplers):
            steps = s.gradient_accumulation_steps
            used.extend(idx for batch in per_rank[rank][i * steps : (i + 1) * steps] for idx in batch)
    return used, iterations


@settings(max_examples=60, deadline=None)
@given(allocation=allocations, extra_samples=st.integers(0, 50), epochs=st.integers(1, 5))
def test_a_pass_over_the_loader_is_an_epoch(allocation, extra_samples, epochs):
    """`for epoch in range(E): for batch in loader:` trains E epochs, give or take part of one batch."""
    global_batch = sum(b * s for b, s in allocation)
    num_samples = global_batch + extra_samples
    samplers = _samplers(allocation, num_samples)
    stream = samplers[0].stream
    position = 0
    for epoch in range(epochs):
        expected_iterations = len(samplers[0]) // samplers[0].gradient_accumulation_steps
        used, iterations = _pass(samplers)
        assert iterations == expected_iterations  # len() announced the pass
        # The pass holds the iterations that start in this epoch ...
        assert epoch * num_samples <= position < (epoch + 1) * num_samples
        assert (
            (position + (iterations - 1) * global_batch)
            < (epoch + 1) * num_samples
            <= position + iterations * global_batch
        )
        assert used == stream.indices(position, iterations * global_batch)
        position += iterations * global_batch
    # ... so E passes end within one batch after E epochs.
    assert epochs * num_samples <= position < epochs * num_samples + global_batch


@settings(max_examples=60, deadline=None)
@given(allocation=allocations, extra_samples=st.integers(0, 50), epochs=st.integers(1, 4))
def test_drop_last_ends_every_pass_at_the_epoch_boundary(allocation, extra_samples, epochs):
    global_batch = sum(b * s for b, s in allocation)
    num_samples = global_batch + extra_samples
    samplers = _samplers(allocation, num_samples, drop_last=True)
    for epoch in range(epochs):
        used, iterations = _pass(samplers)
        assert iterations == num_samples // global_batch
        # Distinct samples, all from this epoch's order, from its start.
        order = samplers[0].stream.epoch_order(epoch).tolist()
        assert used == order[: iterations * global_batch]


def test_resuming_mid_epoch_finishes_that_epoch():
    (whole,) = _samplers([(2, 1)], num_samples=11)  # B = 2: epoch 0 has iterations 0..5 (5 starts at 10)
    assert len(whole) == 6
    (resumed,) = _samplers([(2, 1)], num_samples=11, consumed_samples=8)
    assert len(resumed) == 2 and list(resumed) == list(whole)[4:]
    assert len(resumed) == 5  # the next pass is epoch 1: iterations 6..10 (10 starts at 20 < 22)


def test_the_training_loader_pins_host_memory_for_a_gpu_only():
    import warnings

    from poplar_ext.runtime.data import plan_dataloader

    data = list(range(8))
    sampler = PlanBatchSampler(num_samples=8, micro_batch_sizes=[2, 2], gradient_accumulation_steps=[1, 1], rank=0)
    assert not plan_dataloader(data, sampler, collate_fn=None, device=torch.device("cpu")).pin_memory
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CPU-only torch warns that nothing can be pinned
        assert plan_dataloader(data, sampler, collate_fn=None, device=torch.device("cuda", 0)).pin_memory


class _SizedStream(torch.utils.data.IterableDataset):
    """A stream that knows its length but has no indices: the sampler cannot pick its samples."""

    def __iter__(self):
        yield from range(4)

    def __len__(self) -> int:
        return 4


@pytest.mark.parametrize("dataset", [_SizedStream(), iter(range(4))])
def test_a_dataset_without_indices_is_refused_naming_what_was_given_and_why(dataset):
    what = type(dataset).__name__
    with pytest.raises(
        ValueError, match=rf"^training_data: expected a map-style dataset .*, found {what}, "
    ) as refused:
        check_plan_dataset(dataset, "training_data", otherwise="give a list")
    assert "the plan's sampler cuts range(len(dataset)) into each rank's micro-batches" in str(refused.value)
    assert str(refused.value).endswith("; give a list")


@pytest.mark.parametrize("dataset", [None, [0, 1, 2], torch.utils.data.TensorDataset(torch.zeros(3))])
def test_a_map_style_dataset_or_none_passes(dataset):
    check_plan_dataset(dataset, "training_data")
