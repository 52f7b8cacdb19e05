"""Host launcher of the smooth-max backward kernels (``_kernels_smooth``).

Inputs as for ``_launch.maxsim_bwd``: ``Q [Nq, Lq, d]``; ``D [Nd, Ld, d]`` or ``[Nq, K, Ld, d]``
(any strides); ``row_lse`` the forward's fp32 ``[Nq, Ncols, Lq]`` log2-sum-exp2 rows; the bool
document mask, if any. Gradients come back contiguous, in the input dtype or fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _configs
from ._kernels_smooth import _smooth_bwd_kernel
from ._launch import (
    _as_bytes,
    _cdiv,
    _doc_strides,
    _empty,
    constants,
    grads_without_launch,
    launcher,
    owned_tile_meta,
    smooth_scales,
)

__all__ = ["smooth_bwd"]


def smooth_bwd(
    grad_scores: Tensor,
    Q: Tensor,
    D: Tensor,
    d_mask: Tensor | None,
    row_lse: Tensor,
    tau: float,
    need_grad_q: bool,
    need_grad_d: bool,
    fp32_out: bool,
    fp32_precision: str,
) -> tuple[Tensor, Tensor]:
    trivial = grads_without_launch(Q, D, need_grad_q, need_grad_d, fp32_out)
    if trivial is not None:
        return trivial
    per_query_docs = D.dim() == 4
    Nq, Lq, dim = Q.shape
    Ncols, Ld = D.shape[-3], D.shape[-2]
    empty = Q.new_empty((0,))
    q_dtype = torch.float32 if fp32_out else Q.dtype
    d_dtype = torch.float32 if fp32_out else D.dtype
    cfg = _configs.smooth_bwd_config(Lq, dim)
    dm = _as_bytes(d_mask)
    row_lse = row_lse.contiguous()
    scale, _ = smooth_scales(tau)
    def meta(grad_d: bool):
        return constants(
            GRAD_D=grad_d,
            HAS_D_MASK=dm is not None,
            PER_QUERY_DOCS=per_query_docs,
            BLOCK_S=cfg.block_s,
            **owned_tile_meta(cfg, Q.dtype, fp32_precision),
        )

    def args(out: Tensor) -> tuple:
        return (
            grad_scores, Q, D, D if dm is None else dm, row_lse, out,
            Nq, Ncols, Lq, Ld, dim, scale,
            *grad_scores.stride(), *Q.stride(), *_doc_strides(D, per_query_docs),
        )

    grad_q = grad_d = empty
    if need_grad_q:
        grad_q = _empty(Q.shape, q_dtype, Q.device)
        launcher(_smooth_bwd_kernel)((Nq * _cdiv(Lq, cfg.block_s),), args(grad_q), meta(False))
    if need_grad_d:
        grad_d = _empty(D.shape, d_dtype, D.device)
        groups = Nq if per_query_docs else 1
        grid = (groups * Ncols, _cdiv(Ld, cfg.block_t))
        launcher(_smooth_bwd_kernel)(grid, args(grad_d), meta(True))
    return grad_q, grad_d
