"""The wheel installs cleanly: unique top-level names, the example profiles in, the results out.

A wheel is built from a copy of the source tree (no stale build/ of a checkout), its
contents checked, and installed alone (not editable, no dependencies beyond numpy and
scipy, which the fresh environment takes from this one) into a fresh virtual
environment, where `poplar-search` runs the shipped example and `poplar-bench simulate`
a shipped cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess  # every test here starts a process

ROOT = Path(__file__).resolve().parents[2]
SKIP = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "results", "tests")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source") / "poplar-ext"
    shutil.copytree(ROOT, source, ignore=SKIP)
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (built,) = out.glob("poplar_ext-*.whl")
    return built


def test_the_wheel_holds_unique_top_level_names_and_the_examples_not_the_results(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top_level == {"poplar_ext", "poplar_bench"}
    examples = [n for n in names if n.startswith("poplar_ext/search/example_profiles/") and n.endswith(".json")]
    assert "poplar_ext/search/example_profiles/cluster.json" in examples and len(examples) == 12
    # The pipeline search's layer profiles and the example's network come along.
    assert len([n for n in examples if "/example_profiles/layers/" in n]) == 2
    assert len([n for n in examples if "/example_profiles/network/" in n]) == 1
    assert any(n.startswith("poplar_bench/clusters/") and n.endswith(".json") for n in names)
    assert not [n for n in names if "/results/" in n or n.startswith("tests/")]
    # Every package of the tree is listed in pyproject's packages (a package left out is
    # missing from installs, though a checkout imports it).
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "poplar_ext").rglob("__init__.py")}
    missing = packages - {name.rsplit("/", 1)[0] for name in names}
    assert not missing, sorted(missing)
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    for script in ("poplar-search = poplar_ext.search.cli:main", "poplar-bench = poplar_bench.cli:main"):
        assert script in entry_points


def test_a_fresh_environment_with_the_wheel_alone_runs_search_and_simulate(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    # numpy and scipy from this environment; poplar-ext from the wheel only (no editable finder:
    # the wheel's copy must be the one imported, which the check below asserts).
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    # a fresh environment: a PYTHONPATH of the caller's (a worktree's packages) would be found first
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)]
    done = subprocess.run(install, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    where = subprocess.run(
        [
            str(python),
            "-c",
            "import poplar_ext.search, poplar_bench; print(poplar_ext.search.__file__, poplar_bench.__file__)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert where.stdout.count(str(env_dir)) == 2, where.stdout + where.stderr
    search = subprocess.run(
        [str(env_dir / "bin" / "poplar-search"), "--example", "--global-batch-size", "512", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert search.returncode == 0, search.stderr[-3000:]
    plan = json.loads(search.stdout)
    assert plan["global_batch_size"] == 512 and {r["device_type"] for r in plan["ranks"]} == {"A100-80GB", "V100-16GB"}
    cluster = next((env_dir / "lib").glob("python3*/site-packages/poplar_bench/clusters/*-x8.json"))
    simulate = subprocess.run(
        [str(env_dir / "bin" / "poplar-bench"), "simulate", "--cluster", str(cluster), "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert simulate.returncode == 0, simulate.stderr[-3000:]
    assert (tmp_path / "simulation.md").is_file()
