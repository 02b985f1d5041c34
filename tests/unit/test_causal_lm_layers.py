"""`causal_lm_layers`: a Hugging Face causal LM as pipeline layers computes the model's own logits and loss.

One process, the layers run in order as one pipeline stage would run them (a TiedLayerSpec's
module built once and shared, as on a stage holding both its uses), against the model's
forward with ``labels``: GPT-2 (tied head), Llama (untied), Qwen2 (tied), Mistral (sliding
window), and Llama with eager attention (a 4-D mask rather than SDPA's causal flag).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="a Hugging Face model: pip install 'poplar-ext[hf]'")

from deepspeed.pipe import TiedLayerSpec  # noqa: E402

from poplar_ext.pipeline import causal_lm_layers  # noqa: E402
from poplar_ext.pipeline.causal_lm import CausalLMLoss  # noqa: E402

VOCAB = 100
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def _model(name: str, *, attn: str = "sdpa", **options):
    import transformers

    torch.manual_seed(0)
    if name == "GPT2Config":
        config = transformers.GPT2Config(
            n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
        )
    else:
        config = getattr(transformers, name)(**SIZES, num_key_value_heads=2, **options)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    assert model.config._attn_implementation == attn
    return model


def _run(layers, input_ids):
    built, x = {}, input_ids
    for layer in layers:
        if isinstance(layer, TiedLayerSpec):
            module = built.setdefault(layer.key, layer.build())
            x = module(x) if layer.forward_fn is None else layer.forward_fn(module, x)
        else:
            x = layer(x)
    return x


def _batch():
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (3, 12), generator=generator)
    labels = input_ids.clone()
    labels[0, 5:] = -100  # padding: the token mean differs from the mean of the rows' means
    labels[2, 9:] = -100
    return input_ids, labels


MODELS = {
    "gpt2": ("GPT2Config", {}),
    "llama": ("LlamaConfig", {}),
    "llama_eager": ("LlamaConfig", {"attn": "eager"}),
    "qwen2_tied": ("Qwen2Config", {"tie_word_embeddings": True}),
    "mistral_sliding": ("MistralConfig", {"sliding_window": 4}),
}


@pytest.mark.parametrize("case", list(MODELS))
def test_the_layers_give_the_models_logits_and_loss(case):
    name, options = MODELS[case]
    model = _model(name, **options)
    input_ids, labels = _batch()
    pipe = causal_lm_layers(model)
    with torch.no_grad():
        logits = _run(pipe.layers, input_ids)
        expected = model(input_ids=input_ids, labels=labels)
    assert torch.allclose(logits, expected.logits, atol=1e-6)
    assert float(pipe.loss_fn(logits, labels)) == pytest.approx(float(expected.loss), abs=1e-6)


@pytest.mark.parametrize(("case", "tied"), [("gpt2", True), ("qwen2_tied", True), ("llama", False)])
def test_a_head_tied_to_the_embedding_is_one_tied_layer_spec_at_both_ends(case, tied):
    name, options = MODELS[case]
    pipe = causal_lm_layers(_model(name, **options))
    ends = [pipe.layers[0], pipe.layers[-1]]
    assert pipe.tied is tied
    assert all(isinstance(end, TiedLayerSpec) for end in ends) is tied
    if tied:
        assert ends[0].key == ends[1].key and ends[1].forward_fn is not None
        model_embedding = pipe.layers[0].module_args[0]
        assert ends[0].build().embedding is model_embedding  # the model's weight, not a copy
    assert not any(isinstance(layer, TiedLayerSpec) for layer in pipe.layers[1:-1])


def test_a_micro_batch_without_label_tokens_has_a_loss_of_zero():
    logits = torch.randn(2, 4, VOCAB)
    assert float(CausalLMLoss()(logits, torch.full((2, 4), -100))) == 0.0


def test_other_architectures_are_refused_naming_the_supported_ones():
    import transformers

    config = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    other = transformers.AutoModelForCausalLM.from_config(config)
    supported = r"expected a Hugging Face causal LM of type gpt2, llama, mistral, qwen2"
    with pytest.raises(ValueError, match=supported + r", found GPTNeoXForCausalLM \(model_type 'gpt_neox'\)"):
        causal_lm_layers(other)
    with pytest.raises(ValueError, match=supported + r", found Linear \(model_type None\)"):
        causal_lm_layers(torch.nn.Linear(2, 2))


def test_a_model_without_its_head_is_refused():
    import transformers

    body = transformers.LlamaModel(transformers.LlamaConfig(**SIZES, num_key_value_heads=2))
    with pytest.raises(
        ValueError, match=r"expected a causal LM with its head \(e.g. LlamaForCausalLM\), found LlamaModel"
    ):
        causal_lm_layers(body)


@pytest.mark.parametrize(
    "signature",
    [
        "config, inputs_embeds, attention_mask, cache, position_ids=None",  # transformers 5.24
        "config, inputs_embeds, attention_mask, past_key_values, position_ids=None",  # 5.17, the GPU image's
        "config, input_embeds, attention_mask, cache_position, past_key_values, position_ids=None",  # 4.5x
    ],
)
def test_the_causal_mask_is_asked_for_in_the_installed_transformers_names(signature):
    from poplar_ext.pipeline.causal_lm import DecoderLayer

    calls = []
    namespace = {"calls": calls}
    exec(f"def mask_function({signature}):\n    calls.append(dict(locals()))\n    return None", namespace)

    class Block(torch.nn.Module):
        def forward(self, hidden, **kwargs):
            return hidden

    layer = DecoderLayer(Block(), config="config", mask_function=namespace["mask_function"], rotary=None)
    hidden = torch.zeros(2, 5, 4)
    assert layer(hidden) is hidden
    (arguments,) = calls
    assert arguments["config"] == "config" and arguments["attention_mask"] is None
    assert (arguments.get("inputs_embeds") if "inputs_embeds" in arguments else arguments["input_embeds"]) is hidden
    assert arguments["position_ids"].tolist() == [[0, 1, 2, 3, 4]]
    if "cache_position" in arguments:
        assert arguments["cache_position"].tolist() == [0, 1, 2, 3, 4]
