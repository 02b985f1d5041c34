"""The analytic GPU model (poplar_bench/gpu_model.py) and the shipped cluster files."""

import json

import pytest

from poplar_bench import cluster_files, example_profiles, gpu_model
from poplar_ext.plan.formats import cluster_from_dict, cluster_to_dict, profile_from_dict, profile_to_dict

SHAPE = gpu_model.model_shape("gpt2-xl-1.5b")
ASSUME = gpu_model.Assumptions()


def test_every_spec_is_named_once_and_has_a_datasheet():
    names = [s.name for s in gpu_model.GPU_SPECS]
    assert len(names) == len(set(names))
    assert {"A100-80GB", "A100-40GB", "V100-16GB", "V100S-32GB", "T4-16GB", "A800-80GB", "H100-80GB"} <= set(names)
    for spec in gpu_model.GPU_SPECS:
        assert "datasheet" in spec.datasheet and 0 < spec.mfu < 1


def test_unknown_gpu_type_is_a_value_error_listing_the_known_ones():
    with pytest.raises(
        ValueError, match=r"device_type: expected one of the modelled GPU types \(H100-80GB.*found 'RTX-9090'"
    ):
        gpu_model.gpu_spec("RTX-9090")


def test_unknown_model_preset_is_a_value_error():
    with pytest.raises(ValueError, match=r"model: expected one of the model presets .* found 'gpt-5'"):
        gpu_model.model_shape("gpt-5")


def test_bad_world_size_is_a_value_error():
    with pytest.raises(ValueError, match=r"world_size: expected an integer >= 1, found 0"):
        gpu_model.modelled_profile(gpu_model.gpu_spec("T4-16GB"), SHAPE, zero_stage=0, world_size=0)


def test_bad_stage_is_a_value_error():
    with pytest.raises(ValueError, match=r"zero_stage: expected 0, 1, 2 or 3, found 4"):
        gpu_model.state_bytes(10, 4, 2)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_modelled_profiles_are_valid_files_labelled_modelled(stage):
    profile = gpu_model.modelled_profile(gpu_model.gpu_spec("A100-40GB"), SHAPE, zero_stage=stage, world_size=16)
    data = json.loads(json.dumps(profile_to_dict(profile)))
    assert profile_from_dict(data) == profile
    assert profile.source == "modelled"
    assert data["measured_with"]["gpu_spec"]["name"] == "A100-40GB"
    assert data["measured_with"]["assumptions"]["network_bytes_per_s"] == ASSUME.network_bytes_per_s


@pytest.mark.parametrize("name", [s.name for s in gpu_model.GPU_SPECS])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_largest_micro_batch_fits_and_the_next_does_not(name, stage):
    spec = gpu_model.gpu_spec(name)
    largest = gpu_model.max_micro_batch_size(spec, SHAPE, stage, 64, ASSUME)
    if largest > 0:
        assert gpu_model.peak_memory_bytes(SHAPE, stage, 64, largest, ASSUME) <= spec.memory_capacity_bytes
    assert gpu_model.peak_memory_bytes(SHAPE, stage, 64, largest + 1, ASSUME) > spec.memory_capacity_bytes


def test_a_model_that_fits_nowhere_gets_an_empty_valid_profile():
    shape = gpu_model.model_shape("gpt3-6.7b")
    profile = gpu_model.modelled_profile(gpu_model.gpu_spec("T4-16GB"), shape, zero_stage=0, world_size=8)
    assert profile.max_micro_batch_size == 0 and profile.samples == ()
    assert profile_from_dict(profile_to_dict(profile)) == profile


def test_time_grows_with_batch_and_throughput_saturates():
    spec = gpu_model.gpu_spec("V100S-32GB")
    times = [gpu_model.micro_step_time_s(spec, SHAPE, 1, 8, b, ASSUME) for b in range(1, 9)]
    rates = [b / t for b, t in zip(range(1, 9), times)]
    assert all(a < b for a, b in zip(times, times[1:]))
    assert all(a < b for a, b in zip(rates, rates[1:]))
    ceiling = spec.peak_flops * spec.mfu / SHAPE.flops_per_sample
    assert rates[-1] < ceiling


def test_sharding_saves_memory_stage_by_stage():
    states = [gpu_model.state_bytes(1000, stage, 8) for stage in (0, 1, 2, 3)]
    assert states == sorted(states, reverse=True) and states[0] == 16000 and states[3] == 2000


def test_a_faster_gpu_is_modelled_faster():
    fast, slow = gpu_model.gpu_spec("A100-80GB"), gpu_model.gpu_spec("T4-16GB")
    assert gpu_model.micro_step_time_s(fast, SHAPE, 1, 8, 2, ASSUME) < gpu_model.micro_step_time_s(
        slow, SHAPE, 1, 8, 2, ASSUME
    )


def test_sample_sizes_are_increasing_and_end_at_the_largest():
    assert gpu_model.sample_sizes(0) == []
    assert gpu_model.sample_sizes(1) == [1]
    assert gpu_model.sample_sizes(12) == [1, 2, 4, 8, 12]
    assert gpu_model.sample_sizes(8) == [1, 2, 4, 8]


def test_shipped_cluster_files_are_what_the_generator_makes():
    expected = cluster_files.shipped_clusters()
    shipped = sorted(p.name for p in cluster_files.CLUSTER_DIR.glob("*.json"))
    assert shipped == sorted(expected)
    for name, cluster in expected.items():
        data = json.loads((cluster_files.CLUSTER_DIR / name).read_text())
        assert data == cluster_to_dict(cluster)
        assert cluster_from_dict(data) == cluster


def test_shipped_example_profiles_are_what_the_generator_makes(tmp_path):
    # profiles/README.md: the example profiles repeat the model that made them; regenerated, nothing changes.
    example_profiles.main(tmp_path)
    made = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.json"))
    shipped = sorted(p.relative_to(example_profiles.HERE).as_posix() for p in example_profiles.HERE.rglob("*.json"))
    assert made == shipped
    for name in made:
        assert json.loads((tmp_path / name).read_text()) == json.loads((example_profiles.HERE / name).read_text()), name


def test_pair_cluster_halves_and_node_layout():
    cluster = cluster_files.pair_cluster("A100-80GB", "A100-40GB", world_size=64)
    assert cluster.type_counts() == {"A100-80GB": 32, "A100-40GB": 32}
    assert all(sum(g.count for g in node.devices) == 8 for node in cluster.nodes)


def test_pair_cluster_rejects_an_odd_size():
    with pytest.raises(ValueError, match=r"world_size: expected an even integer >= 2, found 7"):
        cluster_files.pair_cluster("A100-80GB", "A100-40GB", world_size=7)


@pytest.mark.multiprocess
def test_the_generators_help_writes_nothing():
    # `python -m poplar_bench.example_profiles --help` once regenerated the shipped files over themselves.
    import subprocess
    import sys

    before = {p: p.stat().st_mtime_ns for p in example_profiles.HERE.rglob("*.json")}
    done = subprocess.run(
        [sys.executable, "-m", "poplar_bench.example_profiles", "--help"], capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, "--output-dir" in done.stdout) == (0, True), done.stderr
    assert {p: p.stat().st_mtime_ns for p in example_profiles.HERE.rglob("*.json")} == before


def test_activation_bytes_per_sample_with_and_without_checkpointing():
    from poplar_bench.gpu_model import model_shape

    shape = model_shape("gpt2-xl-1.5b")  # s 1024, h 1600, 48 layers, vocab 50257
    head = 10 * 1024 * 50257
    assert shape.activation_bytes_per_sample == 34 * 1024 * 1600 * 48 + head
    assert shape.checkpointed_activation_bytes_per_sample == 2 * 1024 * 1600 * 48 + 34 * 1024 * 1600 + head
    assert shape.kept_bytes_per_sample(False) == shape.activation_bytes_per_sample
    assert shape.kept_bytes_per_sample(True) == shape.checkpointed_activation_bytes_per_sample
