"""The dense forward of MaxSim for Hopper GPUs in Gluon, with each tile's product overlapping the
previous tile's max.

Math
----
The forward of ``forward._maxsim_fwd_kernel`` without masks or the smooth max, with or without
normalization (the norms from the tiles, ``NORMALIZE``) or, without it, the argmax
(``SAVE_ARGMAX``): the same products, norms and maxima (a chunk's row sums may be added in
another order, so scores can differ from Triton's in the last bit)::

    S[i, j, s, t] = <Q[i, s], D[j, t]>            (fp32 accumulation of 16-bit inputs)
    score[i, j]   = Σ_s max_t S[i, j, s, t]
    NORMALIZE:      Σ_s inv(Q[i, s]) · max_t S[i, j, s, t] · inv(D[j, t]),
                    inv(x) = 1 / max(‖x‖, 1e-12) in fp32 from the 16-bit tokens
    SAVE_ARGMAX:    A[i, j, s] = the winning t, from coded similarities (below)

The argmax without a third register tile (docs/design.md, Hopper: the coded argmax): each product
of pass tile ``p`` (at most ``TILE_CODES`` tiles a pass) is coded as ``(S & -16) | (15 - p)`` on
its fp32 bits, and the running max folds the coded values with the same one ``max`` an element
as the scores alone. The end of a pass reduces each row over the columns (the larger coded
value, the lower column among equal ones) and decodes the tile. So the max loses its four low
bits (scores within ~2e-6 relative of the Triton kernel's), and among similarities equal but in
those bits (16 units in the last place) the winner is the earliest tile's where they are 0 or
more and the last tile's where they are negative (float order reverses on the sign); exact ties
inside a tile go to the lower token.

Why a second kernel
-------------------
In the Triton kernel each document tile's warp-group product is waited for right after it is
issued, and the max (and argmax) of its similarities runs while the tensor cores idle: the wait
is the most-sampled instruction of the forward, 19-21% of all warp samples, and the tensor pipe
is busy about half the time (docs/design.md, Forward: chunk splits). Triton 3.6-3.9 does not reorder
this (section 20). Here the loop is written out: the product of tile ``t`` is issued
asynchronously, then the kernel waits only for the product of tile ``t - 1`` and folds it into
the running max while tile ``t``'s product runs. Document tiles arrive by TMA into a ring of
``NUM_STAGES`` shared-memory slots, each with its mbarrier; a slot is refilled as soon as the
product that read it is known to be complete. With ``NORMALIZE`` a tile's inverse norms are
read back from its slot (four threads a token, the squares summed in eights first) just before
its product is issued, while the previous product runs and the registers of the one being
issued are still free, and stored to a small shared buffer; once the product has completed, a
CTA barrier orders those reads before the slot's refill, and the norms are loaded from the
buffer in the product's column layout and applied before the fold (section 35: no barrier
before the product's issue, as a layout conversion there had). With ``TILES_FIRST`` (documents
streamed from DRAM) a pass requests its first tiles before loading its query chunk, so that the
two latencies overlap (docs/design.md, Hopper).

Grid mapping
------------
As ``_maxsim_fwd_kernel``: program ``(j · n_splits + c, b)`` owns document ``j``, the query block
``b`` of ``BLOCK_M = LQ_TILE · QUERIES_PER_BLOCK`` rows and its chunks ``c, c + n_splits, …``,
and writes its part of the scores to ``Out[c]`` (``stride_out_split`` apart). ``d_desc`` views
the documents as one ``[Nd · Ld, dim]`` matrix: tile rows past the end of a document belong to
the next one (or are TMA's zero fill past the last) and are masked out of the max. With
``DOCS_PER_PROGRAM > 1`` (one query chunk, documents of at least ``NUM_STAGES`` tiles) program
``(j, b)`` owns documents ``j · DOCS_PER_PROGRAM, …`` (fewer in the last), one pass each: the
query chunk is loaded once, and the refills of a pass request the next document's first tiles,
so the ring is filled once a program (docs/design.md, Hopper: documents a program).

Caveats
-------
* Hopper only (``warpgroup_mma``, TMA); 16-bit inputs with ``dim == BLOCK_K``; documents
  contiguous and 16-byte aligned (TMA), ``Nd · Ld < 2**31``. The launcher sends every other case
  to the Triton kernel.
* Two ``[BLOCK_M, BLOCK_N]`` fp32 products live at once (the one in flight and the one being
  folded), beside the running max: ``BLOCK_N`` stays at 32-64.
* The argmax as a third register tile beside the running max ran slower than the Triton kernel
  under every tile, stage and warp count measured (docs/design.md, Hopper: tile sets), and so
  did a fold of five instructions an element (section 42): the fold, not the wait for the
  product, sets the pace. The coded fold is two (a ``lop3``, then the ``max``).
* With ``SAVE_ARGMAX``, an infinite similarity coded with a nonzero code is a NaN: a row whose
  max would be +inf (an infinite input, or an fp32 overflow) scores NaN, unless that similarity
  lies in a pass's sixteenth tile (code 0). A NaN row's token is a column of its first tile.
* One warp group (4 warps), except on grids of at most one program an SM, where two warp
  groups split a 128-row block (19-27% faster there, slower on larger grids; sections 31 and
  34).
* NaN propagates through the max as in the Triton kernel.
"""

from __future__ import annotations

import triton.language as tl

try:  # Gluon is experimental; without it (or on CPU) the Triton kernel serves every case.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # The TMA load's name: `async_copy_global_to_shared` up to triton 3.6, `async_load` after.
    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    # The CTA barrier: `thread_barrier` up to triton 3.6, `barrier` after.
    _cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
    AVAILABLE = True
    # Document tiles a pass can number in the low bits of the argmax forward's running max.
    TILE_CODE_BITS = 4
    TILE_CODES = gl.constexpr(1 << TILE_CODE_BITS)
except Exception:  # noqa: BLE001 (any import failure means: not available)
    AVAILABLE = False


if AVAILABLE:

    @gluon.jit
    def _max_nan(a, b):
        return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @gluon.jit
    def _inverse_norms(x):
        """``1 / max(‖row‖, 1e-12)`` in fp32 for each row of a register tile, as the Triton
        kernel's ``_inverse_norm`` (``F.normalize``'s eps)."""
        ROWS: gl.constexpr = x.shape[0]
        DIM: gl.constexpr = x.shape[1]
        x = x.to(gl.float32)
        # Sums of eight squares first: independent of each other, where one running sum over a
        # thread's 32 squares would be a chain of 32 dependent adds.
        eights = gl.sum(gl.reshape(x * x, [ROWS, DIM // 8, 8]), axis=2)
        return 1.0 / gl.maximum(gl.sqrt(gl.sum(eights, axis=1)), 1e-12)

    @gluon.jit
    def _coded(acc, code):
        """``acc`` with ``code`` in its low ``TILE_CODE_BITS`` bits: ``(acc & -16) | code``, one
        ``lop3`` an element. The running max of coded values (one ``max`` an element, as the
        plain forward's) keeps, of each element's values equal but in those bits, the one of
        the highest code where they are 0 or more and of the lowest where they are negative.

        Inline PTX so that the coding takes the product's own registers: any temporary ptxas
        may place in a product's registers, as it did for a fold written with integer ops,
        serializes every product (C7515; section 42)."""
        gl.static_assert(TILE_CODES == 16)
        return gl.inline_asm_elementwise(
            "lop3.b32 $0, $1, -16, $2, 0xea;", "=r,r,r", [acc, code], dtype=gl.float32,
            is_pure=True, pack=1)

    @gluon.jit
    def _argmax_combine(value_a, col_a, value_b, col_b):
        """The larger coded value (NaN first), the lower column among equal ones."""
        take_a = (value_a > value_b) | ((value_a == value_b) & (col_a < col_b)) \
            | (value_a != value_a)  # noqa: PLR0124 (the NaN test)
        return gl.where(take_a, value_a, value_b), gl.where(take_a, col_a, col_b)

    @gluon.jit
    def _decoded_row_max(run_max, o_c, Ld):
        """Each row's max over the pass and its document token, from the coded running max:
        the value with its code bits cleared (NaN kept), the token from the winning column and
        the tile its code names (kept inside the document, which only a NaN row can leave)."""
        BLOCK_N: gl.constexpr = run_max.shape[1]
        layout: gl.constexpr = run_max.type.layout
        cols = gl.zeros(run_max.shape, gl.int32, layout) + gl.expand_dims(o_c, 0)
        best, col = gl.reduce((run_max, cols), 1, _argmax_combine)
        bits = best.to(gl.int32, bitcast=True)
        value = gl.where(best != best, best,  # noqa: PLR0124 (the NaN test)
                         (bits & ~(TILE_CODES - 1)).to(gl.float32, bitcast=True))
        token = (TILE_CODES - 1 - (bits & (TILE_CODES - 1))) * BLOCK_N + col
        return value, gl.minimum(gl.maximum(token, 0), Ld - 1)

    @gluon.jit
    def _complete(acc, inv_smem, run_max, d_desc, bars, d_smem, doc_row, has_next, done, t,
                  n_tiles, Ld, o_c, NORMALIZE: gl.constexpr, MASK_TAIL: gl.constexpr,
                  ACROSS_DOCS: gl.constexpr, SAVE_ARGMAX: gl.constexpr):
        """Tile ``t``'s product has completed: refill its slot, (with ``NORMALIZE``) scale its
        columns by the tile's inverse norms (from ``inv_smem``), and fold it into the running
        max (columns from ``Ld`` on masked where ``MASK_TAIL``; with ``SAVE_ARGMAX`` the coded
        values of :func:`_coded`). With ``ACROSS_DOCS`` the refills run on into the
        next document (at ``doc_row + Ld``) where ``has_next``."""
        NUM_STAGES: gl.constexpr = d_smem.shape[0]
        BLOCK_N: gl.constexpr = d_smem.shape[1]
        slot = (done + t) % NUM_STAGES
        if NORMALIZE:
            # Every warp's reads of the slot (its norms, before its product) are done before
            # its refill is issued, and every warp's share of the tile's inverse norms is in
            # `inv_smem`.
            _cta_barrier()
        refill = t + NUM_STAGES
        if ACROSS_DOCS:  # a refill past this document's tiles: the next one's first tiles
            beyond = (refill >= n_tiles).to(gl.int32)
            row = doc_row + refill * BLOCK_N - beyond * (n_tiles * BLOCK_N - Ld)
            _load_tile(d_desc, bars, d_smem, row, slot, (refill < n_tiles) | has_next)
        else:
            _load_tile(d_desc, bars, d_smem, doc_row + refill * BLOCK_N, slot, refill < n_tiles)
        if NORMALIZE:
            inv = inv_smem.index(slot).load(gl.SliceLayout(0, acc.type.layout))
            acc = acc * gl.expand_dims(inv, 0)
        if SAVE_ARGMAX:  # coded before the mask: -inf with code bits would be a NaN
            acc = _coded(acc, TILE_CODES - 1 - t)
        if MASK_TAIL:
            acc = gl.where(gl.expand_dims(t * BLOCK_N + o_c < Ld, 0), acc, float("-inf"))
        return _max_nan(run_max, acc)

    @gluon.jit
    def _issue(q_smem, d_smem, inv_smem, bars, acc, tile, NORMALIZE: gl.constexpr,
               TILE_LOAD_LAYOUT: gl.constexpr):
        """The product of the query chunk with document tile ``tile`` (counted over the program),
        issued once its TMA load has landed; not waited for. ``acc`` is ignored
        (``use_acc=False``): it names the registers the product is written over. With
        ``NORMALIZE``, first the tile's inverse norms, read back from its slot (four threads a
        token) and written to ``inv_smem``'s slot, which ``_complete`` reads in the product's
        column layout after the CTA barrier it has anyway: here, where one product is in flight
        and the other's registers are free, the reads and sums have the registers to run side by
        side, and no barrier holds the product's issue."""
        NUM_STAGES: gl.constexpr = d_smem.shape[0]
        slot = tile % NUM_STAGES
        mbarrier.wait(bars.index(slot), (tile // NUM_STAGES) & 1)
        if NORMALIZE:
            x = d_smem.index(slot).load(TILE_LOAD_LAYOUT)
            inv_smem.index(slot).store(_inverse_norms(x))
        return warpgroup_mma(q_smem, d_smem.index(slot).permute((1, 0)), acc, use_acc=False,
                             is_async=True)

    @gluon.jit
    def _fill_ring(d_desc, bars, d_smem, doc_row, done, n_tiles):
        """Request a pass's first ``NUM_STAGES`` document tiles (those it has), tile ``s`` into
        slot ``(done + s) % NUM_STAGES``."""
        NUM_STAGES: gl.constexpr = d_smem.shape[0]
        BLOCK_N: gl.constexpr = d_smem.shape[1]
        for s in gl.static_range(NUM_STAGES):
            _load_tile(d_desc, bars, d_smem, doc_row + s * BLOCK_N, (done + s) % NUM_STAGES,
                       s < n_tiles)

    @gluon.jit
    def _load_tile(d_desc, bars, d_smem, row, slot, pred):
        mbarrier.expect(bars.index(slot), d_desc.block_type.nbytes, pred=pred)
        _tma_load(d_desc, [row, 0], bars.index(slot), d_smem.index(slot), pred=pred)

    @gluon.jit
    def _load_query_chunk(Q, q_smem, chunk, lq_r, lq_query, lq_k, Nq, Lq, stride_q_seq,
                          stride_q_tok, LQ_TILE: gl.constexpr, NORMALIZE: gl.constexpr,
                          rows_of: gl.constexpr):
        """The query chunk from row ``chunk`` through registers into ``q_smem`` (rows past the
        query or the batch as zeros); returns its rows' inverse norms with ``NORMALIZE`` (ones
        without)."""
        lq_s = chunk + lq_r % LQ_TILE
        lq_valid = (lq_query < Nq) & (lq_s < Lq)
        ptrs = Q + gl.expand_dims(lq_query.to(gl.int64) * stride_q_seq + lq_s * stride_q_tok, 1) \
            + gl.expand_dims(lq_k, 0)
        b_q = gl.load(ptrs, mask=gl.expand_dims(lq_valid, 1), other=0.0)
        q_smem.store(b_q)
        fence_async_shared()
        if NORMALIZE:
            q_inv = gl.convert_layout(_inverse_norms(b_q), rows_of)
        else:
            q_inv = gl.full([q_smem.shape[0]], 1.0, gl.float32, rows_of)
        return q_inv

    @gluon.jit
    def _pass(q_smem, d_smem, inv_smem, bars, d_desc, zero, doc_row, has_next, done, n_tiles, Ld,
              o_c, NORMALIZE: gl.constexpr, TILE_LOAD_LAYOUT: gl.constexpr,
              ACROSS_DOCS: gl.constexpr, SAVE_ARGMAX: gl.constexpr):
        """The query chunk in ``q_smem`` against the document at ``doc_row``, its ``n_tiles``
        tiles already requested (tile ``t`` as the program's ``done + t``): the element-wise
        running max of their similarities (with ``SAVE_ARGMAX``, of their coded values)."""
        mma: gl.constexpr = zero.type.layout
        run_max = gl.full(zero.shape, float("-inf"), gl.float32, mma)
        # Two products alternate in fixed registers, `acc_a` and `acc_b`: one in flight while
        # the other is folded. (A loop that copied the product in flight from one variable to
        # the other would read its registers before the wait, and ptxas then serializes every
        # product: C7514.) The previous value is the accumulator operand, ignored
        # (`use_acc=False`), so that each product writes over the registers it replaces.
        acc_a = _issue(q_smem, d_smem, inv_smem, bars, zero, done, NORMALIZE, TILE_LOAD_LAYOUT)
        acc_b = zero
        t = 1
        for _ in range(0, (n_tiles - 1) // 2):
            acc_b = _issue(q_smem, d_smem, inv_smem, bars, acc_b, done + t, NORMALIZE,
                           TILE_LOAD_LAYOUT)
            acc_a = warpgroup_mma_wait(num_outstanding=1, deps=(acc_a,))
            run_max = _complete(acc_a, inv_smem, run_max, d_desc, bars, d_smem, doc_row,
                                has_next, done, t - 1, n_tiles, Ld, o_c, NORMALIZE, False,
                                ACROSS_DOCS, SAVE_ARGMAX)
            acc_a = _issue(q_smem, d_smem, inv_smem, bars, acc_a, done + t + 1, NORMALIZE,
                           TILE_LOAD_LAYOUT)
            acc_b = warpgroup_mma_wait(num_outstanding=1, deps=(acc_b,))
            run_max = _complete(acc_b, inv_smem, run_max, d_desc, bars, d_smem, doc_row,
                                has_next, done, t, n_tiles, Ld, o_c, NORMALIZE, False,
                                ACROSS_DOCS, SAVE_ARGMAX)
            t += 2
        # The last tile may run past the document: its columns from Ld on are masked.
        if t < n_tiles:
            pending = _issue(q_smem, d_smem, inv_smem, bars, acc_b, done + t, NORMALIZE,
                             TILE_LOAD_LAYOUT)
            before_last = warpgroup_mma_wait(num_outstanding=1, deps=(acc_a,))
            run_max = _complete(before_last, inv_smem, run_max, d_desc, bars, d_smem, doc_row,
                                has_next, done, t - 1, n_tiles, Ld, o_c, NORMALIZE, False,
                                ACROSS_DOCS, SAVE_ARGMAX)
            last = warpgroup_mma_wait(num_outstanding=0, deps=(pending,))
        else:
            last = warpgroup_mma_wait(num_outstanding=0, deps=(acc_a,))
        return _complete(last, inv_smem, run_max, d_desc, bars, d_smem, doc_row, has_next, done,
                         n_tiles - 1, n_tiles, Ld, o_c, NORMALIZE, True, ACROSS_DOCS, SAVE_ARGMAX)

    @gluon.jit
    def _row_scores(run_max, q_inv, Argmax, doc, chunk, o_r, o_query, o_c, Nq, Ncols, Lq, Ld,
                    LQ_TILE: gl.constexpr, NORMALIZE: gl.constexpr, SAVE_ARGMAX: gl.constexpr):
        """Each row's max over the pass (times its inverse norm with ``NORMALIZE``), 0 for rows
        past the query or the batch; with ``SAVE_ARGMAX`` each row's token is stored to
        ``Argmax[query, doc, token of the query]``."""
        o_s = chunk + o_r % LQ_TILE
        m_row = (o_query < Nq) & (o_s < Lq)
        if SAVE_ARGMAX:
            row_max, token = _decoded_row_max(run_max, o_c, Ld)
            gl.store(Argmax + (o_query.to(gl.int64) * Ncols + doc) * Lq + o_s,
                     token.to(Argmax.dtype.element_ty), mask=m_row)
        else:
            row_max = gl.reduce(run_max, 1, _max_nan)
        if NORMALIZE:
            row_max = row_max * q_inv
        return gl.where(m_row, row_max, 0.0)

    @gluon.jit
    def _store_block_scores(row_sums, out, Ncols, Nq, i_blk, o_r, LQ_TILE: gl.constexpr,
                            QUERIES_PER_BLOCK: gl.constexpr):
        """Each query of the block: the sum of its rows' ``row_sums``, to ``out`` + the query's
        row of scores (``Ncols`` apart)."""
        for q in gl.static_range(QUERIES_PER_BLOCK):
            query = i_blk * QUERIES_PER_BLOCK + q
            total = gl.sum(gl.where(o_r // LQ_TILE == q, row_sums, 0.0), axis=0)
            gl.store(out + query.to(gl.int64) * Ncols, total, mask=query < Nq)

    @gluon.jit(do_not_specialize=["Nq", "Ncols", "Lq", "Ld", "n_splits", "stride_out_split"])
    def _maxsim_fwd_overlap_kernel(
        Q,
        d_desc,
        Out,
        Argmax,
        Nq,
        Ncols,
        Lq,
        Ld,
        n_splits,
        stride_out_split,
        stride_q_seq,
        stride_q_tok,
        LQ_TILE: gl.constexpr,
        QUERIES_PER_BLOCK: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        NORMALIZE: gl.constexpr,
        SAVE_ARGMAX: gl.constexpr,
        TILES_FIRST: gl.constexpr,
        DOCS_PER_PROGRAM: gl.constexpr,
        Q_SMEM_LAYOUT: gl.constexpr,
        MMA_LAYOUT: gl.constexpr,
        Q_LOAD_LAYOUT: gl.constexpr,
        TILE_LOAD_LAYOUT: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        BLOCK_M: gl.constexpr = LQ_TILE * QUERIES_PER_BLOCK
        mma: gl.constexpr = MMA_LAYOUT
        q_load: gl.constexpr = Q_LOAD_LAYOUT
        rows_of: gl.constexpr = gl.SliceLayout(1, mma)
        cols_of: gl.constexpr = gl.SliceLayout(0, mma)

        i_col = gl.program_id(0) // n_splits * DOCS_PER_PROGRAM  # the program's first document
        i_split = gl.program_id(0) % n_splits
        i_blk = gl.program_id(1)
        doc_row = i_col * Ld
        n_tiles = gl.cdiv(Ld, BLOCK_N)

        q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [BLOCK_M, BLOCK_K], Q_SMEM_LAYOUT)
        d_smem = gl.allocate_shared_memory(d_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K],
                                           d_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        # A tile's inverse norms from `_issue` to `_complete`. Its slot is written again
        # NUM_STAGES tiles later, past the CTA barriers of the next two `_complete`s, which every
        # warp reaches only after its reads: three stages at least.
        gl.static_assert(not NORMALIZE or NUM_STAGES >= 3)
        inv_smem = gl.allocate_shared_memory(
            gl.float32, [NUM_STAGES if NORMALIZE else 1, BLOCK_N],
            gl.SwizzledSharedLayout(1, 1, 1, [0]))
        for s in gl.static_range(NUM_STAGES):
            mbarrier.init(bars.index(s), count=1)

        o_r = gl.arange(0, BLOCK_M, layout=rows_of)
        o_query = i_blk * QUERIES_PER_BLOCK + o_r // LQ_TILE
        o_c = gl.arange(0, BLOCK_N, layout=cols_of)
        lq_r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_load))
        lq_query = i_blk * QUERIES_PER_BLOCK + lq_r // LQ_TILE
        lq_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, q_load))
        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
        row_sums = gl.zeros([BLOCK_M], gl.float32, rows_of)

        done = 0  # document tiles consumed so far: tile `done + t` uses slot (done + t) % NUM_STAGES
        if DOCS_PER_PROGRAM == 1:
            for chunk in range(i_split * LQ_TILE, Lq, n_splits * LQ_TILE):
                # With TILES_FIRST the ring's first tiles are requested before the query chunk is
                # loaded, so that the two loads' latencies overlap (the previous chunk's products
                # have all completed).
                if TILES_FIRST:
                    _fill_ring(d_desc, bars, d_smem, doc_row, done, n_tiles)
                q_inv = _load_query_chunk(Q, q_smem, chunk, lq_r, lq_query, lq_k, Nq, Lq,
                                          stride_q_seq, stride_q_tok, LQ_TILE, NORMALIZE, rows_of)
                if not TILES_FIRST:
                    _fill_ring(d_desc, bars, d_smem, doc_row, done, n_tiles)
                run_max = _pass(q_smem, d_smem, inv_smem, bars, d_desc, zero, doc_row, False, done,
                                n_tiles, Ld, o_c, NORMALIZE, TILE_LOAD_LAYOUT, False, SAVE_ARGMAX)
                done += n_tiles
                row_sums += _row_scores(run_max, q_inv, Argmax, i_col, chunk, o_r, o_query, o_c,
                                        Nq, Ncols, Lq, Ld, LQ_TILE, NORMALIZE, SAVE_ARGMAX)
            out = Out + i_split.to(gl.int64) * stride_out_split + i_col
            _store_block_scores(row_sums, out, Ncols, Nq, i_blk, o_r, LQ_TILE, QUERIES_PER_BLOCK)
        else:
            # One query chunk (the launcher's guarantee) against the documents from `i_col`, each
            # a pass; the refills of one pass bring the next one's first tiles, so the ring
            # fills once a program (the documents hold NUM_STAGES tiles at least).
            if TILES_FIRST:
                _fill_ring(d_desc, bars, d_smem, doc_row, done, n_tiles)
            q_inv = _load_query_chunk(Q, q_smem, 0, lq_r, lq_query, lq_k, Nq, Lq, stride_q_seq,
                                      stride_q_tok, LQ_TILE, NORMALIZE, rows_of)
            if not TILES_FIRST:
                _fill_ring(d_desc, bars, d_smem, doc_row, done, n_tiles)
            n_docs = gl.minimum(DOCS_PER_PROGRAM, Ncols - i_col)
            for k in range(n_docs):
                run_max = _pass(q_smem, d_smem, inv_smem, bars, d_desc, zero, doc_row + k * Ld,
                                k + 1 < n_docs, done, n_tiles, Ld, o_c, NORMALIZE,
                                TILE_LOAD_LAYOUT, True, SAVE_ARGMAX)
                done += n_tiles
                row_scores = _row_scores(run_max, q_inv, Argmax, i_col + k, 0, o_r, o_query, o_c,
                                         Nq, Ncols, Lq, Ld, LQ_TILE, NORMALIZE, SAVE_ARGMAX)
                _store_block_scores(row_scores, Out + i_col + k, Ncols, Nq, i_blk, o_r, LQ_TILE,
                                    QUERIES_PER_BLOCK)

        for s in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(bars.index(s))
