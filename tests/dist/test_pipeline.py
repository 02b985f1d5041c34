"""Pipelines of a pipeline plan train exactly as one process on the global batch (issue 22).

4 forked ranks, two real CPU ones and two of an emulated slower type, one group for every
case: first the refusals (no process group exists yet, so passing them means no rank went
on into a collective another rank skipped), then 2 pipelines of 2 stages that differ in
layer split, micro-batch size and count, and a 3-stage pipeline beside a 1-stage one, each
at ZeRO 0 and 1 with gradient clipping on, against one process training the same global
batches (fp32); then a checkpoint resumed against the uninterrupted run, and the copies of
every layer after construction without seeding.
"""

from __future__ import annotations

import json
import os
import time

import _training as t
import pytest
import torch
from harness import run_ranks

from poplar_ext.models.toy_pipeline import RegressionData, mse, toy_sequential
from poplar_ext.runtime.data import SampleStream

STEPS = 3
NUM_SAMPLES = 25  # not a multiple of either global batch: iterations straddle epochs
CLIP = 0.05  # the global gradient is clipped in every step (asserted below)
TYPES = ["cpu", "cpu", "cpu-slow", "cpu-slow"]
# Per pipeline: (rank, first layer, last layer) per stage, micro-batch size, micro-batches.
PLANS = {
    "two_by_two": [([(0, 0, 1), (1, 2, 5)], 2, 4), ([(2, 0, 3), (3, 4, 5)], 3, 2)],  # B = 14, shares 8 and 6
    "three_and_one": [([(0, 0, 0), (1, 1, 2), (2, 3, 5)], 2, 4), ([(3, 0, 5)], 3, 1)],  # B = 11
}
TRAINED = [(name, stage) for name in PLANS for stage in (0, 1)]


def _global_batch(name: str) -> int:
    return sum(b * s for _, b, s in PLANS[name])


def write_pipeline_plan(path, pipelines, *, stage, num_layers=6, types=TYPES):
    """A hand-written pipeline plan (the format of poplar_ext.plan.pipeline_formats)."""
    plan = {
        "schema_version": 1,
        "parallelism": "pipeline",
        "policy": "poplar",
        "zero_stage": stage,
        "global_batch_size": sum(b * s for _, b, s in pipelines),
        "num_layers": num_layers,
        "pipelines": [
            {
                "stages": [
                    {"rank": r, "device_type": types[r], "first_layer": a, "last_layer": z} for r, a, z in stages
                ],
                "micro_batch_size": b,
                "num_micro_batches": s,
            }
            for stages, b, s in pipelines
        ],
        "predicted": {"iteration_time_s": 1.0, "samples_per_s": 1.0, "ideal_samples_per_s": 1.0},
        "profile_fingerprints": {},
    }
    path.write_text(json.dumps(plan))
    return path


class RecordingData(RegressionData):
    """Remembers the samples this rank's loader read."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []

    def __getitem__(self, index):
        self.seen.append(int(index))
        return super().__getitem__(index)


def _config(files, plan_key, *, stage, **extra):
    return {
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
        "poplar": {"cluster": str(files["cluster"]), "plan": str(files[plan_key]), "log_interval_steps": 0},
        **extra,
    }


def _plan_key(name, stage):
    return name if stage == 0 else f"{name}_{stage}"


def _engine(files, name, *, stage, seed_layers=True, monitor=False):
    import poplar_ext
    from poplar_ext.models.toy_pipeline import toy_layers
    from poplar_ext.pipeline import PoplarPipelineModule

    extra = {}
    if monitor:  # DeepSpeed's csv monitor, rank 0 writing
        extra["csv_monitor"] = {"enabled": True, "output_path": str(files["monitor"]), "job_name": f"{name}{stage}"}
    config = _config(files, _plan_key(name, stage), stage=stage, **extra)
    model = PoplarPipelineModule(toy_layers(), loss_fn=mse, seed_layers=seed_layers, config=config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = RecordingData(num_samples=NUM_SAMPLES)
    engine, _, _, _ = poplar_ext.initialize(model=model, optimizer=optimizer, training_data=data, config=config)
    return engine, data


def _parameters(engine):
    return {name: p.detach().clone() for name, p in engine.module.state_dict().items()}


def _train(files, name, stage):
    engine, data = _engine(files, name, stage=stage, monitor=True)
    losses = [float(engine.train_batch()) for _ in range(STEPS)]
    return {
        "params": _parameters(engine),
        "losses": losses,
        "seen": data.seen,
        "position": engine.data_position,
        "eval": _evaluate(engine),
    }


def _evaluate(engine):
    """eval_batch on this pipeline's share of samples 0..B-1 in its plan micro-batches (pipeline 0 first)."""
    data, pipelines = RegressionData(num_samples=NUM_SAMPLES), engine.plan.pipelines
    start = sum(p.micro_batch_size * p.num_micro_batches for p in pipelines[: engine.pipeline_index])
    size, count = pipelines[engine.pipeline_index].micro_batch_size, pipelines[engine.pipeline_index].num_micro_batches
    batches = [
        (data.inputs[i : i + size], data.targets[i : i + size]) for i in range(start, start + size * count, size)
    ]
    return float(engine.eval_batch(iter(batches)))


REFUSALS = {
    "zero_stage_2": dict(plan_key="two_by_two", stage=2),
    "plan_for_3_ranks": dict(plan_key="three_ranks", stage=0),
    "device_types": dict(plan_key="wrong_types", stage=0),
    "layers": dict(plan_key="two_by_two", stage=0, num_layers=5),
    "zero_plan": dict(plan_key="zero_plan", stage=0),
}


def _refusals(files):
    from poplar_ext.models.toy_pipeline import toy_layers
    from poplar_ext.pipeline import PoplarPipelineModule

    messages = {}
    for case, spec in REFUSALS.items():
        config = _config(files, spec["plan_key"], stage=spec["stage"])
        try:
            PoplarPipelineModule(toy_layers(num_layers=spec.get("num_layers", 6)), loss_fn=mse, config=config)
            messages[case] = "accepted"
        except ValueError as exc:
            messages[case] = str(exc)
    return messages


def _resume(files):
    """Save after 2 steps, train a third; a new engine loads the checkpoint and trains the third again."""
    engine, data = _engine(files, "three_and_one", stage=1)
    for _ in range(2):
        engine.train_batch()
    engine.save_checkpoint(files["checkpoints"])
    before = len(data.seen)
    engine.train_batch()
    uninterrupted = {"params": _parameters(engine), "seen": data.seen[before:], "position": engine.data_position}
    engine, data = _engine(files, "three_and_one", stage=1)
    engine.load_checkpoint(files["checkpoints"])
    engine.train_batch()
    resumed = {"params": _parameters(engine), "seen": data.seen, "position": engine.data_position}
    return {"uninterrupted": uninterrupted, "resumed": resumed, "step": engine.global_steps}


def _unseeded_copies(files):
    torch.manual_seed(1000 + int(os.environ["RANK"]))  # every rank builds its layers from other random numbers
    engine, _ = _engine(files, "two_by_two", stage=0, seed_layers=False)
    return _parameters(engine)


SEARCHED_BATCH = 14


def _searched_config(files):
    poplar = {"cluster": str(files["cluster"]), "profiles": str(files["profiles"]), "log_interval_steps": 0}
    return {
        **{k: v for k, v in _config(files, "two_by_two", stage=0).items() if k != "poplar"},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},  # what the layers are measured with
        "train_batch_size": SEARCHED_BATCH,
        "poplar": poplar,
    }


def _searched_at_start(files):
    """No plan file: without data the missing layer profiles are refused; with it they are measured, rank 0
    searches a plan, every rank trains it; a second module finds the profiles in the cache."""
    import poplar_ext
    from poplar_ext.models.toy_pipeline import toy_layers
    from poplar_ext.pipeline import PoplarPipelineModule
    from poplar_ext.plan.pipeline_formats import pipeline_plan_to_dict

    config, out = _searched_config(files), {}
    try:
        PoplarPipelineModule(toy_layers(), loss_fn=mse, config=config)
        out["without_data"] = "accepted"
    except ValueError as exc:
        out["without_data"] = str(exc)
    data = RegressionData(num_samples=NUM_SAMPLES)
    model = PoplarPipelineModule(toy_layers(), loss_fn=mse, seed_layers=True, config=config, training_data=data)
    engine, _, _, _ = poplar_ext.initialize(model=model, training_data=data, config=config)
    out["losses"] = [float(engine.train_batch()) for _ in range(STEPS)]
    out.update(plan=pipeline_plan_to_dict(engine.plan), params=_parameters(engine), position=engine.data_position)
    layer_files = sorted(files["profiles"].glob("layers/*.json"))
    written = {path.name: path.stat().st_mtime_ns for path in layer_files}
    again = PoplarPipelineModule(toy_layers(), loss_fn=mse, config=config, training_data=data)
    out["again"] = pipeline_plan_to_dict(again.poplar_job.plan)
    out["rewritten"] = written != {path.name: path.stat().st_mtime_ns for path in layer_files}
    out["layer_files"] = sorted(written)
    return out


def _per_layer_cli(files):
    """poplar-profile on the pipeline model: layer profiles only, ZeRO stages 0 and 1 of those asked, and the
    network file (--network by default) that prices their transfers and all-reduces."""
    from poplar_ext.profiler.cli import main

    ds = files["profiles"].parent / f"ds_layers{os.environ['RANK']}.json"  # one per rank: none reads a half-written one
    ds.write_text(json.dumps({"optimizer": {"type": "Adam", "params": {"lr": 0.001}}}))
    return main(
        [
            "--deepspeed_config",
            str(ds),
            "--cluster",
            str(files["cluster"]),
            "--repeats",
            "1",
            "--model",
            "poplar_ext.models.toy_pipeline:toy_layers",
            "--batch",
            "poplar_ext.models.toy_pipeline:toy_batch",
            "--zero-stages",
            "0,1,2",
            "--micro-batch-sizes",
            "1,4",
            "--output-dir",
            str(files["cli_profiles"]),
            "--quiet",
        ]
    )


def _sequential_per_layer(files):
    """profile_model(per_layer=True) on an nn.Sequential: whole-model and layer profiles, both from the
    layers' batch ``(inputs, labels)`` and loss ``loss_fn(outputs, labels)``."""
    from poplar_ext import profile_model
    from poplar_ext.models.toy_pipeline import toy_batch

    try:
        profiles = profile_model(
            model_factory=toy_sequential,
            make_batch=toy_batch,
            ds_config={"optimizer": {"type": "Adam", "params": {"lr": 0.001}}},
            cluster=files["cluster"],
            loss_fn=mse,
            per_layer=True,
            zero_stages=[0],
            micro_batch_sizes=[1, 2],
            micro_batch_size_limit=2,
            repeats=1,
            warmup_micro_steps=0,
            measure_network=False,
            cache_dir=files["sequential_profiles"],
            progress=None,
        )
    except Exception as exc:  # agreed on every rank: the group goes on to the other cases
        return f"{type(exc).__name__}: {exc}"
    return sorted((p.device_type, p.zero_stage) for p in profiles)


def _labels_of_a_dict(outputs, labels):
    return mse(outputs, labels["y"])


def _token_mean_labels_not_a_tensor(files):
    """token_mean with micro-batches whose labels are a dict, given to train_batch and eval_batch: what each raises."""
    import poplar_ext
    from poplar_ext.models.toy_pipeline import toy_layers
    from poplar_ext.pipeline import PoplarPipelineModule

    config = _config(files, "two_by_two", stage=0)
    config["poplar"]["loss_reduction"] = "token_mean"
    model = PoplarPipelineModule(toy_layers(), loss_fn=_labels_of_a_dict, config=config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, _, _, _ = poplar_ext.initialize(model=model, optimizer=optimizer, config=config)
    data, size = RegressionData(num_samples=NUM_SAMPLES), engine.poplar_job.pipeline.micro_batch_size
    messages = []
    for call in (engine.train_batch, engine.eval_batch):
        try:
            call(iter([(data.inputs[:size], {"y": data.targets[:size]})] * 4))
            messages.append("accepted")
        except Exception as exc:  # noqa: BLE001 - the old code's gloo error on the stages left waiting, too
            messages.append(f"{type(exc).__name__}: {exc}")
    return messages


def _all_cases(files):
    # First: a pipeline engine leaves DeepSpeed state behind that a later plain engine trips over.
    results = {"sequential": _sequential_per_layer(files)}
    results["refusals"] = _refusals(files)
    for name, stage in TRAINED:
        results[(name, stage)] = _train(files, name, stage)
    results["resume"] = _resume(files)
    results["unseeded"] = _unseeded_copies(files)
    started = time.monotonic()
    results["searched"] = _searched_at_start(files)
    results["searched"]["seconds"] = time.monotonic() - started
    results["cli"] = _per_layer_cli(files)
    results["token_mean_labels"] = _token_mean_labels_not_a_tensor(files)  # last: on old code it broke the group
    return results


def _load_deepspeeds_adam_op():
    """DeepSpeed's Adam (the profiled cases' config optimizer) loads its CPU op at its first use in a process,
    asking py-cpuinfo twice for the CPU's flags (a child process each, ~3 s a rank): loaded once here, before
    the fork, every rank finds it loaded (DeepSpeed keeps loaded ops per process). The op is the same."""
    from deepspeed.ops.op_builder import FusedAdamBuilder

    FusedAdamBuilder().load()


@pytest.fixture(scope="module")
def ranks_and_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    files = {
        "cluster": t.write_cluster(tmp / "cluster.json", fast=2, slow=2),
        "three_ranks": write_pipeline_plan(
            tmp / "three.json", [([(0, 0, 2), (1, 3, 5)], 2, 2), ([(2, 0, 5)], 2, 2)], stage=0
        ),
        "wrong_types": write_pipeline_plan(tmp / "types.json", PLANS["two_by_two"], stage=0, types=["cpu-slow"] * 4),
        "zero_plan": t.write_plan(tmp / "zero.json", [(2, 1)] * 4, stage=0, device_types=TYPES),
        "checkpoints": tmp / "checkpoints",
        "monitor": tmp / "monitor",
        "profiles": tmp / "profiles",
        "cli_profiles": tmp / "cli_profiles",
        "sequential_profiles": tmp / "sequential_profiles",
    }
    for name, pipelines in PLANS.items():
        for stage in (0, 1):
            files[_plan_key(name, stage)] = write_pipeline_plan(tmp / f"{name}{stage}.json", pipelines, stage=stage)
    _load_deepspeeds_adam_op()
    return run_ranks(
        _all_cases, world_size=4, tmp_path=tmp, args=(files,), init_process_group=False, timeout_s=180
    ), files


@pytest.fixture(scope="module")
def results(ranks_and_files):
    return ranks_and_files[0]


def _reference(global_batch: int, steps: int):
    """One process on the concatenated global batches (same stream), the same SGD, the global norm clipped."""
    model = toy_sequential()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data, stream = RegressionData(num_samples=NUM_SAMPLES), SampleStream(num_samples=NUM_SAMPLES, seed=0)
    losses, norms = [], []
    for step in range(steps):
        indices = stream.indices(step * global_batch, global_batch)
        optimizer.zero_grad()
        loss = mse(model(data.inputs[indices]), data.targets[indices])
        loss.backward()
        losses.append(float(loss.detach()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.state_dict().items()}, losses, norms


def _max_difference(per_rank_params, reference):
    """Largest |parameter - reference| over every copy on every rank; every layer must be held somewhere."""
    held = {name for params in per_rank_params for name in params}
    assert held == set(reference), sorted(set(reference) ^ held)
    return max(
        float((value - reference[name]).abs().max()) for params in per_rank_params for name, value in params.items()
    )


def _one_message(results, case):
    messages = {r["refusals"][case] for r in results}
    assert len(messages) == 1, f"ranks disagree: {messages}"
    return messages.pop()


@pytest.mark.parametrize(
    "case,expected",
    [
        ("zero_stage_2", "zero_optimization.stage (or poplar.zero_stage): expected 0 or 1 with pipelines, found 2"),
        ("plan_for_3_ranks", "The plan names 3 ranks but the job has 4 (WORLD_SIZE)."),
        ("device_types", "Device types differ from the cluster's at rank 0 (cpu-slow in the plan, cpu in the cluster)"),
        ("layers", "The plan splits 6 layers but the model has 5"),
        (
            "zero_plan",
            "is a ZeRO plan (every rank trains the whole model); a PoplarPipelineModule needs a pipeline plan",
        ),
    ],
)
def test_what_cannot_run_is_refused_alike_on_every_rank(results, case, expected):
    assert expected in _one_message(results, case)


def test_token_mean_labels_that_are_no_tensor_are_refused_alike_on_every_rank(results):
    # Only the last stages count labels: the others, left waiting in the schedule, raised gloo's error.
    for call, messages in zip(("train_batch", "eval_batch"), zip(*(r["token_mean_labels"] for r in results))):
        assert len(set(messages)) == 1, messages
        assert messages[0] == (
            f"ValueError: {call}: expected micro-batches (inputs, labels) with labels one tensor of token ids with "
            "poplar.loss_reduction token_mean, found another type on the last stage of 2 of 2 pipelines (logged "
            "there): give labels as one tensor per micro-batch"
        )


@pytest.mark.parametrize("name,stage", TRAINED)
def test_pipelines_match_one_process_on_the_global_batch(results, name, stage):
    global_batch = _global_batch(name)
    expected, losses, norms = _reference(global_batch, STEPS)
    assert min(norms) > CLIP, "clipping must be active for this test to cover it"
    runs = [r[(name, stage)] for r in results]
    assert _max_difference([run["params"] for run in runs], expected) <= 1e-5
    for run in runs:  # every rank returns the global batch's mean loss
        assert run["losses"] == pytest.approx(losses, abs=1e-6)
        assert run["position"] == STEPS * global_batch


def _monitored(files, name, stage, event):
    """The (step, value) rows DeepSpeed's csv monitor wrote for `event` in the run of `name` at `stage`."""
    path = files["monitor"] / f"{name}{stage}" / f"{event.replace('/', '_')}.csv"
    return [(int(step), float(value)) for step, value in (line.split(",") for line in path.read_text().split()[1:])]


@pytest.mark.parametrize("name,stage", TRAINED)
def test_eval_batch_returns_the_loss_of_the_batch_every_pipeline_evaluated(ranks_and_files, name, stage):
    # Pipelines of different micro-batch sizes and counts: the mean over all B samples, on every rank.
    results, files = ranks_and_files
    global_batch = _global_batch(name)
    model = toy_sequential()
    model.load_state_dict(_reference(global_batch, STEPS)[0])
    data = RegressionData(num_samples=NUM_SAMPLES)
    with torch.no_grad():
        expected = float(mse(model(data.inputs[:global_batch]), data.targets[:global_batch]))
    evaluated = [r[(name, stage)]["eval"] for r in results]
    assert evaluated == pytest.approx([expected] * len(results), abs=1e-5)
    assert _monitored(files, name, stage, "Train/Samples/eval_loss") == [
        (STEPS * global_batch, pytest.approx(evaluated[0], abs=1e-6))
    ]


@pytest.mark.parametrize("name,stage", TRAINED)
def test_deepspeeds_monitor_gets_the_loss_train_batch_returns(ranks_and_files, name, stage):
    results, files = ranks_and_files
    global_batch, losses = _global_batch(name), results[0][(name, stage)]["losses"]
    expected = [(step * global_batch, pytest.approx(loss, abs=1e-6)) for step, loss in enumerate(losses, 1)]
    assert _monitored(files, name, stage, "Train/Samples/train_loss") == expected
    # DeepSpeed's other events of train_batch still written, once a step
    assert [step for step, _ in _monitored(files, name, stage, "Train/Samples/lr")] == [s for s, _ in expected]


@pytest.mark.parametrize("name", list(PLANS))
def test_each_pipeline_reads_its_share_of_the_stream_once(results, name):
    runs = [r[(name, 0)] for r in results]
    firsts = []
    for stages, _, _ in PLANS[name]:
        first, last = runs[stages[0][0]]["seen"], runs[stages[-1][0]]["seen"]
        assert first == last, "a pipeline's first and last stages read the same micro-batches"
        firsts += first
    middle = [r for stages, _, _ in PLANS[name] for r, *_ in stages[1:-1]]
    assert all(runs[r]["seen"] == [] for r in middle), "middle stages read no data"
    stream = SampleStream(num_samples=NUM_SAMPLES, seed=0)
    assert sorted(firsts) == sorted(stream.indices(0, STEPS * _global_batch(name)))


def test_a_resumed_run_equals_the_uninterrupted_one(results):
    expected, _, _ = _reference(_global_batch("three_and_one"), STEPS)
    uninterrupted = [r["resume"]["uninterrupted"] for r in results]
    resumed = [r["resume"]["resumed"] for r in results]
    assert _max_difference([run["params"] for run in resumed], expected) <= 1e-5
    for before, after in zip(uninterrupted, resumed):
        assert before["seen"] == after["seen"] and after["position"] == before["position"] == STEPS * _global_batch(
            "three_and_one"
        )
        assert max(float((after["params"][k] - v).abs().max()) for k, v in before["params"].items()) == 0.0
    assert {r["resume"]["step"] for r in results} == {STEPS}


def test_every_copy_of_a_layer_starts_as_pipeline_0s_without_seeding(results):
    copies = {}
    for rank_params in (r["unseeded"] for r in results):
        for name, value in rank_params.items():
            copies.setdefault(name, []).append(value)
    assert all(len(values) == 2 for values in copies.values())  # two pipelines hold every layer
    assert all(torch.equal(values[0], values[1]) for values in copies.values())


def test_without_a_plan_one_is_searched_from_layer_profiles_measured_at_start(results):
    searched = [r["searched"] for r in results]
    assert len({s["without_data"] for s in searched}) == 1, "ranks disagree"
    assert "lacks layer profiles of this model for cpu, cpu-slow" in searched[0]["without_data"]
    assert "poplar-profile --per-layer" in searched[0]["without_data"]
    assert "create the dataset first and pass it to both" in searched[0]["without_data"]
    assert len(searched[0]["layer_files"]) == 2  # 2 device types at the config's ZeRO stage 0
    plan = searched[0]["plan"]
    assert all(s["plan"] == plan and s["again"] == plan for s in searched), "every rank, every start: one plan"
    assert plan["global_batch_size"] == SEARCHED_BATCH and plan["zero_stage"] == 0
    print("searched at start, twice:", [round(s["seconds"], 1) for s in searched], "s per rank")
    assert not any(s["rewritten"] for s in searched), "the second start reads the cache, measures nothing"
    expected, losses, _ = _reference(SEARCHED_BATCH, STEPS)
    assert _max_difference([s["params"] for s in searched], expected) <= 1e-5
    for s in searched:
        assert s["losses"] == pytest.approx(losses, abs=1e-6) and s["position"] == STEPS * SEARCHED_BATCH


def test_an_nn_sequential_profiled_per_layer_gets_whole_model_and_layer_profiles(ranks_and_files):
    from poplar_ext.plan.pipeline_formats import load_layer_profiles

    results, files = ranks_and_files
    assert [r["sequential"] for r in results] == [[("cpu", 0), ("cpu-slow", 0)]] * 4
    assert len(list(files["sequential_profiles"].glob("*.json"))) == 2
    layers = load_layer_profiles(files["sequential_profiles"])
    assert sorted((p.device_type, p.num_layers) for p in layers) == [("cpu", 6), ("cpu-slow", 6)]


def test_poplar_profile_measures_a_pipeline_model_layer_by_layer_only(ranks_and_files):
    from poplar_ext.plan.formats import load_cluster
    from poplar_ext.plan.network_format import find_network
    from poplar_ext.plan.pipeline_formats import load_layer_profiles

    results, files = ranks_and_files
    assert [r["cli"] for r in results] == [0] * 4
    assert not list(files["cli_profiles"].glob("*.json")), "a pipeline model gets layer profiles only"
    # ... and the network file beside them, as for any model (docs/pipeline.md: poplar-profile measures it).
    network = find_network(files["cli_profiles"], load_cluster(files["cluster"]))
    assert network is not None and network.world_size == 4
    profiles = load_layer_profiles(files["cli_profiles"])
    assert sorted((p.device_type, p.zero_stage) for p in profiles) == [
        ("cpu", 0),
        ("cpu", 1),
        ("cpu-slow", 0),
        ("cpu-slow", 1),
    ]
    slow = next(p for p in profiles if p.device_type == "cpu-slow")
    assert slow.emulated is not None and slow.measured_with["device"] == "emulated" and slow.num_layers == 6
    assert [s.micro_batch_size for s in slow.layers[0].samples] == [1, 4]
    # Adam: a gradient and two moments per parameter (plus a step counter per tensor).
    assert 3 * slow.layers[0].parameter_bytes <= slow.layers[0].optimizer_state_bytes
