"""Triton kernels of the winner index: the (query, query token) rows of each document column,
grouped by the token tile of ``grad_D`` that their winning token falls in, for the
document-owned backward.

Math
----
On the cross product the rows ``r = i · Lq + s`` of document column ``j`` win tokens
``A[i, j, s]`` (``-1``: no valid token). The document-owned backward adds ``g[i, j] · Q[i, s]``
into ``grad_D[j, A[i, j, s]]``; scanning every row for every token tile costs the forward's
products again. The index lists, per column, the rows whose token falls in each tile
``[k · BLOCK_T, (k + 1) · BLOCK_T)``, tile after tile: a counting sort by tile, with the rows of
each column split into parts (blocks of ``part_queries`` queries)::

    Parts[j, p, k] = #{r in part p : A[r, j] in tile k}
    Counts[j, k]   = Σ_p Parts[j, p, k]
    Rows[j, S_k + Σ_{p' < p} Parts[j, p', k] + ...] = the rows of part p in tile k,
                                                       S_k = Σ_{k' < k} Counts[j, k']

so the owner of tile ``k`` reads exactly its rows, in an order fixed by the shapes alone (part
after part; within a part, the scan's order: token chunks of ``SCAN_S``, within each the queries
in order): the index, and the backward built on it, is bitwise reproducible.

Grid mapping
------------
Both kernels run over ``(column of the chunk, part)``; columns ``[col_base, col_base + n_cols)``
of the argmax, index column 0 being ``col_base``. Each program reads its part of its column's
argmax (int16) in steps of ``SCAN_Q`` queries by ``SCAN_S`` query tokens, once per group of
``TILE_GROUP`` token tiles (once in all while ``Ld <= TILE_GROUP · BLOCK_T``), and matches each
row against the group's tiles (a ``[SCAN, TILE_GROUP]`` one-hot):

* ``_part_counts_kernel``: ``Parts[j, p, :]``.
* ``_part_rows_kernel``: each tile's first place for this part from the counts of the tiles
  before it and of the parts before it, then the part's rows placed in order (an exclusive
  prefix sum down the one-hot gives each row its rank within its tile); part 0 also writes
  ``Counts[j, :]``, which the ``grad_D`` kernel reads.

Caveats
-------
* ``BLOCK_T`` must be the tile of the ``grad_D`` kernel that reads the index.
* The parts keep the grid wide (a column's argmax is split over programs, each reading its
  share once) where one program per column would leave most of the GPU idle.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _won_tiles(Argmax, i0, s0, q_hi, Lq, i_col, Ncols, BLOCK_T: tl.constexpr, SCAN_Q: tl.constexpr,
               SCAN_S: tl.constexpr):
    """Queries ``[i0, min(i0 + SCAN_Q, q_hi))`` by query tokens ``[s0, s0 + SCAN_S)`` of column
    ``i_col``, flattened: their rows ``i · Lq + s`` and the token tile each won (``-1``: none, or
    out of range). Two axes, so that no row index is divided back into its query and token."""
    o_i = i0 + tl.arange(0, SCAN_Q)
    o_s = s0 + tl.arange(0, SCAN_S)
    m = (o_i < q_hi)[:, None] & (o_s < Lq)[None, :]
    t = tl.load(Argmax + (o_i.to(tl.int64)[:, None] * Ncols + i_col) * Lq + o_s[None, :], mask=m,
                other=-1).to(tl.int32)
    tiles = tl.where(t >= 0, t // BLOCK_T, -1)
    rows = o_i[:, None] * Lq + o_s[None, :]
    return tl.reshape(rows, [SCAN_Q * SCAN_S]), tl.reshape(tiles, [SCAN_Q * SCAN_S])


@triton.jit
def _tile_matches(won, k0, TILE_GROUP: tl.constexpr):
    """``[rows, TILE_GROUP]`` int32: 1 where a row's tile is ``k0 + column``."""
    o_tile = k0 + tl.arange(0, TILE_GROUP)
    return (won[:, None] == o_tile[None, :]).to(tl.int32)


@triton.jit
def tile_start(p_counts, tile, SCAN: tl.constexpr):
    """``Σ_{k < tile} counts[k]``: where tile ``tile``'s rows begin in its column's index."""
    start = 0
    for k0 in range(0, tile, SCAN):
        o_k = k0 + tl.arange(0, SCAN)
        start += tl.sum(tl.load(p_counts + o_k, mask=o_k < tile, other=0))
    return start


@triton.jit(do_not_specialize=["Nq", "Ncols", "Lq", "n_tiles", "col_base", "part_queries"])
def _part_counts_kernel(
    Argmax, Parts, Nq, Ncols, Lq, n_tiles, col_base, part_queries,
    BLOCK_T: tl.constexpr, SCAN_Q: tl.constexpr, SCAN_S: tl.constexpr, TILE_GROUP: tl.constexpr,
    PART_SCAN: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    q_lo = part * part_queries
    q_hi = tl.minimum(q_lo + part_queries, Nq)
    p_parts = Parts + (j * tl.num_programs(1) + part) * n_tiles
    for k0 in range(0, n_tiles, TILE_GROUP):
        counts = tl.zeros([TILE_GROUP], tl.int32)
        for s0 in range(0, Lq, SCAN_S):
            for i0 in range(q_lo, q_hi, SCAN_Q):
                _, won = _won_tiles(Argmax, i0, s0, q_hi, Lq, col_base + j, Ncols, BLOCK_T, SCAN_Q,
                                    SCAN_S)
                counts += tl.sum(_tile_matches(won, k0, TILE_GROUP), 0)
        o_tile = k0 + tl.arange(0, TILE_GROUP)
        tl.store(p_parts + o_tile, counts, mask=o_tile < n_tiles)


@triton.jit(do_not_specialize=["Nq", "Ncols", "Lq", "n_tiles", "col_base", "part_queries"])
def _part_rows_kernel(
    Argmax, Parts, Counts, Rows, Nq, Ncols, Lq, n_tiles, col_base, part_queries,
    BLOCK_T: tl.constexpr, SCAN_Q: tl.constexpr, SCAN_S: tl.constexpr, TILE_GROUP: tl.constexpr,
    PART_SCAN: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    n_parts = tl.num_programs(1)
    q_lo = part * part_queries
    q_hi = tl.minimum(q_lo + part_queries, Nq)
    p_parts = Parts + j * n_parts * n_tiles
    p_rows = Rows + j * Nq * Lq
    ahead_of_group = 0  # rows of the tiles before this group, all parts
    for k0 in range(0, n_tiles, TILE_GROUP):
        o_tile = k0 + tl.arange(0, TILE_GROUP)
        m_tile = o_tile < n_tiles
        total = tl.zeros([TILE_GROUP], tl.int32)
        earlier_parts = tl.zeros([TILE_GROUP], tl.int32)
        for p0 in range(0, n_parts, PART_SCAN):
            o_p = p0 + tl.arange(0, PART_SCAN)
            c = tl.load(p_parts + o_p[:, None] * n_tiles + o_tile[None, :],
                        mask=(o_p < n_parts)[:, None] & m_tile[None, :], other=0)
            total += tl.sum(c, 0)
            earlier_parts += tl.sum(tl.where((o_p < part)[:, None], c, 0), 0)
        if part == 0:
            tl.store(Counts + j * n_tiles + o_tile, total, mask=m_tile)
        place = ahead_of_group + tl.cumsum(total, 0) - total + earlier_parts
        ahead_of_group += tl.sum(total, 0)
        for s0 in range(0, Lq, SCAN_S):
            for i0 in range(q_lo, q_hi, SCAN_Q):
                rows, won = _won_tiles(Argmax, i0, s0, q_hi, Lq, col_base + j, Ncols, BLOCK_T,
                                       SCAN_Q, SCAN_S)
                match = _tile_matches(won, k0, TILE_GROUP)
                rank = tl.cumsum(match, 0) - match  # matches of the same tile ahead in this step
                dest = tl.sum(match * (place[None, :] + rank), 1)
                tl.store(p_rows + dest, rows, mask=tl.sum(match, 1) != 0)
                place += tl.sum(match, 0)
