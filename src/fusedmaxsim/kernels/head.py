"""Triton kernels of the fused projection head's backward, from the forward's argmax: by a
document's (query, query token) entries (``_hidden_bwd_entries_kernel``) or by its token tiles
(``_hidden_bwd_rows_kernel``), then the weight's gradient (``_hidden_bwd_weight_kernel``).

Math
----
The documents are ``P = rnd(F.linear(H, W, b))`` (:func:`fusedmaxsim.kernels.common._hidden_tile`,
rounded to H's dtype as the forward's), scored normalized (``P̂ = P / max(‖P‖, eps)``) or as
they are. With ``G[r]`` the MaxSim gradient of document row ``r`` (``grad_D`` of
:mod:`fusedmaxsim.kernels.common`: ``Σ`` over the (query, query token) pairs that ``r`` won of
``g · Q``)::

    grad_P[r] = (G[r] - P̂[r] <P̂[r], G[r]>) / ‖P[r]‖      (normalized, ‖P[r]‖ > eps)
              = G[r] / max(‖P[r]‖, eps)                    (normalized, ‖P[r]‖ <= eps)
              = G[r]                                       (not normalized)
    grad_H = grad_P · W          grad_W = grad_Pᵀ · H          grad_b = Σ_r grad_P[r]

A row that won nothing has ``G[r] = 0`` and receives exactly 0, whatever ``H`` holds there (a
masked token may hold NaN): its hidden state is neither read nor used. ``grad_Q[i, s]`` is
``Σ_j g[i, j] · P̂[row won by (i, s) in j]``: the entries kernel writes each term, the token
tile kernel the winning rows of ``P`` and their inverse norms for ``maxsim``'s gather
(``kernels.backward._maxsim_bwd_gather_kernel``).

Grid mapping
------------
* ``_hidden_bwd_entries_kernel``: program ``(group and column, entry block)`` owns ``BLOCK_E``
  of the document's entries (cross product: ``Nq · Lq``, entry ``e`` = query ``e // Lq``'s
  token ``e % Lq``; per-query candidates: the group's query's ``Lq``). It sums, for each entry,
  the ``g · Q`` of every entry of the document that won the same row (a one-hot product over
  the document's entry blocks, fp32) and marks the first such entry the row's leader; projects
  the entries' winning rows (``_hidden_tile`` over the argmax), applies the Jacobian, and
  writes: each entry's ``g · P̂`` (fp32, ``[Nq, n_cols, Lq, dim]``, summed over the columns
  for ``grad_Q`` by the launcher), the leaders' rows of ``grad_H`` (zeroed by the launcher:
  each row has one writer) and their ``grad_P`` and token (-1 for the others) into the
  entries' buffers for the weight kernel.
* ``_hidden_bwd_rows_kernel``: the document-owned ``grad_D`` kernel's mapping (program = group
  and column, ``tiles_per_program`` token tiles; through the winner index on the cross
  product), which builds ``G`` for a ``BLOCK_T``-token tile with :func:`backward._dd_tile`; then,
  on chip, the tile's winning rows projected again (``_hidden_tile``, ``HIDDEN_BLOCK`` of
  ``d_model`` a step, only those rows' hidden states read), the normalization's Jacobian, and
  ``grad_H``'s rows ``grad_P · W`` in ``HIDDEN_BLOCK``-wide steps; a tile no token won only
  writes zeros to ``grad_H``. For the weight kernel it writes each row's token (-1 where it
  won nothing) and the winning rows of ``grad_P`` (the inputs' dtype: ``F.linear``'s backward
  multiplies it so), and for ``grad_Q`` the winning rows of ``P`` and their inverse norms,
  into buffers of the launched columns (column 0 is ``col_base``).
* ``_hidden_bwd_weight_kernel``: program ``(c, g)`` owns ``grad_W[:, c-block]`` of row group
  ``g`` (every ``groups``-th tile of ``BLOCK_T`` buffer rows, so that the groups stay even) and
  adds ``grad_Pᵀ · H`` over them in fp32, reading ``grad_P`` and the hidden states of the
  buffer rows with a token only (a tile with none is skipped); the programs of block 0 also
  sum ``grad_b``. Each group writes its own fp32 partial (``ACCUMULATE``: added to what an
  earlier launch wrote), which the launcher sums: no atomics, bitwise reproducible.

Caveats
-------
* ``grad_W`` and ``grad_b`` come from ``grad_P`` rounded to the inputs' dtype (as ``F.linear``'s
  backward takes it in 16 bits), ``grad_H`` likewise; the sums run in fp32.
* The entries kernel recomputes a row's projection once an entry that won it and compares
  every pair of a document's entries: the plan takes it where a document's entries are fewer
  than its tokens (``_plan.plan_hidden_backward``).
* A NaN in ``g · Q`` reaches, through the one-hot products, the other rows of its block or
  document as it does in the dense document-owned kernel.
* Those of the shared helpers (``UPCAST``, the projection's order of summation) are in
  :mod:`fusedmaxsim.kernels.common`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .backward import _dd_program, _dd_rows_once, _dd_tile
from .common import NORM_EPS, _dot, _hidden_tile


@triton.jit(do_not_specialize=["Nq", "Ncols", "n_cols", "Lq", "Ld", "d_model",
                               "tiles_per_program", "col_base"])
def _hidden_bwd_rows_kernel(
    Grad, Q, Argmax, Rows, Counts, H, W, Bias, GradH, Tok, GradP, P, PInv,
    Nq, Ncols, n_cols, Lq, Ld, dim, d_model, tiles_per_program, col_base,
    stride_g_seq, stride_g_col, stride_q_seq, stride_q_tok, stride_q_dim,
    stride_h_grp, stride_h_col, stride_h_tok, stride_h_dim, stride_w_out, stride_w_in,
    stride_gh_grp, stride_gh_col, stride_gh_tok,
    PER_QUERY_DOCS: tl.constexpr,
    ROWS_IN_ONE_BLOCK: tl.constexpr,
    WINNER_INDEX: tl.constexpr,
    NORMALIZE: tl.constexpr,
    NEED_Q: tl.constexpr,
    NEED_H: tl.constexpr,
    NEED_W: tl.constexpr,
    HIDDEN_BIAS: tl.constexpr,
    HIDDEN_BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    INDEX_SCAN: tl.constexpr,
):
    """For the program's token tiles, over the ``n_cols`` columns from ``col_base``: with
    ``NEED_W`` which rows won (``Tok``: the row's token, -1 where it did not) and their rows of
    ``grad_P`` (``GradP``), with ``NEED_Q`` their rows of ``P`` and its inverse norms, in
    buffers ``[groups, n_cols, Ld, ..]`` (contiguous; the rows no token won are left
    unwritten); with ``NEED_H`` every row of ``grad_H`` (indexed as ``H``, contiguous in
    ``d_model``)."""
    G_SCALED: tl.constexpr = Q.dtype.element_ty == tl.float16
    pid, i_grp, i_col, tb_lo, tb_hi, r_lo, r_hi, g_down, g_up = _dd_program(
        Grad, Nq, n_cols, Lq, Ld, tiles_per_program, col_base, stride_g_seq, stride_g_col,
        PER_QUERY_DOCS, WINNER_INDEX, G_SCALED, BLOCK_T, BLOCK_R,
    )
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < dim
    rows = _dd_rows_once(
        Grad, Q, Q, Argmax, r_lo, r_hi, g_down, i_col, Ncols, Lq, o_k, m_k, stride_g_seq,
        stride_g_col, stride_q_seq, stride_q_tok, stride_q_dim, 0, 0, ROWS_IN_ONE_BLOCK, False,
        BLOCK_R,
    )
    p_h = H + i_grp * stride_h_grp + i_col * stride_h_col
    hid = (stride_h_dim, W, stride_w_out, stride_w_in, Bias, d_model)
    buf_row = (i_grp * n_cols + i_col - col_base) * Ld  # the column's first buffer row
    for i_tb in range(tb_lo, tb_hi):
        acc = _dd_tile(
            i_tb, pid, i_col, r_lo, r_hi, rows, g_down, Grad, Q, Q, Argmax, Rows, Counts, Nq,
            Ncols, Lq, Ld, o_k, m_k, stride_g_seq, stride_g_col, stride_q_seq, stride_q_tok,
            stride_q_dim, 0, 0, ROWS_IN_ONE_BLOCK, WINNER_INDEX, False, G_SCALED, BLOCK_T,
            BLOCK_R, BLOCK_K, DOT_PRECISION, UPCAST, INDEX_SCAN,
        ) * g_up
        o_t = i_tb * BLOCK_T + tl.arange(0, BLOCK_T)
        m_t = o_t < Ld
        # A NaN gradient counts as won: it must reach the products, as in F.linear's backward.
        m_won = m_t & (tl.sum((acc != 0.0).to(tl.int32), axis=1) > 0)
        o_row = (buf_row + o_t).to(tl.int64)
        if NEED_W:
            tl.store(Tok + o_row, tl.where(m_won, o_t, -1), mask=m_t)
        p_gh = GradH + i_grp * stride_gh_grp + i_col * stride_gh_col
        if tl.max(m_won.to(tl.int32), axis=0) > 0:
            p = _hidden_tile(p_h, stride_h_tok, hid, o_t, m_won, o_k, m_k, HIDDEN_BLOCK,
                             HIDDEN_BIAS, DOT_PRECISION, UPCAST)
            grad_p = acc
            if NORMALIZE:
                pf = p.to(tl.float32)
                inv = 1.0 / tl.maximum(tl.sqrt(tl.sum(pf * pf, axis=1)), NORM_EPS)
                p_hat = pf * inv[:, None]
                radial = tl.sum(p_hat * acc, axis=1)
                radial = tl.where(inv >= 1.0 / NORM_EPS, 0.0, radial)  # at or under eps: none
                grad_p = (acc - p_hat * radial[:, None]) * inv[:, None]
                if NEED_Q:
                    tl.store(PInv + o_row, inv, mask=m_won)
            grad_p = grad_p.to(H.dtype.element_ty)
            m_rows = m_won[:, None] & m_k[None, :]
            if NEED_W:
                tl.store(GradP + o_row[:, None] * dim + o_k[None, :], grad_p, mask=m_rows)
            if NEED_Q:
                tl.store(P + o_row[:, None] * dim + o_k[None, :], p, mask=m_rows)
            if NEED_H:
                _grad_h_rows(grad_p, W, stride_w_out, stride_w_in, p_gh, stride_gh_tok, o_t, m_t,
                             o_k, m_k, d_model, HIDDEN_BLOCK, DOT_PRECISION, UPCAST)
        else:  # no token of the tile won: its grad_H rows are zero, nothing is read
            if NEED_H:
                _zero_rows(p_gh, stride_gh_tok, o_t, m_t, d_model, HIDDEN_BLOCK)


@triton.jit(do_not_specialize=["n_cols", "Lq", "d_model", "n_entries", "col_base"])
def _hidden_bwd_entries_kernel(
    Grad, Q, Argmax, H, W, Bias, GradH, Tok, GradP, GradQ,
    n_cols, Lq, dim, d_model, n_entries, col_base,
    stride_g_seq, stride_g_col, stride_q_seq, stride_q_tok, stride_q_dim,
    stride_a_seq, stride_a_col, stride_a_tok,
    stride_h_grp, stride_h_col, stride_h_tok, stride_h_dim, stride_w_out, stride_w_in,
    stride_gh_grp, stride_gh_col, stride_gh_tok,
    PER_QUERY_DOCS: tl.constexpr,
    NORMALIZE: tl.constexpr,
    NEED_Q: tl.constexpr,
    NEED_H: tl.constexpr,
    NEED_W: tl.constexpr,
    HIDDEN_BIAS: tl.constexpr,
    HIDDEN_BLOCK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """For ``BLOCK_E`` of a document's ``n_entries`` (query, query token) entries (column
    ``col_base + pid % n_cols``): with ``NEED_Q`` every entry's ``g · P̂`` of its winning row
    into ``GradQ [Nq, n_cols, Lq, dim]`` (fp32, 0 where it won nothing); for the first entry of
    each winning row (its leader) with ``NEED_H`` the row of ``grad_H`` (zero elsewhere: the
    launcher's), with ``NEED_W`` its ``grad_P`` and token into the entries' buffers
    ``[groups, n_cols, n_entries, ..]`` (``Tok`` -1 where the entry leads nothing)."""
    pid = tl.program_id(0)
    i_loc = pid % n_cols
    i_grp = (pid // n_cols).to(tl.int64) if PER_QUERY_DOCS else 0
    i_col = (col_base + i_loc).to(tl.int64)
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < dim
    o_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    ent = (Grad, Q, Argmax, i_grp, i_col, Lq, n_entries, stride_g_seq, stride_g_col,
           stride_q_seq, stride_q_tok, stride_q_dim, stride_a_seq, stride_a_col, stride_a_tok)
    tok, g, i_q, i_s, _own = _entries(ent, o_e, o_k, m_k, PER_QUERY_DOCS)
    won = tok >= 0
    # The upstream gradient of each entry's row: the g · Q of every entry of the document that
    # won the same row, summed (a one-hot product, fp32); the row's first entry leads it.
    up = tl.zeros([BLOCK_E, BLOCK_K], tl.float32)
    lead = won
    for e0 in range(0, n_entries, BLOCK_E):
        o_f = e0 + tl.arange(0, BLOCK_E)
        tok_f, _g, _q, _s, u_f = _entries(ent, o_f, o_k, m_k, PER_QUERY_DOCS)
        same = (tok[:, None] == tok_f[None, :]) & (tok_f >= 0)[None, :]
        up += tl.dot(same.to(tl.float32), u_f, input_precision="ieee")
        lead &= tl.sum((same & (o_f[None, :] < o_e[:, None])).to(tl.int32), axis=1) == 0
    row = tl.where(won, tok, 0)
    p_h = H + i_grp * stride_h_grp + i_col * stride_h_col
    hid = (stride_h_dim, W, stride_w_out, stride_w_in, Bias, d_model)
    p = _hidden_tile(p_h, stride_h_tok, hid, row, won, o_k, m_k, HIDDEN_BLOCK, HIDDEN_BIAS,
                     DOT_PRECISION, UPCAST).to(tl.float32)
    grad_p = up
    if NORMALIZE:
        inv = 1.0 / tl.maximum(tl.sqrt(tl.sum(p * p, axis=1)), NORM_EPS)
        p = p * inv[:, None]
        radial = tl.sum(p * up, axis=1)
        radial = tl.where(inv >= 1.0 / NORM_EPS, 0.0, radial)  # at or under eps: none
        grad_p = (up - p * radial[:, None]) * inv[:, None]
    m_e = o_e < n_entries
    if NEED_Q:  # the entry's share of grad_Q[i, s]: g · P̂ of its row (0 where it won nothing)
        o_gq = ((i_q * n_cols + i_loc) * Lq + i_s).to(tl.int64)
        tl.store(GradQ + o_gq[:, None] * dim + o_k[None, :], g[:, None] * p,
                 mask=m_e[:, None] & m_k[None, :])
    grad_p = grad_p.to(H.dtype.element_ty)
    if NEED_H:
        p_gh = GradH + i_grp * stride_gh_grp + i_col * stride_gh_col
        _grad_h_rows(grad_p, W, stride_w_out, stride_w_in, p_gh, stride_gh_tok, row, lead, o_k,
                     m_k, d_model, HIDDEN_BLOCK, DOT_PRECISION, UPCAST)
    if NEED_W:
        o_row = ((i_grp * n_cols + i_loc) * n_entries + o_e).to(tl.int64)
        tl.store(Tok + o_row, tl.where(lead, tok, -1).to(tl.int32), mask=m_e)
        tl.store(GradP + o_row[:, None] * dim + o_k[None, :], grad_p,
                 mask=lead[:, None] & m_k[None, :])


@triton.jit
def _entries(ent, o_e, o_k, m_k, PER_QUERY_DOCS: tl.constexpr):
    """Entries ``o_e`` of a document: ``(token won, g, query, query token, g · Q)`` (token -1
    past ``n_entries`` or where the entry adds nothing; then ``g`` and ``g · Q`` are 0). Cross
    product: entry ``e`` is query ``e // Lq``'s token ``e % Lq``; per-query candidates: the
    group's query's token ``e``."""
    (Grad, Q, Argmax, i_grp, i_col, Lq, n_entries, stride_g_seq, stride_g_col, stride_q_seq,
     stride_q_tok, stride_q_dim, stride_a_seq, stride_a_col, stride_a_tok) = ent
    m_e = o_e < n_entries
    i_q = o_e * 0 + i_grp if PER_QUERY_DOCS else o_e // Lq
    i_s = o_e % Lq
    tok = tl.load(Argmax + i_q * stride_a_seq + i_col * stride_a_col + i_s * stride_a_tok,
                  mask=m_e, other=-1).to(tl.int32)
    won = tok >= 0
    g = tl.load(Grad + i_q * stride_g_seq + i_col * stride_g_col, mask=won, other=0.0)
    g = g.to(tl.float32)
    p_q = Q + (i_q * stride_q_seq + i_s * stride_q_tok)[:, None] + o_k[None, :] * stride_q_dim
    q = tl.load(p_q, mask=won[:, None] & m_k[None, :], other=0.0)
    return tok, g, i_q, i_s, g[:, None] * q.to(tl.float32)


@triton.jit
def _zero_rows(p_out, stride_tok, o_t, m_t, width, BLOCK: tl.constexpr):
    """Rows ``o_t`` (where ``m_t``) of a tensor contiguous in its last dim set to zero."""
    o_c = tl.arange(0, BLOCK)
    p = p_out + o_t.to(tl.int64)[:, None] * stride_tok + o_c[None, :]
    zero = tl.zeros([o_t.shape[0], BLOCK], p_out.dtype.element_ty)
    for c0 in range(0, width, BLOCK):
        tl.store(p, zero, mask=m_t[:, None] & (c0 + o_c < width)[None, :])
        p += BLOCK


@triton.jit
def _grad_h_rows(grad_p, W, stride_w_out, stride_w_in, p_gh, stride_gh_tok, o_t, m_t, o_k, m_k,
                 d_model, HIDDEN_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr):
    """``grad_H[o_t] = grad_P · W`` (``grad_H`` contiguous in ``d_model``), ``HIDDEN_BLOCK``
    columns a step, rounded to grad_H's dtype."""
    o_c = tl.arange(0, HIDDEN_BLOCK)
    p_w = W + o_k[:, None] * stride_w_out + o_c[None, :] * stride_w_in  # [BLOCK_K, HIDDEN_BLOCK]
    p_out = p_gh + o_t.to(tl.int64)[:, None] * stride_gh_tok + o_c[None, :]
    for c0 in range(0, d_model, HIDDEN_BLOCK):
        m_c = c0 + o_c < d_model
        w = tl.load(p_w, mask=m_k[:, None] & m_c[None, :], other=0.0)
        rows = _dot(grad_p, w, DOT_PRECISION, UPCAST)
        tl.store(p_out, rows.to(p_gh.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])
        p_w += HIDDEN_BLOCK * stride_w_in
        p_out += HIDDEN_BLOCK


@triton.jit(do_not_specialize=["n_rows", "n_cols", "col_rows", "d_model", "col_base"])
def _hidden_bwd_weight_kernel(
    Tok, GradP, H, PartW, PartB, n_rows, n_cols, col_rows, dim, d_model, col_base,
    stride_h_grp, stride_h_col, stride_h_tok, stride_h_dim,
    HAS_BIAS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``PartW[g, :, c-block] (+)= Σ grad_Pᵀ · H`` and, in block 0, ``PartB[g] (+)= Σ grad_P``
    over the tiles ``g, g + groups, …`` of the buffer's ``n_rows`` rows (buffer row ``r``:
    group ``r // (n_cols · col_rows)``, column ``col_base + r // col_rows % n_cols``, token
    ``Tok[r]``, -1 where the row adds nothing)."""
    i_c = tl.program_id(0)
    i_g = tl.program_id(1)
    groups = tl.num_programs(1)
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < dim
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < d_model
    acc = tl.zeros([BLOCK_K, BLOCK_C], tl.float32)
    acc_b = tl.zeros([BLOCK_K], tl.float32)
    for i_t in range(i_g, tl.cdiv(n_rows, BLOCK_T), groups):
        o_r = (i_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        m_r = o_r < n_rows
        tok = tl.load(Tok + o_r, mask=m_r, other=-1)
        m_used = tok >= 0
        if tl.max(m_used.to(tl.int32), axis=0) > 0:  # a tile no token won adds nothing
            gp = tl.load(GradP + o_r[:, None] * dim + o_k[None, :],
                         mask=m_used[:, None] & m_k[None, :], other=0.0)
            grp = o_r // (n_cols * col_rows)
            col = col_base + o_r // col_rows % n_cols
            h = tl.load(H + (grp * stride_h_grp + col * stride_h_col + tok * stride_h_tok)[:, None]
                        + o_c[None, :] * stride_h_dim, mask=m_used[:, None] & m_c[None, :],
                        other=0.0)
            acc += _dot(tl.trans(gp), h, DOT_PRECISION, UPCAST)
            if HAS_BIAS:
                acc_b += tl.sum(gp.to(tl.float32), axis=0)
    p_w = PartW + i_g * dim * d_model + o_k[:, None] * d_model + o_c[None, :]
    m_w = m_k[:, None] & m_c[None, :]
    if ACCUMULATE:
        acc += tl.load(p_w, mask=m_w, other=0.0)
    tl.store(p_w, acc, mask=m_w)
    if HAS_BIAS and i_c == 0:
        p_b = PartB + i_g * dim + o_k
        if ACCUMULATE:
            acc_b += tl.load(p_b, mask=m_k, other=0.0)
        tl.store(p_b, acc_b, mask=m_k)
