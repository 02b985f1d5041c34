"""Plan resolution without processes: a plan file, a search at start, missing profiles."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from poplar_bench.synthetic import SYNTHETIC_MODEL, synthetic_profile
from poplar_ext.plan.formats import load_cluster, save_profile
from poplar_ext.runtime.config import poplar_config_from_dict
from poplar_ext.zero.planning import ProfileDirectory, resolve_plan


@pytest.fixture
def cluster_path(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(
        json.dumps(
            {
                "schema_version": 1,
                "nodes": [
                    {
                        "name": "n0",
                        "devices": [{"device_type": "fast", "count": 1}, {"device_type": "slow", "count": 1}],
                    }
                ],
            }
        )
    )
    return path


def _profiles(directory, types):
    directory.mkdir()
    for device_type, seconds_per_sample in types:
        profile = synthetic_profile(
            device_type,
            zero_stage=1,
            max_micro_batch_size=16,
            overhead_s=0.001,
            seconds_per_sample=seconds_per_sample,
            world_size=2,
        )
        save_profile(profile, directory / f"{device_type}.json")
    return directory


def _resolve(cluster_path, section, *, world_size=2, zero_stage=1, broadcasts=None, global_batch=None):
    config = poplar_config_from_dict({"cluster": str(cluster_path), **section}, base_dir=cluster_path.parent)

    def broadcast(obj):
        if broadcasts is not None:
            broadcasts.append(obj)
        return obj

    return resolve_plan(
        config,
        load_cluster(cluster_path),
        world_size=world_size,
        rank=0,
        zero_stage=zero_stage,
        broadcast=broadcast,
        global_batch=global_batch,
    )


def test_search_at_start_broadcasts_the_plan(cluster_path, tmp_path):
    directory = _profiles(tmp_path / "profiles", [("fast", 0.001), ("slow", 0.004)])
    broadcasts = []
    plan = _resolve(cluster_path, {"profiles": str(directory), "global_batch_size": 20}, broadcasts=broadcasts)
    assert plan.global_batch_size == 20 and plan.zero_stage == 1
    assert plan.ranks[0].samples_per_iteration > plan.ranks[1].samples_per_iteration  # the fast rank gets more
    # Rank 0 says what must be measured (nothing), then sends the plan.
    assert [b["result"] for b in broadcasts][0] == [] and "ranks" in broadcasts[1]["result"]


def test_missing_profiles_name_type_stage_and_command(cluster_path, tmp_path):
    directory = _profiles(tmp_path / "profiles", [("fast", 0.001)])
    with pytest.raises(
        ValueError,
        match=r"lacks profiles for these device types and ZeRO stages \(stage 1: slow\)\. Measure them with "
        r"poplar-profile.*--zero-stages 1 --output-dir ",
    ):
        _resolve(cluster_path, {"profiles": str(directory), "global_batch_size": 20})


def test_no_profile_directory_at_all(cluster_path, tmp_path):
    with pytest.raises(
        ValueError, match=r"\(stage 0: fast, slow; stage 1: fast, slow; stage 2: fast, slow; stage 3: fast, slow\)"
    ):
        _resolve(cluster_path, {"profiles": str(tmp_path / "none"), "global_batch_size": "auto"}, zero_stage=None)


def test_missing_profiles_are_rank_0s_error_sent_to_every_rank(cluster_path, tmp_path):
    # Only rank 0 reads the profiles: the others learn of the error from its broadcast,
    # so a node without the profile directory never enters a measuring collective.
    broadcasts = []
    with pytest.raises(ValueError, match="lacks profiles"):
        _resolve(cluster_path, {"profiles": str(tmp_path / "none"), "global_batch_size": 20}, broadcasts=broadcasts)
    assert len(broadcasts) == 1 and "lacks profiles" in broadcasts[0]["error"]


def test_ranks_other_than_0_read_no_file(cluster_path, tmp_path):
    directory = _profiles(tmp_path / "profiles", [("fast", 0.001), ("slow", 0.004)])
    plan = _resolve(cluster_path, {"profiles": str(directory), "global_batch_size": 20})
    config = poplar_config_from_dict(
        {"cluster": str(cluster_path), "profiles": str(tmp_path / "absent"), "global_batch_size": 20}, base_dir=tmp_path
    )
    decisions = iter(
        [
            {"result": []},
            {"result": __import__("poplar_ext.plan.formats", fromlist=["plan_to_dict"]).plan_to_dict(plan)},
        ]
    )
    received = resolve_plan(
        config, load_cluster(cluster_path), world_size=2, rank=1, zero_stage=1, broadcast=lambda obj: next(decisions)
    )
    assert received == plan


def test_infeasible_search_is_a_value_error_on_every_rank(cluster_path, tmp_path):
    directory = _profiles(tmp_path / "profiles", [("fast", 0.001), ("slow", 0.004)])
    with pytest.raises(ValueError, match="the plan search found no feasible plan"):
        _resolve(cluster_path, {"profiles": str(directory), "global_batch_size": 1})


def test_broken_plan_file(cluster_path, tmp_path):
    (tmp_path / "plan.json").write_text("{")
    with pytest.raises(ValueError, match=r"poplar.plan: .*plan.json: \(line 1, column 2\): expected valid JSON"):
        _resolve(cluster_path, {"plan": str(tmp_path / "plan.json")})


def test_cluster_of_another_size(cluster_path, tmp_path):
    directory = _profiles(tmp_path / "profiles", [("fast", 0.001), ("slow", 0.004)])
    with pytest.raises(ValueError, match=r"The cluster description names 2 ranks but the job has 3 \(WORLD_SIZE\)"):
        _resolve(cluster_path, {"profiles": str(directory), "global_batch_size": 20}, world_size=3)


def _measurer(pairs_it_returns, calls, dtype="float32"):
    """A stand-in for the profiler: records what it was asked, returns profiles of some (type, stage) pairs
    measured in `dtype`."""

    def measure(missing, cluster):
        calls.append(sorted(missing))
        return [
            _in_dtype(
                synthetic_profile(
                    device_type,
                    zero_stage=stage,
                    max_micro_batch_size=16,
                    overhead_s=0.001,
                    seconds_per_sample=0.001,
                    world_size=2,
                ),
                dtype,
            )
            for device_type, stage in missing
            if (device_type, stage) in pairs_it_returns
        ]

    return measure


def _in_dtype(profile, dtype):
    return dataclasses.replace(profile, model=dataclasses.replace(profile.model, dtype=dtype))


def _searched_at_start(
    cluster_path, directory, measure, monkeypatch, zero_stage=None, dtype=None, read=None, job_key=None
):
    """The plan `resolve_plan` searches at start with `measure` for the missing profiles (of the synthetic
    model, for a job training in `dtype`), and the profiles it handed the search. `read`: a list that gets
    the job's `ProfileDirectory`, as re-balancing and steady emulation read it after."""
    import poplar_ext.search

    searched = []
    search_plan = poplar_ext.search.search_plan

    def recording(profiles, *args, **kwargs):
        searched.append(profiles)
        return search_plan(profiles, *args, **kwargs)

    monkeypatch.setattr(poplar_ext.search, "search_plan", recording)
    config = poplar_config_from_dict(
        {"cluster": str(cluster_path), "profiles": str(directory), "global_batch_size": 20},
        base_dir=cluster_path.parent,
    )
    profile_directory = ProfileDirectory(config, load_cluster(cluster_path), dtype=dtype, job_key=job_key)
    plan = resolve_plan(
        config,
        load_cluster(cluster_path),
        world_size=2,
        rank=0,
        zero_stage=zero_stage,
        broadcast=lambda o: o,
        measure_missing=measure,
        model_fingerprint=SYNTHETIC_MODEL.fingerprint,
        directory=profile_directory,
    )
    if read is not None:
        read.append(profile_directory)
    return plan, searched[0]


def test_measured_stages_are_recounted_after_profiling(cluster_path, tmp_path, monkeypatch):
    # Asked for every stage, the profiler brings back both types at stage 1 but only
    # "fast" at stage 3 (say "slow" fits nothing there): the search gets stage 1 only.
    calls = []
    returned = {("fast", 1), ("slow", 1), ("fast", 3)}
    plan, profiles = _searched_at_start(cluster_path, tmp_path / "none", _measurer(returned, calls), monkeypatch)
    assert len(calls) == 1 and len(calls[0]) == 8
    assert sorted((p.device_type, p.zero_stage) for p in profiles) == [("fast", 1), ("slow", 1)]
    assert plan.zero_stage == 1


def test_stored_profiles_of_another_dtype_are_measured_again(cluster_path, tmp_path, monkeypatch):
    # The model's fingerprint is taken before DeepSpeed casts it: a job switched from fp32 to bf16 finds
    # the fp32 profiles of its model, whose times and memory are not its own. They are measured again.
    directory = _profiles(tmp_path / "profiles", [("fast", 0.001), ("slow", 0.004)])
    calls = []
    measure = _measurer({("fast", 1), ("slow", 1)}, calls, dtype="bfloat16")
    _, profiles = _searched_at_start(cluster_path, directory, measure, monkeypatch, zero_stage=1, dtype="bfloat16")
    assert calls == [[("fast", 1), ("slow", 1)]]
    assert sorted((p.device_type, p.model.dtype) for p in profiles) == [("fast", "bfloat16"), ("slow", "bfloat16")]


def test_re_balancing_re_plans_from_the_profiles_measured_in_the_jobs_dtype(cluster_path, tmp_path, monkeypatch):
    # Re-balancing and steady emulation read the directory without a fingerprint, after the search: the
    # bf16 profiles measured at start (stored over the fp32 files) are the job's, not the fp32 ones read before.
    from poplar_ext.zero.planning import load_rebalance_inputs

    directory = _profiles(tmp_path / "profiles", [("fast", 0.001), ("slow", 0.004)])
    measure, read = _measurer({("fast", 1), ("slow", 1)}, [], dtype="bfloat16"), []
    plan, _ = _searched_at_start(
        cluster_path, directory, measure, monkeypatch, zero_stage=1, dtype="bfloat16", read=read
    )
    assert {p.model.dtype for p in read[0].profiles()} == {"bfloat16"}
    profiles, _ = load_rebalance_inputs(read[0].poplar_config, read[0].cluster, plan, directory=read[0])
    assert sorted((p.device_type, p.model.dtype) for p in profiles) == [("fast", "bfloat16"), ("slow", "bfloat16")]


def test_stored_profiles_of_the_jobs_dtype_are_reused(cluster_path, tmp_path, monkeypatch):
    directory = _profiles(tmp_path / "profiles", [("fast", 0.001), ("slow", 0.004)])
    calls = []
    _, profiles = _searched_at_start(cluster_path, directory, _measurer(set(), calls), monkeypatch, dtype="float32")
    assert calls == [] and {p.model.dtype for p in profiles} == {"float32"}


def _job_key(**changes):
    """The key the automatic mode's profiler gives the synthetic model's profiles on the fixture's cluster."""
    from poplar_ext.profiler.cache import JobKey

    key = JobKey(
        model_fingerprint=SYNTHETIC_MODEL.fingerprint,
        emulations={"fast": None, "slow": None},
        world_size=2,
        dtype="float32",
        sequence_length=None,
        torch_version="2.13.0",
        deepspeed_version="0.19.8",
        ds_config_fingerprint="sha256:sgd",
    )
    return dataclasses.replace(key, **changes)


@pytest.mark.parametrize(
    ("stored_with", "measured_again"),
    [
        ({}, False),
        ({"ds_config_fingerprint": "sha256:adam"}, True),  # another optimizer, ZeRO settings or offload section
        ({"deepspeed": "0.19.7"}, True),
        ({"sequence_length": 512}, False),  # initialize does not know the data's: poplar-profile's are reused
    ],
)
def test_the_automatic_mode_reuses_a_stored_profile_as_the_profilers_cache_would(
    cluster_path, tmp_path, monkeypatch, stored_with, measured_again
):
    directory = _profiles(tmp_path / "profiles", [("fast", 0.001), ("slow", 0.004)])
    provenance = {"source": "measured", "torch": "2.13.0", "deepspeed": "0.19.8", "ds_config_fingerprint": "sha256:sgd"}
    sequence_length = stored_with.pop("sequence_length", None)
    for path in directory.glob("*.json"):
        data = json.loads(path.read_text())
        data["measured_with"] = {**provenance, **stored_with}
        data["model"]["sequence_length"] = sequence_length
        path.write_text(json.dumps(data))
    calls = []
    measure = _measurer({("fast", 1), ("slow", 1)}, calls)
    _searched_at_start(cluster_path, directory, measure, monkeypatch, zero_stage=1, job_key=_job_key())
    assert calls == ([[("fast", 1), ("slow", 1)]] if measured_again else [])


@pytest.mark.parametrize(("size_limit", "measured_again"), [(16, False), (32, True)])
def test_the_automatic_mode_measures_again_a_profile_a_lower_size_limit_stopped(
    cluster_path, tmp_path, monkeypatch, size_limit, measured_again
):
    # Stopped at 16 by a run's lower limit: a job probing up to 32 would find more fit, as its cache would.
    from poplar_ext.profiler.measure import MeasureSettings

    directory = _profiles(tmp_path / "profiles", [("fast", 0.001), ("slow", 0.004)])
    settings = MeasureSettings(micro_batch_size_limit=size_limit, micro_batch_sizes=(1, 2, 4, 8, 16))
    for path in directory.glob("*.json"):
        data = json.loads(path.read_text())
        data["measured_with"] = {
            **{"source": "measured", "torch": "2.13.0", "deepspeed": "0.19.8", "ds_config_fingerprint": "sha256:sgd"},
            **{"warmup_micro_steps": settings.warmup_micro_steps, "repeats": settings.repeats},
            "largest_micro_batch_probe": {"limited_by_micro_batch_size_limit": True},
        }
        path.write_text(json.dumps(data))
    calls = []
    measure = _measurer({("fast", 1), ("slow", 1)}, calls)
    job_key = _job_key(settings=settings)
    _searched_at_start(cluster_path, directory, measure, monkeypatch, zero_stage=1, job_key=job_key)
    assert calls == ([[("fast", 1), ("slow", 1)]] if measured_again else [])


@pytest.mark.parametrize(("dtype", "measured_again"), [("float32", False), ("bfloat16", True)])
def test_the_automatic_mode_takes_profiles_it_did_not_measure_as_given_in_the_jobs_dtype(
    cluster_path, tmp_path, monkeypatch, dtype, measured_again
):
    # Modelled (or hand-written) profiles hold nothing to compare with the job's key: the user's word.
    directory = _profiles(tmp_path / "profiles", [("fast", 0.001), ("slow", 0.004)])
    assert {json.loads(p.read_text())["measured_with"]["source"] for p in directory.glob("*.json")} == {"modelled"}
    calls = []
    measure = _measurer({("fast", 1), ("slow", 1)}, calls)
    _searched_at_start(cluster_path, directory, measure, monkeypatch, zero_stage=1, job_key=_job_key(dtype=dtype))
    assert calls == ([[("fast", 1), ("slow", 1)]] if measured_again else [])


def test_profiling_that_brings_back_no_complete_stage_says_what_is_missing(cluster_path, tmp_path, monkeypatch):
    calls = []
    with pytest.raises(
        ValueError,
        match=r"after profiling, no ZeRO stage has a profile of every device type "
        r"\(missing: fast at stage 2; slow at stage 2\)",
    ):
        _searched_at_start(cluster_path, tmp_path / "none", _measurer(set(), calls), monkeypatch, zero_stage=2)
    assert calls == [[("fast", 2), ("slow", 2)]]


def test_rank_0_reads_the_profiles_and_the_network_file_once(cluster_path, tmp_path, monkeypatch):
    # Read, measured what was missing, searched: the search counts the measured profiles
    # without reading the directory again (rank 0 stored them there too).
    import poplar_ext.plan.network_format
    from poplar_ext.zero import planning

    reads = {"profiles": 0, "network": 0}

    def counted(name, read):
        def counting(*args, **kwargs):
            reads[name] += 1
            return read(*args, **kwargs)

        return counting

    monkeypatch.setattr(planning, "load_profiles", counted("profiles", planning.load_profiles))
    monkeypatch.setattr(
        poplar_ext.plan.network_format, "find_network", counted("network", poplar_ext.plan.network_format.find_network)
    )
    directory = _profiles(tmp_path / "profiles", [("fast", 0.001)])
    calls = []
    plan, profiles = _searched_at_start(cluster_path, directory, _measurer({("slow", 1)}, calls), monkeypatch, 1)
    assert calls == [[("slow", 1)]] and sorted(p.device_type for p in profiles) == ["fast", "slow"]
    assert reads == {"profiles": 1, "network": 1}


# -- a plan file against the job's global batch and profiles -------------------------------
import warnings  # noqa: E402

from poplar_ext.plan.formats import load_profiles, save_plan  # noqa: E402
from poplar_ext.runtime.config import GlobalBatchRequest, requested_global_batch_size  # noqa: E402
from poplar_ext.search import search_plan  # noqa: E402
from poplar_ext.zero.planning import StalePlanWarning  # noqa: E402


def _searched_plan(cluster_path, directory, tmp_path, batch=20):
    result = search_plan(load_profiles(directory), load_cluster(cluster_path), global_batch_size=batch, zero_stage=1)
    save_plan(result.plan, tmp_path / "plan.json")
    return tmp_path / "plan.json"


def test_a_plan_for_another_global_batch_is_refused(cluster_path, tmp_path):
    directory = _profiles(tmp_path / "profiles", [("fast", 0.001), ("slow", 0.004)])
    plan = _searched_plan(cluster_path, directory, tmp_path)
    config = poplar_config_from_dict({"cluster": str(cluster_path), "plan": str(plan)}, base_dir=tmp_path)
    with pytest.raises(
        ValueError,
        match=r"The plan's global batch is 20 but the config asks for 32 \(train_batch_size\)\. Make that 20, or "
        r"use a plan for 32\.",
    ):
        resolve_plan(
            config,
            load_cluster(cluster_path),
            world_size=2,
            rank=0,
            zero_stage=1,
            broadcast=lambda o: o,
            global_batch=GlobalBatchRequest(size=32, origin="train_batch_size"),
        )


@pytest.mark.parametrize("batch", [20, 21])
def test_a_plan_against_the_trainers_batch_names_the_deepspeed_batch_that_sets_it(cluster_path, tmp_path, batch):
    # A plan of 9 (3 x 2 and 1 x 3) on 2 ranks was told "Make that 9" of per_device_train_batch_size x
    # gradient_accumulation_steps x 2, which no arguments make; the config's train_batch_size does.
    directory = _profiles(tmp_path / "profiles", [("fast", 0.001), ("slow", 0.004)])
    plan = _searched_plan(cluster_path, directory, tmp_path, batch=batch)
    config = poplar_config_from_dict({"cluster": str(cluster_path), "plan": str(plan)}, base_dir=tmp_path)
    origin = "TrainingArguments per_device_train_batch_size x gradient_accumulation_steps x world size (2 x 1 x 2)"
    with pytest.raises(ValueError) as refused:
        resolve_plan(
            config,
            load_cluster(cluster_path),
            world_size=2,
            rank=0,
            zero_stage=1,
            broadcast=lambda o: o,
            global_batch=GlobalBatchRequest(size=4, origin=origin),
        )
    message = str(refused.value)
    assert (
        f"The plan's global batch is {batch} but the config asks for 4 ({origin}). Make that {batch}, or use a "
        in message
    )
    assert f"Or set train_batch_size {batch} in the DeepSpeed config" in message
    assert ("no multiple of the 2 ranks" in message) == (batch % 2 == 1)


@pytest.mark.parametrize(
    ("section", "global_batch", "found"),
    [
        ({"global_batch_size": 20}, None, "20, from poplar.global_batch_size"),
        ({}, GlobalBatchRequest(size=32, origin="train_batch_size"), "32, from train_batch_size"),
    ],
)
def test_a_max_global_batch_below_the_jobs_batch_is_refused(cluster_path, tmp_path, section, global_batch, found):
    # Two settings that contradict each other: the error names the config's field and where the batch came from,
    # not the search's argument names.
    directory = _profiles(tmp_path / "profiles", [("fast", 0.001), ("slow", 0.004)])
    expected = (
        rf"^<DeepSpeed config dict>: poplar.max_global_batch_size: expected at least the global batch \({found}\) "
        r"or no poplar.max_global_batch_size, found number 10$"
    )
    section = {"profiles": str(directory), "max_global_batch_size": 10, **section}
    with pytest.raises(ValueError, match=expected):
        _resolve(cluster_path, section, global_batch=global_batch)


def test_a_plan_above_the_max_global_batch_is_refused(cluster_path, tmp_path):
    directory = _profiles(tmp_path / "profiles", [("fast", 0.001), ("slow", 0.004)])
    plan = _searched_plan(cluster_path, directory, tmp_path)
    section = {"plan": str(plan), "max_global_batch_size": 10}
    # The refusal of a batch the config sets (PoplarConfig.batch_above_bound), the plan file named as its origin.
    expected = (
        rf"^<DeepSpeed config dict>: poplar.max_global_batch_size: expected at least the global batch \(20, from "
        rf"poplar.plan {re.escape(str(plan))}\) or no poplar.max_global_batch_size, found number 10$"
    )
    with pytest.raises(ValueError, match=expected):
        _resolve(cluster_path, section)
    assert _resolve(cluster_path, {**section, "max_global_batch_size": 20}).global_batch_size == 20


def test_no_global_batch_for_the_search_says_what_to_set(cluster_path, tmp_path):
    directory = _profiles(tmp_path / "profiles", [("fast", 0.001), ("slow", 0.004)])
    with pytest.raises(
        ValueError,
        match=r"no global batch for the plan search: set train_batch_size .* or "
        r'poplar.global_batch_size: "auto" to let the search pick',
    ):
        _resolve(cluster_path, {"profiles": str(directory)})


@pytest.mark.parametrize(
    ("batch_keys", "left_auto"),
    [
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"}, "gradient_accumulation_steps"),
        ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"},
         "train_batch_size and gradient_accumulation_steps"),
    ],
)  # fmt: skip
def test_a_batch_left_auto_under_plain_initialize_says_who_fills_it(cluster_path, tmp_path, batch_keys, left_auto):
    # Outside the Trainer and accelerate nobody fills "auto": the batch stays unset, and the error must say why.
    directory = _profiles(tmp_path / "profiles", [("fast", 0.001), ("slow", 0.004)])
    config = poplar_config_from_dict({"profiles": str(directory)}, base_dir=tmp_path)
    with pytest.raises(
        ValueError,
        match=rf'no global batch for the plan search: "auto" in {left_auto} was not filled in \(the Hugging Face '
        r"Trainer and accelerate fill it from their batch size; poplar_ext.initialize does not\): give a number "
        r"there instead, or set train_batch_size",
    ):
        _resolve(cluster_path, {"profiles": str(directory)}, global_batch=requested_global_batch_size(
            config, batch_keys, world_size=2))  # fmt: skip


def test_auto_lets_the_search_pick_the_batch(cluster_path, tmp_path):
    directory = _profiles(tmp_path / "profiles", [("fast", 0.001), ("slow", 0.004)])
    plan = _resolve(
        cluster_path, {"profiles": str(directory), "global_batch_size": "auto", "max_global_batch_size": 40}
    )
    assert 2 <= plan.global_batch_size <= 40


def test_a_plan_from_other_profiles_warns(cluster_path, tmp_path):
    directory = _profiles(tmp_path / "profiles", [("fast", 0.001), ("slow", 0.004)])
    plan = _searched_plan(cluster_path, directory, tmp_path)
    section = {"cluster": str(cluster_path), "plan": str(plan), "profiles": str(directory)}
    config = poplar_config_from_dict(section, base_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the profiles the plan was made from: no warning
        resolve_plan(config, load_cluster(cluster_path), world_size=2, rank=0, zero_stage=1, broadcast=lambda o: o)
    # Measured again: slow's profile changed.
    slow = next(p for p in load_profiles(directory) if p.device_type == "slow")
    save_profile(
        dataclasses.replace(slow, optimizer_step_time_s=slow.optimizer_step_time_s + 0.5), directory / "slow.json"
    )
    with pytest.warns(
        StalePlanWarning,
        match=r"plan.json: this plan was made from other profiles of slow than those in .*search the plan again",
    ):
        resolve_plan(config, load_cluster(cluster_path), world_size=2, rank=0, zero_stage=1, broadcast=lambda o: o)


def test_a_policy_beside_a_plan_file_must_be_the_plans(cluster_path, tmp_path):
    # The plan file's allocation is trained as it is: another policy in the config would be silently ignored.
    directory = _profiles(tmp_path / "profiles", [("fast", 0.001), ("slow", 0.004)])
    plan = _searched_plan(cluster_path, directory, tmp_path)  # made by the poplar policy
    with pytest.raises(
        ValueError,
        match=r"^<DeepSpeed config dict>: poplar.policy: expected 'poplar' \(the policy poplar.plan .*plan.json was "
        r"made by: a policy only chooses a plan searched at start\) or no poplar.policy, found 'uniform' beside "
        r"poplar.plan$",
    ):
        _resolve(cluster_path, {"plan": str(plan), "policy": "uniform"})
    assert _resolve(cluster_path, {"plan": str(plan), "policy": "poplar"}).policy == "poplar"  # one thing said


@pytest.mark.parametrize(("name", "found"), [("profiels", "nothing at"), ("plan.json", "the file")])
def test_profiles_named_beside_a_plan_must_be_a_directory(cluster_path, tmp_path, name, found):
    # Beside a plan nothing is measured into the folder: a misspelt one would silently read as "no profiles".
    directory = _profiles(tmp_path / "profiles", [("fast", 0.001), ("slow", 0.004)])
    plan = _searched_plan(cluster_path, directory, tmp_path)
    with pytest.raises(
        ValueError,
        match=rf"^<DeepSpeed config dict>: poplar.profiles: expected a directory of profiles beside poplar.plan "
        rf"\(.*\), found {found} .*{name}$",
    ):
        _resolve(cluster_path, {"plan": str(plan), "profiles": str(tmp_path / name)})


def test_profiles_named_without_a_plan_are_where_missing_ones_go_and_the_error_names_the_config(cluster_path, tmp_path):
    # Without a plan the folder is where the automatic mode measures into (made when missing); where nothing
    # can measure, the error names the config's field as the one beside a plan does.
    with pytest.raises(ValueError, match=r"^<DeepSpeed config dict>: poplar.profiles: no plan was given and .*none "):
        _resolve(cluster_path, {"profiles": str(tmp_path / "none"), "global_batch_size": 20})


@pytest.mark.parametrize(
    ("named", "setting"),
    [
        (True, r"<DeepSpeed config dict>: poplar.profiles"),
        # Not named in the section: the message names the variable, not a key the config lacks.
        (
            False,
            r"\$POPLAR_PROFILES_DIR \(the automatic mode's profiles: <DeepSpeed config dict> names no poplar.plan "
            r"or poplar.profiles\)",
        ),
    ],
)
def test_profiles_that_name_a_file_are_refused(cluster_path, tmp_path, monkeypatch, named, setting):
    (tmp_path / "profiles.json").write_text("{}")
    monkeypatch.setenv("POPLAR_PROFILES_DIR", str(tmp_path / "profiles.json"))
    section = {"profiles": str(tmp_path / "profiles.json")} if named else {}
    with pytest.raises(
        ValueError, match=rf"^{setting}: expected a directory of profiles .*, found the file .*profiles.json$"
    ):
        _resolve(cluster_path, {**section, "global_batch_size": 20})


def test_missing_profiles_command_without_a_cluster_file_leaves_cluster_out(cluster_path, tmp_path):
    # A job without poplar.cluster reads its cluster from the hardware; so does poplar-profile without
    # --cluster. The suggested command must not name a file called "None".
    directory = _profiles(tmp_path / "profiles", [("fast", 0.001)])
    config = poplar_config_from_dict({"profiles": str(directory), "global_batch_size": 20}, base_dir=tmp_path)
    with pytest.raises(ValueError, match=r"Measure them with poplar-profile") as raised:
        resolve_plan(config, load_cluster(cluster_path), world_size=2, rank=0, zero_stage=1, broadcast=lambda obj: obj)
    assert "--cluster" not in str(raised.value)
    assert "--module poplar_ext.profiler --deepspeed_config DS.json --model MODULE:FACTORY" in str(raised.value)


def test_runtime_plan_problems_says_batch_counts_then_stage(cluster_path, tmp_path):
    """The ZeRO job's own checks in their order: global batch, world size, cluster, stage; "auto" compares nothing."""
    from poplar_ext.plan.formats import cluster_from_dict, load_plan
    from poplar_ext.zero import planning
    from poplar_ext.zero.planning import check_plan_for_job, runtime_plan_problems

    assert "runtime_plan_problems" in planning.__all__
    directory = _profiles(tmp_path / "profiles", [("fast", 0.001), ("slow", 0.004)])
    plan = load_plan(_searched_plan(cluster_path, directory, tmp_path))  # 2 ranks, stage 1, batch 20
    node = {"name": "n0", "devices": [{"device_type": "fast", "count": 4}]}
    cluster = cluster_from_dict({"schema_version": 1, "nodes": [node]})
    batch = GlobalBatchRequest(size=32, origin="train_batch_size")
    problems = runtime_plan_problems(plan, cluster, world_size=3, zero_stage=2, global_batch=batch)
    assert [p.split(" ")[:3] for p in problems] == [
        ["The", "plan's", "global"],
        ["The", "plan", "names"],
        ["The", "cluster", "description"],
        ["The", "plan", "is"],
    ]
    auto = GlobalBatchRequest(size="auto", origin="poplar.global_batch_size")
    assert (
        runtime_plan_problems(plan, load_cluster(cluster_path), world_size=2, zero_stage=None, global_batch=auto) == []
    )
    with pytest.raises(ValueError, match=r"global batch is 20 .* names 2 ranks but the job has 3"):
        check_plan_for_job(plan, cluster, world_size=3, zero_stage=2, global_batch=batch)
