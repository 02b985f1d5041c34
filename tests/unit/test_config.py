"""The poplar section and the nominal per-rank DeepSpeed config."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from poplar_ext.plan.formats import plan_from_dict
from poplar_ext.runtime.config import (
    configured_zero_stage,
    load_deepspeed_config,
    nominal_deepspeed_config,
    poplar_config_from_dict,
    requested_zero_stage,
)

BASE = Path("/cfg")


def _parse(**section):
    return poplar_config_from_dict({"cluster": "cluster.json", "plan": "plan.json", **section}, base_dir=BASE)


def _plan(allocation, stage=1):
    return plan_from_dict(
        {
            "schema_version": 1,
            "policy": "poplar",
            "zero_stage": stage,
            "global_batch_size": sum(b * s for b, s in allocation),
            "ranks": [
                {"rank": r, "device_type": "x", "micro_batch_size": b, "gradient_accumulation_steps": s}
                for r, (b, s) in enumerate(allocation)
            ],
            "predicted": {"iteration_time_s": 1.0, "samples_per_s": 1.0, "ideal_samples_per_s": 1.0},
            "profile_fingerprints": {},
        }
    )


def test_defaults_and_relative_paths():
    cfg = _parse()
    assert cfg.cluster == BASE / "cluster.json" and cfg.plan == BASE / "plan.json"
    assert (cfg.profiles, cfg.policy, cfg.seed, cfg.shuffle, cfg.loss_reduction, cfg.log_interval_steps) == (
        None,
        "poplar",
        0,
        True,
        "mean",
        10,
    )


def test_a_path_from_home_is_the_users_not_the_config_folders(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = _parse(profiles="~/profiles")
    assert cfg.profiles == tmp_path / "profiles"


def test_absolute_paths_stay():
    assert _parse(profiles="/p").profiles == Path("/p")


def test_section_not_an_object():
    with pytest.raises(ValueError, match="poplar: expected an object"):
        poplar_config_from_dict(["cluster.json"], base_dir=BASE)


def test_unknown_key():
    with pytest.raises(
        ValueError,
        match=r"poplar.polcy: expected one of the keys .* \(did you mean 'policy'\?\), found the unknown key 'polcy'",
    ):
        _parse(polcy="uniform")


def test_without_a_cluster_file_the_cluster_is_read_from_the_hardware():
    assert poplar_config_from_dict({"plan": "p.json"}, base_dir=BASE).cluster is None


def test_neither_plan_nor_profiles_is_the_automatic_mode_with_profiles_in_the_users_cache(monkeypatch, tmp_path):
    # The smallest sections the docs show: a cluster file, or nothing at all.
    monkeypatch.delenv("POPLAR_PROFILES_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for section in ({"cluster": "c.json", "cpu_threads": 1}, {}):
        cfg = poplar_config_from_dict(section, base_dir=BASE)
        assert cfg.plan is None and cfg.profiles_defaulted
        assert cfg.profiles == tmp_path / "cache" / "poplar-ext" / "profiles"
    monkeypatch.setenv("POPLAR_PROFILES_DIR", str(tmp_path / "mine"))
    assert poplar_config_from_dict({}, base_dir=BASE).profiles == tmp_path / "mine"
    named = poplar_config_from_dict({"profiles": "p"}, base_dir=BASE)
    assert named.profiles == BASE / "p" and not named.profiles_defaulted
    with pytest.raises(ValueError, match=r"poplar: expected an object \(\{\} for the automatic mode"):
        poplar_config_from_dict([], base_dir=BASE)


def test_bad_policy():
    with pytest.raises(
        ValueError, match=r"poplar.policy: expected one of 'uniform', 'proportional', 'poplar', found string 'fast'"
    ):
        _parse(policy="fast")


def test_bad_seed():
    with pytest.raises(ValueError, match="poplar.seed: expected an integer >= 0, found number -1"):
        _parse(seed=-1)


def test_bad_shuffle():
    with pytest.raises(ValueError, match="poplar.shuffle: expected true or false, found string 'yes'"):
        _parse(shuffle="yes")


def test_bad_reduction():
    with pytest.raises(
        ValueError, match="poplar.loss_reduction: expected one of 'mean', 'sum', 'token_mean', found string 'none'"
    ):
        _parse(loss_reduction="none")


def test_bad_global_batch():
    with pytest.raises(
        ValueError, match="poplar.global_batch_size: expected an integer from 1 to 2147483648 or 'auto', found number 0"
    ):
        _parse(global_batch_size=0)


def test_bad_path():
    with pytest.raises(ValueError, match="poplar.plan: expected a path"):
        _parse(plan=3)


def test_config_from_a_file_resolves_against_its_directory(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"poplar": {}}))
    data, base_dir, source = load_deepspeed_config(args=SimpleNamespace(deepspeed_config=str(tmp_path / "ds.json")))
    assert data == {"poplar": {}} and base_dir == tmp_path and source == str(tmp_path / "ds.json")


def test_config_given_twice():
    with pytest.raises(ValueError, match="expected exactly one of .* found config, args.deepspeed_config"):
        load_deepspeed_config({"a": 1}, args=SimpleNamespace(deepspeed_config="x.json"))


def test_config_file_unreadable(tmp_path):
    with pytest.raises(ValueError, match=r"missing.json: \(file\): expected a readable JSON file \(given as config\)"):
        load_deepspeed_config(str(tmp_path / "missing.json"))


def test_configured_stage():
    assert configured_zero_stage({}) is None
    assert configured_zero_stage({"zero_optimization": {"stage": 2}}) == 2


def test_configured_stage_out_of_range():
    with pytest.raises(ValueError, match="zero_optimization.stage: expected an integer from 0 to 3, found number 4"):
        configured_zero_stage({"zero_optimization": {"stage": 4}})


def test_poplar_zero_stage_values():
    assert _parse(zero_stage="auto").zero_stage == "auto"
    assert _parse(zero_stage=3).zero_stage == 3
    assert _parse().zero_stage is None


@pytest.mark.parametrize("bad", ["AUTO", 4, -1, True, 2.0, [2]])
def test_poplar_zero_stage_bad(bad):
    with pytest.raises(ValueError, match=r"poplar.zero_stage: expected 'auto' or an integer from 0 to 3, found "):
        _parse(zero_stage=bad)


def test_requested_stage_auto_lets_the_search_pick():
    assert requested_zero_stage(_parse(zero_stage="auto"), {}) is None
    assert requested_zero_stage(_parse(zero_stage="auto"), {"zero_optimization": {"offload_param": {}}}) is None


def test_requested_stage_without_poplar_zero_stage_is_deepspeeds():
    assert requested_zero_stage(_parse(), {"zero_optimization": {"stage": 2}}) == 2
    assert requested_zero_stage(_parse(), {}) is None


def test_requested_stage_number():
    assert requested_zero_stage(_parse(zero_stage=1), {}) == 1
    assert requested_zero_stage(_parse(zero_stage=1), {"zero_optimization": {"stage": 1}}) == 1


def test_requested_stage_conflicts_with_deepspeeds():
    with pytest.raises(
        ValueError,
        match=r"poplar.zero_stage: expected 2 \(as zero_optimization.stage\) or no "
        r"zero_optimization.stage, found 'auto' beside zero_optimization.stage 2",
    ):
        requested_zero_stage(_parse(zero_stage="auto"), {"zero_optimization": {"stage": 2}})
    with pytest.raises(ValueError, match=r"found 3 beside zero_optimization.stage 2"):
        requested_zero_stage(_parse(zero_stage=3), {"zero_optimization": {"stage": 2}})


def test_nominal_config_is_valid_per_rank():
    plan = _plan([(4, 1), (2, 3)], stage=1)
    user = {"train_batch_size": 10, "gradient_clipping": 1.0, "poplar": {}}
    nominal = nominal_deepspeed_config(user, plan, 1)
    assert nominal["train_micro_batch_size_per_gpu"] == 2
    assert nominal["gradient_accumulation_steps"] == 3
    assert nominal["train_batch_size"] == 2 * 3 * 2
    assert nominal["zero_optimization"] == {"stage": 1}
    assert user["train_batch_size"] == 10  # the user's dict is not modified


def test_nominal_config_refuses_another_global_batch():
    with pytest.raises(
        ValueError, match=r"train_batch_size: expected the plan's global batch \(10\) or no value, found 12"
    ):
        nominal_deepspeed_config({"train_batch_size": 12}, _plan([(4, 1), (2, 3)]), 0)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("clipping", [{}, {"gradient_clipping": 0.3}])
def test_nominal_config_refuses_float16_autocast_with_clipping_at_zero_1_to_3(stage, clipping):
    # DeepSpeed 0.19.8's ZeRO optimizers clip the GradScaler-scaled gradients, then unscale: measured on one process
    # at ZeRO 1, 3 SGD steps moved the tiny GPT by 8.6e-7 (clipping 1.0) where the global batch moves it by 1.6e-2.
    user = {"torch_autocast": {"enabled": True, "dtype": "float16"}, **clipping}
    found = "0.3" if clipping else r"none \(DeepSpeed's default, 1.0\)"
    with pytest.raises(
        ValueError,
        match=rf"gradient_clipping: expected 0 beside torch_autocast.dtype 'float16' at ZeRO stage {stage} .*, "
        rf"found {found}",
    ):
        nominal_deepspeed_config(user, _plan([(4, 2), (2, 2)], stage=stage), 0)


@pytest.mark.parametrize(
    ("stage", "user"),
    [
        (0, {"torch_autocast": {"enabled": True, "dtype": "fp16"}}),  # the engine's own GradScaler unscales first
        (1, {"torch_autocast": {"enabled": True, "dtype": "fp16"}, "gradient_clipping": 0.0}),
        (1, {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}),
        (1, {"torch_autocast": {"enabled": False, "dtype": "float16"}}),
    ],
)
def test_nominal_config_keeps_autocast_where_deepspeed_clips_right(stage, user):
    assert (
        nominal_deepspeed_config(user, _plan([(4, 2), (2, 2)], stage=stage), 0)["torch_autocast"]
        == user["torch_autocast"]
    )


def test_cpu_process_options_default_to_leaving_the_process_alone():
    cfg = _parse()
    assert cfg.cpu_threads is None and cfg.steady_cpu_allocator is False
    cfg = _parse(cpu_threads=1, steady_cpu_allocator=True)
    assert cfg.cpu_threads == 1 and cfg.steady_cpu_allocator is True


@pytest.mark.parametrize(
    ("key", "bad", "message"),
    [
        ("cpu_threads", 0, "poplar.cpu_threads: expected an integer >= 1, found number 0"),
        ("cpu_threads", "1", "poplar.cpu_threads: expected an integer >= 1, found string '1'"),
        ("steady_cpu_allocator", 1, "poplar.steady_cpu_allocator: expected true or false, found number 1"),
    ],
)
def test_cpu_process_options_bad(key, bad, message):
    with pytest.raises(ValueError, match=message):
        _parse(**{key: bad})


def test_errors_name_the_config_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"poplar": {"cluster": "c.json", "plan": "p.json", "seed": -1}}))
    data, base_dir, source = load_deepspeed_config(str(path))
    with pytest.raises(
        ValueError, match=rf"^{re.escape(str(path))}: poplar.seed: expected an integer >= 0, found number -1$"
    ):
        poplar_config_from_dict(data["poplar"], base_dir=base_dir, source=source)


@pytest.mark.parametrize("zero", [None, [], "2", 3])
def test_zero_optimization_not_an_object(zero):
    with pytest.raises(ValueError, match="zero_optimization: expected an object, found "):
        configured_zero_stage({"zero_optimization": zero})


def test_zero_stage_as_a_float_is_refused():
    with pytest.raises(ValueError, match="zero_optimization.stage: expected an integer from 0 to 3, found number 1.0"):
        configured_zero_stage({"zero_optimization": {"stage": 1.0}})


def test_a_config_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "ds.json"
    path.write_bytes(b'{"poplar": "' + bytes([0xFF]) + b'"}')
    with pytest.raises(ValueError, match=re.escape(f"{path}: (file): expected a UTF-8 JSON file (given as config)")):
        load_deepspeed_config(str(path))


# -- which global batch a job trains ---------------------------------------------------
from poplar_ext.runtime.config import deepspeed_global_batch_size, requested_global_batch_size  # noqa: E402


def test_deepspeeds_global_batch_from_micro_batch_and_accumulation():
    request = deepspeed_global_batch_size(
        {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 2}, world_size=4
    )
    assert request.size == 128 and "16 x 2 x 4" in request.origin
    assert deepspeed_global_batch_size({"train_micro_batch_size_per_gpu": 3}, world_size=2).size == 6
    assert deepspeed_global_batch_size({"train_batch_size": 96}, world_size=4).size == 96
    assert deepspeed_global_batch_size({}, world_size=4).size is None


@pytest.mark.parametrize(
    "auto_key", ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"]
)
def test_hugging_face_auto_values_count_as_unset(auto_key):
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
    }
    assert deepspeed_global_batch_size(config, world_size=2).size is None
    config = {
        "train_batch_size": 24,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 3,
        auto_key: "auto",
    }
    assert deepspeed_global_batch_size(config, world_size=2).size == 24


def test_an_auto_accumulation_count_beside_a_micro_batch_leaves_the_batch_to_its_filler():
    # The Trainer fills "auto" from its arguments (accumulation 2: a batch of 4 x 2 x 2); 4 x 1 x 2 would
    # train half of it.
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"}
    assert deepspeed_global_batch_size(config, world_size=2).size is None
    del config["gradient_accumulation_steps"]  # absent: DeepSpeed's default of 1
    assert deepspeed_global_batch_size(config, world_size=2).size == 8


def test_deepspeeds_three_batch_values_must_agree():
    config = {"train_batch_size": 100, "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 2}
    with pytest.raises(
        ValueError,
        match=r"train_batch_size: expected train_micro_batch_size_per_gpu x gradient_accumulation_steps "
        r"x world size \(16 x 2 x 4 = 128\), as DeepSpeed requires, found number 100",
    ):
        deepspeed_global_batch_size(config, world_size=4)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "96", True])
def test_deepspeed_batch_values_are_checked(bad):
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu: expected an integer from 1 to 2147483648"):
        deepspeed_global_batch_size({"train_micro_batch_size_per_gpu": bad}, world_size=2)


def test_the_search_does_not_override_what_deepspeed_says():
    # micro-batch and accumulation but no train_batch_size: DeepSpeed's product, not the search's pick.
    request = requested_global_batch_size(
        _parse(), {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4}, world_size=3
    )
    assert request.size == 96
    assert requested_global_batch_size(_parse(global_batch_size="auto", plan=None), {}, world_size=3).size == "auto"
    assert (
        requested_global_batch_size(_parse(global_batch_size=12), {"train_batch_size": "auto"}, world_size=3).size == 12
    )
    assert requested_global_batch_size(_parse(), {}, world_size=3).size is None


@pytest.mark.parametrize("poplar_batch", [64, "auto"])
def test_two_global_batches_are_an_error(poplar_batch):
    with pytest.raises(
        ValueError,
        match=r"poplar.global_batch_size: expected the DeepSpeed config's global batch \(96, from "
        r"train_batch_size\) or no poplar.global_batch_size",
    ):
        requested_global_batch_size(
            _parse(global_batch_size=poplar_batch, plan=None), {"train_batch_size": 96}, world_size=3
        )


def test_drop_last_option():
    assert _parse().drop_last is False and _parse(drop_last=True).drop_last is True
    with pytest.raises(ValueError, match="poplar.drop_last: expected true or false, found string 'yes'"):
        _parse(drop_last="yes")


def test_the_documented_section_has_every_key_at_its_default():
    # One source for the defaults: the dataclasses. docs/training.md shows the shape of the
    # section; apart from the three values a job names itself, it must say what they say.
    import dataclasses

    from poplar_ext.runtime import config as module

    docs = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    example = docs.split('```jsonc\n"poplar": {', 1)[1].split("```", 1)[0]
    section = json.loads('{"poplar": {' + re.sub(r"\s+//.*", "", example) + "}")["poplar"]
    derived = ("source", "profiles_defaulted", "policy_given")  # not keys of the section
    assert list(section) == [f.name for f in dataclasses.fields(module.PoplarConfig) if f.name not in derived]
    assert list(section["rebalance"]) == [f.name for f in dataclasses.fields(module.RebalanceConfig)]
    named = {"cluster": BASE / "cluster.json", "profiles": BASE / "profiles", "global_batch_size": 96}
    named["policy_given"] = True  # the documented section names every key
    parsed = poplar_config_from_dict(section, base_dir=BASE)
    assert parsed == dataclasses.replace(module.PoplarConfig(), **named)


def test_deepspeeds_throughput_timer_does_not_synchronise_the_device_unless_the_user_says_so():
    # Synchronised, it waits for the GPU twice per micro-step (poplar-ext builds the dataloader).
    plan = _plan([(4, 1), (2, 3)], stage=1)
    nominal = nominal_deepspeed_config({"poplar": {}}, plan, 0)
    assert nominal["timers"]["throughput"]["synchronized"] is False
    user = {"timers": {"throughput": {"synchronized": True, "enabled": True}}}
    nominal = nominal_deepspeed_config(user, plan, 0)
    assert nominal["timers"]["throughput"] == {"synchronized": True, "enabled": True}
    with pytest.raises(ValueError, match=r"timers.throughput: expected an object, found list"):
        nominal_deepspeed_config({"timers": {"throughput": []}}, plan, 0)


def test_an_engine_another_library_built_gets_the_same_timer_setting():
    from types import SimpleNamespace

    from poplar_ext.zero.initialize import follow_unsynchronised_throughput_timer

    engine = SimpleNamespace(tput_timer=SimpleNamespace(config=SimpleNamespace(synchronized=True)))
    user = {"train_batch_size": 8}
    follow_unsynchronised_throughput_timer(engine, user)
    assert engine.tput_timer.config.synchronized is False
    assert user == {"train_batch_size": 8}  # the user's config is not modified
    engine.tput_timer.config.synchronized = True
    follow_unsynchronised_throughput_timer(engine, {"timers": {"throughput": {"synchronized": True}}})
    assert engine.tput_timer.config.synchronized is True


def test_a_bad_timers_section_is_named_in_its_config_file():
    # The error names the DeepSpeed config file the job read, as every other error of the config does.
    plan = _plan([(4, 1), (2, 3)], stage=1)
    with pytest.raises(ValueError, match=r"^ds\.json: timers\.throughput: expected an object, found list"):
        nominal_deepspeed_config({"timers": {"throughput": []}}, plan, 0, source="ds.json")
    with pytest.raises(ValueError, match=r"^ds\.json: timers: expected an object, found int"):
        nominal_deepspeed_config({"timers": 5}, plan, 0, source="ds.json")


def test_several_wrong_fields_name_the_first_in_the_sections_order():
    """policy, seed, ..., log_interval_steps are checked before cpu_threads, rebalance and calibration."""
    wrong = {"cpu_threads": 0, "rebalance": {"threshold": -1}, "calibration": {"repeats": 0}}
    with pytest.raises(ValueError, match=r"poplar\.policy"):
        poplar_config_from_dict({"policy": "bogus", **wrong}, base_dir=BASE)
    with pytest.raises(ValueError, match=r"poplar\.log_interval_steps"):
        poplar_config_from_dict({"log_interval_steps": -1, **wrong}, base_dir=BASE)
    with pytest.raises(ValueError, match=r"poplar\.global_batch_size"):
        poplar_config_from_dict({"global_batch_size": 0, "seed": -1}, base_dir=BASE)
    with pytest.raises(ValueError, match=r"poplar\.cpu_threads"):
        poplar_config_from_dict({"cpu_threads": 0, "optimizer_offload": "bogus"}, base_dir=BASE)


@pytest.mark.parametrize(
    ("section", "ds_config", "field", "found"),
    [
        ({"global_batch_size": 1}, {}, "poplar.global_batch_size", 1),
        ({}, {"train_batch_size": 2}, "train_batch_size", 2),
    ],
)
def test_a_global_batch_smaller_than_the_ranks_is_refused_before_any_profiling(section, ds_config, field, found):
    # Every rank trains at least one sample an iteration: the search would find no plan, after the automatic
    # mode had profiled every device type.
    with pytest.raises(
        ValueError, match=rf"{field}: expected at least one sample per rank \(3 ranks\), found {found}$"
    ):
        requested_global_batch_size(_parse(**section), ds_config, world_size=3)
