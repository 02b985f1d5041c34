"""Layer profiles measured on the toy pipeline model: files the search loads, times that grow with the
micro-batch and with an emulated slowdown, memory from the parameters, boundary bytes from the output."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from poplar_ext.hardware.cpu_process import cpu_threads
from poplar_ext.models.toy_pipeline import mse, toy_batch, toy_layers
from poplar_ext.plan.formats import Emulation, ModelInfo
from poplar_ext.plan.pipeline_formats import load_layer_profiles
from poplar_ext.profiler.cache import (
    LayerProfileKey,
    find_cached_layer_profile,
    store_layer_profile,
)
from poplar_ext.profiler.layers import (
    LayerMeasurement,
    is_pipeline_model,
    layer_micro_batch_sizes,
    layer_profile,
    measure_layers,
    pipeline_layers,
)
from poplar_ext.profiler.measure import MeasureSettings
from poplar_ext.profiler.per_layer import optimizer_factory_from_config

DIM = 48
SIZES = (1, 32, 4096)  # far apart: the largest outlasts the smallest by ms, not by timer noise
NUM_LAYERS = 4


def _measure(slowdown: float = 1.0, *, optimizer: str = "SGD") -> list[dict]:
    params = {"lr": 0.1, "momentum": 0.9} if optimizer == "SGD" else {"lr": 1e-3}
    measurement = LayerMeasurement(
        make_batch=lambda b: toy_batch(b, dim=DIM),
        optimizer_factory=optimizer_factory_from_config({"optimizer": {"type": optimizer, "params": params}}),
        micro_batch_sizes=SIZES,
        warmup_micro_steps=1,
        repeats=3,
    )
    with cpu_threads(1):
        return measure_layers(
            pipeline_layers(toy_layers(dim=DIM, num_layers=NUM_LAYERS), loss_fn=mse), measurement, slowdown=slowdown
        )


@pytest.fixture(scope="module")
def costs() -> tuple[list[dict], list[dict]]:
    return _measure(), _measure(3.0)


def _total_time(costs: list[dict], size: int) -> float:
    return sum(s["step_time_s"] for c in costs for s in c["samples"] if s["micro_batch_size"] == size)


def _profile(costs: list[dict], emulation: Emulation | None = None, stage: int = 0):
    return layer_profile(
        costs,
        device_type="cpu-slow" if emulation else "cpu",
        zero_stage=stage,
        memory_capacity_bytes=2 * 10**9,
        base_memory=10**8,
        model=ModelInfo(name="toy", fingerprint="sha256:abc", num_parameters=1000, dtype="float32"),
        emulation=emulation,
        provenance={"torch": torch.__version__, "deepspeed": "0.19.8", "ds_config_fingerprint": "sha256:cfg"},
    )


def test_memory_figures_follow_the_parameters_and_boundary_bytes_the_output(costs) -> None:
    plain, _ = costs
    assert [c["name"] for c in plain] == ["Block"] * (NUM_LAYERS - 1) + ["Linear"]
    block, head = plain[0], plain[-1]
    assert block["parameter_bytes"] == 4 * (DIM * DIM + DIM)
    assert head["parameter_bytes"] == 4 * (DIM + 1)
    # SGD with momentum: a gradient and a momentum buffer per parameter.
    assert block["optimizer_state_bytes"] == 2 * block["parameter_bytes"]
    # A block's output is DIM floats per sample, the head's one.
    assert block["output_bytes_per_sample"] == 4 * DIM
    assert head["output_bytes_per_sample"] == 4
    # A block keeps its input (for the linear) and its output (for tanh); the head its input and the loss's
    # difference.
    assert block["activation_bytes_per_sample"] == 2 * 4 * DIM
    assert head["activation_bytes_per_sample"] == 4 * DIM + 4


def test_adam_state_is_two_moments_per_parameter() -> None:
    adam = _measure(optimizer="Adam")
    block = adam[0]
    gradients_and_moments = 3 * block["parameter_bytes"]
    # Plus torch's per-tensor step counters (one scalar per parameter tensor).
    assert gradients_and_moments <= block["optimizer_state_bytes"] <= gradients_and_moments + 2 * 8


def test_times_grow_with_the_micro_batch(costs) -> None:
    plain, _ = costs
    for layer in plain[:-1]:
        times = [s["step_time_s"] for s in layer["samples"]]
        assert times[-1] > times[0], layer


def test_an_emulated_slowdown_multiplies_every_time(monkeypatch) -> None:
    # A clock that reads the same for every block, so that the factor is seen alone: two real
    # measurements of a micro-second layer differ by more than any bound a slowdown test could use.
    import poplar_ext.profiler.layers as layers_module

    def steady_clock(device, run):
        run()
        return 1e-3

    monkeypatch.setattr(layers_module, "time_compute", steady_clock)
    plain, slowed = _measure(), _measure(3.0)
    for plain_layer, slowed_layer in zip(plain, slowed, strict=True):
        for plain_sample, slowed_sample in zip(plain_layer["samples"], slowed_layer["samples"], strict=True):
            assert slowed_sample["step_time_s"] == pytest.approx(3.0 * plain_sample["step_time_s"])
        assert slowed_layer["optimizer_step_time_s"] == pytest.approx(3.0 * plain_layer["optimizer_step_time_s"])


def test_the_timing_names_the_emulated_slowdown_on_emulated_types_alone(costs) -> None:
    plain, _ = costs
    clock = "each layer alone: forward + backward by the compute clock"
    assert _profile(plain).measured_with["timing"] == f"{clock}, median"  # a real device: the clock's times
    emulated = _profile(plain, Emulation(slowdown=3.0, memory_capacity_bytes=2 * 10**9))
    assert emulated.measured_with["timing"] == f"{clock} (x the emulated slowdown), median"


def test_profiles_are_written_to_layers_and_load_and_are_found_by_their_key(costs, tmp_path) -> None:
    emulation = Emulation(slowdown=3.0, memory_capacity_bytes=2 * 10**9)
    for stage in (0, 1):
        store_layer_profile(tmp_path, _profile(costs[0], stage=stage))
        store_layer_profile(tmp_path, _profile(costs[1], emulation, stage=stage))
    loaded = load_layer_profiles(tmp_path)
    assert sorted((p.device_type, p.zero_stage) for p in loaded) == [
        ("cpu", 0),
        ("cpu", 1),
        ("cpu-slow", 0),
        ("cpu-slow", 1),
    ]
    slow = next(p for p in loaded if p.device_type == "cpu-slow" and p.zero_stage == 0)
    assert slow.measured_with["device"] == "emulated" and slow.emulated == emulation
    assert slow.num_layers == NUM_LAYERS
    key = LayerProfileKey.of_profile(slow)
    assert find_cached_layer_profile(tmp_path, key) == slow
    assert find_cached_layer_profile(tmp_path, dataclasses.replace(key, micro_batch_sizes=(1, 2))) is None
    # Stored again, it replaces its file instead of adding one the search would refuse.
    store_layer_profile(tmp_path, _profile(costs[0], stage=0))
    assert len(load_layer_profiles(tmp_path)) == 4


def test_a_layer_profile_timed_over_fewer_micro_steps_than_asked_is_measured_again(costs, tmp_path) -> None:
    profile = _profile(costs[0])
    recorded = {**profile.measured_with, "warmup_micro_steps": 1, "repeats": 3}  # as profile_layers records them
    store_layer_profile(tmp_path, dataclasses.replace(profile, measured_with=recorded))
    key = LayerProfileKey.of_profile(profile)
    for settings, found in [({}, True), ({"repeats": 5}, False), ({"warmup_micro_steps": 2}, False)]:
        asked = MeasureSettings(**settings)
        assert (find_cached_layer_profile(tmp_path, key, settings=asked) is not None) is found, settings


@pytest.mark.parametrize(
    ("dtype", "recorded", "reused"),
    [("bfloat16", None, False), ("bfloat16", "bfloat16", True), ("float32", None, True)],
)
def test_a_half_precision_layer_profile_timed_in_fp32_is_measured_again(
    costs, tmp_path, dtype, recorded, reused
) -> None:
    # Before layers ran in the job's dtype, a bf16 job's layer profiles were timed in fp32 and record no
    # measured_dtype: the cache must not hand them to a bf16 job. An fp32 job's older ones stand.
    from poplar_ext.profiler.cache import JobKey

    profile = _profile(costs[0])
    model = dataclasses.replace(profile.model, dtype=dtype)
    measured_with = {**profile.measured_with, **({"measured_dtype": recorded} if recorded else {})}
    store_layer_profile(tmp_path, dataclasses.replace(profile, model=model, measured_with=measured_with))
    stored = load_layer_profiles(tmp_path)[0]
    job = JobKey(
        model_fingerprint="sha256:abc",
        emulations={"cpu": None},
        world_size=2,
        dtype=dtype,
        sequence_length=None,
        torch_version=torch.__version__,
        deepspeed_version="0.19.8",
        ds_config_fingerprint="sha256:cfg",
    )
    key = job.layer_key("cpu", 0, LayerProfileKey.of_profile(stored).micro_batch_sizes)
    assert key.measured_dtype == dtype
    assert (find_cached_layer_profile(tmp_path, key) is not None) is reused
    assert job.holds(stored) is reused


def test_what_is_a_pipeline_model_and_which_sizes_are_timed() -> None:
    assert is_pipeline_model(toy_layers())
    assert not is_pipeline_model(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="PipelineModule"):
        pipeline_layers(torch.nn.Linear(2, 2))
    assert layer_micro_batch_sizes(None, 256)[-1] == 64
    assert layer_micro_batch_sizes(None, 5) == (1, 2, 3, 4, 5)
    assert layer_micro_batch_sizes((4, 2), 256) == (2, 4)
    assert layer_micro_batch_sizes((512, 2, 8), 4) == (2,), "--max-micro-batch-size holds given sizes too"
    with pytest.raises(
        ValueError, match=r"--micro-batch-sizes: expected a size of at most --max-micro-batch-size \(4\)"
    ):
        layer_micro_batch_sizes((8, 16), 4)
    with pytest.raises(ValueError, match="optimizer.type"):
        optimizer_factory_from_config({"optimizer": {"type": "Lamb"}})


def _measure_model(model, batch) -> list[dict]:
    measurement = LayerMeasurement(
        make_batch=lambda b: batch(b),
        optimizer_factory=optimizer_factory_from_config({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}),
        micro_batch_sizes=(1, 2),
        warmup_micro_steps=0,
        repeats=1,
    )
    with cpu_threads(1):
        return measure_layers(pipeline_layers(model), measurement)


def test_callable_layers_are_profiled_as_deepspeed_runs_them() -> None:
    # DeepSpeedExamples' AlexNet pipeline: a lambda between the convolutions and the classifier.
    layers = [torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), lambda x: torch.flatten(x, 1), torch.nn.Linear(4 * 6 * 6, 10)]
    assert is_pipeline_model(layers)
    costs = _measure_model(layers, lambda b: torch.randn(b, 3, 8, 8))
    assert [c["name"] for c in costs] == ["Conv2d", "ReLU", "<lambda>", "Linear"]
    assert costs[2]["parameter_bytes"] == 0 and costs[2]["optimizer_state_bytes"] == 0
    assert costs[2]["output_bytes_per_sample"] == 4 * 6 * 6 * 4


def test_in_place_activations_are_profiled() -> None:
    # torchvision's AlexNet: ReLU(inplace=True) right after a layer boundary.
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(inplace=True), torch.nn.Linear(8, 2))
    costs = _measure_model(model, lambda b: torch.randn(b, 8))
    assert [c["name"] for c in costs] == ["Linear", "ReLU", "Linear"]
    assert all(s["step_time_s"] > 0 for c in costs for s in c["samples"])


def test_a_layer_that_is_not_one_is_named_with_its_index() -> None:
    expected = r"model: layer 1: expected a LayerSpec, an nn.Module or a callable.*found int"
    with pytest.raises(ValueError, match=expected):
        pipeline_layers([torch.nn.Linear(2, 2), 3])


def test_tied_layers_are_profiled_each_use_with_the_tied_module() -> None:
    # A tied embedding and head (causal_lm_layers of GPT-2): each stage holding a use holds the module.
    from deepspeed.pipe import TiedLayerSpec

    def head(module, hidden):
        return torch.nn.functional.linear(hidden, module.weight)

    layers = [
        TiedLayerSpec("embed", torch.nn.Embedding, 10, 4),
        torch.nn.Linear(4, 4),
        TiedLayerSpec("embed", torch.nn.Embedding, 10, 4, forward_fn=head),
    ]
    assert is_pipeline_model(layers)
    costs = _measure_model(layers, lambda b: torch.randint(0, 10, (b, 3)))
    assert [c["name"] for c in costs] == ["Embedding (tied)", "Linear", "Embedding (tied)"]
    assert costs[0]["parameter_bytes"] == costs[2]["parameter_bytes"] == 10 * 4 * 4
    assert costs[2]["output_bytes_per_sample"] == 3 * 10 * 4  # the head's logits


def _one_step_of_4_to_2(optimizer: dict, **changes) -> LayerMeasurement:
    """One timed micro-step of size 1 on (4 inputs, 2 targets) with the DeepSpeed `optimizer` section."""
    return LayerMeasurement(
        make_batch=lambda b: (torch.randn(b, 4), torch.randn(b, 2)),
        optimizer_factory=optimizer_factory_from_config({"optimizer": optimizer}),
        micro_batch_sizes=(1,),
        warmup_micro_steps=0,
        repeats=1,
        **changes,
    )


def test_layers_are_measured_in_the_jobs_dtype_with_fp32_master_copies() -> None:
    # A bf16 job's layer profiles were labelled bfloat16 but measured in fp32 (the layers as built), about 22%
    # slower for a tiny GPT-2 block on a CPU, far more on a GPU's bf16 units; memory counted fp32 weights.
    seen = []

    class Recording(torch.nn.Linear):
        def forward(self, x):
            seen.append((x.dtype, self.weight.dtype))
            return super().forward(x)

    model = [Recording(4, 4), torch.nn.Linear(4, 2)]
    before = [p.detach().clone() for layer in model for p in layer.parameters()]
    figures = {}
    for dtype in (torch.float32, torch.bfloat16):
        measurement = _one_step_of_4_to_2({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, dtype=dtype)
        with cpu_threads(1):
            figures[dtype] = measure_layers(pipeline_layers(model, loss_fn=mse), measurement)
    assert seen[0] == (torch.float32, torch.float32) and seen[-1] == (torch.bfloat16, torch.bfloat16)
    n = 4 * 4 + 4  # the first layer's parameters
    full, half = figures[torch.float32][0], figures[torch.bfloat16][0]
    assert (full["parameter_bytes"], half["parameter_bytes"]) == (4 * n, 2 * n)
    # fp32: gradients and momentum; bf16: the layer's bf16 gradients, the fp32 masters, their gradients, momentum
    assert (full["optimizer_state_bytes"], half["optimizer_state_bytes"]) == (8 * n, 14 * n)
    assert all(torch.equal(p, b) for p, b in zip((p for layer in model for p in layer.parameters()), before))


def test_measuring_layers_leaves_the_models_own_modules_as_they_were() -> None:
    # causal_lm_layers hands the model's modules over; AdamW's decay would move them at a step.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    before = [p.detach().clone() for p in model.parameters()]
    measurement = _one_step_of_4_to_2({"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.5}})
    with cpu_threads(1):
        measure_layers(pipeline_layers(list(model), loss_fn=mse), measurement)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"repeats": 0}, "repeats: expected an integer >= 1, found 0"),
        ({"micro_batch_sizes": [0, 2]}, r"micro_batch_sizes: expected a non-empty list of integers >= 1"),
        ({"zero_stages": [0, 7]}, r"zero_stages: expected distinct stages among 0, 1, 2, 3, found \[0, 7\]"),
    ],
)
def test_a_pipeline_models_options_are_checked_as_any_models(tmp_path, bad, message) -> None:
    """profile_model checks its arguments before measuring, for a pipeline model too (not a StatisticsError
    or a ZeroDivisionError from inside the layer timing, nor a stage 7 silently left out)."""
    with pytest.raises(ValueError, match=message):
        _profile_toy_layers(tmp_path, **{"zero_stages": (0,), **bad})


def _profile_toy_layers(cache_dir, **options):
    """`profile_model` of a two-layer pipeline model with `options`."""
    from poplar_ext.profiler import profile_model

    return profile_model(
        model_factory=lambda: toy_layers(dim=8, num_layers=2),
        make_batch=lambda b: toy_batch(b, dim=8),
        loss_fn=mse,
        ds_config={"optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
        cache_dir=cache_dir,
        measure_network=False,
        progress=None,
        **options,
    )


class _Outputs(dict):
    """A dict subclass a layer returns (as a BatchEncoding or a ModelOutput is)."""


class _DictBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: dict) -> dict:
        return _Outputs(h=torch.relu(self.lin(x["h"])))


def test_a_layer_passing_a_dict_gets_it_as_it_was_returned() -> None:
    # Layer profiling walks tuples and lists only (as it always has): a dict between layers, and the batch's
    # dict, reach the next layer untouched: the same object, its type kept, its tensors neither made leaves
    # nor detached.
    batch = {"h": torch.randn(2, 4)}
    seen = []

    def spy(x):
        seen.append((x, x["h"].requires_grad, x["h"].grad_fn))
        return x

    measurement = LayerMeasurement(
        make_batch=lambda b: (batch, None),
        optimizer_factory=lambda parameters: torch.optim.SGD(parameters, lr=0.1),
        micro_batch_sizes=(2,),
        warmup_micro_steps=0,
        repeats=1,
    )
    measure_layers(pipeline_layers([spy, _DictBlock(), spy, lambda x: x["h"]]), measurement)
    (first, first_grad, _), (between, _, grad_fn) = seen
    assert first is batch and not first_grad
    assert type(between) is _Outputs and "Relu" in grad_fn.name()


def test_a_layer_that_fails_is_named_with_what_it_got_and_a_batch_that_is_no_pair_says_what_is_expected() -> None:
    # A Hugging Face style batch (a dict) for causal_lm_layers: every rank stopped with a traceback ending in
    # "TypeError: embedding(): argument 'indices' (position 2) must be Tensor, not dict", no layer, no --batch.
    layers = [torch.nn.Embedding(16, 4), torch.nn.Linear(4, 16)]
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(TypeError) as error:  # its own type: a user's error on every rank (poplar_ext.elastic)
        _measure_model(layers, lambda b: {"input_ids": ids[:b], "labels": ids[:b]})
    message = str(error.value)
    assert message.startswith("layer 0 (Embedding): embedding(): ")
    assert message.endswith(
        "; its input: a dict with keys input_ids, labels; the batch (make_batch, poplar-profile's --batch) is a dict "
        "with keys input_ids, labels: expected (inputs, labels), the first layer's input and the loss's labels"
    )
    assert isinstance(error.value.__cause__, TypeError)
    # A pair whose layer fails deeper: the layer and its input, no word of the batch.
    with pytest.raises(RuntimeError) as error:
        _measure_model([torch.nn.Embedding(16, 4), torch.nn.Linear(5, 16)], lambda b: (ids[:b], ids[:b]))
    assert str(error.value).startswith("layer 1 (Linear): mat1 and mat2 shapes cannot be multiplied")
    assert str(error.value).endswith("; its input: a tensor of shape (1, 3, 4) float32")


def test_stages_and_sizes_given_as_generators_reach_the_layer_profiles(tmp_path, monkeypatch) -> None:
    # The argument check read them first: layer profiling then saw both empty.
    import poplar_ext.profiler.api as api
    import poplar_ext.profiler.per_layer as per_layer

    seen = {}

    def profile_layers(options, **kwargs):
        seen.update(zero_stages=list(options.zero_stages), micro_batch_sizes=list(options.micro_batch_sizes))

    monkeypatch.setattr(api, "join_job", lambda: torch.device("cpu"))
    monkeypatch.setattr(api, "process_group_rank", lambda: (0, 1))
    monkeypatch.setattr(per_layer, "profile_layers", profile_layers)
    profiled = _profile_toy_layers(tmp_path, zero_stages=(s for s in (0, 1)), micro_batch_sizes=(b for b in (1, 2)))
    assert profiled == []
    assert seen == {"zero_stages": [0, 1], "micro_batch_sizes": [1, 2]}
