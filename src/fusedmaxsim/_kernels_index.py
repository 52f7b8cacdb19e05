"""Triton kernels of the winner index: the (query, query token) rows of each document column,
grouped by the token tile of ``grad_D`` that their winning token falls in, for the
document-owned backward.

Math
----
On the cross product the rows ``r = i · Lq + s`` of document column ``j`` win tokens
``A[i, j, s]`` (``-1``: no valid token). The document-owned backward adds ``g[i, j] · Q[i, s]``
into ``grad_D[j, A[i, j, s]]``; scanning every row for every token tile costs the forward's
products again. The index lists, per column, the rows whose token falls in each tile
``[k · BLOCK_T, (k + 1) · BLOCK_T)``, tile after tile, each tile's rows in ascending order::

    Counts[j, k] = #{r : A[r, j] in tile k}
    Rows[j, S_k : S_k + Counts[j, k]] = those rows, ascending,   S_k = Σ_{k' < k} Counts[j, k']

so the owner of tile ``k`` reads exactly its rows, in an order fixed by the data alone: the index,
and the backward built on it, is bitwise reproducible.

Grid mapping
------------
Both kernels run over ``(column of the chunk, token tile)``; columns ``[col_base, col_base +
n_cols)`` of the argmax, index column 0 being ``col_base``. Each program scans its column's
rows in ``SCAN`` steps (the argmax of one column is ``Nq · Lq`` int16, read from L2 once per
tile):

* ``_tile_counts_kernel``: ``Counts[j, k]``.
* ``_tile_rows_kernel``: ``S_k`` from the counts before it, then the rows of tile ``k`` compacted
  in order (an exclusive prefix sum of the matches of each step gives their places).

Caveats
-------
* ``BLOCK_T`` must be the tile of the ``grad_D`` kernel that reads the index.
* The work is ``Ld / BLOCK_T`` scans of each column's argmax: small next to the products it
  saves, which were ``Ld / BLOCK_T`` times those of the rows.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _won_tiles(Argmax, o_r, m_r, i_col, Ncols, Lq, BLOCK_T: tl.constexpr):
    """The token tile won by rows ``o_r`` of column ``i_col`` (``-1``: none, or out of range)."""
    o_q = (o_r // Lq).to(tl.int64)
    t = tl.load(Argmax + (o_q * Ncols + i_col) * Lq + o_r % Lq, mask=m_r, other=-1).to(tl.int32)
    return tl.where(t >= 0, t // BLOCK_T, -1)


@triton.jit
def tile_start(p_counts, tile, SCAN: tl.constexpr):
    """``Σ_{k < tile} counts[k]``: where tile ``tile``'s rows begin in its column's index."""
    start = 0
    for k0 in range(0, tile, SCAN):
        o_k = k0 + tl.arange(0, SCAN)
        start += tl.sum(tl.load(p_counts + o_k, mask=o_k < tile, other=0))
    return start


@triton.jit(do_not_specialize=["Ncols", "Lq", "n_rows", "n_tiles", "col_base"])
def _tile_counts_kernel(
    Argmax, Counts, Ncols, Lq, n_rows, n_tiles, col_base,
    BLOCK_T: tl.constexpr, SCAN: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    count = 0
    for r0 in range(0, n_rows, SCAN):
        o_r = r0 + tl.arange(0, SCAN)
        won = _won_tiles(Argmax, o_r, o_r < n_rows, col_base + j, Ncols, Lq, BLOCK_T)
        count += tl.sum((won == tile).to(tl.int32))
    tl.store(Counts + j * n_tiles + tile, count)


@triton.jit(do_not_specialize=["Ncols", "Lq", "n_rows", "n_tiles", "col_base"])
def _tile_rows_kernel(
    Argmax, Counts, Rows, Ncols, Lq, n_rows, n_tiles, col_base,
    BLOCK_T: tl.constexpr, SCAN: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    place = tile_start(Counts + j * n_tiles, tile, SCAN)
    p_rows = Rows + j * n_rows
    for r0 in range(0, n_rows, SCAN):
        o_r = r0 + tl.arange(0, SCAN)
        match = (_won_tiles(Argmax, o_r, o_r < n_rows, col_base + j, Ncols, Lq, BLOCK_T) == tile).to(tl.int32)
        before = tl.cumsum(match, 0) - match  # matches ahead of each row in this step
        tl.store(p_rows + place + before, o_r.to(tl.int32), mask=match != 0)
        place += tl.sum(match)
