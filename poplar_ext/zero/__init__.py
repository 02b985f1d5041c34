"""The ZeRO engine: a plan trained inside DeepSpeed's own ``DeepSpeedEngine``, every rank holding the model.

`planning` (which plan), `initialize` (DeepSpeed's, with per-rank batches), `engine` (`PoplarEngine`); over
`poplar_ext.runtime`. See docs/training.md and DEVELOPING.md's map.
"""

from poplar_ext.zero.engine import PoplarEngine
from poplar_ext.zero.planning import StalePlanWarning

__all__ = ["PoplarEngine", "StalePlanWarning"]
