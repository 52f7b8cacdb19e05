"""PLAID (ColBERTv2) indexes scored in place: MaxSim against compressed documents, and search.

A PLAID index stores each document token as the id of its nearest centroid and, per dimension,
an ``nbits``-bit code of the residual bucket; the token is ``centroids[code] + bucket_weights[b]``
per dimension ``b``. :func:`maxsim_residual` (padded documents) and
:func:`maxsim_residual_varlen` (packed, the layout on disk) score queries against such documents
without a decompressed copy of the corpus, with :func:`fusedmaxsim.maxsim`'s rules;
:func:`plaid_approx_score` is PLAID's pruning score from centroid ids alone. :func:`load` opens a
fast-plaid index directory as a :class:`PlaidIndex`, and :func:`plaid_search` runs the PLAID
search on its device (docs/plaid.md).

The residual codes form a bit stream, each code least significant bit first, packed into bytes
most significant bit first (``bit_order="big"``: what ColBERT's and fast-plaid's
``np.packbits`` write, the default) or least significant bit first (``"little"``).

On a GPU the forward is the fused kernel, each document tile decompressed on chip before the
shared MaxSim loop (``kernels.common._residual_tile``); elsewhere, and for the backward
(``grad_Q``) everywhere, the PyTorch path decompresses a block of documents at a time.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._autograd import approx_checked, autocast_off, inverse_norms, scores_residual
from ._plaid_index import PlaidIndex, load, plaid_search
from ._problem import (
    BIT_ORDERS, NBITS, check_approx, check_bool, check_residual, check_residual_varlen,
    options_for, residual_problem,
)
from ._torch_path import decompress_residuals as _decompress

__all__ = ["PlaidIndex", "decompress_residuals", "load", "maxsim_residual",
           "maxsim_residual_varlen", "plaid_approx_score", "plaid_search"]


@autocast_off
def decompress_residuals(codes: Tensor, residuals: Tensor, centroids: Tensor,
                         bucket_weights: Tensor, nbits: int, *, bit_order: str = "big") -> Tensor:
    """The tokens a PLAID index stores, decompressed: ``[*codes.shape, d]`` in the centroids'
    dtype (the sum is taken in fp32, then rounded).

    Args:
        codes (torch.Tensor): centroid ids, any shape, integers in ``[0, n_centroids)``; an id
            outside gives a token of NaN.
        residuals (torch.Tensor): ``[*codes.shape, ceil(d * nbits / 8)]`` uint8.
        centroids (torch.Tensor): ``[n_centroids, d]``.
        bucket_weights (torch.Tensor): ``[2 ** nbits]``.
        nbits (int): 1, 2, 4 or 8.
        bit_order (str): ``"big"`` (default; ColBERT, fast-plaid) or ``"little"``.
    """
    if isinstance(nbits, bool) or nbits not in NBITS:
        raise ValueError(f"nbits must be one of {NBITS}, got {nbits!r}")
    if bit_order not in BIT_ORDERS:
        raise ValueError(f"bit_order must be one of {BIT_ORDERS}, got {bit_order!r}")
    packed_dim = -(-centroids.shape[-1] * nbits // 8)
    if residuals.dtype != torch.uint8 or tuple(residuals.shape) != (*codes.shape, packed_dim):
        raise ValueError(
            f"residuals must be uint8 [*codes.shape, ceil(d * nbits / 8)] = "
            f"{(*codes.shape, packed_dim)}, got {residuals.dtype} {tuple(residuals.shape)}")
    if tuple(bucket_weights.shape) != (1 << nbits,):
        raise ValueError(f"bucket_weights must be [2 ** nbits] = ({1 << nbits},), got "
                         f"{tuple(bucket_weights.shape)}")
    return _decompress(codes, residuals, centroids, bucket_weights, nbits, bit_order)


def maxsim_residual(
    Q: Tensor,
    codes: Tensor,
    residuals: Tensor,
    doc_lengths: Tensor,
    centroids: Tensor,
    bucket_weights: Tensor,
    nbits: int,
    *,
    normalize: bool = True,
    q_mask: Tensor | None = None,
    bit_order: str = "big",
    validate: bool | None = None,
) -> Tensor:
    """MaxSim of queries against the documents of a PLAID index, scored in place: ``[Nq, Nd]``.

    Document ``j``'s tokens are ``decompress_residuals(codes[j, :doc_lengths[j]], ...)``; the
    scores are :func:`fusedmaxsim.maxsim`'s on those tokens, with its rules: fp32 similarities
    and scores (float64 where ``Q`` or the centroids are float64), a masked query token or an
    empty document adds 0, the lowest token wins a tie. Autograd reaches ``Q`` only (the index
    is frozen).

    Args:
        Q (torch.Tensor): `[Nq, Lq, d]` or `[Lq, d]` (the query axis dropped from the output).
        codes (torch.Tensor): `[Nd, Ld]` centroid ids (padded documents; padding is ignored).
        residuals (torch.Tensor): `[Nd, Ld, ceil(d * nbits / 8)]` uint8.
        doc_lengths (torch.Tensor): `[Nd]` integers in `[0, Ld]`.
        centroids (torch.Tensor): `[n_centroids, d]`.
        bucket_weights (torch.Tensor): `[2 ** nbits]`.
        nbits (int): 1, 2, 4 or 8.
        normalize (bool): L2-normalize the queries and the decompressed tokens (ColBERT's
            rule; default ``True``), exactly as :func:`fusedmaxsim.maxsim`'s ``normalize``.
        q_mask (torch.Tensor, optional): `[Nq, Lq]`, nonzero = valid.
        bit_order (str): ``"big"`` (default; ColBERT, fast-plaid) or ``"little"``.
        validate (bool, optional): check that the lengths lie in `[0, Ld]` and the ids in
            `[0, n_centroids)`. ``None`` (default) checks tensors on the CPU and nothing on a GPU
            (no synchronization); ``True`` always checks (one synchronization on a GPU). An
            unchecked length or id out of range makes that document's scores NaN, never a read
            out of bounds.
    """
    Q, q_mask, docs, squeeze_q = check_residual(Q, codes, residuals, doc_lengths, centroids,
                                                bucket_weights, nbits, bit_order, q_mask,
                                                validate)
    return _scores(Q, q_mask, docs, squeeze_q, normalize)


@autocast_off
def _scores(Q: Tensor, q_mask: Tensor | None, docs, squeeze_q: bool, normalize: bool) -> Tensor:
    """The residual layout's scores, with autograd to ``Q`` where it requires a gradient."""
    normalize = check_bool("normalize", normalize)
    if torch.promote_types(Q.dtype, docs.centroids.dtype) == torch.float64:
        Q = Q.double()  # float64 similarities where either side is float64
    o = options_for(Q)
    save_argmax = torch.is_grad_enabled() and Q.requires_grad
    q_inv = inverse_norms(Q, o.backend) if normalize else None
    p = residual_problem(docs, Q, q_mask, normalize=normalize, save_argmax=save_argmax)
    scores = scores_residual(p, o, Q, docs, q_mask, q_inv)
    return scores.squeeze(0) if squeeze_q else scores


def maxsim_residual_varlen(
    Q: Tensor,
    codes: Tensor,
    residuals: Tensor,
    cu_seqlens_d: Tensor,
    centroids: Tensor,
    bucket_weights: Tensor,
    nbits: int,
    *,
    normalize: bool = True,
    q_mask: Tensor | None = None,
    bit_order: str = "big",
    max_seqlen_d: int | None = None,
    validate: bool | None = None,
) -> Tensor:
    """:func:`maxsim_residual` on packed documents, the layout of an index on disk: ``[Nq, Nd]``.

    Document ``j`` is rows ``[cu_seqlens_d[j], cu_seqlens_d[j + 1])`` of ``codes`` and
    ``residuals`` (rows past ``cu_seqlens_d[-1]`` are ignored: fast-plaid pads its merged files).
    Rules, precision and autograd (to ``Q``) as :func:`maxsim_residual`'s; one compiled kernel
    serves every document length.

    Args:
        Q (torch.Tensor): `[Nq, Lq, d]` or `[Lq, d]`.
        codes (torch.Tensor): `[T]` centroid ids.
        residuals (torch.Tensor): `[T, ceil(d * nbits / 8)]` uint8.
        cu_seqlens_d (torch.Tensor): `[Nd + 1]` offsets: 0, non-decreasing, at most `T`.
        centroids, bucket_weights, nbits, normalize, q_mask, bit_order: as
            :func:`maxsim_residual`'s.
        max_seqlen_d (int, optional): a bound on the documents' lengths. The forward on a GPU
            never needs it (the kernel reads each document's own length and compiles once for
            all); the backward does (without it, it is read from the offsets: one
            synchronization), and on other devices it saves reading the offsets.
        validate (bool, optional): check the offsets (and ``max_seqlen_d``) and the ids, as
            :func:`maxsim_residual`'s ``validate``. An unchecked document out of range scores NaN,
            never a read out of bounds.
    """
    need_grad = torch.is_grad_enabled() and isinstance(Q, Tensor) and Q.requires_grad
    Q, q_mask, docs, squeeze_q = check_residual_varlen(
        Q, codes, residuals, cu_seqlens_d, centroids, bucket_weights, nbits, bit_order, q_mask,
        max_seqlen_d, validate, need_grad)
    return _scores(Q, q_mask, docs, squeeze_q, normalize)


# ------------------------------------------------------------------------------------------------
# The approximate (IVF pruning) score
# ------------------------------------------------------------------------------------------------


@autocast_off
def plaid_approx_score(
    query_centroid_scores: Tensor,
    codes: Tensor,
    doc_lengths: Tensor | None = None,
    *,
    cu_seqlens: Tensor | None = None,
    validate: bool | None = None,
) -> Tensor:
    """PLAID's approximate score (the IVF pruning step): MaxSim against documents known only by
    their tokens' centroid ids, from the queries' scores against every centroid.

    ``score[q, b] = Σ_s max_{t < len_b} cs[q, codes[b, t], s]`` for ``cs =
    query_centroid_scores`` (usually ``centroids @ Q[q]ᵀ``, per query). The max is taken over the
    stored values (exact), the sum in fp32 (float64 for float64 ``cs``). A query token whose max
    is ``-inf`` adds 0, so an empty document scores 0. Query tokens that should not count are
    the caller's to drop: zero their columns of ``cs`` (they then add 0). Not differentiable: the
    scores carry no gradient.

    Args:
        query_centroid_scores (torch.Tensor): ``[n_centroids, Lq]`` (one query; the query axis
            dropped from the output) or ``[Nq, n_centroids, Lq]``; fp16, bf16, fp32 or fp64, any
            strides.
        codes (torch.Tensor): centroid ids, integers in ``[0, n_centroids)``: padded ``[B,
            max_Ld]`` (with ``doc_lengths``; ids past a document's length are ignored) or packed
            ``[T]`` (with ``cu_seqlens``).
        doc_lengths (torch.Tensor, optional): ``[B]`` integers in ``[0, max_Ld]`` (padded codes).
        cu_seqlens (torch.Tensor, optional): ``[B + 1]`` int32 or int64 offsets (packed codes):
            document ``b`` is ``codes[cu_seqlens[b] : cu_seqlens[b + 1]]``; they start at 0, do
            not decrease and end within ``T`` (ids past the end belong to no document).
        validate (bool, optional): check the lengths or offsets and every document token's id.
            ``None`` (default) checks index tensors on the CPU and nothing on a GPU (no
            synchronization); ``True`` always checks (one synchronization on a GPU). Unchecked,
            a document with a length, offset or id out of range scores NaN, never a read out of
            bounds.

    Returns:
        ``[B]`` (one query) or ``[Nq, B]`` fp32 scores (float64 for float64 ``cs``).
    """
    cs, docs, squeeze_q = check_approx(query_centroid_scores, codes, doc_lengths, cu_seqlens,
                                       validate)
    scores = approx_checked(cs, docs.codes, docs.starts, docs.lengths,
                            padded_len=docs.padded_len)
    return scores.squeeze(0) if squeeze_q else scores

