"""The profile cache: lookups compare the keys stored inside the files, never file names."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

from poplar_ext.plan.formats import Emulation, ModelInfo, Profile, Sample, load_profiles
from poplar_ext.plan.pipeline_formats import LayerCost, LayerProfile, LayerSample
from poplar_ext.profiler.cache import (
    LayerProfileKey,
    ProfileKey,
    client_optimizer,
    ds_config_fingerprint,
    find_cached_layer_profile,
    find_cached_profile,
    not_reused_because,
    profile_file_name,
    store_layer_profile,
    store_profile,
)
from poplar_ext.profiler.measure import MeasureSettings

CONFIG = {"train_batch_size": 8, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}


def _profile(**changes) -> Profile:
    profile = Profile(
        device_type="A100-80GB",
        memory_capacity_bytes=80 * 10**9,
        zero_stage=2,
        world_size=4,
        model=ModelInfo(
            name="gpt", fingerprint="sha256:0123456789abcdef", num_parameters=10, dtype="bfloat16", sequence_length=128
        ),
        max_micro_batch_size=4,
        samples=(Sample(micro_batch_size=4, micro_step_time_s=0.1, peak_memory_bytes=10**9),),
        optimizer_step_time_s=0.01,
        emulated=None,
        measured_with={
            "source": "measured",
            "torch": "2.13.0",
            "deepspeed": "0.19.8",
            "ds_config_fingerprint": ds_config_fingerprint(CONFIG),
        },
    )
    return dataclasses.replace(profile, **changes)


def _key(**changes) -> ProfileKey:
    key = ProfileKey(
        model_fingerprint="sha256:0123456789abcdef",
        device_type="A100-80GB",
        emulation=None,
        zero_stage=2,
        world_size=4,
        dtype="bfloat16",
        sequence_length=128,
        torch_version="2.13.0",
        deepspeed_version="0.19.8",
        ds_config_fingerprint=ds_config_fingerprint(CONFIG),
    )
    return dataclasses.replace(key, **changes)


def test_a_stored_profile_is_found_by_its_key(tmp_path: Path) -> None:
    store_profile(tmp_path, _profile())
    assert find_cached_profile(tmp_path, _key()) == _profile()


@pytest.mark.parametrize(
    "change",
    [
        {"model_fingerprint": "sha256:ffffffffffffffff"},
        {"device_type": "V100-16GB"},
        {"emulation": Emulation(slowdown=2.0, memory_capacity_bytes=10**9)},
        {"zero_stage": 3},
        {"world_size": 8},
        {"dtype": "float32"},
        {"sequence_length": 256},
        {"torch_version": "2.12.0"},
        {"deepspeed_version": "0.19.9"},
        {"ds_config_fingerprint": ds_config_fingerprint({**CONFIG, "fp16": {"enabled": True}})},
    ],
)
def test_any_changed_key_misses(tmp_path: Path, change: dict) -> None:
    store_profile(tmp_path, _profile())
    assert find_cached_profile(tmp_path, _key(**change)) is None


def test_a_miss_says_which_key_fields_the_stored_profile_differs_in(tmp_path: Path) -> None:
    # A job that measured again at every start said only "measuring": nothing told that its DeepSpeed config
    # or DeepSpeed itself had changed since the stored profile.
    path = store_profile(tmp_path, _profile())
    changed = _key(deepspeed_version="0.19.9", ds_config_fingerprint="sha256:" + "f" * 64)
    assert not_reused_because(tmp_path, changed) == (
        f"{path.name} differs in deepspeed_version (0.19.8 stored, 0.19.9 now), ds_config_fingerprint"
    )
    asked_more = _key()
    assert find_cached_profile(tmp_path, asked_more, settings=MeasureSettings(repeats=50)) is None
    assert not_reused_because(tmp_path, asked_more) == f"{path.name} was measured with less than asked"
    # None stored of this model, type, stage and levers: nothing to say.
    assert not_reused_because(tmp_path, _key(device_type="V100-16GB")) is None
    assert not_reused_because(tmp_path, _key(activation_checkpointing=True)) is None
    layer = _layer_profile()
    layer_path = store_layer_profile(tmp_path, layer)
    layer_key = dataclasses.replace(LayerProfileKey.of_profile(layer), torch_version="2.12.0")
    assert not_reused_because(tmp_path, layer_key) == (
        f"{layer_path.name} differs in torch_version ({layer.measured_with['torch']} stored, 2.12.0 now)"
    )


def test_the_cache_lookup_tells_each_miss_why_on_rank_0(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from poplar_ext.profiler.cache import cached_on_rank0

    path = store_profile(tmp_path, _profile())
    keys = {"same": _key(), "newer": _key(torch_version="2.14.0"), "other type": _key(device_type="V100-16GB")}
    options, heard = SimpleNamespace(cache_dir=tmp_path, force=False), []
    found = cached_on_rank0(0, options, keys, find_cached_profile, lambda p: p, on_miss=lambda *a: heard.append(a))
    assert list(found) == ["same"]
    assert heard == [("newer", f"{path.name} differs in torch_version (2.13.0 stored, 2.14.0 now)")]
    heard.clear()
    assert cached_on_rank0(1, options, keys, find_cached_profile, lambda p: p, on_miss=heard.append) == {}
    assert heard == []


def test_file_names_are_never_parsed(tmp_path: Path) -> None:
    path = store_profile(tmp_path, _profile())
    path.rename(tmp_path / "renamed-by-someone.json")
    assert find_cached_profile(tmp_path, _key()) == _profile()


def test_a_modelled_profile_is_never_reused_as_measured(tmp_path: Path) -> None:
    store_profile(tmp_path, _profile(measured_with={"source": "modelled", "model": "datasheet"}))
    assert find_cached_profile(tmp_path, _key()) is None


def test_a_broken_file_is_ignored_with_a_warning_naming_it(tmp_path: Path) -> None:
    store_profile(tmp_path, _profile())
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.warns(UserWarning, match="profile cache: ignoring .*broken.json"):
        assert find_cached_profile(tmp_path, _key()) == _profile()


def _layer_profile() -> LayerProfile:
    zero = _profile(zero_stage=1)
    layer = LayerCost(
        index=0,
        name="Block",
        samples=(LayerSample(micro_batch_size=1, step_time_s=0.01),),
        parameter_bytes=4096,
        optimizer_state_bytes=8192,
        activation_bytes_per_sample=1000,
        output_bytes_per_sample=256,
        optimizer_step_time_s=0.001,
    )
    fields = ("device_type", "memory_capacity_bytes", "zero_stage", "model", "emulated", "measured_with")
    return LayerProfile(**{f: getattr(zero, f) for f in fields}, layers=(layer,), base_memory_bytes=10**6)


@pytest.mark.parametrize("layers", [False, True], ids=["profile", "layer profile"])
def test_a_broken_file_is_reported_at_the_caller_of_a_lookup_and_a_store(tmp_path: Path, layers: bool) -> None:
    folder = tmp_path / "layers" if layers else tmp_path
    folder.mkdir(exist_ok=True)
    (folder / "broken.json").write_text("{not json")
    if layers:
        calls = (
            lambda: store_layer_profile(tmp_path, _layer_profile()),
            lambda: find_cached_layer_profile(tmp_path, LayerProfileKey.of_profile(_layer_profile())),
        )
    else:
        calls = (lambda: store_profile(tmp_path, _profile()), lambda: find_cached_profile(tmp_path, _key()))
    for call in calls:
        with pytest.warns(UserWarning, match="profile cache: ignoring .*broken.json") as caught:
            call()
        assert [w.filename for w in caught] == [__file__]


def test_a_missing_directory_is_an_empty_cache(tmp_path: Path) -> None:
    assert find_cached_profile(tmp_path / "absent", _key()) is None


def test_storing_replaces_the_profile_with_the_same_type_stage_and_model(tmp_path: Path) -> None:
    # load_profiles allows one profile per (device type, stage, model) in a directory.
    first = store_profile(tmp_path, _profile())
    first.rename(tmp_path / "old-name.json")
    second = store_profile(tmp_path, _profile(world_size=8))
    assert second == tmp_path / "old-name.json"
    assert [p.world_size for p in load_profiles(tmp_path)] == [8]


def _files(directory: Path) -> list[str]:
    return sorted(str(path.relative_to(directory)) for path in directory.rglob("*.json"))


def test_an_elastic_job_back_at_a_world_size_reuses_its_profile(tmp_path: Path) -> None:
    # 4 ranks, then 8, then 4 again: each size measured once, the directory's one profile always the job's size.
    store_profile(tmp_path, _profile(world_size=4))
    store_profile(tmp_path, _profile(world_size=8, optimizer_step_time_s=0.02))
    assert [p.world_size for p in load_profiles(tmp_path)] == [8]
    assert _files(tmp_path) == [
        "gpt-01234567-A100-80GB-zero2.json",
        "other-world-sizes/world-size-4/gpt-01234567-A100-80GB-zero2.json",
    ]

    back = find_cached_profile(tmp_path, _key(world_size=4))
    assert back == _profile(world_size=4)
    assert [p.world_size for p in load_profiles(tmp_path)] == [4], "moved back where the search reads it"
    assert _files(tmp_path) == [
        "gpt-01234567-A100-80GB-zero2.json",
        "other-world-sizes/world-size-8/gpt-01234567-A100-80GB-zero2.json",
    ]
    assert find_cached_profile(tmp_path, _key(world_size=8)) == _profile(world_size=8, optimizer_step_time_s=0.02)
    assert find_cached_profile(tmp_path, _key(world_size=2)) is None


def test_a_parked_profile_is_reused_only_as_a_stored_one_would_be(tmp_path: Path) -> None:
    store_profile(tmp_path, _as_measured(limited=True))  # 4 ranks, its probe stopped by a limit of 4
    store_profile(tmp_path, _profile(world_size=8))
    assert find_cached_profile(tmp_path, _key(world_size=4), settings=MeasureSettings(micro_batch_size_limit=8)) is None
    assert find_cached_profile(tmp_path, _key(world_size=4, zero_stage=3)) is None
    assert [p.world_size for p in load_profiles(tmp_path)] == [8], "nothing moved for a miss"


def test_a_measurement_on_the_same_world_size_replaces_without_keeping(tmp_path: Path) -> None:
    store_profile(tmp_path, _profile())
    store_profile(tmp_path, _profile(optimizer_step_time_s=0.02))
    assert _files(tmp_path) == ["gpt-01234567-A100-80GB-zero2.json"]


def test_a_parked_profile_in_a_cache_that_cannot_be_written_is_still_reused(tmp_path: Path, monkeypatch) -> None:
    from poplar_ext.profiler import cache

    store_profile(tmp_path, _profile(world_size=4))
    store_profile(tmp_path, _profile(world_size=8))

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cache, "store_profile", read_only)
    with pytest.warns(UserWarning, match="reused .*world-size-4.* but could not move it back into"):
        assert find_cached_profile(tmp_path, _key(world_size=4)) == _profile(world_size=4)
    assert [p.world_size for p in load_profiles(tmp_path)] == [8]


def test_other_stages_and_types_sit_side_by_side(tmp_path: Path) -> None:
    store_profile(tmp_path, _profile())
    store_profile(tmp_path, _profile(zero_stage=3))
    store_profile(tmp_path, _profile(device_type="V100-16GB"))
    assert len(load_profiles(tmp_path)) == 3


def test_the_file_name_is_readable() -> None:
    assert profile_file_name(_profile()) == "gpt-01234567-A100-80GB-zero2.json"


def test_key_of_a_stored_profile_round_trips() -> None:
    assert ProfileKey.of_profile(_profile()) == _key()


def test_config_fingerprint_ignores_batch_sizes_the_stage_the_scheduler_and_the_poplar_section() -> None:
    other = {
        **CONFIG,
        "train_batch_size": 64,
        "gradient_accumulation_steps": 4,
        "zero_optimization": {"stage": 3},
        "poplar": {"cluster": "c.json"},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
    }
    assert ds_config_fingerprint(other) == ds_config_fingerprint(CONFIG)
    offload = {**CONFIG, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert ds_config_fingerprint(offload) != ds_config_fingerprint(CONFIG)
    assert CONFIG["zero_optimization"] == {"stage": 2}, "the caller's config is not modified"


def test_stored_json_holds_every_key(tmp_path: Path) -> None:
    data = json.loads(store_profile(tmp_path, _profile()).read_text())
    assert data["measured_with"]["torch"] == "2.13.0"
    assert data["model"]["fingerprint"] == "sha256:0123456789abcdef"


def _as_measured(limited: bool = False, sizes: tuple[int, ...] = (1, 2, 3, 4), **recorded: Any) -> Profile:
    """`_profile` with the samples and settings profile_model records (default: its own, sizes 1-4, largest 4)."""
    samples = tuple(Sample(micro_batch_size=b, micro_step_time_s=0.1 * b, peak_memory_bytes=b * 10**8) for b in sizes)
    measured_with = {
        **_profile().measured_with,
        "warmup_micro_steps": 1,
        "repeats": 3,
        "largest_micro_batch_probe": {"limited_by_micro_batch_size_limit": limited},
        **recorded,
    }
    return _profile(samples=samples, measured_with=measured_with)


def _found(tmp_path: Path, **settings) -> bool:
    return find_cached_profile(tmp_path, _key(), settings=MeasureSettings(**settings)) is not None


def test_a_profile_a_lower_micro_batch_limit_stopped_is_measured_again_under_a_higher_one(tmp_path: Path) -> None:
    # Measured with --max-micro-batch-size 4: its largest micro-batch is the limit, not what fits.
    store_profile(tmp_path, _as_measured(limited=True))
    assert not _found(tmp_path, micro_batch_size_limit=8)
    assert _found(tmp_path, micro_batch_size_limit=4)
    assert _found(tmp_path, micro_batch_size_limit=2)


def test_a_profile_memory_stopped_is_reused_under_any_micro_batch_limit(tmp_path: Path) -> None:
    store_profile(tmp_path, _as_measured(limited=False))
    assert _found(tmp_path, micro_batch_size_limit=256)


@pytest.mark.parametrize(
    ("settings", "found"),
    [
        ({}, True),
        ({"repeats": 5}, False),  # a median over more micro-steps asked for
        ({"repeats": 2}, True),
        ({"warmup_micro_steps": 2}, False),
        ({"warmup_micro_steps": 0}, True),
        ({"micro_batch_sizes": (1, 3)}, True),
        ({"micro_batch_sizes": (2, 8)}, True),  # 8 does not fit: the sweep is 2 and the largest, 4
    ],
)
def test_a_profile_measured_with_fewer_micro_steps_than_asked_is_measured_again(
    tmp_path: Path, settings: dict, found: bool
) -> None:
    store_profile(tmp_path, _as_measured())
    assert _found(tmp_path, **settings) is found


def test_a_profile_without_a_size_the_sweep_asks_for_is_measured_again(tmp_path: Path) -> None:
    # Measured with --micro-batch-sizes 1,2 (the probe added 4, the largest): the default sweep wants 3 too.
    store_profile(tmp_path, _as_measured(sizes=(1, 2, 4)))
    assert not _found(tmp_path)
    assert not _found(tmp_path, micro_batch_sizes=(3,))
    assert _found(tmp_path, micro_batch_sizes=(1, 2))


def test_a_profile_that_ran_out_of_memory_at_a_swept_size_below_its_largest_is_reused(tmp_path: Path) -> None:
    # Memory not monotonic in the size: 3 ran out in the sweep while 4 fitted. Measured again, it would run out
    # again: the size it records as out of memory counts as swept, and only that size.
    probe = {"limited_by_micro_batch_size_limit": False, "out_of_memory_in_sweep": [3]}
    store_profile(tmp_path, _as_measured(sizes=(1, 2, 4), largest_micro_batch_probe=probe))
    assert _found(tmp_path)
    assert _found(tmp_path, micro_batch_sizes=(3,))
    store_profile(tmp_path, _as_measured(sizes=(1, 4)))
    assert not _found(tmp_path), "2 neither timed nor recorded as out of memory"


def test_a_profile_that_records_no_micro_step_counts_is_measured_again(tmp_path: Path) -> None:
    store_profile(tmp_path, _profile(samples=_as_measured().samples))
    assert find_cached_profile(tmp_path, _key()) is not None, "no settings asked: no counts compared"
    assert not _found(tmp_path)


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o027, 0o640)])
def test_a_stored_profile_gets_the_mode_the_umask_gives_a_new_file(tmp_path: Path, umask: int, mode: int) -> None:
    # A profile directory shared by users and jobs: not the temporary file's 0600.
    old = os.umask(umask)
    try:
        path = store_profile(tmp_path, _profile())
        replaced = store_profile(tmp_path, _profile(world_size=8))
    finally:
        os.umask(old)
    assert replaced == path
    assert stat.S_IMODE(path.stat().st_mode) == mode


def test_a_replaced_file_keeps_its_own_mode(tmp_path: Path) -> None:
    # A mode the user chose (0600 for a private cache, 0640 for a group's) outlives the next write.
    path = store_profile(tmp_path, _profile())
    os.chmod(path, 0o600)
    old = os.umask(0o022)
    try:
        assert store_profile(tmp_path, _profile(world_size=8)) == path
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_config_fingerprint_ignores_optimizer_settings_that_change_no_state_or_cost() -> None:
    """A learning-rate sweep (the Trainer fills ``lr: "auto"`` from --learning_rate) must not re-measure every
    profile; momentum adds a state, another optimizer type another step."""
    adam = {**CONFIG, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8}}}
    swept = {**CONFIG, "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.1, "eps": 1e-6}}}
    assert ds_config_fingerprint(swept) == ds_config_fingerprint(adam)
    sgd = {**CONFIG, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    assert ds_config_fingerprint(sgd) != ds_config_fingerprint(adam)
    momentum = {**CONFIG, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}
    assert ds_config_fingerprint(momentum) != ds_config_fingerprint(sgd)
    assert adam["optimizer"]["params"]["lr"] == 1e-3, "the caller's config is not modified"


def test_a_config_that_only_sets_what_is_not_keyed_matches_one_without_those_sections() -> None:
    # A job whose config added only its ZeRO stage re-measured (and overwrote) the profiles made without one.
    plain = {"optimizer": {"type": "SGD"}, "bf16": {"enabled": True}}
    staged = {**plain, "zero_optimization": {"stage": 1}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    assert ds_config_fingerprint(staged) == ds_config_fingerprint(plain)
    assert ds_config_fingerprint({**plain, "zero_optimization": {"stage": 1, "overlap_comm": True}}) != (
        ds_config_fingerprint(plain)
    )


def test_a_script_built_optimizer_is_keyed_by_its_settings_as_the_configs_is() -> None:
    # Keyed by its class alone, SGD without and with momentum (a buffer per parameter) shared profiles.
    def key(optimizer_class: type, **settings: object) -> str:
        return ds_config_fingerprint(CONFIG, client_optimizer(lambda p: optimizer_class(p, **settings)))

    assert key(torch.optim.SGD, lr=0.1, momentum=0.9) != key(torch.optim.SGD, lr=0.1)
    assert key(torch.optim.Adam, amsgrad=True) != key(torch.optim.Adam)
    assert key(torch.optim.Adam, lr=0.5, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1) == key(torch.optim.Adam)
    assert key(torch.optim.Adam) != key(torch.optim.AdamW) != ds_config_fingerprint(CONFIG)
