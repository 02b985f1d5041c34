"""Plans that cannot run are refused on every rank before any collective; plans
searched at start reach every rank.

The bad cases run with no process group set up in advance: a rank that went on
to DeepSpeed's rendezvous while another raised would wait there until the
harness's timeout, so passing here means no rank entered any collective.
"""

from __future__ import annotations

import contextlib
import json
import os

import _training as t
import pytest
from harness import run_ranks

TYPES = ["cpu", "cpu-slow", "cpu-slow"]


def _initialize(files, *, stage, **poplar):
    import poplar_ext

    model = t.GPT(t.TINY)
    config = t.ds_config(cluster=files["cluster"], plan=files.get(poplar.pop("plan_key", None)), stage=stage)
    config["poplar"].update(poplar)
    return poplar_ext.initialize(model=model, optimizer=t.make_optimizer("sgd", model.parameters()), config=config)


BAD_CASES = {
    "two_ranks": dict(stage=1, plan_key="two_ranks"),
    "stage2_uneven_counts": dict(stage=2, plan_key="stage2_uneven_counts"),
    "stage_differs": dict(stage=0, plan_key="stage1"),
    "over_max_micro_batch": dict(stage=1, plan_key="stage1", profiles_key="profiles"),
    "missing_profiles": dict(stage=1, profiles_key="partial_profiles", global_batch_size=12),
    "cluster_not_the_hardware": dict(stage=1, plan_key="stage1", cluster_key="a100_cluster"),
    "cluster_file_missing": dict(stage=1, plan_key="stage1", cluster_key="missing_cluster"),
    "stage_too_large": dict(stage=1, plan_key="stage1", cluster_key="small_cluster"),
}


def _refusals(files):
    messages = {}
    for name, case in BAD_CASES.items():
        case = dict(case)
        profiles_key = case.pop("profiles_key", None)
        if profiles_key:
            case["profiles"] = str(files[profiles_key])
        cluster_key = case.pop("cluster_key", None)
        if cluster_key:
            case["cluster"] = str(files[cluster_key])
        try:
            _initialize(files, **case)
            messages[name] = "accepted"
        except ValueError as exc:
            messages[name] = str(exc)
    # Last, the good case: searched on rank 0 and broadcast (the first collective).
    with _counting_reads() as reads:
        engine, *_ = _initialize(files, stage=1, profiles=str(files["profiles"]), global_batch_size=12)
    searched = [(r.micro_batch_size, r.gradient_accumulation_steps) for r in engine.plan.ranks]
    return {"messages": messages, "searched": searched, "rank": int(os.environ["RANK"]), "reads": reads}


@contextlib.contextmanager
def _counting_reads():
    """How often this rank reads the profile directory and the network file."""
    import poplar_ext.plan.network_format
    from poplar_ext.zero import planning

    reads = {"profiles": 0, "network": 0}
    readers = {"profiles": (planning, "load_profiles"), "network": (poplar_ext.plan.network_format, "find_network")}
    originals = {name: getattr(module, attribute) for name, (module, attribute) in readers.items()}

    def counted(name):
        def counting(*args, **kwargs):
            reads[name] += 1
            return originals[name](*args, **kwargs)

        return counting

    for name, (module, attribute) in readers.items():
        setattr(module, attribute, counted(name))
    try:
        yield reads
    finally:
        for name, (module, attribute) in readers.items():
            setattr(module, attribute, originals[name])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from poplar_ext.profiler.fingerprint import model_fingerprint

    tmp = tmp_path_factory.mktemp("plans")
    fingerprint = model_fingerprint(t.GPT(t.TINY))
    files = {
        "cluster": t.write_cluster(tmp / "cluster.json"),
        "two_ranks": t.write_plan(tmp / "two.json", [(2, 1), (2, 1)], stage=1, device_types=TYPES[:2]),
        "stage2_uneven_counts": t.write_plan(tmp / "s2.json", [(2, 1), (2, 2), (2, 1)], stage=2, device_types=TYPES),
        "stage1": t.write_plan(tmp / "s1.json", [(8, 1), (3, 1), (2, 1)], stage=1, device_types=TYPES),
        # cpu-slow can hold at most 2 samples per micro-step
        "profiles": t.write_profiles(tmp / "profiles", fingerprint, [("cpu", 16, 0.001), ("cpu-slow", 2, 0.003)]),
        "partial_profiles": t.write_profiles(tmp / "partial", fingerprint, [("cpu", 16, 0.001)]),
        "missing_cluster": tmp / "no-such-cluster.json",
    }
    files["a100_cluster"] = tmp / "a100.json"
    files["a100_cluster"].write_text(
        json.dumps(
            {
                "schema_version": 1,
                "nodes": [
                    {"name": "n0", "devices": [{"device_type": "A100-80GB", "count": 1}]},
                    {"name": "n1", "devices": [{"device_type": "cpu-slow", "count": 2}]},
                ],
                "device_types": {"cpu-slow": {"emulation": {"slowdown": 1.5, "memory_capacity_bytes": 2_000_000_000}}},
            }
        )
    )
    # cpu-slow's memory cannot hold even the model states at ZeRO 1 (the plan's stage).
    small = json.loads(files["cluster"].read_text())
    small["device_types"]["cpu-slow"]["emulation"]["memory_capacity_bytes"] = 10_000
    files["small_cluster"] = tmp / "small.json"
    files["small_cluster"].write_text(json.dumps(small))
    return run_ranks(_refusals, world_size=3, tmp_path=tmp, args=(files,), init_process_group=False, timeout_s=120)


def _messages(results, case):
    messages = [r["messages"][case] for r in results]
    assert len(set(messages)) == 1, f"ranks disagree: {messages}"
    return messages[0]


def test_plan_for_another_world_size(results):
    message = _messages(results, "two_ranks")
    assert "The plan names 2 ranks but the job has 3 (WORLD_SIZE)." in message


def test_stage2_with_per_rank_counts(results):
    assert "ZeRO stage 2 needs the same gradient_accumulation_steps on every rank" in _messages(
        results, "stage2_uneven_counts"
    )


def test_plan_stage_differs_from_config(results):
    message = _messages(results, "stage_differs")
    assert (
        "The plan is for ZeRO stage 1 but the config asks for stage 0 (zero_optimization.stage or poplar.zero_stage)."
        in message
    )


def test_micro_batch_over_the_profiles_largest(results):
    message = _messages(results, "over_max_micro_batch")
    assert "micro_batch_size is above the profile's max_micro_batch_size at rank 1 (cpu-slow: 3 > 2)" in message


def test_missing_profiles_say_what_to_run(results):
    message = _messages(results, "missing_profiles")
    assert "lacks profiles for these device types and ZeRO stages (stage 1: cpu-slow)" in message
    assert "--module poplar_ext.profiler --deepspeed_config DS.json --cluster" in message
    assert "--zero-stages 1 --output-dir" in message


def test_searched_plan_reaches_every_rank(results):
    plans = [r["searched"] for r in results]
    assert plans[0] == plans[1] == plans[2]
    assert sum(b * s for b, s in plans[0]) == 12
    assert all(b <= 2 for b, _ in plans[0][1:])  # within cpu-slow's cap


def test_a_cluster_file_that_is_not_the_hardware_stops_every_rank(results):
    message = _messages(results, "cluster_not_the_hardware")
    assert "poplar.cluster: " in message and "does not match the hardware: Rank 0 on" in message
    assert "the cluster description says 'A100-80GB'; name it 'cpu'" in message


def test_a_missing_cluster_file_stops_every_rank(results):
    assert "no-such-cluster.json" in _messages(results, "cluster_file_missing")


def test_rank_0_reads_the_profiles_and_the_network_file_once(results):
    # Searched at start with re-balancing on (its default, "auto"): the search and the
    # re-balancer's inputs come from one reading of each file, on rank 0 alone.
    assert [r["reads"] for r in results] == [{"profiles": 1, "network": 1}] + [{"profiles": 0, "network": 0}] * 2


def test_a_stage_a_rank_cannot_hold_stops_every_rank_before_the_engine(results):
    message = _messages(results, "stage_too_large")
    assert "rank 1 (cpu-slow): ZeRO stage 1 needs at least" in message, message
    assert "rank 2 (cpu-slow)" in message and "rank 0" not in message
    assert "more than its memory of 0.0 GiB" in message
