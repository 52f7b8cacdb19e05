"""The forward launchers: execute a :class:`~fusedmaxsim._plan.ForwardPlan`.

Inputs arrive checked (``_problem``): dense ``Q [Nq, Lq, d]`` and ``D [Nd, Ld, d]`` (cross
product) or ``[Nq, K, Ld, d]`` (per-query candidates), or packed ``Q [ΣLq, d]`` / ``D [ΣLd, d]``
with a ``RaggedLayout``, or hidden states ``H [.., Ld, d_model]`` with ``W`` and ``b`` in place of
``D`` (the fused projection head); one dtype; any strides (no copies); masks bool with the token
axes; inverse norms fp32. Empty problems return without a launch. The plan says which kernel runs
with which tiles and splits; these functions compute strides and grids, allocate, and launch.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

from .. import settings
from .._plan import ForwardPlan, argmax_dtype, block_k_for, fwd_candidates
from .._problem import Problem, weight_table
from ..kernels.forward import (
    _inverse_norm_kernel, _maxsim_fwd_kernel, _maxsim_hidden_fwd_kernel, _maxsim_ragged_fwd_kernel,
    _maxsim_residual_fwd_kernel,
)
from .runtime import (
    Constants,
    as_bytes,
    cdiv,
    constants,
    doc_strides,
    empty,
    fwd_meta,
    launcher,
    no_argmax,
    smooth_scales,
    take,
    upcast,
)

__all__ = ["forward_dense", "forward_hidden", "forward_packed", "forward_residual",
           "gluon_constexprs", "inverse_norms"]


def forward_dense(plan: ForwardPlan, p: Problem, fp32_precision: str, Q: Tensor, D: Tensor,
                  q_mask: Tensor | None, d_mask: Tensor | None, q_inv: Tensor | None,
                  d_inv: Tensor | None) -> tuple[Tensor, Tensor]:
    """Scores ``[Nq, Ncols]`` (fp32) and the argmax ``[Nq, Ncols, Lq]`` (a shared empty tensor
    when not saved). With ``p.norm_from_tiles`` the kernels normalize with norms computed from
    the tiles (``q_inv``, ``d_inv`` None); with ``p.tau > 0`` the smooth max, and in place of the
    argmax each row's fp32 log2-sum-exp2 (``+inf`` where the row adds nothing)."""
    Nq, Ncols, Lq, Ld = p.Nq, p.Ncols, p.Lq, p.Ld
    device = Q.device
    scores = empty((Nq, Ncols), torch.float32, device)
    saved_dtype = torch.float32 if p.tau else argmax_dtype(Ld)
    save_argmax = p.save_argmax
    argmax = empty((Nq, Ncols, Lq), saved_dtype, device) if save_argmax else \
        no_argmax(device, saved_dtype)
    if not (Nq and Ncols):
        return scores, argmax
    if Lq == 0 or Ld == 0:
        scores.zero_()
        argmax.fill_(float("inf") if p.tau else -1)
        return scores, argmax
    if plan.kernel == "gluon":
        try:
            _launch_gluon(plan, p, Q, D, scores, argmax if save_argmax else None)
            return scores, argmax
        except Exception as exc:  # noqa: BLE001 (Gluon is experimental: any failure to build)
            _gluon_failed(exc)
    qm = None if q_mask is None else as_bytes(q_mask)
    dm = None if d_mask is None else as_bytes(d_mask)
    if q_inv is not None:
        q_inv = q_inv.contiguous()
    if d_inv is not None:
        d_inv = d_inv.contiguous()
    operands = (Q, D, qm, dm, q_inv, d_inv, scores, argmax)
    cfg = plan.tiles
    if plan.autotune:
        from triton.testing import do_bench

        key = ("fwd", cfg, p, fp32_precision)
        cfg = _tuned(key, fwd_candidates(cfg), lambda c: do_bench(
            lambda: _launch_triton(c, plan, p, fp32_precision, *operands), warmup=5, rep=20))
    _launch_triton(cfg, plan, p, fp32_precision, *operands)
    return scores, argmax


_tuned_configs: dict = {}


def _tuned(key: tuple, candidates: list, time_ms) -> object:
    """The fastest of ``candidates`` by ``time_ms(candidate)``, measured once per ``key``; a
    candidate that fails (e.g. out of shared memory) is skipped, the first kept if all fail."""
    found = _tuned_configs.get(key)
    if found is None:
        best, best_ms = candidates[0], float("inf")
        for cfg in candidates:
            try:
                ms = time_ms(cfg)
            except Exception:  # noqa: BLE001 (a configuration this device cannot run)
                continue
            if ms < best_ms:
                best, best_ms = cfg, ms
        found = _tuned_configs[key] = best
    return found


@functools.lru_cache(maxsize=1024)
def _triton_constants(cfg, dtype, dim, per_query_docs, norm_from_tiles, smooth, has_q_mask,
                      has_d_mask, normalize, save_argmax, fp32_precision) -> Constants:
    return constants(
        PER_QUERY_DOCS=per_query_docs,
        NORM_FROM_TILES=norm_from_tiles,
        SMOOTH=smooth,
        **fwd_meta(
            cfg, dtype, dim, has_q_mask=has_q_mask, has_d_mask=has_d_mask, normalize=normalize,
            save_argmax=save_argmax, fp32_precision=fp32_precision,
        ),
    )


def _query_slices(launch_slice, scores: Tensor, qpb: int, splits: int, max_grid_y: int) -> None:
    """``launch_slice(rows, out, stride_out_split)`` over the query batch, shared by the Triton and
    Gluon forwards. Grid axis 1 holds at most ``max_grid_y`` blocks: larger batches go in slices
    of queries (``rows``; None in the common case, which launches the tensors as they are, with
    no slicing on the host). With several chunk splits ``out`` is a buffer of partial scores, one
    slice a split, added into ``scores`` after the launches."""
    Nq, Ncols = scores.shape
    out = scores if splits == 1 else empty((splits, Nq, Ncols), torch.float32, scores.device)
    stride_out_split = out.stride(0) if splits > 1 else 0
    step = max_grid_y * qpb
    if Nq <= step:
        launch_slice(None, out, stride_out_split)
    else:
        for q0 in range(0, Nq, step):
            rows = slice(q0, min(Nq, q0 + step))
            launch_slice(rows, out[rows] if splits == 1 else out[:, rows], stride_out_split)
    if splits > 1:
        torch.sum(out, 0, out=scores)


def _launch_triton(cfg, plan: ForwardPlan, p: Problem, fp32_precision: str, Q, D, qm, dm, q_inv,
                   d_inv, scores, argmax) -> None:
    """The Triton forward with tiles ``cfg`` (several launches for huge query batches); with
    several chunk splits, their partial scores are added into ``scores`` after it."""
    per_query_docs = D.dim() == 4
    Lq, Ld, dim, Ncols = p.Lq, p.Ld, p.dim, p.Ncols
    qpb, splits, save_argmax = cfg.queries_per_block, plan.splits, p.save_argmax
    smooth_scale, smooth_unscale = smooth_scales(p.tau) if p.tau else (1.0, 1.0)
    consts = _triton_constants(
        cfg, Q.dtype, dim, per_query_docs, p.norm_from_tiles, bool(p.tau), qm is not None,
        dm is not None, p.norm_from_tiles or q_inv is not None, save_argmax, fp32_precision,
    )
    kernel = launcher(_maxsim_fwd_kernel)

    def launch_slice(rows, out, stride_out_split):
        doc_rows = rows if per_query_docs else None  # per-query candidates: their documents too
        q, d = take(Q, rows), take(D, doc_rows)
        q_m, d_m = take(qm, rows), take(dm, doc_rows)
        q_i, d_i = take(q_inv, rows), take(d_inv, doc_rows)
        kernel(
            (Ncols * splits, cdiv(q.shape[0], qpb)),
            (
                q, d, q if q_m is None else q_m, d if d_m is None else d_m,
                q if q_i is None else q_i, d if d_i is None else d_i, out,
                take(argmax, rows) if save_argmax else argmax,
                q.shape[0], Ncols, Lq, Ld, splits, stride_out_split, dim, *q.stride(),
                *doc_strides(d, per_query_docs), smooth_scale, smooth_unscale,
            ),
            consts,
        )

    _query_slices(launch_slice, scores, qpb, splits, plan.max_grid_y)


def forward_residual(plan: ForwardPlan, p: Problem, fp32_precision: str, Q: Tensor, docs,
                     q_mask: Tensor | None, normalize_q: bool) -> tuple[Tensor, Tensor]:
    """Scores ``[Nq, Ncols]`` (fp32) and the argmax of ``Q`` against PLAID documents
    (``_problem.ResidualDocs``: every document, or each query's candidates), decompressed tile by
    tile inside the kernel; with ``p.normalize`` the documents' tokens are normalized, with
    ``normalize_q`` the queries', their norms from the tiles. ``Q`` is
    brought to the dtype it shares with the centroids (the decompressed tile is rounded to the
    centroids' first)."""
    Nq, Ncols, Lq = p.Nq, p.Ncols, p.Lq
    device = Q.device
    scores = empty((Nq, Ncols), torch.float32, device)
    save_argmax = p.save_argmax
    argmax = empty((Nq, Ncols, Lq), argmax_dtype(p.Ld), device) if save_argmax else \
        no_argmax(device, argmax_dtype(p.Ld))
    if not (Nq and Ncols):
        return scores, argmax
    if Q.dtype != p.dtype:
        Q = Q.to(p.dtype)
    per_query_docs = docs.doc_ids is not None
    residuals = docs.residuals if docs.residuals.stride(-1) == 1 else docs.residuals.contiguous()
    centroids = docs.centroids if docs.centroids.stride(-1) == 1 else docs.centroids.contiguous()
    table = docs.weight_table
    if table is None:
        table = weight_table(docs.bucket_weights, docs.nbits, docs.bit_order)
    doc_ids = docs.doc_ids.contiguous() if per_query_docs else docs.starts
    qm = as_bytes(q_mask)
    cfg = plan.tiles
    meta = fwd_meta(cfg, Q.dtype, p.dim, has_q_mask=qm is not None, has_d_mask=False,
                    normalize=p.normalize, save_argmax=save_argmax, fp32_precision=fp32_precision)
    del meta["HAS_D_MASK"]  # the lengths bound each document
    consts = constants(NBITS=docs.nbits, PER_QUERY_DOCS=per_query_docs, NORMALIZE_Q=normalize_q,
                       **meta)
    kernel = launcher(_maxsim_residual_fwd_kernel)
    qpb = cfg.queries_per_block

    def launch_slice(rows, out, _stride_out_split):
        q, q_m = take(Q, rows), take(qm, rows)
        ids = take(doc_ids, rows) if per_query_docs else doc_ids
        kernel(
            (Ncols, cdiv(q.shape[0], qpb)),
            (
                q, docs.codes, residuals, docs.starts, docs.lengths, ids, centroids, table,
                q if q_m is None else q_m, out, take(argmax, rows) if save_argmax else argmax,
                q.shape[0], Ncols, Lq, p.Ld, docs.codes.shape[0], centroids.shape[0],
                p.dim, *q.stride(), docs.codes.stride(0), residuals.stride(0),
                centroids.stride(0),
            ),
            consts,
        )

    _query_slices(launch_slice, scores, qpb, 1, plan.max_grid_y)
    return scores, argmax


def forward_hidden(plan: ForwardPlan, p: Problem, fp32_precision: str, Q: Tensor, H: Tensor,
                   W: Tensor, b: Tensor | None, q_mask: Tensor | None,
                   d_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Scores ``[Nq, Ncols]`` (fp32) and the argmax ``[Nq, Ncols, Lq]`` of ``Q`` against the
    projection ``F.linear(H, W, b)`` of hidden states ``H`` (``[Nd, Ld, d_model]`` or
    ``[Nq, K, Ld, d_model]``, any strides), each document tile projected inside the kernel
    (``plan.hidden_block`` of ``d_model`` a step) and never written; with ``p.normalize`` the
    projected tokens are normalized, their norms from the tiles (``Q`` is taken as it is).
    ``Q`` is brought to the problem's dtype; ``W`` and ``b`` come in H's (the projected tile is
    rounded to H's dtype first, as ``F.linear``'s output is)."""
    Nq, Ncols, Lq, Ld = p.Nq, p.Ncols, p.Lq, p.Ld
    device = Q.device
    scores = empty((Nq, Ncols), torch.float32, device)
    save_argmax = p.save_argmax
    argmax = empty((Nq, Ncols, Lq), argmax_dtype(Ld), device) if save_argmax else \
        no_argmax(device, argmax_dtype(Ld))
    if not (Nq and Ncols):
        return scores, argmax
    if Lq == 0 or Ld == 0:
        scores.zero_()
        argmax.fill_(-1)
        return scores, argmax
    if Q.dtype != p.dtype:
        Q = Q.to(p.dtype)
    if b is not None:  # W and b have H's dtype (the front door's check)
        b = b.contiguous()
    hb = plan.hidden_block
    if hb < 16 or hb & (hb - 1):  # 0 would read H as a projected D; tl.dot needs 16 and up
        raise ValueError(f"hidden_block must be a power of two >= 16, got {hb}")
    per_query_docs = H.dim() == 4
    qm, dm = as_bytes(q_mask), as_bytes(d_mask)
    cfg = plan.tiles
    consts = _hidden_constants(cfg, Q.dtype, H.dtype, p.dim, per_query_docs, hb, b is not None,
                               qm is not None, dm is not None, p.normalize, save_argmax,
                               fp32_precision)
    kernel = launcher(_maxsim_hidden_fwd_kernel)
    qpb = cfg.queries_per_block

    def launch_slice(rows, out, _stride_out_split):
        doc_rows = rows if per_query_docs else None  # per-query candidates: their documents too
        q, h, q_m, d_m = take(Q, rows), take(H, doc_rows), take(qm, rows), take(dm, doc_rows)
        kernel(
            (Ncols, cdiv(q.shape[0], qpb)),
            (
                q, h, W, W if b is None else b, q if q_m is None else q_m,
                h if d_m is None else d_m, out, take(argmax, rows) if save_argmax else argmax,
                q.shape[0], Ncols, Lq, Ld, p.d_model, p.dim, *q.stride(),
                *doc_strides(h, per_query_docs), *W.stride(),
            ),
            consts,
        )

    _query_slices(launch_slice, scores, qpb, 1, plan.max_grid_y)
    return scores, argmax


@functools.lru_cache(maxsize=256)
def _hidden_constants(cfg, dtype, h_dtype, dim, per_query_docs, hidden_block, bias, has_q_mask,
                      has_d_mask, normalize, save_argmax, fp32_precision) -> Constants:
    meta = fwd_meta(cfg, dtype, dim, has_q_mask=has_q_mask, has_d_mask=has_d_mask,
                    normalize=normalize, save_argmax=save_argmax, fp32_precision=fp32_precision)
    meta["UPCAST"] = meta["UPCAST"] or upcast(h_dtype)  # the projection's products too
    return constants(PER_QUERY_DOCS=per_query_docs, HIDDEN_BLOCK=hidden_block, HIDDEN_BIAS=bias,
                     **meta)


# ------------------------------------------------------------------------------------------------
# The Gluon (Hopper) forward
# ------------------------------------------------------------------------------------------------


def _gluon_failed(exc: Exception) -> None:
    """The Gluon forward could not be built or launched (Gluon is experimental, and its API
    moves between Triton releases): say so once, and run the Triton kernel from now on."""
    settings.set_hopper_kernel(False)
    warnings.warn(
        f"fusedmaxsim: the Hopper (Gluon) forward failed ({type(exc).__name__}: {exc}); the "
        "Triton kernel serves every forward of this process instead",
        RuntimeWarning,
        stacklevel=6,
    )


@functools.lru_cache(maxsize=None)
def gluon_layouts(torch_dtype: torch.dtype, block_m: int, block_n: int, block_k: int,
                  warps: int = 4):
    """(query tile in shared memory, document tile in shared memory, the products' registers,
    the query chunk's load, a document tile's load from shared memory): the Gluon forward's
    layouts, built once per shape. With 8 warps, two warp groups split the rows of a product."""
    from triton.experimental.gluon import language as gl

    dtype = gl.bfloat16 if torch_dtype == torch.bfloat16 else gl.float16
    k_threads = block_k // 8  # 16-byte loads along the head dimension
    return (
        gl.NVMMASharedLayout.get_default_for([block_m, block_k], dtype),
        gl.NVMMASharedLayout.get_default_for([block_n, block_k], dtype),
        gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, block_n, 16]
        ),
        gl.BlockedLayout([1, 8], [32 // k_threads, k_threads], [warps, 1], [1, 0]),
        # A token's squares summed mostly in one thread: four threads a token.
        gl.BlockedLayout([1, block_k // 4], [8, 4], [warps, 1], [1, 0]),
    )


def gluon_constexprs(torch_dtype: torch.dtype, lq_tile: int, queries_per_block: int,
                     block_n: int, stages: int, dim: int, warps: int, normalize: bool,
                     tiles_first: bool = False, docs_per_program: int = 1,
                     save_argmax: bool = False) -> dict:
    """The Gluon forward's constexprs and ``num_warps`` for these tiles (the launcher's and the
    offline compile's, ``benchmarks/compile_hopper.py``)."""
    q_layout, _, mma_layout, q_load_layout, tile_load_layout = gluon_layouts(
        torch_dtype, lq_tile * queries_per_block, block_n, dim, warps)
    return dict(
        LQ_TILE=lq_tile, QUERIES_PER_BLOCK=queries_per_block, BLOCK_N=block_n, BLOCK_K=dim,
        NUM_STAGES=stages, NORMALIZE=normalize, SAVE_ARGMAX=save_argmax, TILES_FIRST=tiles_first,
        DOCS_PER_PROGRAM=docs_per_program, Q_SMEM_LAYOUT=q_layout,
        MMA_LAYOUT=mma_layout, Q_LOAD_LAYOUT=q_load_layout, TILE_LOAD_LAYOUT=tile_load_layout,
        num_warps=warps,
    )


def _tensor_descriptor(template, base: Tensor, shape: list, strides: list):
    """``template`` (a Gluon ``TensorDescriptor``) for another base tensor, shape and strides,
    without its constructor's checks, about 4 µs of host time a launch: the planner has made the
    same checks (contiguous, 16-byte aligned, int32 rows)."""
    desc = object.__new__(type(template))
    desc.__dict__.update(template.__dict__, base=base, shape=shape, strides=strides)
    return desc


@functools.lru_cache(maxsize=None)
def _descriptor_template(torch_dtype: torch.dtype, block_n: int, dim: int, layout):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    example = torch.empty(block_n, dim, dtype=torch_dtype)
    desc = TensorDescriptor(example, [block_n, dim], [dim, 1], [block_n, dim], layout)
    return desc if hasattr(desc, "__dict__") and not hasattr(desc, "__slots__") else None


@functools.lru_cache(maxsize=None)
def _gluon_launch_values(torch_dtype: torch.dtype, lq_tile: int, queries_per_block: int,
                         dim: int, normalize: bool, tiles: tuple, tiles_first: bool,
                         docs_per_program: int, save_argmax: bool):
    """What a Gluon launch needs besides its tensors, built once per tile set and looked up by
    plain values (hashing the layouts' dataclasses on every launch cost microseconds of host
    time): the constants, the descriptor's template (None where it cannot serve) and the
    document tile's shared layout."""
    block_n, stages, warps, max_registers = tiles
    d_layout = gluon_layouts(torch_dtype, lq_tile * queries_per_block, block_n, dim, warps)[1]
    cap = {} if max_registers is None else {"maxnreg": max_registers}
    consts = constants(**gluon_constexprs(
        torch_dtype, lq_tile, queries_per_block, block_n, stages, dim, warps, normalize,
        tiles_first, docs_per_program, save_argmax), **cap)
    return consts, _descriptor_template(torch_dtype, block_n, dim, d_layout), d_layout


def _launch_gluon(plan: ForwardPlan, p: Problem, Q: Tensor, D: Tensor, scores: Tensor,
                  argmax: Tensor | None) -> None:
    """The forward through ``kernels.hopper_forward``, query chunks split over programs as in
    the Triton forward; with ``p.norm_from_tiles``, of normalized tokens with their norms
    computed from the tiles; a block of fewer than 64 query rows padded to 64; with ``argmax``,
    each row's winning token written there."""
    from ..kernels.hopper_forward import _maxsim_fwd_overlap_kernel

    Ncols, Lq, Ld, dim = p.Ncols, p.Lq, p.Ld, p.dim
    if Q.stride(-1) != 1:
        Q = Q.contiguous()
    hopper, splits = plan.hopper, plan.splits
    qpb, docs = hopper.queries_per_block, hopper.docs_per_program
    save_argmax = argmax is not None
    if not save_argmax:
        argmax = no_argmax(Q.device, torch.int16)
    consts, template, d_layout = _gluon_launch_values(
        Q.dtype, plan.tiles.lq_tile, qpb, dim, p.norm_from_tiles, hopper.tiles,
        hopper.tiles_first, docs, save_argmax)
    block_n = hopper.tiles[0]
    if template is None or not hopper.descriptor_template:
        # A Triton release whose descriptor is not a plain dataclass.
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        documents = D.view(Ncols * Ld, dim)
        d_desc = TensorDescriptor(documents, [Ncols * Ld, dim], [dim, 1], [block_n, dim], d_layout)
    else:  # the base is read for its address and dtype only: the contiguous D serves as it is
        d_desc = _tensor_descriptor(template, D, [Ncols * Ld, dim], [dim, 1])
    kernel = launcher(_maxsim_fwd_overlap_kernel)

    def launch_slice(rows, out, stride_out_split):
        q = take(Q, rows)
        kernel(
            (cdiv(Ncols, docs) * splits, cdiv(q.shape[0], qpb)),
            (q, d_desc, out, argmax if rows is None or not save_argmax else argmax[rows],
             q.shape[0], Ncols, Lq, Ld, splits, stride_out_split, q.stride(0), q.stride(1)),
            consts,
        )

    _query_slices(launch_slice, scores, qpb, splits, plan.max_grid_y)


# ------------------------------------------------------------------------------------------------
# Packed layouts
# ------------------------------------------------------------------------------------------------


def forward_packed(plan: ForwardPlan, p: Problem, fp32_precision: str, layout, Q: Tensor,
                   D: Tensor, q_mask: Tensor | None, d_mask: Tensor | None,
                   q_inv: Tensor | None, d_inv: Tensor | None) -> tuple[Tensor, Tensor]:
    """Scores (``[Nq, n_cols]`` or ``[P]``, fp32) and, when saved, the int32 argmax
    (``[n_cols, ΣLq]`` or ``[P, max_q]``); nothing synchronizes with the host."""
    pairs = layout.pair_q is not None
    rows_q, dim = Q.shape
    device = Q.device
    save_argmax = p.save_argmax
    if pairs:
        out_shape, argmax_shape = (layout.n_pairs,), (layout.n_pairs, layout.max_q)
    else:
        out_shape, argmax_shape = (layout.n_queries, layout.n_cols), (layout.n_cols, rows_q)
    scores = empty(out_shape, torch.float32, device)
    argmax = empty(argmax_shape, torch.int32, device) if save_argmax else \
        no_argmax(device, torch.int32)
    if scores.numel() == 0:
        return scores, argmax
    cfg = plan.tiles
    qpb = cfg.queries_per_block
    n_qblocks = 1 if pairs else cdiv(layout.n_queries, qpb)
    grid = (layout.n_pairs,) if pairs else (layout.n_cols * n_qblocks,)
    qm, dm = as_bytes(q_mask), as_bytes(d_mask)
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
    launcher(_maxsim_ragged_fwd_kernel)(grid, args, _packed_constants(
        cfg, pairs, Q.dtype, dim, q_mask is not None, d_mask is not None, q_inv is not None,
        save_argmax, fp32_precision))
    return scores, argmax


@functools.lru_cache(maxsize=1024)
def _packed_constants(cfg, pairs, dtype, dim, has_q_mask, has_d_mask, normalize, save_argmax,
                      fp32_precision) -> Constants:
    return constants(PAIRS=pairs, **fwd_meta(
        cfg, dtype, dim, has_q_mask=has_q_mask, has_d_mask=has_d_mask, normalize=normalize,
        save_argmax=save_argmax, fp32_precision=fp32_precision))


# ------------------------------------------------------------------------------------------------
# Inverse norms
# ------------------------------------------------------------------------------------------------


def inverse_norms(x: Tensor, eps: float) -> Tensor:
    """``1 / max(‖x[..., :]‖, eps)`` in fp32, shape ``x.shape[:-1]``, one read of ``x``."""
    rows = x.reshape(-1, x.shape[-1]) if x.numel() else x.new_empty((0, x.shape[-1]))
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        block_k = block_k_for(rows.shape[1])
        block_rows = max(1, min(64, 8192 // block_k))
        launcher(_inverse_norm_kernel)(
            (cdiv(rows.shape[0], block_rows),),
            (rows, out, rows.shape[0], rows.shape[1], *rows.stride()),
            constants(EPS=eps, BLOCK_ROWS=block_rows, BLOCK_K=block_k, num_warps=4, num_stages=1),
        )
    return out.view(x.shape[:-1])
