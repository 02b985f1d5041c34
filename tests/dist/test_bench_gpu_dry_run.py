"""`poplar-bench gpu --dry-run`: every step of the GPU run on CPU stand-ins, so that a broken GPU script fails CI.

One run of the command (the GPU test tier's equivalence tests on CPU ranks in a child
pytest, tiny bf16 profiles at every stage, the policy comparison on two emulated CPU
ranks), then the files it wrote and their provenance. What it measures is not checked
here: a dry run measures nothing on a GPU.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import torch

from poplar_bench.cli import main
from poplar_search.formats import ZERO_STAGES

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

    assert main(["gpu", "--output-dir", str(out), "--dry-run"]) == 0, (out / "gpu_run.log").read_text()

    summary = json.loads((out / "gpu_run.json").read_text())
    _provenance_ok(summary["provenance"])
    assert {name: step["status"] for name, step in summary["steps"].items()} == dict.fromkeys(
        ("tests", "profiles", "policies"), "ok"
    )
    for name in ("gpu_run.md", "gpu_run.log", "gpu_policies.md"):
        text = (out / name).read_text()
        assert f"torch {VERSIONS['torch']}" in text and f"DeepSpeed {VERSIONS['deepspeed']}" in text, name

    tests = {t["name"].rsplit("::", 1)[1]: t for t in summary["steps"]["tests"]["tests"]}
    bf16 = tests["test_bf16_equals_a_bf16_reference_and_a_missing_weight_does_not"]
    assert bf16["outcome"] == "passed"
    for stage in ZERO_STAGES:  # the mutation's outcome is recorded, and exceeds the tolerance
        assert bf16["properties"][f"stage{stage}_missing_weight_max_difference"] > bf16["properties"]["tolerance"]
    assert tests["test_fp32_equals_one_process_on_the_global_batch"]["outcome"] == "passed"
    assert (out / "gpu_tests.xml").is_file() and (out / "gpu_tests.log").is_file()

    profiles = json.loads((out / "profiles.json").read_text())
    _provenance_ok(profiles["provenance"])
    assert sorted(p["zero_stage"] for p in profiles["profiles"]) == list(ZERO_STAGES)
    assert {p["dtype"] for p in profiles["profiles"]} == {"bfloat16"}
    assert profiles["batches_made_by_cached_call"] == 0 and profiles["identical_from_cache"]
    assert [g["goal"] for g in profiles["goals"]] == ["every stage profiled", "the same call from the cache"]
    assert len(list((out / "profiles").glob("*.json"))) == len(ZERO_STAGES)

    policies = json.loads((out / "gpu_policies.json").read_text())
    _provenance_ok(policies["provenance"])
    assert "DRY RUN" in policies["data_source"]
    assert [e["policy"] for e in policies["scenarios"][0]["policies"]] == ["uniform", "proportional", "poplar"]
    assert all(e["status"] == "ok" for e in policies["scenarios"][0]["policies"])
