"""Random token ids: every maker of synthetic tokens in poplar-ext draws them here, so one seed gives the same
tokens everywhere (nothing is downloaded). See docs/profiling.md."""

from __future__ import annotations

import torch


def random_tokens(
    vocab_size: int, shape: tuple[int, ...], *, seed: int | None = None, generator: torch.Generator | None = None
) -> torch.Tensor:
    """A LongTensor of `shape` with ids in ``[0, vocab_size)``, from `generator`, or a new one seeded with `seed`."""
    if (seed is None) == (generator is None):
        raise ValueError("random_tokens: expected exactly one of seed and generator")
    if generator is None:
        generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, shape, generator=generator)
