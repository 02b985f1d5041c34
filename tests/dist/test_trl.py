"""PoplarSFTTrainer, PoplarDPOTrainer and PoplarRewardTrainer (TRL) under uneven plans, on forked ranks.

3 ranks (one real CPU type, two emulated), a tiny Llama from its config and a word-level
tokenizer made here (nothing downloaded). Each case trains 3 optimizer steps of a global
batch of 12 and must equal one process training the same global batches with the plain
TRL trainer (fp32, 1e-5), every sample (or packed row) trained once:

* SFT with the completion-only loss (token mean over the completion tokens) at ZeRO 0
  (per-rank accumulation counts);
* SFT with packing (``wrapped``: rows of ``max_length`` tokens) at ZeRO 3;
* DPO with its reference model (sigmoid loss, a mean over pairs) at ZeRO 1 (per-rank
  accumulation counts) and 3 (the reference model partitioned too);
* DPO with the reference log-probs precomputed at construction at ZeRO 1 (TRL batches
  them alike on every rank, whatever each rank's micro-batch);
* a reward model (a sequence classifier, a mean over pairs) at ZeRO 0.

(ZeRO 2 is the custom subclass's, tests/dist/test_trainer_mixin.py.)

One rank group runs every case (a Trainer per case), to keep the suite fast.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from harness import run_ranks

pytest.importorskip("trl", reason="the TRL tests need pip install 'poplar-ext[trl]'")

import _hf_common as hf  # noqa: E402
import _training as t  # noqa: E402

TYPES = ["cpu", "cpu-slow", "cpu-slow"]
GLOBAL_BATCH = 12
STEPS = 3
ALLOCATIONS = {
    0: [(3, 2), (1, 3), (3, 1)],
    1: [(2, 3), (1, 2), (4, 1)],
    2: [(3, 2), (1, 2), (2, 2)],
    3: [(3, 2), (1, 2), (2, 2)],
}
# (name, trainer, ZeRO stage, config fields): each stage once, per-rank accumulation counts at 0 and 1
CASES = [
    ("sft-completion-0", "sft", 0, {"completion_only_loss": True}),
    (
        "sft-packing-3",
        "sft",
        3,
        {"completion_only_loss": False, "packing": True, "packing_strategy": "wrapped", "max_length": 8},
    ),
    ("dpo-1", "dpo", 1, {}),
    ("dpo-3", "dpo", 3, {}),
    ("dpo-precompute-1", "dpo", 1, {"precompute_ref_log_probs": True}),
    ("reward-0", "reward", 0, {}),
]
WORDS = 62  # the vocabulary: <pad>, <eos> and w0..w61 (64 embeddings)


def tokenizer():
    """A word-level tokenizer over w0..w61, built here."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(f"w{rng.randrange(WORDS)}" for _ in range(rng.randint(low, high)))


def dataset(kind: str):
    """50 prompt-completion examples (SFT) or prompt-chosen-rejected pairs (DPO, reward), seeded."""
    from datasets import Dataset

    rng = random.Random(0)
    rows = []
    for _ in range(hf.NUM_SAMPLES):
        row = {"prompt": _words(rng, 2, 6), "completion": " " + _words(rng, 1, 5)}
        if kind in ("dpo", "reward"):
            row = {"prompt": row["prompt"], "chosen": row["completion"], "rejected": " " + _words(rng, 1, 5)}
        rows.append(row)
    return Dataset.from_list(rows)


def _config_class(kind: str):
    from trl import DPOConfig, RewardConfig, SFTConfig

    return {"sft": SFTConfig, "dpo": DPOConfig, "reward": RewardConfig}[kind]


# Plain SGD, no clipping: a loss off by a uniform factor (a token count off by one per
# row) changes the step, where AdamW and clipping would hide it.
OPTIMIZATION = dict(optim="sgd", learning_rate=0.5, weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant")


def _arguments(kind: str, fields: dict, **extra):
    return _config_class(kind)(
        use_cpu=True,
        max_steps=STEPS,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        dataloader_num_workers=0,
        bf16=False,
        gradient_checkpointing=False,
        **OPTIMIZATION,
        **fields,
        **extra,
    )


def tiny_llama(head: str = "causal"):
    """A Llama from its config, seeded alike everywhere. Not GPT-2: transformers 5 gives
    GPT-2 no loss_type, so a plain Trainer counts its label tokens unshifted (one per
    sequence too many) and the plain TRL trainer would not train the true token mean.
    `head` "reward": a sequence classifier of one score (a reward model)."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=WORDS + 2,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
        num_labels=1,
    )
    return (LlamaForSequenceClassification if head == "reward" else LlamaForCausalLM)(config)


def _build(trainer_class, kind: str, args, data=None):
    model = tiny_llama(kind)
    data = dataset(kind) if data is None else data
    common = dict(model=model, args=args, train_dataset=data, eval_dataset=data, processing_class=tokenizer())
    if kind == "dpo":
        common["ref_model"] = tiny_llama()
    return trainer_class(**common)


def _reset_accelerate() -> None:
    """Each Trainer its own accelerate state (a forked rank inherits the parent's singletons)."""
    import datasets
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    datasets.disable_progress_bars()  # this test's processes only


def _train_cases(configs: dict[int, str], out: str, saved_dpo: str) -> dict:
    """`saved_dpo`: the DPO set saved to disk: TRL writes precomputed reference log-probs to the set's cache file,
    which every rank reads (an in-memory set's is in a temporary folder of each process's own)."""
    import datasets

    from poplar_ext.integrations.trl import PoplarDPOTrainer, PoplarRewardTrainer, PoplarSFTTrainer

    trainers = {"sft": PoplarSFTTrainer, "dpo": PoplarDPOTrainer, "reward": PoplarRewardTrainer}
    results = {}
    for name, kind, stage, fields in CASES:
        _reset_accelerate()
        seen: list[list[int]] = []

        class Recording(trainers[kind]):
            def get_train_dataloader(self):
                loader = super().get_train_dataloader()
                # the class is built and used within this iteration: `seen` is the iteration's own
                loader.batch_sampler.batch_sampler = t.RecordingSampler(loader.batch_sampler.batch_sampler, seen)  # noqa: B023
                return loader

        args = _arguments(
            kind,
            fields,
            output_dir=f"{out}/{name}",
            deepspeed=configs[stage],
            ddp_backend="gloo",
            per_device_train_batch_size=4,
            per_device_eval_batch_size=2,
        )
        data = datasets.load_from_disk(saved_dpo) if fields.get("precompute_ref_log_probs") else None
        trainer = _build(Recording, kind, args, data)
        trainer.train()
        evaluated = trainer.evaluate()  # rounds of batches of 2 x each rank's plan micro-batch over the smallest
        # The loader reads ahead: the iterations trained are the first STEPS (an item per optimizer step).
        trained = seen[:STEPS]
        results[name] = {
            "params": hf.full_parameters(trainer.model_wrapped),
            "rows": len(trainer.train_dataset),
            "eval_loss": evaluated["eval_loss"],
            "seen": [i for iteration in trained for batch in iteration for i in batch],
            "logged_num_tokens": _logged(trainer, "num_tokens"),
            "ref_chosen_logps": _precomputed(trainer),
        }
    return results


def _logged(trainer, key: str) -> list[float]:
    """Each training log's `key` (TRL's metrics, as the Trainer logged them), in step order."""
    return [entry[key] for entry in trainer.state.log_history if key in entry and "eval_loss" not in entry]


def _precomputed(trainer) -> list[float] | None:
    """The reference log-probs of the chosen completions TRL precomputed, row by row (None: none were)."""
    columns = getattr(trainer.train_dataset, "column_names", None) or []
    return list(trainer.train_dataset["ref_chosen_logps"]) if "ref_chosen_logps" in columns else None


_Reference = tuple[dict[str, torch.Tensor], int, float, list[float], list[float] | None]
_references: dict[str, _Reference] = {}


def _reference(kind: str, fields: dict, out: Path) -> _Reference:
    """`_train_reference`, once per trainer and configuration (the DPO cases share theirs)."""
    key = json.dumps([kind, fields], sort_keys=True)
    if key not in _references:
        _references[key] = _train_reference(kind, fields, out)
    return _references[key]


def _train_reference(kind: str, fields: dict, out: Path) -> _Reference:
    """One process, the plain TRL trainer, the stream's global batches in order; then its evaluation of
    the whole data set in one batch (the loss TRL computes over all of it)."""
    from trl import DPOTrainer, RewardTrainer, SFTTrainer

    from poplar_ext.runtime.data import SampleStream

    base = {"sft": SFTTrainer, "dpo": DPOTrainer, "reward": RewardTrainer}[kind]

    class InStreamOrder(base):
        def _get_train_sampler(self, train_dataset=None):
            stream = SampleStream(num_samples=len(self.train_dataset), seed=0)
            return stream.indices(0, STEPS * GLOBAL_BATCH)

    _reset_accelerate()
    try:
        args = _arguments(
            kind, fields, output_dir=str(out), per_device_train_batch_size=GLOBAL_BATCH, per_device_eval_batch_size=1000
        )
        trainer = _build(InStreamOrder, kind, args)
        precomputed = _precomputed(trainer)
        trainer.train()
        params = {name: p.detach().float().clone() for name, p in trainer.model.named_parameters()}
        logged_tokens = _logged(trainer, "num_tokens")
        return params, len(trainer.train_dataset), trainer.evaluate()["eval_loss"], logged_tokens, precomputed
    finally:
        _reset_accelerate()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl")
    dataset("dpo").save_to_disk(str(root / "dpo-data"))
    ranks = run_ranks(
        _train_cases,
        world_size=3,
        tmp_path=root,
        args=(hf.trainer_configs(root, ALLOCATIONS, TYPES), str(root / "out"), str(root / "dpo-data")),
        timeout_s=400,
    )
    return root, ranks


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_parameters_equal_the_plain_trl_trainer_on_one_process(trained, case):
    root, ranks = trained
    name, kind, _, fields = case
    expected, rows, _, _, _ = _reference(kind, fields, root / f"reference-{name}")
    assert ranks[0][name]["rows"] == rows
    assert t.max_difference(ranks[0][name]["params"], expected) <= 1e-5


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_sample_once(trained, case):
    _, ranks = trained
    name = case[0]
    seen = [i for rank in ranks for i in rank[name]["seen"]]
    stream = t.SampleStream(num_samples=ranks[0][name]["rows"], seed=0)
    assert sorted(seen) == sorted(stream.indices(0, STEPS * GLOBAL_BATCH))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_evaluate_equals_the_plain_trl_trainer_on_the_whole_set(trained, case):
    # Each rank's batches differ in size (and TRL gathers metrics in compute_loss): every sample
    # once, the loss the exact mean over the whole set, as one process computes it in one batch.
    root, ranks = trained
    name, kind, _, fields = case
    _, _, expected, _, _ = _reference(kind, fields, root / f"reference-{name}")
    assert ranks[0][name]["eval_loss"] == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("case", [c for c in CASES if c[1] == "sft"], ids=[c[0] for c in CASES if c[1] == "sft"])
def test_the_logged_token_count_is_the_jobs_not_rank_0s(trained, case):
    root, ranks = trained
    name, kind, _, fields = case
    _, _, _, expected, _ = _reference(kind, fields, root / f"reference-{name}")
    assert len(expected) == STEPS and ranks[0][name]["logged_num_tokens"] == expected


def test_precomputed_reference_log_probs_equal_the_plain_trl_trainers(trained):
    # TRL precomputes them at construction, each batch split over the ranks and gathered: in batches of one size on
    # every rank (each rank's own micro-batch would make the gathers differ), every row as one process computes it.
    root, ranks = trained
    name, kind, _, fields = next(c for c in CASES if c[3].get("precompute_ref_log_probs"))
    expected = _reference(kind, fields, root / f"reference-{name}")[4]
    assert expected is not None and len(expected) == ranks[0][name]["rows"]
    assert all(rank[name]["ref_chosen_logps"] == ranks[0][name]["ref_chosen_logps"] for rank in ranks)
    assert ranks[0][name]["ref_chosen_logps"] == pytest.approx(expected, abs=1e-4)
