"""Host launchers of the packed-sequence kernels: strides, grids and the pair lists' indexes.

Inputs arrive checked by ``fusedmaxsim.ragged``: packed ``Q [Tq, d]`` and ``D [Td, d]`` of one
dtype, any strides; offsets and pair indices int32 or int64 on the tokens' device; masks bool
``[Tq]`` / ``[Td]``; inverse norms fp32 ``[Tq]`` / ``[Td]``. ``layout`` is a
``fusedmaxsim.ragged.RaggedLayout``: which pairs are scored, the packed row counts and the
promised maximum lengths. Nothing here synchronizes with the host.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
from torch import Tensor

from . import _configs, _launch
from ._kernels_ragged import (
    _maxsim_ragged_bwd_dd_kernel,
    _maxsim_ragged_bwd_dq_kernel,
    _maxsim_ragged_fwd_kernel,
)
from ._launch import (
    _as_bytes,
    _cdiv,
    _empty,
    _no_argmax,
    _sm_count,
    constants,
    fwd_meta,
    gather_meta,
    launcher,
    owned_tile_meta,
)

__all__ = ["ragged_bwd", "ragged_fwd", "sorted_pairs"]

_MAX_GRID_Y = 65535


def _run(kernel, grid: tuple, args: tuple, **meta) -> None:
    """Every launch goes through the dense path's cached launcher (much less host time per call
    than Triton's own launch path, which re-derives every argument's specialization)."""
    launcher(kernel)(grid, args, constants(**meta))


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


def ragged_fwd(
    layout,
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None,
    d_mask: Tensor | None,
    q_inv: Tensor | None,
    d_inv: Tensor | None,
    save_argmax: bool,
    fp32_precision: str,
) -> tuple[Tensor, Tensor]:
    """Scores (``[Nq, n_cols]`` or ``[P]``, fp32) and, when asked, the argmax (empty otherwise)."""
    pairs = layout.pair_q is not None
    rows_q, dim = Q.shape
    device = Q.device
    if pairs:
        out_shape, argmax_shape = (layout.n_pairs,), (layout.n_pairs, layout.max_q)
    else:
        out_shape, argmax_shape = (layout.n_queries, layout.n_cols), (layout.n_cols, rows_q)
    scores = _empty(out_shape, torch.float32, device)
    argmax = _empty(argmax_shape, torch.int32, device) if save_argmax else _no_argmax(device, torch.int32)
    if scores.numel() == 0:
        return scores, argmax

    cfg = _configs.fwd_config(
        Lq=max(layout.max_q, 1), dim=dim, Nq=max(layout.n_queries, 1), per_query_docs=pairs,
        elem_bytes=Q.element_size(),
    )
    if pairs and cfg.queries_per_block != 1:
        cfg = dataclasses.replace(cfg, queries_per_block=1)
    qpb = cfg.queries_per_block
    n_qblocks = 1 if pairs else _cdiv(layout.n_queries, qpb)
    grid = (layout.n_pairs,) if pairs else (layout.n_cols * n_qblocks,)
    qm, dm = _as_bytes(q_mask), _as_bytes(d_mask)
    placeholder = layout.cu_q
    args = (
        Q, D, layout.cu_q, layout.cu_d,
        layout.pair_q if pairs else placeholder, layout.pair_d if pairs else placeholder,
        Q if qm is None else qm, D if dm is None else dm,
        Q if q_inv is None else q_inv.contiguous(), D if d_inv is None else d_inv.contiguous(),
        scores, argmax if argmax.numel() else scores,
        layout.n_queries, layout.n_docs, 1 if pairs else layout.n_cols, n_qblocks, layout.col_lo,
        rows_q, D.shape[0], layout.max_q, layout.max_d, dim,
        *Q.stride(), *D.stride(),
    )
    _run(
        _maxsim_ragged_fwd_kernel,
        grid,
        args,
        PAIRS=pairs,
        **fwd_meta(
            cfg, Q.dtype, dim, has_q_mask=q_mask is not None, has_d_mask=d_mask is not None,
            normalize=q_inv is not None, save_argmax=save_argmax, fp32_precision=fp32_precision,
        ),
    )
    return scores, argmax


def ragged_bwd(
    layout,
    grad_scores: Tensor,
    Q: Tensor,
    D: Tensor,
    argmax: Tensor,
    q_inv: Tensor | None,
    d_inv: Tensor | None,
    need_grad_q: bool,
    need_grad_d: bool,
    strategy: str,
    fp32_out: bool,
    fp32_precision: str,
) -> tuple[Tensor, Tensor]:
    """Gradients with respect to the packed Q and D (the normalized ones when normalizing).

    ``strategy``: ``"unified"`` (query-owned gather split over the pairs for parallelism, fp32
    atomics for ``grad_D`` and, when split, for ``grad_Q``) or ``"lowmem"`` (query-owned
    ``grad_Q`` and document-owned ``grad_D``: no atomics, bitwise reproducible, written directly
    in the output dtype). With ``fp32_out`` the gradients are fp32.
    """
    pairs = layout.pair_q is not None
    rows_q, dim = Q.shape
    rows_d = D.shape[0]
    device = Q.device
    q_dtype = torch.float32 if fp32_out else Q.dtype
    d_dtype = torch.float32 if fp32_out else D.dtype
    empty = Q.new_empty((0,))
    if not (need_grad_q or need_grad_d):
        return empty, empty
    n_items = layout.n_pairs if pairs else layout.n_queries * layout.n_docs
    if n_items == 0 or rows_q == 0 or rows_d == 0 or dim == 0:
        gq = torch.zeros(Q.shape, dtype=q_dtype, device=device) if need_grad_q else empty
        gd = torch.zeros(D.shape, dtype=d_dtype, device=device) if need_grad_d else empty
        return gq, gd

    cfg = _configs.bwd_config(
        Lq=max(layout.max_q, 1), dim=dim, elem_bytes=Q.element_size(), per_query_docs=pairs
    )
    normalize = q_inv is not None
    grad_scores = grad_scores if grad_scores.dim() == 2 else grad_scores.unsqueeze(1)
    stride_g = grad_scores.stride()
    n_queries, n_docs = layout.n_queries, layout.n_docs
    placeholder = layout.cu_q
    if normalize:
        q_inv, d_inv = q_inv.contiguous(), d_inv.contiguous()

    unified = strategy == "unified"
    n_sblocks = _cdiv(max(layout.max_q, 1), cfg.block_s)
    splits = 1
    if unified and n_queries > 0:
        programs = n_queries * n_sblocks
        target = 4 * _sm_count(device)
        per_query = layout.n_docs if not pairs else _cdiv(layout.n_pairs, n_queries)
        if programs < target:
            splits = max(1, min(per_query, _cdiv(target, programs), _MAX_GRID_Y))
    atomic_q = splits > 1
    scatter_d = unified and need_grad_d

    grad_q = empty
    if need_grad_q:
        grad_q = (
            torch.zeros(Q.shape, dtype=torch.float32, device=device)
            if atomic_q
            else _empty(Q.shape, q_dtype, device)
        )
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
        _run(
            _maxsim_ragged_bwd_dq_kernel,
            (n_queries * n_sblocks, splits),
            args,
            PAIRS=pairs,
            **gather_meta(
                cfg, normalize=normalize, grad_q=need_grad_q, atomic_q=atomic_q, scatter_d=scatter_d
            ),
        )
    elif need_grad_q:
        grad_q.zero_()
    if atomic_q and need_grad_q and grad_q.dtype != q_dtype:
        grad_q = grad_q.to(q_dtype)

    grad_d = empty
    if need_grad_d and scatter_d:
        grad_d = grad_d_acc if grad_d_acc.dtype == d_dtype else grad_d_acc.to(d_dtype)
    elif need_grad_d:
        grad_d = _empty(D.shape, d_dtype, device)
        n_tblocks = _cdiv(max(layout.max_d, 1), cfg.block_t)
        if pairs:
            by_doc, starts_d = sorted_pairs(layout.pair_d, n_docs)
            row_query = placeholder
            # The pair's own query is the whole reduction: no wider than it.
            block_r = min(cfg.block_r, max(16, triton.next_power_of_2(max(layout.max_q, 1))))
        else:
            by_doc = starts_d = placeholder
            row_query = _row_query(layout.cu_q, rows_q)
            block_r = cfg.block_r
        args = (
            grad_scores, Q, layout.cu_q, layout.cu_d,
            layout.pair_q if pairs else placeholder, by_doc, starts_d, row_query,
            Q if q_inv is None else q_inv, argmax if argmax.numel() else placeholder, grad_d,
            n_queries, n_docs, rows_q, rows_d, layout.max_q, n_tblocks, dim,
            *stride_g, *Q.stride(), *grad_d.stride(),
        )
        _run(
            _maxsim_ragged_bwd_dd_kernel,
            (n_docs * n_tblocks,),
            args,
            PAIRS=pairs,
            NORMALIZE=normalize,
            BLOCK_R=block_r,
            # Every program scans its rows in a loop: unpipelined, as the dense kernel's scans
            # (benchmarks/NOTES.md section 45).
            **owned_tile_meta(cfg, Q.dtype, fp32_precision, _launch._DD_SCAN_STAGES),
        )
    return grad_q, grad_d
