"""Triton helpers that the MaxSim kernels share: the one inner loop over document tiles
(``_doc_max``), the query chunks and their scores, the one-hot product of the document-owned
backwards and the segments of packed sequences.

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

Hidden-state documents (the fused projection head, ``HIDDEN_BLOCK > 0``): the documents arrive
as ``H [.., Ld, d_model]`` with nn.Linear's ``W [d, d_model]`` and optional ``b [d]``, and each
tile of ``D`` is projected on chip (:func:`_hidden_tile`), never written::

    D[g, j, t] = rnd(Σ_c H[g, j, t, c] · W[:, c] + b)      (fp32 sum, rnd: to H's dtype)

``F.linear(H, W, b)``'s values (up to the order of the sum: Caveats); masks, norms (from the
tiles) and the max as above.

The smooth max (``SMOOTH``) replaces ``max_t`` by ``tau · log Σ_{t valid} exp(S / tau)``, folded
tile by tile as an online log-sum-exp in base 2 (``y = S · log2(e) / tau``); instead of ``A`` the
forward saves ``L[i, j, s] = log2 Σ_t exp2(y)`` (``+inf`` where the token adds nothing), from
which ``smooth`` recomputes the softmax for the gradients.

Packed (ragged) sequences: queries are packed rows ``Q [Tq, d]`` with offsets ``cu_q [Nq + 1]``:
query ``i`` owns the rows ``[cu_q[i], cu_q[i + 1])``, ``Lq_i`` of them. Documents likewise:
``D [Td, d]``, ``cu_d [Nd + 1]``. A scored pair ``(i, j)`` is, with the masks and inverse norms
above::

    A[i, j, s]  = argmax_{t < Ld_j, valid} <Q[cu_q[i] + s], D[cu_d[j] + t]>   (lowest t; -1 if none)
    score(i, j) = Σ_{s < Lq_i, valid, A >= 0} <Q[cu_q[i] + s], D[cu_d[j] + A[i, j, s]]>

Two sets of pairs share every packed kernel:

* the cross product (``PAIRS=False``): every ``(i, j)``; scores ``[Nq, n_cols]`` for the documents
  ``col_lo + [0, n_cols)``; argmax ``[n_cols, Tq]``, indexed by (column, packed query row), so
  its size is independent of any maximum length and every kernel reads it with unit stride;
* a pair list (``PAIRS=True``): pair ``p`` is ``(pair_q[p], pair_d[p])``; scores ``[P]``; argmax
  ``[P, max_seqlen_q]``, indexed by (pair, query token). Pairs may repeat queries or documents.

The backward needs no matrix product of the similarities, only the argmax (``A`` is a document
token index, local to its document)::

    grad_Q[cu_q[i] + s] = Σ_{pairs (i, j)} g(i, j) · D[cu_d[j] + A[i, j, s]]
    grad_D[cu_d[j] + t] = Σ_{pairs (i, j)} Σ_{s: A[i, j, s] = t} g(i, j) · Q[cu_q[i] + s]

Caveats
-------
* NaN: the max propagates NaN (``PropagateNan.ALL``), so a NaN in a valid token makes the affected
  scores NaN. A NaN in a masked token is ignored, as in the reference.
* ``UPCAST`` computes dots in fp32: the Triton interpreter's bf16 ``tl.dot`` is wrong on CPU.
* Hidden-state documents: the projection's fp32 sum over ``d_model`` runs in ``HIDDEN_BLOCK``
  steps, an order other than ``F.linear``'s, so a 16-bit projected element can round the other
  way (one ulp); fp32 inputs take the products' ``DOT_PRECISION`` (TF32 unless told). A tile is
  projected afresh for every query block and query chunk that streams it.
* ``QUERY_IN_REGISTERS`` relies on a Triton rewrite (``MMAV3UseRegOperand``, triton 3.6-3.9):
  a Hopper product takes its first operand from registers only when that operand comes out of
  another tensor-core product, so the query tile is passed through one with a zero operand
  (exact). Where the rewrite does not fire, the kernel is the same with one small product more.
* Packed sequences: ``max_seqlen_q`` / ``max_seqlen_d`` choose tiles and bound the pair-list
  argmax; no loop runs to them. A sequence longer than the bound it was promised makes its scores
  NaN (loud, and never an out-of-bounds access); offsets are clamped into ``[0, rows]`` and
  argmax entries into ``[0, Ld_j)``, so malformed ``cu_seqlens`` give wrong numbers, never a dead
  CUDA context. A pair whose index is out of range scores NaN and reads nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..settings import INTERPRETER

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
def _residual_tile(p_codes, stride_code_tok, res, o_t, m_t, BLOCK_K: tl.constexpr,
                   NBITS: tl.constexpr, EVEN_K: tl.constexpr):
    """``(tile, inside)``: tokens ``o_t`` of one PLAID document, decompressed on chip
    (``centroids[code] + bucket_weights[b]`` per dimension, rounded to the centroids' dtype),
    and whether each token's centroid id lies in ``[0, n_centroids)``. A token outside it is
    read as centroid 0 (never out of bounds) and the caller makes its scores NaN. The tile is
    zero past ``dim``; a token outside ``m_t`` holds finite values the caller masks.

    ``res`` = ``(residual row pointer, its token stride, centroids, their row stride,
    weight table, n_centroids, dim)``. The weight table ``[256, 8 // NBITS]`` holds, for each
    residual byte, the bucket weights of its codes in dimension order (the bit order folded in
    when the table is made: ``fusedmaxsim._problem.weight_table``), so a token's residual
    row is read once as bytes and each byte gathers its ``8 // NBITS`` weights with one load
    (from L1: the table is 0.5-4 KiB). The loaded ``[BLOCK_N, bytes, codes a byte]`` tile is
    reshaped to ``[BLOCK_N, BLOCK_K]`` before any arithmetic (a reshape right before the
    product's operand fails Hopper's shared layouts). The sum is taken in the centroids' dtype
    when the weights share it (for 16-bit values the same result as fp32's sum rounded: where
    fp32 rounds, the smaller term is under a quarter of the larger's 16-bit ulp), else in fp32.
    """
    p_res, stride_res_tok, Centroids, stride_cent, WeightTable, n_centroids, dim = res
    PER_BYTE: tl.constexpr = 8 // NBITS
    BYTES: tl.constexpr = BLOCK_K // PER_BYTE
    code = tl.load(p_codes + o_t * stride_code_tok, mask=m_t, other=0)
    inside = (code >= 0) & (code < n_centroids)
    code = tl.where(inside, code, 0).to(tl.int64)
    o_b = tl.arange(0, BYTES)
    p_byte = p_res + o_t[:, None] * stride_res_tok + o_b[None, :]
    if EVEN_K:  # the row is BYTES long: a token's mask alone, so its bytes load as vectors
        byte = tl.load(p_byte, mask=m_t[:, None], other=0)
    else:
        byte = tl.load(p_byte, mask=m_t[:, None] & (o_b * 8 < dim * NBITS)[None, :], other=0)
    o_j = tl.arange(0, PER_BYTE)
    weight = tl.load(WeightTable + byte.to(tl.int32)[:, :, None] * PER_BYTE + o_j[None, None, :])
    weight = tl.reshape(weight, [o_t.shape[0], BLOCK_K])
    o_k = tl.arange(0, BLOCK_K)
    rows = tl.load(Centroids + code[:, None] * stride_cent + o_k[None, :],
                   mask=m_t[:, None] & (o_k < dim)[None, :], other=0.0)
    if WeightTable.dtype.element_ty == rows.dtype:
        tile = rows + weight
    else:
        tile = (rows.to(tl.float32) + weight.to(tl.float32)).to(rows.dtype)
    if not EVEN_K:  # the spare codes of the last byte, and the bytes past the row
        tile = tl.where((o_k < dim)[None, :], tile, 0.0)
    return tile, inside


@triton.jit
def _hidden_tile(p_h, stride_h_tok, hid, o_t, m_t, o_k, m_k, HIDDEN_BLOCK: tl.constexpr,
                 HIDDEN_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                 MASK_ROWS: tl.constexpr = True, EVEN_K: tl.constexpr = False):
    """Tokens ``o_t`` of one document projected on chip from its hidden states: ``H[o_t] · Wᵀ
    (+ b)`` accumulated in fp32 over ``d_model`` in ``HIDDEN_BLOCK`` steps, the bias added in
    fp32, then rounded to H's dtype (``F.linear``'s output); zero outside ``m_k`` (W and the
    bias are read as zeros there) and, with ``MASK_ROWS``, outside ``m_t`` (where the rows would
    hold the bias), so the tile's norms hold. A tile whose rows are all in ``m_t`` (a document's
    full tiles) skips that select and reads its whole steps of ``H`` unmasked; with ``EVEN_K``
    (``d`` is the tile's width) ``W`` is read unmasked too.

    ``p_h`` points at the document's first token; ``hid`` = ``(H's dim stride, W, W's row
    stride, W's column stride, bias, d_model)`` (``W [d, d_model]``, nn.Linear's weight; the
    bias ``[d]`` contiguous, read only with ``HIDDEN_BIAS``). The loop runs over ``d_model`` at
    run time (one compiled kernel for every width): whole steps with no bound on the hidden
    dim, the tail step masked.
    """
    stride_h_dim, W, stride_w_out, stride_w_in, Bias, d_model = hid
    # int64 token offsets: H may be a strided view with a large token stride. Each step's
    # addresses come from these offsets and the step's start, not from pointer tiles carried
    # through the loop: carried, each pipeline stage held its own [BLOCK_N, HIDDEN_BLOCK] of
    # 64-bit pointers, and the kernel spilled (NOTES §72).
    o_row = o_t.to(tl.int64)[:, None] * stride_h_tok
    o_col = o_k[None, :] * stride_w_out
    acc = tl.zeros([o_t.shape[0], o_k.shape[0]], tl.float32)
    c_full = d_model // HIDDEN_BLOCK * HIDDEN_BLOCK
    for c in range(0, c_full, HIDDEN_BLOCK):
        o_c = c + tl.arange(0, HIDDEN_BLOCK)
        if MASK_ROWS:
            h = tl.load(p_h + o_row + o_c[None, :] * stride_h_dim, mask=m_t[:, None], other=0.0)
        else:
            h = tl.load(p_h + o_row + o_c[None, :] * stride_h_dim)
        if EVEN_K:
            w = tl.load(W + o_c[:, None] * stride_w_in + o_col)
        else:
            w = tl.load(W + o_c[:, None] * stride_w_in + o_col, mask=m_k[None, :], other=0.0)
        acc += _dot(h, w, DOT_PRECISION, UPCAST)  # Wᵀ's [HIDDEN_BLOCK, d] step
    if c_full < d_model:
        o_c = c_full + tl.arange(0, HIDDEN_BLOCK)
        m_c = o_c < d_model
        h = tl.load(p_h + o_row + o_c[None, :] * stride_h_dim, mask=m_t[:, None] & m_c[None, :],
                    other=0.0)
        w = tl.load(W + o_c[:, None] * stride_w_in + o_col, mask=m_c[:, None] & m_k[None, :],
                    other=0.0)
        acc += _dot(h, w, DOT_PRECISION, UPCAST)
    if HIDDEN_BIAS:
        acc += tl.load(Bias + o_k, mask=m_k, other=0.0).to(tl.float32)[None, :]
    tile = acc.to(p_h.dtype.element_ty)
    if MASK_ROWS:
        tile = tl.where(m_t[:, None], tile, 0.0)
    return tile


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
    res,
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
    RESIDUAL_NBITS: tl.constexpr,
    HIDDEN_BLOCK: tl.constexpr = 0,
    HIDDEN_BIAS: tl.constexpr = False,
):
    """One document tile folded into the running reduction.

    The tile is loaded from ``p_doc``, or with ``RESIDUAL_NBITS`` decompressed on chip from a
    PLAID document (:func:`_residual_tile`; ``p_doc`` then points at its centroid ids and ``res``
    holds the rest), or with ``HIDDEN_BLOCK`` projected on chip from hidden states
    (:func:`_hidden_tile`; ``p_doc`` then points at the document's hidden states and ``res``
    holds the projection).

    Max: the element-wise running max ``acc_max [BLOCK_M, BLOCK_N]``; keeping the max per
    (row, slot) and reducing over slots once per document costs one max instruction per
    similarity, against a reduction with shuffles per tile.
    Smooth max (``SMOOTH``): an online log-sum-exp per row, ``acc_max [BLOCK_M]`` the running max
    and ``run_sum`` the running sum of ``exp2(y - acc_max)``, in log2 units ``y = s · smooth_scale``.
    """
    o_t = start + tl.arange(0, BLOCK_N)
    m_t = o_t < t_hi
    p = p_doc + o_t[:, None] * stride_doc_tok + o_k[None, :] * stride_doc_dim
    if RESIDUAL_NBITS:
        b_d, inside = _residual_tile(p_doc, stride_doc_tok, res, o_t, m_t, o_k.shape[0],
                                     RESIDUAL_NBITS, EVEN_K)
        b_d = b_d.to(b_q.dtype)
    elif HIDDEN_BLOCK:
        b_d = _hidden_tile(p_doc, stride_doc_tok, res, o_t, m_t, o_k, m_k, HIDDEN_BLOCK,
                           HIDDEN_BIAS, DOT_PRECISION, UPCAST, MASK_TAIL, EVEN_K).to(b_q.dtype)
    elif MASK_TAIL:
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
        if RESIDUAL_NBITS:  # a centroid id out of range: the token's scores are NaN
            d_inv = tl.where(inside, d_inv, float("nan"))
        b_s = b_s * d_inv[None, :]
    elif RESIDUAL_NBITS:
        b_s = tl.where(inside[None, :], b_s, float("nan"))
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
    res,
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
    RESIDUAL_NBITS: tl.constexpr = 0,
    HIDDEN_BLOCK: tl.constexpr = 0,
    HIDDEN_BIAS: tl.constexpr = False,
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
    document tiles. ``RESIDUAL_NBITS``: the document is a PLAID one, decompressed tile by tile
    (:func:`_residual_tile`, with ``res``); ``HIDDEN_BLOCK``: the document is hidden
    states, projected tile by tile (:func:`_hidden_tile`, with ``res``, the bias with
    ``HIDDEN_BIAS``); both 0 (dense documents) leave ``res`` unread.
    """
    if QUERY_IN_REGISTERS and not UPCAST:
        b_q = _in_product_layout(b_q)
    if all_valid:
        row_max, row_arg = _doc_loop(
            b_q, p_doc, stride_doc_tok, stride_doc_dim, p_dmask, stride_dmask_tok, p_dinv,
            stride_dinv_tok, t_lo, t_hi, o_k, m_k, smooth_scale, res, EVEN_K, False, NORMALIZE,
            NORM_FROM_TILES, TRACK_ARGMAX, SMOOTH, BLOCK_M, BLOCK_N, DOT_PRECISION, UPCAST,
            RESIDUAL_NBITS, HIDDEN_BLOCK, HIDDEN_BIAS,
        )
    else:
        row_max, row_arg = _doc_loop(
            b_q, p_doc, stride_doc_tok, stride_doc_dim, p_dmask, stride_dmask_tok, p_dinv,
            stride_dinv_tok, t_lo, t_hi, o_k, m_k, smooth_scale, res, EVEN_K, True, NORMALIZE,
            NORM_FROM_TILES, TRACK_ARGMAX, SMOOTH, BLOCK_M, BLOCK_N, DOT_PRECISION, UPCAST,
            RESIDUAL_NBITS, HIDDEN_BLOCK, HIDDEN_BIAS,
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
    res,
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
    RESIDUAL_NBITS: tl.constexpr,
    HIDDEN_BLOCK: tl.constexpr = 0,
    HIDDEN_BIAS: tl.constexpr = False,
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
            stride_doc_dim, p_dmask, stride_dmask_tok, p_dinv, stride_dinv_tok, o_k, m_k, res,
            False, EVEN_K, HAS_D_MASK, NORMALIZE, NORM_FROM_TILES, TRACK_ARGMAX, SMOOTH, BLOCK_N,
            DOT_PRECISION, UPCAST, RESIDUAL_NBITS, HIDDEN_BLOCK, HIDDEN_BIAS,
        )
    if t_full < t_hi:
        acc_max, acc_arg, run_sum = _doc_tile(
            b_q, acc_max, acc_arg, run_sum, smooth_scale, t_full, t_hi, p_doc, stride_doc_tok,
            stride_doc_dim, p_dmask, stride_dmask_tok, p_dinv, stride_dinv_tok, o_k, m_k, res,
            True, EVEN_K, HAS_D_MASK, NORMALIZE, NORM_FROM_TILES, TRACK_ARGMAX, SMOOTH, BLOCK_N,
            DOT_PRECISION, UPCAST, RESIDUAL_NBITS, HIDDEN_BLOCK, HIDDEN_BIAS,
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


@triton.jit
def _dd_product(
    o_t, idx, g, b_q, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, G_SCALED: tl.constexpr
):
    """``onehot(idx == t)ᵀ @ (g · Q)`` for the tokens ``o_t``, the one-hot built transposed,
    ``[BLOCK_T, BLOCK_R]``, so that the product needs no layout shuffle. bf16 and fp32 rows, and
    fp16 rows whose ``g`` the caller has brought into fp16's range (``G_SCALED``,
    :func:`backward._g_scales`): each row's ``g`` stands in the one-hot in place of 1 (rounded
    to the input dtype: bf16 has fp32's range), and the query rows go to the product as loaded,
    with no pass over them. Other fp16 rows: ``g · Q`` rounded to fp16 with an exact one-hot,
    since a loss-scaled ``g`` (65536 · g under a gradient scaler) can pass fp16's largest value
    where ``g · Q`` does not."""
    match = o_t[:, None] == idx[None, :]
    if b_q.dtype == tl.float16 and not G_SCALED:
        weights = tl.where(match, 1.0, 0.0).to(tl.float16)
        rows = (b_q.to(tl.float32) * g[:, None]).to(tl.float16)
    else:
        weights = tl.where(match, g[None, :], 0.0).to(b_q.dtype)
        rows = b_q
    return _dot(weights, rows, DOT_PRECISION, UPCAST)


@triton.jit
def _segment(Cu, idx, mask, n_rows):
    """First packed row and length of sequence ``idx`` (scalar or vector), clamped into
    ``[0, n_rows]`` so that malformed offsets can never address outside the packed tensor."""
    lo = tl.load(Cu + idx, mask=mask, other=0).to(tl.int64)
    hi = tl.load(Cu + idx + 1, mask=mask, other=0).to(tl.int64)
    lo = tl.minimum(tl.maximum(lo, 0), n_rows)
    hi = tl.minimum(tl.maximum(hi, lo), n_rows)
    return lo, hi - lo

