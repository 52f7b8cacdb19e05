"""fusedmaxsim: fused GPU kernels for late-interaction (MaxSim) scoring."""

from . import reference, settings
from .api import maxsim, maxsim_pairs
from .ragged import PackedBatch, maxsim_padded, maxsim_ragged, maxsim_varlen, pack_padded, score_pairs_packed
from .retrieval import MaxSimScorer, retrieve

__version__ = "0.1.0"

__all__ = [
    "__version__",
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
