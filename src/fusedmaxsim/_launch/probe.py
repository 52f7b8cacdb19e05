"""The launcher of the PLAID search's probe: executes a :class:`~fusedmaxsim._plan.ProbePlan`
with ``kernels.probe._probe_kernel``.

Inputs: ``cells [Nq, P]`` (any integer type), the index's ``offsets [n_cells + 1]`` and ``ivf
[E]`` (int64), on one device. The bitmap is allocated here, zero, and only ones are written.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .._plan import ProbePlan
from ..kernels.probe import _probe_kernel
from .runtime import constants, launcher

__all__ = ["probe"]


@functools.lru_cache(maxsize=16)
def _constants(block: int, num_warps: int, num_stages: int):
    return constants(BLOCK=block, num_warps=num_warps, num_stages=num_stages)


def probe(plan: ProbePlan, cells: Tensor, offsets: Tensor, ivf: Tensor, n_docs: int) -> Tensor:
    """``hit [Nq, n_docs]`` bool: the documents of the inverted lists of each query's cells."""
    Nq, P = cells.shape
    hit = torch.zeros((Nq, n_docs), dtype=torch.bool, device=cells.device)
    if not (Nq and P and n_docs and ivf.numel()):
        return hit
    cells, bitmap = cells.contiguous(), hit.view(torch.uint8)
    kernel = launcher(_probe_kernel)
    consts = _constants(plan.block, plan.num_warps, plan.num_stages)
    for q0 in range(0, Nq, plan.launch_queries):
        c = cells[q0:q0 + plan.launch_queries]
        kernel((c.numel(),), (c, offsets, ivf, bitmap[q0:q0 + c.shape[0]], P,
                              offsets.shape[0] - 1, n_docs), consts)
    return hit
