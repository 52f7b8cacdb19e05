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

(``Rows`` int16 where every row number fits, else int32), so the owner of tile ``k`` reads
exactly its rows, in an order fixed by the shapes alone (the scan's: token chunks of
``SCAN_S``, within each the queries in order): the index, and the backward built on it, is
bitwise reproducible.

Grid mapping
------------
Both kernels run over ``(column of the chunk, group of TILES consecutive token tiles)``; columns
``[col_base, col_base + n_cols)`` of the argmax, index column 0 being ``col_base``. Each program
scans its column's rows once, in steps of ``SCAN_Q`` queries by ``SCAN_S`` query tokens (the
argmax of one column is ``Nq · Lq`` int16, read from L2 once per group), and handles the matches
of all its tiles at once: each entry's match is a one in its tile's 16-bit field of an int64, so
that one sum counts, and one prefix sum ranks, the rows of up to four tiles:

* ``_tile_counts_kernel``: ``Counts[j, k]`` of the group's tiles (the fields summed per entry
  slot over the steps, then over the slots once).
* ``_tile_rows_kernel``: each tile's ``S_k`` from the counts before it, then its rows compacted
  in order (an exclusive prefix sum of the packed matches of each step gives their places).

Caveats
-------
* ``BLOCK_T`` must be the tile of the ``grad_D`` kernel that reads the index.
* The fields hold 16 bits: a step of at most ``2^16 - 1`` entries, and, for more than one tile a
  program, fewer than ``2^16`` steps a column (``Nq · Lq < 2^16 · SCAN``); the launcher takes
  one tile a program beyond that.
* The work is ``Ld / (BLOCK_T · TILES)`` scans of each column's argmax: small next to the
  products it saves, which were ``Ld / BLOCK_T`` times those of the rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

# A step's matches of one tile are counted in a 16-bit field of an int64, four tiles to it: a step
# holds at most 2^16 - 1 rows, and a counting slot gains at most one a step (the launcher keeps a
# column's steps below 2^16).
FIELD_BITS = tl.constexpr(16)
FIELD_MASK = tl.constexpr(0xFFFF)


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


@triton.jit
def _packed_matches(won, tile0, TILES: tl.constexpr):
    """Each entry's match among tiles ``[tile0, tile0 + TILES)`` as a one in the 16-bit field of
    its tile in an int64 (0 where it won none of them), that field's index in the group (0 where
    none) and its shift."""
    k = won - tile0
    hit = (k >= 0) & (k < TILES)
    field = tl.where(hit, k, 0)
    shift = field.to(tl.int64) * FIELD_BITS
    return tl.where(hit, tl.full(won.shape, 1, tl.int64) << shift, 0), field, shift


@triton.jit(do_not_specialize=["Nq", "Ncols", "Lq", "n_tiles", "col_base"])
def _tile_counts_kernel(
    Argmax, Counts, Nq, Ncols, Lq, n_tiles, col_base,
    BLOCK_T: tl.constexpr, SCAN: tl.constexpr, SCAN_Q: tl.constexpr, SCAN_S: tl.constexpr,
    TILES: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64)
    tile0 = tl.program_id(1) * TILES
    # Per entry slot, the matches of every step in its fields; the slots are added up once.
    slots = tl.zeros([SCAN_Q * SCAN_S], tl.int64)
    for s0 in range(0, Lq, SCAN_S):
        for i0 in range(0, Nq, SCAN_Q):
            _, won = _won_tiles(Argmax, i0, s0, Nq, Lq, col_base + j, Ncols, BLOCK_T, SCAN_Q, SCAN_S)
            slots += _packed_matches(won, tile0, TILES)[0]
    if TILES == 1:  # one tile: the slots' counts need no field (as many steps as a column has)
        tl.store(Counts + j * n_tiles + tile0, tl.sum(slots).to(tl.int32))
    else:
        for f in tl.static_range(TILES):
            count = tl.sum((slots >> (f * FIELD_BITS)) & FIELD_MASK)
            tl.store(Counts + j * n_tiles + tile0 + f, count.to(tl.int32), mask=tile0 + f < n_tiles)


@triton.jit(do_not_specialize=["Nq", "Ncols", "Lq", "n_tiles", "col_base"])
def _tile_rows_kernel(
    Argmax, Counts, Rows, Nq, Ncols, Lq, n_tiles, col_base,
    BLOCK_T: tl.constexpr, SCAN: tl.constexpr, SCAN_Q: tl.constexpr, SCAN_S: tl.constexpr,
    TILES: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64)
    tile0 = tl.program_id(1) * TILES
    p_counts = Counts + j * n_tiles
    o_f = tl.arange(0, TILES)
    # Where each of the group's tiles places its next row: its start, then the rows placed.
    counts = tl.load(p_counts + tile0 + o_f, mask=tile0 + o_f < n_tiles, other=0)
    places = tile_start(p_counts, tile0, SCAN) + tl.cumsum(counts, 0) - counts
    p_rows = Rows + j * Nq * Lq
    for s0 in range(0, Lq, SCAN_S):
        for i0 in range(0, Nq, SCAN_Q):
            rows, won = _won_tiles(Argmax, i0, s0, Nq, Lq, col_base + j, Ncols, BLOCK_T, SCAN_Q, SCAN_S)
            match, field, shift = _packed_matches(won, tile0, TILES)
            # One scan ranks the rows of every tile of the group: the matches ahead of each row
            # in this step, in its tile's field.
            ahead = ((tl.cumsum(match, 0) - match) >> shift) & FIELD_MASK
            place = tl.gather(places, field, 0)
            tl.store(p_rows + place + ahead, rows.to(Rows.dtype.element_ty), mask=match != 0)
            placed = tl.sum(match)
            places += ((placed >> (o_f.to(tl.int64) * FIELD_BITS)) & FIELD_MASK).to(places.dtype)
