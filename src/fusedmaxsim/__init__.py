"""fusedmaxsim: fused GPU kernels for late-interaction (MaxSim) scoring."""

import warnings

# fusedmaxsim needs torch and Triton only. Where NumPy is not installed, importing torch warns
# "Failed to initialize NumPy" although nothing here uses NumPy: keep that warning out of
# fusedmaxsim's import (and so out of every command of the command-line tool).
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401

from . import plaid, reference, settings
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
from .head import ProjectionHead, maxsim_from_hidden
from .planning import explain, forced_plan
from .retrieval import MaxSimScorer, retrieve

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "explain",
    "forced_plan",
    "MaxSimScorer",
    "PackedBatch",
    "ProjectionHead",
    "maxsim",
    "maxsim_from_hidden",
    "maxsim_padded",
    "maxsim_pairs",
    "maxsim_ragged",
    "maxsim_varlen",
    "pack_padded",
    "plaid",
    "reference",
    "retrieve",
    "score_pairs_packed",
    "settings",
]
