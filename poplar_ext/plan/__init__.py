"""The formats every part shares: profiles, clusters, plans, network files, pipeline plans (numpy only, no
torch). Their fields: profiles/README.md."""

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
