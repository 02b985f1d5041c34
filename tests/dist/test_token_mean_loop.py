"""The plain DeepSpeed loop with ``poplar.loss_reduction: token_mean`` (tiny GPT-2, padded sequences).

3 forked ranks, an uneven plan at ZeRO stages 0-3, SGD (whose step, unlike Adam's,
shows any error in the loss's scale) and gradient clipping: the parameters equal one
process training the global batches' token mean, so each micro-batch's tokens were
weighted against the whole iteration's, agreed across ranks.
"""

from __future__ import annotations

import os

import pytest
from harness import run_ranks

pytest.importorskip("transformers", reason="a Hugging Face model: pip install 'poplar-ext[hf]'")

import _hf_common as hf
import _training as t

ALLOCATIONS = {
    0: [(3, 2), (1, 3), (3, 1)],
    1: [(3, 2), (1, 3), (3, 1)],
    2: [(3, 2), (1, 2), (2, 2)],
    3: [(3, 2), (1, 2), (2, 2)],
}
TYPES = ["cpu", "cpu-slow", "cpu-slow"]
STAGES = (0, 1, 2, 3)


def _train(files):
    import poplar_ext

    results = {}
    for stage in STAGES:
        model = hf.tiny_gpt2()
        config = t.ds_config(cluster=files["cluster"], plan=files[stage], stage=stage, loss_reduction="token_mean")
        config["gradient_clipping"] = hf.CLIP
        engine, _, loader, _ = poplar_ext.initialize(
            model=model,
            optimizer=hf.make_optimizer("sgd", model.parameters()),
            training_data=hf.RecordingVarLen(),
            collate_fn=hf.collate,
            config=config,
        )
        done, totals = 0, []
        while done < hf.STEPS:
            for batch in loader:
                if engine.deepspeed_engine.micro_steps % engine.gradient_accumulation_steps() == 0:
                    totals.append(engine.iteration_tokens)
                output = engine(**{k: v.to(engine.device) for k, v in batch.items()})
                engine.backward(output.loss)
                boundary = engine.is_gradient_accumulation_boundary()
                engine.step()
                done += boundary
                if done == hf.STEPS:
                    break
        params = hf.full_parameters(engine.deepspeed_engine)
        if int(os.environ["RANK"]) == 0:
            results[stage] = {"params": params, "totals": totals}
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("token_mean")
    files = t.write_stage_files(tmp, ALLOCATIONS, device_types=TYPES)
    return run_ranks(_train, world_size=3, tmp_path=tmp, args=(files,), timeout_s=300)[0]


def _shifted_tokens(step: int, global_batch: int) -> int:
    data = hf.RecordingVarLen()
    indices = t.SampleStream(num_samples=len(data), seed=0).indices(step * global_batch, global_batch)
    return sum(len(data.items[i]) - 1 for i in indices)  # a causal LM predicts every token but the first


@pytest.mark.parametrize("stage", STAGES)
def test_parameters_equal_one_process_on_the_global_token_mean(results, stage):
    expected = hf.reference_parameters(12, hf.STEPS, optimizer="sgd")
    assert t.max_difference(results[stage]["params"], expected) <= 1e-5


@pytest.mark.parametrize("stage", STAGES)
def test_the_iteration_s_tokens_are_counted_as_the_loss_counts_them(results, stage):
    assert results[stage]["totals"] == [_shifted_tokens(step, 12) for step in range(hf.STEPS)]
