"""The public functions: argument checks, defaults, and the documented semantics.

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
* fp16, bf16 and fp32 inputs; fp32 is never computed in half precision. On the GPU fp32 uses TF32
  tensor cores by default and exact IEEE fp32 under ``FUSEDMAXSIM_FP32_PRECISION=ieee`` or
  :func:`fusedmaxsim.settings.use_fp32_precision`. float64 runs on the PyTorch path (gradcheck).
  Inputs of two different dtypes are promoted to a common one.
* NaN in a valid token propagates to the scores it takes part in.
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
  measurements, ``benchmarks/NOTES.md``). The PyTorch path is always deterministic.
* ``reduction="smoothmax"`` replaces the max over document tokens by the smooth max
  ``tau · log Σ_t exp(s_t / tau)`` over the valid ones (colpali-engine's ``use_smooth_max``;
  ``tau=0.1`` by default). It tends to the max as ``tau → 0`` and to ``max + tau·log(#ties)`` at
  exact ties. Every valid document token receives gradient, weighted by its softmax; the forward
  saves one fp32 log-sum-exp per (query, document, query token) instead of the argmax, and the
  backward recomputes the similarities (deterministic, no atomics; ``backward=`` is ignored).
  Masks behave as for the max. With ``normalize=True`` the tokens are normalized by
  ``F.normalize`` before the call (one extra copy of each).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _ops, settings
from ._validate import (
    Problem,
    canonical,
    canonical_pairs,
    check_backward,
    check_reduction,
    select_backend,
    triton_available,
)

__all__ = ["maxsim", "maxsim_pairs"]


_FAST_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _plain_inference_applies(Q: object, D: object) -> bool:
    """Whether ``maxsim(Q, D)`` (no masks, the max, the default backward) is an inference cross
    product of CUDA tensors that :func:`_plain_inference` may launch straight away: these
    conditions imply that every check of ``canonical`` passes and that ``_run`` would make that
    same launch. (CUDA last: on a CPU this measures what the checks cost, benchmarks/
    host_python.py.)"""
    return (
        isinstance(Q, Tensor) and isinstance(D, Tensor)
        and Q.dim() == 3 and D.dim() == 3 and Q.dtype is D.dtype and Q.dtype in _FAST_DTYPES
        and Q.shape[2] == D.shape[2]
        and not (torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad))
        and settings.backend() != "torch" and not torch.compiler.is_compiling()
        and triton_available() and Q.is_cuda and D.is_cuda and Q.get_device() == D.get_device()
    )


def _plain_inference(Q: Tensor, D: Tensor, normalize: bool) -> Tensor:
    """The scores of the most common call, straight from the launcher: the layers between cost
    a small call about as much host time as its kernel takes (benchmarks/NOTES.md section 39)."""
    return _ops._launch().maxsim_fwd(
        Q, D, None, None, None, None, False, settings.fp32_precision(), bool(normalize))[0]


def _run(p: Problem, normalize: bool, strategy: str, tau: float = 0.0) -> Tensor:
    Q, D = p.Q, p.D
    backend = select_backend(Q)
    save_argmax = torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad)
    eager = not torch.compiler.is_compiling()
    if tau and normalize:
        # The smooth max is not scale-invariant per query token, so the inverse norms cannot be
        # applied after the reduction as for the max: normalize first.
        Q, D = _ops.NormalizeTokens.apply(Q), _ops.NormalizeTokens.apply(D)
        normalize = False
    if normalize and not save_argmax and eager and backend == "triton":
        # Inference: the kernel normalizes the tiles it holds; no pass over Q and D first.
        return _ops.maxsim_fwd_normalized(Q, D, p.q_mask, p.d_mask, settings.fp32_precision())
    q_inv = _ops.inverse_norms(Q, backend) if normalize else None
    d_inv = _ops.inverse_norms(D, backend) if normalize else None
    args = (Q, D, p.q_mask, p.d_mask, q_inv, d_inv, save_argmax, backend,
            settings.fp32_precision(), strategy, tau)
    if not save_argmax and eager:
        return _ops.maxsim_fwd_impl(*args)[0]  # inference: no autograd node, no dispatcher
    return _ops.maxsim_scores(*args)


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
    if (q_mask is None and d_mask is None and backward is None and reduction == "max"
            and _plain_inference_applies(Q, D)):
        return _plain_inference(Q, D, normalize)
    p = canonical(Q, D, q_mask, d_mask)
    scores = _run(p, normalize, check_backward(backward), check_reduction(reduction, tau))
    if p.squeeze_d:
        scores = scores.squeeze(1)
    if p.squeeze_q:
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
    p = canonical_pairs(Q, D, q_mask, d_mask)
    return _run(p, normalize, check_backward(backward), check_reduction(reduction, tau)).squeeze(1)
