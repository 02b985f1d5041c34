"""`poplar-bench gpu --dry-run`: every step of the GPU run on CPU stand-ins, so that a broken GPU script fails CI.

One run of the command (the exactness checks of tests/gpu on CPU ranks in a child pytest,
tiny bf16 profiles at ZeRO 1 and 3, the policy comparison on two emulated CPU ranks), then
the eight files it wrote, flat, and their provenance. What it measures is not checked here:
a dry run measures nothing on a GPU.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import torch

from poplar_bench.cli import main
from poplar_ext.plan.formats import ZERO_STAGES

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = {"torch": torch.__version__, "deepspeed": importlib.metadata.version("deepspeed")}


def _provenance_ok(provenance: dict) -> None:
    assert {k: provenance[k] for k in VERSIONS} == VERSIONS
    assert provenance["dry_run"] is True and "dry run" in provenance["devices"]
    for key in ("gpu", "driver", "cuda", "python"):
        assert key in provenance, key


def test_dry_run_writes_every_result_with_its_provenance(tmp_path, monkeypatch):
    for name in ("DS_BUILD_OPS", "DS_SKIP_CUDA_CHECK", "PYTORCH_NVML_BASED_CUDA_CHECK"):
        monkeypatch.setenv(name, "")  # the run sets them: put back after the test
    monkeypatch.chdir(ROOT)  # the command runs from the repository root
    out = tmp_path / "out"

    command = ["gpu", "--output-dir", str(out), "--work-dir", str(tmp_path / "work"), "--dry-run"]
    assert main(command) == 0, (out / "gpu_run.log").read_text()

    # At most 8 files, flat: all of them come back from the GPU machine.
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["gpu_run.json", "gpu_run.md", "gpu_run.log", "provenance.json", "exact.jsonl", "profile_trials.jsonl"]
        + ["predictions.json", "predictions.md"]
    )
    _provenance_ok(json.loads((out / "provenance.json").read_text()))
    summary = json.loads((out / "gpu_run.json").read_text())
    _provenance_ok(summary["provenance"])
    assert {name: step["status"] for name, step in summary["steps"].items()} == {
        **dict.fromkeys(("exact", "profile", "predictions"), "ok"),
        "launcher": "skipped",  # pytest skips it on CPU: reported as such, not as a launcher that ran
    }
    reasons = ("dry run on CPU: the launcher test needs GPUs", "the deepspeed launcher is not on PATH")
    assert summary["steps"]["launcher"]["reason"] in reasons
    assert "## launcher: skipped" in (out / "gpu_run.md").read_text()
    for name in ("gpu_run.md", "gpu_run.log", "predictions.md"):
        text = (out / name).read_text()
        assert f"torch {VERSIONS['torch']}" in text and f"DeepSpeed {VERSIONS['deepspeed']}" in text, name

    lines = [json.loads(line) for line in (out / "exact.jsonl").read_text().splitlines()]
    seen = {(line["check"], line["zero_stage"]): line["within_tolerance"] for line in lines}
    mutation = "bf16 without the loss weight (mutation)"
    expected = {("fp32", s): True for s in ZERO_STAGES} | {("bf16", s): True for s in ZERO_STAGES}
    assert seen == expected | {(mutation, 0): False, (mutation, 3): False}

    records = [json.loads(line) for line in (out / "profile_trials.jsonl").read_text().splitlines()]
    trials = [r["line"] for r in records if "line" in r and " probe: " in r["line"]]
    assert trials and all("micro-batch" in t and ("peak" in t or "out of memory" in t) for t in trials)
    profiles = [r["profile"] for r in records if "profile" in r]
    assert sorted(p["zero_stage"] for p in profiles) == [1, 3]
    assert {p["model"]["dtype"] for p in profiles} == {"bfloat16"}
    profile_step = summary["steps"]["profile"]
    assert profile_step["batches_made_by_cached_call"] == 0 and profile_step["identical_from_cache"]

    predictions = json.loads((out / "predictions.json").read_text())
    _provenance_ok(predictions["provenance"])
    assert "DRY RUN" in predictions["data_source"]
    assert [e["policy"] for e in predictions["scenarios"][0]["policies"]] == ["uniform", "proportional", "poplar"]
    assert all(e["status"] == "ok" for e in predictions["scenarios"][0]["policies"])
