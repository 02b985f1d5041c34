"""``python -m poplar_ext.profiler`` (and ``deepspeed --module poplar_ext.profiler``): `poplar-profile`.
See docs/profiling.md."""

import sys

from poplar_ext.profiler.cli import main

sys.exit(main())
