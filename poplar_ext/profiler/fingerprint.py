"""Model fingerprint: which architecture a profile was measured with (module classes, parameter and buffer names,
shapes and dtypes, each module's settings; never the weights' values), taken on the model as built, before
DeepSpeed wraps it. See docs/profiling.md."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from torch import nn

from poplar_ext.plan.formats import content_fingerprint

_NOT_IN_FINGERPRINT = frozenset(
    # Train or eval mode; activation checkpointing, switched per profile and keyed apart from the model.
    "training activation_checkpointing gradient_checkpointing "
    # Where a Hugging Face model came from, and its dtype (its parameters' dtypes are hashed).
    "name_or_path transformers_version architectures dtype torch_dtype generation_config "
    # Set by a Trainer (use_cache: a cache of the keys and values backward keeps anyway) or by the first forward
    # (problem_type), and label names: none changes the compute.
    "use_cache problem_type id2label label2id "
    # What a hub config.json or resize_token_embeddings adds beside the shapes (which hold the vocabulary),
    # initialisation, and GPT-2's unused n_ctx.
    "vocab_size task_specific_params initializer_range n_ctx".split()
)


def json_settings(values: Mapping[Any, Any]) -> dict[str, Any]:
    """The JSON scalars of `values` (a module's attributes, an optimizer's defaults; lists of them, mappings of
    them) and the configs among them (a dataclass, or a Hugging Face config with its attention implementation),
    less those that do not change the compute: `_NOT_IN_FINGERPRINT`, token ids (the data's) and private names."""
    kept = {}
    for name, value in values.items():
        name = str(name)
        if name.startswith("_") or name in _NOT_IN_FINGERPRINT or name.endswith("_token_id"):
            continue
        if callable(getattr(value, "to_diff_dict", None)):  # a Hugging Face config; to_dict() leaves out its attention
            value = {**value.to_dict(), "attn_implementation": getattr(value, "_attn_implementation", None)}
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            # Its fields as they are: asdict would deep-copy them, and a lock or process group cannot be copied.
            value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        if isinstance(value, Mapping):
            value = json_settings(value)
        elif isinstance(value, (list, tuple)) and all(_is_scalar(v) for v in value):
            value = list(value)
        elif not _is_scalar(value):
            continue
        kept[name] = value
    return kept


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def model_description(model: nn.Module) -> dict[str, Any]:
    """The JSON-able facts the fingerprint hashes (handy for seeing why two differ)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, found {type(model).__name__}")
    return {
        "modules": [[name, f"{type(m).__module__}.{type(m).__qualname__}"] for name, m in model.named_modules()],
        "parameters": [
            [name, list(p.shape), str(p.dtype).removeprefix("torch."), bool(p.requires_grad)]
            for name, p in model.named_parameters()
        ],
        "buffers": [[name, list(b.shape), str(b.dtype).removeprefix("torch.")] for name, b in model.named_buffers()],
        # Hyper-parameters no shape shows: attention heads, dropout, attention implementation, strides, ...
        "settings": [[name, s] for name, m in model.named_modules() if (s := json_settings(vars(m)))],
    }


def model_fingerprint(model: nn.Module) -> str:
    """Stable short hash of `model`'s architecture (classes, parameter names, shapes, dtypes, settings)."""
    return content_fingerprint(model_description(model))
