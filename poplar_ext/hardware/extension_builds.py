"""Build locks of torch's C++ extensions checked before a job starts: a stale one refused. See docs/limits.md
(what a first start builds)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

STALE_AFTER_S = 600.0
"""A build lock older than this is taken as left by a killed build (a CPU op builds in about a minute;
DeepSpeed's largest CUDA ops in a few)."""


def extension_build_locks(root: Path | None = None) -> list[Path]:
    """The build lock files under `root` (default: ``TORCH_EXTENSIONS_DIR``, else torch's per-user folder):
    ``<root>/<ext>/lock`` and ``<root>/<python and CUDA tag>/<ext>/lock``."""
    if root is None and os.environ.get("TORCH_EXTENSIONS_DIR"):
        root = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    elif root is None:
        import torch.utils.cpp_extension

        root = Path(torch.utils.cpp_extension.get_default_build_root())
    if not root.is_dir():
        return []
    return sorted({*root.glob("*/lock"), *root.glob("*/*/lock")})


def check_extension_build_locks(*, root: Path | None = None, stale_after_s: float = STALE_AFTER_S) -> None:
    """Refuse to start when a stale extension build lock would make every rank wait forever; log a fresh one.

    Raises RuntimeError naming each stale lock, its age and how to remove it."""
    now = time.time()
    stale = []
    for lock in extension_build_locks(root):
        try:
            age_s = now - lock.stat().st_mtime
        except FileNotFoundError:
            continue  # the build finished while we looked
        if age_s > stale_after_s:
            stale.append((lock, age_s))
        else:
            logger.warning(
                "an extension is being built (lock %s, %.0f s old): this job waits until that build ends",
                lock,
                age_s,
            )
    if stale:
        listed = "; ".join(f"{lock} ({age_s / 60:.0f} minutes old)" for lock, age_s in stale)
        commands = " ".join(str(lock) for lock, _ in stale)
        raise RuntimeError(
            f"extension build lock(s) left by a build that did not finish: {listed}. Every rank would wait on them "
            f"forever. If no other job is building these extensions now, remove them (rm {commands}) and start "
            "again; the next start builds the extension anew"
        )
