"""Triton kernels of the smooth-max backward: gradients of ``tau · logsumexp(s / tau)``.

Math
----
The forward (``_maxsim_fwd_kernel`` with ``SMOOTH``, the same inner loop as the max) saves, for
every query token ``s`` of query ``i`` against column ``j``, the log2-sum-exp2 of the scaled
similarities ``y = S · log2(e) / tau`` over the valid document tokens::

    L[i, j, s] = log2 Σ_{t valid} exp2(y[i, j, s, t])     (+inf where the token added nothing)
    score[i, j] = Σ_{s valid} tau · ln 2 · L[i, j, s]

Its derivative with respect to ``S[i, j, s, t]`` is the softmax ``P = exp2(y - L)`` (0 for masked
tokens, and for rows saved as +inf, whose tokens are not even read: a NaN in a masked token stays
out), so, with ``g = grad_scores``::

    grad_Q[i, s]    = Σ_j g[i, j] · Σ_t P[i, j, s, t] · D[g(i), j, t]
    grad_D[g, j, t] = Σ_{i in group g} g[i, j] · Σ_s P[i, j, s, t] · Q[i, s]

Unlike the max, every token takes part, so both kernels recompute ``S`` tile by tile (two more
products per gradient, as a FlashAttention backward does) instead of reading an argmax.

Grid mapping
------------
``_smooth_bwd_kernel``, launched once per gradient:

* ``GRAD_D`` False: program ``(i, s-block)`` owns ``grad_Q[i, s-block]`` and walks every column
  of its group and every document tile.
* ``GRAD_D`` True: program ``(g, j, t-block)`` owns ``grad_D[g, j, t-block]`` and walks the
  group's queries (all of them on the cross product, query ``g`` for per-query candidates) and
  their token blocks.
Each output row has one owner: no atomics, bitwise reproducible.

Caveats
-------
* ``P · g`` is rounded to the input dtype before its product (as FlashAttention rounds ``P``);
  the error is of the size of writing the gradient in that dtype.
* Normalization is applied by the caller before the forward (``F.normalize``), not in here.
* ``UPCAST`` computes dots in fp32 (the Triton interpreter's bf16 ``tl.dot`` is wrong on CPU).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _dot


@triton.jit(do_not_specialize=["Nq", "Ncols", "Lq", "Ld"])
def _smooth_bwd_kernel(
    GradScores,
    Q,
    D,
    DMask,
    RowLse,
    Grad,
    Nq,
    Ncols,
    Lq,
    Ld,
    dim,
    smooth_scale,
    stride_g_seq,
    stride_g_col,
    stride_q_seq,
    stride_q_tok,
    stride_q_dim,
    stride_d_grp,
    stride_d_col,
    stride_d_tok,
    stride_d_dim,
    GRAD_D: tl.constexpr,
    HAS_D_MASK: tl.constexpr,
    PER_QUERY_DOCS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``grad_Q`` (``GRAD_D`` False, grid ``Nq · s-blocks``) or ``grad_D`` (grid
    ``(groups · Ncols, t-blocks)``) into ``Grad``, contiguous."""
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < dim
    if not GRAD_D:
        n_sblocks = tl.cdiv(Lq, BLOCK_S)
        pid = tl.program_id(0).to(tl.int64)
        i_q = pid // n_sblocks
        o_s = (pid % n_sblocks) * BLOCK_S + tl.arange(0, BLOCK_S)
        m_s = o_s < Lq
        b_q = tl.load(
            Q + i_q * stride_q_seq + o_s[:, None] * stride_q_tok + o_k[None, :] * stride_q_dim,
            mask=m_s[:, None] & m_k[None, :],
            other=0.0,
        )
        i_grp = i_q if PER_QUERY_DOCS else 0
        acc = tl.zeros([BLOCK_S, BLOCK_K], tl.float32)
        for j in range(0, Ncols):
            g = tl.load(GradScores + i_q * stride_g_seq + j * stride_g_col)
            lse = tl.load(RowLse + (i_q * Ncols + j) * Lq + o_s, mask=m_s, other=float("inf"))
            p_doc = D + i_grp * stride_d_grp + j * stride_d_col
            doc_row = (i_grp * Ncols + j) * Ld
            for t0 in range(0, Ld, BLOCK_T):
                o_t = t0 + tl.arange(0, BLOCK_T)
                m_t = o_t < Ld
                if HAS_D_MASK:
                    m_t = m_t & (tl.load(DMask + doc_row + o_t, mask=m_t, other=0) != 0)
                b_d = tl.load(
                    p_doc + o_t[:, None] * stride_d_tok + o_k[None, :] * stride_d_dim,
                    mask=m_t[:, None] & m_k[None, :],
                    other=0.0,
                )
                y = _dot(b_q, tl.trans(b_d), DOT_PRECISION, UPCAST) * smooth_scale
                # Rows saved as +inf added nothing: their (maybe masked, NaN) tokens get 0.
                live = m_t[None, :] & (lse != float("inf"))[:, None]
                p = tl.where(live, tl.exp2(y - lse[:, None]), 0.0) * g
                acc += _dot(p.to(b_d.dtype), b_d, DOT_PRECISION, UPCAST)
        o_row = i_q * Lq + o_s
        m_out = m_s
    else:
        pid = tl.program_id(0).to(tl.int64)
        i_grp = pid // Ncols if PER_QUERY_DOCS else 0
        j = pid % Ncols
        o_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        m_t = o_t < Ld
        doc_row = (i_grp * Ncols + j) * Ld
        if HAS_D_MASK:
            m_t = m_t & (tl.load(DMask + doc_row + o_t, mask=m_t, other=0) != 0)
        b_d = tl.load(
            D + i_grp * stride_d_grp + j * stride_d_col + o_t[:, None] * stride_d_tok
            + o_k[None, :] * stride_d_dim,
            mask=m_t[:, None] & m_k[None, :],
            other=0.0,
        )
        q_lo = i_grp if PER_QUERY_DOCS else 0
        q_hi = i_grp + 1 if PER_QUERY_DOCS else Nq
        acc = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
        for i_q in range(q_lo, q_hi):
            g = tl.load(GradScores + i_q * stride_g_seq + j * stride_g_col)
            for s0 in range(0, Lq, BLOCK_S):
                o_s = s0 + tl.arange(0, BLOCK_S)
                m_s = o_s < Lq
                lse = tl.load(RowLse + (i_q * Ncols + j) * Lq + o_s, mask=m_s, other=float("inf"))
                # Tokens of rows that added nothing (masked ones among them) are never read.
                live_s = m_s & (lse != float("inf"))
                b_q = tl.load(
                    Q + i_q * stride_q_seq + o_s[:, None] * stride_q_tok
                    + o_k[None, :] * stride_q_dim,
                    mask=live_s[:, None] & m_k[None, :],
                    other=0.0,
                )
                y = _dot(b_d, tl.trans(b_q), DOT_PRECISION, UPCAST) * smooth_scale  # [T, S]
                p = tl.where(m_t[:, None] & live_s[None, :], tl.exp2(y - lse[None, :]), 0.0) * g
                acc += _dot(p.to(b_q.dtype), b_q, DOT_PRECISION, UPCAST)
        o_row = doc_row + o_t
        m_out = o_t < Ld
    tl.store(
        Grad + o_row[:, None] * dim + o_k[None, :],
        acc.to(Grad.dtype.element_ty),
        mask=m_out[:, None] & m_k[None, :],
    )
