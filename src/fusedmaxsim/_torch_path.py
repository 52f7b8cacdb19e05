"""The PyTorch path: MaxSim in bounded blocks, for CPU, MPS, float64 and any device without Triton.

Same contract as the Triton launchers in ``_launch`` (same arguments, same argmax with the lowest
index winning ties, same ``-1`` sentinel), so the autograd layer above does not care which path
ran. Similarities are computed in fp32 (float64 for float64 inputs) a block of
``(queries, documents, query tokens)`` at a time; a block holds at most ``block_bytes`` of
similarities and document copies, so memory never grows with the batch the way the naive
``einsum`` does. The one exception: a single document row larger than the budget is still
processed whole.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from ._plan import argmax_dtype, plan_blocks
from ._problem import weight_table

__all__ = [
    "decompress_residuals", "hidden_bwd_torch", "maxsim_bwd_blocked", "maxsim_fwd_blocked",
    "NORM_EPS", "normalize_backward", "packed_bwd_torch",
    "packed_fwd_torch", "residual_bwd_torch", "residual_fwd_torch", "smooth_bwd_blocked",
]

_LOG2E = math.log2(math.e)


NORM_EPS = 1e-12  # F.normalize's default


def normalize_backward(x: Tensor, grad_hat: Tensor, x_inv: Tensor | None = None) -> Tensor:
    """Vector-Jacobian product of ``F.normalize(x, dim=-1)`` (eps 1e-12), exact, fp32 or fp64.

    ``x_inv``: the forward's inverse norms (:func:`inverse_norms`), so they are not computed again.
    """
    xf = x.to(grad_hat.dtype)
    if x_inv is None:
        x_inv = 1.0 / torch.linalg.vector_norm(xf, dim=-1).clamp_min(NORM_EPS)
    inv = x_inv.to(grad_hat.dtype).unsqueeze(-1)
    x_hat = xf * inv
    radial = (grad_hat * x_hat).sum(dim=-1, keepdim=True)
    clamped = inv >= 1.0 / NORM_EPS  # norm <= eps: F.normalize divides by eps, no radial term
    radial = torch.where(clamped, torch.zeros_like(radial), radial)
    grad = (grad_hat - radial * x_hat) * inv
    # Linear in grad_hat, so a token that receives none gets exactly 0, whatever its values
    # (a masked token may hold NaN, which must not leak in through x_hat).
    untouched = (grad_hat == 0).all(dim=-1, keepdim=True)
    return grad.masked_fill(untouched, 0.0).to(x.dtype)


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _blocks_of(Q: Tensor, D: Tensor, block_bytes: int) -> tuple[int, int, int]:
    """:func:`plan_blocks` for padded ``Q [Nq, Lq, d]`` against ``D [Nd, Ld, d]`` or
    ``[Nq, K, Ld, d]`` (the packed layouts, whose padded sizes are known only as they run)."""
    Nq, Lq, dim = Q.shape
    budget = block_bytes // (8 if Q.dtype == torch.float64 else 4)
    return plan_blocks(Nq, D.shape[-3], Lq, D.shape[-2], dim, D.dim() == 4, budget)


_NOTHING_SAVED: dict = {}


def _nothing_saved(device: torch.device, dtype: torch.dtype) -> Tensor:
    """The shared empty tensor an inference call returns in place of the argmax (one PyTorch call
    less a call; it is never written)."""
    empty = _NOTHING_SAVED.get((device, dtype))
    if empty is None:
        empty = _NOTHING_SAVED[(device, dtype)] = torch.empty((0,), dtype=dtype, device=device)
    return empty


def _doc_block(D: Tensor, q: slice, c: slice, per_query_docs: bool, ct: torch.dtype) -> Tensor:
    return (D[q, c] if per_query_docs else D[c]).to(ct)


def _doc_side(t: Tensor | None, q: slice, c: slice, per_query_docs: bool) -> Tensor | None:
    """A document-side [.., Ld] tensor's block, shaped to broadcast over [bq, ls, bc, Ld]."""
    if t is None:
        return None
    return t[q, c].unsqueeze(1) if per_query_docs else t[c]


def _zero_grads(Q: Tensor, D: Tensor, need_grad_q: bool, need_grad_d: bool, ct: torch.dtype):
    """Zeroed accumulators in the compute dtype for the needed gradients, empty for the others."""
    empty = Q.new_empty((0,))
    grad_q = torch.zeros(Q.shape, dtype=ct, device=Q.device) if need_grad_q else empty
    grad_d = torch.zeros(D.shape, dtype=ct, device=D.device) if need_grad_d else empty
    return grad_q, grad_d


def _out_grads(grad_q, grad_d, Q, D, need_grad_q, need_grad_d, fp32_out, ct):
    """The needed accumulators in the gradients' dtypes: the inputs' own, or fp32 with ``fp32_out``."""
    as_fp32 = fp32_out and ct != torch.float64
    if need_grad_q:
        grad_q = grad_q.to(torch.float32 if as_fp32 else Q.dtype)
    if need_grad_d:
        grad_d = grad_d.to(torch.float32 if as_fp32 else D.dtype)
    return grad_q, grad_d


def _fwd_block(q_blk, d_blk, q_valid, d_valid, q_scale, d_scale, save_argmax: bool, tau: float,
               doc_major: bool = False):
    """One block: ``q_blk [bq, ls, d]`` against ``d_blk`` (``[bc, Ld, d]``, or ``[bq, bc, Ld, d]``
    per query), both in the compute dtype; masks and scales sliced alike, the document side's
    shaped to broadcast over ``[bq, ls, bc, Ld]``. Returns the block's scores summed over its query
    tokens ``[bq, bc]`` and, with ``save_argmax``, what the backward reads ``[bq, bc, ls]`` (a
    permuted view), else ``None``. ``doc_major`` (shared documents only) lays the similarities
    out as ``[bc, Ld, bq, ls]``: the product with the document tokens as its rows, which a CPU's
    BLAS runs up to 1.48× faster for some query sizes (the plan decides; docs/design.md, PyTorch
    path); the reductions then run over axis 1 and their results are viewed back."""
    nq, nl, dim = q_blk.shape
    nc, Ld = d_blk.shape[-3], d_blk.shape[-2]
    axis = -1
    if d_blk.dim() == 4:
        sim = torch.bmm(q_blk, d_blk.reshape(nq, nc * Ld, dim).transpose(1, 2))
        sim = sim.view(nq, nl, nc, Ld)
    elif doc_major:
        sim, axis = torch.inner(d_blk, q_blk), 1  # [bc, Ld, bq, ls]
        d_scale = None if d_scale is None else d_scale[..., None, None]
        d_valid = None if d_valid is None else d_valid[..., None, None]
    else:
        # One call for the product (its reshapes stay in C++): on a CPU a small call's time is
        # mostly its count of PyTorch calls (docs/design.md, PyTorch path).
        sim = torch.inner(q_blk, d_blk)  # [bq, ls, bc, Ld]
    if d_scale is not None:
        sim.mul_(d_scale)
    if d_valid is not None:
        sim.masked_fill_(~d_valid, float("-inf"))
    arg = None
    if tau:
        lse2 = torch.logsumexp(sim / tau, dim=axis) * _LOG2E  # [bq, ls, bc]
        best, arg = lse2 * (tau / _LOG2E), (lse2 if save_argmax else None)
    elif save_argmax:
        best, arg = sim.max(dim=axis)  # [bq, ls, bc]; NaN propagates; lowest index wins
    else:
        # No indices to find: on a CPU `amax` takes a third of the time of `max`'s
        # value-and-index pass (docs/design.md, PyTorch path). NaN propagates alike.
        best = sim.amax(dim=axis)
    del sim
    if best.dtype == torch.bfloat16:  # a bf16 product (the plan's bf16_product): the rest in fp32
        best = best.float()
    if axis == 1:  # [bc, bq, ls] viewed as [bq, ls, bc]
        best = best.permute(1, 2, 0)
        arg = None if arg is None else arg.permute(1, 2, 0)
    # `best` is a new tensor: rows that add nothing (no valid document token, so a max of -inf;
    # or a masked query token) are zeroed in place. Where nothing else needs to know which rows
    # those were, one pass that keeps NaN and +inf does it (a comparison and a fill are two).
    if q_valid is None and arg is None:
        torch.nan_to_num_(best, nan=math.nan, posinf=math.inf, neginf=0.0)
        if q_scale is not None:
            best.mul_(q_scale.unsqueeze(-1))
        return best.sum(dim=1), None
    none = best == float("-inf")
    best.masked_fill_(none, 0.0)
    if q_scale is not None:
        best.mul_(q_scale.unsqueeze(-1))
    if q_valid is not None:
        q_valid = q_valid.unsqueeze(-1)
        best.masked_fill_(~q_valid, 0.0)
        none = none | ~q_valid
    if arg is not None:
        arg = arg.masked_fill(none, float("inf") if tau else -1).permute(0, 2, 1)
    return best.sum(dim=1), arg


def maxsim_fwd_blocked(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None,
    d_mask: Tensor | None,
    q_inv: Tensor | None,
    d_inv: Tensor | None,
    save_argmax: bool,
    blocks: tuple[int, int, int],
    tau: float = 0.0,
    doc_major: bool = False,
    bf16_product: bool = False,
) -> tuple[Tensor, Tensor]:
    """Scores and argmax; with ``tau > 0`` the smooth max and, in place of the argmax, each row's
    log2-sum-exp2 of ``s · log2(e) / tau`` (``+inf`` where the row adds nothing), as on the
    Triton path. ``blocks``: queries, columns and query tokens a block (:func:`plan_blocks`);
    ``doc_major``: the product's orientation (:func:`_fwd_block`); ``bf16_product``: bf16
    inputs multiplied as they are, each token's maximum similarity rounded to bf16 before the
    fp32 sum (inference on a CPU); all from the plan."""
    per_query_docs = D.dim() == 4
    Nq, Lq, _ = Q.shape
    Ncols, Ld = D.shape[-3], D.shape[-2]
    ct = _compute_dtype(Q)
    pt = torch.bfloat16 if bf16_product else ct  # the product's dtype
    saved_dtype = ct if tau else argmax_dtype(Ld)
    if Nq * Ncols * Lq * Ld == 0:
        saved_shape = (Nq, Ncols, Lq) if save_argmax else (0,)
        argmax = torch.full(saved_shape, float("inf") if tau else -1, dtype=saved_dtype,
                            device=Q.device)
        return torch.zeros((Nq, Ncols), dtype=ct, device=Q.device), argmax

    bq, bc, ls = blocks
    if bq >= Nq and bc >= Ncols and ls >= Lq:
        # The whole problem in one block (the common case): one product, one reduction, one sum,
        # as the naive formula, with no accumulator.
        every = slice(None)
        d_valid = _doc_side(d_mask, every, every, per_query_docs)
        d_scale = _doc_side(d_inv, every, every, per_query_docs)
        q_scale = None if q_inv is None else q_inv.to(ct)
        scores, arg = _fwd_block(Q if Q.dtype == pt else Q.to(pt), D if D.dtype == pt else D.to(pt),
                                 q_mask, d_valid, q_scale, d_scale, save_argmax, tau, doc_major)
        if arg is None:
            return scores, _nothing_saved(Q.device, saved_dtype)
        return scores, Q.new_empty((Nq, Ncols, Lq), dtype=saved_dtype).copy_(arg)

    scores = torch.zeros((Nq, Ncols), dtype=ct, device=Q.device)
    saved_shape = (Nq, Ncols, Lq) if save_argmax else (0,)
    argmax = torch.empty(saved_shape, dtype=saved_dtype, device=Q.device)
    for i0 in range(0, Nq, bq):
        qs = slice(i0, min(Nq, i0 + bq))
        for j0 in range(0, Ncols, bc):
            cs = slice(j0, min(Ncols, j0 + bc))
            d_blk = _doc_block(D, qs, cs, per_query_docs, pt)  # [bc, Ld, d] or [bq, bc, Ld, d]
            d_valid = _doc_side(d_mask, qs, cs, per_query_docs)
            d_scale = _doc_side(d_inv, qs, cs, per_query_docs)
            for s0 in range(0, Lq, ls):
                ss = slice(s0, min(Lq, s0 + ls))
                q_valid = None if q_mask is None else q_mask[qs, ss]
                q_scale = None if q_inv is None else q_inv[qs, ss].to(ct)
                part, arg = _fwd_block(Q[qs, ss].to(pt), d_blk, q_valid, d_valid, q_scale,
                                       d_scale, save_argmax, tau, doc_major)
                scores[qs, cs] += part
                if arg is not None:
                    argmax[qs, cs, ss] = arg
    return scores, argmax


def maxsim_bwd_blocked(
    grad_scores: Tensor,
    Q: Tensor,
    D: Tensor,
    argmax: Tensor,
    q_inv: Tensor | None,
    d_inv: Tensor | None,
    need_grad_q: bool,
    need_grad_d: bool,
    fp32_out: bool,
    block_bytes: int,
) -> tuple[Tensor, Tensor]:
    """Gradients from the saved argmax: a gather for ``grad_Q`` and an accumulating
    ``index_put_`` (deterministic on every device) for ``grad_D``."""
    per_query_docs = D.dim() == 4
    Nq, Lq, dim = Q.shape
    Ncols, Ld = D.shape[-3], D.shape[-2]
    ct = _compute_dtype(Q)
    grad_q, grad_d = _zero_grads(Q, D, need_grad_q, need_grad_d, ct)
    if (need_grad_q or need_grad_d) and Nq * Ncols * Lq * Ld * dim > 0:
        grad_d_rows = grad_d.view(-1, dim) if need_grad_d else None
        g_all = grad_scores.to(ct)
        # Per pair, the gathered rows and their weighted copy: 2·Lq·d elements.
        bq, bc, _ = plan_blocks(Nq, Ncols, Lq, 2 * dim, 0, True, block_bytes // 4)
        for i0 in range(0, Nq, bq):
            qs = slice(i0, min(Nq, i0 + bq))
            q_rows = Q[qs].to(ct)
            if q_inv is not None:
                q_rows = q_rows * q_inv[qs].to(ct).unsqueeze(-1)
            for j0 in range(0, Ncols, bc):
                cs = slice(j0, min(Ncols, j0 + bc))
                idx = argmax[qs, cs].long()  # [bq, bc, Lq]
                hit = idx >= 0
                tok = idx.clamp_min(0)
                col = torch.arange(cs.start, cs.stop, device=Q.device).view(1, -1, 1)
                grp = torch.arange(qs.start, qs.stop, device=Q.device).view(-1, 1, 1)
                g = g_all[qs, cs].unsqueeze(-1) * hit  # [bq, bc, Lq]
                if need_grad_q:
                    rows = D[grp, col, tok] if per_query_docs else D[col, tok]  # [bq, bc, Lq, d]
                    rows = rows.to(ct)
                    if d_inv is not None:
                        scale = d_inv[grp, col, tok] if per_query_docs else d_inv[col, tok]
                        rows = rows * scale.to(ct).unsqueeze(-1)
                    # A miss gathered token 0 as a stand-in: keep it (maybe masked NaN) out.
                    rows = rows.masked_fill(~hit.unsqueeze(-1), 0.0)
                    grad_q[qs] += (g.unsqueeze(-1) * rows).sum(dim=1)
                if need_grad_d:
                    flat = (grp * Ncols if per_query_docs else 0) + col
                    flat = (flat * Ld + tok)[hit]
                    src = (g.unsqueeze(-1) * q_rows.unsqueeze(1))[hit]
                    # Sorted on CUDA, so deterministic (index_add_ would use atomics there).
                    grad_d_rows.index_put_((flat,), src, accumulate=True)
    return _out_grads(grad_q, grad_d, Q, D, need_grad_q, need_grad_d, fp32_out, ct)


def smooth_bwd_blocked(
    grad_scores: Tensor,
    Q: Tensor,
    D: Tensor,
    d_mask: Tensor | None,
    row_lse: Tensor,
    tau: float,
    need_grad_q: bool,
    need_grad_d: bool,
    fp32_out: bool,
    block_bytes: int,
) -> tuple[Tensor, Tensor]:
    """Gradients of the smooth max: the similarity blocks recomputed, weighted by their softmax
    ``exp2(s · log2(e) / tau - row_lse)`` and ``grad_scores``, and multiplied back."""
    per_query_docs = D.dim() == 4
    Nq, Lq, dim = Q.shape
    Ncols, Ld = D.shape[-3], D.shape[-2]
    ct = _compute_dtype(Q)
    grad_q, grad_d = _zero_grads(Q, D, need_grad_q, need_grad_d, ct)
    if (need_grad_q or need_grad_d) and Nq * Ncols * Lq * Ld * dim > 0:
        g_all = grad_scores.to(ct)
        # The similarity block and its weights: two block-sized temporaries.
        budget = block_bytes // (2 * torch.finfo(ct).bits // 8)
        bq, bc, ls = plan_blocks(Nq, Ncols, Lq, Ld, dim, per_query_docs, budget)
        for i0 in range(0, Nq, bq):
            qs = slice(i0, min(Nq, i0 + bq))
            for j0 in range(0, Ncols, bc):
                cs = slice(j0, min(Ncols, j0 + bc))
                d_blk = _doc_block(D, qs, cs, per_query_docs, ct)
                d_valid = _doc_side(d_mask, qs, cs, per_query_docs)
                if d_mask is not None:  # masked tokens (NaN or not) never reach a product
                    valid = d_mask[qs, cs] if per_query_docs else d_mask[cs]
                    d_blk = d_blk.masked_fill(~valid[..., None], 0.0)
                g = g_all[qs, cs].unsqueeze(1).unsqueeze(-1)  # [bq, 1, bc, 1]
                for s0 in range(0, Lq, ls):
                    ss = slice(s0, min(Lq, s0 + ls))
                    lse = row_lse[qs, cs, ss].to(ct).permute(0, 2, 1).unsqueeze(-1)
                    live = lse < float("inf")  # rows that added something
                    # Tokens of rows that added nothing here (masked ones among them) stay unread.
                    q_blk = Q[qs, ss].to(ct).masked_fill(~live.any(dim=2), 0.0)
                    if per_query_docs:
                        sim = torch.einsum("qsh,qcth->qsct", q_blk, d_blk)
                    else:
                        sim = torch.einsum("qsh,cth->qsct", q_blk, d_blk)
                    if d_valid is not None:
                        sim.masked_fill_(~d_valid, float("-inf"))
                    weight = torch.exp2(sim * (_LOG2E / tau) - lse) * g  # [bq, ls, bc, Ld]
                    weight = weight.masked_fill(~live, 0.0)
                    del sim
                    if need_grad_q:
                        spec = "qsct,qcth->qsh" if per_query_docs else "qsct,cth->qsh"
                        grad_q[qs, ss] += torch.einsum(spec, weight, d_blk)
                    if need_grad_d:
                        if per_query_docs:
                            grad_d[qs, cs] += torch.einsum("qsct,qsh->qcth", weight, q_blk)
                        else:
                            grad_d[cs] += torch.einsum("qsct,qsh->cth", weight, q_blk)
    return _out_grads(grad_q, grad_d, Q, D, need_grad_q, need_grad_d, fp32_out, ct)


# --------------------------------------------------------------------------------------------
# The PyTorch path: the packed sequences are padded a bounded block at a time and scored by the
# dense path's blocked implementation, so that both paths share one contract.
# --------------------------------------------------------------------------------------------


def _lengths(cu: Tensor, rows: int) -> Tensor:
    """Sequence lengths, with offsets clamped into ``[0, rows]`` as the kernels clamp them."""
    cu = cu.long()
    lo = cu[:-1].clamp(0, rows)
    hi = torch.maximum(cu[1:].clamp(max=rows), lo)
    return hi - lo


def _padded_rows(cu: Tensor, seqs: Tensor, width: int, rows: int) -> tuple[Tensor, Tensor]:
    """Packed row of every slot of a ``[len(seqs), width]`` padded view, and which slots hold a
    token of their sequence (the rows of the others are clamped into range and never matter)."""
    cu = cu.long()
    lo = cu[seqs].clamp(0, rows)
    hi = torch.maximum(cu[seqs + 1].clamp(max=rows), lo)
    slots = torch.arange(width, device=cu.device)
    inside = slots < (hi - lo)[:, None]
    return (lo[:, None] + slots).clamp(max=max(rows - 1, 0)), inside


def _gather(x: Tensor | None, idx: Tensor) -> Tensor | None:
    if x is None:
        return None
    if x.shape[0] == 0:
        return x.new_zeros((*idx.shape, *x.shape[1:]))
    return x[idx]


@dataclasses.dataclass
class _Padded:
    """Some sequences of one side gathered into a padded block."""

    rows: Tensor  # [n, width] packed row of each slot
    inside: Tensor  # [n, width] the slot holds a token of its sequence
    valid: Tensor  # inside, and not masked
    tokens: Tensor  # [n, width, d]
    inv: Tensor | None  # [n, width] inverse norms


def _pad(cu, seqs, width, rows, X, mask, inv, keep=None) -> _Padded:
    idx, inside = _padded_rows(cu, seqs, width, rows)
    if keep is not None:
        inside = inside & keep[:, None]
    valid = inside if mask is None else inside & _gather(mask, idx)
    return _Padded(idx, inside, valid, _gather(X, idx), _gather(inv, idx))


def _column_groups(lengths: list[int], max_len: int, dim: int, budget: int):
    """Consecutive documents whose padded block (``count · width · d``) fits the budget, each
    padded to its own longest document, not the corpus's."""
    start, width = 0, 0
    for n, length in enumerate(lengths):
        w = max(width, min(length, max_len))
        if n > start and (n + 1 - start) * max(w, 1) * dim > budget:
            yield start, n, width
            start, w = n, min(length, max_len)
        width = w
    if start < len(lengths):
        yield start, len(lengths), width


def _too_long(lengths: Tensor, bound: int) -> Tensor:
    return lengths > bound


def _cross_fwd_torch(layout, Q, D, q_mask, d_mask, q_inv, d_inv, save_argmax, block_bytes):
    ct = _compute_dtype(Q)
    device, dim = Q.device, Q.shape[1]
    n_q, n_cols, rows_q = layout.n_queries, layout.n_cols, layout.rows_q
    scores = torch.zeros((n_q, n_cols), dtype=ct, device=device)
    argmax_shape = (n_cols, rows_q) if save_argmax else (0,)
    argmax = torch.full(argmax_shape, -1, dtype=torch.int32, device=device)
    if n_q == 0 or n_cols == 0:
        return scores, argmax
    len_q = _lengths(layout.cu_q, rows_q)
    len_d = _lengths(layout.cu_d[layout.col_lo : layout.col_lo + n_cols + 1], layout.rows_d)
    width_q = min(int(len_q.max()), layout.max_q)
    qp = _pad(layout.cu_q, torch.arange(n_q, device=device), width_q, rows_q, Q, q_mask, q_inv)
    q_rows = qp.rows[qp.inside]
    for c0, c1, width_d in _column_groups(len_d.tolist(), layout.max_d, dim, block_bytes // 4):
        docs = torch.arange(layout.col_lo + c0, layout.col_lo + c1, device=device)
        dp = _pad(layout.cu_d, docs, width_d, layout.rows_d, D, d_mask, d_inv)
        s, a = maxsim_fwd_blocked(
            qp.tokens, dp.tokens, qp.valid, dp.valid, qp.inv, dp.inv, save_argmax,
            _blocks_of(qp.tokens, dp.tokens, block_bytes),
        )
        scores[:, c0:c1] = s
        if save_argmax:
            argmax[c0:c1, q_rows] = a.permute(1, 0, 2)[:, qp.inside].to(argmax.dtype)
    # As on the GPU: a sequence longer than its promised maximum scores NaN.
    broken = _too_long(len_q, layout.max_q)[:, None] | _too_long(len_d, layout.max_d)[None, :]
    return torch.where(broken, float("nan"), scores), argmax


def _cross_bwd_torch(layout, grad, Q, D, argmax, q_inv, d_inv, need_q, need_d, block_bytes):
    ct = _compute_dtype(Q)
    device, dim = Q.device, Q.shape[1]
    n_q, n_cols, rows_q = layout.n_queries, layout.n_cols, layout.rows_q
    grad_q = torch.zeros(Q.shape, dtype=ct, device=device) if need_q else None
    grad_d = torch.zeros(D.shape, dtype=ct, device=device) if need_d else None
    if n_q == 0 or n_cols == 0:
        return grad_q, grad_d
    len_q = _lengths(layout.cu_q, rows_q)
    len_d = _lengths(layout.cu_d, layout.rows_d)
    width_q = min(int(len_q.max()), layout.max_q)
    qp = _pad(layout.cu_q, torch.arange(n_q, device=device), width_q, rows_q, Q, None, q_inv)
    q_rows = qp.rows[qp.inside]
    grad_qp = torch.zeros((n_q, width_q, dim), dtype=ct, device=device) if need_q else None
    for c0, c1, width_d in _column_groups(len_d.tolist(), layout.max_d, dim, block_bytes // 4):
        docs = torch.arange(c0, c1, device=device)
        dp = _pad(layout.cu_d, docs, width_d, layout.rows_d, D, None, d_inv)
        arg = torch.full((c1 - c0, n_q, width_q), -1, dtype=torch.int32, device=device)
        arg[:, qp.inside] = argmax[c0:c1, q_rows]
        gq, gd = maxsim_bwd_blocked(
            grad[:, c0:c1], qp.tokens, dp.tokens, arg.permute(1, 0, 2), qp.inv, dp.inv,
            need_q, need_d, True, block_bytes,
        )
        if need_q:
            grad_qp += gq
        if need_d:
            grad_d[dp.rows[dp.inside]] = gd[dp.inside]
    if need_q:
        grad_q[q_rows] = grad_qp[qp.inside]
    return grad_q, grad_d


class _PairBlocks:
    """The pair list in blocks of pairs, each side padded to its longest sequence (capped by the
    promised maximum), a block holding at most the PyTorch path's budget of tokens."""

    def __init__(self, layout, dim: int, block_bytes: int):
        self.layout = layout
        self.len_q = _lengths(layout.cu_q, layout.rows_q)
        self.len_d = _lengths(layout.cu_d, layout.rows_d)
        self.width_q = min(int(self.len_q.max()) if self.len_q.numel() else 0, layout.max_q)
        self.width_d = min(int(self.len_d.max()) if self.len_d.numel() else 0, layout.max_d)
        per_pair = max(1, (self.width_q + self.width_d) * max(dim, 1))
        self.step = max(1, (block_bytes // 4) // per_pair)

    def __iter__(self):
        layout = self.layout
        for p0 in range(0, layout.n_pairs, self.step):
            sl = slice(p0, min(layout.n_pairs, p0 + self.step))
            pq, pd = layout.pair_q[sl].long(), layout.pair_d[sl].long()
            ok = (pq >= 0) & (pq < layout.n_queries) & (pd >= 0) & (pd < layout.n_docs)
            yield sl, torch.where(ok, pq, 0), torch.where(ok, pd, 0), ok

    def pad(self, pq, pd, ok, Q, D, q_mask, d_mask, q_inv, d_inv) -> tuple[_Padded, _Padded]:
        layout = self.layout
        qp = _pad(layout.cu_q, pq, self.width_q, layout.rows_q, Q, q_mask, q_inv, keep=ok)
        dp = _pad(layout.cu_d, pd, self.width_d, layout.rows_d, D, d_mask, d_inv, keep=ok)
        return qp, dp


def _pairs_fwd_torch(layout, Q, D, q_mask, d_mask, q_inv, d_inv, save_argmax, block_bytes):
    ct = _compute_dtype(Q)
    n_pairs = layout.n_pairs
    scores = torch.zeros(n_pairs, dtype=ct, device=Q.device)
    argmax = torch.full(
        (n_pairs, layout.max_q) if save_argmax else (0,), -1, dtype=torch.int32, device=Q.device
    )
    if n_pairs == 0:
        return scores, argmax
    if layout.n_queries == 0 or layout.n_docs == 0:  # every index is out of range
        return scores.fill_(float("nan")), argmax
    blocks = _PairBlocks(layout, Q.shape[1], block_bytes)
    for sl, pq, pd, ok in blocks:
        qp, dp = blocks.pad(pq, pd, ok, Q, D, q_mask, d_mask, q_inv, d_inv)
        d_tokens = dp.tokens.unsqueeze(1)
        s, a = maxsim_fwd_blocked(
            qp.tokens, d_tokens, qp.valid, dp.valid.unsqueeze(1), qp.inv,
            None if dp.inv is None else dp.inv.unsqueeze(1), save_argmax,
            _blocks_of(qp.tokens, d_tokens, block_bytes),
        )
        broken = ~ok | _too_long(blocks.len_q[pq], layout.max_q)
        broken = broken | _too_long(blocks.len_d[pd], layout.max_d)
        scores[sl] = torch.where(broken, float("nan"), s[:, 0])
        if save_argmax:
            argmax[sl, : blocks.width_q] = a[:, 0].to(argmax.dtype)
    return scores, argmax


def _pairs_bwd_torch(layout, grad, Q, D, argmax, q_inv, d_inv, need_q, need_d, block_bytes):
    ct = _compute_dtype(Q)
    grad_q = torch.zeros(Q.shape, dtype=ct, device=Q.device) if need_q else None
    grad_d = torch.zeros(D.shape, dtype=ct, device=D.device) if need_d else None
    if layout.n_pairs == 0 or layout.n_queries == 0 or layout.n_docs == 0:
        return grad_q, grad_d
    blocks = _PairBlocks(layout, Q.shape[1], block_bytes)
    for sl, pq, pd, ok in blocks:
        qp, dp = blocks.pad(pq, pd, ok, Q, D, None, None, q_inv, d_inv)
        gq, gd = maxsim_bwd_blocked(
            grad[sl].unsqueeze(1), qp.tokens, dp.tokens.unsqueeze(1),
            argmax[sl, : blocks.width_q].unsqueeze(1), qp.inv,
            None if dp.inv is None else dp.inv.unsqueeze(1), need_q, need_d, True, block_bytes,
        )
        # Pairs share queries and documents: their gradients add up (index_put_ with
        # accumulate sorts the indices on CUDA: deterministic, where index_add_ uses atomics).
        if need_q:
            grad_q.index_put_((qp.rows[qp.inside],), gq[qp.inside], accumulate=True)
        if need_d:
            grad_d.index_put_((dp.rows[dp.inside],), gd[:, 0][dp.inside], accumulate=True)
    return grad_q, grad_d


def packed_fwd_torch(layout, Q, D, q_mask, d_mask, q_inv, d_inv, save_argmax, block_bytes):
    """Scores and argmax of a packed layout (cross product or pair list), as the Triton path."""
    fwd = _pairs_fwd_torch if layout.pair_q is not None else _cross_fwd_torch
    return fwd(layout, Q, D, q_mask, d_mask, q_inv, d_inv, save_argmax, block_bytes)


def packed_bwd_torch(layout, grad, Q, D, argmax, q_inv, d_inv, need_q, need_d, fp32_out,
                     block_bytes):
    """Gradients of a packed layout in the inputs' dtypes (fp32 with ``fp32_out``); an
    unneeded one is an empty tensor."""
    bwd = _pairs_bwd_torch if layout.pair_q is not None else _cross_bwd_torch
    grad_q, grad_d = bwd(layout, grad, Q, D, argmax, q_inv, d_inv, need_q, need_d, block_bytes)
    grad_q, grad_d = _out_grads(grad_q, grad_d, Q, D, need_q, need_d, fp32_out, _compute_dtype(Q))
    none = Q.new_empty((0,))
    return (none if grad_q is None else grad_q), (none if grad_d is None else grad_d)


# ------------------------------------------------------------------------------------------------
# Residual (PLAID) documents: decompressed a block of documents at a time
# ------------------------------------------------------------------------------------------------

def decompress_residuals(codes: Tensor, residuals: Tensor, centroids: Tensor,
                         bucket_weights: Tensor, nbits: int, bit_order: str) -> Tensor:
    """``centroids[codes] + bucket_weights[b]`` per dimension, ``b`` the dimension's code in
    ``residuals``, summed in fp32 (float64 for float64) and rounded to the centroids' dtype: ``[*codes.shape, d]``. An
    id outside ``[0, n_centroids)`` gives a token of NaN (never a read out of bounds)."""
    n_centroids, dim = centroids.shape
    inside = (codes >= 0) & (codes < n_centroids)
    rows = centroids[codes.clamp(0, max(n_centroids - 1, 0)).long()]
    ct = _compute_dtype(centroids)
    # Each byte's weights through the kernel's own table (the bit order folded in).
    weights = weight_table(bucket_weights.to(ct), nbits, bit_order)[residuals.long()]
    weights = weights.flatten(-2)[..., :dim]  # the last byte's spare codes dropped
    tokens = (rows.to(ct) + weights).to(centroids.dtype)
    return tokens.masked_fill_(~inside.unsqueeze(-1), float("nan"))


def _residual_docs(docs, ids: Tensor, normalize: bool):
    """The documents ``ids`` (any shape; an id < 0: none) gathered from the packed rows and
    decompressed: ``(tokens [*ids.shape, L, d], valid [*ids.shape, L], d_inv, broken
    [*ids.shape])``, ``L`` the longest of them (on a GPU the documents' bound where it is known,
    else one synchronization), ``d_inv`` the
    tokens' inverse norms (fp32) with ``normalize``, ``broken`` the documents whose length or
    offset is out of range (their scores are NaN; nothing of them is read)."""
    safe = ids.clamp_min(0)
    starts, lengths = docs.starts[safe], docs.lengths[safe].long()
    n_rows = docs.codes.shape[0]
    bound = n_rows if docs.max_len is None else docs.max_len
    broken = (lengths < 0) | (lengths > bound) | (starts < 0) | (starts + lengths > n_rows)
    lengths = torch.where(broken | (ids < 0), 0, lengths)
    if ids.device.type != "cpu" and docs.max_len is not None:
        L = docs.max_len
    else:
        L = int(lengths.max()) if lengths.numel() else 0
    pos = torch.arange(L, device=ids.device)
    valid = pos < lengths[..., None]
    rows = torch.where(valid, starts[..., None] + pos, 0)
    tokens = decompress_residuals(docs.codes[rows], docs.residuals[rows], docs.centroids,
                                  docs.bucket_weights, docs.nbits, docs.bit_order)
    d_inv = None
    if normalize:
        norm = torch.linalg.vector_norm(tokens, dim=-1, dtype=_compute_dtype(tokens))
        d_inv = 1.0 / norm.clamp_min(NORM_EPS)
    return tokens, valid, d_inv, broken


def _residual_blocks(docs, blocks: tuple[int, int, int], Nq: int):
    """The blocks of the scores, ``(q0, q1, j0, j1, ids)``: every query against a block of
    documents, or a block of queries against a block of their own candidates."""
    bq, bc, _ = blocks
    n_cols = docs.n_cols
    for j0 in range(0, n_cols, bc):
        j1 = min(n_cols, j0 + bc)
        if docs.doc_ids is None:
            yield 0, Nq, j0, j1, torch.arange(j0, j1, device=docs.starts.device)
        else:
            for q0 in range(0, Nq, bq):
                q1 = min(Nq, q0 + bq)
                yield q0, q1, j0, j1, docs.doc_ids[q0:q1, j0:j1]


def residual_fwd_torch(blocks: tuple[int, int, int], doc_major: bool, Q: Tensor, docs,
                       q_mask: Tensor | None, q_inv: Tensor | None, normalize: bool,
                       save_argmax: bool) -> tuple[Tensor, Tensor]:
    """Scores ``[Nq, Ncols]`` and argmax of ``Q`` against the compressed documents: each block of
    documents (or of each query's candidates) gathered, decompressed, then scored by
    :func:`maxsim_fwd_blocked` (``blocks`` from the plan, as there)."""
    Nq, Lq, _ = Q.shape
    n_cols = docs.n_cols
    ct = _compute_dtype(Q)
    saved = argmax_dtype(docs.codes.shape[0] if docs.max_len is None else docs.max_len)
    scores = torch.zeros((Nq, n_cols), dtype=ct, device=Q.device)
    argmax = torch.full((Nq, n_cols, Lq), -1, dtype=saved, device=Q.device) if save_argmax \
        else _nothing_saved(Q.device, saved)
    if Nq == 0:
        return scores, argmax
    for q0, q1, j0, j1, ids in _residual_blocks(docs, blocks, Nq):
        tokens, valid, d_inv, broken = _residual_docs(docs, ids, normalize)
        s, a = maxsim_fwd_blocked(
            Q[q0:q1], tokens, None if q_mask is None else q_mask[q0:q1], valid,
            None if q_inv is None else q_inv[q0:q1], d_inv, save_argmax,
            (blocks[0], j1 - j0, blocks[2]), 0.0, doc_major and docs.doc_ids is None)
        if not docs.checked:
            s = torch.where(broken, float("nan"), s)
        if docs.doc_ids is not None:
            s = torch.where(ids < 0, float("-inf"), s)  # no candidate
        scores[q0:q1, j0:j1] = s
        if save_argmax:
            argmax[q0:q1, j0:j1] = a
    return scores, argmax


def residual_bwd_torch(blocks: tuple[int, int, int], grad_scores: Tensor, Q: Tensor, docs,
                       argmax: Tensor, q_inv: Tensor | None, normalize: bool, fp32_out: bool,
                       block_bytes: int) -> tuple[Tensor, Tensor]:
    """``(grad_Q, empty)``: the index is frozen. Each block of documents is gathered and
    decompressed again, and its part of ``grad_Q`` gathered from the saved argmax
    (:func:`maxsim_bwd_blocked`)."""
    ct = _compute_dtype(Q)
    grad_q = torch.zeros(Q.shape, dtype=ct, device=Q.device)
    for q0, q1, j0, j1, ids in _residual_blocks(docs, blocks, Q.shape[0]):
        tokens, _, d_inv, _ = _residual_docs(docs, ids, normalize)
        part, _ = maxsim_bwd_blocked(grad_scores[q0:q1, j0:j1], Q[q0:q1], tokens,
                                     argmax[q0:q1, j0:j1],
                                     None if q_inv is None else q_inv[q0:q1], d_inv, True, False,
                                     True, block_bytes)
        grad_q[q0:q1] += part
    as_fp32 = fp32_out and ct != torch.float64
    return grad_q.to(torch.float32 if as_fp32 else Q.dtype), Q.new_empty((0,))


# ------------------------------------------------------------------------------------------------
# PLAID approximate scores: the centroid scores of a block of documents gathered at a time
# ------------------------------------------------------------------------------------------------


def _approx_rows(first: Tensor, length: Tensor, width: int, codes: Tensor,
                 n_centroids: int) -> Tensor:
    """``[n, width]`` rows of the table (the centroid scores, then a row of -inf and one of NaN)
    for the tokens of some documents (``first``, ``length``) padded to ``width``: a token's
    centroid, the -inf row past a document's length, the NaN row for an id outside
    ``[0, n_centroids)``."""
    slots = torch.arange(width, device=codes.device)
    inside = slots < length[:, None]
    ids = codes[(first[:, None] + slots).clamp(0, max(codes.shape[0] - 1, 0))].long()
    ok = (ids >= 0) & (ids < n_centroids)
    return torch.where(inside, torch.where(ok, ids, n_centroids + 1), n_centroids)


def _approx_sum(vals: Tensor) -> Tensor:
    """``Σ_s max_t`` over ``vals [..., tokens, Lq]``, a max of -inf adding 0 (NaN propagates)."""
    best = vals.amax(-2)
    return torch.where(best == float("-inf"), 0.0, best).sum(-1)


def approx_scores_torch(block_elems: int, cs: Tensor, codes: Tensor, starts: Tensor,
                        lengths: Tensor, doc_ids: Tensor | None,
                        hits: Tensor | None = None) -> Tensor:
    """PLAID's approximate scores (``kernels.approx``' contract) on the PyTorch path: ``[Nq,
    Nd]``, or ``[Nq, C]`` with ``doc_ids`` (an id < 0: -inf), fp32 (float64 for float64 ``cs``).
    With ``hits [Nq, Nd]`` only the documents of ``hits[q]`` true are scored for query ``q``,
    the rest score -inf (the largest count read back: one synchronization on a GPU).

    The centroid scores are copied once into the compute dtype with two rows more, -inf (a
    padding token) and NaN (an id out of range), so that one ``index_select`` gathers a block's
    final values. Consecutive documents (or candidate pairs) are gathered a block at a time,
    each block padded to its own longest document and holding at most ``block_elems`` values (a
    single document larger than that is still gathered whole). A document whose range leaves
    ``codes``, or a candidate id ``>= Nd``, scores NaN."""
    if hits is not None:  # each query's hits, ascending, then -1: as wide as the most hits
        Nq, Nd = hits.shape
        pos = torch.cumsum(hits, 1)
        width = int(pos[:, -1].max()) if hits.numel() else 0
        ids = torch.full((Nq, width + 1), -1, dtype=torch.int64, device=hits.device)
        slot = torch.where(hits, pos - 1, width)  # column width: a slot for the misses
        ids.scatter_(1, slot, torch.arange(Nd, device=hits.device).expand(Nq, Nd))
        ids = ids[:, :width]
        scores = approx_scores_torch(block_elems, cs, codes, starts, lengths, ids)
        out = scores.new_full((Nq, Nd + 1), float("-inf"))  # column Nd: the padding's
        return out.scatter_(1, torch.where(ids < 0, Nd, ids), scores)[:, :Nd]
    Nq, n_centroids, Lq = cs.shape
    ct = _compute_dtype(cs)
    n_docs, n_tokens = starts.shape[0], codes.shape[0]
    candidates = doc_ids is not None
    out = torch.zeros((Nq, doc_ids.shape[1] if candidates else n_docs), dtype=ct,
                      device=cs.device)
    if out.numel() == 0:
        return out
    with torch.no_grad():
        first, length = starts.long(), lengths.long()
        broken = (first < 0) | (length < 0) | (first > n_tokens) | (length > n_tokens - first)
        length = torch.where(broken, 0, length)
        first = torch.where(broken, 0, first)
        extra = torch.tensor([float("-inf"), float("nan")], dtype=ct, device=cs.device)
        table = torch.cat([cs.to(ct), extra[None, :, None].expand(Nq, 2, Lq)], 1)
        rows = n_centroids + 2
        if not candidates:
            lengths_list = length.tolist()
            longest = max(lengths_list)
            bq = max(1, min(Nq, block_elems // max(1, longest * Lq)))
            for q0 in range(0, Nq, bq):
                q1 = min(Nq, q0 + bq)
                for j0, j1, width in _column_groups(lengths_list, longest, (q1 - q0) * max(Lq, 1),
                                                    block_elems):
                    if width == 0 or Lq == 0:
                        continue  # every document of the block empty: 0
                    idx = _approx_rows(first[j0:j1], length[j0:j1], width, codes,
                                       n_centroids)
                    vals = table[q0:q1].index_select(1, idx.flatten())
                    out[q0:q1, j0:j1] = _approx_sum(vals.view(q1 - q0, j1 - j0, width, Lq))
            return torch.where(broken, float("nan"), out)
        ids = doc_ids.long()
        none = ids < 0
        known = ~none & (ids < n_docs)
        if n_docs == 0:
            return torch.where(none, float("-inf"), float("nan")).to(ct)
        doc = torch.where(known, ids, 0).flatten()
        pair_first, pair_len = first[doc], torch.where(known.flatten(), length[doc], 0)
        base = torch.arange(Nq, device=cs.device).repeat_interleave(ids.shape[1]) * rows
        lengths_list = pair_len.tolist()
        flat, flat_table = out.view(-1), table.view(Nq * rows, Lq)
        for p0, p1, width in _column_groups(lengths_list, max(lengths_list), max(Lq, 1),
                                            block_elems):
            if width == 0 or Lq == 0:
                continue
            idx = _approx_rows(pair_first[p0:p1], pair_len[p0:p1], width, codes,
                               n_centroids) + base[p0:p1, None]
            vals = flat_table.index_select(0, idx.flatten())
            flat[p0:p1] = _approx_sum(vals.view(p1 - p0, width, Lq))
        out = torch.where(~known | broken[doc].view_as(known), float("nan"), out)
        return torch.where(none, float("-inf"), out)


__all__ += ["approx_scores_torch"]


def probe_torch(launch_queries: int, cells: Tensor, offsets: Tensor, ivf: Tensor, n_docs: int,
                longest: int) -> Tensor:
    """The search's probe (``kernels.probe``' contract) on the PyTorch path: ``hit [Nq, n_docs]``
    bool, true where a document is in the inverted list ``ivf[offsets[c]:offsets[c + 1]]`` of
    some cell ``c`` of ``cells [Nq, P]`` (a cell outside ``[0, n_cells)`` probes nothing). The
    lists of ``launch_queries`` queries are gathered at a time, each padded to ``longest``."""
    Nq, P = cells.shape
    hit = torch.zeros((Nq, n_docs + 1), dtype=torch.bool, device=cells.device)
    if longest == 0 or P == 0:
        return hit[:, :-1]
    n_cells = offsets.shape[0] - 1
    pos = torch.arange(longest, device=cells.device)
    for q0 in range(0, Nq, launch_queries):
        c = cells[q0:q0 + launch_queries].long()
        probed = (c >= 0) & (c < n_cells)
        c = torch.where(probed, c, 0)
        lo = offsets[c]
        n = torch.where(probed, offsets[c + 1] - lo, 0)
        entry = (lo[..., None] + pos).clamp_max(ivf.shape[0] - 1)
        docs = torch.where(pos < n[..., None], ivf[entry], n_docs)  # column n_docs: no entry
        hit[q0:q0 + launch_queries].scatter_(1, docs.flatten(1), True)
    return hit[:, :-1]


__all__ += ["probe_torch"]


# ------------------------------------------------------------------------------------------------
# The fused projection head's backward: closed form from the saved argmax
# ------------------------------------------------------------------------------------------------


def _hidden_mm(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """``a @ b`` for ``a`` in the compute dtype and ``b`` in the inputs' dtype: a 16-bit product
    (as ``F.linear``'s backward runs it: the gradient rounded to the inputs' dtype, fp32
    accumulation inside the product), else in the compute dtype."""
    if dtype in (torch.float16, torch.bfloat16):
        return a.to(dtype) @ b
    return a @ b.to(a.dtype)


def hidden_bwd_torch(grad_scores: Tensor, Q: Tensor, H: Tensor, W: Tensor, b: Tensor | None,
                     argmax: Tensor, normalize: bool, need_q: bool, need_h: bool, need_w: bool,
                     need_b: bool, cols: int, by_entry: bool) -> tuple[Tensor | None, ...]:
    """``(grad_Q, grad_H, grad_W, grad_b)`` of ``maxsim(Q, normalize?(F.linear(H, W, b)))`` from
    the forward's argmax ``[Nq, Ncols, Lq]`` (-1: the token adds nothing); None where not needed.

    With ``P = F.linear(H, W, b)`` (rounded to H's dtype as the forward's) and ``P̂`` its
    normalized rows, only winning rows receive gradient::

        grad_P̂[r]  = Σ_{(i, j, s): row(i, j, A[i, j, s]) = r} g[i, j] · Q[i, s]
        grad_Q[i, s] = Σ_j g[i, j] · P̂[row(i, j, A[i, j, s])]
        grad_P = J_normalize(P) · grad_P̂
        grad_W = grad_Pᵀ H;  grad_b = Σ_r grad_P;  grad_H = grad_P W

    Columns (documents) are taken ``cols`` a chunk. With ``by_entry`` (the plan's choice where a
    chunk has fewer (query, query token) entries than document rows: a few queries against long
    documents, or per-query candidates) a chunk recomputes the projection of its winners only,
    one row an entry (``Nq·c·Lq`` rows of ``d_model``, fewer than the chunk's ``c·Ld``); otherwise
    every row of the chunk (``F.linear`` once). Either way at most ``min(rows, entries)`` rows of
    ``d_model`` a chunk, nothing of ``Nq·Nd·Lq`` rows at once (``_plan.plan_hidden_backward``).
    Deterministic: the sums over entries run through ``index_put_(accumulate=True)`` (sorted on
    CUDA). A row that no entry wins receives exactly 0, whatever its values (a masked token may
    hold NaN)."""
    per_query = H.dim() == 4
    Nq, Lq, dim = Q.shape
    Ncols, Ld, d_model = H.shape[-3], H.shape[-2], H.shape[-1]
    dtype = H.dtype
    ct = torch.float64 if torch.float64 in (Q.dtype, H.dtype) else torch.float32
    dev = Q.device
    grad_q = torch.zeros((Nq, Lq, dim), dtype=ct, device=dev) if need_q else None
    grad_h = torch.zeros_like(H) if need_h else None
    grad_w = torch.zeros((dim, d_model), dtype=ct, device=dev) if need_w else None
    grad_b = torch.zeros((dim,), dtype=ct, device=dev) if need_b and b is not None else None
    if not (Nq * Ncols * Lq * Ld):
        return grad_q, grad_h, grad_w, grad_b
    g = grad_scores.to(ct)
    q = Q.to(ct)
    for c0 in range(0, Ncols, cols):
        cs = slice(c0, min(Ncols, c0 + cols))
        c = cs.stop - c0
        arg = argmax[:, cs].long()  # [Nq, c, Lq]
        valid = arg >= 0
        t = arg.clamp_min(0)
        ge = torch.where(valid, g[:, cs, None], 0.0)  # [Nq, c, Lq]; an absent winner adds 0
        jj = torch.arange(c, device=dev).view(1, c, 1).expand_as(t)
        ii = torch.arange(Nq, device=dev).view(Nq, 1, 1).expand_as(t)
        Hc = H[:, cs] if per_query else H[cs]
        local = (((ii * c + jj) if per_query else jj) * Ld + t).flatten()  # [E] chunk rows
        upstream = (ge.unsqueeze(-1) * q.unsqueeze(1)).reshape(-1, dim)  # grad_P̂ an entry
        if by_entry:
            He = Hc[ii, jj, t] if per_query else Hc[jj, t]  # [Nq, c, Lq, d_model]
            He = He.masked_fill(~valid.unsqueeze(-1), 0.0).reshape(-1, d_model)
            P = torch.nn.functional.linear(He, W, b).to(ct)  # [E, d]
            grad_in = upstream
        else:
            He = Hc.reshape(-1, d_model)  # [R, d_model]; a copy only for strided candidates
            P = torch.nn.functional.linear(He, W, b).to(ct)  # [R, d]
            grad_in = torch.zeros_like(P).index_put_((local,), upstream, accumulate=True)
            touched = (grad_in != 0).any(dim=-1, keepdim=True)
            He = He.masked_fill(~touched, 0.0)  # rows no entry won: their values never matter
        inv = 1.0 / torch.linalg.vector_norm(P, dim=-1).clamp_min(NORM_EPS) if normalize else None
        if need_q:
            P_hat = P if inv is None else P * inv.unsqueeze(-1)
            won = P_hat if by_entry else P_hat[local]
            won = torch.where(valid.reshape(-1, 1), won, 0.0).view(Nq, c, Lq, dim)
            grad_q += (ge.unsqueeze(-1) * won).sum(1)
        if not (need_h or need_w or grad_b is not None):
            continue
        grad_p = grad_in if inv is None else normalize_backward(P, grad_in, inv)  # [E or R, d]
        if need_w:
            grad_w += _hidden_mm(grad_p.t(), He, dtype).to(ct)
        if grad_b is not None:
            grad_b += grad_p.sum(0)
        if need_h:
            if by_entry:
                # Each winning row once: the entries sorted by row, a segment a row, the
                # duplicates summed in fp32 (at most E segments, d wide, without a
                # synchronization), one product a segment, added to its row (a segment past
                # the last row is zero and adds nothing to row 0).
                rows, order = torch.sort(local, stable=True)
                first = torch.ones_like(rows, dtype=torch.bool)
                first[1:] = rows[1:] != rows[:-1]
                segment = first.cumsum(0) - 1
                total = torch.zeros_like(grad_p).index_put_((segment,), grad_p[order],
                                                            accumulate=True)
                row_of = torch.zeros_like(rows).index_put_((segment,), rows, accumulate=False)
                values = _hidden_mm(total, W, dtype).to(dtype)  # [E, d_model]
                target = grad_h[:, cs] if per_query else grad_h[cs]
                target = target.view(-1, d_model) if target.is_contiguous() else None
                if target is not None:
                    target.index_put_((row_of,), values, accumulate=True)
                else:  # a strided grad_h (H's own layout): through a coordinate index
                    t_of = row_of % Ld
                    g_of = row_of // Ld
                    view = grad_h[:, cs] if per_query else grad_h[cs]
                    if per_query:
                        view.index_put_((g_of // c, g_of % c, t_of), values, accumulate=True)
                    else:
                        view.index_put_((g_of, t_of), values, accumulate=True)
            else:
                rows = _hidden_mm(grad_p, W, dtype).to(dtype)
                if per_query:
                    grad_h[:, cs] = rows.view(Nq, c, Ld, d_model)
                else:
                    grad_h[cs] = rows.view(c, Ld, d_model)
    return grad_q, grad_h, grad_w, grad_b
