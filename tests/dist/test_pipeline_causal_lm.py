"""Hugging Face causal LMs in pipelines train exactly as one process training the model (issue 34).

4 forked ranks (two of an emulated type), `causal_lm_layers` of a tiny GPT-2 (its head tied to
its embedding) and a tiny Llama (untied), ``poplar.loss_reduction: token_mean``, padded
sequences (labels ``-100``), gradient clipping on: after 3 steps every parameter equals one
process training the Hugging Face model on the same global batches with its own loss (the
mean over the global batch's label tokens). The plans put the tied embedding and head on
different stages in pipelines of different splits, and (three_and_one) on one rank of a
one-stage pipeline beside a three-stage one: the tied gradient is the sum over every stage
using it, in every pipeline. A checkpoint resumed sets every copy of the tied module again.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks

pytest.importorskip("transformers", reason="a Hugging Face model: pip install 'poplar-ext[hf]'")

import _hf_common as hf  # noqa: E402
import _training as t  # noqa: E402
from test_pipeline import write_pipeline_plan  # noqa: E402  (the pipeline tests' plan writer)

from poplar_ext.models.hugging_face import PaddedTokens  # noqa: E402

STEPS = 3
NUM_SAMPLES = 25
VOCAB = 96
LENGTH = 12
CLIP = 0.5
TYPES = ["cpu", "cpu", "cpu-slow", "cpu-slow"]
# Per pipeline: (rank, first layer, last layer) per stage, micro-batch size, micro-batches. 6 layers:
# GPT-2: tied embedding, positions, 2 blocks, final norm, tied head; Llama: embedding, 3 blocks, norm, head.
PLANS = {
    "two_by_two": [([(0, 0, 1), (1, 2, 5)], 2, 4), ([(2, 0, 3), (3, 4, 5)], 3, 2)],  # B = 14
    "three_and_one": [([(0, 0, 0), (1, 1, 2), (2, 3, 5)], 2, 4), ([(3, 0, 5)], 3, 1)],  # B = 11
}
CASES = [("gpt2", "two_by_two", 0), ("gpt2", "three_and_one", 1), ("llama", "two_by_two", 1)]
RESUMED = ("gpt2", "two_by_two", 0)  # the head's stage holds the tied embedding through forward_fn only


def _model(family: str):
    """Random weights seeded alike on every rank and in the reference; no dropout."""
    import transformers

    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=LENGTH, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    else:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config)


def _data():
    return PaddedTokens(num_samples=NUM_SAMPLES, vocab_size=VOCAB, length=LENGTH)


def _config(files, family, plan, stage):
    return {
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
        "poplar": {
            "cluster": str(files["cluster"]),
            "plan": str(files[(plan, stage)]),
            "loss_reduction": "token_mean",
            "log_interval_steps": 0,
        },
    }


def _engine(files, family, plan, stage):
    import poplar_ext
    from poplar_ext.pipeline import PoplarPipelineModule, causal_lm_layers

    model = _model(family)
    pipe = causal_lm_layers(model)
    config = _config(files, family, plan, stage)
    module = PoplarPipelineModule(pipe.layers, loss_fn=pipe.loss_fn, config=config)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    engine, _, _, _ = poplar_ext.initialize(model=module, optimizer=optimizer, training_data=_data(), config=config)
    return engine, model


def _parameters(engine, model):
    """The stage's parameters, the model's own modules' (wrapped, not copied): named as the model names them."""
    held = {id(p) for p in engine.module.parameters()}
    return {name: p.detach().clone() for name, p in model.named_parameters() if id(p) in held}


def _train(files, family, plan, stage):
    engine, model = _engine(files, family, plan, stage)
    losses = [float(engine.train_batch()) for _ in range(STEPS)]
    return {"params": _parameters(engine, model), "losses": losses}


def _resume(files):
    """Save after 2 steps, train a third; a new engine of a new model loads the checkpoint and trains it again."""
    engine, model = _engine(files, *RESUMED)
    for _ in range(STEPS - 1):
        engine.train_batch()
    engine.save_checkpoint(files["checkpoints"])
    engine.train_batch()
    uninterrupted = _parameters(engine, model)
    engine, model = _engine(files, *RESUMED)
    engine.load_checkpoint(files["checkpoints"])
    engine.train_batch()
    return {"uninterrupted": uninterrupted, "resumed": _parameters(engine, model)}


def _all_cases(files):
    return {**{case: _train(files, *case) for case in CASES}, "resume": _resume(files)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline_causal_lm")
    files = {"cluster": t.write_cluster(tmp / "cluster.json", fast=2, slow=2), "checkpoints": tmp / "checkpoints"}
    for _, plan, stage in CASES:
        files[(plan, stage)] = write_pipeline_plan(tmp / f"{plan}{stage}.json", PLANS[plan], stage=stage, types=TYPES)
    return run_ranks(_all_cases, world_size=4, tmp_path=tmp, args=(files,), init_process_group=False, timeout_s=300)


def _reference(family: str, global_batch: int):
    """One process: the Hugging Face model's own loss on each whole global batch (its token mean),
    the global norm clipped, the same SGD."""
    model = _model(family)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, norms = hf.train_in_one_process(
        model, optimizer, _data(), global_batch=global_batch, steps=STEPS, clip=CLIP
    )
    return {name: p.detach().clone() for name, p in model.named_parameters()}, losses, norms


@pytest.mark.parametrize("family,plan,stage", CASES)
def test_a_causal_lm_in_pipelines_matches_the_model_trained_in_one_process(results, family, plan, stage):
    global_batch = sum(b * s for _, b, s in PLANS[plan])
    expected, losses, norms = _reference(family, global_batch)
    assert min(norms) > CLIP, "clipping must be active for this test to cover it"
    runs = [r[(family, plan, stage)] for r in results]
    held = {name for run in runs for name in run["params"]}
    assert held == set(expected), sorted(held ^ set(expected))
    difference = max(
        float((value - expected[name]).abs().max()) for run in runs for name, value in run["params"].items()
    )
    assert difference <= 1e-5
    for run in runs:  # every rank returns the global batch's token mean
        assert run["losses"] == pytest.approx(losses, abs=1e-5)


def test_a_resumed_run_sets_every_copy_of_a_tied_module_as_the_uninterrupted_one(results):
    for rank_result in results:
        uninterrupted, resumed = rank_result["resume"]["uninterrupted"], rank_result["resume"]["resumed"]
        assert uninterrupted.keys() == resumed.keys()
        assert all(torch.equal(resumed[name], value) for name, value in uninterrupted.items()), [
            name for name, value in uninterrupted.items() if not torch.equal(resumed[name], value)
        ]
