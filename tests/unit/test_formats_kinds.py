"""A file of another of the project's formats, read where one format is expected, is named for what it is
(poplar_ext/plan/kinds.py), not reported as a misspelt key with a misleading "did you mean"."""

import dataclasses
import json
import shutil
import warnings
from pathlib import Path

import pytest

from poplar_ext.plan import kinds
from poplar_ext.plan.errors import FormatError, WrongFormatError
from poplar_ext.plan.formats import (
    Cluster,
    Plan,
    Profile,
    cluster_from_dict,
    is_cluster_or_plan,
    load_profiles,
    plan_from_dict,
    profile_from_dict,
)
from poplar_ext.plan.network_format import NetworkProfile, network_from_dict
from poplar_ext.plan.pipeline_formats import (
    LayerProfile,
    PipelinePlan,
    any_plan_from_dict,
    layer_profile_from_dict,
    pipeline_plan_from_dict,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "poplar_ext" / "search" / "example_profiles"
PREDICTED = {"iteration_time_s": 1.0, "samples_per_s": 20.0, "ideal_samples_per_s": 25.0}
DS_CONFIG = {"gradient_clipping": 1.0, "zero_optimization": {"stage": 1}, "optimizer": {"type": "Adam"}}


def _example(name: str) -> dict:
    return json.loads((EXAMPLES / name).read_text())


def _files() -> dict[str, dict]:
    """One file of every format, as parsed JSON."""
    stage = {"rank": 0, "device_type": "a", "first_layer": 0, "last_layer": 0}
    return {
        "profile": _example("gpt2-small-124m.v100-16gb.stage1.json"),
        "layer profile": _example("layers/gpt2-small-124m.a100-80gb.stage0.json"),
        "cluster": _example("cluster.json"),
        "network": json.loads(next((EXAMPLES / "network").glob("*.json")).read_text()),
        "plan": {
            "schema_version": 1,
            "policy": "poplar",
            "zero_stage": 1,
            "global_batch_size": 4,
            "ranks": [{"rank": 0, "device_type": "a", "micro_batch_size": 2, "gradient_accumulation_steps": 2}],
            "predicted": PREDICTED,
            "profile_fingerprints": {},
        },
        "pipeline plan": {
            "schema_version": 1,
            "parallelism": "pipeline",
            "policy": "poplar",
            "zero_stage": 1,
            "global_batch_size": 4,
            "num_layers": 1,
            "pipelines": [{"stages": [stage], "micro_batch_size": 2, "num_micro_batches": 2}],
            "predicted": PREDICTED,
            "profile_fingerprints": {},
        },
        "DeepSpeed config": DS_CONFIG,
    }


READERS = {
    "profile": (profile_from_dict, "a profile"),
    "layer profile": (layer_profile_from_dict, "a layer profile"),
    "cluster": (cluster_from_dict, "a cluster description"),
    "network": (network_from_dict, "a network file"),
    "plan": (plan_from_dict, "a plan"),
    "pipeline plan": (pipeline_plan_from_dict, "a pipeline plan"),
}
FOUND = {
    "profile": "a profile (its keys 'max_micro_batch_size', 'optimizer_step_time_s', 'samples')",
    "layer profile": "a layer profile (its keys 'base_memory_bytes', 'layers')",
    "cluster": "a cluster description (its keys 'device_types', 'nodes')",
    "network": "a network file (its keys 'backend', 'cluster_key', 'collectives' and 2 more)",
    "plan": "a plan (its keys 'ranks')",
    "pipeline plan": "a pipeline plan (its keys 'num_layers', 'pipelines')",
    "DeepSpeed config": "a DeepSpeed config (its keys 'gradient_clipping', 'optimizer', 'zero_optimization')",
}


def test_every_file_is_read_by_its_own_reader():
    files = _files()
    for name, (read, _) in READERS.items():
        read(files[name], source="f.json")
    assert isinstance(any_plan_from_dict(files["pipeline plan"]), PipelinePlan)


# A ZeRO plan's reader refuses a pipeline plan by its parallelism (test_pipeline_formats), before its keys.
PAIRS = [
    (expected, given)
    for expected in READERS
    for given in FOUND
    if given != expected and (expected, given) != ("plan", "pipeline plan")
]


@pytest.mark.parametrize(("expected", "given"), PAIRS)
def test_a_file_of_another_format_is_named_for_what_it_is(expected, given):
    read, expected_name = READERS[expected]
    with pytest.raises(WrongFormatError) as caught:
        read(_files()[given], source="x.json")
    error = caught.value
    assert isinstance(error, FormatError)
    assert (error.source, error.field, error.expected, error.found) == ("x.json", "(file)", expected_name, FOUND[given])
    assert str(error) == f"x.json: (file): expected {expected_name}, found {FOUND[given]}"
    assert "did you mean" not in str(error) and "\n" not in str(error)


def test_a_plan_of_another_format_is_named_where_either_kind_of_plan_is_read():
    with pytest.raises(WrongFormatError, match=r"^p.json: \(file\): expected a plan, found a cluster description"):
        any_plan_from_dict(_files()["cluster"], source="p.json")


def test_a_broken_file_of_no_other_format_keeps_its_message():
    # Keys of the expected format beside another's: a broken file of this format, its stray key named as before.
    profile = {**_files()["profile"], "nodes": []}
    with pytest.raises(FormatError, match=r"^p.json: nodes: expected one of the keys .*found the unknown key 'nodes'$"):
        profile_from_dict(profile, source="p.json")
    # Keys of two other formats: no one format to name.
    mixed = {"schema_version": 1, "samples": [], "nodes": []}
    with pytest.raises(FormatError, match=r"^c.json: samples: expected one of the keys .*the unknown key 'samples'$"):
        cluster_from_dict(mixed, source="c.json")
    # No format's keys: the misspelt key and its closest known key, as before.
    with pytest.raises(FormatError, match=r"c.json: node: expected .* \(did you mean 'nodes'\?\), found the unknown"):
        cluster_from_dict({"schema_version": 1, "node": []}, source="c.json")


def test_each_formats_own_keys_are_its_alone():
    classes = {
        "Profile": Profile,
        "LayerProfile": LayerProfile,
        "Cluster": Cluster,
        "Plan": Plan,
        "PipelinePlan": PipelinePlan,
        "NetworkProfile": NetworkProfile,
    }
    fields = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in classes.items()}
    fields["NetworkProfile"].add("kind")
    fields["Plan"].add("parallelism")
    for fmt in kinds.FORMATS:
        assert fmt.keys and (fmt.reader == "" or set(fmt.keys) <= fields[fmt.reader]), fmt.name
        others = set().union(*(keys for reader, keys in fields.items() if reader != fmt.reader))
        assert not set(fmt.keys) & others, fmt.name


@pytest.mark.parametrize(
    "config",
    [
        DS_CONFIG,
        {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True}},
        {"poplar": {"profiles": "prof"}, "fp16": {"enabled": True}, "steps_per_print": 10},
    ],
)
def test_a_deepspeed_config_beside_the_profiles_is_skipped_like_a_cluster(tmp_path, config):
    folder = tmp_path / "prof"
    shutil.copytree(EXAMPLES, folder)
    (folder / "ds.json").write_text(json.dumps(config))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # skipped without a word, as the cluster.json beside them is
        profiles = load_profiles(folder)
    assert len(profiles) == 8 and {p.device_type for p in profiles} == {"A100-80GB", "V100-16GB"}
    assert is_cluster_or_plan(config)  # the profile cache skips it alike


def test_a_profile_with_a_deepspeed_key_is_still_a_broken_profile(tmp_path):
    profile = {**_files()["profile"], "fp16": {"enabled": True}}
    assert not is_cluster_or_plan(profile)
    (tmp_path / "p.json").write_text(json.dumps(profile))
    with pytest.raises(FormatError, match=r"p.json: fp16: expected one of the keys .*found the unknown key 'fp16'$"):
        load_profiles(tmp_path)


def _search_outputs() -> dict[str, dict]:
    """What ``poplar-search --json`` prints with ``--policy all`` (a plan per policy) and ``--parallelism auto`` (the
    ZeRO and the pipeline plan, and which was chosen): not plans, though made of them."""
    files = _files()
    return {
        "--policy all": {"uniform": None, "proportional": files["plan"], "poplar": files["plan"]},
        "--parallelism auto": {"chosen": "pipeline", "zero": files["plan"], "pipeline": files["pipeline plan"]},
    }


@pytest.mark.parametrize("option", ["--policy all", "--parallelism auto"])
def test_the_search_json_of_several_plans_is_named_where_a_plan_is_read(tmp_path, option):
    # `--policy all --json > plan.json` was read as "a DeepSpeed config (its keys 'poplar')", and
    # `--parallelism auto --json` as a plan with the unknown key 'chosen'; beside the profiles, the latter was
    # refused as a profile with that unknown key.
    data = _search_outputs()[option]
    named = f"found the JSON that poplar-search {option} prints"
    for read in (plan_from_dict, any_plan_from_dict, pipeline_plan_from_dict):
        with pytest.raises(WrongFormatError, match=rf"^p.json: \(file\): expected a (pipeline )?plan, {named}"):
            read(data, source="p.json")
    folder = tmp_path / "prof"
    shutil.copytree(EXAMPLES, folder)
    (folder / "out.json").write_text(json.dumps(data))
    assert is_cluster_or_plan(data) and len(load_profiles(folder)) == 8  # skipped, as a plan beside them is
    with pytest.raises(WrongFormatError, match=rf"^p.json: \(file\): expected a cluster description, {named}"):
        cluster_from_dict(data, source="p.json")
