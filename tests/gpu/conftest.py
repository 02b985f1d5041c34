"""GPU tier: the runtime's equivalence and launcher tests with CUDA, nccl and bf16.

Skipped, with the reason shown, where CUDA is absent. Uses the multi-process helpers
of tests/dist (put on sys.path here).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
