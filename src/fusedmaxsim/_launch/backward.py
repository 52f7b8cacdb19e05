"""The backward launchers: execute a :class:`~fusedmaxsim._plan.BackwardPlan`.

Inputs as the forward's (``forward``), plus the upstream gradient ``grad_scores`` (fp32, any
strides) and what the forward saved: the argmax, or under the smooth max each row's fp32
log2-sum-exp2. The plan says which kernels run, split and chunked how; these functions compute
strides and grids, allocate, and launch. Gradients come back in the input dtype, or fp32 with
``fp32_out`` (the normalizing path, whose Jacobian is applied above).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

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
from ..kernels.head import (
    _hidden_bwd_entries_kernel,
    _hidden_bwd_rows_kernel,
    _hidden_bwd_weight_kernel,
)
from ..kernels.smooth import _smooth_bwd_kernel
from ..kernels.winner_index import _tile_counts_kernel, _tile_rows_kernel
from .runtime import (
    Constants,
    as_bytes,
    cdiv,
    constants,
    doc_strides,
    dot_precision,
    empty,
    gather_meta,
    grads_without_launch,
    launcher,
    owned_tile_meta,
    smooth_scales,
    upcast,
    zeros,
)

__all__ = ["backward_dense", "backward_hidden", "backward_packed", "backward_smooth",
           "sorted_pairs"]


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


# ------------------------------------------------------------------------------------------------
# The fused projection head: the document-owned rows with the projection's backward on chip
# ------------------------------------------------------------------------------------------------


class _HeadBackward(NamedTuple):
    """What every chunk of ``backward_hidden`` shares: its arguments, ``grad_H`` (None where not
    needed) and what is asked for (``need_w``: grad_W or grad_b)."""

    plan: BackwardPlan
    fp32_precision: str
    grad_scores: Tensor
    Q: Tensor
    argmax: Tensor
    H: Tensor
    W: Tensor
    b: Tensor | None
    grad_h: Tensor | None
    normalize: bool
    need_q: bool
    need_h: bool
    need_w: bool


def backward_hidden(plan: BackwardPlan, fp32_precision: str, grad_scores: Tensor, Q: Tensor,
                    H: Tensor, W: Tensor, b: Tensor | None, argmax: Tensor, normalize: bool,
                    needs: tuple[bool, bool, bool, bool]) -> tuple[Tensor | None, ...]:
    """``(grad_Q, grad_H, grad_W, grad_b)`` of ``maxsim(Q, normalize?(F.linear(H, W, b)))`` from
    the forward's argmax, each in its input's dtype (None where not needed).

    ``plan.hidden_cols`` columns at a time, by the plan's kernel:

    * ``"entries"``: the entries kernel writes the winning rows of ``grad_H`` (zeroed first),
      each entry's ``g · P̂`` (summed over the chunk's columns into ``grad_Q``) and, for the
      weights, the leading entries' ``grad_P`` and tokens;
    * ``"tiles"``: the rows kernel (through the chunk's winner index where the plan says so)
      writes every row of ``grad_H``, for the weights the chunk's rows' tokens and the winning
      rows' ``grad_P``, and for ``grad_Q`` the winning rows of ``P`` with their inverse norms,
      from which the gather kernel adds the chunk's ``grad_Q``.

    Then, where ``grad_W`` or ``grad_b`` is needed, the weight kernel adds the chunk's into
    ``plan.weight_groups`` fp32 partials, summed at the end. No atomics: bitwise
    reproducible."""
    need_q, need_h, need_w, need_b = needs
    need_b = need_b and b is not None
    need_weights = need_w or need_b
    per_query = H.dim() == 4
    Nq, Lq, dim = Q.shape
    Ncols, Ld, d_model = H.shape[-3], H.shape[-2], H.shape[-1]
    groups = Nq if per_query else 1
    dev, dtype = Q.device, H.dtype
    if not (Nq * Ncols * Lq * Ld * dim):  # nothing scored: every gradient is zero
        return tuple(torch.zeros_like(t) if need else None
                     for t, need in zip((Q, H, W, b), (need_q, need_h, need_w, need_b)))
    by_entry = plan.kernel == "entries"
    chunk = min(plan.hidden_cols, Ncols)
    grad_h = None
    if need_h:  # the entries kernel writes the winning rows only
        grad_h = (zeros if by_entry else empty)(H.shape, dtype, dev)
    # For the weight kernel, a chunk's buffer rows (a token tile kernel's every row of its
    # columns, the entries kernel's (query, query token) entries of each column): each row's
    # token and grad_P.
    col_rows = (Lq if per_query else Nq * Lq) if by_entry else Ld
    lead = (groups, chunk, col_rows) if per_query else (chunk, col_rows)
    col_axis = 1 if per_query else 0
    tok = grad_p = weights = None
    if need_weights:
        tok = empty(lead, torch.int32, dev)
        grad_p = empty((*lead, dim), dtype, dev)
        weights = (empty((plan.weight_groups, dim, d_model), torch.float32, dev),
                   empty((plan.weight_groups, dim), torch.float32, dev) if need_b else H)
    shared = _HeadBackward(plan, fp32_precision, grad_scores, Q, argmax, H, W, b, grad_h,
                           normalize, need_q, need_h, need_weights)
    run = _hidden_entries if by_entry else _hidden_tiles(shared, chunk)
    grad_q = None
    for c0 in range(0, Ncols, chunk):
        n = min(chunk, Ncols - c0)
        tok_c, grad_p_c = _chunk_rows(tok, col_axis, n), _chunk_rows(grad_p, col_axis, n)
        part = run(shared, tok_c, grad_p_c, c0, n)
        if need_q:  # one chunk: the part itself, else fp32 parts summed
            grad_q = part if grad_q is None else grad_q.add_(part)
        if weights is not None:
            _launch_hidden_weight(plan, fp32_precision, tok_c, grad_p_c, H, *weights, c0, n,
                                  need_b)
    if need_q and grad_q.dtype != Q.dtype:
        grad_q = grad_q.to(Q.dtype)
    grad_w = grad_b = None
    if weights is not None:
        part_w, part_b = weights
        grad_w = (part_w[0] if plan.weight_groups == 1 else part_w.sum(0)).to(W.dtype)
        if need_b:
            grad_b = (part_b[0] if plan.weight_groups == 1 else part_b.sum(0)).to(b.dtype)
    return grad_q, grad_h, grad_w if need_w else None, grad_b


def _hidden_entries(shared: _HeadBackward, tok, grad_p, col_base: int,
                    n_cols: int) -> Tensor | None:
    """One chunk of columns through the entries kernel; its ``grad_Q`` (fp32) where needed."""
    (plan, fp32_precision, grad_scores, Q, argmax, H, W, b, grad_h, normalize, need_q, need_h,
     need_w) = shared
    cfg = plan.tiles
    Nq, Lq, dim = Q.shape
    d_model = H.shape[-1]
    per_query = H.dim() == 4
    groups = Nq if per_query else 1
    n_entries = Lq if per_query else Nq * Lq
    # Each entry's g · P̂, [Nq, n_cols, Lq, dim]: grad_Q is its sum over the columns.
    shares = empty((Nq, n_cols, Lq, dim), torch.float32, Q.device) if need_q else None
    gh = grad_h if grad_h is not None else H
    launcher(_hidden_bwd_entries_kernel)(
        (groups * n_cols, cdiv(n_entries, cfg.block_t)),
        (
            grad_scores, Q, argmax, H, W, H if b is None else b, gh, H if tok is None else tok,
            H if grad_p is None else grad_p, shares if need_q else H, n_cols, Lq, dim, d_model,
            n_entries, col_base,
            *grad_scores.stride(), *Q.stride(), *argmax.stride(),
            *doc_strides(H, per_query)[:3], H.stride(-1), *W.stride(),
            *doc_strides(gh, per_query)[:3],
        ),
        _hidden_entries_constants(cfg, per_query, normalize, need_q, need_h, need_w,
                                  b is not None, plan.hidden_block, Q.dtype, fp32_precision),
    )
    return shares.sum(1) if need_q else None


@functools.lru_cache(maxsize=256)
def _hidden_entries_constants(cfg, per_query, normalize, need_q, need_h, need_w, bias,
                              hidden_block, dtype, fp32_precision) -> Constants:
    meta = owned_tile_meta(cfg, dtype, fp32_precision)
    meta["BLOCK_E"] = meta.pop("BLOCK_T")
    return constants(
        PER_QUERY_DOCS=per_query, NORMALIZE=normalize, NEED_Q=need_q, NEED_H=need_h,
        NEED_W=need_w, HIDDEN_BIAS=bias, HIDDEN_BLOCK=hidden_block, **meta,
    )


def _hidden_tiles(shared: _HeadBackward, chunk: int):
    """The token tile kernels' run of a chunk of columns, ``run(shared, tok, grad_p, col_base,
    n_cols)`` as ``_hidden_entries`` (its ``grad_Q``: in Q's dtype for a single chunk, else
    fp32), with the buffers its chunks share: ``P`` and its inverse norms for the gather, the
    winner index."""
    plan, Q, H, normalize, need_q = (shared.plan, shared.Q, shared.H, shared.normalize,
                                     shared.need_q)
    Nq, Lq, dim = Q.shape
    Ncols, Ld = H.shape[-3], H.shape[-2]
    per_query = H.dim() == 4
    dev, dtype = Q.device, H.dtype
    lead = (Nq, chunk, Ld) if per_query else (chunk, Ld)
    col_axis = 1 if per_query else 0
    P_all = empty((*lead, dim), dtype, dev) if need_q else None
    inv_all = empty(lead, torch.float32, dev) if need_q and normalize else None
    q_inv = torch.ones((Nq, Lq), dtype=torch.float32, device=dev) if need_q and normalize else None
    index = None
    if plan.winner_index:
        index = _winner_index_buffers(Q, chunk, cdiv(Ld, plan.tiles.block_t),
                                      plan.index_row_dtype)

    def run(shared, tok, grad_p, c0, n):
        (plan, fp32_precision, grad_scores, Q, argmax, H, W, b, grad_h, normalize, need_q,
         need_h, need_w) = shared
        rows, counts = _winner_index(plan, argmax, c0, n, index) if index else (None, None)
        P, p_inv = _chunk_rows(P_all, col_axis, n), _chunk_rows(inv_all, col_axis, n)
        _launch_hidden_rows(plan, fp32_precision, grad_scores, Q, argmax, rows, counts, H, W, b,
                            grad_h, tok, grad_p, P, p_inv, c0, n, normalize, need_q, need_h,
                            need_w)
        if not need_q:
            return None
        args = argmax if n == Ncols else argmax[:, c0:c0 + n].contiguous()
        # One chunk: grad_Q written in Q's dtype; several: fp32 parts to be summed.
        part = empty(Q.shape, Q.dtype if n == Ncols else torch.float32, dev)
        _launch_gather(plan.tiles, grad_scores[:, c0:c0 + n], Q, P, args, q_inv, p_inv,
                       per_query, 0, n, 1, part, None, plan.gather_step)
        return part

    return run


def _chunk_rows(buf: Tensor | None, col_axis: int, n_cols: int) -> Tensor | None:
    """A chunk's buffer (allocated for a whole chunk, its columns on ``col_axis``) for a chunk of
    ``n_cols`` columns: itself when whole, else its first elements viewed contiguous with
    ``n_cols`` columns (the kernels index the buffers as contiguous)."""
    if buf is None or buf.shape[col_axis] == n_cols:
        return buf
    shape = (*buf.shape[:col_axis], n_cols, *buf.shape[col_axis + 1:])
    return buf.view(-1)[:math.prod(shape)].view(shape)


def _launch_hidden_rows(plan, fp32_precision, grad_scores, Q, argmax, rows, counts, H, W, b,
                        grad_h, tok, grad_p, P, p_inv, col_base, n_cols, normalize, need_q,
                        need_h, need_w) -> None:
    cfg = plan.tiles
    Nq, Lq, dim = Q.shape
    Ncols, Ld, d_model = H.shape[-3], H.shape[-2], H.shape[-1]
    per_query = H.dim() == 4
    groups = Nq if per_query else 1
    tiles_per_program = plan.dd_tiles_per_program
    gh = grad_h if grad_h is not None else H
    launcher(_hidden_bwd_rows_kernel)(
        (groups * n_cols if rows is None else n_cols,
         cdiv(cdiv(Ld, cfg.block_t), tiles_per_program)),
        (
            grad_scores, Q, argmax, argmax if rows is None else rows,
            argmax if counts is None else counts, H, W, H if b is None else b, gh,
            H if tok is None else tok, H if grad_p is None else grad_p, H if P is None else P,
            H if p_inv is None else p_inv, Nq, Ncols, n_cols, Lq, Ld, dim, d_model,
            tiles_per_program, col_base,
            *grad_scores.stride(), *Q.stride(), *doc_strides(H, per_query)[:3],
            H.stride(-1), *W.stride(), *doc_strides(gh, per_query)[:3],
        ),
        _hidden_rows_constants(cfg, per_query, plan.rows_in_one_block, rows is not None,
                               normalize, need_q, need_h, need_w, b is not None,
                               plan.hidden_block, Q.dtype, fp32_precision, plan.index_scan),
    )


@functools.lru_cache(maxsize=256)
def _hidden_rows_constants(cfg, per_query, rows_in_one_block, winner_index, normalize, need_q,
                           need_h, need_w, bias, hidden_block, dtype, fp32_precision,
                           index_scan) -> Constants:
    return constants(
        PER_QUERY_DOCS=per_query, ROWS_IN_ONE_BLOCK=rows_in_one_block,
        WINNER_INDEX=winner_index, NORMALIZE=normalize, NEED_Q=need_q, NEED_H=need_h,
        NEED_W=need_w,
        HIDDEN_BIAS=bias, HIDDEN_BLOCK=hidden_block, BLOCK_R=cfg.block_r,
        INDEX_SCAN=index_scan,
        **owned_tile_meta(cfg, dtype, fp32_precision),
    )


def _launch_hidden_weight(plan, fp32_precision, tok, grad_p, H, part_w, part_b, col_base,
                          n_cols, need_b) -> None:
    col_rows, dim, d_model = grad_p.shape[-2], grad_p.shape[-1], H.shape[-1]
    block_t, block_c, warps, stages = plan.weight_tiles
    per_query = H.dim() == 4
    launcher(_hidden_bwd_weight_kernel)(
        (cdiv(d_model, block_c), plan.weight_groups),
        (tok, grad_p, H, part_w, part_b, tok.numel(), n_cols, col_rows, dim, d_model, col_base,
         *doc_strides(H, per_query)[:3], H.stride(-1)),
        _hidden_weight_constants(need_b, col_base > 0, block_t, block_c, plan.tiles.block_k,
                                 warps, stages, H.dtype, fp32_precision),
    )


@functools.lru_cache(maxsize=64)
def _hidden_weight_constants(bias, accumulate, block_t, block_c, block_k, warps, stages, dtype,
                             fp32_precision) -> Constants:
    return constants(
        HAS_BIAS=bias, ACCUMULATE=accumulate, BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_K=block_k,
        DOT_PRECISION=dot_precision(dtype, fp32_precision), UPCAST=upcast(dtype),
        num_warps=warps, num_stages=stages,
    )
