"""The plan and what it is made from: profiles, clusters, network files, pipeline plans and layer profiles, their
validation and their errors (numpy only, no torch).

Every other part shares these formats: the profiler writes profiles, the search reads profiles and clusters and writes
plans, the runtime reads plans. Their fields are described in profiles/README.md.
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

__all__ = [
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
