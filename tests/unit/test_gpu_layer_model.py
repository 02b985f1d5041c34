"""The analytic model layer by layer (poplar_bench/gpu_layer_model.py): layer profiles and the two-level network."""

import pytest

from poplar_bench import gpu_layer_model, gpu_model
from poplar_ext.plan.pipeline_formats import layer_profile_from_dict, layer_profile_to_dict

SHAPE = gpu_model.model_shape("gpt2-xl-1.5b")
SPEC = gpu_model.gpu_spec("A100-80GB")


def test_the_layers_add_up_to_the_whole_model():
    profile = gpu_layer_model.modelled_layer_profile(SPEC, SHAPE)
    assert profile.num_layers == SHAPE.num_layers + 2
    assert [layer.name for layer in profile.layers[:2]] == ["Embedding", "Block"] and profile.layers[-1].name == "Head"
    for b in (1, 8, 64):
        layers = sum(next(s.step_time_s for s in x.samples if s.micro_batch_size == b) for x in profile.layers)
        whole = gpu_model.micro_step_time_s(SPEC, SHAPE, 0, 1, b, gpu_model.Assumptions())
        # The head's own vocabulary matrix adds its weight traffic; the position embedding does no matmul.
        assert layers == pytest.approx(whole, rel=0.01)
    static = sum(x.parameter_bytes + x.optimizer_state_bytes for x in profile.layers)
    assert static == 16 * (SHAPE.num_parameters + SHAPE.vocab_size * SHAPE.hidden_size)


def test_layer_profiles_are_labelled_modelled_and_read_back():
    (profile,) = gpu_layer_model.modelled_layer_profiles(["T4-16GB"], SHAPE)
    assert profile.source == "modelled" and profile.measured_with["model"] == gpu_layer_model.LAYER_MODEL_VERSION
    assert layer_profile_from_dict(layer_profile_to_dict(profile)) == profile
    with pytest.raises(ValueError, match=r"device_type: expected one of the modelled GPU types"):
        gpu_layer_model.modelled_layer_profiles(["MI300X"], SHAPE)


def test_the_two_level_network_keeps_the_whole_jobs_fit_and_adds_node_scopes():
    assumptions = gpu_model.Assumptions(network_bytes_per_s=1.25e9)
    network = gpu_layer_model.two_level_network(assumptions, gpus_per_node=8)
    assert network.collectives == gpu_model.modelled_network(assumptions).collectives
    assert network.scopes["within_node"].group_size == 8
    within = network.scopes["within_node"].collectives["all_gather"]
    between = network.scopes["between_nodes"].collectives["all_gather"]
    assert within.bus_bandwidth_bytes_per_s == gpu_layer_model.INTRA_NODE_BYTES_PER_S
    assert between.bus_bandwidth_bytes_per_s == 1.25e9 and network.source == "modelled"
