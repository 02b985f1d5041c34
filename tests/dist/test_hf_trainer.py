"""PoplarTrainer: the Hugging Face Trainer with an uneven plan, on forked ranks and under torchrun, on CPU.

3 ranks (one real CPU type, two emulated), a tiny GPT-2 built from its config,
variable-length padded sequences, the token-mean loss, AdamW and gradient clipping,
ZeRO stages 0-3 (uneven accumulation counts at 0/1): the parameters after 3 optimizer
steps equal one process training on the same global batches (fp32, 1e-5); every
sample is trained exactly once; the logged batch size and samples/s are the true
global ones; a run resumed from a checkpoint equals the uninterrupted one.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import assert_launch_finished, free_port, run_ranks

pytest.importorskip("transformers", reason="the Hugging Face tests need pip install 'poplar-ext[hf]'")

import _hf_common as hf
import _training as t

# Imported here, in the pytest process, so that the forked ranks start with them: each rank's first
# Trainer run imported them otherwise (seconds of CPU a rank, three ranks on two cores).
from transformers import GPT2LMHeadModel  # noqa: F401

from poplar_ext.integrations.transformers import PoplarTrainer  # noqa: F401

HERE = Path(__file__).resolve().parent
TYPES = ["cpu", "cpu-slow", "cpu-slow"]
ALLOCATIONS = {
    0: [(3, 2), (1, 3), (3, 1)],
    1: [(3, 2), (1, 3), (3, 1)],
    2: [(3, 2), (1, 2), (2, 2)],
    3: [(3, 2), (1, 2), (2, 2)],
}
GLOBAL_BATCH = 12
STAGES = (0, 1, 2, 3)


@functools.cache
def _reference(global_batch: int, steps: int) -> dict[str, torch.Tensor]:
    """`hf.reference_parameters`, computed once per module for the several tests that compare with it."""
    return hf.reference_parameters(global_batch, steps)


def _config(root: Path, stage: int, checkpointing: list[bool] | None = None, offload: list[bool] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    cluster = t.write_cluster(root / "cluster.json", fast=1, slow=2, slowdown=1.0)
    plan = t.write_plan(
        root / f"plan{stage}.json",
        ALLOCATIONS[stage],
        stage=stage,
        device_types=TYPES,
        checkpointing=checkpointing,
        offload=offload,
    )
    path = root / f"ds{stage}.json"
    path.write_text(json.dumps(hf.trainer_ds_config(stage, cluster=str(cluster), plan=str(plan))))
    return path


def _launch(config: Path, out: Path, *extra: str, ranks: int = 3) -> str:
    env = dict(
        os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(ranks),
        "--master_port",
        str(free_port()),
        str(HERE / "hf_train.py"),
        "--deepspeed_config",
        str(config),
        "--out",
        str(out),
        *extra,
    ]
    markers = [out / f"done-rank{rank}" for rank in range(ranks)]
    for marker in markers:  # an earlier launch's, in the same folder (a resume)
        marker.unlink(missing_ok=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=420)
    log = done.stdout + done.stderr
    out.parent.mkdir(parents=True, exist_ok=True)
    (out.parent / f"{out.name}-launch{len(list(out.parent.glob(f'{out.name}-launch*.log')))}.log").write_text(log)
    # torchrun's summary ends the log; the failing rank's own lines are what tell why
    failing = [line for line in log.splitlines() if "terminate" in line or "Error" in line]
    assert_launch_finished(done.returncode, log, markers, "\n".join(failing[-30:]) + "\n" + log[-3000:])
    return log


def _train_runs(runs: list[tuple[str, str, dict]], log_path: str) -> None:
    """Each ``(deepspeed config, output folder, options)`` trained by `hf_train.train` on these forked ranks;
    rank 0's log lines (poplar_ext's and the Trainer's) in `log_path`."""
    import logging

    import hf_train
    import transformers
    from accelerate.state import AcceleratorState

    transformers.logging.set_verbosity_info()  # the Trainer's "Total train batch size"
    if int(os.environ["RANK"]) == 0:
        handler = logging.FileHandler(log_path)
        for name in ("poplar_ext", "transformers"):
            logging.getLogger(name).addHandler(handler)
            logging.getLogger(name).setLevel(logging.INFO)
    for config, out, options in runs:
        AcceleratorState._reset_state(reset_partial_state=False)  # each run its own DeepSpeed plugin
        hf_train.train(config, Path(out), **options)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 4 stages, at ZeRO 2 the plan's per-rank activation checkpointing (also for the models
    model_init builds) and optimizer offload, at ZeRO 1 2 steps saved then resumed to 4, and the automatic
    mode: 10 Trainer runs on one group of 3 forked ranks (the real launcher is the resume test's run on 2
    ranks)."""
    root = tmp_path_factory.mktemp("hf")
    jobs = [(str(_config(root / f"stage{stage}", stage)), str(root / f"stage{stage}"), {}) for stage in STAGES]
    jobs[STAGES.index(3)][2]["save_model"] = True  # its weights not gathered: save_model's DeepSpeed save
    variants = {
        "checkpointing": ({"checkpointing": [False, True, True]}, {"gradient_checkpointing": True}),
        "model_init": ({"checkpointing": [True, False, False]}, {"model_init": True}),
        "offload": ({"offload": [False, True, True]}, {}),
    }
    for name, (plan_options, train_options) in variants.items():
        jobs.append((str(_config(root / name, 2, **plan_options)), str(root / name), train_options))
    resume_config = str(_config(root / "resume", 1))
    jobs.append((resume_config, str(root / "resume" / "parts"), {"steps": 2, "save_steps": 2}))
    checkpoint = str(root / "resume" / "parts" / "checkpoint-2")
    jobs.append((resume_config, str(root / "resume" / "resumed"), {"steps": 4, "resume": checkpoint}))
    # No plan: a cluster and a profile directory (the automatic mode).
    (root / "auto").mkdir()
    cluster = t.write_cluster(root / "auto" / "cluster.json", fast=1, slow=2, slowdown=1.0)
    auto_config = root / "auto" / "ds.json"
    auto_config.write_text(json.dumps(hf.trainer_ds_config(1, cluster=str(cluster), profiles=str(root / "profiles"))))
    jobs.append((str(auto_config), str(root / "auto" / "out"), {}))
    run_ranks(_train_runs, world_size=3, tmp_path=root / "ranks", args=(jobs, str(root / "rank0.log")), timeout_s=400)
    log = (root / "rank0.log").read_text()
    return root, {stage: log for stage in STAGES}


def test_save_model_at_zero_3_without_gathered_weights_saves_a_whole_checkpoint(runs):
    # The Trainer then falls back to the engine's save_checkpoint(output_dir) in place: through save_whole, as a
    # checkpoint's save, it is whole, with poplar-ext's state beside DeepSpeed's files and nothing half-written.
    model = runs[0] / "stage3" / "model"
    tag = (model / "latest").read_text().strip()
    assert (model / tag / "poplar_state.json").is_file()
    assert not [p.name for p in model.iterdir() if p.name.endswith((".saving", ".replaced"))]


@pytest.mark.parametrize("stage", STAGES)
def test_parameters_equal_one_process_on_the_global_batches(runs, stage):
    root, _ = runs
    params = torch.load(root / f"stage{stage}" / "params.pt", weights_only=False)
    assert t.max_difference(params, _reference(GLOBAL_BATCH, hf.STEPS)) <= 1e-5


@pytest.mark.parametrize("stage", STAGES)
def test_the_logged_loss_is_the_global_token_mean(runs, stage):
    # AdamW and clipping hide a uniform error in the loss's scale; the loss does not: a
    # token count off by one per sequence (labels not shifted, as the Trainer counts for
    # GPT-2) would log a loss about 10% low.
    root, _ = runs
    history = json.loads((root / f"stage{stage}" / "log_history.json").read_text())
    assert history[0]["loss"] == pytest.approx(hf.reference_first_loss(GLOBAL_BATCH), rel=1e-3)


@pytest.mark.parametrize("stage", STAGES)
def test_every_sample_exactly_once(runs, stage):
    root, _ = runs
    seen = [i for r in range(3) for i in json.loads((root / f"stage{stage}" / f"samples-rank{r}.json").read_text())]
    stream = t.SampleStream(num_samples=hf.NUM_SAMPLES, seed=0)
    assert sorted(seen) == sorted(stream.indices(0, hf.STEPS * GLOBAL_BATCH))


def test_logged_batch_size_and_samples_per_second_are_the_true_global_ones(runs):
    root, logs = runs
    metrics = json.loads((root / "stage1" / "metrics.json").read_text())
    assert metrics["train_samples_per_second"] == pytest.approx(
        hf.STEPS * GLOBAL_BATCH / metrics["train_runtime"], rel=0.05
    )
    assert "true global batch 12" in logs[1]
    assert "Total train batch size (w. parallel, distributed & accumulation) = 12" in logs[1]


def test_each_rank_takes_its_gradient_checkpointing_from_the_plan(runs):
    # The slow type recomputes, the fast one does not (ZeRO-2 allows ranks to differ), although
    # the user's arguments ask for it everywhere (through the name transformers 5.24 deprecated).
    out = runs[0] / "checkpointing"
    assert [json.loads((out / f"checkpointing-rank{r}.json").read_text()) for r in range(3)] == [False, True, True]
    params = torch.load(out / "params.pt", weights_only=False)
    assert t.max_difference(params, _reference(GLOBAL_BATCH, hf.STEPS)) <= 1e-5


def test_the_models_model_init_builds_take_the_plans_checkpointing(runs):
    out = runs[0] / "model_init"
    assert [json.loads((out / f"checkpointing-rank{r}.json").read_text()) for r in range(3)] == [True, False, False]
    params = torch.load(out / "params.pt", weights_only=False)
    assert t.max_difference(params, _reference(GLOBAL_BATCH, hf.STEPS)) <= 1e-5


def test_each_rank_takes_its_optimizer_offload_from_the_plan(runs):
    # The slow type keeps the Trainer's AdamW state on the host (ZeRO-2), the fast one on its device.
    out = runs[0] / "offload"
    assert [json.loads((out / f"offload-rank{r}.json").read_text()) for r in range(3)] == [False, True, True]
    params = torch.load(out / "params.pt", weights_only=False)
    assert t.max_difference(params, _reference(GLOBAL_BATCH, hf.STEPS)) <= 1e-5


def _two_rank_config(root: Path, stage: int) -> Path:
    """The cluster after a node is lost: the real type and one slow rank, a new plan of the same global batch."""
    root.mkdir()
    config = json.loads(_config(root, stage).read_text())
    cluster = t.write_cluster(root / "cluster2.json", fast=1, slow=1, slowdown=1.0)
    plan = t.write_plan(root / "plan2.json", [(3, 2), (2, 3)], stage=stage, device_types=TYPES[:2])
    # The global batch set in the poplar section: the Trainer's default (per device x ranks) would shrink with a node.
    config["poplar"].update(cluster=str(cluster), plan=str(plan), global_batch_size=GLOBAL_BATCH)
    (root / "ds.json").write_text(json.dumps(config))
    return root / "ds.json"


def test_resume_from_checkpoint_equals_the_uninterrupted_run_also_on_fewer_ranks(runs, tmp_path):
    root = runs[0] / "resume"
    # In DeepSpeed's tag folder, where engine.load_checkpoint reads it too.
    assert (root / "parts" / "checkpoint-2" / "global_step2" / "poplar_state.json").is_file()
    first = [i for r in range(3) for i in json.loads((root / "parts" / f"samples-rank{r}.json").read_text())]
    second = [i for r in range(3) for i in json.loads((root / "resumed" / f"samples-rank{r}.json").read_text())]
    expected = _reference(GLOBAL_BATCH, 4)  # the uninterrupted run: one process, 4 global batches
    assert t.max_difference(torch.load(root / "resumed" / "params.pt", weights_only=False), expected) <= 1e-5
    stream = t.SampleStream(num_samples=hf.NUM_SAMPLES, seed=0)
    assert sorted(first) == sorted(stream.indices(0, 2 * GLOBAL_BATCH))
    assert sorted(second) == sorted(stream.indices(2 * GLOBAL_BATCH, 2 * GLOBAL_BATCH))
    # A node lost: the same checkpoint on 2 ranks under a new plan, the ZeRO-1 AdamW state resharded,
    # under torchrun.
    fewer = tmp_path / "fewer"
    shutil.copytree(root / "parts" / "checkpoint-2", fewer / "checkpoint-2")
    # and a later save that stopped in DeepSpeed's part: its files in global_step3.saving, no latest, no
    # poplar_state.json, no trainer_state.json; the resume must skip it for checkpoint-2, saying so
    unfinished = fewer / "checkpoint-3"
    shutil.copytree(root / "parts" / "checkpoint-2", unfinished, ignore=shutil.ignore_patterns("latest", "*.json"))
    (unfinished / "global_step2").rename(unfinished / "global_step3.saving")
    log = _launch(_two_rank_config(tmp_path / "two", 1), fewer, "--steps", "4", "--resume", ranks=2)
    assert f"skipped {unfinished}: expected a whole checkpoint" in log
    assert "under another plan (3 ranks then, 2 now)" in log
    assert t.max_difference(torch.load(fewer / "params.pt", weights_only=False), expected) <= 1e-5
    # the Trainer's own scheduler.pt restored too: its schedule continues at step 2 instead of starting over
    for resumed in (root / "resumed", fewer):
        assert json.loads((resumed / "scheduler.json").read_text()) == {"last_epoch": 4}, resumed
    on_two = [i for r in range(2) for i in json.loads((fewer / f"samples-rank{r}.json").read_text())]
    assert sorted(on_two) == sorted(stream.indices(2 * GLOBAL_BATCH, 2 * GLOBAL_BATCH))


def test_automatic_mode_profiles_searches_and_trains_the_global_batch(runs):
    # No plan: a cluster and a profile directory; the Trainer's model and data are profiled
    # (its ModelOutput's .loss, dict batches), a plan searched, and trained. Whatever the plan,
    # the parameters are those of one process on the same global batches.
    root, _ = runs
    # cpu and cpu-slow at stage 1, without and with gradient checkpointing (GPT-2 supports it)
    assert len(list((root / "profiles").glob("*.json"))) == 4
    params = torch.load(root / "auto" / "out" / "params.pt", weights_only=False)
    assert t.max_difference(params, _reference(GLOBAL_BATCH, hf.STEPS)) <= 1e-5
