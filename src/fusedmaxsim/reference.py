"""Pure-PyTorch oracles for MaxSim: the ground truth of every test and benchmark.

They materialise the whole ``[Nq, Nd, Lq, Ld]`` similarity grid with ``einsum``, so they are
only for checking. They run on any device, promote fp16 and bf16 to fp32, keep float64 as
float64 (``torch.autograd.gradcheck`` works through them) and support autograd, double
backward included.

They share no code with the fused paths on purpose: a bug in the library's validation or
layout handling cannot hide itself by also being in the oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["decompress_residuals_ref", "maxsim_pairs_ref", "maxsim_ref", "maxsim_residual_ref"]


def _upcast(x: Tensor) -> Tensor:
    return x if x.dtype == torch.float64 else x.float()


def _valid(mask: Tensor | None, like_shape: torch.Size, device: torch.device) -> Tensor:
    if mask is None:
        return torch.ones(like_shape, dtype=torch.bool, device=device)
    return mask != 0


def maxsim_ref(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None = None,
    d_mask: Tensor | None = None,
    *,
    normalize: bool = False,
    reduction: str = "max",
    tau: float = 0.1,
) -> Tensor:
    """MaxSim by the definition, ``score[i, j] = Σ_s max_t ⟨Q[i, s], D[j, t]⟩``.

    Same shapes and semantics as :func:`fusedmaxsim.maxsim`: ``Q [Lq, d]`` or ``[Nq, Lq, d]``;
    ``D [Ld, d]``, ``[Nd, Ld, d]`` (cross product) or ``[Nq, K, Ld, d]`` (per-query
    candidates). Masked doc tokens never win the max, masked query tokens add 0, a query token
    with no valid doc token adds 0. Ties go to the lowest doc-token index (``Tensor.max``).
    ``reduction="smoothmax"``: ``tau · logsumexp_t(s / tau)`` over the valid tokens instead of
    the max (``torch.logsumexp``). Returns float32, or float64 when an input is float64.
    """
    if Q.shape[-1] != D.shape[-1]:
        raise ValueError(f"Q and D must share the embedding dim, got {tuple(Q.shape)} and {tuple(D.shape)}")
    q = _upcast(Q)
    d = _upcast(D)
    if q.dtype != d.dtype:
        q, d = q.double(), d.double()
    if normalize:
        q = F.normalize(q, dim=-1)
        d = F.normalize(d, dim=-1)
    squeeze_q, squeeze_d = q.dim() == 2, d.dim() == 2
    q3 = q.unsqueeze(0) if squeeze_q else q
    q_valid = _valid(q_mask, q3.shape[:2], q.device).reshape(q3.shape[:2])
    if d.dim() == 4:  # per-query candidates [Nq, K, Ld, d]
        d_valid = _valid(d_mask, d.shape[:3], d.device)
        sim = torch.einsum("qsh,qkth->qkst", q3, d)
    else:
        d3 = d.unsqueeze(0) if squeeze_d else d
        d_valid = _valid(d_mask, d3.shape[:2], d.device).reshape(d3.shape[:2])
        sim = torch.einsum("qsh,kth->qkst", q3, d3)
        d_valid = d_valid.unsqueeze(0)
    neg_inf = torch.tensor(float("-inf"), dtype=sim.dtype, device=sim.device)
    sim = torch.where(d_valid.unsqueeze(2), sim, neg_inf)  # [Nq, Nd, Lq, Ld]
    if sim.shape[-1] == 0:
        best = sim.new_full(sim.shape[:-1], float("-inf"))
    elif reduction == "smoothmax":
        best = tau * torch.logsumexp(sim / tau, dim=-1)
    else:
        best = sim.max(dim=-1).values
    best = torch.where(best == float("-inf"), torch.zeros_like(best), best)
    best = torch.where(q_valid.unsqueeze(1), best, torch.zeros_like(best))
    scores = best.sum(dim=-1)
    if squeeze_d:
        scores = scores.squeeze(1)
    if squeeze_q:
        scores = scores.squeeze(0)
    return scores


def maxsim_pairs_ref(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None = None,
    d_mask: Tensor | None = None,
    *,
    normalize: bool = False,
    reduction: str = "max",
    tau: float = 0.1,
) -> Tensor:
    """Diagonal pairs ``score[b] = maxsim(Q[b], D[b])`` for ``Q [B, Lq, d]``, ``D [B, Ld, d]``."""
    return maxsim_ref(
        Q,
        D.unsqueeze(1),
        q_mask,
        None if d_mask is None else d_mask.unsqueeze(1),
        normalize=normalize,
        reduction=reduction,
        tau=tau,
    ).squeeze(1)


def decompress_residuals_ref(codes: Tensor, residuals: Tensor, centroids: Tensor,
                             bucket_weights: Tensor, nbits: int, bit_order: str = "big") -> Tensor:
    """``centroids[codes] + bucket_weights[b]`` per dimension, rounded to the centroids' dtype:
    the residual bytes unpacked into their bit stream (``"big"``: each byte's most significant
    bit first), every ``nbits`` consecutive bits one code, least significant bit first."""
    dim = centroids.shape[1]
    shifts = torch.arange(8, device=residuals.device)
    if bit_order == "big":
        shifts = 7 - shifts
    bits = (residuals.long().unsqueeze(-1) >> shifts) & 1  # [..., packed_dim, 8]
    stream = bits.flatten(-2)[..., : dim * nbits].view(*codes.shape, dim, nbits)
    weights = 2 ** torch.arange(nbits, device=residuals.device)
    buckets = (stream * weights).sum(-1)
    tokens = centroids.double()[codes.long()] + bucket_weights.double()[buckets]
    return tokens.to(centroids.dtype)


def maxsim_residual_ref(Q: Tensor, codes: Tensor, residuals: Tensor, doc_lengths: Tensor,
                        centroids: Tensor, bucket_weights: Tensor, nbits: int, *,
                        normalize: bool = True, q_mask: Tensor | None = None,
                        bit_order: str = "big") -> Tensor:
    """:func:`maxsim_ref` of ``Q`` against the decompressed documents, padding masked by the
    lengths."""
    D = decompress_residuals_ref(codes, residuals, centroids, bucket_weights, nbits, bit_order)
    if Q.dtype == torch.float64 or D.dtype == torch.float64:
        Q, D = Q.double(), D.double()
    d_mask = torch.arange(codes.shape[1], device=codes.device) < doc_lengths[:, None]
    return maxsim_ref(Q, D, q_mask, d_mask, normalize=normalize)


def plaid_approx_score_ref(query_centroid_scores: Tensor, codes: Tensor,
                           doc_lengths: Tensor | None = None, *,
                           cu_seqlens: Tensor | None = None) -> Tensor:
    """PLAID's approximate score by the definition, in float64: ``score[q, b] = Σ_s max_{t <
    len_b} cs[q, codes[b, t], s]``, a max of -inf (an empty document) adding 0; an id outside
    ``[0, n_centroids)`` in a document's tokens makes its scores NaN. ``cs [n_centroids, Lq]``
    or ``[Nq, n_centroids, Lq]``; padded ``codes [B, max_Ld]`` with ``doc_lengths [B]``, or
    packed ``codes [T]`` with ``cu_seqlens [B + 1]``. Returns ``[B]`` or ``[Nq, B]`` float64.
    Document by document, for checking only."""
    cs = query_centroid_scores.double()
    squeeze = cs.dim() == 2
    if squeeze:
        cs = cs.unsqueeze(0)
    Nq, n_centroids, _ = cs.shape
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        docs = [codes[bounds[b]:bounds[b + 1]] for b in range(len(bounds) - 1)]
    else:
        docs = [row[:n] for row, n in zip(codes, doc_lengths.tolist())]
    scores = torch.zeros(Nq, len(docs), dtype=torch.float64, device=cs.device)
    for b, ids in enumerate(docs):
        ids = ids.long().to(cs.device)
        if ids.numel() == 0:
            continue
        if ((ids < 0) | (ids >= n_centroids)).any():
            scores[:, b] = float("nan")
            continue
        best = cs[:, ids, :].max(dim=1).values  # [Nq, Lq]
        scores[:, b] = torch.where(best == float("-inf"), 0.0, best).sum(-1)
    return scores.squeeze(0) if squeeze else scores


__all__ += ["plaid_approx_score_ref"]
