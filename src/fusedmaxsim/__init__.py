"""fusedmaxsim: fused GPU kernels for late-interaction (MaxSim) scoring."""

from . import reference, settings
from .api import (
    PackedBatch,
    maxsim,
    maxsim_padded,
    maxsim_pairs,
    maxsim_ragged,
    maxsim_varlen,
    pack_padded,
    score_pairs_packed,
)
from .planning import explain, forced_plan
from .retrieval import MaxSimScorer, retrieve

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "explain",
    "forced_plan",
    "MaxSimScorer",
    "PackedBatch",
    "maxsim",
    "maxsim_padded",
    "maxsim_pairs",
    "maxsim_ragged",
    "maxsim_varlen",
    "pack_padded",
    "reference",
    "retrieve",
    "score_pairs_packed",
    "settings",
]
