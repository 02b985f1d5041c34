"""Model fingerprint: which architecture a profile was measured with (module classes, parameter and buffer names,
shapes and dtypes; never the weights' values), taken on the model as built, before DeepSpeed wraps it. See
docs/profiling.md."""

from __future__ import annotations

from typing import Any

from torch import nn

from poplar_ext.plan.formats import content_fingerprint


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
    }


def model_fingerprint(model: nn.Module) -> str:
    """Stable short hash of `model`'s architecture (classes, parameter names, shapes, dtypes)."""
    return content_fingerprint(model_description(model))
