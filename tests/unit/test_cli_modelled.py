"""`poplar-search` tables say when the profiles they price are modelled (the shipped example's), not measured."""

import json

from test_cli import examples_with, run

LABEL = "Profiles: MODELLED (measured_with.source"


def _measured(data):
    data["measured_with"]["source"] = "measured"


def test_the_example_table_says_its_profiles_are_modelled(capsys, tmp_path):
    code, out, err = run(capsys, "--example", "--global-batch-size", 512, "--output", tmp_path / "plan.json")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("poplar at ZeRO stage 1 (auto): global batch 512") and lines[1].startswith(LABEL)
    code, out, _ = run(capsys, "--example", "--predict", tmp_path / "plan.json")
    assert code == 0 and out.splitlines()[2].startswith(LABEL)
    code, out, _ = run(capsys, "--example", "--parallelism", "auto", "--global-batch-size", 512)
    assert code == 0 and f"\n\n{LABEL}" in out  # apart from the comparison table's rows
    code, out, _ = run(capsys, "--example", "--policy", "all")  # under the comparison table, apart from its rows
    assert code == 0 and "poplar speed-up\n" in out and f"\n\n{LABEL}" in out and "-\n" + LABEL not in out
    code, out, _ = run(capsys, "--example", "--global-batch-size", 512, "--json")
    assert code == 0 and json.loads(out)["global_batch_size"] == 512  # JSON unchanged


def test_measured_profiles_get_no_label(capsys, tmp_path):
    profiles = examples_with(tmp_path, "*.stage*.json", _measured)
    code, out, err = run(capsys, "--profiles", profiles, "--cluster", profiles / "cluster.json")
    assert code == 0 and "MODELLED" not in out, out


def test_some_modelled_types_are_counted(capsys, tmp_path):
    profiles = examples_with(tmp_path, "*v100*.stage*.json", _measured)
    code, out, _ = run(capsys, "--profiles", profiles, "--cluster", profiles / "cluster.json")
    assert code == 0 and out.splitlines()[1].startswith("Profiles: MODELLED for 1 of 2 device types ("), out


def test_a_pipeline_plan_is_labelled_by_its_layer_profiles_alone(capsys, tmp_path):
    # --parallelism pipeline prices layer profiles only: the folder's modelled whole-model ones labelled it.
    profiles = examples_with(tmp_path, "layers/*.json", _measured)
    common = ["--profiles", profiles, "--cluster", profiles / "cluster.json", "--global-batch-size", 256]
    code, out, _ = run(capsys, *common, "--parallelism", "pipeline")
    assert code == 0 and "MODELLED" not in out, out
    code, out, _ = run(capsys, *common, "--parallelism", "auto")  # the ZeRO plan beside it is priced modelled
    assert code == 0 and "Profiles: MODELLED for" in out or LABEL in out, out


def test_emulated_profiles_are_labelled_so(capsys, tmp_path):
    # Measured on a CPU rank slowed down to stand for a V100: nothing else in the table says so.
    emulation = {"slowdown": 3.0, "memory_capacity_bytes": 16 * 10**9}

    def emulated(data):
        _measured(data)
        if data["device_type"] == "V100-16GB":
            data["emulated"] = emulation

    profiles = examples_with(tmp_path, "**/*.stage*.json", emulated)
    cluster = json.loads((profiles / "cluster.json").read_text())
    cluster["device_types"] = {"V100-16GB": {"emulation": emulation}}
    (profiles / "cluster.json").write_text(json.dumps(cluster))
    common = ["--profiles", profiles, "--cluster", profiles / "cluster.json"]
    code, out, _ = run(capsys, *common, "--global-batch-size", 512, "--output", tmp_path / "plan.json")
    assert code == 0 and out.splitlines()[1].startswith("Profiles: EMULATED for 1 of 2 device types ("), out
    assert "MODELLED" not in out
    code, out, _ = run(capsys, *common, "--predict", tmp_path / "plan.json")
    assert code == 0 and out.splitlines()[2].startswith("Profiles: EMULATED for 1 of 2 device types ("), out
    code, out, _ = run(capsys, *common, "--global-batch-size", 256, "--parallelism", "pipeline")  # layer profiles
    assert code == 0 and "\nProfiles: EMULATED for 1 of 2 device types (" in out, out
