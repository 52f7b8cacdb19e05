"""Triton kernels of the winner index: the (query, query token) rows of each document column,
sorted by the document token that won their max, for the document-owned ``grad_D``.

Math
----
On the cross product the rows ``r = i · Lq + s`` of document column ``j`` win tokens
``A[i, j, s]`` (``-1``: no valid token). The document-owned backward adds
``g[i, j] · Q[i, s]`` into ``grad_D[j, A[i, j, s]]``; scanning every row for every token tile
costs the forward's products again. The index lists, per column, the rows that won any token,
in order of the token won and, among equal tokens, of the row (a stable counting sort)::

    Rows[j, Starts[j, t] : Starts[j, t + 1]] = the rows r with A[r, j] = t, ascending
    Starts[j, 0] = 0, Starts[j, Ld] = the number of rows of column j that won a token

so the owner of a token tile ``[t0, t1)`` reads exactly ``Rows[j, Starts[j, t0] : Starts[j, t1]]``.
Everything is integer and fixed-order: the index, and so the backward built on it, is bitwise
reproducible.

Grid mapping
------------
Both kernels run over ``(column of the chunk, block of ROWS_PER_BLOCK rows)``; columns
``[col_base, col_base + n_cols)`` of the argmax, index column 0 is ``col_base``.

* ``_winner_counts_kernel``: ``Counts[j, b, t]`` = the rows of block ``b`` that won token ``t``
  (a histogram per block; every entry below ``Ld`` written, no zero fill needed).
* ``_winner_rows_kernel``: program ``(j, b)`` sums the counts of its column (all blocks, and the
  blocks before its own) into each token's start, then walks its rows in ``SUB_ROWS`` steps:
  a row's place is its token's cursor plus the rows before it in the step that won the same
  token; the cursor advances by the step's histogram. Program ``(j, 0)`` writes ``Starts[j]``.

Caveats
-------
* ``BINS`` (a power of two, constexpr) must exceed ``Ld``: the launcher uses the index only then.
  It is one value for every ``Ld``, so a new document length compiles nothing.
* The histogram needs int32 tokens; the int16 argmax is widened on load.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _won_tokens(Argmax, o_r, m_r, i_col, Ncols, Lq):
    """The tokens won by rows ``o_r`` of column ``i_col`` (int32; ``-1``: none or out of range)."""
    o_q = (o_r // Lq).to(tl.int64)
    return tl.load(Argmax + (o_q * Ncols + i_col) * Lq + o_r % Lq, mask=m_r, other=-1).to(tl.int32)


@triton.jit(do_not_specialize=["Ncols", "Lq", "Ld", "n_rows", "n_blocks", "rows_per_block", "col_base"])
def _winner_counts_kernel(
    Argmax, Counts, Ncols, Lq, Ld, n_rows, n_blocks, rows_per_block, col_base,
    BINS: tl.constexpr, SUB_ROWS: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    r_lo = b * rows_per_block
    r_hi = tl.minimum(r_lo + rows_per_block, n_rows)
    counts = tl.zeros([BINS], tl.int32)
    for r0 in range(r_lo, r_hi, SUB_ROWS):
        o_r = r0 + tl.arange(0, SUB_ROWS)
        t = _won_tokens(Argmax, o_r, o_r < r_hi, col_base + j, Ncols, Lq)
        counts += tl.histogram(t, BINS, mask=t >= 0)
    o_t = tl.arange(0, BINS)
    tl.store(Counts + (j * n_blocks + b) * Ld + o_t, counts, mask=o_t < Ld)


@triton.jit(do_not_specialize=["Ncols", "Lq", "Ld", "n_rows", "n_blocks", "rows_per_block", "col_base"])
def _winner_rows_kernel(
    Argmax, Counts, Starts, Rows, Ncols, Lq, Ld, n_rows, n_blocks, rows_per_block, col_base,
    BINS: tl.constexpr, SUB_ROWS: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    o_t = tl.arange(0, BINS)
    m_t = o_t < Ld
    total = tl.zeros([BINS], tl.int32)
    before = tl.zeros([BINS], tl.int32)
    for b2 in range(0, n_blocks):
        counts = tl.load(Counts + (j * n_blocks + b2) * Ld + o_t, mask=m_t, other=0)
        total += counts
        before += tl.where(b2 < b, counts, 0)
    starts = tl.cumsum(total, 0) - total  # exclusive; BINS > Ld, so starts[Ld] is the row count
    if b == 0:
        tl.store(Starts + j * (Ld + 1) + o_t, starts, mask=o_t <= Ld)

    cursor = starts + before
    o_sub = tl.arange(0, SUB_ROWS)
    p_rows = Rows + j * n_rows
    r_lo = b * rows_per_block
    r_hi = tl.minimum(r_lo + rows_per_block, n_rows)
    for r0 in range(r_lo, r_hi, SUB_ROWS):
        o_r = r0 + o_sub
        t = _won_tokens(Argmax, o_r, o_r < r_hi, col_base + j, Ncols, Lq)
        won = t >= 0
        # Rows before this one in the step that won the same token keep their order ahead of it.
        earlier = (t[None, :] == t[:, None]) & (o_sub[None, :] < o_sub[:, None])
        place = tl.gather(cursor, tl.where(won, t, 0), 0) + tl.sum(earlier.to(tl.int32), 1)
        tl.store(p_rows + place, o_r.to(tl.int32), mask=won)
        cursor += tl.histogram(t, BINS, mask=won)
