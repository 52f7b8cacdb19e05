"""Triton kernels of the MaxSim backward from the forward's argmax, dense and packed side by
side: the ``grad_Q`` gathers (``_maxsim_bwd_gather_kernel``, ``_maxsim_ragged_bwd_dq_kernel``), the
document-owned ``grad_D`` (``_maxsim_bwd_dd_kernel``, ``_maxsim_ragged_bwd_dd_kernel``) and the
drain of the atomic ``grad_D`` buffer (``_drain_chunk_kernel``).

Math
----
In :mod:`fusedmaxsim.kernels.common`: the backward needs no second matrix product, only the argmax
``A``, for the dense layouts and for packed sequences. (The smooth max's backward, which
recomputes the softmax, is :mod:`fusedmaxsim.kernels.smooth`.)

Grid mapping
------------
* ``_maxsim_bwd_gather_kernel``: program ``(i, s-block, column split)`` of the columns
  ``[col_base, col_end)``, walked ``COLS_PER_STEP`` at a time, gathers the winning document rows
  for ``grad_Q`` (row-owned) and, in the "unified" strategy, scatters ``g · Q`` rows into an fp32
  ``grad_D`` buffer with atomics (the buffer's column 0 is ``col_base``: large ``grad_D`` goes
  through it in column chunks).
* ``_drain_chunk_kernel``: casts a finished column chunk of that buffer into ``grad_D`` and
  clears it for the next chunk.
* ``_maxsim_ragged_bwd_dq_kernel``: program = (query, token block, split); it owns ``grad_Q`` rows
  and gathers, for each of its query's pairs (all columns, or its slice of the pair list sorted by
  query), the winning document rows. With ``splits > 1`` (the "unified" strategy) the pairs are
  dealt round-robin to the splits, which add into an fp32 ``grad_Q`` with atomics; with
  ``SCATTER_GRAD_D`` the program also scatters ``g · Q`` rows into an fp32 ``grad_D`` with atomics.
* ``_maxsim_bwd_dd_kernel``: program ``(g, j, t-blocks)`` owns tiles of ``grad_D`` and adds
  ``onehot(A == t)ᵀ @ (g · Q)`` over blocks of the group's (query, token) rows; per-query
  candidates load their rows once for several tiles; on the cross product a tile reads only the
  rows that won one of its tokens, through the winner index of ``winner_index``. No atomics:
  bitwise reproducible. Each row's weight ``g`` (bf16, fp32; fp16 once divided by a power of two
  of its column's largest ``|g|``, multiplied back at the store) or ``g · Q`` (fp16 with
  normalize) is rounded to the input dtype before the product, an error of the same size as
  writing the gradient in that dtype.
* ``_maxsim_ragged_bwd_dd_kernel``: program = (document, token block); it owns ``grad_D`` rows and
  adds ``onehot(A == t)ᵀ @ (g · Q)`` over the document's query rows: every packed query row for
  the cross product (flattened, no padding), the rows of each pair of the document (the pair list
  sorted by document) otherwise. No atomics: bitwise reproducible.

Caveats
-------
* The atomic paths (``SCATTER_GRAD_D``, ``ATOMIC_GRAD_Q``) are not bitwise reproducible: fp32
  additions land in varying order.
* ``splits > 1`` and ``SCATTER_GRAD_D`` are not bitwise reproducible (fp32 atomics).
* Those of the shared helpers (``UPCAST``) and of packed sequences (malformed offsets, argmax
  entries out of range) are in :mod:`fusedmaxsim.kernels.common`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _dd_product, _segment
from .winner_index import tile_start


@triton.jit(do_not_specialize=["Nq", "Ncols", "Lq", "Ld", "col_base", "col_end", "cols_per_split"])
def _maxsim_bwd_gather_kernel(
    Grad,
    Q,
    D,
    QInv,
    DInv,
    Argmax,
    GradQ,
    GradD,
    Nq,
    Ncols,
    Lq,
    Ld,
    dim,
    col_base,
    col_end,
    cols_per_split,
    stride_g_seq,
    stride_g_col,
    stride_q_seq,
    stride_q_tok,
    stride_q_dim,
    stride_d_grp,
    stride_d_col,
    stride_d_tok,
    stride_d_dim,
    stride_qinv_seq,
    stride_qinv_tok,
    stride_dinv_grp,
    stride_dinv_col,
    stride_dinv_tok,
    stride_gq_seq,
    stride_gq_tok,
    stride_gq_dim,
    stride_gd_grp,
    stride_gd_col,
    stride_gd_tok,
    stride_gd_dim,
    PER_QUERY_DOCS: tl.constexpr,
    NORMALIZE: tl.constexpr,
    COMPUTE_GRAD_Q: tl.constexpr,
    ATOMIC_GRAD_Q: tl.constexpr,
    SCATTER_GRAD_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COLS_PER_STEP: tl.constexpr,
):
    n_sblocks = tl.cdiv(Lq, BLOCK_S)
    pid = tl.program_id(0).to(tl.int64)
    i_q = pid // n_sblocks
    i_sb = pid % n_sblocks
    i_split = tl.program_id(1).to(tl.int64)

    o_s = i_sb * BLOCK_S + tl.arange(0, BLOCK_S)
    m_s = o_s < Lq
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < dim
    i_grp = i_q if PER_QUERY_DOCS else 0

    if SCATTER_GRAD_D:
        b_q = tl.load(
            Q + i_q * stride_q_seq + o_s[:, None] * stride_q_tok + o_k[None, :] * stride_q_dim,
            mask=m_s[:, None] & m_k[None, :],
            other=0.0,
        ).to(tl.float32)
        if NORMALIZE:
            q_inv = tl.load(QInv + i_q * stride_qinv_seq + o_s * stride_qinv_tok, mask=m_s, other=0.0)
            b_q = b_q * q_inv[:, None]

    acc = tl.zeros([BLOCK_S, BLOCK_K], tl.float32)
    col_lo = col_base + i_split * cols_per_split
    col_hi = tl.minimum(col_lo + cols_per_split, col_end)
    # A column's loads wait on each other (its argmax, then the document rows that names). The
    # columns of one step are unrolled, so their loads are all issued before the first is used:
    # that hides the latency where too few programs share an SM to hide it for each other.
    for col_step in range(col_lo, col_hi, COLS_PER_STEP):
        for c in tl.static_range(COLS_PER_STEP):
            col = col_step + c
            # A column past the program's last reads no row (every idx -1) and the last one's g,
            # in bounds, zeroed. The masks are vectors: the interpreter takes no scalar load mask,
            # and its `&` of a vector and a scalar is not boolean.
            m_col = tl.full([BLOCK_S], col, tl.int64) < col_hi
            g = tl.load(Grad + i_q * stride_g_seq + tl.minimum(col, col_hi - 1) * stride_g_col)
            g = tl.where(col < col_hi, g.to(tl.float32), 0.0)
            idx = tl.load(Argmax + (i_q * Ncols + col) * Lq + o_s, mask=m_s & m_col, other=-1)
            m_hit = idx >= 0
            idx = tl.where(m_hit, idx, 0).to(tl.int64)
            m_rows = m_hit[:, None] & m_k[None, :]
            if COMPUTE_GRAD_Q:
                b_d = tl.load(
                    D + i_grp * stride_d_grp + col * stride_d_col + idx[:, None] * stride_d_tok
                    + o_k[None, :] * stride_d_dim,
                    mask=m_rows,
                    other=0.0,
                ).to(tl.float32)
                if NORMALIZE:
                    d_inv = tl.load(
                        DInv + i_grp * stride_dinv_grp + col * stride_dinv_col + idx * stride_dinv_tok,
                        mask=m_hit,
                        other=0.0,
                    )
                    b_d = b_d * d_inv[:, None]
                acc += g * b_d
            if SCATTER_GRAD_D:
                tl.atomic_add(
                    GradD + i_grp * stride_gd_grp + (col - col_base) * stride_gd_col + idx[:, None] * stride_gd_tok
                    + o_k[None, :] * stride_gd_dim,
                    g * b_q,
                    mask=m_rows,
                    sem="relaxed",
                )

    if COMPUTE_GRAD_Q:
        p_gq = GradQ + i_q * stride_gq_seq + o_s[:, None] * stride_gq_tok + o_k[None, :] * stride_gq_dim
        m_gq = m_s[:, None] & m_k[None, :]
        if ATOMIC_GRAD_Q:
            tl.atomic_add(p_gq, acc, mask=m_gq, sem="relaxed")
        else:
            tl.store(p_gq, acc.to(GradQ.dtype.element_ty), mask=m_gq)


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
def _dd_rows(
    Grad, Q, QInv, Argmax, o_r, m_r, i_col, Ncols, Lq, o_k, m_k,
    stride_g_seq, stride_g_col, stride_q_seq, stride_q_tok, stride_q_dim,
    stride_qinv_seq, stride_qinv_tok,
    NORMALIZE: tl.constexpr, ROWS_WON: tl.constexpr,
):
    """Rows ``o_r`` (where ``m_r``) of the flattened (query, query token) pairs: their winning
    document tokens, their weights ``g`` (fp32) and their query rows (zero where no token won).
    ``ROWS_WON``: every row given won a token (the winner index's), so no mask reads the argmax
    and the query rows load beside it, one load latency a block instead of two in a chain."""
    o_q = (o_r // Lq).to(tl.int64)
    o_s = o_r % Lq
    idx = tl.load(Argmax + (o_q * Ncols + i_col) * Lq + o_s, mask=m_r, other=-1)
    g = tl.load(Grad + o_q * stride_g_seq + i_col * stride_g_col, mask=m_r, other=0.0).to(tl.float32)
    if NORMALIZE:
        g = g * tl.load(QInv + o_q * stride_qinv_seq + o_s * stride_qinv_tok, mask=m_r, other=0.0)
    b_q = tl.load(
        Q + o_q[:, None] * stride_q_seq + o_s[:, None] * stride_q_tok + o_k[None, :] * stride_q_dim,
        mask=(m_r if ROWS_WON else m_r & (idx >= 0))[:, None] & m_k[None, :],
        other=0.0,
    )
    return idx, g, b_q  # [BLOCK_R], [BLOCK_R], [BLOCK_R, BLOCK_K]


@triton.jit
def _g_scales(Grad, q_lo, q_hi, i_col, stride_g_seq, stride_g_col, BLOCK: tl.constexpr):
    """``(2^-e, 2^e)`` for ``2^e`` the power of two at or under the largest ``|g|`` of queries
    ``[q_lo, q_hi)`` at column ``i_col`` (1 where that is 0, subnormal, infinite or NaN; ``e`` at
    most 126, so that both are normal): the weights ``g · 2^-e`` are below 2 in magnitude, each
    rounded to fp16 as exactly as a weight near 1, and the scaling itself is exact."""
    largest = tl.zeros([BLOCK], tl.float32)
    for q0 in range(q_lo, q_hi, BLOCK):
        o_q = q0 + tl.arange(0, BLOCK)
        g = tl.load(Grad + o_q.to(tl.int64) * stride_g_seq + i_col * stride_g_col,
                    mask=o_q < q_hi, other=0.0)
        largest = tl.maximum(largest, tl.abs(g.to(tl.float32)))
    biased = (tl.max(largest, axis=0).to(tl.int32, bitcast=True) >> 23) & 0xFF
    biased = tl.where((biased == 0) | (biased == 0xFF), 127, tl.minimum(biased, 253))
    return ((254 - biased) << 23).to(tl.float32, bitcast=True), \
        (biased << 23).to(tl.float32, bitcast=True)


@triton.jit
def _dd_program(
    Grad, Nq, n_cols, Lq, Ld, tiles_per_program, col_base, stride_g_seq, stride_g_col,
    PER_QUERY_DOCS: tl.constexpr, WINNER_INDEX: tl.constexpr, G_SCALED: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """What a document-owned program holds: its group and column (of ``n_cols`` a group from
    ``col_base``; one group with ``WINNER_INDEX``, the cross product), its token tiles
    ``[tb_lo, tb_hi)``, its (query, query token) rows ``[r_lo, r_hi)`` and its weights' scales
    (:func:`_g_scales` where ``G_SCALED``, else 1)."""
    pid = tl.program_id(0).to(tl.int64)
    i_grp = pid // n_cols
    i_col = col_base + pid % n_cols
    if WINNER_INDEX:
        i_grp = 0
    tb_lo = tl.program_id(1).to(tl.int64) * tiles_per_program
    tb_hi = tl.minimum(tb_lo + tiles_per_program, tl.cdiv(Ld, BLOCK_T))
    if PER_QUERY_DOCS:
        r_lo = i_grp * Lq
        r_hi = r_lo + Lq
    else:
        r_lo = 0
        r_hi = Nq * Lq
    g_down, g_up = 1.0, 1.0
    if G_SCALED:
        g_down, g_up = _g_scales(Grad, r_lo // Lq, tl.cdiv(r_hi, Lq), i_col, stride_g_seq,
                                 stride_g_col, BLOCK_R)
    return pid, i_grp, i_col, tb_lo, tb_hi, r_lo, r_hi, g_down, g_up


@triton.jit
def _dd_tile(
    i_tb, pid, i_col, r_lo, r_hi, rows, g_down, Grad, Q, QInv, Argmax, Rows, Counts, Nq, Ncols,
    Lq, Ld, o_k, m_k, stride_g_seq, stride_g_col, stride_q_seq, stride_q_tok, stride_q_dim,
    stride_qinv_seq, stride_qinv_tok,
    ROWS_IN_ONE_BLOCK: tl.constexpr, WINNER_INDEX: tl.constexpr, NORMALIZE: tl.constexpr,
    G_SCALED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    INDEX_SCAN: tl.constexpr,
):
    """``onehot(A == t)ᵀ @ (g · Q)`` for token tile ``i_tb`` (fp32, ``[BLOCK_T, BLOCK_K]``, still
    to be multiplied by ``g_up``): from ``rows`` = ``(idx, g, b_q)`` loaded once for every tile
    (``ROWS_IN_ONE_BLOCK``), else block by block over the program's rows, or with
    ``WINNER_INDEX`` over the rows that won one of the tile's tokens, in the index's order."""
    o_t = i_tb * BLOCK_T + tl.arange(0, BLOCK_T)
    o_block = tl.arange(0, BLOCK_R)
    if ROWS_IN_ONE_BLOCK:
        idx, g, b_q = rows
        acc = _dd_product(o_t, idx, g, b_q, DOT_PRECISION, UPCAST, G_SCALED)
    else:
        if WINNER_INDEX:
            p_rows = Rows + pid * Nq * Lq
            p_counts = Counts + pid * tl.cdiv(Ld, BLOCK_T)
            e_lo = tile_start(p_counts, i_tb, INDEX_SCAN)
            e_hi = e_lo + tl.load(p_counts + i_tb)
            # The next block's row numbers are requested a block ahead, so that each block
            # waits on one load's latency (its rows) instead of two in a chain.
            o_r_next = tl.load(p_rows + e_lo + o_block, mask=e_lo + o_block < e_hi,
                               other=0).to(tl.int32)
        else:
            e_lo, e_hi = r_lo, r_hi
        acc = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
        for e0 in range(e_lo, e_hi, BLOCK_R):
            o_e = e0 + o_block
            m_e = o_e < e_hi
            if WINNER_INDEX:
                o_r = o_r_next
                o_r_next = tl.load(p_rows + o_e + BLOCK_R, mask=o_e + BLOCK_R < e_hi,
                                   other=0).to(tl.int32)
            else:
                o_r = o_e
            idx, g, b_q = _dd_rows(
                Grad, Q, QInv, Argmax, o_r, m_e, i_col, Ncols, Lq, o_k, m_k,
                stride_g_seq, stride_g_col, stride_q_seq, stride_q_tok, stride_q_dim,
                stride_qinv_seq, stride_qinv_tok, NORMALIZE, WINNER_INDEX,
            )
            acc += _dd_product(o_t, idx, g * g_down, b_q, DOT_PRECISION, UPCAST, G_SCALED)
    return acc


@triton.jit
def _dd_rows_once(
    Grad, Q, QInv, Argmax, r_lo, r_hi, g_down, i_col, Ncols, Lq, o_k, m_k, stride_g_seq,
    stride_g_col, stride_q_seq, stride_q_tok, stride_q_dim, stride_qinv_seq, stride_qinv_tok,
    ROWS_IN_ONE_BLOCK: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """The rows ``(idx, g · g_down, b_q)`` that every tile of the program uses, loaded once
    (``ROWS_IN_ONE_BLOCK``: per-query candidates, ``Lq <= BLOCK_R``); else placeholders."""
    o_block = tl.arange(0, BLOCK_R)
    idx, g, b_q = o_block, g_down, o_block
    if ROWS_IN_ONE_BLOCK:
        idx, g, b_q = _dd_rows(
            Grad, Q, QInv, Argmax, r_lo + o_block, r_lo + o_block < r_hi, i_col, Ncols, Lq, o_k,
            m_k, stride_g_seq, stride_g_col, stride_q_seq, stride_q_tok, stride_q_dim,
            stride_qinv_seq, stride_qinv_tok, NORMALIZE, False,
        )
        g = g * g_down
    return idx, g, b_q


@triton.jit(do_not_specialize=["Nq", "Ncols", "Lq", "Ld", "tiles_per_program", "col_base"])
def _maxsim_bwd_dd_kernel(
    Grad,
    Q,
    QInv,
    Argmax,
    GradD,
    Rows,
    Counts,
    Nq,
    Ncols,
    Lq,
    Ld,
    dim,
    tiles_per_program,
    col_base,
    stride_g_seq,
    stride_g_col,
    stride_q_seq,
    stride_q_tok,
    stride_q_dim,
    stride_qinv_seq,
    stride_qinv_tok,
    stride_gd_grp,
    stride_gd_col,
    stride_gd_tok,
    stride_gd_dim,
    PER_QUERY_DOCS: tl.constexpr,
    ROWS_IN_ONE_BLOCK: tl.constexpr,
    WINNER_INDEX: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    INDEX_SCAN: tl.constexpr,
):
    """Document-owned ``grad_D``: ``grad_D[g, j, t-tile] = onehot(A == t)ᵀ @ (g · Q)`` over rows.

    The rows are the group's (query, query token) pairs, flattened so that one product covers
    ``BLOCK_R`` of them whatever the query length; :func:`_dd_product` says what is rounded to
    the input dtype before the product. A program writes ``tiles_per_program``
    consecutive token tiles; with ``ROWS_IN_ONE_BLOCK`` (per-query candidates, ``Lq <= BLOCK_R``)
    it loads its rows once for all of them. With ``WINNER_INDEX`` (the cross product) a tile
    reads only the rows that won one of its tokens, in the index's order (``winner_index``):
    program column 0 is column ``col_base``, and ``Rows``/``Counts`` hold that chunk's index.
    """
    # fp16 without normalize: the column's g divided by a power of two of its largest |g| before
    # the one-hot (and the tile multiplied back at the store), so that g itself fits fp16's range
    # and the rows skip bf16's pass over them in fp32 (the longer part of fp16's block).
    G_SCALED: tl.constexpr = Q.dtype.element_ty == tl.float16 and not NORMALIZE
    pid, i_grp, i_col, tb_lo, tb_hi, r_lo, r_hi, g_down, g_up = _dd_program(
        Grad, Nq, Ncols, Lq, Ld, tiles_per_program, col_base, stride_g_seq, stride_g_col,
        PER_QUERY_DOCS, WINNER_INDEX, G_SCALED, BLOCK_T, BLOCK_R,
    )
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < dim
    p_out = GradD + i_grp * stride_gd_grp + i_col * stride_gd_col + o_k[None, :] * stride_gd_dim
    rows = _dd_rows_once(
        Grad, Q, QInv, Argmax, r_lo, r_hi, g_down, i_col, Ncols, Lq, o_k, m_k, stride_g_seq,
        stride_g_col, stride_q_seq, stride_q_tok, stride_q_dim, stride_qinv_seq, stride_qinv_tok,
        ROWS_IN_ONE_BLOCK, NORMALIZE, BLOCK_R,
    )
    for i_tb in range(tb_lo, tb_hi):
        acc = _dd_tile(
            i_tb, pid, i_col, r_lo, r_hi, rows, g_down, Grad, Q, QInv, Argmax, Rows, Counts, Nq,
            Ncols, Lq, Ld, o_k, m_k, stride_g_seq, stride_g_col, stride_q_seq, stride_q_tok,
            stride_q_dim, stride_qinv_seq, stride_qinv_tok, ROWS_IN_ONE_BLOCK, WINNER_INDEX,
            NORMALIZE, G_SCALED, BLOCK_T, BLOCK_R, BLOCK_K, DOT_PRECISION, UPCAST, INDEX_SCAN,
        )
        o_t = i_tb * BLOCK_T + tl.arange(0, BLOCK_T)
        tl.store(p_out + o_t[:, None] * stride_gd_tok, (acc * g_up).to(GradD.dtype.element_ty),
                 mask=(o_t < Ld)[:, None] & m_k[None, :])


@triton.jit
def _onehot_rows(
    acc, o_t, idx, g, o_row, m_r, Q, QInv, stride_q_tok, stride_q_dim, o_k, m_k,
    NORMALIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """``acc [BLOCK_T, BLOCK_K] += onehot(idx == t)ᵀ @ (g · Q rows)``, rounded before the product
    as :func:`_dd_product` says (fp16: ``g · Q``, ``g`` not scaled here)."""
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


@triton.jit(do_not_specialize=["n_elems", "stride_buf_grp", "stride_out_grp"])
def _drain_chunk_kernel(Buf, Out, n_elems, stride_buf_grp, stride_out_grp, BLOCK: tl.constexpr):
    """``Out[g, :n] = Buf[g, :n]`` in ``Out``'s dtype, and ``Buf[g, :n] = 0`` for the next chunk:
    one pass (and one launch) instead of a cast and a zero fill. Program = a block of one group
    (blocks of a group consecutive); the ``n_elems`` elements of a group are contiguous on both
    sides."""
    pid = tl.program_id(0).to(tl.int64)
    blocks = tl.cdiv(n_elems, BLOCK)
    g = pid // blocks
    o = (pid % blocks) * BLOCK + tl.arange(0, BLOCK)
    m = o < n_elems
    p_buf = Buf + g * stride_buf_grp + o
    x = tl.load(p_buf, mask=m)
    tl.store(Out + g * stride_out_grp + o, x.to(Out.dtype.element_ty), mask=m)
    tl.store(p_buf, tl.zeros_like(x), mask=m)

