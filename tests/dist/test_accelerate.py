"""PoplarAccelerator: a loop written as accelerate's documentation writes it, on an uneven plan.

3 forked ranks (one real CPU type, two emulated), the tiny GPT, Adam and gradient
clipping, ZeRO stages 0-3 (uneven accumulation counts at 0/1): the parameters after 3
optimizer steps equal one process training the same global batches (fp32, 1e-5); every
sample is trained once; gather_for_metrics returns every rank's rows; save_state and
load_state in a fresh Accelerator continue the data and equal the uninterrupted run, also under
another plan of the same global batch; after free_memory() a second prepare trains the plan again.
Re-balancing: a ``slowdown_schedule`` makes rank 1 4x slower mid-run (ZeRO-1 with uneven
accumulation counts, ZeRO-2 with one): one re-plan moves samples away from it, accumulate()
follows each rank's new count, and the parameters, also after save_state and load_state across
the switch, equal one process on the same global batches.
One real ``accelerate launch`` run (with accelerate's config file, 2 ranks) checks the launcher, and one deepspeed
launcher run a script's own DeepSpeedPlugin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import EXIT_ABORT, assert_launch_finished, free_port, run_ranks

pytest.importorskip("accelerate", reason="PoplarAccelerator needs pip install 'poplar-ext[accelerate]'")
pytest.importorskip(
    "transformers", reason="the token-mean case trains a Hugging Face model: pip install 'poplar-ext[hf]'"
)

import _hf_common as hf
import _training as t
from accelerate.state import AcceleratorState
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

# Imported here, in the pytest process, so that the forked ranks start with them (seconds each otherwise).
from transformers import GPT2LMHeadModel  # noqa: F401

from poplar_ext.integrations.accelerate import PoplarAccelerator
from poplar_ext.models.toy_gpt import GPT
from poplar_ext.profiler.fingerprint import model_fingerprint

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parents[1] / "examples"
TYPES = ["cpu", "cpu-slow", "cpu-slow"]
ALLOCATIONS = {
    0: [(3, 2), (1, 3), (3, 1)],
    1: [(3, 2), (1, 3), (3, 1)],
    2: [(3, 2), (1, 2), (2, 2)],
    3: [(3, 2), (1, 2), (2, 2)],
}
GLOBAL_BATCH = 12
STEPS = 3
STAGES = (0, 1, 2, 3)
RESUME_STAGES = (1, 3)
OTHER_PLAN = [(2, 3), (3, 1), (3, 1)]
"""A stage-1 plan of the same global batch that a resume switches to: after one step of ALLOCATIONS[1], accelerate's
saved micro-step counters (2, 3, 1) are not multiples of its counts (3, 1, 1)."""
TOKEN_MEAN_STAGES = (1, 2)
DROP_LAST_STEPS = 6  # 50 samples, B = 12: 4 iterations an epoch and its last 2 samples dropped


class Indexed(torch.utils.data.Dataset):
    """The tests' token data with each sample's index beside it (to see which samples were trained)."""

    def __init__(self, data=None):
        self.data = t.dataset() if data is None else data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return {"tokens": self.data[index], "index": index}


def _accelerator(config: dict):
    AcceleratorState._reset_state(reset_partial_state=True)  # one Accelerator per case in this process
    # On CPU accelerate picks no backend for DeepSpeed by itself: gloo, as the harness's group.
    gloo = InitProcessGroupKwargs(backend="gloo")
    return PoplarAccelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), kwargs_handlers=[gloo])


def _train(accelerator, steps: int, *, checkpoint: Path | None = None, resume: bool = False, data=None, gpt=t.TINY):
    """accelerate's documented loop (a `gpt` on `data`, default the tiny one on the tests' data); the
    gathered sample indices of each step's last micro-batches."""
    torch.manual_seed(0)
    model = GPT(gpt)
    optimizer = t.make_optimizer("adam", model.parameters())
    train_dataloader = torch.utils.data.DataLoader(Indexed(data), batch_size=4, shuffle=True)
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    if resume:
        accelerator.load_state(checkpoint)
        train_dataloader = accelerator.skip_first_batches(train_dataloader, 1)  # as accelerate's docs resume
    seen, gathered, done = [], [], 0
    while done < steps:
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                seen.extend(batch["index"].tolist())
                loss = model(batch["tokens"])
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                gathered.append(accelerator.gather_for_metrics(batch["index"]).tolist())
                done += 1
                if done == steps:
                    break
    if checkpoint is not None and not resume:
        accelerator.save_state(checkpoint)
    return model, seen, gathered


def _cases(files, checkpoints):
    results = {}
    for stage in STAGES:
        config = t.ds_config(cluster=files["cluster"], plan=files[stage], stage=stage)
        accelerator = _accelerator(config)
        model, seen, gathered = _train(accelerator, STEPS)
        results[stage] = {
            "params": t.full_parameters(model),
            "seen": seen,
            "gathered": gathered,
            "plan": (accelerator.micro_batch_size, accelerator.gradient_accumulation_steps),
        }
    # The plan searched at start from profiles, for a plain Accelerator's global batch (4 x 1 x 3).
    # The profiles are synthetic: checked against this machine at start they would be rescaled to it.
    config = t.ds_config(
        cluster=files["cluster"], plan=None, stage=1, profiles=str(files["profiles"]), calibration={"action": "off"}
    )
    accelerator = _accelerator(config)
    model, seen, _ = _train(accelerator, STEPS)
    results["searched"] = {"params": t.full_parameters(model), "seen": seen, "plan": accelerator.plan}
    results["token_mean"] = {stage: _token_mean(files, stage) for stage in TOKEN_MEAN_STAGES}
    results["token_mean_drop_last"] = _token_mean(files, 1, steps=DROP_LAST_STEPS, drop_last=True)
    results["refusals"] = _refusals(files)
    for stage in RESUME_STAGES:
        config = t.ds_config(cluster=files["cluster"], plan=files[stage], stage=stage)
        _, first, _ = _train(_accelerator(config), 1, checkpoint=checkpoints / f"stage{stage}")
        model, rest, _ = _train(_accelerator(config), STEPS - 1, checkpoint=checkpoints / f"stage{stage}", resume=True)
        results[f"resumed{stage}"] = {"params": t.full_parameters(model), "seen": first + rest, "first": first}
    # The stage-1 checkpoint resumed under another plan of the same global batch.
    accelerator = _accelerator(t.ds_config(cluster=files["cluster"], plan=files["other_plan"], stage=1))
    model, rest, _ = _train(accelerator, STEPS - 1, checkpoint=checkpoints / "stage1", resume=True)
    results["resumed_other_plan"] = {
        "params": t.full_parameters(model),
        "seen": results["resumed1"]["first"] + rest,
        "steps": accelerator.poplar_engine.global_steps,
    }
    # accelerate's free_memory() between two trainings: the second prepare's DataLoader is on the plan again.
    accelerator.free_memory()
    model, seen, _ = _train(accelerator, STEPS)
    results["after_free_memory"] = {"params": t.full_parameters(model), "seen": seen}
    return results


def _token_mean(files, stage: int, *, steps: int = hf.STEPS, **poplar) -> dict:
    """The loop with a Hugging Face causal LM on padded sequences and ``loss_reduction: token_mean`` (and
    `poplar`), over as many passes (epochs) as `steps` takes."""
    config = t.ds_config(
        cluster=files["cluster"], plan=files[stage], stage=stage, loss_reduction="token_mean", **poplar
    )
    config["gradient_clipping"] = hf.CLIP
    accelerator = _accelerator(config)
    model = hf.tiny_gpt2()
    optimizer = hf.make_optimizer("sgd", model.parameters())  # scale-sensitive: a wrong token count shows
    dataloader = torch.utils.data.DataLoader(hf.RecordingVarLen(), batch_size=4, collate_fn=hf.collate)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    done = 0
    while done < steps:
        for batch in dataloader:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)  # the micro-batch's own token mean, as usual
                optimizer.step()
                optimizer.zero_grad()
            done += accelerator.sync_gradients
            if done == steps:
                break
    return {"params": hf.full_parameters(model)}


def _refusals(files) -> dict[str, str]:
    messages = {}
    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)  # set by the Accelerators above (in this forked rank only)
    try:
        PoplarAccelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])  # no DeepSpeed
    except ValueError as error:
        messages["no_deepspeed"] = str(error)
    return messages


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("accelerate")
    files = t.write_stage_files(tmp, ALLOCATIONS, device_types=TYPES)
    files["profiles"] = t.write_profiles(
        tmp / "profiles", model_fingerprint(GPT(t.TINY)), [("cpu", 16, 0.001), ("cpu-slow", 4, 0.003)]
    )
    files["other_plan"] = t.write_plan(tmp / "other_plan.json", OTHER_PLAN, stage=1, device_types=TYPES)
    return run_ranks(_cases, world_size=3, tmp_path=tmp, args=(files, tmp / "checkpoints"), timeout_s=300)


@pytest.fixture(scope="module")
def reference():
    return t.reference_parameters("adam", GLOBAL_BATCH, STEPS)[0]


def _stream_indices(steps: int) -> list[int]:
    return t.SampleStream(num_samples=t.NUM_SAMPLES, seed=0).indices(0, steps * GLOBAL_BATCH)


@pytest.mark.parametrize("stage", STAGES)
def test_parameters_equal_one_process_on_the_global_batches(results, reference, stage):
    assert t.max_difference(results[0][stage]["params"], reference) <= 1e-5


@pytest.mark.parametrize("stage", STAGES)
def test_each_rank_trains_its_plan_and_every_sample_once(results, stage):
    assert [r[stage]["plan"] for r in results] == ALLOCATIONS[stage]
    seen = [i for r in results for i in r[stage]["seen"]]
    assert sorted(seen) == sorted(_stream_indices(STEPS))


@pytest.mark.parametrize("stage", STAGES)
def test_gather_for_metrics_returns_every_rank_s_rows(results, stage):
    # At each optimizer step: every rank's last micro-batch, rank 0's rows first.
    for step, gathered in enumerate(results[0][stage]["gathered"]):
        expected = []
        for rank, (b, s) in enumerate(ALLOCATIONS[stage]):
            expected += results[rank][stage]["seen"][(step * s + s - 1) * b : (step * s + s) * b]
        assert gathered == expected


def test_the_plan_searched_at_start_splits_a_plain_accelerator_s_global_batch(results, reference):
    plan = results[0]["searched"]["plan"]
    assert plan.global_batch_size == GLOBAL_BATCH  # the DataLoader's 4 x 1 accumulation step x 3 processes
    assert [r.micro_batch_size * r.gradient_accumulation_steps for r in plan.ranks] != [4, 4, 4]
    assert t.max_difference(results[0]["searched"]["params"], reference) <= 1e-5
    seen = [i for r in results for i in r["searched"]["seen"]]
    assert sorted(seen) == sorted(_stream_indices(STEPS))


@pytest.fixture(scope="module")
def token_mean_reference():
    return hf.reference_parameters(GLOBAL_BATCH, hf.STEPS, optimizer="sgd")


@pytest.mark.parametrize("stage", TOKEN_MEAN_STAGES)
def test_token_mean_gradients_equal_one_process_on_the_global_batch_s_tokens(results, token_mean_reference, stage):
    assert t.max_difference(results[0]["token_mean"][stage]["params"], token_mean_reference) <= 1e-5


def test_token_mean_with_drop_last_trains_on_past_a_dropped_epoch_tail(results):
    # The second epoch's iterations start at its beginning (50), not 4 x 12 = 48: the tokens counted for
    # each iteration are found by the sampler's position.
    expected = hf.reference_parameters(GLOBAL_BATCH, DROP_LAST_STEPS, optimizer="sgd", drop_last=True)
    assert t.max_difference(results[0]["token_mean_drop_last"]["params"], expected) <= 1e-5


@pytest.mark.parametrize(
    "case, expected",
    [
        ("no_deepspeed", "PoplarAccelerator: expected DeepSpeed"),
    ],
)
def test_what_it_cannot_train_is_refused_on_every_rank(results, case, expected):
    assert all(expected in r["refusals"][case] for r in results)


@pytest.mark.parametrize("stage", RESUME_STAGES)
def test_load_state_continues_the_data_and_equals_the_uninterrupted_run(results, stage):
    seen = [i for r in results for i in r[f"resumed{stage}"]["seen"]]
    assert sorted(seen) == sorted(_stream_indices(STEPS))
    assert t.max_difference(results[0][f"resumed{stage}"]["params"], results[0][stage]["params"]) <= 1e-5


def test_load_state_under_another_plan_equals_one_process(results, reference):
    # accelerate restores its micro-step counter from the checkpoint; the data resumes at an iteration
    # start, so accumulate() counts the new plan's micro-steps from 0 on every rank.
    assert [r["resumed_other_plan"]["steps"] for r in results] == [STEPS] * len(results)
    assert t.max_difference(results[0]["resumed_other_plan"]["params"], reference) <= 1e-5
    seen = [i for r in results for i in r["resumed_other_plan"]["seen"]]
    assert sorted(seen) == sorted(_stream_indices(STEPS))


def test_a_prepare_after_free_memory_trains_the_plan_again(results, reference):
    # A second training from the start (accelerate's find_executable_batch_size pattern, or a second phase).
    assert t.max_difference(results[0]["after_free_memory"]["params"], reference) <= 1e-5
    seen = [i for r in results for i in r["after_free_memory"]["seen"]]
    assert sorted(seen) == sorted(_stream_indices(STEPS))


# -- the LR scheduler: how often each kind steps, whatever each rank's accumulation count -------------
def _scheduler_steps(files) -> dict[str, list[int]]:
    """Each scheduler kind's own step counter after each optimizer step, on this rank (stage 1, uneven counts)."""
    from deepspeed.runtime.lr_schedules import WarmupLR

    kinds = {
        "torch": (lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0), "last_epoch"),
        "deepspeed": (lambda opt: WarmupLR(opt, warmup_max_lr=0.01, warmup_num_steps=100), "last_batch_iteration"),
    }
    counters = {}
    for kind, (make, counter) in kinds.items():
        accelerator = _accelerator(t.ds_config(cluster=files["cluster"], plan=files[1], stage=1))
        torch.manual_seed(0)
        model = GPT(t.TINY)
        optimizer = t.make_optimizer("adam", model.parameters())
        loader = torch.utils.data.DataLoader(Indexed(), batch_size=4)
        model, optimizer, loader, lr_scheduler = accelerator.prepare(model, optimizer, loader, make(optimizer))
        counters[kind] = []
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(batch["tokens"]))
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                counters[kind].append(getattr(lr_scheduler.scheduler, counter))
                if len(counters[kind]) == STEPS:
                    break
    return counters


def test_the_lr_scheduler_follows_optimizer_steps_alike_on_every_rank(tmp_path):
    files = t.write_stage_files(tmp_path, {1: ALLOCATIONS[1]}, device_types=TYPES)
    counters = run_ranks(_scheduler_steps, world_size=3, tmp_path=tmp_path, args=(files,), timeout_s=300)
    world_size = len(TYPES)
    for rank_counters in counters:  # ranks of 2, 3 and 1 micro-steps per optimizer step
        # A torch scheduler is accelerate's: the loop's step() at the accumulation boundary, once per process.
        assert rank_counters["torch"] == [world_size * step for step in range(1, STEPS + 1)]
        # DeepSpeed's own is DeepSpeed's engine's: once per optimizer step (the loop's step() does nothing).
        first = rank_counters["deepspeed"][0]
        assert rank_counters["deepspeed"] == [first + step for step in range(STEPS)]
    assert len({c["deepspeed"][0] for c in counters}) == 1


# -- re-balancing: an emulated rank slows down mid-run ----------------------------------------
# Enough compute per sample that a rank's time follows its samples (test_rebalance_training's model).
DRIFT_GPT = t.GPTConfig(vocab_size=256, sequence_length=32, num_layers=2, num_heads=2, hidden_size=64)
DRIFT_SAMPLES = 100
DRIFT_BATCH = 24
DRIFT_STEP = 2
"""Rank 1 runs 4x slower once this many optimizer steps are done."""
DRIFT_STEPS = 8
RESUMED_STEPS = 2
DRIFT_ALLOCATIONS = {1: [(4, 2), (2, 4), (4, 2)], 2: [(4, 2), (4, 2), (4, 2)]}
"""Each stage's plan at start: uneven accumulation counts at stage 1, one count at stage 2."""
DRIFT_LARGEST_SIZES = {1: 4, 2: 12}
"""Each stage's largest micro-batch in the profiles, the largest a re-plan may use: at stage 1 the fast ranks'
new share takes 3 or more micro-steps (accumulate()'s counter moves to a multiple); at stage 2 one micro-step
of up to 12 samples each (with 8 at most, 8 + 8 + 8 in one micro-step beat moving samples)."""


def _drift_config(files, stage: int) -> dict:
    # Threshold 1.0 (2x off): every rank is emulated and steady at its profile (1.0x), the drift is 4x.
    # Stage 1 asks for re-balancing, stage 2 has the default (auto).
    rebalance = {"check_interval_steps": 2, "threshold": 1.0, "sustained_checks": 2}
    if stage == 1:
        rebalance["enabled"] = True
    return t.ds_config(
        cluster=files["drift_cluster"],
        plan=files[f"drift{stage}"],
        stage=stage,
        profiles=str(files["drift_profiles"]),
        rebalance=rebalance,
    )


def _write_drift_profiles(directory) -> None:
    """Synthetic profiles of the drift model, both types alike and emulated: what a re-plan starts from."""
    for stage, largest in DRIFT_LARGEST_SIZES.items():
        t.write_steady_profiles(
            directory,
            GPT(DRIFT_GPT),
            {"cpu-fast": 1.0, "cpu-slow": 1.0},
            fast_s_per_sample=0.008,
            largest=largest,
            zero_stage=stage,
        )


def _drift_run(accelerator, steps: int, **train) -> dict:
    with t.logged_lines("poplar_ext") as logged:  # this forked rank's own logger
        model, seen, _ = _train(accelerator, steps, data=t.dataset(DRIFT_GPT, DRIFT_SAMPLES), gpt=DRIFT_GPT, **train)
    plan = accelerator.plan
    return {
        "params": t.full_parameters(model),
        "seen": seen,
        "allocation": [(r.micro_batch_size, r.gradient_accumulation_steps) for r in plan.ranks],
        "counted": (accelerator.micro_batch_size, accelerator.gradient_accumulation_steps),
        "history": [(h["start_step"], h["reason"]) for h in accelerator.poplar_engine.plan_history],
        "steps": accelerator.poplar_engine.global_steps,
        "logged": logged,
    }


def _drifting(files, checkpoints) -> dict:
    results = {}
    for stage in DRIFT_ALLOCATIONS:
        checkpoint = checkpoints / f"drift{stage}"
        results[stage] = _drift_run(_accelerator(_drift_config(files, stage)), DRIFT_STEPS, checkpoint=checkpoint)
        accelerator = _accelerator(_drift_config(files, stage))
        results[f"resumed{stage}"] = _drift_run(accelerator, RESUMED_STEPS, checkpoint=checkpoint, resume=True)
    return results


@pytest.fixture(scope="module")
def drift(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("accelerate-drift")
    cluster_file = t.write_cluster(tmp / "cluster.json", fast=1, slow=2, slowdown=1.0, fast_type="cpu-fast")
    cluster = json.loads(cluster_file.read_text())
    cluster["device_types"]["cpu-slow"]["emulation"]["slowdown_schedule"] = [[DRIFT_STEP, 4.0, 1]]
    cluster_file.write_text(json.dumps(cluster))
    files = {"drift_cluster": cluster_file, "drift_profiles": tmp / "profiles"}
    _write_drift_profiles(files["drift_profiles"])
    types = ["cpu-fast", "cpu-slow", "cpu-slow"]
    for stage, allocation in DRIFT_ALLOCATIONS.items():
        files[f"drift{stage}"] = t.write_plan(tmp / f"plan{stage}.json", allocation, stage=stage, device_types=types)
    return run_ranks(_drifting, world_size=3, tmp_path=tmp, args=(files, tmp / "checkpoints"), timeout_s=300)


@pytest.fixture(scope="module")
def drift_reference():
    """One process on the same global batches: the parameters after the first run's and the resumed run's steps."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: two threads on the shared cores made it 4x slower (measured)
    try:
        return {
            steps: t.reference_parameters("adam", DRIFT_BATCH, steps, gpt=DRIFT_GPT, num_samples=DRIFT_SAMPLES)[0]
            for steps in (DRIFT_STEPS, DRIFT_STEPS + RESUMED_STEPS)
        }
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("stage", DRIFT_ALLOCATIONS)
def test_a_slowed_rank_gets_exactly_one_replan_that_moves_samples_away(drift, stage):
    first = drift[0][stage]
    assert len(first["history"]) == 2, first["history"]
    start_step, reason = first["history"][1]
    assert DRIFT_STEP < start_step < DRIFT_STEPS and reason.startswith("re-balanced")
    # Every rank steady at its synthetic profile: the drift reads as its schedule's factor, exactly.
    assert "rank 1 (cpu-slow) at 4.00x its predicted compute (speed factor 1.00 -> 4.00)" in reason, reason
    before, after = DRIFT_ALLOCATIONS[stage], first["allocation"]
    assert after[1][0] * after[1][1] < before[1][0] * before[1][1], f"{before} -> {after}"
    assert all(r[stage]["history"] == first["history"] and r[stage]["allocation"] == after for r in drift)
    assert [r[stage]["counted"] for r in drift] == after, "accumulate() counts each rank's new accumulation steps"
    assert any(f"poplar plan from step {start_step}: re-balanced" in line for line in first["logged"])
    assert all(r[stage]["steps"] == DRIFT_STEPS for r in drift)


@pytest.mark.parametrize("stage", DRIFT_ALLOCATIONS)
def test_training_across_the_replan_equals_one_process_every_sample_once(drift, drift_reference, stage):
    assert t.max_difference(drift[0][stage]["params"], drift_reference[DRIFT_STEPS]) <= 1e-5
    seen = sorted(i for r in drift for i in r[stage]["seen"])
    assert seen == sorted(t.SampleStream(num_samples=DRIFT_SAMPLES, seed=0).indices(0, DRIFT_STEPS * DRIFT_BATCH))


@pytest.mark.parametrize("stage", DRIFT_ALLOCATIONS)
def test_load_state_after_the_replan_continues_under_the_switched_plan(drift, drift_reference, stage):
    saved, resumed = drift[0][stage], drift[0][f"resumed{stage}"]
    assert resumed["allocation"] == saved["allocation"] and resumed["history"] == saved["history"]
    assert [r[f"resumed{stage}"]["counted"] for r in drift] == saved["allocation"]
    steps = DRIFT_STEPS + RESUMED_STEPS
    assert all(r[f"resumed{stage}"]["steps"] == steps for r in drift)
    assert t.max_difference(resumed["params"], drift_reference[steps]) <= 1e-5
    seen = sorted(i for r in drift for i in r[stage]["seen"] + r[f"resumed{stage}"]["seen"])
    assert seen == sorted(t.SampleStream(num_samples=DRIFT_SAMPLES, seed=0).indices(0, steps * DRIFT_BATCH))


# accelerate's own config file, as `accelerate config` writes it for DeepSpeed with a config file.
ACCELERATE_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: {ds_config}
  zero3_init_flag: false
num_machines: 1
num_processes: {processes}
machine_rank: 0
use_cpu: false
"""


def test_under_accelerate_launch_with_its_config_file(tmp_path, reference):
    # 2 ranks (a third costs a launch ~4 s of CPU), uneven counts and samples at ZeRO-1: with even
    # samples per rank, DeepSpeed's own division by the count would be the right weight.
    cluster = t.write_cluster(tmp_path / "cluster.json", fast=1, slow=1, slowdown=1.0)
    plan = t.write_plan(tmp_path / "plan.json", [(4, 2), (4, 1)], stage=1, device_types=TYPES[:2])
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps(t.ds_config(cluster=cluster, plan=plan, stage=1)))
    accelerate_config = tmp_path / "accelerate.yaml"
    accelerate_config.write_text(ACCELERATE_CONFIG.format(ds_config=ds_config, processes=2))
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_config),
        "--main_process_port", str(free_port()), str(HERE / "accelerate_train.py"), "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    _assert_finished(done, out, ranks=2)
    assert "rank 1: cpu-slow (emulated: 1x slower, 2.0 GB), micro-batch 4 x 1 accumulation steps" in done.stderr
    assert t.max_difference(torch.load(out / "params.pt", weights_only=False), reference) <= 1e-5
    seen = [i for r in range(2) for i in json.loads((out / f"samples-rank{r}.json").read_text())]
    assert sorted(seen) == sorted(_stream_indices(STEPS))


def _assert_finished(done: subprocess.CompletedProcess, out: Path, *, ranks: int) -> None:
    log = done.stdout + done.stderr
    markers = [out / f"done-rank{rank}" for rank in range(ranks)]
    assert_launch_finished(done.returncode, log, markers, log[-4000:])


def test_under_the_deepspeed_launcher_with_a_deepspeed_plugin(tmp_path, reference):
    # The same loop without accelerate launch: the DeepSpeed config through DeepSpeedPlugin, none of accelerate's
    # environment variables. torchrun's environment is accelerate launch's own (it starts the ranks through
    # torch.distributed.run): a plain torchrun launch of this script would add ~8 s and nothing the two do not test.
    cluster = t.write_cluster(tmp_path / "cluster.json", fast=1, slow=1, slowdown=1.0)
    plan = t.write_plan(tmp_path / "plan.json", [(4, 2), (4, 1)], stage=1, device_types=TYPES[:2])
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps(t.ds_config(cluster=cluster, plan=plan, stage=1)))
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    start = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port())]
    script = [str(HERE / "accelerate_train.py"), "--out", str(out), "--deepspeed_config", str(ds_config)]
    done = subprocess.run(start + script, env=env, capture_output=True, text=True, timeout=300)
    _assert_finished(done, out, ranks=2)
    assert t.max_difference(torch.load(out / "params.pt", weights_only=False), reference) <= 1e-5
    seen = [i for r in range(2) for i in json.loads((out / f"samples-rank{r}.json").read_text())]
    assert sorted(seen) == sorted(_stream_indices(STEPS))


def test_the_diffusion_example_in_the_automatic_mode_profiles_with_its_loss_fn(tmp_path):
    # No plan: the example's model returns no loss, so profiling calls the loss_fn it gives PoplarAccelerator.
    config = json.loads((EXAMPLES / "ds_config_accelerate.json").read_text())
    profiles = tmp_path / "profiles"
    config["poplar"] = {
        "cluster": str(EXAMPLES / "cluster.json"), "profiles": str(profiles), "global_batch_size": 8, "cpu_threads": 1,
    }  # fmt: skip
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps(config))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
        str(EXAMPLES / "accelerate_diffusion.py"), "--deepspeed_config", str(ds_config),
        "--output_dir", str(tmp_path / "out"), "--max_train_steps", "2",
        # diffusers' scripts start a new run where 'latest' finds no checkpoint yet (the output dir is new here).
        "--resume_from_checkpoint", "latest",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    log = done.stdout + done.stderr
    assert "step 2: loss" in log and (done.returncode == 0 or EXIT_ABORT in log), log[-4000:]
    assert "Checkpoint 'latest' does not exist. Starting a new training run." in log
    assert f"searched at start by the poplar policy from {profiles}" in log
    assert sorted(p.name.split("-", 2)[2] for p in profiles.glob("*.json")) == ["cpu-slow-zero1.json", "cpu-zero1.json"]
