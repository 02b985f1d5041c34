"""What the profiler hands DeepSpeed: per-stage configs, the dtype, the optimizer of the automatic mode."""

from __future__ import annotations

import pytest
import torch

from poplar_ext.profiler import training_dtype
from poplar_ext.profiler.auto import missing_profiles_measurer, sequence_length_of
from poplar_ext.profiler.measure import MeasureSettings, default_loss, move_to_device, stage_ds_config

USER_CONFIG = {
    "train_batch_size": 96,
    "gradient_accumulation_steps": 4,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 1, "overlap_comm": True},
    "memory_breakdown": True,
    "poplar": {"cluster": "c.json"},
}


def test_stage_config_sets_the_stage_and_nominal_batches_and_keeps_the_rest() -> None:
    config = stage_ds_config(USER_CONFIG, zero_stage=3, world_size=4)
    assert config["zero_optimization"] == {"stage": 3, "overlap_comm": True}
    assert (
        config["train_batch_size"]
        == config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * 4
    )
    assert config["bf16"] == {"enabled": True}
    assert config["memory_breakdown"] is False, "it would reset the CUDA peak counters"
    assert "poplar" not in config
    assert USER_CONFIG["zero_optimization"]["stage"] == 1, "the caller's config is not modified"


@pytest.mark.parametrize(
    ("config", "dtype"),
    [
        ({}, "float32"),
        ({"bf16": {"enabled": True}}, "bfloat16"),
        ({"fp16": {"enabled": True}}, "float16"),
        ({"fp16": {"enabled": False}}, "float32"),
    ],
)
def test_training_dtype(config, dtype) -> None:
    assert training_dtype(config) == dtype


def test_settings_reject_bad_values() -> None:
    with pytest.raises(ValueError, match="repeats: expected an integer >= 1, found 0"):
        MeasureSettings(repeats=0)
    with pytest.raises(ValueError, match=r"micro_batch_sizes: expected a non-empty list of integers >= 1, found \[0\]"):
        MeasureSettings(micro_batch_sizes=(0,))


def test_batches_reach_the_model_as_tensor_tuple_or_dict() -> None:
    calls = []

    def engine(*args, **kwargs):
        calls.append((len(args), sorted(kwargs)))
        return torch.zeros(())

    default_loss(engine, torch.ones(2))
    default_loss(engine, (torch.ones(2), torch.ones(2)))
    default_loss(engine, {"x": torch.ones(2)})
    assert calls == [(1, []), (2, []), (0, ["x"])]
    moved = move_to_device({"a": [torch.ones(1)], "b": 3}, torch.device("cpu"))
    assert moved["b"] == 3 and moved["a"][0].device.type == "cpu"


def test_automatic_mode_needs_an_optimizer() -> None:
    with pytest.raises(ValueError, match="poplar: profiling the missing profiles needs an optimizer"):
        missing_profiles_measurer(
            model=torch.nn.Linear(2, 1),
            training_data=[torch.ones(2)],
            collate_fn=None,
            optimizer=None,
            ds_config={},
            profiles_dir="p",
            micro_batch_size_limit=8,
        )


def test_automatic_mode_needs_training_samples() -> None:
    with pytest.raises(ValueError, match="training_data: expected at least one sample"):
        missing_profiles_measurer(
            model=torch.nn.Linear(2, 1),
            training_data=[],
            collate_fn=None,
            optimizer=None,
            ds_config={"optimizer": {"type": "SGD"}},
            profiles_dir="p",
            micro_batch_size_limit=8,
        )


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.2, betas=(0.8, 0.9)),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.RMSprop(p, lr=0.01, alpha=0.9),
    ],
    ids=["adamw", "sgd", "rmsprop"],
)
def test_automatic_mode_builds_the_users_kind_of_optimizer_with_its_settings(make) -> None:
    from poplar_ext.profiler.auto import _optimizer_factory

    users = make(torch.nn.Linear(2, 2).parameters())
    copy = _optimizer_factory(users, {})(torch.nn.Linear(2, 2).parameters())
    assert type(copy) is type(users)
    assert copy.defaults == users.defaults


def test_profile_model_takes_the_profile_options_fields_with_their_defaults() -> None:
    # One source for the defaults: profile_model's keywords are ProfileOptions' fields, and
    # the measurement's settings start from the same values.
    import dataclasses
    import inspect

    from poplar_ext.profiler import ProfileOptions, profile_model

    parameters = inspect.signature(profile_model).parameters
    fields = dataclasses.fields(ProfileOptions)
    assert list(parameters) == [f.name for f in fields]
    for f in fields:
        assert parameters[f.name].kind is inspect.Parameter.KEYWORD_ONLY
        assert parameters[f.name].default == (
            inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        )
    settings = MeasureSettings()
    for name in ("warmup_micro_steps", "repeats", "micro_batch_size_limit", "micro_batch_sizes"):
        assert getattr(settings, name) == getattr(ProfileOptions, name, None)


def test_automatic_mode_keys_stored_profiles_as_the_profiler_does() -> None:
    # One definition: a stored profile of another optimizer (the script's or the config's) is not the job's.
    from poplar_bench.synthetic import simple_cluster
    from poplar_ext.profiler.cache import client_optimizer, ds_config_fingerprint
    from poplar_ext.profiler.fingerprint import model_fingerprint

    model, cluster = torch.nn.Linear(2, 1), simple_cluster({"fast": 1, "slow": 2})
    jobs = {
        "sgd": (torch.optim.SGD(model.parameters(), lr=0.1), {"bf16": {"enabled": True}}),
        "sgd momentum": (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), {"bf16": {"enabled": True}}),
        "adamw": (torch.optim.AdamW(model.parameters(), lr=0.1), {"bf16": {"enabled": True}}),
        "config's": (None, {"bf16": {"enabled": True}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}),
    }
    fingerprints = set()
    for optimizer, config in jobs.values():
        measure = missing_profiles_measurer(
            model=model,
            training_data=[torch.ones(2)],
            collate_fn=None,
            optimizer=optimizer,
            ds_config=config,
            profiles_dir="p",
            micro_batch_size_limit=8,
        )
        key = measure.profiles_key(cluster).key("slow", 1)
        # A stored profile a lower limit stopped is not the job's: it probes up to its own (`JobKey.holds`).
        assert measure.profiles_key(cluster).settings.micro_batch_size_limit == 8
        client = None if optimizer is None else client_optimizer(lambda p, o=optimizer: o)  # the script's settings
        assert key.ds_config_fingerprint == ds_config_fingerprint(config, client)
        assert (key.model_fingerprint, key.world_size, key.dtype) == (model_fingerprint(model), 3, "bfloat16")
        fingerprints.add(key.ds_config_fingerprint)
    assert len(fingerprints) == len(jobs)


def test_automatic_mode_keys_profiles_with_the_datas_sequence_length() -> None:
    # Keyed without one, a job on 64-token samples took the profiles measured on 8-token ones.
    from poplar_bench.synthetic import simple_cluster
    from poplar_ext.models.toy_gpt import GPT, GPTConfig, SyntheticTokens

    model, cluster = GPT(GPTConfig(sequence_length=64)), simple_cluster({"fast": 1, "slow": 1})
    keys = {}
    for tokens in (8, 64):
        measure = missing_profiles_measurer(
            model=model,
            training_data=SyntheticTokens(num_samples=2, sequence_length=tokens, vocab_size=256),
            collate_fn=None,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            ds_config={},
            profiles_dir="p",
            micro_batch_size_limit=8,
        )
        keys[tokens] = measure.profiles_key(cluster).key("slow", 1)
    assert (keys[8].sequence_length, keys[64].sequence_length) == (8, 64)


@pytest.mark.parametrize(
    ("batch", "tokens"),
    [
        (torch.zeros(1, 17, dtype=torch.long), 16),  # the built-in GPT's: 16 inputs and the last one's target
        ({"input_ids": torch.zeros(1, 12, dtype=torch.long), "labels": torch.zeros(1, 12, dtype=torch.long)}, 12),
        ((torch.zeros(1, 9, dtype=torch.int32), torch.zeros(1, 9, dtype=torch.long)), 9),
        (torch.zeros(1, 4), None),  # no token ids: not a sequence model
        ((torch.zeros(1, 4), torch.zeros(1, 1)), None),
        ({"pixel_values": torch.zeros(1, 3, 8, 8)}, None),
    ],
)
def test_the_sequence_length_is_read_from_a_micro_batch(batch, tokens) -> None:
    assert sequence_length_of(batch) == tokens


@pytest.mark.parametrize("force", [False, True])
def test_the_automatic_measurer_returns_every_profile_it_measured_at_the_stage(monkeypatch, force) -> None:
    # profile_model also measures again (and stores over) the other types' profiles its cache refuses, and
    # with force all of them: the planner's copies of those must be replaced, not kept beside a newer file.
    import poplar_ext.profiler
    from poplar_bench.synthetic import simple_cluster, synthetic_profile

    def profile_model(**options):
        stages = options["zero_stages"]
        return [
            synthetic_profile(t, zero_stage=s, max_micro_batch_size=4, overhead_s=0.001, seconds_per_sample=0.001)
            for s in stages
            for t in ("fast", "slow")
        ]

    monkeypatch.setattr(poplar_ext.profiler, "profile_model", profile_model)
    model = torch.nn.Linear(2, 1)
    measure = missing_profiles_measurer(
        model=model,
        training_data=[torch.ones(2)],
        collate_fn=None,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        ds_config={},
        profiles_dir="p",
        micro_batch_size_limit=8,
    )
    measured = measure([("slow", 1)], simple_cluster({"fast": 1, "slow": 1}), force=force)
    assert sorted((p.device_type, p.zero_stage) for p in measured) == [("fast", 1), ("slow", 1)]


def test_the_loss_in_a_models_output_and_an_error_as_every_rank_receives_it() -> None:
    from types import SimpleNamespace

    from poplar_ext.profiler.measure import described_error, loss_of

    loss = torch.tensor(2.0)
    assert loss_of(SimpleNamespace(loss=loss)) is loss  # Hugging Face's output
    assert loss_of({"loss": loss, "logits": torch.ones(2)}) is loss
    assert loss_of(loss) is loss
    assert described_error(ValueError("bad batch")) == ("ValueError: bad batch", ValueError)
    assert described_error(OSError("lost peer")) == ("OSError: lost peer", None)


def test_the_ranks_of_each_node_in_rank_order() -> None:
    from types import SimpleNamespace

    from poplar_ext.plan.formats import Cluster, ClusterNode, DeviceGroup
    from poplar_ext.profiler.network import node_ranks

    def node(name: str, *counts: int) -> ClusterNode:
        return ClusterNode(name=name, devices=tuple(DeviceGroup(device_type=f"t{c}", count=c) for c in counts))

    cluster = Cluster(nodes=(node("a", 2, 1), node("b", 1), node("c", 2)))
    assert node_ranks(SimpleNamespace(cluster=cluster)) == [[0, 1, 2], [3], [4, 5]]


@pytest.mark.parametrize(
    ("refusal", "message"),
    [
        (
            AssertionError("You are using an untested ZeRO Optimizer."),
            "ds_config: DeepSpeed refused it at ZeRO stage 2: You are using an untested ZeRO Optimizer.",
        ),
        # DeepSpeed's pydantic checks of its sections run over several lines; its device check is a ValueError.
        (
            ValueError(
                "1 validation error for DeepSpeedZeroConfig\noverlap_comm\n  Input should be a valid boolean "
                "[type=bool_parsing, input_value='maybe', input_type=str]"
            ),
            "ds_config: DeepSpeed refused it at ZeRO stage 2: 1 validation error for DeepSpeedZeroConfig "
            "overlap_comm Input should be a valid boolean [type=bool_parsing, input_value='maybe', input_type=str]",
        ),
        (
            ValueError("Type fp16 is not supported on your device."),
            "ds_config: DeepSpeed refused it at ZeRO stage 2: Type fp16 is not supported on your device.",
        ),
    ],
)
def test_a_config_deepspeed_refuses_is_named_as_the_configs_on_one_line(monkeypatch, refusal, message) -> None:
    from types import SimpleNamespace

    import deepspeed

    from poplar_ext.plan.formats import ModelInfo
    from poplar_ext.profiler import api
    from poplar_ext.profiler.fingerprint import model_fingerprint

    def refuse(**_kwargs):
        raise refusal

    monkeypatch.setattr(deepspeed, "initialize", refuse)
    monkeypatch.setattr(api, "place_model", lambda model, device: model)  # collective: no group here
    model = torch.nn.Linear(2, 1)
    session = api._Session(
        options=SimpleNamespace(ds_config={"optimizer": {"type": "AdamW"}}, optimizer_factory=None),
        settings=MeasureSettings(),
        layout=SimpleNamespace(device=torch.device("cpu"), world_size=2),
        model=ModelInfo(name="linear", fingerprint=model_fingerprint(model), num_parameters=3, dtype="float32"),
        toggle=None,
        job_key=None,
        offload_types=(),
        runs=(),
        spare_models=[model],
        trainable_parameters=3,
    )
    with pytest.raises(ValueError) as caught:
        session.build_engine(api._Run(2, False, False))
    assert str(caught.value) == message and caught.value.__cause__ is refusal


def _tokens(length_of):
    """make_batch of `length_of(b)` token ids per sample."""
    return lambda b: {"input_ids": torch.zeros(b, length_of(b), dtype=torch.long)}


def test_micro_batches_of_another_length_than_the_sequence_length_are_refused(monkeypatch, tmp_path) -> None:
    # The profiles are keyed with sequence_length: a job of that length would reuse times measured on another.
    from contextlib import nullcontext
    from dataclasses import replace

    from poplar_ext.profiler import api
    from poplar_ext.profiler.options import ProfileOptions

    def measure(options, settings, device, writable, timeouts=None):
        return [options.make_batch(size)["input_ids"].shape[-1] for size in (1, 4)]

    monkeypatch.setattr(api, "join_job", lambda: torch.device("cpu"))
    monkeypatch.setattr(api, "_measuring_process", lambda device: nullcontext())
    monkeypatch.setattr(api, "_short_timeouts", lambda options, device: nullcontext())
    monkeypatch.setattr(api, "_profile", measure)
    monkeypatch.setattr(api, "process_group_rank", lambda: (0, 1))
    options = ProfileOptions(
        model_factory=lambda: torch.nn.Linear(2, 1),
        make_batch=_tokens(lambda b: 16),
        ds_config={"optimizer": {"type": "AdamW"}},
        sequence_length=64,
        cache_dir=tmp_path,
        per_layer=False,
    )
    with pytest.raises(ValueError) as caught:
        api.profile_with(options)
    assert str(caught.value) == (
        "sequence_length: expected the micro-batches of make_batch (poplar-profile: --batch) to hold 64 tokens per "
        "sample, as sequence_length (--sequence-length) keys the profiles, found 16 in make_batch(1); give the "
        "length its samples have"
    )
    assert api.profile_with(replace(options, sequence_length=16)) == [16, 16]
    assert api.profile_with(replace(options, sequence_length=None)) == [16, 16], "no length given: any"
    # Micro-batch 1's length is the data's, as the automatic mode reads it: a collate that pads to a batch's longest
    # sample makes longer ones.
    padded = replace(options, make_batch=_tokens(lambda b: 15 + b), sequence_length=16)
    assert api.profile_with(padded) == [16, 19]
    no_token_ids = replace(options, make_batch=lambda b: {"input_ids": torch.ones(b, 3)})
    assert api.profile_with(no_token_ids) == [3, 3], "a batch without token ids is not checked"
