"""Shared pieces of the Hugging Face tests: a tiny GPT-2, variable-length data, a reference run."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from poplar_ext.runtime.data import SampleStream

STEPS = 3
NUM_SAMPLES = 50
VOCAB = 64
MAX_LENGTH = 16
CLIP = 0.5
# Constant learning rate (the reference needs no schedule); eps well above the default
# because GPT-2's attention key biases get gradients of pure rounding noise (see
# tests/dist/_training.py), which Adam with eps=1e-8 turns into lr-sized steps.
OPTIMIZATION = dict(
    learning_rate=1e-3, weight_decay=0.0, adam_epsilon=1e-4, max_grad_norm=CLIP, lr_scheduler_type="constant"
)


def tiny_gpt2():
    """GPT-2 from its config, random weights seeded alike on every rank; no dropout (the reference must match).
    Also a Trainer's ``model_init`` (no arguments)."""
    return gpt2(width=32)


def gpt2(*, width: int):
    """`tiny_gpt2` with `width` (its hidden size)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=width,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


class RecordingVarLen(torch.utils.data.Dataset):
    """Token sequences of lengths 4..16 (seeded, distinct); remembers which indices were read."""

    def __init__(self, num_samples: int = NUM_SAMPLES) -> None:
        generator = torch.Generator().manual_seed(0)
        self.items = []
        for _ in range(num_samples):
            length = int(torch.randint(4, MAX_LENGTH + 1, (1,), generator=generator))
            self.items.append(torch.randint(0, VOCAB, (length,), generator=generator).tolist())
        self.seen: list[int] = []

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        self.seen.append(int(index))
        return {"input_ids": self.items[index]}


def collate(items: list[dict]) -> dict:
    """Right padding to the micro-batch's longest sequence; padded labels are -100."""
    longest = max(len(item["input_ids"]) for item in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    mask = torch.zeros(len(items), longest, dtype=torch.long)
    labels = torch.full((len(items), longest), -100, dtype=torch.long)
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        ids[row, :n] = torch.tensor(item["input_ids"])
        mask[row, :n] = 1
        labels[row, :n] = ids[row, :n]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def full_parameters(engine) -> dict[str, torch.Tensor]:
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=engine.zero_optimization_stage() == 3):
        return {name: p.detach().float().cpu().clone() for name, p in params.items()}


def make_optimizer(name: str, params):
    if name == "sgd":  # scale-sensitive: a wrong token count changes the step
        return torch.optim.SGD(params, lr=0.5)
    return torch.optim.AdamW(
        params, lr=OPTIMIZATION["learning_rate"], eps=OPTIMIZATION["adam_epsilon"], weight_decay=0.0
    )


def reference_parameters(
    global_batch: int,
    steps: int,
    optimizer: str = "adamw",
    *,
    schedule_warmup_steps: int | None = None,
    drop_last: bool = False,
) -> dict[str, torch.Tensor]:
    """One process, no DeepSpeed: each whole global batch's token mean, clipped; the learning rate
    constant, or with `schedule_warmup_steps` the Trainer's linear schedule over `steps`. With `drop_last`
    each epoch's global batches start at its beginning and its tail is left out (``poplar.drop_last``)."""
    model = tiny_gpt2()
    data = RecordingVarLen()
    optimizer = make_optimizer(optimizer, model.parameters())
    schedule = None
    if schedule_warmup_steps is not None:
        from transformers import get_linear_schedule_with_warmup

        schedule = get_linear_schedule_with_warmup(optimizer, schedule_warmup_steps, steps)
    stream = SampleStream(num_samples=len(data), seed=0)
    per_epoch = len(data) // global_batch
    for step in range(steps):
        start = step * global_batch
        if drop_last:
            start = (step // per_epoch) * len(data) + (step % per_epoch) * global_batch
        batch = collate([data[i] for i in stream.indices(start, global_batch)])
        optimizer.zero_grad()
        model(**batch).loss.backward()  # the mean over the global batch's shifted label tokens
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        if schedule is not None:
            schedule.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def reference_first_loss(global_batch: int) -> float:
    """The token-mean loss of the untrained model on the first global batch."""
    model = tiny_gpt2()
    data = RecordingVarLen()
    batch = collate([data[i] for i in SampleStream(num_samples=len(data), seed=0).indices(0, global_batch)])
    with torch.no_grad():
        return float(model(**batch).loss)


def trainer_ds_config(stage: int, **poplar) -> dict:
    """A DeepSpeed config for the Trainer: Hugging Face's "auto" batch values (poplar fills them per
    rank from the plan), ZeRO `stage`, and a poplar section of `poplar` (no periodic logging)."""
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10_000,
        "poplar": {"log_interval_steps": 0, **poplar},
    }


def trainer_configs(root: Path, allocations: dict[int, list[tuple[int, int]]], types: list[str]) -> dict[int, str]:
    """A DeepSpeed config per ZeRO stage with Hugging Face's "auto" batch values and a poplar
    section naming a plan of `allocations[stage]` ((micro-batch, accumulation) per rank)."""
    import _training as t

    cluster = t.write_cluster(root / "cluster.json", fast=1, slow=len(types) - 1, slowdown=1.0)
    paths = {}
    for stage, allocation in allocations.items():
        plan = t.write_plan(root / f"plan{stage}.json", allocation, stage=stage, device_types=types)
        config = trainer_ds_config(stage, cluster=str(cluster), plan=str(plan))
        (root / f"ds{stage}.json").write_text(json.dumps(config))
        paths[stage] = str(root / f"ds{stage}.json")
    return paths


def train_in_one_process(model, optimizer, data, *, global_batch: int, steps: int, clip: float):
    """One process, no DeepSpeed, on `data`'s ``input_ids`` and ``labels`` (`PaddedTokens`): the model's
    own loss (the token mean) on each whole global batch of the shared stream, the global norm clipped.
    Returns the losses and the norms before clipping."""
    stream = SampleStream(num_samples=len(data), seed=0)
    losses, norms = [], []
    for step in range(steps):
        indices = stream.indices(step * global_batch, global_batch)
        optimizer.zero_grad()
        loss = model(input_ids=data.input_ids[indices], labels=data.labels[indices]).loss
        loss.backward()
        losses.append(float(loss.detach()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
    return losses, norms
