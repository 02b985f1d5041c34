"""What PoplarTrainer weights each training micro-batch's loss by, for the gradients of the global batch."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="PoplarTrainer needs pip install 'poplar-ext[hf]'")

import torch  # noqa: E402
from test_trainer_mixin_refusals import _arguments_of_a_settled_job  # noqa: E402  (a one-rank job, no group)

pytestmark = pytest.mark.usefixtures("in_tmp_path")  # the Trainer creates output_dir


def _trainer(monkeypatch, model):
    """A one-rank PoplarTrainer of a plan of 2 micro-batches of 2 (global batch 4), without a process group."""
    from poplar_ext.integrations.transformers import PoplarTrainer

    return PoplarTrainer(model=model, args=_arguments_of_a_settled_job(monkeypatch, {}, {}))


def _bert_classifier():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    return GPT2LMHeadModel(config)


def test_a_model_whose_loss_ignores_num_items_in_batch_is_weighted_by_its_share_of_the_labels(monkeypatch):
    # BertForSequenceClassification's forward takes **kwargs, so the Trainer passes it num_items_in_batch and
    # counts its loss a sum over them; it returns CrossEntropyLoss's mean over its own labels instead. Taken at the
    # Trainer's word (weight 1), each rank's accumulation steps added up their means: the logged loss and the
    # gradients of a 2-rank job (micro-batches 3 x 2 and 2 x 2) were twice one device's on the global batch.
    model = _bert_classifier().train()
    trainer = _trainer(monkeypatch, model)
    batch = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 10]]), "labels": torch.tensor([0, 2])}
    own = model(**batch).loss
    # The global batch's labels over the world size: 4 (this micro-batch's 2 and the next one's).
    weighted = trainer.compute_loss(model, dict(batch), num_items_in_batch=torch.tensor(4.0))
    torch.testing.assert_close(weighted, own * 2 / 4)


def test_a_model_whose_loss_takes_num_items_in_batch_is_left_as_it_normalised_it(monkeypatch):
    model = _gpt2().train()
    trainer = _trainer(monkeypatch, model)
    ids = torch.tensor([[5, 6, 7, 8], [8, 9, 10, 11]])
    batch = {"input_ids": ids, "labels": ids}
    normalised = model(**batch, num_items_in_batch=torch.tensor(12.0)).loss  # its token sum over 12
    weighted = trainer.compute_loss(model, dict(batch), num_items_in_batch=torch.tensor(12.0))
    torch.testing.assert_close(weighted, normalised)


class _Inner(torch.nn.Module):
    def forward(self, input_ids=None, labels=None, **kwargs):
        return labels


class _Delegating(torch.nn.Module):
    """A transformers-like model handing its labels and loss kwargs on (as BLIP's and Kosmos-2's forward do)."""

    def __init__(self):
        super().__init__()
        self.text_decoder = _Inner()

    def forward(self, input_ids=None, labels=None, **kwargs):
        return self.text_decoder(input_ids=input_ids, labels=labels, **kwargs)


class _OwnMean(torch.nn.Module):
    """A transformers-like model taking **kwargs whose loss is its labels' mean, as BERT's heads."""

    def forward(self, logits=None, labels=None, **kwargs):
        return torch.nn.functional.cross_entropy(logits, labels)


@pytest.mark.parametrize(("model_class", "ignores"), [(_Delegating, False), (_OwnMean, True)])
def test_a_forward_handing_its_labels_and_kwargs_on_is_taken_at_the_trainers_word(monkeypatch, model_class, ignores):
    # The inner module gets num_items_in_batch and may normalise by it: weighting its loss again would divide twice.
    from poplar_ext.integrations.transformers import _model_loss_ignores

    monkeypatch.setattr(model_class.forward, "__module__", "transformers.models.fake.modeling_fake")
    assert _model_loss_ignores(model_class()) is ignores


def _llama_classifier(**config):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        pad_token_id=0,
        **config,
    )
    return LlamaForSequenceClassification(config)


@pytest.mark.parametrize(
    ("config", "labels"),
    [({"num_labels": 3}, [[0, 2], [1, 1]]), ({"num_labels": 1}, [[0.5, -1.0], [2.0, 1.5]])],
    ids=["single-label", "regression"],
)
def test_a_forward_calling_loss_function_without_its_kwargs_is_weighted_by_its_share_of_the_labels(
    monkeypatch, config, labels
):
    # transformers 5.24's GenericForSequenceClassification (Llama's, Mistral's, Qwen's ... classifiers) calls
    # self.loss_function(logits=..., labels=..., pooled_logits=..., config=...) without **kwargs: the loss never
    # sees num_items_in_batch and is its micro-batch's mean. Taken at the Trainer's word, 2 accumulation steps gave
    # twice the global batch's loss (single-label: 2.1591 where one device has 1.0795).
    model = _llama_classifier(**config).train()
    trainer = _trainer(monkeypatch, model)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16]])
    batches = [{"input_ids": ids[2 * i : 2 * i + 2], "labels": torch.tensor(labels[i])} for i in range(2)]
    weighted = sum(trainer.compute_loss(model, dict(b), num_items_in_batch=torch.tensor(4.0)) for b in batches)
    whole = model(input_ids=ids, labels=torch.tensor(labels[0] + labels[1])).loss  # the global batch's mean
    torch.testing.assert_close(weighted, whole)


class _PeftLike(torch.nn.Module):
    """A stand-in for peft's PeftModel (peft is not installed here): a wrapper whose forward is peft's."""

    def __init__(self, base):
        super().__init__()
        self.base_model = base

    def forward(self, *args, **kwargs):
        return self.base_model(*args, **kwargs)


def test_a_peft_wrapped_model_is_judged_by_its_base_model(monkeypatch):
    # The Trainer decides model_accepts_loss_kwargs on unwrap_peft_model(model); the label-mean rule read the
    # wrapper's forward (peft's, not transformers') and left LoRA on BERT with its micro-batch means summed.
    from poplar_ext.integrations import transformers as integration

    monkeypatch.setattr(_PeftLike.forward, "__module__", "peft.peft_model")
    unwrap = lambda m: m.base_model if isinstance(m, _PeftLike) else m  # noqa: E731
    monkeypatch.setattr(integration, "unwrap_peft_model", unwrap, raising=False)
    model = _PeftLike(_bert_classifier()).train()
    trainer = _trainer(monkeypatch, model)
    batch = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 10]]), "labels": torch.tensor([0, 2])}
    own = model(**batch).loss
    weighted = trainer.compute_loss(model, dict(batch), num_items_in_batch=torch.tensor(4.0))
    torch.testing.assert_close(weighted, own * 2 / 4)


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=32,
        d_model=8,
        d_kv=4,
        d_ff=16,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        dropout_rate=0.0,
        decoder_start_token_id=0,
    )
    return T5ForConditionalGeneration(config)


def _seq2seq_batches() -> tuple[dict, list[dict]]:
    """A global batch of 4 source/target pairs, targets padded with -100, and its 2 micro-batches (each padded to
    its own longest target): the second holds one pair with no target tokens."""
    sources = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16]])
    targets = [[3, 4, 5], [6], [7, 8], []]

    def padded(rows: list[list[int]]) -> torch.Tensor:
        labels = torch.full((len(rows), max(1, *map(len, rows))), -100)
        for row, target in enumerate(rows):
            labels[row, : len(target)] = torch.tensor(target, dtype=torch.long)
        return labels

    whole = {"input_ids": sources, "labels": padded(targets)}
    parts = [{"input_ids": sources[i : i + 2], "labels": padded(targets[i : i + 2])} for i in (0, 2)]
    return whole, parts


def test_a_seq2seq_models_label_mean_over_padded_targets_is_weighted_by_its_share_of_the_tokens(monkeypatch):
    # T5's forward takes **kwargs and returns CrossEntropyLoss's mean over its labels that are not -100: each
    # micro-batch weighted by its share of the global batch's target tokens (6: 4 and 2) sums to the whole mean.
    model = _t5().train()
    trainer = _trainer(monkeypatch, model)
    whole, parts = _seq2seq_batches()
    weighted = sum(trainer.compute_loss(model, dict(b), num_items_in_batch=torch.tensor(6.0)) for b in parts)
    torch.testing.assert_close(weighted, model(**whole).loss)


def test_a_micro_batch_without_label_tokens_adds_nothing_to_a_label_mean_loss(monkeypatch):
    # A micro-batch of a model's own label mean whose labels are all -100 (a pair with an empty target) has the loss
    # 0/0 = NaN; weighted by its share, 0, it stayed NaN: 3 ranks of T5 (micro-batches 3, 1, 2) logged 3.4681 where
    # one device on the global batch has 4.2734 (the Trainer's NaN filter replaced the rank's whole step).
    model = _t5().train()
    trainer = _trainer(monkeypatch, model)
    whole, parts = _seq2seq_batches()
    empty = {"input_ids": parts[1]["input_ids"][1:], "labels": parts[1]["labels"][1:]}
    assert int(empty["labels"].ne(-100).sum()) == 0
    nothing = trainer.compute_loss(model, dict(empty), num_items_in_batch=torch.tensor(6.0))
    assert float(nothing.detach()) == 0.0
    nothing.backward()
    assert all(p.grad is None or not p.grad.isnan().any() for p in model.parameters())
    model.zero_grad()
    pieces = [parts[0], {k: v[:1] for k, v in parts[1].items()}, empty]
    weighted = sum(trainer.compute_loss(model, dict(b), num_items_in_batch=torch.tensor(6.0)) for b in pieces)
    torch.testing.assert_close(weighted, model(**whole).loss)


class _EngineLike(torch.nn.Module):
    """A DeepSpeed engine's modes: its ``train()`` and ``eval()`` set its module's alone (DeepSpeedEngine's), so its own
    ``training`` stays True."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        self.module.train(False)
        return self


def test_an_evaluation_through_an_engine_is_not_weighted_as_training(monkeypatch):
    # evaluate() before train() at ZeRO 3 hands compute_loss DeepSpeed's inference engine, whose `training` stays True
    # after eval(): its losses were weighted as training's (W * b_r / B), and on 2 ranks (micro-batches 3 x 2, 1 x 2)
    # PoplarSFTTrainer's eval_loss was 2.5950 where one process evaluating the set has 4.1702 (DPO 0.4332 for 0.6931,
    # a reward model 0.4337 for 0.6941).
    model = _gpt2()
    trainer = _trainer(monkeypatch, model)
    engine = _EngineLike(model)
    engine.eval()
    assert engine.training and not model.training
    ids = torch.tensor([[5, 6, 7, 8], [8, 9, 10, 11]])
    batch = {"input_ids": ids, "labels": ids}
    with torch.no_grad():
        torch.testing.assert_close(trainer.compute_loss(engine, dict(batch)), model(**batch).loss)
        engine.train()  # training through the engine is weighted still: a sample mean of 2 of the global batch of 4
        torch.testing.assert_close(trainer.compute_loss(engine, dict(batch)), model(**batch).loss * 2 / 4)


def test_a_loss_reduction_in_the_poplar_section_which_the_trainer_does_not_read_is_warned_of(monkeypatch, caplog):
    # The Trainer weights its loss as loss_is_scaled_for_ga says: a config asking for the sum trained the token mean
    # without a word.
    from poplar_ext.integrations.transformers import PoplarTrainer

    arguments = _arguments_of_a_settled_job(monkeypatch, {}, {"loss_reduction": "sum"})
    with caplog.at_level("WARNING", logger="poplar_ext.integrations.transformers"):
        PoplarTrainer(model=_gpt2(), args=arguments)
    assert "PoplarTrainer: poplar.loss_reduction 'sum' is not read by a Trainer" in caplog.text, caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="poplar_ext.integrations.transformers"):
        PoplarTrainer(model=_gpt2(), args=_arguments_of_a_settled_job(monkeypatch, {}, {}))
    assert "loss_reduction" not in caplog.text
