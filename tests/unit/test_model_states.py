"""The static memory estimate per ZeRO stage (search.model_states)."""

import pytest

from poplar_ext.search.model_states import cannot_hold, model_states, optimizer_state_bytes, shortfall

BILLION = 10**9


def test_matches_deepspeeds_zero2_estimator_for_fp16_adam():
    # estimate_zero2_model_states_mem_needs(cpu_offload=False): 2 * P + 18 * P / N.
    states = model_states(num_parameters=BILLION, zero_stage=2, world_size=4, dtype="float16")
    assert states.device_bytes == 2 * BILLION + 18 * BILLION // 4


def test_main_case_a_16gb_card_cannot_hold_a_1b_model_at_zero0_in_bf16():
    # 2 (bf16 weights) + 2 (grads) + 8 (Adam) + 8 (fp32 master and grads) bytes per parameter.
    states = model_states(num_parameters=BILLION, zero_stage=0, world_size=2, dtype="bfloat16")
    assert states.device_bytes == 20 * BILLION
    assert cannot_hold(states, capacity_bytes=16 * 2**30)
    assert not cannot_hold(states, capacity_bytes=80 * 2**30)


@pytest.mark.parametrize(
    ("stage", "expected_bytes"),
    # fp32 Adam, 4 ranks: 4 + 4 + 8 bytes per parameter, sharded stage by stage.
    [(0, 16_000), (1, 8_000 + 2_000), (2, 4_000 + 1_000 + 2_000), (3, 1_000 + 1_000 + 2_000)],
)
def test_each_stage_shards_one_more_part(stage, expected_bytes):
    states = model_states(num_parameters=1_000, zero_stage=stage, world_size=4, dtype="float32")
    assert states.device_bytes == expected_bytes


def test_offload_moves_the_optimizer_part_to_the_host():
    states = model_states(num_parameters=1_000, zero_stage=1, world_size=4, dtype="float32", optimizer_offload=True)
    assert (states.optimizer_bytes, states.device_bytes) == (0, 8_000)


def test_optimizer_type_from_the_config():
    assert optimizer_state_bytes({"optimizer": {"type": "AdamW"}}) == 8
    assert optimizer_state_bytes({"optimizer": {"type": "SGD"}}) == 4
    assert optimizer_state_bytes({}) == 8  # the script's own optimizer: counted as Adam


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="dtype: expected one of float32, bfloat16, float16, found 'int8'"):
        model_states(num_parameters=1, zero_stage=0, world_size=1, dtype="int8")
    with pytest.raises(ValueError, match="zero_stage: expected one of 0, 1, 2, 3, found 4"):
        model_states(num_parameters=1, zero_stage=4, world_size=1, dtype="float32")


def test_frozen_parameters_have_no_gradient_or_optimizer_state():
    states = model_states(
        num_parameters=1_000, num_trainable_parameters=100, zero_stage=0, world_size=1, dtype="float32"
    )
    assert (states.parameters_bytes, states.gradients_bytes, states.optimizer_bytes) == (4_000, 400, 800)


def test_shortfall_names_estimate_parts_and_capacity():
    states = model_states(num_parameters=2**30, zero_stage=0, world_size=1, dtype="float32")
    assert shortfall(states, capacity_bytes=8 * 2**30) == (
        "ZeRO stage 0 needs at least 16.0 GiB for the model states alone (parameters 4.0 GiB, gradients 4.0 GiB, "
        "optimizer 8.0 GiB), more than its memory of 8.0 GiB"
    )
