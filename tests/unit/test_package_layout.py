"""The package tree keeps the promises DEVELOPING.md makes about it.

* every module of poplar_ext is on DEVELOPING.md's map;
* torch.distributed's collectives are used in one module only (`poplar_ext/collectives.py`);
  starting processes through torch.distributed.elastic is not a collective;
* ZeRO stages and policy names are spelled out once (`poplar_ext/plan/formats.py`);
* importing poplar_ext configures no logging: its logger has a NullHandler only.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("poplar_ext", "poplar_bench")


def _modules(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "results" not in p.parts)


def test_developing_md_maps_every_module():
    text = (ROOT / "DEVELOPING.md").read_text()
    map_text = text[text.index("## Map of the code") : text.index("## Contracts between the pieces")]
    missing = []
    for package in ("poplar_ext",):
        for path in _modules(package):
            if path.name != "__init__.py" and path.name not in map_text:
                missing.append(str(path.relative_to(ROOT)))
        for directory in sorted(p for p in (ROOT / package).iterdir() if (p / "__init__.py").exists()):
            if f"{directory.name}/" not in map_text:
                missing.append(f"{directory.relative_to(ROOT)}/")
    assert not missing, f"not on DEVELOPING.md's map: {missing}"


def _is_collectives(module: str) -> bool:
    return module.startswith("torch.distributed") and not module.startswith("torch.distributed.elastic")


def _imports_torch_distributed(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(_is_collectives(a.name) for a in node.names):
            return True
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and (
                _is_collectives(node.module)
                or (node.module == "torch" and any(a.name == "distributed" for a in node.names))
            )
        ):
            return True
    return False


def test_only_the_collectives_module_touches_torch_distributed():
    users = [
        str(path.relative_to(ROOT))
        for path in _modules("poplar_ext")
        if _imports_torch_distributed(ast.parse(path.read_text()))
    ]
    assert users == ["poplar_ext/collectives.py"]


STAGES = {0, 1, 2, 3}
POLICY_NAMES = {"uniform", "proportional", "poplar"}


def _vocabulary_literals(path: Path) -> list[tuple[str, str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, (ast.Tuple, ast.List, ast.Set))
            and node.elts
            and all(isinstance(e, ast.Constant) for e in node.elts)
        ):
            values = [e.value for e in node.elts]
            if all(type(v) is int for v in values) and set(values) == STAGES and len(values) == 4:
                found.append((str(path.relative_to(ROOT)), "ZeRO stages", node.lineno))
            elif set(values) == POLICY_NAMES and len(values) == 3:
                found.append((str(path.relative_to(ROOT)), "policy names", node.lineno))
    return found


def test_stages_and_policy_names_are_spelled_out_once():
    found = [hit for package in PACKAGES for path in _modules(package) for hit in _vocabulary_literals(path)]
    assert sorted((path, kind) for path, kind, _ in found) == [
        ("poplar_ext/plan/formats.py", "ZeRO stages"),
        ("poplar_ext/plan/formats.py", "policy names"),
    ], found


@pytest.mark.multiprocess
def test_importing_poplar_ext_configures_no_logging():
    code = (
        "import logging, poplar_ext\n"
        "assert logging.getLogger().handlers == [], logging.getLogger().handlers\n"
        "print([type(h).__name__ for h in logging.getLogger('poplar_ext').handlers])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "['NullHandler']"


@pytest.mark.parametrize("name", ["initialize", "PoplarEngine", "profile_model", "PlanBatchSampler"])
def test_public_api(name):
    import poplar_ext

    assert name in poplar_ext.__all__ and getattr(poplar_ext, name) is not None
