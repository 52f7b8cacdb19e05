"""Triton kernels of MaxSim on packed (ragged) sequences: the cross product and a pair list.

Math
----
Queries are packed rows ``Q [Tq, d]`` with offsets ``cu_q [Nq + 1]``: query ``i`` owns the rows
``[cu_q[i], cu_q[i + 1])``, ``Lq_i`` of them. Documents likewise: ``D [Td, d]``, ``cu_d [Nd + 1]``.
A scored pair ``(i, j)`` is, with the masks and inverse norms of ``_kernels``::

    A[i, j, s]  = argmax_{t < Ld_j, valid} <Q[cu_q[i] + s], D[cu_d[j] + t]>   (lowest t; -1 if none)
    score(i, j) = Σ_{s < Lq_i, valid, A >= 0} <Q[cu_q[i] + s], D[cu_d[j] + A[i, j, s]]>

Two sets of pairs share every kernel here:

* the cross product (``PAIRS=False``): every ``(i, j)``; scores ``[Nq, n_cols]`` for the documents
  ``col_lo + [0, n_cols)``; argmax ``[n_cols, Tq]``, indexed by (column, packed query row), so
  its size is independent of any maximum length and every kernel reads it with unit stride;
* a pair list (``PAIRS=True``): pair ``p`` is ``(pair_q[p], pair_d[p])``; scores ``[P]``; argmax
  ``[P, max_seqlen_q]``, indexed by (pair, query token). Pairs may repeat queries or documents.

The backward needs no matrix product of the similarities, only the argmax (``A`` is a document
token index, local to its document)::

    grad_Q[cu_q[i] + s] = Σ_{pairs (i, j)} g(i, j) · D[cu_d[j] + A[i, j, s]]
    grad_D[cu_d[j] + t] = Σ_{pairs (i, j)} Σ_{s: A[i, j, s] = t} g(i, j) · Q[cu_q[i] + s]

Grid mapping
------------
* ``_maxsim_ragged_fwd_kernel`` (1-D grid). Cross product: program = (document column, block of
  ``QUERIES_PER_BLOCK`` queries), the query block varying fastest, so the programs that read one
  document run side by side and share it through L2 (a corpus is read from HBM about once). Pair
  list: program = pair. Each query occupies ``LQ_TILE`` rows of the ``BLOCK_M`` tile; a query
  longer than the tile is walked in chunks, up to the longest query of the block. The document
  streams through :func:`fusedmaxsim._kernels._doc_max`, the one MaxSim inner loop, over its true
  length ``[0, Ld_j)``: short documents cost what they hold, never the longest one.
* ``_maxsim_ragged_bwd_dq_kernel``: program = (query, token block, split); it owns ``grad_Q`` rows
  and gathers, for each of its query's pairs (all columns, or its slice of the pair list sorted by
  query), the winning document rows. With ``splits > 1`` (the "unified" strategy) the pairs are
  dealt round-robin to the splits, which add into an fp32 ``grad_Q`` with atomics; with
  ``SCATTER_GRAD_D`` the program also scatters ``g · Q`` rows into an fp32 ``grad_D`` with atomics.
* ``_maxsim_ragged_bwd_dd_kernel``: program = (document, token block); it owns ``grad_D`` rows and
  adds ``onehot(A == t)ᵀ @ (g · Q)`` over the document's query rows: every packed query row for
  the cross product (flattened, no padding), the rows of each pair of the document (the pair list
  sorted by document) otherwise. No atomics: bitwise reproducible.

Caveats
-------
* ``max_seqlen_q`` / ``max_seqlen_d`` choose tiles and bound the pair-list argmax; no loop runs to
  them. A sequence longer than the bound it was promised makes its scores NaN (loud, and never an
  out-of-bounds access); offsets are clamped into ``[0, rows]`` and argmax entries into
  ``[0, Ld_j)``, so malformed ``cu_seqlens`` give wrong numbers, never a dead CUDA context.
  A pair whose index is out of range scores NaN and reads nothing.
* NaN propagates and ties go to the lowest token index, as in ``_doc_max``.
* ``splits > 1`` and ``SCATTER_GRAD_D`` are not bitwise reproducible (fp32 atomics).
* ``UPCAST`` computes dots in fp32: the Triton interpreter's bf16 ``tl.dot`` is wrong on CPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._kernels import MASK_SCAN, _chunk_scores, _dd_product, _doc_max, _query_chunk, _valid_span


@triton.jit
def _segment(Cu, idx, mask, n_rows):
    """First packed row and length of sequence ``idx`` (scalar or vector), clamped into
    ``[0, n_rows]`` so that malformed offsets can never address outside the packed tensor."""
    lo = tl.load(Cu + idx, mask=mask, other=0).to(tl.int64)
    hi = tl.load(Cu + idx + 1, mask=mask, other=0).to(tl.int64)
    lo = tl.minimum(tl.maximum(lo, 0), n_rows)
    hi = tl.minimum(tl.maximum(hi, lo), n_rows)
    return lo, hi - lo


@triton.jit(
    do_not_specialize=[
        "n_queries", "n_docs", "n_cols", "n_qblocks", "col_lo", "rows_q", "rows_d", "max_q",
        "max_d",
    ]
)
def _maxsim_ragged_fwd_kernel(
    Q,
    D,
    CuQ,
    CuD,
    PairQ,
    PairD,
    QMask,
    DMask,
    QInv,
    DInv,
    Out,
    Argmax,
    n_queries,
    n_docs,
    n_cols,
    n_qblocks,
    col_lo,
    rows_q,
    rows_d,
    max_q,
    max_d,
    dim,
    stride_q_tok,
    stride_q_dim,
    stride_d_tok,
    stride_d_dim,
    PAIRS: tl.constexpr,
    HAS_Q_MASK: tl.constexpr,
    HAS_D_MASK: tl.constexpr,
    NORMALIZE: tl.constexpr,
    SAVE_ARGMAX: tl.constexpr,
    LQ_TILE: tl.constexpr,
    QUERIES_PER_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    QUERY_IN_REGISTERS: tl.constexpr,
):
    BLOCK_M: tl.constexpr = LQ_TILE * QUERIES_PER_BLOCK
    pid = tl.program_id(0).to(tl.int64)
    o_r = tl.arange(0, BLOCK_M)
    o_row_in_tile = o_r % LQ_TILE
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < dim

    if PAIRS:
        # QUERIES_PER_BLOCK == 1: the tile holds the pair's one query.
        i_query = tl.load(PairQ + pid).to(tl.int64)
        i_doc = tl.load(PairD + pid).to(tl.int64)
        in_range = (i_query >= 0) & (i_query < n_queries) & (i_doc >= 0) & (i_doc < n_docs)
        o_query = tl.zeros([BLOCK_M], tl.int64) + i_query
        # Not `(o_r >= 0) & in_range`: a vector & a scalar bool trips the interpreter.
        m_query = o_r < tl.where(in_range, BLOCK_M, 0)
        o_out = pid + tl.arange(0, QUERIES_PER_BLOCK)
        p_out = Out + o_out
        m_out = o_out == pid
    else:
        i_blk = pid % n_qblocks
        i_col = pid // n_qblocks
        i_doc = col_lo + i_col
        in_range = i_doc < n_docs
        o_query = i_blk * QUERIES_PER_BLOCK + o_r // LQ_TILE  # [BLOCK_M] query of each row
        m_query = o_query < n_queries
        o_out = i_blk * QUERIES_PER_BLOCK + tl.arange(0, QUERIES_PER_BLOCK)
        p_out = Out + o_out * n_cols + i_col
        m_out = o_out < n_queries

    d_lo, d_len = _segment(CuD, i_doc, in_range, rows_d)
    p_doc = D + d_lo * stride_d_tok
    p_dmask = DMask + d_lo
    p_dinv = DInv + d_lo
    q_lo, q_len = _segment(CuQ, o_query, m_query, rows_q)  # [BLOCK_M], 0 for absent queries
    t_lo, t_hi, all_valid = 0, d_len.to(tl.int32), True
    if HAS_D_MASK:
        t_lo, t_hi, all_valid = _valid_span(p_dmask, 0, d_len.to(tl.int32), MASK_SCAN)

    acc = tl.zeros([QUERIES_PER_BLOCK], tl.float32)
    for chunk in range(0, tl.max(q_len), LQ_TILE):
        o_s = chunk + o_row_in_tile
        m_row = o_s < q_len
        o_row = q_lo + o_s  # packed query row
        b_q, m_valid = _query_chunk(
            Q, QMask, o_row * stride_q_tok, o_row, m_row, o_k, m_k, stride_q_dim, HAS_Q_MASK
        )
        row_max, row_arg = _doc_max(
            b_q, p_doc, stride_d_tok, stride_d_dim, p_dmask, 1, p_dinv, 1,
            t_lo, t_hi, all_valid, o_k, m_k, 1.0, EVEN_K, NORMALIZE, False, SAVE_ARGMAX,
            False, BLOCK_M, BLOCK_N, DOT_PRECISION, UPCAST, QUERY_IN_REGISTERS,
        )
        q_inv = 1.0
        if NORMALIZE:
            q_inv = tl.load(QInv + o_row, mask=m_valid, other=0.0)
        acc += _chunk_scores(row_max, m_valid, 1.0, q_inv, QUERIES_PER_BLOCK, LQ_TILE)
        if SAVE_ARGMAX:
            arg = tl.where(m_valid, row_arg, -1)
            if PAIRS:
                tl.store(Argmax + pid * max_q + o_s, arg, mask=m_row & (o_s < max_q))
            else:
                tl.store(Argmax + i_col * rows_q + o_row, arg, mask=m_row)

    # A sequence longer than its promised bound poisons its scores; so does a bad pair index.
    q_len_out = tl.max(tl.reshape(q_len, (QUERIES_PER_BLOCK, LQ_TILE)), axis=1)
    acc = tl.where(q_len_out > max_q, float("nan"), acc)
    acc = tl.where((d_len > max_d) | (in_range == 0), float("nan"), acc)
    tl.store(p_out, acc, mask=m_out)


@triton.jit(
    do_not_specialize=[
        "n_queries", "n_docs", "n_cols", "rows_q", "rows_d", "max_q", "n_sblocks", "n_splits",
    ]
)
def _maxsim_ragged_bwd_dq_kernel(
    Grad,
    Q,
    D,
    CuQ,
    CuD,
    PairD,
    PairsByQuery,
    PairStartsQ,
    QInv,
    DInv,
    Argmax,
    GradQ,
    GradD,
    n_queries,
    n_docs,
    n_cols,
    rows_q,
    rows_d,
    max_q,
    n_sblocks,
    n_splits,
    dim,
    stride_g_row,
    stride_g_col,
    stride_q_tok,
    stride_q_dim,
    stride_d_tok,
    stride_d_dim,
    stride_gq_tok,
    stride_gq_dim,
    stride_gd_tok,
    stride_gd_dim,
    PAIRS: tl.constexpr,
    NORMALIZE: tl.constexpr,
    COMPUTE_GRAD_Q: tl.constexpr,
    ATOMIC_GRAD_Q: tl.constexpr,
    SCATTER_GRAD_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    i_query = pid // n_sblocks
    i_sb = pid % n_sblocks
    i_split = tl.program_id(1).to(tl.int64)
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < dim

    q_lo, q_len = _segment(CuQ, i_query, i_query < n_queries, rows_q)
    if PAIRS:
        item_lo = tl.load(PairStartsQ + i_query).to(tl.int64)
        item_hi = tl.load(PairStartsQ + i_query + 1).to(tl.int64)
    else:
        item_lo = 0
        item_hi = n_cols

    # Token blocks beyond the grid's (a hint's) reach are taken round-robin: the query's true
    # length decides the work.
    for sb in range(i_sb, tl.cdiv(q_len, BLOCK_S), n_sblocks):
        o_s = sb * BLOCK_S + tl.arange(0, BLOCK_S)
        m_s = o_s < q_len
        o_row = q_lo + o_s
        if SCATTER_GRAD_D:
            b_q = tl.load(
                Q + o_row[:, None] * stride_q_tok + o_k[None, :] * stride_q_dim,
                mask=m_s[:, None] & m_k[None, :],
                other=0.0,
            ).to(tl.float32)
            if NORMALIZE:
                b_q = b_q * tl.load(QInv + o_row, mask=m_s, other=0.0)[:, None]
        acc = tl.zeros([BLOCK_S, BLOCK_K], tl.float32)
        for item in range(item_lo + i_split, item_hi, n_splits):
            if PAIRS:
                i_pair = tl.load(PairsByQuery + item).to(tl.int64)
                i_doc = tl.load(PairD + i_pair).to(tl.int64)
                g = tl.load(Grad + i_pair * stride_g_row).to(tl.float32)
                idx = tl.load(Argmax + i_pair * max_q + o_s, mask=m_s & (o_s < max_q), other=-1)
            else:
                i_doc = item
                g = tl.load(Grad + i_query * stride_g_row + item * stride_g_col).to(tl.float32)
                idx = tl.load(Argmax + item * rows_q + o_row, mask=m_s, other=-1)
            d_lo, d_len = _segment(CuD, i_doc, (i_doc >= 0) & (i_doc < n_docs), rows_d)
            m_hit = (idx >= 0) & (idx < d_len)
            o_t = d_lo + tl.where(m_hit, idx, 0).to(tl.int64)  # packed document row
            m_rows = m_hit[:, None] & m_k[None, :]
            if COMPUTE_GRAD_Q:
                b_d = tl.load(
                    D + o_t[:, None] * stride_d_tok + o_k[None, :] * stride_d_dim,
                    mask=m_rows,
                    other=0.0,
                ).to(tl.float32)
                if NORMALIZE:
                    b_d = b_d * tl.load(DInv + o_t, mask=m_hit, other=0.0)[:, None]
                acc += g * b_d
            if SCATTER_GRAD_D:
                tl.atomic_add(
                    GradD + o_t[:, None] * stride_gd_tok + o_k[None, :] * stride_gd_dim,
                    g * b_q,
                    mask=m_rows,
                    sem="relaxed",
                )
        if COMPUTE_GRAD_Q:
            p_gq = GradQ + o_row[:, None] * stride_gq_tok + o_k[None, :] * stride_gq_dim
            m_gq = m_s[:, None] & m_k[None, :]
            if ATOMIC_GRAD_Q:
                tl.atomic_add(p_gq, acc, mask=m_gq, sem="relaxed")
            else:
                tl.store(p_gq, acc.to(GradQ.dtype.element_ty), mask=m_gq)


@triton.jit
def _onehot_rows(
    acc, o_t, idx, g, o_row, m_r, Q, QInv, stride_q_tok, stride_q_dim, o_k, m_k,
    NORMALIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """``acc [BLOCK_T, BLOCK_K] += onehot(idx == t)ᵀ @ (g · Q rows)``, rounded before the product
    as :func:`_kernels._dd_product` says (fp16: ``g · Q``, ``g`` not scaled here)."""
    if NORMALIZE:
        g = g * tl.load(QInv + o_row, mask=m_r, other=0.0)
    b_q = tl.load(
        Q + o_row[:, None] * stride_q_tok + o_k[None, :] * stride_q_dim,
        mask=(m_r & (idx >= 0))[:, None] & m_k[None, :],
        other=0.0,
    )
    return acc + _dd_product(o_t, idx, g, b_q, DOT_PRECISION, UPCAST, False)


@triton.jit(
    do_not_specialize=["n_queries", "n_docs", "rows_q", "rows_d", "max_q", "n_tblocks"]
)
def _maxsim_ragged_bwd_dd_kernel(
    Grad,
    Q,
    CuQ,
    CuD,
    PairQ,
    PairsByDoc,
    PairStartsD,
    RowQuery,
    QInv,
    Argmax,
    GradD,
    n_queries,
    n_docs,
    rows_q,
    rows_d,
    max_q,
    n_tblocks,
    dim,
    stride_g_row,
    stride_g_col,
    stride_q_tok,
    stride_q_dim,
    stride_gd_tok,
    stride_gd_dim,
    PAIRS: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    i_doc = pid // n_tblocks
    i_tb = pid % n_tblocks
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < dim
    d_lo, d_len = _segment(CuD, i_doc, i_doc < n_docs, rows_d)

    for tb in range(i_tb, tl.cdiv(d_len, BLOCK_T), n_tblocks):
        o_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        m_t = o_t < d_len
        acc = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
        if PAIRS:
            item_lo = tl.load(PairStartsD + i_doc).to(tl.int64)
            item_hi = tl.load(PairStartsD + i_doc + 1).to(tl.int64)
            for item in range(item_lo, item_hi):
                i_pair = tl.load(PairsByDoc + item).to(tl.int64)
                i_query = tl.load(PairQ + i_pair).to(tl.int64)
                q_lo, q_len = _segment(
                    CuQ, i_query, (i_query >= 0) & (i_query < n_queries), rows_q
                )
                g = tl.load(Grad + i_pair * stride_g_row).to(tl.float32)
                for r0 in range(0, tl.minimum(q_len, max_q), BLOCK_R):
                    o_s = r0 + tl.arange(0, BLOCK_R)
                    m_r = (o_s < q_len) & (o_s < max_q)
                    idx = tl.load(Argmax + i_pair * max_q + o_s, mask=m_r, other=-1)
                    acc = _onehot_rows(
                        acc, o_t, idx, tl.zeros([BLOCK_R], tl.float32) + g, q_lo + o_s, m_r, Q,
                        QInv, stride_q_tok, stride_q_dim, o_k, m_k, NORMALIZE, DOT_PRECISION,
                        UPCAST,
                    )
        else:
            for r0 in range(0, rows_q, BLOCK_R):
                o_row = r0 + tl.arange(0, BLOCK_R)
                m_r = o_row < rows_q
                o_query = tl.load(RowQuery + o_row, mask=m_r, other=0).to(tl.int64)
                m_r = m_r & (o_query < n_queries)
                idx = tl.load(Argmax + i_doc * rows_q + o_row, mask=m_r, other=-1)
                g = tl.load(
                    Grad + o_query * stride_g_row + i_doc * stride_g_col, mask=m_r, other=0.0
                ).to(tl.float32)
                acc = _onehot_rows(
                    acc, o_t, idx, g, o_row, m_r, Q, QInv, stride_q_tok, stride_q_dim, o_k, m_k,
                    NORMALIZE, DOT_PRECISION, UPCAST,
                )
        tl.store(
            GradD + (d_lo + o_t)[:, None] * stride_gd_tok + o_k[None, :] * stride_gd_dim,
            acc.to(GradD.dtype.element_ty),
            mask=m_t[:, None] & m_k[None, :],
        )
