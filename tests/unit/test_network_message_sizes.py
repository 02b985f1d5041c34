"""The network is timed up to the largest bucket ZeRO sends, capped by memory."""

from __future__ import annotations

from poplar_ext.profiler.network import DEFAULT_MESSAGE_BYTES, message_sizes

GIB = 2**30


def test_default_buckets_in_bf16_on_a_16gb_card_reach_one_eighth_of_its_memory() -> None:
    # 5e8 elements x 2 bytes = 1 GB, under 16 GiB / 8.
    sizes = message_sizes({}, element_bytes=2, capacity_bytes=16 * GIB)
    assert sizes[: len(DEFAULT_MESSAGE_BYTES)] == DEFAULT_MESSAGE_BYTES
    assert sizes[-1] == 10**9
    assert sizes[len(DEFAULT_MESSAGE_BYTES) :] == (2**27, 2**29, 10**9)


def test_the_config_buckets_set_the_largest_message() -> None:
    config = {"zero_optimization": {"reduce_bucket_size": 2e7, "allgather_bucket_size": "auto"}}
    # "auto" is DeepSpeed's default (5e8), the larger of the two.
    assert message_sizes(config, element_bytes=4, capacity_bytes=80 * GIB)[-1] == 2 * 10**9
    small = {"zero_optimization": {"reduce_bucket_size": 1e6, "allgather_bucket_size": 1e6}}
    assert message_sizes(small, element_bytes=4, capacity_bytes=80 * GIB) == (2**12, 2**16, 2**20, 4 * 10**6)


def test_a_small_memory_caps_the_largest_message() -> None:
    assert message_sizes({}, element_bytes=4, capacity_bytes=512 * 2**20)[-1] == 64 * 2**20
