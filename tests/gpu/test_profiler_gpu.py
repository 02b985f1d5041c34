"""GPU tier of the profiler: a real CUDA device, bf16, the real out-of-memory probe.

Skipped, with the reason shown, where CUDA is absent. One rank per GPU present (up
to 2), forked before CUDA is initialised (the harness refuses otherwise), NCCL set
up by DeepSpeed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
)

DS_CONFIG = {
    "bf16": {"enabled": True},
    # torch_adam: no JIT build of DeepSpeed's fused Adam (needs nvcc).
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
    "gradient_clipping": 1.0,
}


def _profile_real_gpus(cache_dir: str) -> dict:
    import deepspeed
    import torch.distributed as dist

    from poplar_ext.hardware.devices import hardware_device_type
    from poplar_ext.models.toy_gpt import GPT, GPTConfig
    from poplar_ext.plan.formats import cluster_from_dict
    from poplar_ext.profiler import profile_model

    deepspeed.init_distributed()
    local = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    device_type = hardware_device_type(local)
    # Every rank's GPU here is the same model: a cluster of one real device type.
    cluster = cluster_from_dict(
        {
            "schema_version": 1,
            "nodes": [{"name": "gpu-node", "devices": [{"device_type": device_type, "count": dist.get_world_size()}]}],
        }
    )
    cfg = GPTConfig(vocab_size=8192, sequence_length=256, num_layers=4, num_heads=8, hidden_size=512)
    calls = {"first": 0, "second": 0}

    def batches(key):
        def make_batch(micro_batch_size: int):
            calls[key] += 1
            return torch.randint(0, cfg.vocab_size, (micro_batch_size, cfg.sequence_length + 1))

        return make_batch

    common = dict(
        model_factory=lambda: GPT(cfg),
        ds_config=DS_CONFIG,
        cluster=cluster,
        zero_stages=(0, 3),
        cache_dir=cache_dir,
        sequence_length=cfg.sequence_length,
        micro_batch_size_limit=64,
        progress=None,
    )
    first = profile_model(make_batch=batches("first"), **common)
    second = profile_model(make_batch=batches("second"), **common)
    return {"device_type": device_type, "first": first, "second": second, "calls": calls}


def test_profiles_a_real_gpu_in_bf16_and_reuses_them(tmp_path) -> None:
    from harness import run_ranks

    world_size = min(2, torch.cuda.device_count())
    results = run_ranks(
        _profile_real_gpus,
        world_size=world_size,
        tmp_path=tmp_path,
        args=(str(tmp_path / "profiles"),),
        init_process_group=False,
        timeout_s=600,
        # Spawned, as test_runtime_gpu.py's ranks: this module's is_available() may have initialised the CUDA
        # driver in the pytest process, and a forked rank then dies at its first CUDA call.
        start_method="spawn",
    )
    result = results[0]
    assert len(result["first"]) == 2
    for profile in result["first"]:
        assert profile.device_type == result["device_type"] and profile.emulated is None
        assert profile.model.dtype == "bfloat16"
        assert profile.measured_with["timing"] == "CUDA events, median"
        # Up to the gradient reduction, except at ZeRO 3, whose all-gathers no window leaves out.
        stage_3 = profile.zero_stage == 3
        assert profile.measured_with["compute_window"]["clock"] == "cuda"
        assert profile.measured_with["compute_window"]["ends_at"] == (
            "micro-step end" if stage_3 else "gradient reduction"
        )
        assert profile.measured_with["micro_step_times_include_communication"] is stage_3
        assert profile.max_micro_batch_size >= 1
        assert all(s.peak_memory_bytes <= profile.memory_capacity_bytes for s in profile.samples)
        times = [s.micro_step_time_s for s in profile.samples]
        assert times[-1] > times[0], "a larger micro-batch takes longer"
    assert result["second"] == result["first"] and result["calls"]["second"] == 0


def test_a_compute_span_on_a_real_gpu_ends_where_it_is_first_ended() -> None:
    # The profiler ends it at DeepSpeed's gradient reduction, then again at the micro-step's end.
    from poplar_ext.hardware.compute_clock import ComputeSpan

    a = torch.randn(4096, 4096, device="cuda")

    def work(n: int) -> None:
        for _ in range(n):
            torch.mm(a, a)

    def span_s(after_end: int) -> float:
        span = ComputeSpan("cuda")
        span.start()
        work(20)
        span.end()
        work(after_end)
        span.end()
        return span.elapsed_s()

    work(3)
    whole_s = min(span_s(0) for _ in range(3))
    ended_early_s = min(span_s(40) for _ in range(3))
    assert abs(ended_early_s - whole_s) < 0.1 * whole_s, (whole_s, ended_early_s)
