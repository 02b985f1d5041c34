"""`poplar-bench pipeline --model`: each model's ZeRO form and pipeline form are one model (same loss on the
same samples), so the bench compares the two parallelisms on the same work."""

from __future__ import annotations

import pytest
import torch

from poplar_bench import pipeline_compare
from poplar_bench.pipeline_compare import BENCH_MODELS


def _pipeline_loss(model, batch) -> torch.Tensor:
    """The layers run in order as one stage holding them all runs them (a tied module built once; layer i
    seeded as DeepSpeed's ``seed_layers`` seeds it)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    from deepspeed.runtime.utils import set_random_seed

    layers, loss_fn = model.pipeline()
    inputs, labels = (batch["input_ids"], batch["labels"]) if isinstance(batch, dict) else batch
    built, hidden = {}, inputs
    for index, layer in enumerate(layers):
        if isinstance(layer, TiedLayerSpec):
            module = built.setdefault(layer.key, layer.build())
            hidden = module(hidden) if layer.forward_fn is None else layer.forward_fn(module, hidden)
            continue
        if isinstance(layer, LayerSpec):
            set_random_seed(1234 + index)
            layer = layer.build()
        hidden = layer(hidden)
    return loss_fn(hidden, labels)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_the_zero_model_and_the_pipeline_layers_give_one_loss(name):
    if name == "gpt":
        pytest.importorskip("transformers")
    model = BENCH_MODELS[name]
    batch = model.make_batch(3)
    torch.manual_seed(0)
    zero = model.zero_model()
    zero_loss = zero(**batch) if isinstance(batch, dict) else zero(*batch)
    torch.manual_seed(0)
    assert float(_pipeline_loss(model, batch)) == pytest.approx(float(zero_loss), rel=1e-5)
    assert len(model.pipeline_data(5)) == len(model.zero_data(5)) == 5


def test_an_unknown_model_is_refused_naming_the_choices(tmp_path):
    with pytest.raises(ValueError, match="model: expected one of mlp, gpt, found 'bert'"):
        pipeline_compare.run_pipeline_bench(out_dir=tmp_path, model="bert")


def _run(measured_zero: float, measured_pipeline: float, pipeline_plan: str = "P") -> dict:
    return {
        "link": "fast",
        "bandwidth_bytes_per_s": None,
        "run_s": 10.0,
        "zero": {"plan": "Z", "measured_iteration_s": measured_zero, "predicted_iteration_s": 1.0},
        "pipeline": {"plan": pipeline_plan, "measured_iteration_s": measured_pipeline, "predicted_iteration_s": 2.0},
    }


def test_repetitions_give_each_kind_its_median_every_run_and_any_other_plan():
    row = pipeline_compare.combined_row([_run(1.3, 2.0), _run(1.1, 2.6, "Q"), _run(1.2, 2.2)])
    assert row["run_s"] == 30.0 and row["link"] == "fast"
    assert row["zero"]["measured_iteration_s"] == 1.2 and row["zero"]["measured_runs_s"] == [1.3, 1.1, 1.2]
    assert row["pipeline"]["measured_iteration_s"] == 2.2 and row["pipeline"]["other_plans"] == ["Q"]
    assert row["zero"]["other_plans"] == [] and row["zero"]["predicted_iteration_s"] == 1.0
    report = {"date": "d", "cluster": "c", "model": "m", "link_emulation": "l", "machine": {}, "repetitions": 3}
    text = pipeline_compare.render_markdown({**report, "rows": [row]})
    assert "| fast (uncapped) | pipeline | P; another run: Q | 2.200 | 2.000 | 1.10 | 1.00, 1.30, 1.10 |" in text


def test_each_run_is_compared_with_its_own_plans_prediction():
    other = _run(1.1, 3.0, "Q")
    other["pipeline"]["predicted_iteration_s"] = 3.0  # another plan, another prediction
    row = pipeline_compare.combined_row([_run(1.3, 2.0), other, _run(1.2, 2.2)])
    report = {"date": "d", "cluster": "c", "model": "m", "link_emulation": "l", "machine": {}, "repetitions": 3}
    text = pipeline_compare.render_markdown({**report, "rows": [row]})
    assert "| 1.00, 1.00, 1.10 |" in text


def test_the_rows_ratio_is_the_median_of_each_runs_against_its_own_plan():
    # The row's measured/predicted was the median time over the runs over the first run's prediction: with one run
    # of another, slower plan (3.0 s predicted, 3.0 measured) every run ran at its prediction, yet the row read 1.10.
    first = _run(1.0, 2.0)
    other = _run(1.0, 3.0, "Q")
    other["pipeline"]["predicted_iteration_s"] = 3.0
    last = _run(1.0, 3.0, "Q")
    last["pipeline"]["predicted_iteration_s"] = 3.0
    row = pipeline_compare.combined_row([first, other, last])
    report = {"date": "d", "cluster": "c", "model": "m", "link_emulation": "l", "machine": {}, "repetitions": 3}
    text = pipeline_compare.render_markdown({**report, "rows": [row]})
    assert "| fast (uncapped) | pipeline | P; another run: Q | 3.000 | 2.000 | 1.00 | 1.00, 1.00, 1.00 |" in text
    assert "measured/predicted: the median of each run's, against the prediction of the plan that run searched" in text


def test_fewer_than_one_repetition_is_refused(tmp_path):
    with pytest.raises(ValueError, match="repetitions: expected at least 1, found 0"):
        pipeline_compare.run_pipeline_bench(out_dir=tmp_path, repetitions=0)


def test_the_report_names_the_cores_of_the_machine_it_ran_on():
    row = pipeline_compare.combined_row([_run(1.3, 2.0)])
    report = {"date": "d", "cluster": "c", "model": "m", "link_emulation": "l", "rows": [row]}
    text = pipeline_compare.render_markdown({**report, "machine": {"usable_cpus": 16, "load_average": [1.0] * 3}})
    assert "Load average of the 16-core machine at the end" in text and "2-core" not in text
    assert "Load average of the machine at the end" in pipeline_compare.render_markdown({**report, "machine": {}})
