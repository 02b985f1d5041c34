"""`poplar-bench gpu`'s parts that need no GPU run: failures recorded, the budget, the exactness verdict, options."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from poplar_bench.cli import build_parser
from poplar_bench.gpu import run as gpu_run
from poplar_bench.gpu.context import GpuRunSettings, RunLog
from poplar_bench.gpu.run import run_step
from poplar_bench.gpu.tier import run_exactness, run_in_own_group


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


def test_steps_run_in_order_within_the_budget_and_the_rest_are_skipped(tmp_path, monkeypatch):
    ran: list[tuple[str, float]] = []

    def step(name: str, seconds: float):
        def run(context) -> dict:
            ran.append((name, context.timeout_s))
            time.sleep(seconds)
            return {}

        return run

    monkeypatch.setattr("poplar_bench.gpu.provenance.read_provenance", lambda dry_run: _provenance())
    monkeypatch.setattr(gpu_run, "STEP_MINIMUM_S", {"exact": 0.1, "profile": 0.1, "predictions": 0.5, "launcher": 0.1})
    monkeypatch.setattr(gpu_run, "STEP_LIMITS_S", {"exact": 5.0, "profile": 5.0, "predictions": 5.0, "launcher": 5.0})
    monkeypatch.setattr(
        gpu_run,
        "STEP_FUNCTIONS",
        {"exact": step("exact", 0.0), "profile": step("profile", 0.6), "predictions": step("predictions", 0.0)}
        | {"launcher": step("launcher", 0.0)},
    )
    settings = GpuRunSettings(output_dir=tmp_path / "out", budget_s=1.0, work_dir=tmp_path / "work")
    assert gpu_run.run_gpu(settings) == 0  # skipped is not failed

    assert [name for name, _ in ran] == ["exact", "profile", "launcher"]
    assert all(timeout <= 1.0 for _, timeout in ran), "a step got more than what was left of the budget"
    summary = json.loads((tmp_path / "out" / "gpu_run.json").read_text())
    assert summary["steps"]["predictions"]["status"] == "skipped"
    assert "left of the budget" in summary["steps"]["predictions"]["reason"]
    assert json.loads((tmp_path / "out" / "provenance.json").read_text()) == _provenance()
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == ["gpu_run.json", "gpu_run.log", "gpu_run.md", "provenance.json"]


def test_a_run_stopped_in_a_step_leaves_a_summary_that_says_it_did_not_finish(tmp_path, monkeypatch):
    # gpu_run.md was written after each step only and listed the steps done: a run killed in step 2 of 4 (the GPU
    # machine's time up, Ctrl-C) left a summary of step 1 that read as a whole run, and one killed in step 1 none.
    def stopped(context) -> dict:
        raise KeyboardInterrupt

    monkeypatch.setattr("poplar_bench.gpu.provenance.read_provenance", lambda dry_run: _provenance())
    steps = {"exact": lambda context: {}, "profile": stopped, "predictions": lambda c: {}, "launcher": lambda c: {}}
    monkeypatch.setattr(gpu_run, "STEP_FUNCTIONS", steps)
    settings = GpuRunSettings(output_dir=tmp_path / "out", budget_s=300.0, work_dir=tmp_path / "work")
    with pytest.raises(KeyboardInterrupt):
        gpu_run.run_gpu(settings)
    summary = json.loads((tmp_path / "out" / "gpu_run.json").read_text())
    assert summary["steps"]["exact"]["status"] == "ok" and list(summary["steps"]) == ["exact"]
    assert summary["finished"] is False
    assert summary["steps_not_finished"] == ["profile", "predictions", "launcher"]
    text = (tmp_path / "out" / "gpu_run.md").read_text()
    assert "**UNFINISHED**: written while the run went on, before profile, predictions, launcher ended" in text

    monkeypatch.setattr(gpu_run, "STEP_FUNCTIONS", {**steps, "profile": lambda context: {}})
    assert gpu_run.run_gpu(settings) == 0
    summary = json.loads((tmp_path / "out" / "gpu_run.json").read_text())
    assert summary["finished"] is True and summary["steps_not_finished"] == []
    assert "UNFINISHED" not in (tmp_path / "out" / "gpu_run.md").read_text()


def _provenance() -> dict:
    versions = {"torch": "2", "deepspeed": "0.19", "python": "3"}
    return {"gpu": None, "driver": None, "cuda": None, "devices": "dry run", **versions}


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="steps: expected some of exact, profile, predictions, launcher, found tests"):
        GpuRunSettings(output_dir=tmp_path, steps=("exact", "tests"))
    with pytest.raises(ValueError, match="budget_s: expected a number of seconds > 0"):
        GpuRunSettings(output_dir=tmp_path, budget_s=0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gpu", "--dry-run"])  # --output-dir is required


def _exact_line(check: str, stage: int, within: bool) -> dict:
    return {"check": check, "zero_stage": stage, "within_tolerance": within}


@pytest.mark.parametrize(
    ("lines", "wrong"),
    [
        ([_exact_line("fp32", 0, True), _exact_line("bf16 without the loss weight (mutation)", 0, False)], None),
        ([_exact_line("fp32", 2, False)], "fp32 at stage 2"),
        # A mutation within the tolerance means the check could not have failed.
        ([_exact_line("bf16 without the loss weight (mutation)", 3, True)], "mutation) at stage 3"),
    ],
)
def test_the_exactness_step_judges_every_line(tmp_path, monkeypatch, lines, wrong):
    from poplar_bench.gpu import tier

    def fake_pytest(context, *, selection, extra_env):
        path = Path(extra_env["POPLAR_GPU_EXACT_LINES"])
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        return 0

    monkeypatch.setattr(tier, "_pytest", fake_pytest)
    context = SimpleNamespace(out=tmp_path, timeout_s=10.0)
    result = run_exactness(context)
    assert result["lines"] == lines
    if wrong is None:
        assert "error" not in result
    else:
        assert wrong in result["error"]


@pytest.mark.multiprocess
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
    label_report(report, dry_run=False, provenance=provenance)
    assert "NVIDIA H200 (driver 580.1, CUDA 13.0; torch 2.11.0, DeepSpeed 0.19.8)" in report["title"]
    assert "REAL GPU compute, speeds EMULATED" in report["data_source"]
    assert report["provenance"] == provenance and "NVIDIA H200" in report["machine"]["gpus"]
    assert not [n for n in report["notes"] if "CPU process" in n] and "Other processes." in report["notes"]
    assert any("gloo on CUDA tensors" in n for n in report["notes"])

    dry = _report()
    label_report(dry, dry_run=True, provenance=provenance | {"gpu": None})
    assert "DRY RUN" in dry["data_source"] and any("CPU process" in n for n in dry["notes"])
    # After "GPUs: " in the machine line: "GPUs: GPU no GPU (driver -, ...)" before.
    assert report["machine"]["gpus"].startswith("NVIDIA H200 (driver 580.1, CUDA 13.0; torch 2.11.0")
    assert dry["machine"]["gpus"].startswith("no GPU (dry run on CPU) (driver 580.1")


def test_the_gpu_command_finds_its_checkouts_gpu_checks_from_any_folder(monkeypatch, tmp_path):
    # From another folder the exactness and launcher steps failed: "expected the GPU checks (run from the
    # repository root)", after the other steps had run.
    import argparse
    from pathlib import Path

    import poplar_bench.gpu.run as gpu_run
    from poplar_bench.commands import gpu

    given = []
    monkeypatch.setattr(gpu_run, "run_gpu", lambda settings: given.append(settings) or 0)
    monkeypatch.chdir(tmp_path)
    arguments = argparse.Namespace(
        output_dir=tmp_path / "out", dry_run=True, budget_s=60.0, steps="exact", work_dir=None
    )
    assert gpu.run(arguments) == 0
    root = Path(__file__).resolve().parents[2]
    assert given[0].repo == root and (root / "tests" / "gpu" / "test_runtime_gpu.py").is_file()


_FAKE_PIP = """\
import os, sys, zipfile
from pathlib import Path

args = sys.argv[1:]
if args[:2] != ["-m", "pip"]:  # the script's own Python (its checks): the real interpreter
    os.execv(os.environ["REAL_PYTHON"], [os.environ["REAL_PYTHON"], *args])
command, rest = args[2], args[3:]
folder = Path(rest[rest.index("-d" if "-d" in rest else "-w") + 1])
v = os.environ["FAKE_RELEASE"]  # the registry's latest release of each unpinned package
if command == "wheel":
    wheels = {"deepspeed-0.19.8": ""} if rest[-1].startswith("deepspeed==") else {"poplar_ext-0.1.0": ""}
else:
    wheels = {f"pydantic-2.{v}.0": f"Requires-Dist: pydantic-core==2.{v}0.0\\n", f"pydantic_core-2.{v}0.0": "",
              f"typing_extensions-4.{v}.0": "", f"pytest-9.{v}.0": "", "hjson-3.1.0": ""}
for stem, requires in wheels.items():
    name, version = stem.split("-")
    with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{name}-{version}.dist-info/METADATA", f"Name: {name}\\nVersion: {version}\\n{requires}")
"""


@pytest.mark.multiprocess
def test_the_wheelhouse_filled_again_after_new_releases_holds_one_version_of_each(tmp_path):
    # Two versions of one package in the folder stop run_on_gpu.sh's whole install on the GPU machine ("Cannot
    # install typing-extensions 4.15.0 and typing-extensions 4.16.0"): the rare GPU session would train nothing.
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    fake = tmp_path / "python3"
    fake.write_text(f"#!{sys.executable}\n" + _FAKE_PIP)
    fake.chmod(0o755)
    folder = tmp_path / "wheelhouse"
    for release in ("9", "10"):  # filled once, then again after every unpinned package had a new release
        env = {**os.environ, "PYTHON": str(fake), "REAL_PYTHON": sys.executable, "FAKE_RELEASE": release}
        done = subprocess.run(
            ["bash", str(root / "bench" / "gpu" / "wheelhouse.sh"), str(folder)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    names = sorted(p.name.split("-")[0] + "-" + p.name.split("-")[1] for p in folder.glob("*.whl"))
    assert names == [
        "deepspeed-0.19.8",
        "hjson-3.1.0",
        "poplar_ext-0.1.0",
        "pydantic-2.10.0",
        "pydantic_core-2.100.0",
        "pytest-9.10.0",
        "typing_extensions-4.10.0",
    ]


_FAKE_RUN = """\
import os, sys
from pathlib import Path

args = sys.argv[1:]
if args[:2] == ["-m", "pip"]:  # --version, install: the wheels' install went through
    sys.exit(0)
if args[:2] == ["-m", "poplar_bench.cli"]:  # where the run would write its files
    folder = args[args.index("--output-dir") + 1]
    Path(os.environ["RECORD"]).write_text(os.path.abspath(folder))
    sys.exit(0)
sys.exit(f"unexpected: {args}")
"""


@pytest.mark.multiprocess
def test_run_on_gpu_writes_into_the_output_folder_named_from_any_folder(tmp_path):
    # The script changes into the checkout before the run: a relative OUTPUT_DIR named another folder there.
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    fake = tmp_path / "python3"
    fake.write_text(f"#!{sys.executable}\n" + _FAKE_RUN)
    fake.chmod(0o755)
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "a-1.0-py3-none-any.whl").write_text("")
    record = tmp_path / "record"
    env = {
        **os.environ,
        "PYTHON": str(fake),
        "RECORD": str(record),
        "POPLAR_WHEELHOUSE": str(tmp_path / "wheels"),
        "POPLAR_GPU_SITE": str(tmp_path / "site"),
    }
    done = subprocess.run(
        ["bash", str(root / "bench" / "gpu" / "run_on_gpu.sh"), "out", "--dry-run"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert record.read_text() == str(tmp_path / "out")


@pytest.mark.multiprocess
def test_run_on_gpu_without_the_wheelhouse_says_what_to_carry_and_leaves_it_in_the_output(tmp_path):
    # The wheelhouse is git-ignored: a GPU call that did not carry it got ls's line on stderr alone, and no file.
    import os
    import subprocess

    root = Path(__file__).resolve().parents[2]
    (tmp_path / "wheels").mkdir()
    env = {**os.environ, "POPLAR_WHEELHOUSE": str(tmp_path / "wheels"), "POPLAR_GPU_SITE": str(tmp_path / "site")}
    done = subprocess.run(
        ["bash", str(root / "bench" / "gpu" / "run_on_gpu.sh"), str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    said = f"{tmp_path / 'wheels'}: expected the wheels of bench/gpu/wheelhouse.sh, found none"
    assert done.returncode == 2 and said in done.stderr
    assert said in (tmp_path / "out" / "install_failed.txt").read_text()
    assert not (tmp_path / "site").exists()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("script", "opening", "argument"),
    [("run_on_gpu.sh", "`poplar-bench gpu` on the GPU machine", "OUTPUT_DIR"), ("wheelhouse.sh", "Fill a", "FOLDER")],
)
def test_the_gpu_scripts_explain_themselves_and_refuse_an_option_for_their_folder(tmp_path, script, opening, argument):
    # --help went to mkdir: its own help, then run_on_gpu.sh failed in `cd --help` and wheelhouse.sh went on to
    # download into a folder named --help; an option first (the folder forgotten) was mkdir's error.
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    fake = tmp_path / "python3"
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.exit('no Python should run')\n")
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "POPLAR_WHEELHOUSE": str(tmp_path), "POPLAR_GPU_SITE": str(tmp_path)}

    def run(*args: str) -> subprocess.CompletedProcess:
        command = ["bash", str(root / "bench" / "gpu" / script), *args]
        return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)

    for flag in ("--help", "-h"):
        done = run(flag)
        assert done.returncode == 0 and done.stdout.startswith(opening)
        assert f"bench/gpu/{script}" in done.stdout and argument in done.stdout
    done = run("--dry-run")
    assert done.returncode == 2
    assert f"{script}: {argument}: expected the " in done.stderr and "found the option --dry-run" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["python3"]


@pytest.mark.multiprocess
def test_the_pipeline_script_refuses_a_dtype_it_would_not_train_in(tmp_path):
    # Any word went into the config as a key DeepSpeed ignores ({"bf16x": {"enabled": true}}): the run trained fp32
    # and printed "pipeline_gpt on one GPU rank, bf16x: exit code 0".
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    fake = tmp_path / "python3"
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.exit('no Python should run')\n")
    fake.chmod(0o755)
    script = root / "bench" / "gpu" / "pipeline_on_gpu.sh"
    env = {**os.environ, "PYTHON": str(fake), "POPLAR_GPU_SITE": str(tmp_path)}
    done = subprocess.run(["bash", str(script), "bf16x"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "DTYPE: expected bf16, fp16 or fp32, found 'bf16x'" in done.stderr
    assert "no Python should run" not in done.stderr
    done = subprocess.run(["bash", str(script), "--help"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("One rank trains examples/pipeline_gpt.py")
