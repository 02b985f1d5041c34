"""poplar-ext's search: profiles + cluster + global batch -> plan, ZeRO (`search_plan`) or pipelines
(`search_pipeline_plan`), both returning a `SearchResult`; `predict` and `predict_pipeline` price a given
plan. `poplar-search` is its command line (docs/search.md).

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
from .pipeline_cost import PipelinePrediction, predict_pipeline
from .pipeline_search import check_pipeline_plan, search_pipeline_plan

__all__ = [
    "PipelinePrediction",
    "check_pipeline_plan",
    "predict_pipeline",
    "search_pipeline_plan",
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
