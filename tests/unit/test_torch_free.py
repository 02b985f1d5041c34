"""`poplar_ext.search` (search/) runs with torch and deepspeed unimportable (design: a laptop without torch)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess  # every test here starts a process

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


HELP_SCRIPT = (
    SCRIPT.split("import poplar_ext.search")[0]
    + """
from poplar_ext.profiler.cli import main
code = main(sys.argv[1:])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "deepspeed"))
print("LOADED", loaded, "EXIT", code)
"""
)


def test_poplar_profile_answers_help_and_bad_input_without_importing_torch():
    """`poplar-profile --help` and a refused command line answer at once: torch is imported only for work."""
    helped = subprocess.run([sys.executable, "-c", HELP_SCRIPT, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert helped.returncode == 0, helped.stderr
    assert "usage: poplar-profile" in helped.stdout and "--deepspeed_config" in helped.stdout
    refused = subprocess.run(
        [sys.executable, "-c", HELP_SCRIPT, "--model", "toy-gpt"], cwd=ROOT, capture_output=True, text=True
    )
    assert "LOADED [] EXIT 2" in refused.stdout, refused.stderr
    assert refused.stderr.startswith("poplar-profile: error: ") and "--deepspeed_config" in refused.stderr


def test_the_reshard_command_answers_help_without_importing_torch():
    script = (
        SCRIPT.split("import poplar_ext.search")[0]
        + "from poplar_ext.runtime.reshard import main\n"
        + "code = main(['--help'])\n"
    )
    helped = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0, helped.stderr
    assert "--input_folder" in helped.stdout and "--output_folder" in helped.stdout


def test_poplar_profile_without_torch_installed_says_what_to_install(tmp_path):
    # As under `pip install --no-deps poplar-ext numpy scipy`: torch is not there at all (ModuleNotFoundError).
    config = tmp_path / "ds.json"
    config.write_text('{"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}')
    script = (
        "import sys\n"
        "sys.modules['torch'] = sys.modules['deepspeed'] = None\n"
        "from poplar_ext.profiler.cli import main\n"
        f"sys.exit(main(['--deepspeed_config', {str(config)!r}, '--model', 'toy-gpt']))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("poplar-profile: error: expected torch and deepspeed installed, found no module")
    assert done.stderr.count("\n") == 1, done.stderr
