"""Round trips and error messages of the three file formats (poplar_ext/plan/formats.py)."""

import copy

import pytest

from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import (
    cluster_from_dict,
    cluster_to_dict,
    plan_from_dict,
    profile_from_dict,
    profile_to_dict,
)


def good_profile():
    return {
        "schema_version": 1,
        "device_type": "A100-80GB",
        "memory_capacity_bytes": 80_000_000_000,
        "zero_stage": 2,
        "world_size": 3,
        "model": {"name": "m", "fingerprint": "f", "num_parameters": 5, "dtype": "float32"},
        "max_micro_batch_size": 4,
        "samples": [
            {"micro_batch_size": 1, "micro_step_time_s": 0.1, "peak_memory_bytes": 5},
            {"micro_batch_size": 4, "micro_step_time_s": 0.3, "peak_memory_bytes": 8},
        ],
        "optimizer_step_time_s": 0.01,
        "emulated": None,
        "measured_with": {"source": "measured"},
    }


def good_plan():
    return {
        "schema_version": 1,
        "policy": "poplar",
        "zero_stage": 1,
        "global_batch_size": 10,
        "ranks": [
            {"rank": 0, "device_type": "a", "micro_batch_size": 4, "gradient_accumulation_steps": 2},
            {"rank": 1, "device_type": "b", "micro_batch_size": 2, "gradient_accumulation_steps": 1},
        ],
        "predicted": {"iteration_time_s": 1.0, "samples_per_s": 10.0, "ideal_samples_per_s": 11.0},
        "profile_fingerprints": {"a": "sha256:x", "b": "sha256:y"},
    }


def test_profile_round_trip():
    profile = profile_from_dict(good_profile())
    assert profile_from_dict(profile_to_dict(profile)) == profile
    assert profile.fingerprint.startswith("sha256:")


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.pop("device_type"), r"f.json: device_type: expected a value, found nothing"),
        (lambda d: d["model"].pop("fingerprint"), r"model.fingerprint: expected a value"),
        (lambda d: d.update(zero_stage=4), r"zero_stage: expected an integer from 0 to 3, found number 4"),
        (lambda d: d.update(zero_stage="2"), r"zero_stage: expected an integer from 0 to 3, found string '2'"),
        (lambda d: d.update(schema_version=2), r"schema_version: expected schema_version 1, found number 2"),
        (
            lambda d: d["samples"][1].update(micro_step_time_s=0),
            r"samples\[1\].micro_step_time_s: expected a number from 1e-09 to 1e\+06, found number 0",
        ),
        (
            lambda d: d["samples"][0].update(micro_batch_size=-1),
            r"samples\[0\].micro_batch_size: expected an integer from 1 to 1048576, found number -1",
        ),
        (
            lambda d: d["samples"][1].update(micro_batch_size=1),
            r"samples\[1\].micro_batch_size: expected a micro_batch_size larger",
        ),
        (lambda d: d.update(max_micro_batch_size=2), r"max_micro_batch_size: expected at least the largest sampled"),
        (lambda d: d["model"].update(dtype="int8"), r"model.dtype: expected one of 'float32'"),
        (
            lambda d: d["measured_with"].update(source="guessed"),
            r"measured_with.source: expected one of 'measured', 'modelled'",
        ),
        (lambda d: d.update(samples=[]), r"samples: expected a list of at least 1 item"),
    ],
)
def test_profile_errors_name_file_and_field(mutate, match):
    data = copy.deepcopy(good_profile())
    mutate(data)
    with pytest.raises(FormatError, match=match):
        profile_from_dict(data, source="f.json")


@pytest.mark.parametrize("flag", ["false", "yes", 0, 1, []])
def test_a_profile_whose_communication_flag_is_no_boolean_is_refused(flag):
    # The cost model reads measured_with.micro_step_times_include_communication only when it is a boolean, else it
    # goes by the clock: "false" on a profile timed by CUDA events was taken as true, unnoticed.
    data = copy.deepcopy(good_profile())
    data["measured_with"]["micro_step_times_include_communication"] = flag
    with pytest.raises(
        FormatError,
        match=r"^f.json: measured_with.micro_step_times_include_communication: expected true or false, found ",
    ):
        profile_from_dict(data, source="f.json")
    for flag in (True, False, None):  # null: as absent, the clock says
        data["measured_with"]["micro_step_times_include_communication"] = flag
        assert profile_from_dict(data, source="f.json").measured_with["micro_step_times_include_communication"] is flag


def test_cluster_rank_order_and_round_trip():
    cluster = cluster_from_dict(
        {
            "schema_version": 1,
            "nodes": [
                {"name": "n0", "devices": [{"device_type": "a", "count": 2}]},
                {"name": "n1", "devices": [{"device_type": "b", "count": 1}, {"device_type": "a", "count": 1}]},
            ],
            "device_types": {"b": {"emulation": {"slowdown": 2.0, "memory_capacity_bytes": 100}}},
        }
    )
    assert cluster.rank_device_types == ("a", "a", "b", "a")
    assert cluster.emulation_of("a") is None and cluster.emulation_of("b").slowdown == 2.0
    assert cluster_from_dict(cluster_to_dict(cluster)) == cluster


def test_cluster_errors():
    base = {"schema_version": 1, "nodes": [{"name": "n0", "devices": [{"device_type": "a", "count": 0}]}]}
    with pytest.raises(
        FormatError, match=r"c.json: nodes\[0\].devices\[0\].count: expected an integer from 1 to 65536, found number 0"
    ):
        cluster_from_dict(base, source="c.json")
    base["nodes"][0]["devices"][0]["count"] = 1
    base["device_types"] = {"z": {}}
    with pytest.raises(FormatError, match=r"device_types.z: expected a device type that some node uses"):
        cluster_from_dict(base, source="c.json")


def test_plan_checks_sum_and_rank_order():
    assert plan_from_dict(good_plan()).world_size == 2
    bad = good_plan()
    bad["global_batch_size"] = 11
    with pytest.raises(FormatError, match=r"global_batch_size: expected the sum over ranks .* \(10\), found number 11"):
        plan_from_dict(bad, source="p.json")
    bad = good_plan()
    bad["ranks"][1]["rank"] = 5
    with pytest.raises(FormatError, match=r"ranks\[1\].rank: expected rank 1"):
        plan_from_dict(bad, source="p.json")
