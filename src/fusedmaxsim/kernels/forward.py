"""Triton kernels of the MaxSim forward, with a running max and argmax: dense
(``_maxsim_fwd_kernel``) and packed (``_maxsim_ragged_fwd_kernel``) side by side, and the inverse
norms (``_inverse_norm_kernel``).

Math
----
In :mod:`fusedmaxsim.kernels.common`: ``S``, ``A`` and ``score`` for the dense layouts (the cross
product, per-query candidates) and for packed sequences (the cross product, a pair list), and the
smooth max (``SMOOTH``), whose ``L`` the dense forward saves instead of ``A``.

Grid mapping
------------
* ``_maxsim_fwd_kernel``: program ``(j · n_splits + c, b)`` owns document column ``j``, a block of
  ``BLOCK_M = LQ_TILE · QUERIES_PER_BLOCK`` query rows and their ``LQ_TILE``-row chunks
  ``c, c + n_splits, …``. On the cross product several short queries share one block (each padded
  to ``LQ_TILE`` rows), so they share every document tile that is streamed through; queries longer
  than ``LQ_TILE`` are walked in chunks by a run-time loop, so one compiled kernel serves every
  query length of a bucket. With ``n_splits > 1`` the chunks of one (column, block) run in
  neighbouring programs, which start together and read the same document tiles while they are in
  L2, and each writes its part of the scores to its own slice of ``Out`` (``stride_out_split``
  apart) for the launcher to add up: one program walking every chunk streams its document once
  per chunk, from DRAM once the documents in flight outgrow L2. Document tokens stream in
  ``BLOCK_N`` tiles through :func:`_doc_max`, the one MaxSim inner loop that every layout shares.
  The ``[Lq, Ld]`` similarity tile lives only in registers.
* ``_maxsim_ragged_fwd_kernel`` (1-D grid). Cross product: program = (document column, block of
  ``QUERIES_PER_BLOCK`` queries), the query block varying fastest, so the programs that read one
  document run side by side and share it through L2 (a corpus is read from HBM about once). Pair
  list: program = pair. Each query occupies ``LQ_TILE`` rows of the ``BLOCK_M`` tile; a query
  longer than the tile is walked in chunks, up to the longest query of the block. The document
  streams through :func:`fusedmaxsim.kernels.common._doc_max`, the one MaxSim inner loop, over its
  true length ``[0, Ld_j)``: short documents cost what they hold, never the longest one.
* ``_maxsim_residual_fwd_kernel``: the dense cross product's mapping (program = document column,
  block of query rows; no chunk splits) over PLAID documents stored as packed rows (document
  ``j``: rows ``[starts[j], starts[j] + lengths[j])``; padded documents are rows ``j · Ld``
  onwards), or, with ``PER_QUERY_DOCS``, one query a block against its own candidate documents
  (column ``c`` of query ``i`` is document ``DocIds[i, c]``; an id < 0 scores -inf).
  ``_doc_max`` decompresses each document tile on chip from its centroid ids and residual codes
  (``common._residual_tile``) and runs to the document's length; norms from the tiles
  (``NORMALIZE``: the documents' tokens, ``NORMALIZE_Q``: the queries'). A length
  outside ``[0, max_len]`` or rows outside ``[0, n_rows)`` make the column's scores NaN, with
  nothing read; an id outside the centroids makes its token NaN.
* ``_maxsim_hidden_fwd_kernel``: the fused projection head, the dense cross product's mapping
  (program = document column, block of query rows; no chunk splits) over documents given as
  hidden states ``H [Nd, Ld, d_model]`` or, with ``PER_QUERY_DOCS``, ``[Nq, K, Ld, d_model]``
  (one query a block: column ``c`` of query ``i`` is ``H[i, c]``). ``_doc_max`` projects each
  document tile on chip (``common._hidden_tile``: ``F.linear(H, W, b)``, rounded to H's dtype)
  and never writes the projection; with ``NORMALIZE`` the projected tokens are normalized, their
  norms from the tiles (the queries are taken as they are). The document mask bounds the loop as
  in ``_maxsim_fwd_kernel`` (``_valid_span``).
* ``_inverse_norm_kernel``: program = a block of token rows; ``1 / max(‖x‖, eps)`` in fp32, each
  token read once (the norms are computed once per token, never per tile).

Caveats
-------
* Q, D (H and W) may have any strides; the forward's masks, inverse norms and outputs must be
  contiguous (the launcher makes them so), which lets the kernel derive their strides.
* NaN propagates and ties go to the lowest token index, as in ``_doc_max``.
* The fused projection head projects each document tile once per query block and query chunk:
  it pays where those are few (the planner's ``hidden_route``). Its bias must be contiguous.
* Those of the shared loop (NaN, ``UPCAST``, ``QUERY_IN_REGISTERS``, the projection's rounding)
  and of packed sequences (``max_seqlen_q`` / ``max_seqlen_d``, malformed offsets) are in
  :mod:`fusedmaxsim.kernels.common`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    MASK_SCAN,
    NORM_EPS,
    _chunk_scores,
    _doc_max,
    _inverse_norm,
    _query_chunk,
    _segment,
    _valid_span,
)


@triton.jit(do_not_specialize=["Nq", "Ncols", "Lq", "Ld", "n_splits", "stride_out_split"])
def _maxsim_fwd_kernel(
    Q,
    D,
    QMask,
    DMask,
    QInv,
    DInv,
    Out,
    Argmax,
    Nq,
    Ncols,
    Lq,
    Ld,
    n_splits,
    stride_out_split,
    dim,
    stride_q_seq,
    stride_q_tok,
    stride_q_dim,
    stride_d_grp,
    stride_d_col,
    stride_d_tok,
    stride_d_dim,
    smooth_scale,
    smooth_unscale,
    HAS_Q_MASK: tl.constexpr,
    HAS_D_MASK: tl.constexpr,
    NORMALIZE: tl.constexpr,
    NORM_FROM_TILES: tl.constexpr,
    SAVE_ARGMAX: tl.constexpr,
    SMOOTH: tl.constexpr,
    PER_QUERY_DOCS: tl.constexpr,
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
    i_col = tl.program_id(0).to(tl.int64) // n_splits
    i_split = tl.program_id(0) % n_splits
    i_blk = tl.program_id(1).to(tl.int64)

    o_r = tl.arange(0, BLOCK_M)
    o_query = i_blk * QUERIES_PER_BLOCK + o_r // LQ_TILE  # [BLOCK_M] query of each row
    o_row_in_tile = o_r % LQ_TILE
    m_query = o_query < Nq
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < dim

    # Per-query candidates have one query per block, and that query owns the document group.
    # Masks, inverse norms and outputs are contiguous (the launcher makes them so): their
    # strides follow from the shapes, which keeps the launch short.
    i_grp = i_blk if PER_QUERY_DOCS else 0
    p_doc = D + i_grp * stride_d_grp + i_col * stride_d_col
    doc_row = (i_grp * Ncols + i_col) * Ld if PER_QUERY_DOCS else i_col * Ld
    p_dmask = DMask + doc_row
    p_dinv = DInv + doc_row
    t_lo, t_hi, all_valid = 0, Ld, True
    if HAS_D_MASK:
        t_lo, t_hi, all_valid = _valid_span(p_dmask, 0, Ld, MASK_SCAN)

    acc = tl.zeros([QUERIES_PER_BLOCK], tl.float32)
    for chunk in range(i_split * LQ_TILE, Lq, n_splits * LQ_TILE):
        o_s = chunk + o_row_in_tile
        m_row = m_query & (o_s < Lq)
        b_q, m_valid = _query_chunk(
            Q, QMask, o_query * stride_q_seq + o_s * stride_q_tok, o_query * Lq + o_s, m_row, o_k,
            m_k, stride_q_dim, HAS_Q_MASK,
        )
        row_max, row_arg = _doc_max(
            b_q, p_doc, stride_d_tok, stride_d_dim, p_dmask, 1, p_dinv, 1,
            t_lo, t_hi, all_valid, o_k, m_k, smooth_scale, (D, 0, D, 0, D, 0), EVEN_K, NORMALIZE,
            NORM_FROM_TILES, SAVE_ARGMAX and not SMOOTH, SMOOTH, BLOCK_M, BLOCK_N, DOT_PRECISION,
            UPCAST, QUERY_IN_REGISTERS,
        )
        unit = 1.0
        if SMOOTH:
            unit = smooth_unscale  # log2 units back to tau · logsumexp(s / tau)
        q_inv = 1.0
        if NORMALIZE:
            if NORM_FROM_TILES:
                q_inv = _inverse_norm(b_q, NORM_EPS)
            else:
                q_inv = tl.load(QInv + o_query * Lq + o_s, mask=m_valid, other=0.0)
        acc += _chunk_scores(row_max, m_valid, unit, q_inv, QUERIES_PER_BLOCK, LQ_TILE)
        if SAVE_ARGMAX:
            if SMOOTH:
                # The backward's softmax is exp2(y - row_max); +inf where nothing was added
                # makes it 0 there.
                keep = m_valid & (row_max != float("-inf"))
                tl.store(Argmax + (o_query * Ncols + i_col) * Lq + o_s,
                         tl.where(keep, row_max, float("inf")), mask=m_row)
            else:
                arg = tl.where(m_valid, row_arg, -1)
                tl.store(Argmax + (o_query * Ncols + i_col) * Lq + o_s, arg, mask=m_row)

    o_out = i_blk * QUERIES_PER_BLOCK + tl.arange(0, QUERIES_PER_BLOCK)
    tl.store(Out + i_split.to(tl.int64) * stride_out_split + o_out * Ncols + i_col, acc, mask=o_out < Nq)


@triton.jit(do_not_specialize=["Nq", "Ncols", "Lq", "max_len", "n_rows", "n_centroids"])
def _maxsim_residual_fwd_kernel(
    Q,
    Codes,
    Residuals,
    Starts,
    Lengths,
    DocIds,
    Centroids,
    WeightTable,
    QMask,
    Out,
    Argmax,
    Nq,
    Ncols,
    Lq,
    max_len,
    n_rows,
    n_centroids,
    dim,
    stride_q_seq,
    stride_q_tok,
    stride_q_dim,
    stride_code_tok,
    stride_res_tok,
    stride_cent,
    HAS_Q_MASK: tl.constexpr,
    NORMALIZE: tl.constexpr,
    NORMALIZE_Q: tl.constexpr,
    SAVE_ARGMAX: tl.constexpr,
    PER_QUERY_DOCS: tl.constexpr,
    LQ_TILE: tl.constexpr,
    QUERIES_PER_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    QUERY_IN_REGISTERS: tl.constexpr,
    NBITS: tl.constexpr,
):
    BLOCK_M: tl.constexpr = LQ_TILE * QUERIES_PER_BLOCK
    i_col = tl.program_id(0).to(tl.int64)
    i_blk = tl.program_id(1).to(tl.int64)
    o_r = tl.arange(0, BLOCK_M)
    o_query = i_blk * QUERIES_PER_BLOCK + o_r // LQ_TILE
    o_row_in_tile = o_r % LQ_TILE
    m_query = o_query < Nq
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < dim

    # The column's document: the column itself, or (one query a block) the query's candidate.
    doc = i_col
    if PER_QUERY_DOCS:
        doc = tl.load(DocIds + i_blk * Ncols + i_col).to(tl.int64)
    missing = doc < 0
    doc = tl.maximum(doc, 0)
    start = tl.load(Starts + doc).to(tl.int64)
    length = tl.load(Lengths + doc).to(tl.int64)
    broken = (length < 0) | (length > max_len) | (start < 0) | (start + length > n_rows)
    t_hi = tl.where(broken | missing, 0, length).to(tl.int32)  # token indices are int32
    p_codes = Codes + tl.maximum(start, 0) * stride_code_tok
    res = (Residuals + tl.maximum(start, 0) * stride_res_tok, stride_res_tok, Centroids,
           stride_cent, WeightTable, n_centroids, dim)
    acc = tl.zeros([QUERIES_PER_BLOCK], tl.float32)
    for chunk in range(0, Lq, LQ_TILE):
        o_s = chunk + o_row_in_tile
        m_row = m_query & (o_s < Lq)
        b_q, m_valid = _query_chunk(
            Q, QMask, o_query * stride_q_seq + o_s * stride_q_tok, o_query * Lq + o_s, m_row, o_k,
            m_k, stride_q_dim, HAS_Q_MASK,
        )
        row_max, row_arg = _doc_max(
            b_q, p_codes, stride_code_tok, 0, p_codes, 1, p_codes, 1, 0, t_hi, True, o_k, m_k,
            1.0, res, EVEN_K, NORMALIZE, NORMALIZE, SAVE_ARGMAX, False, BLOCK_M, BLOCK_N,
            DOT_PRECISION, UPCAST, QUERY_IN_REGISTERS, NBITS,
        )
        q_inv = 1.0
        if NORMALIZE_Q:
            q_inv = _inverse_norm(b_q, NORM_EPS)
        acc += _chunk_scores(row_max, m_valid, 1.0, q_inv, QUERIES_PER_BLOCK, LQ_TILE)
        if SAVE_ARGMAX:
            arg = tl.where(m_valid, row_arg, -1)
            tl.store(Argmax + (o_query * Ncols + i_col) * Lq + o_s, arg, mask=m_row)
    acc = tl.where(broken, float("nan"), acc)
    acc = tl.where(missing, float("-inf"), acc)
    o_out = i_blk * QUERIES_PER_BLOCK + tl.arange(0, QUERIES_PER_BLOCK)
    tl.store(Out + o_out * Ncols + i_col, acc, mask=o_out < Nq)


@triton.jit(do_not_specialize=["Nq", "Ncols", "Lq", "Ld", "d_model"])
def _maxsim_hidden_fwd_kernel(
    Q,
    H,
    W,
    Bias,
    QMask,
    DMask,
    Out,
    Argmax,
    Nq,
    Ncols,
    Lq,
    Ld,
    d_model,
    dim,
    stride_q_seq,
    stride_q_tok,
    stride_q_dim,
    stride_h_grp,
    stride_h_col,
    stride_h_tok,
    stride_h_dim,
    stride_w_out,
    stride_w_in,
    HAS_Q_MASK: tl.constexpr,
    HAS_D_MASK: tl.constexpr,
    NORMALIZE: tl.constexpr,
    SAVE_ARGMAX: tl.constexpr,
    PER_QUERY_DOCS: tl.constexpr,
    LQ_TILE: tl.constexpr,
    QUERIES_PER_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    QUERY_IN_REGISTERS: tl.constexpr,
    HIDDEN_BLOCK: tl.constexpr,
    HIDDEN_BIAS: tl.constexpr,
):
    BLOCK_M: tl.constexpr = LQ_TILE * QUERIES_PER_BLOCK
    i_col = tl.program_id(0).to(tl.int64)
    i_blk = tl.program_id(1).to(tl.int64)
    o_r = tl.arange(0, BLOCK_M)
    o_query = i_blk * QUERIES_PER_BLOCK + o_r // LQ_TILE
    o_row_in_tile = o_r % LQ_TILE
    m_query = o_query < Nq
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < dim

    # The column's hidden states: document i_col, or (one query a block) the query's candidate.
    i_grp = i_blk if PER_QUERY_DOCS else 0
    p_doc = H + i_grp * stride_h_grp + i_col * stride_h_col
    doc_row = (i_grp * Ncols + i_col) * Ld if PER_QUERY_DOCS else i_col * Ld
    p_dmask = DMask + doc_row
    t_lo, t_hi, all_valid = 0, Ld, True
    if HAS_D_MASK:
        t_lo, t_hi, all_valid = _valid_span(p_dmask, 0, Ld, MASK_SCAN)
    hid = (stride_h_dim, W, stride_w_out, stride_w_in, Bias, d_model)
    acc = tl.zeros([QUERIES_PER_BLOCK], tl.float32)
    for chunk in range(0, Lq, LQ_TILE):
        o_s = chunk + o_row_in_tile
        m_row = m_query & (o_s < Lq)
        b_q, m_valid = _query_chunk(
            Q, QMask, o_query * stride_q_seq + o_s * stride_q_tok, o_query * Lq + o_s, m_row, o_k,
            m_k, stride_q_dim, HAS_Q_MASK,
        )
        row_max, row_arg = _doc_max(
            b_q, p_doc, stride_h_tok, 0, p_dmask, 1, p_dmask, 1, t_lo, t_hi, all_valid, o_k,
            m_k, 1.0, hid, EVEN_K, NORMALIZE, NORMALIZE, SAVE_ARGMAX, False, BLOCK_M, BLOCK_N,
            DOT_PRECISION, UPCAST, QUERY_IN_REGISTERS, HIDDEN_BLOCK=HIDDEN_BLOCK,
            HIDDEN_BIAS=HIDDEN_BIAS,
        )
        acc += _chunk_scores(row_max, m_valid, 1.0, 1.0, QUERIES_PER_BLOCK, LQ_TILE)
        if SAVE_ARGMAX:
            arg = tl.where(m_valid, row_arg, -1)
            tl.store(Argmax + (o_query * Ncols + i_col) * Lq + o_s, arg, mask=m_row)
    o_out = i_blk * QUERIES_PER_BLOCK + tl.arange(0, QUERIES_PER_BLOCK)
    tl.store(Out + o_out * Ncols + i_col, acc, mask=o_out < Nq)


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
            t_lo, t_hi, all_valid, o_k, m_k, 1.0, (D, 0, D, 0, D, 0), EVEN_K, NORMALIZE, False,
            SAVE_ARGMAX, False, BLOCK_M, BLOCK_N, DOT_PRECISION, UPCAST, QUERY_IN_REGISTERS,
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


@triton.jit(do_not_specialize=["n_rows"])
def _inverse_norm_kernel(
    X,
    Out,
    n_rows,
    dim,
    stride_x_row,
    stride_x_dim,
    EPS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``Out[r] = 1 / max(‖X[r]‖, EPS)`` in fp32, reading each token once in its own dtype.

    (``torch.linalg.vector_norm(x, dtype=float32)`` first writes an fp32 copy of ``x``: three
    times the bytes on a 16-bit input.)
    """
    o_r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    m_r = o_r < n_rows
    o_k = tl.arange(0, BLOCK_K)
    x = tl.load(
        X + o_r[:, None] * stride_x_row + o_k[None, :] * stride_x_dim,
        mask=m_r[:, None] & (o_k < dim)[None, :],
        other=0.0,
    )
    tl.store(Out + o_r, _inverse_norm(x, EPS), mask=m_r)

