"""The ZeRO engine: a plan trained inside DeepSpeed's ``DeepSpeedEngine`` (docs/training.md)."""

from poplar_ext.zero.engine import PoplarEngine
from poplar_ext.zero.planning import StalePlanWarning

__all__ = ["PoplarEngine", "StalePlanWarning"]
