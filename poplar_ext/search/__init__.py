"""poplar-ext's batch-allocation search: profiles + cluster + global batch -> plan.

Pure: imports numpy and scipy only (never torch or deepspeed), so it runs on a laptop.
"""

from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import (
    Cluster,
    Plan,
    Prediction,
    Profile,
    RankPlan,
    Sample,
    load_cluster,
    load_plan,
    load_profile,
    load_profiles,
    save_plan,
)

from .api import PlanPrediction, SearchResult, StageReport, check_plan, predict, search_plan

__all__ = [
    "PlanPrediction",
    "SearchResult",
    "StageReport",
    "check_plan",
    "predict",
    "search_plan",
    "Cluster",
    "FormatError",
    "Plan",
    "Prediction",
    "Profile",
    "RankPlan",
    "Sample",
    "load_cluster",
    "load_plan",
    "load_profile",
    "load_profiles",
    "save_plan",
]
