"""Fuzzing the inputs: mutated profiles, clusters, plans and `poplar` sections.

Whatever the mutation (types, missing and extra keys, huge and negative numbers,
deep nesting, encodings), the loaders raise nothing but `FormatError` (the
documented error type, a ValueError), and `poplar-search` exits 0, 1 or 2 within
seconds (hypothesis's deadline catches a hang or a runaway search). On the shipped
files, unmutated, every global batch up to the search's limit (2**31) is planned.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import cluster_from_dict, plan_from_dict, profile_from_dict
from poplar_ext.runtime.config import poplar_config_from_dict
from poplar_ext.search import cli

EXAMPLES = Path(__file__).resolve().parents[2] / "poplar_ext" / "search" / "example_profiles"
PROFILE_FILES = sorted(p for p in EXAMPLES.glob("gpt2-small-124m.*.json"))
PROFILE = json.loads(PROFILE_FILES[0].read_text())
CLUSTER = json.loads((EXAMPLES / "cluster.json").read_text())
PLAN = json.loads((Path(__file__).resolve().parents[2] / "examples" / "plan.json").read_text())
SECTION = {
    "cluster": "c.json",
    "profiles": "p/",
    "policy": "poplar",
    "global_batch_size": 96,
    "seed": 0,
    "zero_stage": "auto",
    "shuffle": True,
    "loss_reduction": "mean",
    "drop_last": False,
}

# Values a mutation puts in place: every JSON type, and the numbers that broke things.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([0, 1, -1, 2**31, 2**31 + 1, 2**63, 10**12, 10**19, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e-300, 1e300, 0.5, -0.0, 1.0]),
    st.text(max_size=12),
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)


def _paths(value: Any) -> list[tuple]:
    """Every path to a node of a JSON document (keys and list indices)."""
    found, stack = [], [((), value)]
    while stack:
        prefix, node = stack.pop()
        found.append(prefix)
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        stack.extend((prefix + (key,), child) for key, child in children)
    return sorted(found, key=repr)


@st.composite
def mutated(draw, document: Any) -> Any:
    """`document` with one to three mutations at random places, then perhaps deep nesting."""
    document = copy.deepcopy(document)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(document)))
        action = draw(st.sampled_from(["replace", "delete", "add_key"]))
        if not path:
            if action == "replace":
                document = draw(json_values)
            continue
        parent = _at(document, path[:-1])
        last = path[-1]
        if action == "replace":
            parent[last] = draw(json_values)
        elif action == "delete":
            del parent[last]
        elif action == "add_key" and isinstance(parent[last], dict):
            parent[last][draw(st.text(min_size=1, max_size=10))] = draw(json_values)
    depth = draw(st.sampled_from([0, 0, 1, 5, 70, 3000]))
    paths = [p for p in _paths(document) if p]
    if depth and paths:
        # Last: nothing after this walks the document recursively.
        path = draw(st.sampled_from(paths))
        parent = _at(document, path[:-1])
        nested: Any = parent[path[-1]]
        for _ in range(depth):
            nested = [nested]
        parent[path[-1]] = nested
    return document


def _at(document: Any, path: tuple) -> Any:
    for key in path:
        document = document[key]
    return document


def _loads_or_format_error(load, document):
    try:
        load(document)
    except FormatError:
        pass


FUZZ = settings(
    max_examples=150, deadline=10_000, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


@FUZZ
@given(mutated(PROFILE))
def test_profile_loader_raises_only_format_errors(document):
    _loads_or_format_error(lambda d: profile_from_dict(d, source="p.json"), document)


@FUZZ
@given(mutated(CLUSTER))
def test_cluster_loader_raises_only_format_errors(document):
    _loads_or_format_error(lambda d: cluster_from_dict(d, source="c.json"), document)


@FUZZ
@given(mutated(PLAN))
def test_plan_loader_raises_only_format_errors(document):
    _loads_or_format_error(lambda d: plan_from_dict(d, source="plan.json"), document)


@FUZZ
@given(mutated(SECTION))
def test_poplar_section_raises_only_format_errors(document):
    _loads_or_format_error(lambda d: poplar_config_from_dict(d, base_dir=Path("/cfg"), source="ds.json"), document)


def _write(path: Path, document: Any, encoding: str) -> None:
    try:
        text = json.dumps(document, ensure_ascii=False)
    except RecursionError:  # 3000 levels deep: write the nesting as text
        text = '{"schema_version": 1, "nodes": ' + "[" * 3000 + "]" * 3000 + "}"
    try:
        path.write_bytes(text.encode(encoding))
    except UnicodeEncodeError:  # a character this encoding lacks: UTF-8 after all
        path.write_bytes(text.encode("utf-8"))


@settings(
    max_examples=60,
    deadline=10_000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
@given(
    profile=mutated(PROFILE),
    cluster=mutated(CLUSTER),
    which=st.sampled_from(["profile", "cluster", "both"]),
    encoding=st.sampled_from(["utf-8", "utf-8", "latin-1", "utf-16"]),
    batch=st.sampled_from(["512", "1", "7", "4096", str(2**20), str(2**31), str(2**31 + 1), "1e30", "-5", "0"]),
    stage=st.sampled_from(["auto", "0", "1", "2", "3"]),
    policy=st.sampled_from(["poplar", "uniform", "proportional", "all"]),
)
def test_poplar_search_exits_0_1_or_2(tmp_path_factory, profile, cluster, which, encoding, batch, stage, policy):
    tmp = tmp_path_factory.mktemp("fuzz")
    profiles = tmp / "profiles"
    profiles.mkdir()
    for path in PROFILE_FILES:
        (profiles / path.name).write_bytes(path.read_bytes())
    if which in ("profile", "both"):
        _write(profiles / PROFILE_FILES[0].name, profile, encoding)
    cluster_path = tmp / "cluster.json"
    _write(cluster_path, cluster if which in ("cluster", "both") else CLUSTER, encoding)
    target = tmp / "plan.json"
    code = cli.main(
        [
            "--profiles",
            str(profiles),
            "--cluster",
            str(cluster_path),
            "--global-batch-size",
            batch,
            "--zero-stage",
            stage,
            "--policy",
            policy,
            "--output",
            str(target),
        ]
    )
    assert code in (0, 1, 2)
    assert target.exists() == (code == 0)


@settings(max_examples=40, deadline=10_000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch=st.one_of(st.integers(1, 2**31), st.sampled_from([2**31, 2**31 - 1, 10**9, 10**9 + 7, 2**22, 2**22 + 1])),
    stage=st.sampled_from(["0", "1", "2", "3", "auto"]),
)
def test_poplar_search_plans_any_global_batch_up_to_2_31(tmp_path_factory, batch, stage):
    # Stages 0 and 1 split any batch of at least one sample per rank; stages 2 and 3 need
    # a divisor that fits, so a large prime is infeasible there (exit 1, with a reason).
    target = tmp_path_factory.mktemp("batch") / "plan.json"
    code = cli.main(
        [
            "--profiles",
            str(EXAMPLES),
            "--cluster",
            str(EXAMPLES / "cluster.json"),
            "--global-batch-size",
            str(batch),
            "--zero-stage",
            stage,
            "--output",
            str(target),
        ]
    )
    world_size = sum(group["count"] for node in CLUSTER["nodes"] for group in node["devices"])
    if stage in ("0", "1", "auto") and batch >= world_size:
        assert code == 0
    assert code in (0, 1)
    if code == 0:
        assert json.loads(target.read_text())["global_batch_size"] == batch
