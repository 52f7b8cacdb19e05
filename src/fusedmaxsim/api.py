"""Every scoring front door: argument checks, defaults, and the documented semantics.

Each function checks its arguments (``_problem``), describes the call as a ``Problem``, and hands
it to the one autograd layer (``_autograd``), which plans (``_plan``) and launches (``_launch``).

Semantics shared by every function here
---------------------------------------
* ``score[i, j] = Σ_s max_t ⟨Q[i, s], D[j, t]⟩`` over valid tokens. Scores are float32 (float64
  when an input is float64), accumulated in fp32 whatever the input dtype.
* Masks are bool or any real dtype, nonzero = valid, and receive no gradient. A masked document
  token never wins the max; a masked query token adds 0; a query token whose document has no valid
  token adds 0. A fully masked query or document scores exactly 0 and receives exactly 0 gradient.
  Masked tokens are excluded, not zero-filled: their values (NaN included) never matter.
* Ties in the max: the lowest document-token index wins and alone receives the gradient.
* ``normalize=True`` L2-normalizes every token (``F.normalize``, eps 1e-12) inside the computation
  and backpropagates through the normalization exactly.
* fp16, bf16 and fp32 inputs; fp32 is never computed in half precision. On the GPU fp32 follows
  PyTorch's matmul precision: TF32 tensor cores where ``torch.get_float32_matmul_precision()`` is
  ``"high"`` or ``"medium"``, exact IEEE fp32 under its default ``"highest"``; an explicit
  ``FUSEDMAXSIM_FP32_PRECISION`` (``tf32``, ``tf32x3``, ``ieee``) or
  :func:`fusedmaxsim.settings.use_fp32_precision` wins. float64 runs on
  the PyTorch path (gradcheck).
  Inputs of two different dtypes are promoted to a common one.
* NaN in a valid token propagates to the scores it takes part in.
* Boolean options (``normalize=`` and every other flag) take a Python ``True`` or ``False``;
  anything else (``"yes"``, 1, a NumPy or tensor boolean) is a ``TypeError`` naming the argument.
* Gradients are first order: a second backward through the scores (``create_graph=True``, then
  backward again) raises a ``RuntimeError`` saying so.
* Any strides are accepted, no copies made. Empty batches return empty outputs without a launch;
  ``Lq = 0`` or ``Ld = 0`` score 0.
* Gradients come in the input dtype, and only those that are needed are computed. The argmax is
  saved only when a gradient will be needed (nothing under ``no_grad`` / ``inference_mode``), as
  int16 while ``Ld < 32768`` and int32 beyond.
* ``backward=``: ``"unified"`` (one pass, fp32 atomics for ``grad_D``: the fewest launches; past
  32 MiB its fp32 buffer holds a fifth of ``grad_D`` at a time, column chunk after column chunk),
  ``"lowmem"`` (every gradient row owned by one program: no atomics, bitwise reproducible,
  gradients written directly in the input dtype), ``"auto"`` or ``None``: lowmem for per-query
  candidates, for small problems (``Nq·Nd·Lq·Ld·d <= 2**32``, where the host's time decides), for
  16-bit cross products from ``2**36`` multiply-adds up (bound by the GPU, where lowmem is the
  faster) and under ``torch.use_deterministic_algorithms(True)``, else unified (the rule comes from
  measurements, ``docs/design.md``, Backward strategies). The PyTorch path is always deterministic.
* ``reduction="smoothmax"`` replaces the max over document tokens by the smooth max
  ``tau · log Σ_t exp(s_t / tau)`` over the valid ones (colpali-engine's ``use_smooth_max``;
  ``tau=0.1`` by default). It tends to the max as ``tau → 0`` and to ``max + tau·log(#ties)`` at
  exact ties. Every valid document token receives gradient, weighted by its softmax; the forward
  saves one fp32 log-sum-exp per (query, document, query token) instead of the argmax, and the
  backward recomputes the similarities (deterministic, no atomics; ``backward=`` is ignored).
  Masks behave as for the max. With ``normalize=True`` the tokens are normalized by
  ``F.normalize`` before the call (one extra copy of each).

Packed layout (FlashAttention's ``cu_seqlens`` convention)
----------------------------------------------------------
``Q_packed [ΣLq, d]`` holds the queries' tokens back to back and ``cu_seqlens_q [Nq + 1]`` (int32
or int64, starting at 0, non-decreasing, ending at ``ΣLq``) where each starts: query ``i`` is
``Q_packed[cu_seqlens_q[i]:cu_seqlens_q[i + 1]]``. Documents likewise. Padding is never stored,
read or computed: a 30-token passage costs 30 tokens, whatever the longest one is.

Offsets may live on the CPU or on the tokens' device. ``max_seqlen_q`` / ``max_seqlen_d`` are the
longest lengths; they choose tiles and bound the saved argmax, and no loop runs to them.

* Given for offsets on the GPU, nothing synchronizes with the host: the offsets' values are then
  trusted, and a sequence longer than its promised maximum scores NaN (no out-of-bounds access,
  no dead CUDA context; malformed offsets give wrong numbers, never a crash). ``validate=True``
  checks everything at the cost of one synchronization.
* Omitted, they are read from the offsets: one synchronization, which also checks every value.
* Offsets on the CPU are always checked (it costs nothing), unless ``validate=False``.

A failed check is a ``ValueError`` raised before anything runs on the device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ._autograd import (NormalizeTokens, autocast_off, inverse_norms, scores_dense,
                        scores_packed)
from ._problem import (
    DenseInputs,
    RaggedLayout,
    _check_length_range,
    _check_lengths,
    _check_packed_mask,
    _check_padded,
    _check_tokens,
    _check_validate,
    _length_range_errors,
    _pack_list,
    _sequence_list,
    _to_device,
    build_layout,
    canonical,
    canonical_pairs,
    check_backward,
    check_bool,
    check_reduction,
    dense_problem,
    options_for,
    packed_problem,
    promote_pair,
)

__all__ = [
    "PackedBatch",
    "maxsim",
    "maxsim_padded",
    "maxsim_pairs",
    "maxsim_ragged",
    "maxsim_varlen",
    "pack_padded",
    "score_pairs_packed",
]


def _needs_grad(Q: Tensor, D: Tensor) -> bool:
    return torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad)


@autocast_off
def _score_dense(x: DenseInputs, normalize: bool, strategy: str, tau: float = 0.0) -> Tensor:
    """Scores of checked dense inputs: the problem, its options, then the autograd layer."""
    Q, D = x.Q, x.D
    o = options_for(Q)
    save_argmax = _needs_grad(Q, D)
    if tau and normalize:
        # The smooth max is not scale-invariant per query token, so the inverse norms cannot be
        # applied after the reduction as for the max: normalize first.
        Q, D = NormalizeTokens.apply(Q), NormalizeTokens.apply(D)
        normalize = False
    # Inference on the Triton path: the kernel normalizes the tiles it holds, no pass over Q and
    # D first.
    from_tiles = (normalize and not save_argmax and o.backend == "triton"
                  and not torch.compiler.is_compiling())
    q_inv = d_inv = None
    if normalize and not from_tiles:
        q_inv, d_inv = inverse_norms(Q, o.backend), inverse_norms(D, o.backend)
    p = dense_problem(Q, D, x.q_mask, x.d_mask, normalize=normalize, norm_from_tiles=from_tiles,
                      tau=tau, save_argmax=save_argmax)
    return scores_dense(p, o, strategy, Q, D, x.q_mask, x.d_mask, q_inv, d_inv)


@autocast_off
def _score_packed(layout: RaggedLayout, Q: Tensor, D: Tensor, q_mask, d_mask, normalize: bool,
                  strategy: str) -> Tensor:
    """Scores of ``layout``'s pairs, with autograd when a gradient will be needed."""
    o = options_for(Q)
    q_inv = inverse_norms(Q, o.backend) if normalize else None
    d_inv = inverse_norms(D, o.backend) if normalize else None
    p = packed_problem(layout, Q, q_mask, d_mask, normalize=normalize,
                       save_argmax=_needs_grad(Q, D))
    return scores_packed(p, o, strategy, layout, Q, D, q_mask, d_mask, q_inv, d_inv)


def maxsim(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None = None,
    d_mask: Tensor | None = None,
    *,
    normalize: bool = False,
    backward: str | None = None,
    reduction: str = "max",
    tau: float = 0.1,
) -> Tensor:
    """Late-interaction (MaxSim) scores, fused: the similarity grid is never written to memory.

    Args:
        Q (torch.Tensor): query tokens, shape `[Nq, Lq, d]` or `[Lq, d]`.
        D (torch.Tensor): document tokens: `[Nd, Ld, d]` scores every query against every
            document (output `[Nq, Nd]`); `[Nq, K, Ld, d]` scores each query against its own K
            candidates (distillation, hard negatives; output `[Nq, K]`); `[Ld, d]` is one document.
        q_mask (torch.Tensor, optional): `[Nq, Lq]` (or `[Lq]`), nonzero = valid. Default: all valid.
        d_mask (torch.Tensor, optional): D's token axes (`[Nd, Ld]`, `[Nq, K, Ld]` or `[Ld]`).
        normalize (bool): L2-normalize every token first. Default: ``False``.
        backward (str, optional): ``"auto"`` / ``None``, ``"unified"`` or ``"lowmem"``.
        reduction (str): ``"max"`` (default) or ``"smoothmax"`` (``tau · logsumexp(s / tau)``
            over each query token's document tokens).
        tau (float): the smooth max's temperature, > 0. Default: 0.1. Unused for ``"max"``.

    Returns:
        torch.Tensor: float32 scores; a 2-D Q drops the query axis, a 2-D D the document axis.

    Examples::

        >>> Q = torch.randn(4, 32, 128)
        >>> D = torch.randn(10, 300, 128)
        >>> maxsim(Q, D).shape
        torch.Size([4, 10])
    """
    x = canonical(Q, D, q_mask, d_mask)
    normalize = check_bool("normalize", normalize)
    scores = _score_dense(x, normalize, check_backward(backward), check_reduction(reduction, tau))
    if x.squeeze_d:
        scores = scores.squeeze(1)
    if x.squeeze_q:
        scores = scores.squeeze(0)
    return scores


def maxsim_pairs(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None = None,
    d_mask: Tensor | None = None,
    *,
    normalize: bool = False,
    backward: str | None = None,
    reduction: str = "max",
    tau: float = 0.1,
) -> Tensor:
    """Scores of the diagonal pairs ``(Q[b], D[b])`` only, without the cross product.

    Args:
        Q (torch.Tensor): `[B, Lq, d]`.
        D (torch.Tensor): `[B, Ld, d]`.
        q_mask (torch.Tensor, optional): `[B, Lq]`.
        d_mask (torch.Tensor, optional): `[B, Ld]`.

    Returns:
        torch.Tensor: `[B]` float32 scores. Same semantics and keywords as :func:`maxsim`.
    """
    x = canonical_pairs(Q, D, q_mask, d_mask)
    normalize = check_bool("normalize", normalize)
    return _score_dense(x, normalize, check_backward(backward),
                        check_reduction(reduction, tau)).squeeze(1)


def maxsim_varlen(
    Q_packed: Tensor,
    D_packed: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_d: Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_d: int | None = None,
    *,
    q_mask: Tensor | None = None,
    d_mask: Tensor | None = None,
    normalize: bool = False,
    backward: str | None = None,
    validate: bool | None = None,
) -> Tensor:
    """MaxSim of every packed query against every packed document, ``[Nq, Nd]``, with autograd.

    Each document is read over its own length, so ragged corpora cost their real size, not
    ``Nd × max_seqlen_d``; the saved argmax is ``[Nd, ΣLq]`` int32, with no padding either.

    Args:
        Q_packed (torch.Tensor): query tokens back to back, shape `[ΣLq, d]`.
        D_packed (torch.Tensor): document tokens back to back, shape `[ΣLd, d]`.
        cu_seqlens_q (torch.Tensor): `[Nq + 1]` int32 or int64 offsets into ``Q_packed``.
        cu_seqlens_d (torch.Tensor): `[Nd + 1]` offsets into ``D_packed``.
        max_seqlen_q (int, optional): the longest query. Given (with ``max_seqlen_d``) for offsets
            on the GPU, no host synchronization happens. See the module docstring.
        max_seqlen_d (int, optional): the longest document.
        q_mask (torch.Tensor, optional): `[ΣLq]`, nonzero = valid (e.g. a punctuation skiplist).
        d_mask (torch.Tensor, optional): `[ΣLd]`.
        normalize (bool): L2-normalize every token first. Default: ``False``.
        backward (str, optional): ``"auto"`` / ``None`` (unified, or lowmem under
            ``torch.use_deterministic_algorithms(True)``), ``"unified"`` (fp32 atomics, fastest)
            or ``"lowmem"`` (every gradient row owned by one program: bitwise reproducible).
        validate (bool, optional): ``True`` checks every value (one synchronization);
            ``False`` checks none; ``None`` checks what costs nothing. Default: ``None``.

    Returns:
        torch.Tensor: `[Nq, Nd]` float32 scores; an empty query or document scores 0.

    Examples::

        >>> Q = torch.randn(5 + 7, 128)          # two queries, 5 and 7 tokens
        >>> D = torch.randn(30 + 300 + 120, 128)  # three passages
        >>> maxsim_varlen(Q, D, torch.tensor([0, 5, 12]), torch.tensor([0, 30, 330, 450])).shape
        torch.Size([2, 3])
    """
    Q, D = _check_tokens(Q_packed, D_packed, "Q_packed", "D_packed")
    q_mask = _check_packed_mask("q_mask", q_mask, Q.shape[0], "Q_packed", Q.device)
    d_mask = _check_packed_mask("d_mask", d_mask, D.shape[0], "D_packed", D.device)
    normalize = check_bool("normalize", normalize)
    strategy = check_backward(backward)
    layout = build_layout(
        Q, D, cu_seqlens_q, cu_seqlens_d, max_seqlen_q, max_seqlen_d, validate=validate
    )
    return _score_packed(layout, Q, D, q_mask, d_mask, normalize, strategy)


def score_pairs_packed(
    Q_packed: Tensor,
    D_packed: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_d: Tensor,
    pair_q_idx: Tensor,
    pair_d_idx: Tensor,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_d: int | None = None,
    q_mask: Tensor | None = None,
    d_mask: Tensor | None = None,
    normalize: bool = False,
    backward: str | None = None,
    validate: bool | None = None,
) -> Tensor:
    """MaxSim of listed ``(query, document)`` pairs only, ``[P]``, with autograd.

    For sparse workloads (a reranker's scheduler, hard negatives gathered from a shared pool):
    no ``[Nq, Nd]`` matrix is formed. Pairs may share queries and documents; their gradients add
    up. The saved argmax is ``[P, max_seqlen_q]`` int32.

    Args:
        Q_packed (torch.Tensor): `[ΣLq, d]`.
        D_packed (torch.Tensor): `[ΣLd, d]`.
        cu_seqlens_q (torch.Tensor): `[Nq + 1]` offsets into ``Q_packed``.
        cu_seqlens_d (torch.Tensor): `[Nd + 1]` offsets into ``D_packed``.
        pair_q_idx (torch.Tensor): `[P]` int32 or int64, the query of each pair.
        pair_d_idx (torch.Tensor): `[P]`, the document of each pair. Indices are checked with the
            offsets (module docstring); an unchecked index out of range scores NaN and reads
            nothing.
        max_seqlen_q, max_seqlen_d, q_mask, d_mask, normalize, backward, validate: as in
            :func:`maxsim_varlen`. ``"lowmem"`` sorts the pairs by query and by document once
            per backward, on the device.

    Returns:
        torch.Tensor: `[P]` float32 scores; an empty pair list gives an empty tensor.
    """
    Q, D = _check_tokens(Q_packed, D_packed, "Q_packed", "D_packed")
    q_mask = _check_packed_mask("q_mask", q_mask, Q.shape[0], "Q_packed", Q.device)
    d_mask = _check_packed_mask("d_mask", d_mask, D.shape[0], "D_packed", D.device)
    normalize = check_bool("normalize", normalize)
    strategy = check_backward(backward)
    layout = build_layout(
        Q, D, cu_seqlens_q, cu_seqlens_d, max_seqlen_q, max_seqlen_d, pair_q_idx, pair_d_idx,
        validate=validate,
    )
    return _score_packed(layout, Q, D, q_mask, d_mask, normalize, strategy)


def maxsim_ragged(
    queries: list[Tensor] | Tensor,
    documents: list[Tensor] | Tensor,
    *,
    normalize: bool = False,
    backward: str | None = None,
) -> Tensor:
    """MaxSim of lists of variable-length sequences, ``[Nq, Nd]``, packed without padding.

    The form evaluators hand over (PyLate's, colpali-engine's ``score_multi_vector``): one
    ``[L, d]`` tensor per query and per document. The lengths are known on the host, so nothing
    synchronizes; the tensors are concatenated once (autograd flows back to each of them).

    Args:
        queries (list[torch.Tensor]): `[Lq_i, d]` each (or one `[Nq, Lq, d]` tensor).
        documents (list[torch.Tensor]): `[Ld_j, d]` each (or one `[Nd, Ld, d]` tensor).
        normalize (bool): L2-normalize every token first. Default: ``False``.
        backward (str, optional): as in :func:`maxsim_varlen`.

    Returns:
        torch.Tensor: `[Nq, Nd]` float32 scores.
    """
    qs = _sequence_list("queries", queries)
    ds = _sequence_list("documents", documents)
    normalize = check_bool("normalize", normalize)
    strategy = check_backward(backward)
    everything = qs + ds
    if not everything:
        return torch.zeros((0, 0))
    dim, device = everything[0].shape[1], everything[0].device
    dtype = everything[0].dtype
    for t in everything[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    Q, cu_q, max_q = _pack_list("queries", qs, dim, dtype, device)
    D, cu_d, max_d = _pack_list("documents", ds, dim, dtype, device)
    layout = build_layout(Q, D, cu_q, cu_d, max_q, max_d, validate=False)
    return _score_packed(layout, Q, D, None, None, normalize, strategy)


def maxsim_padded(
    queries: Tensor,
    documents: Tensor,
    query_lengths: Tensor,
    doc_lengths: Tensor,
    *,
    normalize: bool = False,
    backward: str | None = None,
    validate: bool | None = None,
) -> Tensor:
    """Rerank padded candidates given their lengths: ``[B, C]``, with autograd.

    Query ``b`` is ``queries[b, :query_lengths[b]]`` and its candidate ``c`` is
    ``documents[b, c, :doc_lengths[b, c]]``. The lengths become masks of the per-query
    candidate layout of :func:`fusedmaxsim.maxsim`: no packing copy and no host synchronization.

    Args:
        queries (torch.Tensor): `[B, Lq, d]`.
        documents (torch.Tensor): `[B, C, Ld, d]`.
        query_lengths (torch.Tensor): `[B]` integers in `[0, Lq]`.
        doc_lengths (torch.Tensor): `[B, C]` integers in `[0, Ld]`. Lengths on the CPU are checked
            (unless ``validate=False``); on the GPU only with ``validate=True`` (one
            synchronization). An unchecked length outside its range makes its scores NaN.
        normalize, backward: as in :func:`fusedmaxsim.maxsim`.

    Returns:
        torch.Tensor: `[B, C]` float32 scores.
    """
    Q, D = _check_padded(queries, documents)
    B, C, Ld = D.shape[0], D.shape[1], D.shape[2]
    Lq = Q.shape[1]
    check_bool("normalize", normalize)
    check_backward(backward)
    validate = _check_validate(validate)
    qlen = _check_lengths("query_lengths", query_lengths, (B,), Q.device)
    dlen = _check_lengths("doc_lengths", doc_lengths, (B, C), Q.device)
    checked = True
    for name, lengths, extent in (("query_lengths", qlen, Lq), ("doc_lengths", dlen, Ld)):
        if validate is True or (validate is None and lengths.device.type == "cpu"):
            _length_range_errors(name, lengths, extent)
        else:
            checked = False
    qlen, dlen = _to_device(qlen, Q.device), _to_device(dlen, Q.device)
    q_mask = torch.arange(Lq, device=Q.device) < qlen[:, None]
    d_mask = torch.arange(Ld, device=Q.device) < dlen[..., None]
    scores = maxsim(Q, D, q_mask, d_mask, normalize=normalize, backward=backward)
    if not checked:
        broken = ((qlen < 0) | (qlen > Lq))[:, None] | (dlen < 0) | (dlen > Ld)
        scores = torch.where(broken, float("nan"), scores)
    return scores


class PackedBatch(NamedTuple):
    """Padded candidates in the packed layout of :func:`score_pairs_packed` (pair ``b·C + c`` is
    query ``b`` against its candidate ``c``); unpacks as a tuple in this order."""

    Q_packed: Tensor
    cu_seqlens_q: Tensor
    D_packed: Tensor
    cu_seqlens_d: Tensor
    pair_q_idx: Tensor
    pair_d_idx: Tensor
    max_seqlen_q: int
    max_seqlen_d: int


def _offsets_from(lengths: Tensor) -> Tensor:
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.reshape(-1).long(), 0, out=cu[1:])
    return cu


def _int32_if_fits(t: Tensor, bound: int) -> Tensor:
    return t.int() if bound < 2**31 else t


def pack_padded(
    queries: Tensor,
    documents: Tensor,
    query_lengths: Tensor,
    doc_lengths: Tensor,
    *,
    validate: bool | None = None,
) -> PackedBatch:
    """Drop the padding of padded candidates: the :class:`PackedBatch` for
    :func:`score_pairs_packed` (or :func:`maxsim_varlen`), differentiable with respect to
    ``queries`` and ``documents``.

    The packed sizes are data-dependent, so this synchronizes once (reading the totals and
    maxima), and therefore always checks that every length lies in ``[0, extent]``.

    Args:
        queries (torch.Tensor): `[B, Lq, d]`.
        documents (torch.Tensor): `[B, C, Ld, d]`.
        query_lengths (torch.Tensor): `[B]`.
        doc_lengths (torch.Tensor): `[B, C]`.
        validate (bool, optional): accepted for the keyword's sake (``True``, ``False`` or
            ``None``): the lengths are read on the host in any case, so they are always checked.

    Returns:
        PackedBatch: packed tokens, int32 offsets, pair indices ``b`` and ``b·C + c``, and the
        maxima as Python ints.
    """
    Q, D = _check_padded(queries, documents)
    _check_validate(validate)
    B, C, Ld = D.shape[0], D.shape[1], D.shape[2]
    Lq, dim, device = Q.shape[1], Q.shape[2], Q.device
    qlen = _to_device(_check_lengths("query_lengths", query_lengths, (B,), device), device).long()
    dlen = _to_device(_check_lengths("doc_lengths", doc_lengths, (B, C), device), device).long()
    Q, D = promote_pair(Q, D)
    if B == 0:
        zero = torch.zeros(1, dtype=torch.int32, device=device)
        none = torch.zeros(0, dtype=torch.int32, device=device)
        return PackedBatch(
            Q.new_empty((0, dim)), zero, D.new_empty((0, dim)), zero, none, none, 0, 0
        )
    stats = [qlen.min(), qlen.max(), qlen.sum()]
    stats += [dlen.min(), dlen.max(), dlen.sum()] if dlen.numel() else [qlen.new_zeros(())] * 3
    q_low, q_high, total_q, d_low, d_high, total_d = torch.stack(stats).tolist()
    _check_length_range("query_lengths", q_low, q_high, Lq)
    _check_length_range("doc_lengths", d_low, d_high, Ld)
    cu_q, cu_d = _offsets_from(qlen), _offsets_from(dlen)

    def rows(lengths: Tensor, cu: Tensor, total: int) -> tuple[Tensor, Tensor]:
        seq = torch.repeat_interleave(
            torch.arange(lengths.numel(), device=device), lengths.reshape(-1), output_size=total
        )
        return seq, torch.arange(total, device=device) - cu[seq]

    q_seq, q_tok = rows(qlen, cu_q, total_q)
    d_seq, d_tok = rows(dlen, cu_d, total_d)
    pair_q = torch.arange(B, device=device, dtype=torch.int32).repeat_interleave(C)
    pair_d = torch.arange(B * C, device=device, dtype=torch.int32)
    return PackedBatch(
        Q_packed=Q[q_seq, q_tok],
        cu_seqlens_q=_int32_if_fits(cu_q, total_q),
        D_packed=D[d_seq // C, d_seq % C, d_tok],
        cu_seqlens_d=_int32_if_fits(cu_d, total_d),
        pair_q_idx=pair_q,
        pair_d_idx=pair_d,
        max_seqlen_q=q_high,
        max_seqlen_d=d_high if dlen.numel() else 0,
    )
