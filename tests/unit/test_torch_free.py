"""`poplar_ext.search` (search/) runs with torch and deepspeed unimportable (design: a laptop without torch)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import sys

class Blocker:
    # A meta-path finder that makes torch and deepspeed (and their submodules) unimportable.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "deepspeed"):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, Blocker())

import poplar_ext.search
from poplar_ext.search.cli import main
from poplar_bench.synthetic import random_profiles, simple_cluster
import numpy as np

profiles = random_profiles(np.random.default_rng(0), ["a", "b"])
result = poplar_ext.search.search_plan(profiles, simple_cluster({"a": 2, "b": 2}), global_batch_size=64)
assert result.ok, result.message
code = main(["--example", "--global-batch-size", "512", "--format", "json"])
assert code == 0, code
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "deepspeed"))
print("LOADED", loaded)
"""


def test_search_imports_and_runs_without_torch_or_deepspeed():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "LOADED []" in proc.stdout


def test_the_blocker_really_blocks():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.split("import poplar_ext.search")[0] + "import torch"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "torch is blocked in this test" in proc.stderr
