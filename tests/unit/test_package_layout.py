"""The package tree keeps the promises DEVELOPING.md makes about it.

* every module of poplar_ext is on DEVELOPING.md's map;
* torch.distributed's collectives are used in one module only (`poplar_ext/collectives.py`);
  starting processes through torch.distributed.elastic is not a collective;
* ZeRO stages and policy names are spelled out once (`poplar_ext/plan/formats.py`);
* importing poplar_ext configures no logging: its logger has a NullHandler only.
"""

from __future__ import annotations

import ast
import functools
import re
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


# -- Names in prose: what a reader is told to import exists under that name
_BACKTICKED = re.compile(r"`{1,2}([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`{1,2}")
_SHORT_HEADS = ("search", "plan", "profiler", "runtime", "hardware", "zero", "integrations", "models")
"""Backticked names that start with a folder of poplar_ext name that folder (``pipeline.`` is left out: it is also
the DeepSpeed config's section)."""
_RETIRED = re.compile(r"\bsearch\.formats\b|\bfrom search import\b|(?<![\w./-])bench\.(?!md\b|json\b)[a-z_]+\b(?!/)")
"""Names from before the one package: ``search`` and ``bench`` installed under other names (``bench.gpu_model/1``
stays: a version written into profiles)."""


def _markdown_files() -> list[Path]:
    """Every .md file of the tree, outside dot-folders (.git, caches, a virtual environment) and build metadata."""
    return sorted(
        p
        for p in ROOT.rglob("*.md")
        if not any(part.startswith(".") or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts[:-1])
    )


def _prose_files() -> list[Path]:
    docs = [p for p in _markdown_files() if "results" not in p.parts]
    return docs + [p for package in PACKAGES for p in _modules(package)]


@functools.cache
def _top_level_names(path: Path) -> tuple[set[str], dict[str, ast.ClassDef]]:
    """What a module defines at its top level, also under an ``if`` or ``try`` there (TYPE_CHECKING, an
    optional import), and its classes by name."""
    names: set[str] = set()
    classes: dict[str, ast.ClassDef] = {}
    body = list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                classes[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
            if isinstance(node.value, ast.Dict):  # a package's lazily loaded names (PEP 562)
                names.update(k.value for k in node.value.keys if isinstance(k, ast.Constant))
        elif isinstance(node, (ast.If, ast.Try)):
            body += node.body + node.orelse + getattr(node, "finalbody", [])
            body += [stmt for handler in getattr(node, "handlers", []) for stmt in handler.body]
    return names, classes


def _class_has(node: ast.ClassDef, member: str) -> bool:
    """Whether the class defines `member` (a method, a field, a class attribute, an attribute its methods set on
    ``self``), or inherits from outside the file (members not followed)."""
    if any(
        not (isinstance(b, ast.Name) and b.id in {"object", "Exception", "ValueError", "Protocol"}) for b in node.bases
    ):
        return True
    for item in ast.walk(node):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and item.name == member:
            return True
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.target.id == member:
            return True
        if isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == member for t in item.targets):
            return True
        stored = isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store)
        if stored and item.attr == member and isinstance(item.value, ast.Name) and item.value.id == "self":
            return True
    return False


def _module_file(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_file(".".join(parts[:cut]))
        if path is None:
            continue
        rest = parts[cut:]
        if not rest:
            return True
        names, classes = _top_level_names(path)
        if rest[0] not in names:
            return False
        return len(rest) == 1 or rest[0] not in classes or _class_has(classes[rest[0]], rest[1])
    return False


def _named_in_prose() -> list[tuple[str, int, str]]:
    found = []
    for path in _prose_files():
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for match in _BACKTICKED.finditer(line):
                name = match.group(1)
                if name.split(".")[0] in _SHORT_HEADS:
                    name = "poplar_ext." + name
                if name.split(".")[0] in PACKAGES and name.rsplit(".", 1)[1] not in {"py", "md", "json"}:
                    found.append((f"{path.relative_to(ROOT)}:{number}", 0, name))
            found += [(f"{path.relative_to(ROOT)}:{number}", 1, m.group(0)) for m in _RETIRED.finditer(line)]
    return found


def test_names_in_docs_and_docstrings_are_the_names_that_import():
    named = _named_in_prose()
    assert sum(1 for _, retired, _ in named if not retired) > 100, "the scan found the backticked names"
    wrong = [f"{where}: {name}" for where, retired, name in named if retired or not _resolves(name)]
    assert not wrong, "names that do not import as written (the module or name moved?):\n" + "\n".join(wrong)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """Private names this module takes from the project's others: imported by name, or read off a module it
    imported (``from . import demo`` then ``demo._preimport()``)."""
    uses, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(PACKAGES)):
            private = [a.name for a in node.names if _private(a.name)]
            if private and not (node.module == "poplar_ext" and private == ["_lazy_attributes"]):
                uses.append((node.lineno, ", ".join(private)))
            modules.update(a.asname or a.name for a in node.names)  # names that may be modules
        elif isinstance(node, ast.Import):
            modules.update(a.asname or a.name for a in node.names if a.name.startswith(PACKAGES))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and ast.unparse(node.value) in modules:
            uses.append((node.lineno, ast.unparse(node)))
    return uses


def test_no_module_takes_another_modules_private_names():
    """What one module takes from another is public there: a private name shared across modules (the pipeline
    package once took `_on_cpu` from the ZeRO initialize) is coupling no reader of the owner can see. The one
    exception: the package root's `_lazy_attributes`, which its subpackages' __init__ use for their own lazy names."""
    shared = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for package in PACKAGES
        for path in _modules(package)
        for line, what in _private_uses(ast.parse(path.read_text()))
    ]
    assert not shared, "\n".join(shared)


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_relative_link_in_the_docs_names_a_file_in_the_tree():
    """A link to a file that moved or left (a one-off script git now keeps) reads as a promise the tree breaks."""
    links = [(doc, m.group(1).partition("#")[0]) for doc in _markdown_files() for m in _LINK.finditer(doc.read_text())]
    relative = [(doc, target) for doc, target in links if target and not target.startswith(("http:", "https:"))]
    assert len(relative) > 100, "the scan found the links"
    broken = [f"{doc.relative_to(ROOT)}: {target}" for doc, target in relative if not (doc.parent / target).exists()]
    assert not broken, "\n".join(broken)


_SCRIPT_NAME = re.compile(r"`([\w./<>-]+\.(?:py|sh))`")


def test_every_script_a_result_names_is_in_the_tree_or_named_with_its_commit():
    """bench/results keeps measurements, not the one-off scripts behind them (git keeps those): a README
    telling a reader to run `run_all.sh` that left the tree breaks that promise."""
    results = ROOT / "bench" / "results"
    named = [
        (doc, paragraph, name)
        for doc in _markdown_files()
        if results in doc.parents
        for paragraph in doc.read_text().split("\n\n")
        for name in _SCRIPT_NAME.findall(paragraph)
    ]
    assert len(named) > 5, "the scan found the scripts named"
    missing = [
        f"{doc.relative_to(ROOT)}: {name}"
        for doc, paragraph, name in named
        if "git show" not in paragraph
        and not any((base / name).exists() for base in (doc.parent, ROOT, ROOT / "poplar_ext", ROOT / "poplar_bench"))
    ]
    assert missing == [], "not in the tree (say `git show REV:PATH` where git keeps them):\n" + "\n".join(missing)


_DOC_PATH = re.compile(r"(?:docs/[\w.-]+\.md|profiles/README\.md|DEVELOPING\.md|README\.md)")


def test_every_library_module_says_what_it_is_for_and_points_to_a_doc_that_exists():
    """The style the issue sets: a module docstring says what the module is for and points to the docs."""
    problems = []
    for path in _modules("poplar_ext"):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        named = _DOC_PATH.findall(doc)
        if not doc.strip() or not named:
            problems.append(f"{path.relative_to(ROOT)}: {'no docstring' if not doc.strip() else 'names no doc'}")
        problems += [
            f"{path.relative_to(ROOT)}: {name} is not in the tree" for name in named if not (ROOT / name).exists()
        ]
    assert problems == [], "\n".join(problems)
