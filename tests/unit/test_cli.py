"""`poplar-search` (poplar_ext/search/cli.py): exit codes, output files, table and JSON output."""

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from poplar_ext.plan.formats import load_plan, load_profiles
from poplar_ext.search.cli import build_parser, main

EXAMPLES = Path(__file__).resolve().parents[2] / "poplar_ext" / "search" / "example_profiles"
CLUSTER = EXAMPLES / "cluster.json"


def examples_with(tmp_path, pattern: str, change) -> Path:
    """A copy of the shipped example profiles in ``tmp_path/profiles``, `change(data)` applied to each file of it
    matching the glob `pattern`."""
    folder = tmp_path / "profiles"
    shutil.copytree(EXAMPLES, folder)
    for path in folder.glob(pattern):
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))
    return folder


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_readme_command_prints_a_table(capsys):
    code, out, err = run(capsys, "--profiles", EXAMPLES, "--cluster", CLUSTER, "--global-batch-size", 512)
    assert code == 0 and err == ""
    assert "global batch 512" in out and "% of ideal" in out
    assert "0-3    A100-80GB" in out and "4-7    V100-16GB" in out
    assert "stage  status" in out


def test_output_is_written_and_valid(capsys, tmp_path):
    target = tmp_path / "plan.json"
    code, out, _ = run(
        capsys,
        "--profiles",
        EXAMPLES,
        "--cluster",
        CLUSTER,
        "--global-batch-size",
        256,
        "--zero-stage",
        2,
        "--output",
        target,
        "--format",
        "json",
    )
    assert code == 0
    plan = load_plan(target)
    assert plan.global_batch_size == 256 and plan.zero_stage == 2
    assert json.loads(out) == json.loads(target.read_text())


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_output_file_gets_the_mode_the_umask_gives_a_new_file(capsys, tmp_path, umask, mode):
    # A plan is read by the training job's ranks, maybe another user's: not a private 0600 temp file.
    target = tmp_path / "plan.json"
    previous = os.umask(umask)
    try:
        code, _, _ = run(capsys, "--example", "--global-batch-size", 64, "--output", target)
    finally:
        os.umask(previous)
    assert code == 0 and stat.S_IMODE(target.stat().st_mode) == mode


def test_output_through_a_symlink_writes_its_target_and_keeps_the_link(capsys, tmp_path):
    target = tmp_path / "plans" / "plan.json"
    target.parent.mkdir()
    target.write_text("{}")
    link = tmp_path / "current.json"
    link.symlink_to(target)
    code, out, _ = run(capsys, "--example", "--global-batch-size", 64, "--output", link, "--format", "json")
    assert code == 0 and link.is_symlink()
    assert json.loads(target.read_text()) == json.loads(out)


def test_output_never_overwrites_an_input_but_may_replace_a_plan(capsys, tmp_path):
    profiles = tmp_path / "profiles"
    shutil.copytree(EXAMPLES, profiles)
    cluster, profile = profiles / "cluster.json", next(profiles.glob("*a100*stage1.json"))
    inputs = {path: path.read_bytes() for path in (cluster, profile, *profiles.glob("layers/*.json"))}
    for target in inputs:
        code, out, err = run(capsys, "--profiles", profiles, "--cluster", cluster, "--output", target)
        assert code == 2 and out == ""
        assert f"--output: expected a file that is not one of the inputs, found {target}" in err
    assert all(path.read_bytes() == data for path, data in inputs.items())
    plan = profiles / "plan.json"
    for batch in (64, 128):  # a plan written beside the profiles is replaced by the next one
        common = ("--profiles", profiles, "--cluster", cluster, "--global-batch-size", batch, "--output", plan)
        assert run(capsys, *common)[0] == 0 and load_plan(plan).global_batch_size == batch


def test_policy_all_compares_and_prints_every_plan_as_json(capsys):
    code, out, _ = run(
        capsys, "--profiles", EXAMPLES, "--cluster", CLUSTER, "--global-batch-size", 512, "--policy", "all"
    )
    assert code == 0
    for name in ("poplar", "uniform", "proportional"):
        assert f"\n{name} " in out
    assert "poplar speed-up" in out and "Plan of the poplar policy" in out
    code, out, _ = run(
        capsys,
        "--profiles",
        EXAMPLES,
        "--cluster",
        CLUSTER,
        "--policy",
        "all",
        "--format",
        "json",
        "--max-global-batch-size",
        1000,
    )
    data = json.loads(out)
    assert set(data) == {"poplar", "uniform", "proportional"}
    assert all(plan["global_batch_size"] <= 1000 for plan in data.values())


def test_infeasible_exits_1_with_reason_and_writes_nothing(capsys, tmp_path):
    target = tmp_path / "plan.json"
    code, out, err = run(
        capsys, "--profiles", EXAMPLES, "--cluster", CLUSTER, "--global-batch-size", 4, "--output", target
    )
    assert code == 1 and out == ""
    assert err.startswith("poplar-search: infeasible: ") and "smaller than the 8 ranks" in err
    assert not target.exists()


def test_infeasible_maximum_is_named_as_the_maximum(capsys):
    code, out, err = run(capsys, "--profiles", EXAMPLES, "--cluster", CLUSTER, "--max-global-batch-size", 3)
    assert code == 1 and out == ""
    assert "largest global batch allowed (3) is smaller than the 8 ranks" in err


def test_bad_profile_exits_2_naming_file_and_field(capsys, tmp_path):
    profiles = tmp_path / "profiles"
    shutil.copytree(EXAMPLES, profiles)
    bad = profiles / "gpt2-small-124m.v100-16gb.stage1.json"
    data = json.loads(bad.read_text())
    data["samples"][0]["micro_step_time_s"] = -1
    bad.write_text(json.dumps(data))
    target = tmp_path / "plan.json"
    code, out, err = run(capsys, "--profiles", profiles, "--cluster", CLUSTER, "--output", target)
    assert code == 2 and out == "" and not target.exists()
    assert err.strip().count("\n") == 0
    assert f"{bad}: samples[0].micro_step_time_s: expected a number from 1e-09 to 1e+06, found number -1" in err


def test_unknown_device_type_exits_2(capsys, tmp_path):
    cluster = json.loads(CLUSTER.read_text())
    cluster["nodes"][1]["devices"][0]["device_type"] = "H100-80GB"
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(cluster))
    code, _, err = run(capsys, "--profiles", EXAMPLES, "--cluster", path)
    assert code == 2 and "found 'H100-80GB' with no profile" in err and str(path) in err


def test_missing_cluster_file_exits_2(capsys, tmp_path):
    code, _, err = run(capsys, "--profiles", EXAMPLES, "--cluster", tmp_path / "nope.json")
    assert code == 2 and "nope.json: (file): expected a readable JSON file" in err


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--cluster", "c.json"], "the following arguments are required: --profiles"),
        (["--profiles", "d", "--cluster", "c", "--zero-stage", "4"], "expected auto, 0, 1, 2 or 3, found '4'"),
        (["--profiles", "d", "--cluster", "c", "--global-batch-size", "0"], "expected a positive integer, found '0'"),
        (["--profiles", "d", "--cluster", "c", "--policy", "best"], "invalid choice: 'best'"),
    ],
)
def test_bad_arguments_exit_2_on_one_line(capsys, argv, match):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert match in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--global-batch-size", "2147483649"], "argument --global-batch-size: expected at most 2147483648 (the"),
        (["--max-global-batch-size", "10000000000"], "argument --max-global-batch-size: expected at most 2147483648"),
        *(
            (
                ["--global-batch-size", "64", "--max-global-batch-size", "10", "--parallelism", parallelism],
                "--global-batch-size: expected at most --max-global-batch-size (10), found 64",
            )
            for parallelism in ("zero", "auto")
        ),
        (
            ["--global-batch-size", "4194305", "--parallelism", "auto"],
            "--global-batch-size: expected at most 4194304 with --parallelism auto (the pipeline search's limit), "
            "found 4194305",
        ),
    ],
)
def test_a_batch_above_the_limit_is_the_options_error_not_the_files(capsys, extra, match):
    code, out, err = run(capsys, "--example", *extra)
    assert code == 2 and out == "" and match in err
    assert "profiles:" not in err and "cluster:" not in err  # the files are not at fault


@pytest.mark.parametrize("option", ["--profiles", "--cluster", "--network", "--predict", "--output"])
def test_an_empty_path_is_refused_not_ignored(capsys, option):
    # `--output "$PLAN"` with PLAN unset must not exit 0 without writing (nor search in place of --predict).
    code, out, err = run(capsys, "--example", "--global-batch-size", 64, option, "")
    assert code == 2 and out == ""
    assert f"argument {option}: expected a path, found ''" in err


def test_help_describes_formats_and_exit_codes(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    assert "profiles/README.md" in out and "exit status" in out and "1  infeasible" in out


def test_help_says_which_policies_choose_the_memory_levers(capsys):
    # A user short of memory on one type read --help and found no word on checkpointing or offload.
    code, out, _ = run(capsys, "--help")
    text = " ".join(out.split())
    assert code == 0
    assert "memory levers (activation checkpointing, optimizer offload: poplar-profile)" in text
    assert "poplar also chooses them per device type" in text
    assert "uniform and proportional take each type's first profiled setting" in text


def test_parser_works_as_a_subcommand():
    import argparse

    root = argparse.ArgumentParser(prog="poplar")
    build_parser(root.add_subparsers(dest="command"))
    args = root.parse_args(["search", "--profiles", "d", "--cluster", "c", "--zero-stage", "auto"])
    assert args.command == "search" and args.zero_stage == "auto" and args.policy == "poplar"


def test_profiles_directory_may_hold_the_cluster_description():
    profiles = load_profiles(EXAMPLES)
    assert len(profiles) == 8
    assert {p.source for p in profiles} == {"modelled"}


def test_a_profiles_path_that_is_a_file_is_said_to_be_one(capsys):
    code, out, err = run(capsys, "--profiles", CLUSTER, "--cluster", CLUSTER, "--global-batch-size", 512)
    assert code == 2 and out == ""
    assert f"{CLUSTER}: (directory): expected a directory of profile JSON files, found a file" in err


def test_a_network_file_and_no_network_together_are_refused(capsys):
    network = next((EXAMPLES / "network").glob("*.json"))
    code, out, err = run(capsys, "--example", "--global-batch-size", 512, "--network", network, "--no-network")
    assert code == 2 and out == ""
    assert "--no-network: not allowed with argument --network" in err


PROFILE = EXAMPLES / "gpt2-small-124m.v100-16gb.stage1.json"
PROFILE_FOUND = "a profile (its keys 'max_micro_batch_size', 'optimizer_step_time_s', 'samples')"
CLUSTER_FOUND = "a cluster description (its keys 'device_types', 'nodes')"


@pytest.mark.parametrize(
    ("argv", "given", "expected", "found", "option"),
    [
        (["--profiles", EXAMPLES, "--cluster", PROFILE, "--global-batch-size", 64], PROFILE, "a cluster description",
         PROFILE_FOUND, "--cluster"),
        (["--profiles", EXAMPLES, "--cluster", PROFILE, "--global-batch-size", 64, "--parallelism", "pipeline"],
         PROFILE, "a cluster description", PROFILE_FOUND, "--cluster"),
        (["--example", "--network", CLUSTER, "--global-batch-size", 64], CLUSTER, "a network file", CLUSTER_FOUND,
         "--network"),
        (["--profiles", EXAMPLES, "--predict", CLUSTER], CLUSTER, "a plan", CLUSTER_FOUND, "--predict"),
    ],
)  # fmt: skip
def test_a_file_of_another_format_is_named_with_what_its_option_takes(capsys, argv, given, expected, found, option):
    # Not "device_type: expected one of the keys 'device_types', ... (did you mean 'device_types'?)".
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert (
        err
        == f"poplar-search: error: {given}: (file): expected {expected}, found {found}: pass {expected} to {option}\n"
    )


def test_a_deepspeed_config_in_the_profiles_folder_is_skipped(capsys, tmp_path):
    profiles = tmp_path / "profiles"
    shutil.copytree(EXAMPLES, profiles)
    (profiles / "ds.json").write_text(json.dumps({"gradient_clipping": 1.0, "zero_optimization": {"stage": 1}}))
    code, out, err = run(
        capsys, "--profiles", profiles, "--cluster", profiles / "cluster.json", "--global-batch-size", 64
    )
    assert code == 0 and err == "" and "global batch 64" in out


@pytest.mark.parametrize("mode", [[], ["--parallelism", "pipeline"], ["--predict", "PLAN"]])
def test_a_network_file_of_another_cluster_is_used_with_a_note(tmp_path, capsys, mode):
    measured_here = next((EXAMPLES / "network").glob("*.json"))
    data = json.loads(measured_here.read_text())
    data["cluster_key"] = "sha256:" + "0" * 64  # measured on some other cluster
    data["measured_with"]["source"] = "measured"  # the example's is modelled: for any cluster, no note
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(data))
    plan = tmp_path / "plan.json"
    assert main(["--example", "--global-batch-size", "512", "--output", str(plan)]) == 0
    capsys.readouterr()
    mode = [str(plan) if arg == "PLAN" else arg for arg in mode]
    extra = [] if "--predict" in mode else ["--global-batch-size", "512"]
    modelled = tmp_path / "modelled.json"
    modelled.write_text(json.dumps({**data, "measured_with": {"source": "modelled"}}))
    for network, noted in ((elsewhere, True), (measured_here, False), (modelled, False)):
        assert main(["--example", *extra, *mode, "--network", str(network)]) == 0
        err = capsys.readouterr().err
        assert (f"note: --network {network} was measured on another cluster" in err) is noted, err
        if noted:  # the file's own figures
            assert f"({data['world_size']} ranks, {data['num_nodes']} node(s), {data['backend']})" in err


def test_predict_names_both_kinds_of_plan_for_a_misspelt_parallelism(capsys, tmp_path):
    # The ZeRO reader alone offered only 'zero' for "pipelines".
    plan = json.loads((Path(__file__).resolve().parents[2] / "examples" / "plan.json").read_text())
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**plan, "parallelism": "pipelines"}))
    code, out, err = run(capsys, "--example", "--predict", path)
    assert code == 2 and out == ""
    expected = "parallelism: expected one of 'zero', 'pipeline', found string 'pipelines' (did you mean 'pipeline'?)"
    assert expected in err, err


def test_model_picks_one_models_profiles_from_a_folder_of_several(capsys, tmp_path):
    # A folder with two models' profiles (the automatic mode's cache holds every model's): refused without
    # --model, naming it; searched with it, by name or fingerprint.
    folder = tmp_path / "profiles"
    shutil.copytree(EXAMPLES, folder, ignore=shutil.ignore_patterns("layers", "cluster.json"))
    for path in list(folder.glob("*.json")):
        data = json.loads(path.read_text())
        data["model"] = {**data["model"], "name": "other-model", "fingerprint": "sha256:other"}
        (folder / f"other-{path.name}").write_text(json.dumps(data))
    common = ["--profiles", folder, "--cluster", CLUSTER, "--global-batch-size", 512, "--no-network"]
    code, out, err = run(capsys, *common)
    assert code == 2 and "expected profiles of one model, found 2 models" in err
    assert "(poplar-search: --model NAME picks one)" in err
    name = json.loads(next(EXAMPLES.glob("*.json")).read_text())["model"]["name"]
    for chosen in (name, "sha256:other"):
        code, out, err = run(capsys, *common, "--model", chosen, "--format", "json")
        assert code == 0, err
        assert json.loads(out)["global_batch_size"] == 512
    code, out, err = run(capsys, *common, "--model", "gpt2")
    assert code == 2 and "--model: expected the name or fingerprint of a model in" in err and "other-model" in err


def test_profiles_of_one_fingerprint_under_two_names_are_one_model(capsys, tmp_path):
    # poplar-profile --model hf:GPT2Config names its profiles gpt2-causal-lm; a PoplarTrainer job searching from that
    # folder measured its missing stage again under the class name, gpt2lmheadmodel, the same fingerprint. The folder
    # was then refused as "2 models" with or without --model, even by the fingerprint both share.
    folder = tmp_path / "profiles"
    shutil.copytree(EXAMPLES, folder, ignore=shutil.ignore_patterns("layers", "cluster.json"))
    for path in folder.glob("*stage1.json"):
        data = json.loads(path.read_text())
        data["model"] = {**data["model"], "name": "renamed"}
        path.write_text(json.dumps(data))
    name = json.loads(next(folder.glob("*stage0.json")).read_text())["model"]
    common = ["--profiles", folder, "--cluster", CLUSTER, "--global-batch-size", 512, "--no-network"]
    for chosen in ((), ("--model", name["name"]), ("--model", "renamed"), ("--model", name["fingerprint"])):
        code, out, err = run(capsys, *common, *chosen, "--format", "json")
        assert code == 0, err
        assert json.loads(out)["zero_stage"] == 1  # the renamed stage is searched beside the others


def test_model_takes_the_fingerprint_as_profile_file_names_show_it(capsys, tmp_path):
    # The cache's file names show 8 digits of the fingerprint (gpt-a1b2c3d4-...json); --model took only the whole.
    folder = tmp_path / "profiles"
    shutil.copytree(EXAMPLES, folder, ignore=shutil.ignore_patterns("layers", "cluster.json"))
    for tag, fingerprint in (("one", "sha256:0123456789ab"), ("two", "sha256:0123456799ff")):
        for path in EXAMPLES.glob("*.json"):
            data = json.loads(path.read_text())
            if "model" not in data:
                continue
            data["model"] = {**data["model"], "name": "same", "fingerprint": fingerprint}
            (folder / f"{tag}-{path.name}").write_text(json.dumps(data))
    common = ["--profiles", folder, "--cluster", CLUSTER, "--global-batch-size", 512, "--no-network"]
    for chosen in ("01234567", "sha256:01234567"):  # both models': more digits needed
        code, out, err = run(capsys, *common, "--model", chosen)
        assert code == 2 and f"--model: {chosen!r} begins the fingerprints of several models in" in err, err
        assert "expected more of one" in err
    for chosen in ("012345678", "sha256:012345679"):
        code, out, err = run(capsys, *common, "--model", chosen, "--format", "json")
        assert code == 0, err
    code, out, err = run(capsys, *common, "--model", "0123456")  # fewer than 8 digits: not a fingerprint
    assert code == 2 and "--model: expected the name or fingerprint of a model in" in err


def test_another_gpus_profiles_beside_the_clusters_are_not_called_misspelt(capsys, tmp_path):
    # A cluster of the A100s alone, planned from the example folder (as from a cache that holds every GPU's):
    # "a misspelt 'A100-80GB'?" was said of V100-16GB, and of an A100-40GB profiled as fully as the A100-80GB.
    folder = tmp_path / "profiles"
    shutil.copytree(EXAMPLES, folder, ignore=shutil.ignore_patterns("layers", "cluster.json"))
    for path in folder.glob("*.a100-80gb.stage*.json"):
        data = json.loads(path.read_text())
        (folder / path.name.replace("80gb", "40gb")).write_text(json.dumps({**data, "device_type": "A100-40GB"}))
    cluster = tmp_path / "a100s.json"
    nodes = [{"name": "node0", "devices": [{"device_type": "A100-80GB", "count": 4}]}]
    cluster.write_text(json.dumps({"schema_version": 1, "nodes": nodes}))
    code, out, err = run(capsys, "--profiles", folder, "--cluster", cluster, "--global-batch-size", 512)
    assert code == 0 and "global batch 512" in out
    assert err == "", err


def test_profiles_measured_under_several_deepspeed_configs_are_noted(capsys, tmp_path):
    # A PoplarTrainer job re-measured ZeRO 1 under its own config (transformers' fused AdamW) beside profiles of
    # poplar-profile's plain AdamW: the search compared the stages without a word.
    folder = tmp_path / "profiles"
    shutil.copytree(EXAMPLES, folder, ignore=shutil.ignore_patterns("layers", "cluster.json"))
    for key in ("sha256:aaaa", "sha256:bbbb"):
        for path in folder.glob("*.json"):
            data = json.loads(path.read_text())
            if data.get("kind", "profile") == "profile" and "zero_stage" in data:
                data["measured_with"]["ds_config_fingerprint"] = "sha256:aaaa" if data["zero_stage"] != 1 else key
                path.write_text(json.dumps(data))
        code, out, err = run(capsys, "--profiles", folder, "--cluster", CLUSTER, "--global-batch-size", 512)
        assert code == 0, err
        if key == "sha256:aaaa":
            assert "DeepSpeed configs" not in err, err
            continue
        assert f"note: {folder} holds profiles measured under 2 DeepSpeed configs (measured_with.ds_config_" in err
        assert "sha256:aaaa at ZeRO stage 0, 2, 3; sha256:bbbb at ZeRO stage 1)" in err


def test_profiles_of_stages_not_searched_are_not_noted_as_measured_under_another_config(capsys, tmp_path):
    # Stage 1's profiles keyed sha256:bbbb, the others sha256:aaaa: with --zero-stage 0 only stage 0's (one key) are
    # searched, yet the note said the stages were compared under 2 DeepSpeed configs.
    folder = tmp_path / "profiles"
    shutil.copytree(EXAMPLES, folder, ignore=shutil.ignore_patterns("layers", "cluster.json"))
    for path in folder.glob("*.json"):
        data = json.loads(path.read_text())
        if data.get("kind", "profile") == "profile" and "zero_stage" in data:
            data["measured_with"]["ds_config_fingerprint"] = "sha256:bbbb" if data["zero_stage"] == 1 else "sha256:aaaa"
            path.write_text(json.dumps(data))
    for stage in ("0", "2"):
        code, out, err = run(
            capsys, "--profiles", folder, "--cluster", CLUSTER, "--global-batch-size", 512, "--zero-stage", stage
        )
        assert code == 0, err
        assert "DeepSpeed configs" not in err, err
    code, out, err = run(capsys, "--profiles", folder, "--cluster", CLUSTER, "--global-batch-size", 512)
    assert code == 0, err
    assert "sha256:aaaa at ZeRO stage 0, 2, 3; sha256:bbbb at ZeRO stage 1)" in err


def test_a_profile_whose_device_type_is_misspelt_is_said_to_be_unused(capsys, tmp_path):
    # One V100 profile renamed 'V100-16G': the search ignores it (as a folder's other GPUs'), with a note; where
    # its stage then has no profile of the type, the reason names it too.
    folder = tmp_path / "profiles"
    shutil.copytree(EXAMPLES, folder, ignore=shutil.ignore_patterns("layers", "cluster.json"))
    path = folder / "gpt2-small-124m.v100-16gb.stage2.json"
    data = json.loads(path.read_text())
    assert data["device_type"] == "V100-16GB"
    path.write_text(json.dumps({**data, "device_type": "V100-16G"}))
    code, out, err = run(capsys, "--profiles", folder, "--cluster", CLUSTER, "--global-batch-size", 512)
    assert code == 0, err
    assert f"note: {folder} has profiles of 'V100-16G', a device type the cluster does not have (not used): a " in err
    assert "misspelt 'V100-16GB'?" in err
    code, out, err = run(
        capsys, "--profiles", folder, "--cluster", CLUSTER, "--global-batch-size", 512, "--zero-stage", 2
    )
    assert code == 1
    assert (
        "No profile for V100-16GB at stage 2. A profile of 'V100-16G' (not in the cluster) is there: 'V100-16GB'" in err
    )


def _two_models_folder(tmp_path, *, layers=False):
    """The example profiles (or layer profiles) of one model, copied as another model's beside them: each model's
    files are known (`other-` names the second's)."""
    folder = tmp_path / "profiles"
    shutil.copytree(EXAMPLES, folder, ignore=shutil.ignore_patterns("cluster.json"))
    files = folder / "layers" if layers else folder
    for path in list(files.glob("*.json")):
        data = json.loads(path.read_text())
        data["model"] = {**data["model"], "fingerprint": "sha256:other"}  # same name: only the fingerprint differs
        (files / f"other-{path.name}").write_text(json.dumps(data))
    return folder, sorted(p.name for p in files.glob("*.json"))


def test_profiles_of_two_models_are_refused_naming_their_files(capsys, tmp_path):
    # The message named the models' fingerprints only: which of the folder's files are the other model's?
    folder, names = _two_models_folder(tmp_path)
    common = ["--profiles", folder, "--cluster", CLUSTER, "--global-batch-size", 512, "--no-network"]
    code, out, err = run(capsys, *common)
    assert code == 2 and "expected profiles of one model, found 2 models" in err, err
    assert "(poplar-search: --model NAME picks one); the files: " in err, err
    first_of_each = [next(n for n in names if n.startswith("other-")), next(n for n in names if "other" not in n)]
    assert all(f"{folder / name}" in err for name in first_of_each), err
    assert "sha256:other): " in err and "and 5 more" in err, err  # 8 files each: 3 named


def test_layer_profiles_of_two_models_are_refused_naming_their_files(capsys, tmp_path):
    folder, names = _two_models_folder(tmp_path, layers=True)
    common = ["--profiles", folder, "--cluster", CLUSTER, "--global-batch-size", 64, "--no-network"]
    code, out, err = run(capsys, *common, "--parallelism", "pipeline")
    assert code == 2 and "expected layer profiles of one model, found 2" in err, err
    assert all(f"{folder / 'layers' / name}" in err for name in names), err


@pytest.mark.parametrize("pattern", ["*v100*.json", "layers/*v100*.json"])
def test_profiles_of_one_model_in_two_dtypes_are_refused(capsys, tmp_path, pattern):
    # The V100's profiles in bfloat16 beside the A100's in float16, one fingerprint (taken before DeepSpeed casts):
    # every mode planned and priced from both, exit 0, nothing said.
    folder = examples_with(tmp_path, pattern, lambda data: data["model"].update(dtype="bfloat16"))
    kind = "layer profile" if pattern.startswith("layers") else "profile"
    expected = f"{kind}s: expected one model.dtype over the {kind}s used, found bfloat16 in V100-16GB at stage "
    common = ["--profiles", folder, "--cluster", CLUSTER]
    parallelism = "pipeline" if kind == "layer profile" else "zero"
    code, out, err = run(capsys, *common, "--global-batch-size", 512, "--parallelism", parallelism)
    assert code == 2 and expected in err and "float16 in A100-80GB at stage " in err, err
    plan = "pplan.json" if kind == "layer profile" else "plan.json"
    code, _, _ = run(capsys, "--example", "--global-batch-size", 512, "--parallelism", parallelism, "--output",
                     tmp_path / plan)  # fmt: skip
    assert code == 0
    code, out, err = run(capsys, *common, "--predict", tmp_path / plan)
    assert code == 2 and expected in err, err


def test_an_output_that_cannot_be_a_file_says_why(capsys, tmp_path):
    # "plan.json/x.json: cannot write the plan: File exists": which file? (mkdir of the folder plan.json, a file)
    (tmp_path / "plan.json").write_text("{}")
    target = tmp_path / "plan.json" / "x.json"
    code, out, err = run(capsys, "--example", "--global-batch-size", 64, "--output", target)
    assert code == 2 and out == ""
    assert f"{target}: cannot write the plan: " in err and f"(its folder {tmp_path / 'plan.json'} is a file)" in err
    code, out, err = run(capsys, "--example", "--global-batch-size", 64, "--output", tmp_path)
    assert code == 2 and f"{tmp_path}: cannot write the plan: " in err, err
    assert "(a folder: --output takes the plan's file name, e.g. " in err, err
