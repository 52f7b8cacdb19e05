"""Triton kernels of MaxSim: the forward with a running max and argmax, and two backwards.

Math
----
For query tokens ``Q [Nq, Lq, d]`` and documents ``D``::

    S[i, j, s, t] = <Q[i, s], D[g(i), j, t]> (· q_inv[i, s] · d_inv[g(i), j, t] when normalizing)
    A[i, j, s]    = argmax_{t valid} S[i, j, s, t]             (lowest t among ties; -1 if none)
    score[i, j]   = Σ_{s valid, A >= 0} S[i, j, s, A[i, j, s]]

``g(i)`` is the document group of query ``i``: ``0`` for the cross product (``D [1, Nd, Ld, d]``,
every query meets every document) and ``i`` for per-query candidates (``D [Nq, K, Ld, d]``).
A masked doc token is ``-inf`` before every max, so it never wins; a query row whose max stays
``-inf`` adds 0. The backward needs no second matrix product, only the argmax::

    grad_Q[i, s]       = Σ_j g[i, j] · D[g(i), j, A[i, j, s]]
    grad_D[g, j, t]    = Σ_{i in group g} Σ_{s: A[i, j, s] = t} g[i, j] · Q[i, s]

(with ``d_inv`` and ``q_inv`` folded in, these are the gradients with respect to the normalized
tokens; the launcher's caller applies the normalization's Jacobian).

The smooth max (``SMOOTH``) replaces ``max_t`` by ``tau · log Σ_{t valid} exp(S / tau)``, folded
tile by tile as an online log-sum-exp in base 2 (``y = S · log2(e) / tau``); instead of ``A`` the
forward saves ``L[i, j, s] = log2 Σ_t exp2(y)`` (``+inf`` where the token adds nothing), from
which ``_kernels_smooth`` recomputes the softmax for the gradients.

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
* ``_maxsim_bwd_gather_kernel``: program ``(i, s-block, column split)`` of the columns
  ``[col_base, col_end)``, walked ``COLS_PER_STEP`` at a time, gathers the winning document rows
  for ``grad_Q`` (row-owned) and, in the "unified" strategy, scatters ``g · Q`` rows into an fp32
  ``grad_D`` buffer with atomics (the buffer's column 0 is ``col_base``: large ``grad_D`` goes
  through it in column chunks).
* ``_maxsim_bwd_dd_kernel``: program ``(g, j, t-blocks)`` owns tiles of ``grad_D`` and adds
  ``onehot(A == t)ᵀ @ (g · Q)`` over blocks of the group's (query, token) rows; per-query
  candidates load their rows once for several tiles; on the cross product a tile reads only the
  rows that won one of its tokens, through the winner index of ``_kernels_index``. No atomics:
  bitwise reproducible. Each row's weight ``g`` (bf16, fp32; fp16 once divided by a power of two
  of its column's largest ``|g|``, multiplied back at the store) or ``g · Q`` (fp16 with
  normalize) is rounded to the input dtype before the product, an error of the same size as
  writing the gradient in that dtype.
* ``_drain_chunk_kernel``: casts a finished column chunk of that buffer into ``grad_D`` and
  clears it for the next chunk.
* ``_inverse_norm_kernel``: program = a block of token rows; ``1 / max(‖x‖, eps)`` in fp32, each
  token read once (the norms are computed once per token, never per tile).

Caveats
-------
* NaN: the max propagates NaN (``PropagateNan.ALL``), so a NaN in a valid token makes the affected
  scores NaN. A NaN in a masked token is ignored, as in the reference.
* The atomic paths (``SCATTER_GRAD_D``, ``ATOMIC_GRAD_Q``) are not bitwise reproducible: fp32
  additions land in varying order.
* ``UPCAST`` computes dots in fp32: the Triton interpreter's bf16 ``tl.dot`` is wrong on CPU.
* ``QUERY_IN_REGISTERS`` relies on a Triton rewrite (``MMAV3UseRegOperand``, triton 3.6-3.9):
  a Hopper product takes its first operand from registers only when that operand comes out of
  another tensor-core product, so the query tile is passed through one with a zero operand
  (exact). Where the rewrite does not fire, the kernel is the same with one small product more.
* Q and D may have any strides; the forward's masks, inverse norms and outputs must be
  contiguous (the launcher makes them so), which lets the kernel derive their strides.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._configs import INTERPRETER
from ._kernels_index import tile_start

NORM_EPS = tl.constexpr(1e-12)  # F.normalize's default; the launchers pass the same to EPS
# Document-mask bytes read per step by _valid_span; small under the interpreter, so that tiny
# test documents take several steps.
MASK_SCAN = tl.constexpr(16 if INTERPRETER else 512)


@triton.jit
def _max_propagate_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _inverse_norm(x, EPS: tl.constexpr):
    """``1 / max(‖row‖, EPS)`` in fp32 for each row of a tile."""
    x = x.to(tl.float32)
    return 1.0 / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), EPS)


@triton.jit
def _in_product_layout(b_q):
    """``b_q`` unchanged in value, produced by a tensor-core product: Triton then feeds it to
    every Hopper product of the loop from registers, where by default it reads the loop-invariant
    query tile from shared memory again for every document tile. A product with a 16-deep zero
    operand costs 1/8 of one query-by-query product, once per query chunk; adding it to zero is
    exact."""
    zero_a = tl.zeros([b_q.shape[0], 16], b_q.dtype)
    zero_b = tl.zeros([16, b_q.shape[1]], b_q.dtype)
    return tl.dot(zero_a, zero_b, acc=b_q.to(tl.float32)).to(b_q.dtype)


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _doc_tile(
    b_q,
    acc_max,
    acc_arg,
    run_sum,
    smooth_scale,
    start,
    t_hi,
    p_doc,
    stride_doc_tok,
    stride_doc_dim,
    p_dmask,
    stride_dmask_tok,
    p_dinv,
    stride_dinv_tok,
    o_k,
    m_k,
    MASK_TAIL: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_D_MASK: tl.constexpr,
    NORMALIZE: tl.constexpr,
    NORM_FROM_TILES: tl.constexpr,
    TRACK_ARGMAX: tl.constexpr,
    SMOOTH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One document tile folded into the running reduction.

    Max: the element-wise running max ``acc_max [BLOCK_M, BLOCK_N]``; keeping the max per
    (row, slot) and reducing over slots once per document costs one max instruction per
    similarity, against a reduction with shuffles per tile.
    Smooth max (``SMOOTH``): an online log-sum-exp per row, ``acc_max [BLOCK_M]`` the running max
    and ``run_sum`` the running sum of ``exp2(y - acc_max)``, in log2 units ``y = s · smooth_scale``.
    """
    o_t = start + tl.arange(0, BLOCK_N)
    m_t = o_t < t_hi
    p = p_doc + o_t[:, None] * stride_doc_tok + o_k[None, :] * stride_doc_dim
    if MASK_TAIL:
        b_d = tl.load(p, mask=m_t[:, None] & m_k[None, :], other=0.0)
    elif EVEN_K:
        b_d = tl.load(p)
    else:
        b_d = tl.load(p, mask=m_k[None, :], other=0.0)
    b_s = _dot(b_q, tl.trans(b_d), DOT_PRECISION, UPCAST)  # [BLOCK_M, BLOCK_N] fp32
    if NORMALIZE:
        if NORM_FROM_TILES:
            # The tile is on chip already: its norms cost BLOCK_N·BLOCK_K multiply-adds here
            # instead of a pass over all of D before the kernel.
            d_inv = _inverse_norm(b_d, NORM_EPS)
        elif MASK_TAIL:
            d_inv = tl.load(p_dinv + o_t * stride_dinv_tok, mask=m_t, other=0.0)
        else:
            d_inv = tl.load(p_dinv + o_t * stride_dinv_tok)
        b_s = b_s * d_inv[None, :]
    if HAS_D_MASK:
        if MASK_TAIL:
            m_t = m_t & (tl.load(p_dmask + o_t * stride_dmask_tok, mask=m_t, other=0) != 0)
        else:
            m_t = tl.load(p_dmask + o_t * stride_dmask_tok) != 0
    if HAS_D_MASK or MASK_TAIL:
        b_s = tl.where(m_t[None, :], b_s, float("-inf"))
    if SMOOTH:
        b_y = b_s * smooth_scale
        new_max = tl.maximum(acc_max, tl.max(b_y, 1))
        base = tl.where(new_max == float("-inf"), 0.0, new_max)  # no valid token yet: no NaN
        run_sum = run_sum * tl.exp2(acc_max - base) + tl.sum(tl.exp2(b_y - base[:, None]), 1)
        acc_max = new_max
    else:
        if TRACK_ARGMAX:
            # Strict '>' keeps the earliest tile per slot: the lowest index among ties.
            acc_arg = tl.where(b_s > acc_max, o_t[None, :], acc_arg)
        acc_max = tl.maximum(acc_max, b_s, propagate_nan=tl.PropagateNan.ALL)
    return acc_max, acc_arg, run_sum


@triton.jit
def _valid_span(p_mask, t_lo, t_hi, BLOCK: tl.constexpr):
    """``(lo, hi, all_valid)``: the smallest span ``[lo, hi)`` of ``[t_lo, t_hi)`` that holds every
    valid token of a document mask, and whether every token inside it is valid (``lo == hi`` when
    none is). Reading the mask once per program lets the tile loop skip padding altogether, and
    drop the per-similarity mask where the valid tokens are contiguous (padded documents)."""
    lo = t_hi
    hi = t_lo + 0 * t_hi  # a run-time value from the start, like the loop's updates
    n_valid = 0 * t_hi
    for start in range(t_lo, t_hi, BLOCK):
        o_t = start + tl.arange(0, BLOCK)
        valid = tl.load(p_mask + o_t, mask=o_t < t_hi, other=0) != 0
        lo = tl.minimum(lo, tl.min(tl.where(valid, o_t, t_hi), 0))
        hi = tl.maximum(hi, tl.max(tl.where(valid, o_t + 1, t_lo), 0))
        n_valid += tl.sum(valid.to(tl.int32), 0)
    lo = tl.minimum(lo, hi)
    return lo, hi, n_valid == hi - lo


@triton.jit
def _doc_max(
    b_q,
    p_doc,
    stride_doc_tok,
    stride_doc_dim,
    p_dmask,
    stride_dmask_tok,
    p_dinv,
    stride_dinv_tok,
    t_lo,
    t_hi,
    all_valid,
    o_k,
    m_k,
    smooth_scale,
    EVEN_K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    NORM_FROM_TILES: tl.constexpr,
    TRACK_ARGMAX: tl.constexpr,
    SMOOTH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    QUERY_IN_REGISTERS: tl.constexpr,
):
    """The MaxSim inner loop: max (and lowest argmax) of ``b_q``'s rows over document tokens
    ``[t_lo, t_hi)``. Every layout calls this one loop.

    ``b_q [BLOCK_M, BLOCK_K]`` stays on chip; the document streams through in ``BLOCK_N`` tiles,
    full tiles without bounds checks and the tail tile with them. ``all_valid``: the constant
    ``True`` without a document mask; with one, :func:`_valid_span`'s run-time flag that every
    token of the span is valid, in which case the loop runs without reading the mask.
    Returns ``row_max [BLOCK_M]`` (``-inf`` where no valid token) and ``row_arg [BLOCK_M]``
    (int32, ``-1`` where no valid token; only meaningful when ``TRACK_ARGMAX``). With ``SMOOTH``,
    ``row_max`` is ``log2 Σ_t exp2(s_t · smooth_scale)`` instead (``-inf`` where no valid token).
    ``QUERY_IN_REGISTERS``: keep ``b_q`` in registers for the products (16-bit inputs, at least
    64 rows: Hopper's warp-group products), which leaves shared memory's bandwidth to the
    document tiles.
    """
    if QUERY_IN_REGISTERS and not UPCAST:
        b_q = _in_product_layout(b_q)
    if all_valid:
        row_max, row_arg = _doc_loop(
            b_q, p_doc, stride_doc_tok, stride_doc_dim, p_dmask, stride_dmask_tok, p_dinv,
            stride_dinv_tok, t_lo, t_hi, o_k, m_k, smooth_scale, EVEN_K, False, NORMALIZE,
            NORM_FROM_TILES, TRACK_ARGMAX, SMOOTH, BLOCK_M, BLOCK_N, DOT_PRECISION, UPCAST,
        )
    else:
        row_max, row_arg = _doc_loop(
            b_q, p_doc, stride_doc_tok, stride_doc_dim, p_dmask, stride_dmask_tok, p_dinv,
            stride_dinv_tok, t_lo, t_hi, o_k, m_k, smooth_scale, EVEN_K, True, NORMALIZE,
            NORM_FROM_TILES, TRACK_ARGMAX, SMOOTH, BLOCK_M, BLOCK_N, DOT_PRECISION, UPCAST,
        )
    return row_max, row_arg


@triton.jit
def _doc_loop(
    b_q,
    p_doc,
    stride_doc_tok,
    stride_doc_dim,
    p_dmask,
    stride_dmask_tok,
    p_dinv,
    stride_dinv_tok,
    t_lo,
    t_hi,
    o_k,
    m_k,
    smooth_scale,
    EVEN_K: tl.constexpr,
    HAS_D_MASK: tl.constexpr,
    NORMALIZE: tl.constexpr,
    NORM_FROM_TILES: tl.constexpr,
    TRACK_ARGMAX: tl.constexpr,
    SMOOTH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """:func:`_doc_max`'s tile loop for one masking mode."""
    if SMOOTH:
        acc_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    else:
        acc_max = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
    acc_arg = tl.full([BLOCK_M, BLOCK_N], -1, tl.int32)
    run_sum = tl.zeros([BLOCK_M], tl.float32)
    t_full = t_lo + (t_hi - t_lo) // BLOCK_N * BLOCK_N
    for start in range(t_lo, t_full, BLOCK_N):
        acc_max, acc_arg, run_sum = _doc_tile(
            b_q, acc_max, acc_arg, run_sum, smooth_scale, start, t_hi, p_doc, stride_doc_tok,
            stride_doc_dim, p_dmask, stride_dmask_tok, p_dinv, stride_dinv_tok, o_k, m_k, False,
            EVEN_K, HAS_D_MASK, NORMALIZE, NORM_FROM_TILES, TRACK_ARGMAX, SMOOTH, BLOCK_N,
            DOT_PRECISION, UPCAST,
        )
    if t_full < t_hi:
        acc_max, acc_arg, run_sum = _doc_tile(
            b_q, acc_max, acc_arg, run_sum, smooth_scale, t_full, t_hi, p_doc, stride_doc_tok,
            stride_doc_dim, p_dmask, stride_dmask_tok, p_dinv, stride_dinv_tok, o_k, m_k, True,
            EVEN_K, HAS_D_MASK, NORMALIZE, NORM_FROM_TILES, TRACK_ARGMAX, SMOOTH, BLOCK_N,
            DOT_PRECISION, UPCAST,
        )
    row_arg = tl.full([BLOCK_M], -1, tl.int32)
    if SMOOTH:
        row_max = acc_max + tl.log2(run_sum)
    else:
        row_max = tl.reduce(acc_max, 1, _max_propagate_nan)
        if TRACK_ARGMAX:
            no_slot = 2147483647
            row_arg = tl.min(tl.where(acc_max == row_max[:, None], acc_arg, no_slot), axis=1)
            row_arg = tl.where((row_arg == no_slot) | (row_max == float("-inf")), -1, row_arg)
    return row_max, row_arg


@triton.jit
def _query_chunk(Q, QMask, row_offsets, mask_index, m_row, o_k, m_k, stride_q_dim, HAS_Q_MASK: tl.constexpr):
    """A chunk of query rows on chip, with the rows that count (inside, and not masked; the
    others are loaded as zeros). ``row_offsets``: each row's element offset in ``Q``;
    ``mask_index``: its index in the contiguous query mask."""
    m_valid = m_row
    if HAS_Q_MASK:
        m_valid = m_valid & (tl.load(QMask + mask_index, mask=m_row, other=0) != 0)
    b_q = tl.load(
        Q + row_offsets[:, None] + o_k[None, :] * stride_q_dim,
        mask=m_valid[:, None] & m_k[None, :],
        other=0.0,
    )
    return b_q, m_valid


@triton.jit
def _chunk_scores(row_max, m_valid, unit, q_inv, QUERIES_PER_BLOCK: tl.constexpr, LQ_TILE: tl.constexpr):
    """Each query's part of a chunk's score: ``Σ unit · row_max · q_inv`` over its counted rows,
    where a row without a valid document token adds 0."""
    contrib = tl.where(row_max == float("-inf"), 0.0, row_max) * unit * q_inv
    contrib = tl.where(m_valid, contrib, 0.0)
    return tl.sum(tl.reshape(contrib, (QUERIES_PER_BLOCK, LQ_TILE)), axis=1)


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
            t_lo, t_hi, all_valid, o_k, m_k, smooth_scale, EVEN_K, NORMALIZE, NORM_FROM_TILES,
            SAVE_ARGMAX and not SMOOTH, SMOOTH, BLOCK_M, BLOCK_N, DOT_PRECISION, UPCAST,
            QUERY_IN_REGISTERS,
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
def _dd_product(
    o_t, idx, g, b_q, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, G_SCALED: tl.constexpr
):
    """``onehot(idx == t)ᵀ @ (g · Q)`` for the tokens ``o_t``, the one-hot built transposed,
    ``[BLOCK_T, BLOCK_R]``, so that the product needs no layout shuffle. bf16 and fp32 rows, and
    fp16 rows whose ``g`` the caller has brought into fp16's range (``G_SCALED``,
    :func:`_g_scales`): each row's ``g`` stands in the one-hot in place of 1 (rounded to the
    input dtype: bf16 has fp32's range), and the query rows go to the product as loaded, with no
    pass over them. Other fp16 rows: ``g · Q`` rounded to fp16 with an exact one-hot, since a
    loss-scaled ``g`` (65536 · g under a gradient scaler) can pass fp16's largest value where
    ``g · Q`` does not."""
    match = o_t[:, None] == idx[None, :]
    if b_q.dtype == tl.float16 and not G_SCALED:
        weights = tl.where(match, 1.0, 0.0).to(tl.float16)
        rows = (b_q.to(tl.float32) * g[:, None]).to(tl.float16)
    else:
        weights = tl.where(match, g[None, :], 0.0).to(b_q.dtype)
        rows = b_q
    return _dot(weights, rows, DOT_PRECISION, UPCAST)


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
    reads only the rows that won one of its tokens, in the index's order (``_kernels_index``):
    program column 0 is column ``col_base``, and ``Rows``/``Counts`` hold that chunk's index.
    """
    pid = tl.program_id(0).to(tl.int64)
    i_grp = pid // Ncols
    i_col = pid % Ncols
    if WINNER_INDEX:
        i_grp = 0
        i_col = col_base + pid
    tb_lo = tl.program_id(1).to(tl.int64) * tiles_per_program
    tb_hi = tl.minimum(tb_lo + tiles_per_program, tl.cdiv(Ld, BLOCK_T))

    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < dim
    o_block = tl.arange(0, BLOCK_R)
    if PER_QUERY_DOCS:
        r_lo = i_grp * Lq
        r_hi = r_lo + Lq
    else:
        r_lo = 0
        r_hi = Nq * Lq
    p_out = GradD + i_grp * stride_gd_grp + i_col * stride_gd_col + o_k[None, :] * stride_gd_dim
    # fp16 without normalize: the column's g divided by a power of two of its largest |g| before
    # the one-hot (and the tile multiplied back at the store), so that g itself fits fp16's range
    # and the rows skip bf16's pass over them in fp32 (the longer part of fp16's block).
    G_SCALED: tl.constexpr = Q.dtype.element_ty == tl.float16 and not NORMALIZE
    g_down, g_up = 1.0, 1.0
    if G_SCALED:
        g_down, g_up = _g_scales(Grad, r_lo // Lq, tl.cdiv(r_hi, Lq), i_col, stride_g_seq,
                                 stride_g_col, BLOCK_R)

    if ROWS_IN_ONE_BLOCK:  # loaded once, for every tile of the program
        idx, g, b_q = _dd_rows(
            Grad, Q, QInv, Argmax, r_lo + o_block, r_lo + o_block < r_hi, i_col, Ncols, Lq, o_k,
            m_k, stride_g_seq, stride_g_col, stride_q_seq, stride_q_tok, stride_q_dim,
            stride_qinv_seq, stride_qinv_tok, NORMALIZE, False,
        )
        g = g * g_down
    for i_tb in range(tb_lo, tb_hi):
        o_t = i_tb * BLOCK_T + tl.arange(0, BLOCK_T)
        if ROWS_IN_ONE_BLOCK:
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
        tl.store(p_out + o_t[:, None] * stride_gd_tok, (acc * g_up).to(GradD.dtype.element_ty),
                 mask=(o_t < Ld)[:, None] & m_k[None, :])


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
