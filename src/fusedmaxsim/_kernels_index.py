"""Triton kernels of the winner index: the (query, query token) rows of each document column,
grouped by the token tile of ``grad_D`` that their winning token falls in, for the
document-owned backward.

Math
----
On the cross product the rows ``r = i · Lq + s`` of document column ``j`` win tokens
``A[i, j, s]`` (``-1``: no valid token). The document-owned backward adds ``g[i, j] · Q[i, s]``
into ``grad_D[j, A[i, j, s]]``; scanning every row for every token tile costs the forward's
products again. The index lists, per column, the rows whose token falls in each tile
``[k · BLOCK_T, (k + 1) · BLOCK_T)``, tile after tile::

    Counts[j, k] = #{r : A[r, j] in tile k}
    Rows[j, S_k : S_k + Counts[j, k]] = those rows,   S_k = Σ_{k' < k} Counts[j, k']

so the owner of tile ``k`` reads exactly its rows, in an order fixed by the shapes alone (the
scan's: token chunks of ``SCAN_S``, within each the queries in order): the index, and the
backward built on it, is bitwise reproducible.

Grid mapping
------------
Both kernels run over ``(column of the chunk, token tile)``; columns ``[col_base, col_base +
n_cols)`` of the argmax, index column 0 being ``col_base``. Each program scans its column's
rows in steps of ``SCAN_Q`` queries by ``SCAN_S`` query tokens (the argmax of one column is
``Nq · Lq`` int16, read from L2 once per tile):

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
def _won_tiles(Argmax, i0, s0, Nq, Lq, i_col, Ncols, BLOCK_T: tl.constexpr, SCAN_Q: tl.constexpr,
               SCAN_S: tl.constexpr):
    """Queries ``[i0, i0 + SCAN_Q)`` by query tokens ``[s0, s0 + SCAN_S)`` of column ``i_col``,
    flattened: their rows ``i · Lq + s`` and the token tile each won (``-1``: none, or out of
    range). Two axes, so that no row index is divided back into its query and token."""
    o_i = i0 + tl.arange(0, SCAN_Q)
    o_s = s0 + tl.arange(0, SCAN_S)
    m = (o_i < Nq)[:, None] & (o_s < Lq)[None, :]
    t = tl.load(Argmax + (o_i.to(tl.int64)[:, None] * Ncols + i_col) * Lq + o_s[None, :], mask=m,
                other=-1).to(tl.int32)
    tiles = tl.where(t >= 0, t // BLOCK_T, -1)
    rows = o_i[:, None] * Lq + o_s[None, :]
    return tl.reshape(rows, [SCAN_Q * SCAN_S]), tl.reshape(tiles, [SCAN_Q * SCAN_S])


@triton.jit
def tile_start(p_counts, tile, SCAN: tl.constexpr):
    """``Σ_{k < tile} counts[k]``: where tile ``tile``'s rows begin in its column's index."""
    start = 0
    for k0 in range(0, tile, SCAN):
        o_k = k0 + tl.arange(0, SCAN)
        start += tl.sum(tl.load(p_counts + o_k, mask=o_k < tile, other=0))
    return start


@triton.jit(do_not_specialize=["Nq", "Ncols", "Lq", "n_tiles", "col_base"])
def _tile_counts_kernel(
    Argmax, Counts, Nq, Ncols, Lq, n_tiles, col_base,
    BLOCK_T: tl.constexpr, SCAN: tl.constexpr, SCAN_Q: tl.constexpr, SCAN_S: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    count = 0
    for s0 in range(0, Lq, SCAN_S):
        for i0 in range(0, Nq, SCAN_Q):
            _, won = _won_tiles(Argmax, i0, s0, Nq, Lq, col_base + j, Ncols, BLOCK_T, SCAN_Q, SCAN_S)
            count += tl.sum((won == tile).to(tl.int32))
    tl.store(Counts + j * n_tiles + tile, count)


@triton.jit(do_not_specialize=["Nq", "Ncols", "Lq", "n_tiles", "col_base"])
def _tile_rows_kernel(
    Argmax, Counts, Rows, Nq, Ncols, Lq, n_tiles, col_base,
    BLOCK_T: tl.constexpr, SCAN: tl.constexpr, SCAN_Q: tl.constexpr, SCAN_S: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    place = tile_start(Counts + j * n_tiles, tile, SCAN)
    p_rows = Rows + j * Nq * Lq
    for s0 in range(0, Lq, SCAN_S):
        for i0 in range(0, Nq, SCAN_Q):
            rows, won = _won_tiles(Argmax, i0, s0, Nq, Lq, col_base + j, Ncols, BLOCK_T, SCAN_Q, SCAN_S)
            match = (won == tile).to(tl.int32)
            before = tl.cumsum(match, 0) - match  # matches ahead of each row in this step
            tl.store(p_rows + place + before, rows, mask=match != 0)
            place += tl.sum(match)
