"""Bad input to the formats and to `poplar-search`: a clear error naming the file and the
field, exit 2 and no output file; never a traceback, a MemoryError or a hang.
An internal error is exit 3 in one line; --debug shows its traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from poplar_bench.synthetic import synthetic_profile
from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import (
    MAX_GLOBAL_BATCH_SIZE,
    MAX_WORLD_SIZE,
    cluster_from_dict,
    load_cluster,
    plan_from_dict,
    plan_to_dict,
    profile_from_dict,
    profile_to_dict,
    read_json,
)
from poplar_ext.search import cli

EXAMPLES = Path(__file__).resolve().parents[2] / "poplar_ext" / "search" / "example_profiles"
CLUSTER = EXAMPLES / "cluster.json"
A100_STAGE0 = EXAMPLES / "gpt2-small-124m.a100-80gb.stage0.json"


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _copy_examples(tmp_path: Path) -> Path:
    directory = tmp_path / "profiles"
    shutil.copytree(EXAMPLES, directory)
    (directory / "cluster.json").unlink()
    return directory


def _bad_exit(capsys, tmp_path, *argv, profiles=EXAMPLES, cluster=CLUSTER):
    target = tmp_path / "plan.json"
    code, out, err = run(capsys, "--profiles", profiles, "--cluster", cluster, *argv, "--output", target)
    assert code == 2, (code, err)
    assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not target.exists()
    return err


# -- sizes beyond what the search can do ---------------------------------------------
@pytest.mark.parametrize(
    "batch", [str(10**30), "100000000000000", "10000000000000000000", str(MAX_GLOBAL_BATCH_SIZE + 1)]
)
def test_a_global_batch_beyond_the_limit_is_bad_input(capsys, tmp_path, batch):
    err = _bad_exit(capsys, tmp_path, "--global-batch-size", batch, "--zero-stage", "0")
    assert f"argument --global-batch-size: expected at most {MAX_GLOBAL_BATCH_SIZE} (the search's limit)" in err


def test_a_float_global_batch_is_an_argument_error(capsys, tmp_path):
    err = _bad_exit(capsys, tmp_path, "--global-batch-size", "1e30")
    assert "--global-batch-size" in err and "expected a positive integer, found '1e30'" in err


def test_a_huge_max_micro_batch_size_names_the_file_and_field(capsys, tmp_path):
    profiles = _copy_examples(tmp_path)
    path = profiles / A100_STAGE0.name
    data = json.loads(path.read_text())
    data["max_micro_batch_size"] = 10**12
    path.write_text(json.dumps(data))
    err = _bad_exit(capsys, tmp_path, "--global-batch-size", "512", profiles=profiles)
    assert f"{path}: max_micro_batch_size: expected an integer from 0 to 1048576, found number {10**12}" in err


@pytest.mark.parametrize("count", [10**12, MAX_WORLD_SIZE + 1])
def test_a_huge_cluster_is_bad_input(capsys, tmp_path, count):
    data = json.loads(CLUSTER.read_text())
    data["nodes"][0]["devices"][0]["count"] = count
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps(data))
    err = _bad_exit(capsys, tmp_path, "--global-batch-size", "512", cluster=cluster)
    assert f"{cluster}: nodes[0].devices[0].count: expected" in err


def test_the_cluster_total_is_held_to_the_limit():
    nodes = [{"name": f"n{i}", "devices": [{"device_type": "A", "count": MAX_WORLD_SIZE // 2}]} for i in range(3)]
    with pytest.raises(
        FormatError,
        match=r"c.json: nodes\[2\].devices\[0\].count: expected a count that keeps the cluster within "
        rf"{MAX_WORLD_SIZE} ranks",
    ):
        cluster_from_dict({"schema_version": 1, "nodes": nodes}, source="c.json")


def test_deeply_nested_json_names_the_file(capsys, tmp_path):
    cluster = tmp_path / "cluster.json"
    cluster.write_text('{"schema_version": 1, "nodes": ' + "[" * 100_000 + "]" * 100_000 + "}")
    err = _bad_exit(capsys, tmp_path, "--global-batch-size", "512", cluster=cluster)
    assert f"{cluster}: (file): expected JSON nested at most 64 deep, found deeper nesting" in err


def test_deep_nesting_in_free_form_provenance_is_refused():
    data = profile_to_dict(
        synthetic_profile("A", zero_stage=0, max_micro_batch_size=4, overhead_s=0.1, seconds_per_sample=0.01)
    )
    nested: list = []
    for _ in range(100):
        nested = [nested]
    data["measured_with"]["notes"] = nested
    with pytest.raises(FormatError, match=r"p.json: measured_with: expected JSON nested at most 64 deep"):
        profile_from_dict(data, source="p.json")


def test_a_file_that_is_not_utf8_is_named(capsys, tmp_path):
    cluster = tmp_path / "cluster.json"
    data = json.loads(CLUSTER.read_text())
    data["nodes"][0]["name"] = "n\u0153ud"
    cluster.write_bytes(json.dumps(data, ensure_ascii=False).encode("cp1252"))  # a Windows editor's encoding
    err = _bad_exit(capsys, tmp_path, "--global-batch-size", "512", cluster=cluster)
    assert f"{cluster}: (file): expected a UTF-8 JSON file, found a byte that is not UTF-8 at offset" in err


def test_read_json_names_the_file_for_every_failure(tmp_path):
    path = tmp_path / "x.json"
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(FormatError, match="x.json: \\(file\\): expected a UTF-8 JSON file"):
        read_json(path)


@pytest.mark.parametrize(
    ("write", "field", "expected", "found"),
    [
        (
            lambda p: p.write_text('{"nodes": '),
            "(line 1, column 11)",
            "valid JSON",
            "the end of the file (it stops early)",
        ),
        (
            lambda p: p.write_text('{"nodes": ,}'),
            "(line 1, column 11)",
            "valid JSON",
            "a syntax error (Expecting value)",
        ),
        (lambda p: None, "(file)", "a readable JSON file", "no such file"),
        (lambda p: p.mkdir(), "(file)", "a readable JSON file", "a folder"),
    ],
    ids=["cut short", "syntax", "missing", "folder"],
)
def test_unreadable_json_is_said_in_words(tmp_path, write, field, expected, found):
    path = tmp_path / "x.json"
    write(path)
    with pytest.raises(FormatError) as caught:
        read_json(path)
    assert str(caught.value) == f"{path}: {field}: expected {expected}, found {found}"


def test_a_key_given_twice_is_an_error_not_the_last_one_kept(tmp_path, capsys):
    # json keeps the last of a key given twice: a second "emulation" would replace the first without a word
    cluster = tmp_path / "cluster.json"
    text = CLUSTER.read_text()
    cluster.write_text(text.replace('"nodes"', '"schema_version": 1, "nodes"', 1))
    err = _bad_exit(capsys, tmp_path, "--global-batch-size", "512", cluster=cluster)
    assert f"{cluster}: (file): expected each key once in an object, found the key 'schema_version' twice" in err


# -- unknown keys: never ignored, the closest known key named ---------------------------
def test_a_misspelt_emulation_key_is_not_a_real_device():
    data = {
        "schema_version": 1,
        "nodes": [{"name": "n", "devices": [{"device_type": "slow", "count": 1}]}],
        "device_types": {"slow": {"emulate": {"slowdown": 2.0, "memory_capacity_bytes": 10**9}}},
    }
    with pytest.raises(
        FormatError,
        match=r"c.json: device_types.slow.emulate: expected one of the keys 'emulation' "
        r"\(did you mean 'emulation'\?\), found the unknown key 'emulate'",
    ):
        cluster_from_dict(data, source="c.json")


@pytest.mark.parametrize(
    ("mutate", "path", "suggestion"),
    [
        (lambda d: d.update(max_micro_batch=8), "max_micro_batch", "max_micro_batch_size"),
        (lambda d: d["model"].update(dtpye="float32"), "model.dtpye", "dtype"),
        (lambda d: d["samples"][0].update(micro_step_time=0.1), r"samples\[0\].micro_step_time", "micro_step_time_s"),
    ],
)
def test_unknown_profile_keys(mutate, path, suggestion):
    data = profile_to_dict(
        synthetic_profile("A", zero_stage=0, max_micro_batch_size=8, overhead_s=0.1, seconds_per_sample=0.01)
    )
    mutate(data)
    with pytest.raises(
        FormatError, match=rf"p.json: {path}: expected one of the keys .*\(did you mean '{suggestion}'\?\)"
    ):
        profile_from_dict(data, source="p.json")


def test_unknown_plan_keys(tmp_path):
    result = cli.search_plan(
        [synthetic_profile("A", zero_stage=1, max_micro_batch_size=8, overhead_s=0.1, seconds_per_sample=0.01)],
        load_cluster(_one_type_cluster(tmp_path)),
        global_batch_size=8,
        zero_stage=1,
    )
    data = plan_to_dict(result.plan)
    data["ranks"][0]["gradient_acumulation_steps"] = 2
    with pytest.raises(
        FormatError,
        match=r"plan.json: ranks\[0\].gradient_acumulation_steps: .*did you mean 'gradient_accumulation_steps'",
    ):
        plan_from_dict(data, source="plan.json")
    data = plan_to_dict(result.plan)
    data["profile_fingerprint"] = {}
    with pytest.raises(FormatError, match=r"plan.json: profile_fingerprint: .*did you mean 'profile_fingerprints'"):
        plan_from_dict(data, source="plan.json")


def _one_type_cluster(tmp_path: Path) -> Path:
    path = tmp_path / "one.json"
    path.write_text(
        json.dumps({"schema_version": 1, "nodes": [{"name": "n", "devices": [{"device_type": "A", "count": 2}]}]})
    )
    return path


# -- an internal error is not "infeasible" ---------------------------------------------
def _broken_search(*args, **kwargs):
    raise ZeroDivisionError("simulated bug")


def test_an_internal_error_exits_3_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "search_plan", _broken_search)
    target = tmp_path / "plan.json"
    code, out, err = run(
        capsys, "--profiles", EXAMPLES, "--cluster", CLUSTER, "--global-batch-size", 512, "--output", target
    )
    assert code == cli.EXIT_INTERNAL_ERROR == 3
    assert err.strip().splitlines() == [
        "poplar-search: internal error: ZeroDivisionError: simulated bug (a bug in poplar-search; "
        "run again with --debug for the traceback and report it)"
    ]
    assert out == "" and not target.exists()


def test_debug_shows_the_traceback(capsys, monkeypatch):
    monkeypatch.setattr(cli, "search_plan", _broken_search)
    code, _, err = run(capsys, "--profiles", EXAMPLES, "--cluster", CLUSTER, "--global-batch-size", 512, "--debug")
    assert code == 3
    assert "Traceback (most recent call last)" in err and "_broken_search" in err


# -- profiles measured under another emulation than the cluster declares ------------------
def _emulated_examples(tmp_path: Path, slowdown: float, capacity: int) -> Path:
    """The example profiles (whole-model and layer), as if V100-16GB had been measured emulated."""
    directory = _copy_examples(tmp_path)
    for path in [*directory.glob("*v100*.json"), *(directory / "layers").glob("*v100*.json")]:
        data = json.loads(path.read_text())
        data["emulated"] = {"slowdown": slowdown, "memory_capacity_bytes": capacity}
        path.write_text(json.dumps(data))
    return directory


def _cluster_emulating_v100(tmp_path: Path, emulation: dict | None) -> Path:
    data = json.loads(CLUSTER.read_text())
    data["device_types"] = {} if emulation is None else {"V100-16GB": {"emulation": emulation}}
    path = tmp_path / f"cluster-{len(list(tmp_path.glob('cluster-*')))}.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("parallelism", ["zero", "pipeline"])
@pytest.mark.parametrize(
    "declared, found",
    [
        ({"slowdown": 4.0, "memory_capacity_bytes": 17179869184}, "slowdown 2, 17179869184 bytes"),
        ({"slowdown": 2.0, "memory_capacity_bytes": 100_000_000}, "slowdown 2, 17179869184 bytes"),
        (None, "slowdown 2, 17179869184 bytes"),
    ],
)
def test_profiles_measured_under_another_emulation_than_the_clusters_are_refused(
    capsys, tmp_path, parallelism, declared, found
):
    profiles = _emulated_examples(tmp_path, 2.0, 17179869184)
    cluster = _cluster_emulating_v100(tmp_path, declared)
    args = ("--parallelism", parallelism, "--global-batch-size", "512")
    err = _bad_exit(capsys, tmp_path, *args, profiles=profiles, cluster=cluster)
    assert "V100-16GB: expected" in err and f"measured as {found}" in err and "poplar-profile" in err, err
    if declared is None:
        assert "as the cluster declares it (a real device (no emulation))" in err
    # As measured: the plan is searched, and --predict prices it; with the cluster declaring otherwise it refuses.
    matching = _cluster_emulating_v100(tmp_path, {"slowdown": 2.0, "memory_capacity_bytes": 17179869184})
    plan = tmp_path / "searched.json"
    code, _, err = run(capsys, "--profiles", profiles, "--cluster", matching, *args, "--output", plan)
    assert code == 0, err
    code, _, err = run(capsys, "--profiles", profiles, "--cluster", matching, "--predict", plan)
    assert code == 0, err
    code, out, err = run(capsys, "--profiles", profiles, "--cluster", cluster, "--predict", plan)
    assert code == 2 and out == "" and f"V100-16GB: expected {'layer ' * (parallelism == 'pipeline')}profiles" in err


def test_only_the_stages_searched_are_held_to_the_clusters_emulation(capsys, tmp_path):
    """A type re-profiled at one stage after its emulation changed keeps older files of other stages."""
    profiles = _emulated_examples(tmp_path, 2.0, 17179869184)
    for path in profiles.glob("*v100*stage1.json"):
        data = json.loads(path.read_text())
        data["emulated"]["slowdown"] = 4.0
        path.write_text(json.dumps(data))
    cluster = _cluster_emulating_v100(tmp_path, {"slowdown": 4.0, "memory_capacity_bytes": 17179869184})
    code, _, err = run(
        capsys, "--profiles", profiles, "--cluster", cluster, "--zero-stage", "1", "--global-batch-size", 512
    )
    assert code == 0, err
    err = _bad_exit(
        capsys, tmp_path, "--zero-stage", "0", "--global-batch-size", "512", profiles=profiles, cluster=cluster
    )
    assert "found profiles measured as slowdown 2," in err


def test_profiles_that_say_no_emulation_are_taken_as_the_clusters_type(capsys, tmp_path):
    """Modelled or hand-written profiles (no ``emulated``) for an emulated type: as before, searched."""
    cluster = _cluster_emulating_v100(tmp_path, {"slowdown": 1.0, "memory_capacity_bytes": 17179869184})
    code, _, err = run(capsys, "--profiles", EXAMPLES, "--cluster", cluster, "--global-batch-size", "512")
    assert code == 0, err
