"""Train a GPT-2-shaped model from its config in pipelines whose plan is searched at start.

    torchrun --nproc_per_node 4 examples/pipeline_gpt.py --deepspeed_config examples/ds_config_pipeline_gpt.json

The model is Hugging Face's GPT2LMHeadModel built from a config (random weights, nothing is
downloaded), turned into pipeline layers by `causal_lm_layers` (its head tied to its
embedding); the data is padded random tokens. The config names no plan: rank 0 searches one
from the layer profiles in ``profiles/layers/`` (measured first, on the first start, with the
config's optimizer) for the cluster of examples/cluster_pipeline.json (2 CPU ranks, 2
emulated twice as slow), and every rank trains it. The loss is the model's own: the mean
over the global batch's label tokens (``poplar.loss_reduction: token_mean``).
"""

from __future__ import annotations

import argparse
import json
import logging

import deepspeed
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import poplar_ext
from poplar_ext.models.hugging_face import PaddedTokens
from poplar_ext.pipeline import PoplarPipelineModule, causal_lm_layers

VOCAB_SIZE, SEQUENCE_LENGTH = 256, 32


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--local_rank",
        type=int,
        default=-1,
        help="set by the deepspeed launcher (--local_rank=N); torchrun sets LOCAL_RANK instead",
    )
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to train")
    parser.add_argument("--num-samples", type=int, default=400, help="size of the synthetic data set")
    parser.add_argument("--layers", type=int, default=4, help="GPT-2 blocks")
    parser.add_argument("--result", help="rank 0 writes a JSON summary of the run here")
    deepspeed.add_config_arguments(parser)
    return parser


def gpt2(num_layers: int) -> GPT2LMHeadModel:
    """A small GPT-2 from its config, the same random weights on every rank (seeded); no dropout, so that
    a run can be compared with one process training the model (tests/dist/test_pipeline_gpt_example.py)."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=num_layers, n_head=4, n_embd=64, vocab_size=VOCAB_SIZE, n_positions=SEQUENCE_LENGTH,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    for name in ("steps", "num_samples", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer, found {getattr(args, name)}")
    # poplar_ext logs each rank's place in the plan and the true samples/s at INFO; the script decides where.
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] [%(name)s] %(message)s")
    pipe = causal_lm_layers(gpt2(args.layers))
    data = PaddedTokens(num_samples=args.num_samples, vocab_size=VOCAB_SIZE, length=SEQUENCE_LENGTH)
    # Collective: the plan is searched (its missing layer profiles measured with `data`), this rank's stage built.
    model = PoplarPipelineModule(pipe.layers, loss_fn=pipe.loss_fn, args=args, training_data=data)
    engine, _, _, _ = poplar_ext.initialize(args=args, model=model, training_data=data)  # the config's optimizer
    losses = [float(engine.train_batch()) for _ in range(args.steps)]  # the global batch's token mean
    if engine.global_rank == 0 and args.result:
        plan = engine.plan
        summary = {
            "steps": engine.global_steps,
            "global_batch_size": engine.train_batch_size(),
            "pipelines": [[(s.first_layer, s.last_layer) for s in p.stages] for p in plan.pipelines],
            "micro_batches": [(p.micro_batch_size, p.num_micro_batches) for p in plan.pipelines],
            "losses": losses,
        }
        with open(args.result, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
