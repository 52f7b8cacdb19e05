"""Triton kernel of PLAID's approximate score (``fusedmaxsim.plaid.plaid_approx_score``): the IVF
pruning step, MaxSim against documents known only by their tokens' centroid ids.

Math
----
For centroid scores ``cs [Nq, n_centroids, Lq]`` (``cs[q, c, s]``: query ``q``'s token ``s``
against centroid ``c``, usually ``centroids @ Q[q]ᵀ``) and document ``j`` the centroid ids
``codes[starts[j] : starts[j] + lengths[j]]``::

    score[q, j] = Σ_s  max_{t < lengths[j]}  cs[q, codes[starts[j] + t], s]

The max is taken over the stored values, converted to fp32 (exact), and the sum in fp32. A query
token whose max is ``-inf`` (an empty document, or ``-inf`` in every entry the document's ids
select) adds 0, so an empty document scores 0. With per-query candidates (``CANDIDATES``) column
``c`` of query ``q`` is document ``doc_ids[q, c]``; an id < 0 is "no candidate", scored ``-inf``.
With hits (``HITS``) column ``j`` is document ``j``, scored where ``Hits[q, j]`` is nonzero and
``-inf`` elsewhere.

Grid mapping
------------
1-D grid.

* Cross product: program ``j · n_qblocks + b`` owns document ``j`` and the queries
  ``[b · QUERIES_PER_BLOCK, (b + 1) · QUERIES_PER_BLOCK)``; the query blocks of one document are
  neighbours, so the programs reading its ids run together. A document's ids are read once a
  query chunk for every query of the block.
* Per-query candidates: program ``q · Ncols + c`` owns column ``c`` of query ``q``
  (``QUERIES_PER_BLOCK`` is 1).
* Hits (the search's candidates, ``HITS``): ``Hits [Nq, Nd]`` marks each query's candidate
  documents; program ``q · P + p`` (``P = n_slot_programs``) owns query ``q``'s documents
  ``[p · span, (p + 1) · span)`` and walks them in steps of ``BLOCK_D``: it loads a step's
  bytes, ranks its hits (a cumulative sum), scores them one after another and stores the step's
  scores at once, -inf for a document that is no candidate. A bitmap as wide as the corpus costs
  a byte a document to walk, and needs no compacted list of candidates (whose offsets would need
  a scan across the corpus); ``P`` spreads the corpus over the GPU whatever the hit count.

A program walks its queries' tokens in chunks of ``LQ_TILE`` (a run-time loop over ``Lq``, so
one compiled kernel serves every query length of a bucket) and, within a chunk, the document's
tokens in steps of ``BLOCK_T`` up to its length (a run-time value: no recompilation per
length). A step loads ``BLOCK_T`` ids, then gathers the ``[BLOCK_T, QUERIES_PER_BLOCK ·
LQ_TILE]`` tile of centroid scores (for each token, its centroid's row of each query, ``LQ_TILE``
consecutive values) and folds it into an element-wise running max of the same shape, reduced
over tokens once a chunk.

Caveats
-------
* Padded documents (``PADDED``): document ``j`` starts at ``j · padded_len`` (no ``Starts``
  read), and a length above ``padded_len`` scores NaN, like a range outside the ids.
* Bounds: a document whose range leaves ``[0, n_tokens)`` (a negative start or length, or
  ``start + length > n_tokens``) or a candidate id ``>= n_docs`` reads nothing and scores NaN;
  a token whose id lies outside ``[0, n_centroids)`` reads nothing and makes its document's
  scores NaN. Never a read out of bounds. NaN in a gathered score propagates to its sum.
* ``Lq`` is specialized as Triton does by default (1, a multiple of 16, other): where it is a
  multiple of 16 the column mask is known constant over 16 columns, so each centroid row is read
  with 16-byte loads (compiled offline for sm_90: 4 ``LDG.E.128`` a thread for a ``[128, 32]``
  fp16 tile, against 32 ``LDG.E.U16`` with ``Lq`` unspecialized). Three variants at most, never
  one per length.
* ``cs`` may have any strides (the launcher gives it a unit stride along ``Lq`` for coalesced
  rows); ``Out`` is contiguous ``[Nq, Ncols]``, and so are ``Hits``' bytes. ``codes`` int32
  or int64, ``starts`` and ``lengths`` any integer type; document lengths must fit in int32.
* Not differentiable (the caller's scores carry no gradient).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _max_propagate_nan


@triton.jit
def _approx_column(CS, Codes, Starts, Lengths, doc, q0, Nq, Lq, n_centroids, n_tokens, n_docs,
                   padded_len, stride_cs_q, stride_cs_c, stride_cs_s, stride_code,
                   CANDIDATES: tl.constexpr, PADDED: tl.constexpr, LQ_TILE: tl.constexpr,
                   QUERIES_PER_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr):
    """The scores ``[QUERIES_PER_BLOCK]`` of document ``doc`` (an id < 0 with ``CANDIDATES``:
    none, -inf) for the queries ``[q0, q0 + QUERIES_PER_BLOCK)``."""
    COLS: tl.constexpr = LQ_TILE * QUERIES_PER_BLOCK
    no_candidate = doc < 0
    known = (doc >= 0) & (doc < n_docs)
    doc = tl.where(known, doc, 0)
    length = tl.load(Lengths + doc, mask=known, other=0).to(tl.int64)
    if PADDED:
        start = doc * padded_len
        long = length > padded_len  # would read the next document's ids
    else:
        start = tl.load(Starts + doc, mask=known, other=0).to(tl.int64)
        long = False
    # A range outside the ids (checked without overflow) scores NaN and reads nothing.
    broken = (~known) | long | (start < 0) | (length < 0) | (start > n_tokens) | \
        (length > n_tokens - start)
    n_tok = tl.where(broken, 0, length).to(tl.int32)
    start = tl.where(broken, 0, start)
    p_codes = Codes + start * stride_code

    o_c = tl.arange(0, COLS)
    o_query = q0 + o_c // LQ_TILE  # [COLS] query of each column (int64)
    o_s_in = o_c % LQ_TILE
    m_query = o_query < Nq
    o_t0 = tl.arange(0, BLOCK_T)
    acc = tl.zeros([QUERIES_PER_BLOCK], tl.float32)
    for chunk in range(0, Lq, LQ_TILE):
        o_s = chunk + o_s_in
        m_col = m_query & (o_s < Lq)
        p_cols = CS + o_query * stride_cs_q + o_s * stride_cs_s  # [COLS] pointers
        run = tl.full([BLOCK_T, COLS], float("-inf"), tl.float32)
        for t0 in range(0, n_tok, BLOCK_T):
            o_t = t0 + o_t0
            m_t = o_t < n_tok
            code = tl.load(p_codes + o_t * stride_code, mask=m_t, other=0).to(tl.int64)
            bad = m_t & ((code < 0) | (code >= n_centroids))  # read nothing, score NaN
            m_read = m_t & (~bad)
            vals = tl.load(p_cols[None, :] + code[:, None] * stride_cs_c,
                           mask=m_read[:, None] & m_col[None, :], other=float("-inf"))
            vals = tl.where(bad[:, None], float("nan"), vals.to(tl.float32))
            run = tl.maximum(run, vals, propagate_nan=tl.PropagateNan.ALL)
        row_max = tl.reduce(run, 0, _max_propagate_nan)  # [COLS]
        contrib = tl.where(row_max == float("-inf"), 0.0, row_max)
        contrib = tl.where(m_col, contrib, 0.0)
        acc += tl.sum(tl.reshape(contrib, (QUERIES_PER_BLOCK, LQ_TILE)), axis=1)
    acc = tl.where(broken, float("nan"), acc)
    if CANDIDATES:
        acc = tl.where(no_candidate, float("-inf"), acc)
    return acc


@triton.jit(do_not_specialize=["Nq", "Ncols", "n_centroids", "n_tokens", "n_docs", "n_qblocks",
                               "n_slot_programs", "span", "padded_len"])
def _plaid_approx_kernel(
    CS,
    Codes,
    Starts,
    Lengths,
    DocIds,
    Hits,
    Out,
    Nq,
    Ncols,
    Lq,
    n_centroids,
    n_tokens,
    n_docs,
    n_qblocks,
    n_slot_programs,
    span,
    padded_len,
    stride_cs_q,
    stride_cs_c,
    stride_cs_s,
    stride_code,
    stride_ids_q,
    stride_ids_c,
    CANDIDATES: tl.constexpr,
    HITS: tl.constexpr,
    PADDED: tl.constexpr,
    LQ_TILE: tl.constexpr,
    QUERIES_PER_BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    if HITS:
        q0 = pid // n_slot_programs
        first = (pid % n_slot_programs) * span
        last = tl.minimum(first + span, Ncols)
        for d0 in range(first, last, BLOCK_D):
            o_d = d0 + tl.arange(0, BLOCK_D)
            m_d = o_d < last
            hit = (tl.load(Hits + q0 * Ncols + o_d, mask=m_d, other=0) != 0).to(tl.int32)
            rank = tl.cumsum(hit, 0)  # the i-th hit of the step has rank i + 1
            out = tl.full([BLOCK_D], float("-inf"), tl.float32)
            for i in range(0, tl.sum(hit, 0)):
                doc = tl.sum(tl.where((hit != 0) & (rank == i + 1), o_d, 0), 0)
                acc = _approx_column(CS, Codes, Starts, Lengths, doc, q0, Nq, Lq, n_centroids,
                                     n_tokens, n_docs, padded_len, stride_cs_q, stride_cs_c,
                                     stride_cs_s, stride_code, False, PADDED, LQ_TILE,
                                     QUERIES_PER_BLOCK, BLOCK_T)
                out = tl.where(o_d == doc, tl.sum(acc, 0), out)
            tl.store(Out + q0 * Ncols + o_d, out, mask=m_d)
    else:
        if CANDIDATES:
            q0 = pid // Ncols
            i_col = pid % Ncols
            doc = tl.load(DocIds + q0 * stride_ids_q + i_col * stride_ids_c).to(tl.int64)
        else:
            i_col = pid // n_qblocks
            q0 = (pid % n_qblocks) * QUERIES_PER_BLOCK
            doc = i_col
        acc = _approx_column(CS, Codes, Starts, Lengths, doc, q0, Nq, Lq, n_centroids, n_tokens,
                             n_docs, padded_len, stride_cs_q, stride_cs_c, stride_cs_s,
                             stride_code, CANDIDATES, PADDED, LQ_TILE, QUERIES_PER_BLOCK,
                             BLOCK_T)
        o_out = q0 + tl.arange(0, QUERIES_PER_BLOCK)
        tl.store(Out + o_out * Ncols + i_col, acc, mask=o_out < Nq)
