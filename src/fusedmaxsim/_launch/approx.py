"""The launcher of PLAID's approximate score: executes an :class:`~fusedmaxsim._plan.ApproxPlan`
with ``kernels.approx._plaid_approx_kernel``.

Inputs arrive as ``_autograd.approx_scores`` takes them (shapes, dtypes and devices checked):
``cs [Nq, n_centroids, Lq]`` (any float dtype but float64, which the planner sends to the
PyTorch path; any strides), ``codes [T]``, ``starts [Nd]``, ``lengths [Nd]``, and optional
``doc_ids [Nq, C]`` or ``hits [Nq, Nd]``. Empty problems return without a launch. The plan says
the tiles and how many queries a launch takes; this module computes strides and grids,
allocates and launches.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .._plan import ApproxPlan
from ..kernels.approx import _plaid_approx_kernel
from .runtime import cdiv, constants, empty, launcher

__all__ = ["approx_scores"]


@functools.lru_cache(maxsize=256)
def _constants(tiles, candidates: bool, hits: bool, padded: bool, block_d: int):
    return constants(CANDIDATES=candidates, HITS=hits, PADDED=padded, LQ_TILE=tiles.lq_tile,
                     QUERIES_PER_BLOCK=tiles.queries_per_block, BLOCK_T=tiles.block_t,
                     BLOCK_D=block_d, num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def approx_scores(plan: ApproxPlan, cs: Tensor, codes: Tensor, starts: Tensor | None,
                  lengths: Tensor, doc_ids: Tensor | None, hits: Tensor | None = None,
                  padded_len: int | None = None) -> Tensor:
    """Scores ``[Nq, Nd]`` (or ``[Nq, C]`` with ``doc_ids``), fp32; nothing synchronizes with
    the host. With ``hits [Nq, Nd]`` (bool) only query ``q``'s documents of nonzero ``hits[q]``
    are scored, the others are -inf. With ``padded_len`` (``starts`` None) document ``j`` starts
    at ``j · padded_len``. ``cs`` is copied only where its query tokens are not adjacent (stride
    along ``Lq`` other than 1), so that each centroid's row is one coalesced read."""
    Nq, n_centroids, Lq = cs.shape
    candidates = doc_ids is not None
    n_cols = doc_ids.shape[1] if candidates else lengths.shape[0]
    out = empty((Nq, n_cols), torch.float32, cs.device)
    if not (Nq and n_cols):
        return out
    if cs.stride(2) != 1 and Lq > 1:
        cs = cs.contiguous()
    tiles = plan.tiles
    qpb = tiles.queries_per_block
    consts = _constants(tiles, candidates, hits is not None, padded_len is not None,
                        plan.hit_block)
    padded_len = padded_len or 0
    if starts is None:
        starts = lengths  # a placeholder the kernel never reads
    slots = plan.slot_programs if hits is not None else 1
    span = cdiv(n_cols, slots)
    kernel = launcher(_plaid_approx_kernel)
    # What a variant does not read is given a placeholder: the lengths.
    ids = doc_ids if candidates else lengths
    bitmap = hits.view(torch.uint8) if hits is not None else lengths
    id_strides = (doc_ids.stride(0), doc_ids.stride(1)) if candidates else (0, 0)
    step = plan.launch_queries
    for q0 in range(0, Nq, step):
        q1 = min(Nq, q0 + step)
        n_q = q1 - q0
        n_qblocks = 1 if candidates or hits is not None else cdiv(n_q, qpb)
        if hits is not None:
            programs = n_q * slots
        elif candidates:
            programs = n_q * n_cols
        else:
            programs = n_cols * n_qblocks
        kernel(
            (programs,),
            (cs[q0:q1], codes, starts, lengths, ids[q0:q1] if candidates else ids,
             bitmap[q0:q1] if hits is not None else bitmap, out[q0:q1], n_q, n_cols, Lq,
             n_centroids, codes.shape[0], lengths.shape[0], n_qblocks, slots, span, padded_len,
             *cs.stride(), codes.stride(0), *id_strides),
            consts,
        )
    return out
