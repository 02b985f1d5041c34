"""The search (numpy and scipy only, no torch): `search_plan` / `search_pipeline_plan` -> `SearchResult`;
`predict` / `predict_pipeline` price a plan; `poplar-search` is its command line (docs/search.md)."""

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
