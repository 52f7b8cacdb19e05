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

import math

import torch
from torch import Tensor

from ._configs import argmax_dtype

__all__ = ["maxsim_bwd_blocked", "maxsim_fwd_blocked", "plan_blocks", "smooth_bwd_blocked"]

_LOG2E = math.log2(math.e)


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def plan_blocks(
    Nq: int, Ncols: int, Lq: int, Ld: int, dim: int, per_query_docs: bool, budget_elems: int
) -> tuple[int, int, int]:
    """Queries, columns and query tokens per block so that the block's temporaries fit the budget.

    The temporaries are the similarity block ``bq·bc·ls·Ld`` plus the document block copied to the
    compute dtype (``bc·Ld·d``, or ``bq·bc·Ld·d`` for per-query candidates).
    """
    budget = max(1, budget_elems)
    doc = Ld * dim
    rows = Lq
    if Lq * Ld + doc > budget:
        rows = max(1, (budget - doc) // max(Ld, 1))
        return 1, 1, min(rows, Lq)
    per_pair = Lq * Ld + doc
    bc = max(1, min(Ncols, budget // per_pair))
    if per_query_docs:
        bq = max(1, min(Nq, budget // (bc * per_pair)))
    else:
        bq = max(1, min(Nq, (budget - bc * doc) // max(bc * Lq * Ld, 1)))
    return bq, bc, rows


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


def maxsim_fwd_blocked(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None,
    d_mask: Tensor | None,
    q_inv: Tensor | None,
    d_inv: Tensor | None,
    save_argmax: bool,
    block_bytes: int,
    tau: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Scores and argmax; with ``tau > 0`` the smooth max and, in place of the argmax, each row's
    log2-sum-exp2 of ``s · log2(e) / tau`` (``+inf`` where the row adds nothing), as on the
    Triton path."""
    per_query_docs = D.dim() == 4
    Nq, Lq, dim = Q.shape
    Ncols, Ld = D.shape[-3], D.shape[-2]
    ct = _compute_dtype(Q)
    scores = torch.zeros((Nq, Ncols), dtype=ct, device=Q.device)
    saved_shape = (Nq, Ncols, Lq) if save_argmax else (0,)
    if tau:
        argmax = torch.full(saved_shape, float("inf"), dtype=ct, device=Q.device)
    else:
        argmax = torch.full(saved_shape, -1, dtype=argmax_dtype(Ld), device=Q.device)
    if scores.numel() == 0 or Lq == 0 or Ld == 0:
        return scores if ct == torch.float64 else scores.float(), argmax

    bq, bc, ls = plan_blocks(Nq, Ncols, Lq, Ld, dim, per_query_docs, block_bytes // scores.element_size())
    for i0 in range(0, Nq, bq):
        qs = slice(i0, min(Nq, i0 + bq))
        for j0 in range(0, Ncols, bc):
            cs = slice(j0, min(Ncols, j0 + bc))
            d_blk = _doc_block(D, qs, cs, per_query_docs, ct)  # [bc, Ld, d] or [bq, bc, Ld, d]
            d_valid = _doc_side(d_mask, qs, cs, per_query_docs)
            d_scale = _doc_side(d_inv, qs, cs, per_query_docs)
            for s0 in range(0, Lq, ls):
                ss = slice(s0, min(Lq, s0 + ls))
                q_blk = Q[qs, ss].to(ct)  # [bq, ls, d]
                nq, nl = q_blk.shape[:2]
                nc = d_blk.shape[-3]
                if per_query_docs:
                    sim = torch.bmm(q_blk, d_blk.reshape(nq, nc * Ld, dim).transpose(1, 2))
                else:
                    sim = q_blk.reshape(nq * nl, dim) @ d_blk.reshape(nc * Ld, dim).T
                sim = sim.view(nq, nl, nc, Ld)
                if d_scale is not None:
                    sim.mul_(d_scale)
                if d_valid is not None:
                    sim.masked_fill_(~d_valid, float("-inf"))
                if tau:
                    lse2 = torch.logsumexp(sim / tau, dim=-1) * _LOG2E  # [bq, ls, bc]
                    best, arg = lse2 * (tau / _LOG2E), lse2
                elif save_argmax:
                    best, arg = sim.max(dim=-1)  # [bq, ls, bc]; NaN propagates; lowest index wins
                else:
                    # No indices to find: on a CPU `amax` takes a third of the time of `max`'s
                    # value-and-index pass (benchmarks/NOTES.md section 28). NaN propagates alike.
                    best = sim.amax(dim=-1)
                del sim
                none = best == float("-inf")
                contrib = torch.where(none, torch.zeros_like(best), best)
                if q_inv is not None:
                    contrib = contrib * q_inv[qs, ss].to(ct).unsqueeze(-1)
                if q_mask is not None:
                    q_valid = q_mask[qs, ss].unsqueeze(-1)
                    contrib = torch.where(q_valid, contrib, torch.zeros_like(contrib))
                    none = none | ~q_valid
                scores[qs, cs] += contrib.sum(dim=1)
                if save_argmax:
                    arg = torch.where(none, torch.full_like(arg, float("inf") if tau else -1), arg)
                    argmax[qs, cs, ss] = arg.permute(0, 2, 1).to(argmax.dtype)
    return scores if ct == torch.float64 else scores.float(), argmax


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
