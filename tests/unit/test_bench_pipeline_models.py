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
