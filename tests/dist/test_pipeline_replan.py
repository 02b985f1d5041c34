"""A pipeline checkpoint resumed under another pipeline plan trains on exactly (issue 34).

4 forked ranks, two emulated. Each case trains 3 steps under plan A, saves, and a new job
under plan B (other splits, depth and number of pipelines) loads the checkpoint and trains
2 more: its parameters are those of one process training the same 5 global batches, and
the resumed pipelines read the next samples of the stream, each once.

* ZeRO 0, Adam (per-parameter states and `step` in a torch state_dict): 2 pipelines of 2
  stages -> 1 pipeline of 4 stages;
* ZeRO 1, SGD with momentum (flat partitions): a 3-stage pipeline beside a 1-stage one
  -> 4 pipelines of 1 stage, the global batch 11 -> 12;
* each saved again into the tag it resumed from, and resumed under plan A again: one more
  step equals one process on the 6 global batches (nothing of the first save is read);
* a model of other widths loading the ZeRO-0 checkpoint: refused alike on every rank,
  nothing loaded.
"""

from __future__ import annotations

import _training as t
import pytest
import torch
from harness import run_ranks
from test_pipeline import CLIP, NUM_SAMPLES, TYPES, RecordingData, _config, write_pipeline_plan

from poplar_ext.models.toy_pipeline import RegressionData, mse, toy_sequential
from poplar_ext.runtime.data import SampleStream

BEFORE, AFTER = 3, 2
# Per pipeline: (rank, first layer, last layer) per stage, micro-batch size, micro-batches.
CASES = {
    "zero0_adam": {
        "stage": 0,
        "optimizer": "adam",
        "A": [([(0, 0, 1), (1, 2, 5)], 2, 4), ([(2, 0, 3), (3, 4, 5)], 3, 2)],  # B = 14
        "B": [([(0, 0, 0), (1, 1, 2), (2, 3, 4), (3, 5, 5)], 2, 7)],  # B = 14
    },
    "zero1_sgd": {
        "stage": 1,
        "optimizer": "sgd",
        "A": [([(0, 0, 0), (1, 1, 2), (2, 3, 5)], 2, 4), ([(3, 0, 5)], 3, 1)],  # B = 11
        "B": [([(0, 0, 5)], 3, 1), ([(1, 0, 5)], 3, 1), ([(2, 0, 5)], 2, 1), ([(3, 0, 5)], 2, 2)],  # B = 12
    },
}


def _batch(pipelines) -> int:
    return sum(b * s for _, b, s in pipelines)


def _optimizer(name, parameters):
    if name == "adam":
        return torch.optim.Adam(parameters, lr=0.01)
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)


def _engine(files, case, plan, *, dim=8):
    import poplar_ext
    from poplar_ext.models.toy_pipeline import toy_layers
    from poplar_ext.pipeline import PoplarPipelineModule

    config = _config(files, f"{case}_{plan}", stage=CASES[case]["stage"])
    model = PoplarPipelineModule(toy_layers(dim=dim), loss_fn=mse, seed_layers=True, config=config)
    optimizer = _optimizer(CASES[case]["optimizer"], model.parameters())
    data = RecordingData(num_samples=NUM_SAMPLES)
    engine, _, _, _ = poplar_ext.initialize(model=model, optimizer=optimizer, training_data=data, config=config)
    return engine, data


def _parameters(engine):
    return {name: p.detach().clone() for name, p in engine.module.state_dict().items()}


def _replan(files, case):
    """3 steps under A, saved; 2 under B, saved into the same tag; back under A for one more step."""
    checkpoints = files[f"{case}_checkpoints"]
    engine, _ = _engine(files, case, "A")
    for _ in range(BEFORE):
        engine.train_batch()
    engine.save_checkpoint(checkpoints, tag="t")
    engine, data = _engine(files, case, "B")
    engine.load_checkpoint(checkpoints)
    position = engine.data_position
    for _ in range(AFTER):
        engine.train_batch()
    result = {
        "params": _parameters(engine),
        "seen": data.seen,
        "start": position,
        "position": engine.data_position,
        "step": engine.global_steps,
        "history": [entry["reason"] for entry in engine.plan_history],
    }
    engine.save_checkpoint(checkpoints, tag="t")  # over the checkpoint of A, and its state per parameter
    engine, _ = _engine(files, case, "A")
    engine.load_checkpoint(checkpoints)
    engine.train_batch()
    return {**result, "back": _parameters(engine)}


def _another_model(files):
    engine, _ = _engine(files, "zero0_adam", "A", dim=4)  # the checkpoint is B's: the layers move
    before = _parameters(engine)
    try:
        engine.load_checkpoint(files["zero0_adam_checkpoints"])
        message = "accepted"
    except ValueError as exc:
        message = str(exc)
    unchanged = all(torch.equal(value, _parameters(engine)[name]) for name, value in before.items())
    return {"message": message, "unchanged": unchanged}


def _all_cases(files):
    results = {case: _replan(files, case) for case in CASES}
    results["another_model"] = _another_model(files)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline_replan")
    files = {"cluster": t.write_cluster(tmp / "cluster.json", fast=2, slow=2)}
    for case, spec in CASES.items():
        for plan in ("A", "B"):
            path = tmp / f"{case}_{plan}.json"
            files[f"{case}_{plan}"] = write_pipeline_plan(path, spec[plan], stage=spec["stage"], types=TYPES)
        files[f"{case}_checkpoints"] = tmp / f"{case}_checkpoints"
    return run_ranks(_all_cases, world_size=4, tmp_path=tmp, args=(files,), init_process_group=False, timeout_s=240)


def _reference(optimizer_name, batches):
    """One process on the same global batches of the stream, the same optimizer, the global norm clipped."""
    model = toy_sequential()
    optimizer = _optimizer(optimizer_name, model.parameters())
    data, stream = RegressionData(num_samples=NUM_SAMPLES), SampleStream(num_samples=NUM_SAMPLES, seed=0)
    position = 0
    for batch in batches:
        indices = stream.indices(position, batch)
        optimizer.zero_grad()
        mse(model(data.inputs[indices]), data.targets[indices]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        position += batch
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


@pytest.mark.parametrize("case", list(CASES))
def test_a_resume_under_another_plan_trains_as_one_process(results, case):
    spec = CASES[case]
    batches = [_batch(spec["A"])] * BEFORE + [_batch(spec["B"])] * AFTER
    expected = _reference(spec["optimizer"], batches)
    runs = [r[case] for r in results]
    held = {name for run in runs for name in run["params"]}
    assert held == set(expected)
    worst = max(float((v - expected[k]).abs().max()) for run in runs for k, v in run["params"].items())
    assert worst <= 1e-5
    assert {run["step"] for run in runs} == {BEFORE + AFTER}
    assert all("under another pipeline plan" in run["history"][-1] for run in runs)


@pytest.mark.parametrize("case", list(CASES))
def test_a_save_into_the_tag_it_resumed_from_replaces_that_checkpoint(results, case):
    spec = CASES[case]
    batches = [_batch(spec["A"])] * BEFORE + [_batch(spec["B"])] * AFTER + [_batch(spec["A"])]
    expected = _reference(spec["optimizer"], batches)
    worst = max(float((v - expected[k]).abs().max()) for r in results for k, v in r[case]["back"].items())
    assert worst <= 1e-5


@pytest.mark.parametrize("case", list(CASES))
def test_the_resumed_pipelines_read_the_rest_of_the_stream_once(results, case):
    spec = CASES[case]
    start = BEFORE * _batch(spec["A"])
    runs = [r[case] for r in results]
    assert {(run["start"], run["position"]) for run in runs} == {(start, start + AFTER * _batch(spec["B"]))}
    firsts = [index for stages, _, _ in spec["B"] for index in runs[stages[0][0]]["seen"]]
    stream = SampleStream(num_samples=NUM_SAMPLES, seed=0)
    assert sorted(firsts) == sorted(stream.indices(start, AFTER * _batch(spec["B"])))


def test_another_models_checkpoint_is_refused_alike_on_every_rank_before_loading(results):
    messages = {r["another_model"]["message"] for r in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "holds another model's optimizer state" in message
    assert "0.linear.weight of shape [8, 8] then, [4, 4] now" in message
    assert all(r["another_model"]["unchanged"] for r in results)
