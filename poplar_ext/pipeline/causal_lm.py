"""Hugging Face causal LMs (GPT-2, Llama, Qwen2, Mistral) as pipeline layers (docs/pipeline.md)."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from deepspeed.pipe import TiedLayerSpec
from torch import nn

from poplar_ext.runtime.weighting import IGNORE_INDEX

TIED_EMBEDDING_KEY = "token_embedding"
"""The `TiedLayerSpec` key of a tied token embedding and head."""

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2")
"""``config.model_type`` of the causal LMs `causal_lm_layers` takes."""


class TokenEmbedding(nn.Module):
    """The model's token embedding as a layer: token ids to hidden states (the tied module when tied)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(input_ids)


def tied_head(shared: TokenEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """The head of a model that ties it to its embedding: logits from the embedding's weight."""
    return nn.functional.linear(hidden, shared.embedding.weight)


class LearnedPositions(nn.Module):
    """GPT-2's learned position embeddings added to the token embeddings, then its embedding dropout."""

    def __init__(self, positions: nn.Embedding, dropout: nn.Module) -> None:
        super().__init__()
        self.positions, self.dropout = positions, dropout

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        position_ids = torch.arange(hidden.shape[1], device=hidden.device)
        return self.dropout(hidden + self.positions(position_ids))


class DecoderLayer(nn.Module):
    """One decoder block of the model, called as the model's own forward calls it (no cache)."""

    def __init__(self, block: nn.Module, *, config: Any, mask_function: Callable[..., Any], rotary: Any) -> None:
        super().__init__()
        self.block = block
        self.config, self.mask_function = config, mask_function
        # A plain attribute, not a submodule: the rotary module has no parameters, and one
        # module registered under every block would appear once per block in a state dict.
        self.__dict__["rotary"] = rotary
        self._mask_parameters = frozenset(inspect.signature(mask_function).parameters)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = self.mask_function(**self._mask_arguments(hidden, position_ids))
        extra = {} if self.rotary is None else {"position_embeddings": self.rotary(hidden, position_ids)}
        return self.block(hidden, attention_mask=mask, position_ids=position_ids, **extra)

    def _mask_arguments(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any]:
        # transformers 5 takes (inputs_embeds, cache); 4.5x took (input_embeds, past_key_values,
        # cache_position): the GPU image's 4.x failed on the 5.x names.
        names = self._mask_parameters
        arguments: dict[str, Any] = {"config": self.config, "attention_mask": None, "position_ids": position_ids}
        arguments["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = hidden
        for name in ("cache", "past_key_values"):
            if name in names:
                arguments[name] = None
        if "cache_position" in names:
            arguments["cache_position"] = position_ids[0]
        return arguments


class CausalLMLoss:
    """A causal LM's loss on one micro-batch, the model's own: the mean over its label tokens of the next-token
    cross entropy (``labels[..., 1:]`` against the logits before them, ``-100`` ignored); 0 without label tokens
    (the model's would be NaN). ``poplar_loss_reduction`` says which reduction the config must ask for,
    ``loss_shifts_labels`` how its tokens are counted."""

    poplar_loss_reduction = "token_mean"
    loss_shifts_labels = True
    __name__ = "causal_lm_loss"

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        predicted = logits[..., :-1, :].float()
        targets = labels[..., 1:].to(logits.device)
        total = nn.functional.cross_entropy(
            predicted.reshape(-1, predicted.shape[-1]),
            targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        return total / targets.ne(IGNORE_INDEX).sum().clamp(min=1)


@dataclass(frozen=True, kw_only=True)
class CausalLMPipeline:
    """What `causal_lm_layers` returns: a `PoplarPipelineModule`'s layers and loss."""

    layers: list[Any]
    """The layers in order: modules, and `TiedLayerSpec`s for a tied embedding and head."""
    loss_fn: CausalLMLoss
    """The last stage's ``loss_fn(logits, labels)``; needs ``poplar.loss_reduction: token_mean``."""
    tied: bool
    """Whether the head shares the embedding's weight (one `TiedLayerSpec` key)."""


def _model_type(model: Any) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES or not hasattr(model, "get_output_embeddings"):
        raise ValueError(
            f"causal_lm_layers: expected a Hugging Face causal LM of type {', '.join(SUPPORTED_MODEL_TYPES)}, "
            f"found {type(model).__name__} (model_type {model_type!r})"
        )
    return model_type


def _mask_function(module: nn.Module, name: str) -> Callable[..., Any]:
    """The mask builder `name` as imported by the module defining `module`'s class: the function
    the model's own forward calls."""
    function = getattr(sys.modules[type(module).__module__], name, None)
    if function is None:
        raise ValueError(
            f"causal_lm_layers: expected {type(module).__module__} to use transformers' {name}, found none "
            "(a transformers version this was not written for)"
        )
    return function


def _layer_mask_names(model_type: str, config: Any) -> list[str]:
    """Each block's mask builder, as the model's forward chooses it."""
    layers = config.num_hidden_layers
    if model_type == "qwen2":
        kinds = config.layer_types
        return [
            "create_sliding_window_causal_mask" if k == "sliding_attention" else "create_causal_mask" for k in kinds
        ]
    if model_type == "mistral" and config.sliding_window is not None:
        return ["create_sliding_window_causal_mask"] * layers
    return ["create_causal_mask"] * layers


def _parts(model: Any, model_type: str) -> tuple[Any, list[nn.Module], nn.Module, list[Any], Any]:
    """The model's body, its layers before the blocks (the token embedding excluded), the blocks, the
    final norm and the rotary module (None for GPT-2)."""
    if model_type == "gpt2":
        body = model.transformer
        return body, [LearnedPositions(body.wpe, body.drop)], list(body.h), body.ln_f, None
    body = model.model
    return body, [], list(body.layers), body.norm, body.rotary_emb


def causal_lm_layers(model: Any) -> CausalLMPipeline:
    """`model` (a transformers causal LM of type gpt2, llama, mistral or qwen2) as pipeline layers and
    its loss; raises ValueError for any other model, before anything is built or sent."""
    model_type = _model_type(model)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    name = type(model).__name__
    if head is None:
        raise ValueError(f"causal_lm_layers: expected a causal LM with its head (e.g. LlamaForCausalLM), found {name}")
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"causal_lm_layers: expected a head without bias, found one in {name}")
    tied = head.weight is embedding.weight
    body, before, blocks, norm, rotary = _parts(model, model_type)
    if tied:
        first: Any = TiedLayerSpec(TIED_EMBEDDING_KEY, TokenEmbedding, embedding, tied_weight_attr="embedding.weight")
        last: Any = TiedLayerSpec(
            TIED_EMBEDDING_KEY, TokenEmbedding, embedding, forward_fn=tied_head, tied_weight_attr="embedding.weight"
        )
    else:
        first, last = TokenEmbedding(embedding), head
    masks = _layer_mask_names(model_type, model.config)
    decoders = [
        DecoderLayer(block, config=model.config, mask_function=_mask_function(body, mask), rotary=rotary)
        for block, mask in zip(blocks, masks)
    ]
    return CausalLMPipeline(layers=[first, *before, *decoders, norm, last], loss_fn=CausalLMLoss(), tied=tied)


__all__ = ["SUPPORTED_MODEL_TYPES", "CausalLMLoss", "CausalLMPipeline", "causal_lm_layers"]
