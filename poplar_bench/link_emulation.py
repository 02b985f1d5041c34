"""An emulated slow link between emulated nodes, for `poplar-bench pipeline` (not training): a bandwidth cap on
the bytes that cross it. See docs/bench.md (poplar-bench pipeline)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "p2p": lambda n: 1.0,
}


@dataclass(frozen=True, kw_only=True)
class LinkEmulation:
    """Which emulated node each rank is on, and the link between nodes."""

    node_of_rank: tuple[int, ...]
    """Emulated node of every rank, rank 0 first."""
    bandwidth_bytes_per_s: float
    """What the link between two nodes carries per second (each direction)."""
    latency_s: float = 0.0
    """Added once per crossing operation."""

    def __post_init__(self) -> None:
        if not self.node_of_rank:
            raise ValueError("node_of_rank: expected the node of at least one rank, found none")
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"bandwidth_bytes_per_s: expected a number > 0, found {self.bandwidth_bytes_per_s}")
        if self.latency_s < 0:
            raise ValueError(f"latency_s: expected a number >= 0, found {self.latency_s}")

    def crossing_bytes(self, operation: str, tensor_bytes: int, ranks: Sequence[int]) -> float:
        """Bytes one link between nodes carries for `operation` on `ranks` (0 when they share a node)."""
        if operation not in _FACTORS:
            raise ValueError(f"operation: expected one of {', '.join(_FACTORS)}, found {operation!r}")
        if len({self.node_of_rank[r] for r in ranks}) < 2:
            return 0.0
        return _FACTORS[operation](len(ranks)) * tensor_bytes

    def delay_s(self, operation: str, tensor_bytes: int, ranks: Sequence[int]) -> float:
        """The sleep after `operation`: 0 within a node, else latency plus the crossing bytes over the bandwidth."""
        if len({self.node_of_rank[r] for r in ranks}) < 2:
            return 0.0
        return self.latency_s + self.crossing_bytes(operation, tensor_bytes, ranks) / self.bandwidth_bytes_per_s


# (torch.distributed function, operation, which argument's bytes count: position, keyword)
_WRAPPED = (
    ("all_reduce", "all_reduce", 0, "tensor"),
    ("broadcast", "broadcast", 0, "tensor"),
    ("send", "p2p", 0, "tensor"),
    ("recv", "p2p", 0, "tensor"),
    ("all_gather_into_tensor", "all_gather", 0, "output_tensor"),
    ("_all_gather_base", "all_gather", 0, "output_tensor"),
    ("reduce_scatter_tensor", "reduce_scatter", 1, "input"),
    ("_reduce_scatter_base", "reduce_scatter", 1, "input"),
)


def _wrap(dist: Any, link: LinkEmulation, original: Callable, name: str, operation: str, position: int, keyword: str):
    @functools.wraps(original)
    def emulated(*args: Any, **kwargs: Any) -> Any:
        work = original(*args, **kwargs)
        tensor = args[position] if len(args) > position else kwargs[keyword]
        group, peer = kwargs.get("group"), None
        if operation == "p2p":
            peer = args[1] if len(args) > 1 else kwargs.get("dst", kwargs.get("src"))
        if peer is not None:
            ranks = [dist.get_rank(), peer]
        elif group is None or group is dist.group.WORLD:
            ranks = list(range(dist.get_world_size()))
        else:
            ranks = list(dist.get_process_group_ranks(group))
        delay = link.delay_s(operation, tensor.numel() * tensor.element_size(), ranks)
        if delay > 0.0:
            if work is not None and hasattr(work, "wait"):
                work.wait()  # the link is busy until the bytes are across
            time.sleep(delay)
        return work

    return emulated


def install_link_emulation(link: LinkEmulation) -> Callable[[], None]:
    """Cap the link between emulated nodes in this process (see docs/bench.md); returns the undo."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name, *_ in _WRAPPED if hasattr(dist, name)}
    for name, *how in _WRAPPED:
        if name in originals:
            setattr(dist, name, _wrap(dist, link, originals[name], name, *how))

    def undo() -> None:
        for name, original in originals.items():
            setattr(dist, name, original)

    return undo


__all__ = ["LinkEmulation", "install_link_emulation"]
