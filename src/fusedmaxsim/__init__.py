"""fusedmaxsim: fused GPU kernels for late-interaction (MaxSim) scoring."""

from . import reference, settings
from .api import maxsim, maxsim_pairs

__version__ = "0.1.0"

__all__ = ["__version__", "maxsim", "maxsim_pairs", "reference", "settings"]
