"""A pipeline job re-balances when a stage drifts (issue 34): 4 forked ranks as 2 pipelines of 2 stages.

Every rank is emulated and steady at its layer profiles (synthetic, written here), so each rank's
measured compute is exactly its profile's times its slowdown: a ``slowdown_schedule`` that makes
rank 0 (pipeline 0's first stage) 4x slower after step 4 is seen at the checks of steps 6 and 8,
and every rank switches at step 8 to counts that move micro-batches to pipeline 1. The parameters
are those of one process training the same global batches, every sample is read once, and a
checkpoint saved after the switch resumes under the re-balanced counts, equal to the uninterrupted run.
At ZeRO stages 0 and 1, one after the other in one group of ranks.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import _training as t
import pytest
from harness import run_ranks
from test_pipeline import CLIP, NUM_SAMPLES, RecordingData, _max_difference, _reference, write_pipeline_plan

from poplar_ext.runtime.data import SampleStream

DRIFT_STEP = 4
SWITCH_STEP = DRIFT_STEP + 4  # checks every 2 steps, the drift sustained over 2 of them
STEPS = 10
MORE = 2  # trained after the checkpoint, uninterrupted and resumed
TYPES = ["cpu-fast", "cpu-fast", "cpu-slow", "cpu-slow"]
# Per pipeline: (rank, first layer, last layer) per stage, micro-batch size, micro-batches.
PIPELINES = [([(0, 0, 2), (1, 3, 5)], 2, 6), ([(2, 0, 2), (3, 3, 5)], 2, 3)]
GLOBAL_BATCH = 18
STAGES = (0, 1)
LAYER_S_PER_SAMPLE = 0.002
"""A fast rank's forward and backward of one layer per sample: steady emulation pads the real compute to it."""


def _write_layer_profiles(directory, slowdowns: dict[str, float]) -> None:
    """Synthetic layer profiles of the toy pipeline model: every layer LAYER_S_PER_SAMPLE x b x the type's slowdown."""
    from poplar_ext.plan.formats import Emulation, ModelInfo
    from poplar_ext.plan.pipeline_formats import (
        LayerCost,
        LayerProfile,
        LayerSample,
        layer_profiles_dir,
        save_layer_profile,
    )

    folder = layer_profiles_dir(directory)
    folder.mkdir(parents=True)
    model = ModelInfo(name="toy-pipeline", fingerprint="sha256:toy", num_parameters=1, dtype="float32")
    for (device_type, slowdown), stage in itertools.product(slowdowns.items(), STAGES):
        layer = LayerCost(
            index=0,
            name="Linear",
            samples=tuple(
                LayerSample(micro_batch_size=b, step_time_s=slowdown * LAYER_S_PER_SAMPLE * b) for b in (1, 2, 4)
            ),
            parameter_bytes=1000,
            optimizer_state_bytes=3000,
            activation_bytes_per_sample=100,
            output_bytes_per_sample=100,
            optimizer_step_time_s=0.0001,
        )
        profile = LayerProfile(
            device_type=device_type,
            memory_capacity_bytes=2_000_000_000,
            zero_stage=stage,
            model=model,
            layers=tuple(dataclasses.replace(layer, index=i) for i in range(6)),
            base_memory_bytes=1_000_000,
            emulated=Emulation(slowdown=slowdown, memory_capacity_bytes=2_000_000_000),
            measured_with={"source": "modelled", "note": "written by the test"},
        )
        save_layer_profile(profile, folder / f"{device_type}-stage{stage}.json")


def _config(files, stage: int) -> dict:
    poplar = {
        "cluster": str(files["cluster"]),
        "plan": str(files["plans"][stage]),
        "profiles": str(files["profiles"]),
        "log_interval_steps": 0,
        "cpu_threads": 1,
        "rebalance": {"enabled": True, "check_interval_steps": 2, "threshold": 0.2, "sustained_checks": 2},
    }
    return {
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
        "poplar": poplar,
    }


def _engine(files, stage: int):
    import torch

    import poplar_ext
    from poplar_ext.models.toy_pipeline import mse, toy_layers
    from poplar_ext.pipeline import PoplarPipelineModule

    config = _config(files, stage)
    model = PoplarPipelineModule(toy_layers(), loss_fn=mse, seed_layers=True, config=config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = RecordingData(num_samples=NUM_SAMPLES)
    engine, _, _, _ = poplar_ext.initialize(model=model, optimizer=optimizer, training_data=data, config=config)
    return engine, data


def _state(engine) -> dict:
    params = {name: p.detach().clone() for name, p in engine.module.state_dict().items()}
    counts = [p.num_micro_batches for p in engine.plan.pipelines]
    return {"params": params, "counts": counts, "position": engine.data_position}


def _drift_then_resume(files, stage: int) -> dict:
    engine, data = _engine(files, stage)
    first = [p.num_micro_batches for p in engine.plan.pipelines]
    losses = [float(engine.train_batch()) for _ in range(STEPS)]
    monitor = engine.rebalancer.monitor
    out = {
        "first": first,
        "losses": losses,
        "at_save": _state(engine),
        "history": [(h["start_step"], h["reason"]) for h in engine.plan_history],
        "scales": None if monitor is None else list(monitor.rank_scales),
        "checks": None if monitor is None else list(monitor.checks),
    }
    seen_before = len(data.seen)
    engine.save_checkpoint(files["checkpoints"] / str(stage))
    for _ in range(MORE):
        engine.train_batch()
    out.update(seen=data.seen[:seen_before], uninterrupted=_state(engine), seen_after=data.seen[seen_before:])
    resumed, resumed_data = _engine(files, stage)
    resumed.load_checkpoint(files["checkpoints"] / str(stage))
    out["resumed_history"] = [(h["start_step"], h["reason"]) for h in resumed.plan_history]
    for _ in range(MORE):
        resumed.train_batch()
    out.update(resumed=_state(resumed), resumed_seen=resumed_data.seen)
    return out


def _every_stage(files) -> dict:
    return {stage: _drift_then_resume(files, stage) for stage in STAGES}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline_rebalance")
    cluster = json.loads(
        t.write_cluster(tmp / "cluster.json", fast=2, slow=2, slowdown=2.0, fast_type="cpu-fast").read_text()
    )
    cluster["device_types"]["cpu-fast"]["emulation"]["slowdown_schedule"] = [[DRIFT_STEP, 4.0, 0]]
    (tmp / "cluster.json").write_text(json.dumps(cluster))
    _write_layer_profiles(tmp / "profiles", {"cpu-fast": 1.0, "cpu-slow": 2.0})
    files = {
        "cluster": tmp / "cluster.json",
        "plans": {s: write_pipeline_plan(tmp / f"plan{s}.json", PIPELINES, stage=s, types=TYPES) for s in STAGES},
        "profiles": tmp / "profiles",
        "checkpoints": tmp / "checkpoints",
    }
    return run_ranks(_every_stage, world_size=4, tmp_path=tmp, args=(files,), init_process_group=False, timeout_s=300)


@pytest.mark.parametrize("stage", STAGES)
def test_every_rank_switches_at_the_same_step_to_counts_moved_off_the_slowed_pipeline(results, stage):
    results = [r[stage] for r in results]
    first = results[0]
    assert first["first"] == [6, 3]
    assert len(first["history"]) == 2, (first["history"], first["checks"])
    start_step, reason = first["history"][1]
    assert start_step == SWITCH_STEP and "rank 0 (cpu-fast) at 4.00x" in reason, first["history"]
    counts = first["at_save"]["counts"]
    assert counts[0] < 6 and counts[1] > 3 and 2 * sum(counts) == GLOBAL_BATCH, counts
    assert all(r["history"] == first["history"] and r["at_save"]["counts"] == counts for r in results)
    # Steady emulation: every rank's compute is its profile's times its slowdown, to the float.
    assert first["scales"] == pytest.approx([4.0, 1.0, 1.0, 1.0])
    assert all(r["scales"] is None for r in results[1:]), "rank 0 alone holds the monitor"


@pytest.mark.parametrize("stage", STAGES)
def test_the_parameters_are_those_of_one_process_on_the_same_global_batches(results, stage):
    results = [r[stage] for r in results]
    expected, losses, norms = _reference(GLOBAL_BATCH, STEPS)
    assert min(norms) > CLIP, "clipping must be active for this test to cover it"
    assert _max_difference([r["at_save"]["params"] for r in results], expected) <= 1e-5
    for r in results:
        assert r["losses"] == pytest.approx(losses, abs=1e-6) and r["at_save"]["position"] == STEPS * GLOBAL_BATCH


@pytest.mark.parametrize("stage", STAGES)
def test_every_sample_is_read_once_across_the_switch(results, stage):
    results = [r[stage] for r in results]
    firsts = []
    for stages, _, _ in PIPELINES:
        first, last = results[stages[0][0]]["seen"], results[stages[-1][0]]["seen"]
        assert first == last, "a pipeline's first and last stages read the same micro-batches"
        firsts += first
    stream = SampleStream(num_samples=NUM_SAMPLES, seed=0)
    assert sorted(firsts) == sorted(stream.indices(0, STEPS * GLOBAL_BATCH))


@pytest.mark.parametrize("stage", STAGES)
def test_a_resume_continues_under_the_rebalanced_counts_as_the_uninterrupted_run(results, stage):
    for r in (r[stage] for r in results):
        assert r["resumed"]["counts"] == r["at_save"]["counts"], "the checkpoint's last plan, not the plan file's"
        assert r["resumed_history"] == r["history"]
        assert r["resumed_seen"] == r["seen_after"] and r["resumed"]["position"] == (STEPS + MORE) * GLOBAL_BATCH
        before, after = r["uninterrupted"]["params"], r["resumed"]["params"]
        assert max(float((after[k] - v).abs().max()) for k, v in before.items()) == 0.0
