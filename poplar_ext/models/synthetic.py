"""Random token ids for the synthetic data and the profilers' batches (nothing is downloaded).

Every maker of random tokens in poplar-ext (the toy GPT's data set, ``poplar-profile``'s
batches for the toy GPT and for Hugging Face models, the demo's) draws them here, so that
the same seed gives the same tokens everywhere.
"""

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
