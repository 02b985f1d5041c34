"""A small MLP as pipeline LayerSpecs (`toy_layers`; `toy_sequential`: the same in one process, seeded as
``seed_layers=True`` seeds them), and a seeded regression data set. See docs/pipeline.md."""

from __future__ import annotations

import torch
from deepspeed.pipe import LayerSpec
from deepspeed.runtime import utils as deepspeed_utils
from torch import nn


class Block(nn.Module):
    """``tanh(linear(x))``, width kept."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def toy_layers(*, dim: int = 8, num_layers: int = 6) -> list[LayerSpec]:
    """`num_layers` layers: blocks, then a linear head to one output."""
    return [LayerSpec(Block, dim) for _ in range(num_layers - 1)] + [LayerSpec(nn.Linear, dim, 1)]


def toy_sequential(*, dim: int = 8, num_layers: int = 6, base_seed: int = 1234) -> nn.Sequential:
    """The layers of `toy_layers` in one process, seeded as DeepSpeed's ``seed_layers`` seeds layer i
    (``base_seed + i``); parameters are named ``<layer index>.<name>``, as in a PipelineModule."""
    layers = []
    for index, spec in enumerate(toy_layers(dim=dim, num_layers=num_layers)):
        deepspeed_utils.set_random_seed(base_seed + index)
        layers.append(spec.build())
    return nn.Sequential(*layers)


def mse(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean squared error over the micro-batch."""
    return ((outputs - labels) ** 2).mean()


class RegressionData(torch.utils.data.Dataset):
    """`num_samples` pairs ``(x, sin(sum(x)))``, x normal in `dim` dimensions, fixed by `seed`."""

    def __init__(self, *, num_samples: int, dim: int = 8, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(num_samples, dim, generator=generator)
        self.targets = self.inputs.sum(dim=1, keepdim=True).sin()

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]


def toy_batch(micro_batch_size: int, *, dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch ``(inputs, labels)`` of `RegressionData` (the profiler's ``make_batch``)."""
    data = RegressionData(num_samples=micro_batch_size, dim=dim, seed=micro_batch_size)
    return data.inputs, data.targets
