"""The job's devices read from the hardware (poplar_ext/hardware/discovery.py), without processes.

The gathering is one collective; everything decided from the gathered facts is pure
and tested here with facts as a cluster of GPUs would report them.
"""

from __future__ import annotations

import json

import pytest
import torch

from poplar_ext.hardware.devices import cuda_device_index
from poplar_ext.hardware.discovery import (
    DeviceFacts,
    agreed_cluster,
    check_device_support,
    cluster_from_facts,
    cluster_mismatches,
    has_kernels_for,
    local_device_facts,
    local_node_key,
    memory_capacity_bytes,
    node_key,
)
from poplar_ext.plan.formats import cluster_from_dict, cluster_to_dict, save_cluster

GIB = 2**30


CUDA_12_ARCHS = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")
CUDA_13_ARCHS = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120")


def _facts(
    *ranks: tuple[str, str, str, int],
    nodes: tuple[str, ...] = (),
    capabilities: tuple[tuple[int, int] | None, ...] = (),
    archs: tuple[str, ...] = CUDA_12_ARCHS,
) -> list[DeviceFacts]:
    """(host, device type, device id, memory GiB) per rank; the node key is the host unless `nodes`
    gives it; compute capability 8.0 unless `capabilities` gives it."""
    return [
        DeviceFacts(
            rank=r,
            host=host,
            node=nodes[r] if nodes else host,
            device_type=t,
            hardware=f"NVIDIA {t}",
            memory_bytes=gib * GIB,
            device_id=uuid,
            compute_capability=capabilities[r] if capabilities else (8, 0),
            cuda_arch_list=archs,
        )
        for r, (host, t, uuid, gib) in enumerate(ranks)
    ]


MIXED = _facts(
    ("a", "A100-80GB", "GPU-a0", 80),
    ("a", "A100-80GB", "GPU-a1", 80),
    ("a", "V100-16GB", "GPU-a2", 16),
    ("b", "V100-16GB", "GPU-b0", 16),
    ("b", "V100-16GB", "GPU-b1", 16),
)


def test_the_discovered_cluster_lists_every_rank_in_order():
    cluster = cluster_from_facts(MIXED)
    assert cluster.rank_device_types == ("A100-80GB", "A100-80GB", "V100-16GB", "V100-16GB", "V100-16GB")
    assert [n.name for n in cluster.nodes] == ["a", "b"]
    assert [(g.device_type, g.count) for g in cluster.nodes[0].devices] == [("A100-80GB", 2), ("V100-16GB", 1)]
    # It is a valid cluster file for poplar-search.
    assert cluster_from_dict(cluster_to_dict(cluster)).rank_device_types == cluster.rank_device_types


def test_containers_with_one_host_name_on_two_machines_are_two_nodes():
    ranks = (("worker", "A100-80GB", "0", 80), ("worker", "A100-80GB", "0", 80))
    facts = _facts(*ranks, nodes=(node_key("worker", "boot-1", "net:[1]"), node_key("worker", "boot-2", "net:[1]")))
    cluster = cluster_from_facts(facts)
    assert [n.name for n in cluster.nodes] == ["worker", "worker#2"]
    # Each is its own device (the same index on two machines), with all of its memory.
    assert [memory_capacity_bytes(facts, r) for r in (0, 1)] == [80 * GIB, 80 * GIB]


def test_ranks_of_one_machine_share_a_node_key():
    assert node_key("worker", "boot-1", "net:[7]") == node_key("worker", "boot-1", "net:[7]")
    assert node_key("worker", "boot-1", "net:[7]") != node_key("worker", "boot-1", "net:[8]")
    assert node_key("worker", "boot-1", "net:[7]") != node_key("other", "boot-1", "net:[7]")


def test_the_local_node_key_reads_the_boot_id_and_the_network_namespace(tmp_path, monkeypatch):
    import poplar_ext.hardware.discovery as discovery

    (tmp_path / "boot_id").write_text("b0d-1\n")
    monkeypatch.setattr(discovery, "_BOOT_ID_FILES", (str(tmp_path / "missing"), str(tmp_path / "boot_id")))
    monkeypatch.setattr(discovery.os, "readlink", lambda path: "net:[4026531840]")
    monkeypatch.setattr(discovery.socket, "gethostname", lambda: "worker")
    assert local_node_key() == node_key("worker", "b0d-1", "net:[4026531840]")


@pytest.mark.parametrize(
    ("capability", "archs", "covered"),
    [
        ((8, 0), ("sm_80",), True),
        ((8, 6), ("sm_80",), True),  # binary compatible within a major
        ((8, 0), ("sm_86",), False),  # never downwards
        ((9, 0), ("sm_80", "sm_86"), False),  # nor across majors
        ((9, 0), ("sm_80", "compute_80"), True),  # PTX is compiled for a newer device
        ((7, 0), CUDA_13_ARCHS, False),  # CUDA 13 builds dropped Volta
        ((7, 5), CUDA_13_ARCHS, True),
        ((12, 1), CUDA_13_ARCHS, True),
        ((10, 3), ("sm_90a", "sm_100a"), False),  # arch-specific kernels run on that exact device only
        ((9, 0), ("sm_90a",), True),
        ((8, 0), (), False),
    ],
)
def test_a_torch_build_has_kernels_for_a_capability(capability, archs, covered):
    assert has_kernels_for(capability, archs) is covered


def test_a_device_the_torch_build_has_no_kernels_for_is_refused_on_every_rank():
    facts = _facts(
        ("a", "A100-80GB", "0", 80),
        ("b", "V100-32GB", "0", 32),
        capabilities=((8, 0), (7, 0)),
        archs=CUDA_13_ARCHS,
    )
    with pytest.raises(ValueError) as info:
        check_device_support(facts, bf16=False, source="poplar_ext.initialize")
    message = str(info.value)
    assert "Rank 1 on b has NVIDIA V100-32GB (compute capability 7.0)" in message
    assert "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120 compute_120" in message
    assert "install a torch build" in message
    assert "Rank 0" not in message


def test_bf16_is_refused_where_a_rank_is_older_than_ampere():
    facts = _facts(("a", "A100-80GB", "0", 80), ("b", "T4-16GB", "0", 16), capabilities=((8, 0), (7, 5)))
    check_device_support(facts, bf16=False, source="cluster")  # fp16 and fp32 run anywhere
    with pytest.raises(ValueError, match=r"Rank 1 on b has NVIDIA T4-16GB \(compute capability 7.5\).*bf16.*fp16"):
        check_device_support(facts, bf16=True, source="cluster")


def test_cpu_ranks_need_no_kernels_and_run_bf16():
    facts = _facts(("a", "cpu", "cpu", 16), capabilities=(None,), archs=())
    check_device_support(facts, bf16=True, source="cluster")


def test_a_cuda_device_records_its_capability_and_the_torch_build(monkeypatch):
    class Properties:
        name = "Tesla V100-SXM2-32GB"
        total_memory = 32 * GIB
        major, minor = 7, 0
        uuid = "GPU-1"

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(CUDA_13_ARCHS))
    facts = local_device_facts(torch.device("cuda", 0), rank=3)
    assert facts.compute_capability == (7, 0)
    assert facts.cuda_arch_list == CUDA_13_ARCHS
    assert facts.device_type == "V100-32GB"
    assert "sm_75" in facts.hardware  # profiles' provenance says which kernels the build had


def test_a_host_whose_ranks_are_not_consecutive_keeps_every_rank_in_place():
    facts = _facts(("a", "T4-16GB", "0", 16), ("b", "L4-24GB", "0", 24), ("a", "T4-16GB", "1", 16))
    cluster = cluster_from_facts(facts)
    assert cluster.rank_device_types == ("T4-16GB", "L4-24GB", "T4-16GB")
    assert [n.name for n in cluster.nodes] == ["a", "b", "a#2"]


def test_a_cluster_file_that_puts_the_big_micro_batch_on_the_small_card_is_caught():
    declared = cluster_from_dict(
        {
            "schema_version": 1,
            "nodes": [
                {"name": "a", "devices": [{"device_type": "A100-80GB", "count": 3}]},
                {"name": "b", "devices": [{"device_type": "V100-16GB", "count": 2}]},
            ],
        }
    )
    problems = cluster_mismatches(declared, MIXED)
    assert problems == [
        "Rank 2 on a has NVIDIA V100-16GB (the cluster description says 'A100-80GB'; name it 'V100-16GB' as its "
        "hardware reports it, or declare it emulated under device_types)."
    ]


def test_emulated_types_are_declared_not_read():
    declared = cluster_from_dict(
        {
            "schema_version": 1,
            "nodes": [{"name": "a", "devices": [{"device_type": "slow", "count": 2}]}],
            "device_types": {"slow": {"emulation": {"slowdown": 2.0, "memory_capacity_bytes": GIB}}},
        }
    )
    assert cluster_mismatches(declared, _facts(("a", "cpu", "cpu", 64), ("a", "cpu", "cpu", 64))) == []


def _real_cluster(*nodes: tuple[str, list[tuple[str, int]]]):
    return cluster_from_dict(
        {
            "schema_version": 1,
            "nodes": [
                {"name": name, "devices": [{"device_type": t, "count": n} for t, n in devices]}
                for name, devices in nodes
            ],
        }
    )


def test_real_types_split_over_nodes_other_than_their_machines_are_named():
    # MIXED runs ranks 0-2 on machine a, 3-4 on b: the network would be priced by the file's nodes.
    merged = _real_cluster(("all", [("A100-80GB", 2), ("V100-16GB", 3)]))
    assert cluster_mismatches(merged, MIXED) == [
        "Its nodes (all: ranks 0-4) are not the machines the ranks run on (a: ranks 0-2; b: ranks 3-4): declare "
        "one node per machine, or leave the cluster out to read it from the hardware."
    ]
    moved = _real_cluster(("x", [("A100-80GB", 2)]), ("y", [("V100-16GB", 3)]))
    assert cluster_mismatches(moved, MIXED) == [
        "Its nodes (x: ranks 0-1; y: ranks 2-4) are not the machines the ranks run on (a: ranks 0-2; b: ranks "
        "3-4): declare one node per machine, or leave the cluster out to read it from the hardware."
    ]


def test_a_machine_whose_ranks_the_launcher_placed_apart_is_one_node_per_run_of_its_ranks():
    # Cyclic placement (srun --distribution=cyclic, mpirun --map-by node): ranks 0 and 2 on a, 1 and 3 on b.
    ranks = [("a", "A100-80GB", "GPU-a0", 80), ("b", "A100-80GB", "GPU-b0", 80)] * 2
    facts = _facts(*ranks)
    per_machine = _real_cluster(("a", [("A100-80GB", 2)]), ("b", [("A100-80GB", 2)]))
    assert cluster_mismatches(per_machine, facts) == [
        "Its nodes (a: ranks 0-1; b: ranks 2-3) are not the machines the ranks run on (a: rank 0; b: rank 1; "
        "a#2: rank 2; b#2: rank 3): declare one node per run of consecutive ranks on a machine, or leave the "
        "cluster out to read it from the hardware."
    ]
    assert cluster_mismatches(cluster_from_facts(facts), facts) == []


def test_a_real_cluster_split_as_its_machines_passes_under_any_node_names():
    renamed = _real_cluster(("x", [("A100-80GB", 2), ("V100-16GB", 1)]), ("y", [("V100-16GB", 2)]))
    assert cluster_mismatches(renamed, MIXED) == []


def test_emulated_types_may_stand_for_nodes_on_one_machine():
    declared = cluster_from_dict(
        {
            "schema_version": 1,
            "nodes": [
                {"name": "n0", "devices": [{"device_type": "cpu", "count": 1}]},
                {"name": "n1", "devices": [{"device_type": "slow", "count": 1}]},
            ],
            "device_types": {"slow": {"emulation": {"slowdown": 2.0, "memory_capacity_bytes": GIB}}},
        }
    )
    assert cluster_mismatches(declared, _facts(("a", "cpu", "cpu", 64), ("a", "cpu", "cpu", 64))) == []


def test_a_cluster_of_another_size_is_named():
    declared = cluster_from_facts(MIXED[:3])
    assert cluster_mismatches(declared, MIXED) == ["The cluster description names 3 ranks but the job has 5."]


def test_capacity_is_the_device_s_memory_shared_only_by_ranks_on_that_device():
    # One GPU per process (CUDA_VISIBLE_DEVICES per process, as SLURM sets it): the whole card.
    assert memory_capacity_bytes(MIXED, 0) == 80 * GIB
    # Two ranks emulating types on one GPU share it; CPU ranks of a host share its RAM.
    shared = _facts(("a", "H100-80GB", "GPU-x", 80), ("a", "H100-80GB", "GPU-x", 80), ("a", "H100-80GB", "GPU-y", 80))
    assert [memory_capacity_bytes(shared, r) for r in range(3)] == [40 * GIB, 40 * GIB, 80 * GIB]
    cpus = _facts(("a", "cpu", "cpu", 64), ("a", "cpu", "cpu", 64), ("b", "cpu", "cpu", 32))
    assert [memory_capacity_bytes(cpus, r) for r in range(3)] == [32 * GIB, 32 * GIB, 32 * GIB]


@pytest.mark.parametrize(
    ("local_rank", "device_count", "index"),
    [(3, 8, 3), (3, 1, 0), (5, 2, 1), (0, 1, 0)],  # one device each; one per process; several ranks per GPU
)
def test_each_local_rank_gets_its_own_device(local_rank, device_count, index):
    assert cuda_device_index(local_rank, device_count) == index


def test_no_visible_device_is_an_error():
    with pytest.raises(ValueError, match="device_count: expected at least one visible CUDA device, found 0"):
        cuda_device_index(0, 0)


def test_the_local_facts_of_a_cpu_rank():
    facts = local_device_facts(torch.device("cpu"), rank=0)
    assert facts.device_type == "cpu" and facts.device_id == "cpu" and facts.memory_bytes > 0


def test_only_rank_0_reads_the_cluster_file(tmp_path):
    path = tmp_path / "cluster.json"
    save_cluster(cluster_from_facts(MIXED), path)
    sent = []
    agreed = agreed_cluster(path, MIXED, rank=0, broadcast=lambda obj: sent.append(obj) or obj)
    assert agreed.rank_device_types == cluster_from_facts(MIXED).rank_device_types
    # Rank 1's node has no such file: it takes rank 0's.
    received = agreed_cluster(tmp_path / "absent.json", MIXED, rank=1, broadcast=lambda obj: sent[0])
    assert received == agreed


def test_a_mismatching_file_is_every_rank_s_error(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(
        json.dumps(
            {"schema_version": 1, "nodes": [{"name": "a", "devices": [{"device_type": "A100-80GB", "count": 5}]}]}
        )
    )
    sent = []
    with pytest.raises(
        ValueError,
        match=r"poplar.cluster: .*cluster.json does not match the hardware: Rank 2 on a has NVIDIA V100-16GB",
    ):
        agreed_cluster(path, MIXED, rank=0, broadcast=lambda obj: sent.append(obj) or obj, name="poplar.cluster")
    with pytest.raises(ValueError, match="Rank 3 on b has NVIDIA V100-16GB"):
        agreed_cluster(None, MIXED, rank=1, broadcast=lambda obj: sent[0])


def test_initialize_refuses_bf16_on_an_old_device_before_the_cluster_is_agreed(tmp_path, monkeypatch):
    """prepare_job checks the gathered facts with the config's precision; the cluster (a
    collective decided by rank 0) is never reached, so every rank raises the same error."""
    from poplar_ext.runtime import job_start
    from poplar_ext.zero import initialize

    facts = _facts(("a", "T4-16GB", "0", 16), capabilities=((7, 5),))
    monkeypatch.setattr(initialize, "join_job", lambda **options: torch.device("cpu"))
    monkeypatch.setattr(initialize, "process_group_rank", lambda: (0, 1))
    monkeypatch.setattr(job_start, "gather_device_facts", lambda device: facts)
    monkeypatch.setattr(job_start, "agreed_cluster", lambda *args, **kwargs: pytest.fail("cluster agreed first"))
    ds_config = {"train_batch_size": 4, "bf16": {"enabled": True}, "poplar": {"plan": "plan.json"}}
    with pytest.raises(ValueError, match=r"ds.json: the job's devices cannot run it: Rank 0 on a .*fp16"):
        initialize.prepare_job((ds_config, tmp_path, "ds.json"))
