"""The backward launchers: execute a :class:`~fusedmaxsim._plan.BackwardPlan`.

Inputs as the forward's (``forward``), plus the upstream gradient ``grad_scores`` (fp32, any
strides) and what the forward saved: the argmax, or under the smooth max each row's fp32
log2-sum-exp2. The plan says which kernels run, split and chunked how; these functions compute
strides and grids, allocate, and launch. Gradients come back in the input dtype, or fp32 with
``fp32_out`` (the normalizing path, whose Jacobian is applied above).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .._plan import BackwardPlan
from ..kernels.backward import (
    _drain_chunk_kernel,
    _maxsim_bwd_dd_kernel,
    _maxsim_bwd_gather_kernel,
    _maxsim_ragged_bwd_dd_kernel,
    _maxsim_ragged_bwd_dq_kernel,
)
from ..kernels.smooth import _smooth_bwd_kernel
from ..kernels.winner_index import _tile_counts_kernel, _tile_rows_kernel
from .runtime import (
    Constants,
    as_bytes,
    cdiv,
    constants,
    doc_strides,
    empty,
    gather_meta,
    grads_without_launch,
    launcher,
    owned_tile_meta,
    smooth_scales,
)

__all__ = ["backward_dense", "backward_packed", "backward_smooth", "sorted_pairs"]


def _or_empty(grad: Tensor | None, like: Tensor) -> Tensor:
    """A gradient nobody asked for is an empty tensor (the registered op returns tensors only)."""
    return like.new_empty((0,)) if grad is None else grad


# ------------------------------------------------------------------------------------------------
# Dense layouts: the gather (grad_Q; the unified grad_D's scatter) and the document-owned grad_D
# ------------------------------------------------------------------------------------------------


def backward_dense(plan: BackwardPlan, fp32_precision: str, grad_scores: Tensor, Q: Tensor,
                   D: Tensor, argmax: Tensor, q_inv: Tensor | None, d_inv: Tensor | None,
                   need_grad_q: bool, need_grad_d: bool, fp32_out: bool) -> tuple[Tensor, Tensor]:
    """Gradients of the scores with respect to Q and D (the normalized ones when normalizing).

    ``"unified"``: one gather kernel; fp32 atomics scatter ``grad_D`` into a buffer (whole, or
    ``plan.scatter_chunk_cols`` columns at a time, each chunk drained into grad_D). ``"lowmem"``:
    row-owned ``grad_Q`` and document-owned ``grad_D`` (through the winner index where the plan
    says so); no atomics, bitwise reproducible, written directly in the output dtype."""
    trivial = grads_without_launch(Q, D, need_grad_q, need_grad_d, fp32_out)
    if trivial is not None:
        return trivial
    per_query_docs = D.dim() == 4
    Ncols = D.shape[-3]
    q_dtype = torch.float32 if fp32_out else Q.dtype
    d_dtype = torch.float32 if fp32_out else D.dtype
    cfg = plan.tiles
    scatter_d = plan.strategy == "unified" and need_grad_d
    chunk_cols = plan.scatter_chunk_cols
    gather = functools.partial(
        _launch_gather, cfg, grad_scores, Q, D, argmax, q_inv, d_inv, per_query_docs
    )
    # One fp32 buffer for all of grad_D: one launch gathers grad_Q (when asked for) and scatters
    # grad_D, and grad_D is that buffer cast.
    one_buffer = scatter_d and chunk_cols == Ncols
    grad_q = grad_d = None
    if need_grad_q or one_buffer:
        atomic_q = plan.atomic_q
        if need_grad_q:
            grad_q = (torch.zeros(Q.shape, dtype=torch.float32, device=Q.device) if atomic_q
                      else empty(Q.shape, q_dtype, Q.device))
        buffer = _scatter_buffer(D, Ncols) if one_buffer else None
        gather(0, Ncols, plan.gather_splits, grad_q, buffer, plan.gather_step)
        if atomic_q and grad_q.dtype != q_dtype:
            grad_q = grad_q.to(q_dtype)
        if one_buffer:
            return _or_empty(grad_q, Q), buffer.to(d_dtype)

    if scatter_d:
        # Column chunks through an fp32 buffer of `chunk_cols` columns, each drained into grad_D
        # when complete (cast, and the buffer cleared for the next chunk, in one launch): the
        # buffer stays a fraction of grad_D however large D is.
        buffer = _scatter_buffer(D, chunk_cols)
        grad_d = empty(D.shape, d_dtype, D.device)
        for c0 in range(0, Ncols, chunk_cols):
            n = min(chunk_cols, Ncols - c0)
            gather(c0, n, min(n, plan.split_cap), None, buffer, (1, None))
            _drain_chunk(buffer, grad_d, c0, n, plan.drain_block)
    elif need_grad_d:
        grad_d = empty(D.shape, d_dtype, D.device)
        dd = functools.partial(
            _launch_dd, plan, grad_scores, Q, q_inv, argmax, grad_d, per_query_docs,
            fp32_precision,
        )
        if plan.winner_index:
            n_tiles = cdiv(D.shape[-2], cfg.block_t)
            index_cols = plan.index_cols
            index = _winner_index_buffers(Q, index_cols, n_tiles, plan.index_row_dtype)
            for c0 in range(0, Ncols, index_cols):
                n = min(index_cols, Ncols - c0)
                dd(c0, n, *_winner_index(plan, argmax, c0, n, index))
        else:
            dd(0, Ncols, None, None)
    return _or_empty(grad_q, Q), _or_empty(grad_d, Q)


def _scatter_buffer(D: Tensor, n_cols: int) -> Tensor:
    shape = list(D.shape)
    shape[-3] = n_cols
    return torch.zeros(shape, dtype=torch.float32, device=D.device)


def _drain_chunk(buffer: Tensor, grad_d: Tensor, c0: int, n_cols: int, block: int) -> None:
    """Columns ``[c0, c0 + n_cols)`` of ``grad_d`` from the buffer's first ``n_cols``, which are
    then zero again (``grad_d`` and ``buffer`` contiguous, columns on axis -3)."""
    groups = buffer.numel() // (buffer.shape[-3] * buffer.shape[-2] * buffer.shape[-1])
    n_elems = n_cols * buffer.shape[-2] * buffer.shape[-1]
    out = grad_d.narrow(-3, c0, n_cols)
    launcher(_drain_chunk_kernel)(
        (cdiv(n_elems, block) * groups,),
        (buffer, out, n_elems, buffer.stride(0) if groups > 1 else 0,
         grad_d.stride(0) if groups > 1 else 0),
        constants(BLOCK=block, num_warps=4, num_stages=1),
    )


def _launch_gather(cfg, grad_scores, Q, D, argmax, q_inv, d_inv, per_query_docs, col_base,
                   n_cols, splits, grad_q, grad_d_buffer, step) -> None:
    """The gather kernel over columns ``[col_base, col_base + n_cols)`` in ``splits`` column
    splits: ``grad_q`` (None: not computed; fp32 and added atomically when ``splits > 1``) and
    the scatter of ``g · Q`` rows into ``grad_d_buffer`` (None: none), whose column 0 is
    ``col_base``; ``step``: (columns a step, warps or None)."""
    Nq, Lq, dim = Q.shape
    Ncols, Ld = D.shape[-3], D.shape[-2]
    normalize = q_inv is not None
    cols_per_split = cdiv(n_cols, splits)
    splits = cdiv(n_cols, cols_per_split)
    launcher(_maxsim_bwd_gather_kernel)(
        (Nq * cdiv(Lq, cfg.block_s), splits),
        (
            grad_scores, Q, D,
            Q if q_inv is None else q_inv, D if d_inv is None else d_inv,
            argmax,
            Q if grad_q is None else grad_q,
            D if grad_d_buffer is None else grad_d_buffer,
            Nq, Ncols, Lq, Ld, dim, col_base, col_base + n_cols, cols_per_split,
            *grad_scores.stride(),
            *Q.stride(),
            *doc_strides(D, per_query_docs),
            *(q_inv.stride() if normalize else (0, 0)),
            *(doc_strides(d_inv, per_query_docs) if normalize else (0, 0, 0)),
            *(grad_q.stride() if grad_q is not None else (0, 0, 0)),
            *(doc_strides(grad_d_buffer, per_query_docs) if grad_d_buffer is not None
              else (0, 0, 0, 0)),
        ),
        _gather_constants(
            cfg, per_query_docs, normalize, grad_q is not None,
            grad_q is not None and splits > 1, grad_d_buffer is not None, step,
        ),
    )


@functools.lru_cache(maxsize=1024)
def _gather_constants(cfg, per_query_docs, normalize, grad_q, atomic_q, scatter_d,
                      step) -> Constants:
    cols_per_step, warps = step
    meta = gather_meta(cfg, normalize=normalize, grad_q=grad_q, atomic_q=atomic_q,
                       scatter_d=scatter_d)
    if warps is not None:
        meta["num_warps"] = warps
    return constants(PER_QUERY_DOCS=per_query_docs, COLS_PER_STEP=cols_per_step, **meta)


@functools.lru_cache(maxsize=1024)
def _dd_constants(cfg, per_query_docs, rows_in_one_block, winner_index, normalize, dtype,
                  fp32_precision, scan_stages, index_scan) -> Constants:
    return constants(
        PER_QUERY_DOCS=per_query_docs,
        ROWS_IN_ONE_BLOCK=rows_in_one_block,
        WINNER_INDEX=winner_index,
        INDEX_SCAN=index_scan,
        NORMALIZE=normalize,
        BLOCK_R=cfg.block_r,
        **owned_tile_meta(cfg, dtype, fp32_precision, None if rows_in_one_block else scan_stages),
    )


def _launch_dd(plan: BackwardPlan, grad_scores, Q, q_inv, argmax, grad_d, per_query_docs,
               fp32_precision, col_base, n_cols, rows, counts) -> None:
    """The document-owned grad_D over columns ``[col_base, col_base + n_cols)``: through the
    winner index ``rows``/``counts`` of those columns (cross product), or, without one (None),
    every column at once, each token tile scanning all of its group's rows."""
    cfg = plan.tiles
    Nq, Lq, dim = Q.shape
    Ncols, Ld = grad_d.shape[-3], grad_d.shape[-2]
    normalize = q_inv is not None
    groups = Nq if per_query_docs else 1
    tiles_per_program = plan.dd_tiles_per_program
    launcher(_maxsim_bwd_dd_kernel)(
        (groups * n_cols, cdiv(cdiv(Ld, cfg.block_t), tiles_per_program)),
        (
            grad_scores, Q, Q if q_inv is None else q_inv, argmax, grad_d,
            argmax if rows is None else rows, argmax if counts is None else counts,
            Nq, Ncols, Lq, Ld, dim, tiles_per_program, col_base,
            *grad_scores.stride(),
            *Q.stride(),
            *(q_inv.stride() if normalize else (0, 0)),
            *doc_strides(grad_d, per_query_docs),
        ),
        _dd_constants(
            cfg, per_query_docs, plan.rows_in_one_block, rows is not None, normalize, Q.dtype,
            fp32_precision, plan.dd_scan_stages, plan.index_scan,
        ),
    )


def _winner_index_buffers(Q: Tensor, n_cols: int, n_tiles: int,
                          row_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Rows and tile counts of ``n_cols`` columns (unwritten)."""
    return (
        empty((n_cols, Q.shape[0] * Q.shape[1]), row_dtype, Q.device),
        empty((n_cols, n_tiles), torch.int32, Q.device),
    )


def _winner_index(plan: BackwardPlan, argmax: Tensor, col_base: int, n_cols: int,
                  buffers) -> tuple[Tensor, Tensor]:
    """The winner index of columns ``[col_base, col_base + n_cols)`` for the plan's token tiles,
    in ``buffers``: two launches."""
    rows, counts = buffers
    Nq, Ncols, Lq = argmax.shape
    n_tiles = counts.shape[1]
    grid = (n_cols, cdiv(n_tiles, plan.index_tiles))
    args = (Nq, Ncols, Lq, n_tiles, col_base)
    meta = _index_constants(plan.tiles.block_t, plan.index_scan_tokens, plan.index_scan,
                            plan.index_tiles)
    launcher(_tile_counts_kernel)(grid, (argmax, counts, *args), meta)
    launcher(_tile_rows_kernel)(grid, (argmax, counts, rows, *args), meta)
    return rows, counts


@functools.lru_cache(maxsize=64)
def _index_constants(block_t: int, scan_tokens: int, scan: int, tiles: int) -> Constants:
    return constants(
        BLOCK_T=block_t, SCAN=scan, SCAN_Q=max(1, scan // scan_tokens), SCAN_S=scan_tokens,
        TILES=tiles, num_warps=4, num_stages=1,
    )


# ------------------------------------------------------------------------------------------------
# The smooth max: similarities recomputed tile by tile
# ------------------------------------------------------------------------------------------------


def backward_smooth(plan: BackwardPlan, fp32_precision: str, grad_scores: Tensor, Q: Tensor,
                    D: Tensor, d_mask: Tensor | None, row_lse: Tensor, tau: float,
                    need_grad_q: bool, need_grad_d: bool, fp32_out: bool) -> tuple[Tensor, Tensor]:
    """The smooth max's gradients: ``row_lse`` the forward's fp32 ``[Nq, Ncols, Lq]``
    log2-sum-exp2 rows; the bool document mask, if any. Deterministic, no atomics."""
    trivial = grads_without_launch(Q, D, need_grad_q, need_grad_d, fp32_out)
    if trivial is not None:
        return trivial
    per_query_docs = D.dim() == 4
    Nq, Lq, dim = Q.shape
    Ncols, Ld = D.shape[-3], D.shape[-2]
    q_dtype = torch.float32 if fp32_out else Q.dtype
    d_dtype = torch.float32 if fp32_out else D.dtype
    cfg = plan.tiles
    dm = as_bytes(d_mask)
    row_lse = row_lse.contiguous()
    scale, _ = smooth_scales(tau)

    def meta(grad_d: bool):
        return constants(
            GRAD_D=grad_d,
            HAS_D_MASK=dm is not None,
            PER_QUERY_DOCS=per_query_docs,
            BLOCK_S=cfg.block_s,
            **owned_tile_meta(cfg, Q.dtype, fp32_precision),
        )

    def args(out: Tensor) -> tuple:
        return (
            grad_scores, Q, D, D if dm is None else dm, row_lse, out,
            Nq, Ncols, Lq, Ld, dim, scale,
            *grad_scores.stride(), *Q.stride(), *doc_strides(D, per_query_docs),
        )

    grad_q = grad_d = Q.new_empty((0,))
    if need_grad_q:
        grad_q = empty(Q.shape, q_dtype, Q.device)
        launcher(_smooth_bwd_kernel)((Nq * cdiv(Lq, cfg.block_s),), args(grad_q), meta(False))
    if need_grad_d:
        grad_d = empty(D.shape, d_dtype, D.device)
        groups = Nq if per_query_docs else 1
        grid = (groups * Ncols, cdiv(Ld, cfg.block_t))
        launcher(_smooth_bwd_kernel)(grid, args(grad_d), meta(True))
    return grad_q, grad_d


# ------------------------------------------------------------------------------------------------
# Packed layouts
# ------------------------------------------------------------------------------------------------


def sorted_pairs(keys: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The pairs sorted by ``keys`` (stable, so in pair order within a key) and, for each
    ``k < n``, where its pairs start: pairs of ``k`` are ``order[starts[k]:starts[k + 1]]``.
    Keys outside ``[0, n)`` fall outside every range. Device-side, no host synchronization."""
    keys = keys.long()
    order = torch.argsort(keys, stable=True)
    bounds = torch.arange(n + 1, device=keys.device, dtype=torch.int64)
    starts = torch.searchsorted(keys[order], bounds)
    return order, starts


def _row_query(cu_q: Tensor, rows: int) -> Tensor:
    """Query of every packed query row (``n_queries`` for rows outside every query)."""
    rows_idx = torch.arange(rows, device=cu_q.device, dtype=cu_q.dtype)
    return torch.searchsorted(cu_q[1:].contiguous(), rows_idx, right=True).to(torch.int32)


def backward_packed(plan: BackwardPlan, fp32_precision: str, layout, grad_scores: Tensor,
                    Q: Tensor, D: Tensor, argmax: Tensor, q_inv: Tensor | None,
                    d_inv: Tensor | None, need_grad_q: bool, need_grad_d: bool,
                    fp32_out: bool) -> tuple[Tensor, Tensor]:
    """Gradients with respect to the packed Q and D (the normalized ones when normalizing).

    ``"unified"``: query-owned gather split over the pairs (``plan.gather_splits``), fp32
    atomics for ``grad_D`` and, when split, for ``grad_Q``. ``"lowmem"``: query-owned ``grad_Q``
    and document-owned ``grad_D``: no atomics, bitwise reproducible, in the output dtype."""
    pairs = layout.pair_q is not None
    rows_q, dim = Q.shape
    rows_d = D.shape[0]
    device = Q.device
    q_dtype = torch.float32 if fp32_out else Q.dtype
    d_dtype = torch.float32 if fp32_out else D.dtype
    none = Q.new_empty((0,))
    if not (need_grad_q or need_grad_d):
        return none, none
    n_items = layout.n_pairs if pairs else layout.n_queries * layout.n_docs
    if n_items == 0 or rows_q == 0 or rows_d == 0 or dim == 0:
        gq = torch.zeros(Q.shape, dtype=q_dtype, device=device) if need_grad_q else none
        gd = torch.zeros(D.shape, dtype=d_dtype, device=device) if need_grad_d else none
        return gq, gd

    cfg = plan.tiles
    normalize = q_inv is not None
    grad_scores = grad_scores if grad_scores.dim() == 2 else grad_scores.unsqueeze(1)
    stride_g = grad_scores.stride()
    n_queries, n_docs = layout.n_queries, layout.n_docs
    placeholder = layout.cu_q
    if normalize:
        q_inv, d_inv = q_inv.contiguous(), d_inv.contiguous()
    n_sblocks = cdiv(max(layout.max_q, 1), cfg.block_s)
    splits, atomic_q = plan.gather_splits, plan.atomic_q
    scatter_d = plan.strategy == "unified" and need_grad_d

    grad_q = none
    if need_grad_q:
        grad_q = (torch.zeros(Q.shape, dtype=torch.float32, device=device) if atomic_q
                  else empty(Q.shape, q_dtype, device))
    grad_d_acc = torch.zeros(D.shape, dtype=torch.float32, device=device) if scatter_d else None

    if (need_grad_q or scatter_d) and n_queries > 0:
        by_query, starts_q = sorted_pairs(layout.pair_q, n_queries) if pairs else (None, None)
        args = (
            grad_scores, Q, D, layout.cu_q, layout.cu_d,
            layout.pair_d if pairs else placeholder,
            by_query if pairs else placeholder, starts_q if pairs else placeholder,
            Q if q_inv is None else q_inv, D if d_inv is None else d_inv,
            argmax if argmax.numel() else placeholder,
            Q if grad_q.numel() == 0 else grad_q,
            D if grad_d_acc is None else grad_d_acc,
            n_queries, n_docs, 1 if pairs else n_docs, rows_q, rows_d, layout.max_q,
            n_sblocks, splits, dim,
            *stride_g, *Q.stride(), *D.stride(),
            *(grad_q.stride() if need_grad_q else (0, 0)),
            *(grad_d_acc.stride() if scatter_d else (0, 0)),
        )
        launcher(_maxsim_ragged_bwd_dq_kernel)((n_queries * n_sblocks, splits), args, constants(
            PAIRS=pairs, **gather_meta(cfg, normalize=normalize, grad_q=need_grad_q,
                                       atomic_q=atomic_q, scatter_d=scatter_d)))
    elif need_grad_q:
        grad_q.zero_()
    if atomic_q and need_grad_q and grad_q.dtype != q_dtype:
        grad_q = grad_q.to(q_dtype)

    grad_d = none
    if need_grad_d and scatter_d:
        grad_d = grad_d_acc if grad_d_acc.dtype == d_dtype else grad_d_acc.to(d_dtype)
    elif need_grad_d:
        grad_d = empty(D.shape, d_dtype, device)
        n_tblocks = cdiv(max(layout.max_d, 1), cfg.block_t)
        if pairs:
            by_doc, starts_d = sorted_pairs(layout.pair_d, n_docs)
            row_query = placeholder
        else:
            by_doc = starts_d = placeholder
            row_query = _row_query(layout.cu_q, rows_q)
        args = (
            grad_scores, Q, layout.cu_q, layout.cu_d,
            layout.pair_q if pairs else placeholder, by_doc, starts_d, row_query,
            Q if q_inv is None else q_inv, argmax if argmax.numel() else placeholder, grad_d,
            n_queries, n_docs, rows_q, rows_d, layout.max_q, n_tblocks, dim,
            *stride_g, *Q.stride(), *grad_d.stride(),
        )
        # Every program scans its rows in a loop: unpipelined, as the dense kernel's scans.
        launcher(_maxsim_ragged_bwd_dd_kernel)((n_docs * n_tblocks,), args, constants(
            PAIRS=pairs, NORMALIZE=normalize, BLOCK_R=plan.block_r,
            **owned_tile_meta(cfg, Q.dtype, fp32_precision, plan.dd_scan_stages)))
    return grad_q, grad_d
