"""Hugging Face models from a transformers config, random weights, and their batches (``poplar-profile --model
hf:GPT2Config``); transformers is imported only when a model is built (``pip install 'poplar-ext[hf]'``).
See docs/profiling.md."""

from __future__ import annotations

from typing import Any

import torch

from poplar_ext.models.synthetic import random_tokens
from poplar_ext.plan.validation import closest

HF_TASKS = ("causal-lm", "masked-lm")
"""What the built model predicts: the next token, or a seeded 15% of masked tokens."""
SIZE_KEYS = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_size",
    "intermediate_size",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
)
"""A config's sizes by transformers' common names (a class's own spellings, GPT-2's ``n_layer``, through its
``attribute_map``): each an integer of 1 or more."""


def model_from_config(config_class: str, sizes: dict[str, Any], *, task: str = "causal-lm") -> Any:
    """A model of transformers' `config_class` (e.g. ``GPT2Config``) with `sizes`, random weights."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    cls = getattr(transformers, config_class, None)
    if cls is None or not isinstance(cls, type) or not issubclass(cls, transformers.PretrainedConfig):
        raise ValueError(
            f"--model hf:{config_class}: expected the name of a transformers config class (e.g. GPT2Config)"
        )
    if task not in HF_TASKS:
        raise ValueError(f"--hf-task: expected one of {', '.join(HF_TASKS)}, found {task!r}")
    _check_sizes(cls, sizes)
    try:
        config = cls(**sizes)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--hf-config: {config_class} refused {sizes}: {exc}") from exc
    _check_config_keys(config, config_class, sizes)
    auto = AutoModelForCausalLM if task == "causal-lm" else AutoModelForMaskedLM
    return auto.from_config(config)


def _check_sizes(cls: type, sizes: dict[str, Any]) -> None:
    """A size below 1 is refused: transformers keeps it, and ``n_layer=-1`` builds a model without layers."""
    common = {own: name for name, own in getattr(cls, "attribute_map", {}).items()}
    for key, value in sizes.items():
        if common.get(key, key) in SIZE_KEYS and isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError(f"--hf-config: {key}: expected an integer >= 1, found {value}")


def _check_config_keys(config: Any, config_class: str, sizes: dict[str, Any]) -> None:
    """A key the config keeps only as an extra attribute (one its model never reads) is refused: a
    misspelt size (``n_layers`` for ``n_layer``) would otherwise silently leave the default model."""

    try:
        known = set(type(config)().to_dict())
    except Exception:  # noqa: BLE001 - a config that cannot be built without arguments: nothing to compare with
        return
    stored = config.to_dict()
    for key in sizes:
        if key in stored and key not in known:
            close = closest(key, sorted(known))
            hint = "" if close is None else f" (did you mean {close}?)"
            raise ValueError(f"--hf-config: {config_class} has no field {key!r}{hint}")


def random_lm_batch(vocab_size: int, micro_batch_size: int, sequence_length: int, *, task: str = "causal-lm") -> dict:
    """One micro-batch of random tokens with labels (a masked LM predicts a seeded 15% of them)."""
    generator = torch.Generator().manual_seed(micro_batch_size)
    ids = random_tokens(vocab_size, (micro_batch_size, sequence_length), generator=generator)
    labels = ids.clone()
    if task == "masked-lm":
        keep = torch.rand(ids.shape, generator=generator) < 0.15
        labels[~keep] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


class PaddedTokens(torch.utils.data.Dataset):
    """``(input_ids, labels)`` samples of one `length` (a pipeline's activations keep one shape): each
    sample's random tokens (ids 1 and up) are 3 to `length` long, then padding (id 0, label ``-100``),
    so the mean over label tokens differs from the mean over samples. Seeded."""

    def __init__(self, *, num_samples: int, vocab_size: int, length: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.input_ids = random_tokens(vocab_size - 1, (num_samples, length), generator=generator) + 1
        lengths = torch.randint(3, length + 1, (num_samples,), generator=generator)
        padding = torch.arange(length) >= lengths[:, None]
        self.input_ids[padding] = 0
        self.labels = self.input_ids.masked_fill(padding, -100)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.input_ids[index], self.labels[index]
