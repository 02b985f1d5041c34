"""poplar-profile's entry point on forked ranks (as under the launcher, without its start-up cost)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from harness import run_ranks

from poplar_ext.plan.formats import load_cluster, load_profiles
from poplar_ext.plan.network_format import find_network


def _run_cli(argv: list[str]) -> int:
    from poplar_ext.profiler.cli import main

    return main(argv)


def test_cli_profiles_the_toy_gpt_and_then_reuses_it(tmp_path, capfd) -> None:
    cluster = tmp_path / "cluster.json"
    cluster.write_text(
        json.dumps(
            {
                "schema_version": 1,
                "nodes": [
                    {
                        "name": "n0",
                        "devices": [{"device_type": "big", "count": 1}, {"device_type": "small", "count": 1}],
                    }
                ],
                "device_types": {
                    "big": {"emulation": {"slowdown": 1.0, "memory_capacity_bytes": 8 * 10**9}},
                    "small": {"emulation": {"slowdown": 2.0, "memory_capacity_bytes": 8 * 10**9}},
                },
            }
        )
    )
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                "gradient_clipping": 0.0,
                "zero_allow_untested_optimizer": True,
            }
        )
    )
    out = tmp_path / "profiles"
    argv = [
        "--local_rank=0",
        "--deepspeed_config",
        str(ds),
        "--cluster",
        str(cluster),
        "--model",
        "toy-gpt",
        "--layers",
        "1",
        "--hidden-size",
        "32",
        "--heads",
        "2",
        "--vocab-size",
        "128",
        "--sequence-length",
        "16",
        "--zero-stages",
        "1",
        "--max-micro-batch-size",
        "4",
        "--repeats",
        "1",
        "--output-dir",
        str(out),
    ]
    assert run_ranks(_run_cli, world_size=2, tmp_path=tmp_path / "first", args=(argv,), timeout_s=120) == [0, 0]
    profiles = load_profiles(out)
    # The built-in GPT can recompute its activations: each type is measured without and with it.
    assert sorted(
        (p.device_type, p.zero_stage, p.activation_checkpointing, p.max_micro_batch_size) for p in profiles
    ) == [("big", 1, False, 4), ("big", 1, True, 4), ("small", 1, False, 4), ("small", 1, True, 4)]
    assert {p.model.name for p in profiles} == {"toy-gpt-1x32"} and {p.model.sequence_length for p in profiles} == {16}
    written = {p.key: p.measured_with["date"] for p in profiles}
    (network_file,) = out.glob("network/network-*.json")
    assert len(list(out.glob("*.json"))) == 4, "the profile directory's *.json are the four profiles"
    assert len(list(out.glob("*-ckpt.json"))) == 2
    network = find_network(out, load_cluster(cluster))
    assert network is not None and network.world_size == 2 and network.backend == "gloo"
    assert network.source == "measured" and all(len(fit.samples) == 5 for fit in network.collectives.values())
    assert run_ranks(_run_cli, world_size=2, tmp_path=tmp_path / "second", args=(argv,), timeout_s=120) == [0, 0]
    assert {p.key: p.measured_with["date"] for p in load_profiles(out)} == written, "reused, not re-measured"
    logs = "\n".join(path.read_text() for path in (tmp_path / "second").rglob("rank0.log"))
    assert "from the cache (not measured)" in logs and "largest micro-batch" in logs
    assert f"network: from the cache ({network_file})" in logs
    # More repeats asked for: measured again, and the progress says why the stored ones were not reused.
    again = [*argv[: argv.index("--repeats")], "--repeats", "2", "--activation-checkpointing", "off",
             *argv[argv.index("--repeats") + 2 :]]  # fmt: skip
    assert run_ranks(_run_cli, world_size=2, tmp_path=tmp_path / "third", args=(again,), timeout_s=120) == [0, 0]
    logs = "\n".join(path.read_text() for path in (tmp_path / "third").rglob("rank0.log"))
    for label in ("big (emulated", "small (emulated"):
        assert re.search(rf"ZeRO-1: {re.escape(label)}[^\n]* measured again: \S+\.json was measured with less", logs)


def test_cli_bad_input_exits_2_on_every_rank(tmp_path) -> None:
    argv = ["--deepspeed_config", "x.json", "--cluster", "y.json", "--model", "toy-gpt", "--zero-stages", "7"]
    assert run_ranks(
        _run_cli, world_size=2, tmp_path=tmp_path, args=(argv,), init_process_group=False, timeout_s=60
    ) == [2, 2]


def test_cli_config_deepspeed_refuses_exits_2_on_every_rank(tmp_path) -> None:
    cluster = tmp_path / "cluster.json"
    cluster.write_text(
        json.dumps({"schema_version": 1, "nodes": [{"name": "n0", "devices": [{"device_type": "cpu", "count": 2}]}]})
    )
    ds = tmp_path / "ds.json"
    # DeepSpeed asserts that ZeRO gets a tested optimizer unless told otherwise.
    ds.write_text(json.dumps({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))
    argv = [
        "--deepspeed_config",
        str(ds),
        "--cluster",
        str(cluster),
        "--model",
        "toy-gpt",
        "--zero-stages",
        "1",
        "--output-dir",
        str(tmp_path / "p"),
    ]
    assert run_ranks(_run_cli, world_size=2, tmp_path=tmp_path, args=(argv,), timeout_s=60) == [2, 2]
    log = next(tmp_path.rglob("rank0.log")).read_text()
    assert (
        "poplar-profile: error: ds_config: DeepSpeed refused it at ZeRO stage 1: "
        "You are using an untested ZeRO Optimizer" in log
    )


def _tiny_toy_gpt_on_two_cpu_ranks(tmp_path) -> tuple[Path, list[str]]:
    """The DeepSpeed config written for two real CPU ranks, and the command line of a one-layer toy GPT on them
    at ZeRO 0 (their cluster file beside it)."""
    cluster = tmp_path / "cluster.json"
    cluster.write_text(
        json.dumps({"schema_version": 1, "nodes": [{"name": "n0", "devices": [{"device_type": "cpu", "count": 2}]}]})
    )
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_clipping": 0.0}))
    sizes = ["--layers", "1", "--hidden-size", "32", "--heads", "2", "--vocab-size", "128", "--sequence-length", "16"]
    return ds, [
        *("--deepspeed_config", str(ds), "--cluster", str(cluster), "--model", "toy-gpt", *sizes),
        *("--zero-stages", "0", "--repeats", "1", "--activation-checkpointing", "off"),
    ]


def test_an_output_directory_rank_0_cannot_write_is_an_error_on_every_rank_before_any_stage(tmp_path) -> None:
    ds, argv = _tiny_toy_gpt_on_two_cpu_ranks(tmp_path)
    # Under a file: no rank can make it (root ignores a read-only mode, so that is not the test).
    argv += ["--max-micro-batch-size", "2", "--no-network", "--output-dir", str(ds / "p")]
    assert run_ranks(_run_cli, world_size=2, tmp_path=tmp_path, args=(argv,), timeout_s=120) == [2, 2]
    for log in tmp_path.rglob("rank*.log"):
        text = log.read_text()
        expected = "poplar-profile: error: --output-dir: expected a directory rank 0 can write profiles into"
        assert f"{expected}, found {ds / 'p'} (" in text
        assert "measuring" not in text, "refused before any stage is measured"


def _run_cli_read_only(directory: Path, argv: list[str]) -> int:
    """`_run_cli` on a rank where no file can be made in `directory`, as in a read-only one (root ignores a
    read-only mode, so the rank refuses what the kernel would)."""
    import errno
    import os

    real_open = os.open

    def read_only_open(path, flags, *args, **kwargs):
        making = flags & os.O_CREAT or flags & os.O_TMPFILE == os.O_TMPFILE
        if making and directory in (Path(path), *Path(path).parents):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)

    os.open = read_only_open
    return _run_cli(argv)


def test_a_complete_cache_in_a_read_only_output_directory_is_read_and_one_with_work_refused(tmp_path) -> None:
    _, argv = _tiny_toy_gpt_on_two_cpu_ranks(tmp_path)
    at = argv.index("--cluster")
    del argv[at : at + 2]  # discovered and written beside the profiles: read back, not written again
    out = tmp_path / "p"
    argv += ["--max-micro-batch-size", "2", "--output-dir", str(out)]
    assert run_ranks(_run_cli, world_size=2, tmp_path=tmp_path / "fill", args=(argv,), timeout_s=120) == [0, 0]
    files = {path: path.stat().st_mtime_ns for path in out.rglob("*")}
    read_only = (out, argv)
    assert run_ranks(_run_cli_read_only, world_size=2, tmp_path=tmp_path / "read", args=read_only) == [0, 0]
    log = next((tmp_path / "read").rglob("rank0.log")).read_text()
    assert "ZeRO-0: cpu (real) from the cache (not measured)" in log and "largest micro-batch" in log, "the summary"
    assert {path: path.stat().st_mtime_ns for path in out.rglob("*")} == files, "nothing written"
    more = (out, [*argv, "--zero-stages", "0,1"])  # stage 1 is not in the cache
    assert run_ranks(_run_cli_read_only, world_size=2, tmp_path=tmp_path / "more", args=more) == [2, 2]
    for log_path in (tmp_path / "more").rglob("rank*.log"):
        text = log_path.read_text()
        expected = "poplar-profile: error: --output-dir: expected a directory rank 0 can write profiles into"
        assert f"{expected}, found {out} (Permission denied)" in text
        assert "measuring" not in text, "refused before any stage is measured"


def test_cli_profiles_real_cpu_ranks(tmp_path) -> None:
    _, argv = _tiny_toy_gpt_on_two_cpu_ranks(tmp_path)
    argv += ["--max-micro-batch-size", "4", "--output-dir", str(tmp_path / "p")]
    assert run_ranks(_run_cli, world_size=2, tmp_path=tmp_path, args=(argv,), timeout_s=120) == [0, 0]
    (profile,) = load_profiles(tmp_path / "p")
    from poplar_ext.hardware.memory import physical_memory_bytes

    assert profile.device_type == "cpu" and profile.emulated is None and profile.measured_with["device"] == "real"
    assert profile.memory_capacity_bytes == physical_memory_bytes() // 2, "a CPU rank's share of RAM"
    assert profile.max_micro_batch_size == 4 and profile.measured_with["hardware"].startswith("CPU ")
    # Past the prediction is unsafe on a real CPU (the kernel's out-of-memory killer).
    assert profile.measured_with["largest_micro_batch_probe"]["probed_past_prediction"] is False


def test_without_a_cluster_file_the_cluster_is_discovered_and_written_for_poplar_search(tmp_path) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_clipping": 0.0}))
    argv = [
        "--deepspeed_config",
        str(ds),
        "--model",
        "toy-gpt",
        "--layers",
        "1",
        "--hidden-size",
        "32",
        "--heads",
        "2",
        "--vocab-size",
        "128",
        "--sequence-length",
        "16",
        "--zero-stages",
        "0",
        "--max-micro-batch-size",
        "2",
        "--repeats",
        "1",
        "--output-dir",
        str(tmp_path / "p"),
        "--activation-checkpointing",
        "off",
    ]
    assert run_ranks(_run_cli, world_size=2, tmp_path=tmp_path, args=(argv,), timeout_s=120) == [0, 0]
    from poplar_ext.plan.formats import load_cluster

    cluster = load_cluster(tmp_path / "p" / "cluster.json")
    assert cluster.rank_device_types == ("cpu", "cpu") and cluster.device_types == {}
    (profile,) = load_profiles(tmp_path / "p")  # the cluster file beside the profiles is not a profile
    assert profile.device_type == "cpu"
    from poplar_ext.search.cli import main as search_main

    assert (
        search_main(
            [
                "--profiles",
                str(tmp_path / "p"),
                "--cluster",
                str(tmp_path / "p" / "cluster.json"),
                "--global-batch-size",
                "4",
            ]
        )
        == 0
    )


def test_a_cluster_file_only_rank_0_lacks_is_an_error_on_every_rank(tmp_path) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))
    argv = [
        "--deepspeed_config",
        str(ds),
        "--cluster",
        str(tmp_path / "none.json"),
        "--model",
        "toy-gpt",
        "--zero-stages",
        "1",
        "--output-dir",
        str(tmp_path / "p"),
    ]
    assert run_ranks(_run_cli, world_size=2, tmp_path=tmp_path, args=(argv,), timeout_s=60) == [2, 2]
    for log in tmp_path.rglob("rank*.log"):
        assert "poplar-profile: error: cluster: " in log.read_text() and "none.json" in log.read_text()


def test_a_cluster_file_that_misnames_the_hardware_is_an_error_on_every_rank(tmp_path) -> None:
    cluster = tmp_path / "cluster.json"
    cluster.write_text(
        json.dumps(
            {"schema_version": 1, "nodes": [{"name": "n0", "devices": [{"device_type": "A100-80GB", "count": 2}]}]}
        )
    )
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))
    argv = [
        "--deepspeed_config",
        str(ds),
        "--cluster",
        str(cluster),
        "--model",
        "toy-gpt",
        "--zero-stages",
        "1",
        "--output-dir",
        str(tmp_path / "p"),
    ]
    assert run_ranks(_run_cli, world_size=2, tmp_path=tmp_path, args=(argv,), timeout_s=60) == [2, 2]
    for log in tmp_path.rglob("rank*.log"):
        text = log.read_text()
        assert "does not match the hardware: Rank 0 on" in text and "Rank 1 on" in text
        assert "the cluster description says 'A100-80GB'; name it 'cpu'" in text


def test_cli_profiles_a_transformers_model_built_from_its_config(tmp_path) -> None:
    import pytest

    pytest.importorskip("transformers", reason="pip install 'poplar-ext[hf]'")
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_clipping": 0.0}))
    argv = [
        "--deepspeed_config",
        str(ds),
        "--model",
        "hf:GPT2Config",
        "--hf-config",
        "n_layer=1,n_embd=32,n_head=2,vocab_size=64,n_positions=32",
        "--sequence-length",
        "16",
        "--zero-stages",
        "0",
        "--max-micro-batch-size",
        "2",
        "--repeats",
        "1",
        "--output-dir",
        str(tmp_path / "p"),
    ]
    assert run_ranks(_run_cli, world_size=2, tmp_path=tmp_path, args=(argv,), timeout_s=120) == [0, 0]
    # A Hugging Face model with gradient checkpointing: measured without and with it.
    profile, checkpointed = sorted(load_profiles(tmp_path / "p"), key=lambda p: p.activation_checkpointing)
    assert (profile.activation_checkpointing, checkpointed.activation_checkpointing) == (False, True)
    assert (
        profile.model.name == "gpt2-causal-lm"
        and profile.model.sequence_length == 16
        and profile.max_micro_batch_size == 2
    )
    assert checkpointed.max_micro_batch_size == 2
