"""`poplar-bench gpu`'s parts that need no run: a failing step is recorded and the others go on, bad options."""

from __future__ import annotations

import pytest

from poplar_bench.cli import build_parser
from poplar_bench.gpu.run import GpuRunSettings, RunLog, run_step
from poplar_bench.gpu.tier import read_junit, run_in_own_group


def test_a_failing_step_is_recorded_not_raised(tmp_path):
    log = RunLog(tmp_path / "gpu_run.log")

    def broken() -> dict:
        raise RuntimeError("no CUDA here")

    failed = run_step("profiles", broken, log)
    reported = run_step("tests", lambda: {"error": "pytest exit code 1"}, log)
    passed = run_step("policies", lambda: {"mode": "emulated"}, log)

    assert failed["status"] == "failed" and "RuntimeError: no CUDA here" in failed["error"]
    assert "Traceback" in failed["traceback"]
    assert reported["status"] == "failed" and passed["status"] == "ok" and passed["mode"] == "emulated"
    text = (tmp_path / "gpu_run.log").read_text()
    assert "step profiles: failed" in text and "step policies: ok" in text


def test_the_two_parts_write_beside_each_other(tmp_path):
    stems = {part: GpuRunSettings(output_dir=tmp_path, part=part).stem for part in ("1", "2", "all")}
    assert stems == {"1": "gpu_run_part1", "2": "gpu_run_part2", "all": "gpu_run"}


def test_bad_part_is_refused(tmp_path):
    with pytest.raises(ValueError, match="part: expected one of"):
        GpuRunSettings(output_dir=tmp_path, part="3")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gpu", "--output-dir", str(tmp_path), "--part", "3"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gpu", "--dry-run"])  # --output-dir is required


def test_junit_cases_with_outcomes_and_recorded_numbers(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(
        '<testsuites><testsuite><testcase classname="tests.gpu.t" name="test_a" time="1.5">'
        '<properties><property name="tolerance" value="0.002"/><property name="collectives" value="gloo"/>'
        '</properties></testcase><testcase classname="tests.gpu.t" name="test_b" time="0">'
        '<failure message="stage 2: 0.1">trace</failure></testcase>'
        '<testcase classname="tests.gpu.t" name="test_c" time="0"><skipped message="needs CUDA"/></testcase>'
        "</testsuite></testsuites>"
    )
    cases = read_junit(path)
    assert [(c["name"], c["outcome"]) for c in cases] == [
        ("tests.gpu.t::test_a", "passed"),
        ("tests.gpu.t::test_b", "failed"),
        ("tests.gpu.t::test_c", "skipped"),
    ]
    assert cases[0]["properties"] == {"tolerance": 0.002, "collectives": "gloo"} and cases[0]["time_s"] == 1.5
    assert cases[1]["message"] == "stage 2: 0.1"


def test_a_step_past_its_limit_is_killed_with_what_it_started(tmp_path):
    import os
    import time

    pid_file = tmp_path / "grandchild.pid"
    # The child starts a grandchild (as pytest forks ranks), then both outlive the limit.
    command = ["bash", "-c", f"sleep 60 & echo $! > {pid_file}; sleep 60"]
    with (tmp_path / "log").open("w") as log:
        assert run_in_own_group(command, cwd=tmp_path, env=dict(os.environ), log=log, timeout_s=0.5) is None
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _running(grandchild):
        time.sleep(0.05)
    assert not _running(grandchild)


def _running(pid: int) -> bool:
    from pathlib import Path

    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; its parent (also killed) did not reap it


def _report() -> dict:
    cpu_note = "Devices are emulated (poplar_ext.hardware.emulation): each rank is a CPU process (1 thread)"
    return {"scenarios": [{"policies": [{}, {}, {}]}], "notes": [cpu_note, "Other processes."], "machine": {}}


def test_the_comparison_report_names_the_gpu_and_drops_the_cpu_notes_on_a_gpu():
    from poplar_bench.gpu.policies import label_report

    provenance = {"gpu": "NVIDIA H200", "driver": "580.1", "cuda": "13.0", "torch": "2.11.0", "deepspeed": "0.19.8"}
    provenance |= {"python": "3.12.3", "devices": "real: 1 x NVIDIA H200"}
    report = _report()
    label_report(report, mode="emulated", why_not_mps="nvidia-cuda-mps-control is not installed", provenance=provenance)
    assert "NVIDIA H200 (driver 580.1, CUDA 13.0; torch 2.11.0, DeepSpeed 0.19.8)" in report["title"]
    assert "EMULATED" in report["data_source"] and "nvidia-cuda-mps-control" in report["data_source"]
    assert report["provenance"] == provenance and "NVIDIA H200" in report["machine"]["gpus"]
    assert not [n for n in report["notes"] if "CPU process" in n] and "Other processes." in report["notes"]
    assert any("gloo on CUDA tensors" in n for n in report["notes"])

    dry = _report()
    label_report(dry, mode="dry-run", why_not_mps="dry run", provenance=provenance | {"gpu": None})
    assert "DRY RUN" in dry["data_source"] and any("CPU process" in n for n in dry["notes"])
