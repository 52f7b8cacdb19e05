"""Autograd for every layout: registered ``torch.library`` ops and an eager fast path.

Op pairs, each with fake (meta) implementations, so that every front door traces under
``torch.compile(fullgraph=True)`` and passes ``torch.library.opcheck``:

* ``fusedmaxsim::maxsim_fwd`` / ``maxsim_bwd``: the dense layouts (cross product, per-query
  candidates, diagonal pairs);
* ``fusedmaxsim::maxsim_packed_fwd`` / ``maxsim_packed_bwd``: the packed layouts (packed cross
  product over a range of documents, pair lists), the ``RaggedLayout`` passed as its tensors and
  integers;
* ``fusedmaxsim::maxsim_residual_fwd`` / ``maxsim_residual_bwd``: PLAID documents (``grad_Q``
  only), the ``ResidualDocs`` passed as its tensors and values; and ``fusedmaxsim::plaid_approx``
  (no gradient), PLAID's approximate score.

The forward returns the scores and, when a gradient will be needed, what the backward reads (the
argmax, or under the smooth max each row's log-sum-exp); the backward turns it into gradients.
Eager calls skip the dispatcher through :class:`MaxSimFunction`, which runs the same code: one
``run_forward`` / ``run_backward`` that asks the planner (``_plan``) and hands its plan to a
launcher (``_launch``) or to the PyTorch path (``_torch_path``).

With ``normalize``, the inverse norms enter as inputs (detached); the kernels produce gradients
with respect to the normalized tokens and this module applies the normalization's Jacobian, so the
result equals ``F.normalize`` followed by MaxSim.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from . import _torch_path
from ._torch_path import NORM_EPS, normalize_backward
from ._plan import argmax_dtype, plan_backward, plan_forward, plan_hidden_backward
from ._problem import (
    RESIDUAL_LAYOUTS, Options, Problem, RaggedLayout, ResidualDocs, dense_problem, hidden_problem,
    options_for, packed_problem, promote_pair, residual_problem,
)

__all__ = ["DOUBLE_BACKWARD_MESSAGE", "NORM_EPS", "NormalizeTokens", "inverse_norms",
           "run_backward", "run_forward", "scores_dense", "scores_hidden", "scores_packed",
           "scores_residual"]


_launchers: tuple | None = None

# The device types whose autocast a call turns off (the backends' devices), and one check of
# every type for the common case, autocast off (PyTorch's private _is_any_autocast_enabled;
# where a release lacks it, each type is checked).
_AUTOCAST_KINDS = tuple(k for k in ("cuda", "cpu", "mps") if torch.amp.is_autocast_available(k))
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: any(torch.is_autocast_enabled(k) for k in _AUTOCAST_KINDS))


def autocast_off(fn):
    """``fn`` with ``torch.autocast`` off wherever the caller turned it on: every product, sum and
    norm of a call runs in its inputs' dtypes, so the scores and gradients are the same under
    autocast as without it, whichever backend and route the plan takes (autocast does not cast
    the inputs either: README "Semantics"). For the front doors' hubs and the backwards."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if _any_autocast():
            for kind in _AUTOCAST_KINDS:
                if torch.is_autocast_enabled(kind):
                    with torch.autocast(kind, enabled=False):
                        return run(*args, **kwargs)  # and so on for the next kind turned on
        return fn(*args, **kwargs)

    return run


def _launch():
    """The Triton launchers ``(forward, backward)``, imported on first use (the PyTorch path never
    imports Triton) and kept: an import statement on every call costs the host time."""
    global _launchers
    if _launchers is None:
        from ._launch import backward, forward

        _launchers = forward, backward
    return _launchers


# ------------------------------------------------------------------------------------------------
# One forward and one backward for every layout: plan, then launch
# ------------------------------------------------------------------------------------------------


def run_forward(p: Problem, o: Options, Q, D, q_mask, d_mask, q_inv, d_inv,
                layout: RaggedLayout | ResidualDocs | None = None) -> tuple[Tensor, Tensor]:
    """Scores and what the backward reads (a shared empty tensor when ``p.save_argmax`` is off).
    ``layout``: the packed layouts' :class:`RaggedLayout`, or the residual layouts' documents
    (then ``D`` is unused; the queries are normalized where ``q_inv`` is given, the documents'
    tokens where ``p.normalize``)."""
    plan = plan_forward(p, o)
    if p.layout in RESIDUAL_LAYOUTS:
        if plan.kernel == "torch":
            return _torch_path.residual_fwd_torch(plan.blocks, plan.doc_major, Q, layout, q_mask,
                                                  q_inv, p.normalize, p.save_argmax)
        return _launch()[0].forward_residual(plan, p, o.fp32_precision, Q, layout, q_mask,
                                             q_inv is not None)
    if plan.kernel == "torch":
        if layout is not None:
            return _torch_path.packed_fwd_torch(layout, Q, D, q_mask, d_mask, q_inv, d_inv,
                                                p.save_argmax, o.torch_block_bytes)
        return _torch_path.maxsim_fwd_blocked(Q, D, q_mask, d_mask, q_inv, d_inv, p.save_argmax,
                                              plan.blocks, p.tau, plan.doc_major,
                                              plan.bf16_product)
    forward = _launch()[0]
    if layout is not None:
        return forward.forward_packed(plan, p, o.fp32_precision, layout, Q, D, q_mask, d_mask,
                                      q_inv, d_inv)
    return forward.forward_dense(plan, p, o.fp32_precision, Q, D, q_mask, d_mask, q_inv, d_inv)


def run_backward(p: Problem, o: Options, strategy: str, grad: Tensor, Q, D, saved, q_inv, d_inv,
                 d_mask, need_q: bool, need_d: bool,
                 layout: RaggedLayout | None = None) -> tuple[Tensor, Tensor]:
    """``(grad_Q, grad_D)`` with respect to the (normalized) tokens; an unneeded one is an empty
    tensor. ``d_mask`` is read only by the smooth max, whose backward recomputes the
    similarities."""
    if p.layout in RESIDUAL_LAYOUTS:  # the index is frozen: grad_Q only
        return _torch_path.residual_bwd_torch(plan_forward(p, o).blocks, grad, Q, layout, saved,
                                              q_inv, p.normalize, p.normalize,
                                              o.torch_block_bytes)
    if layout is not None and (layout.col_lo or layout.col_hi is not None):
        raise ValueError(
            "fusedmaxsim: the packed backward covers every document of the layout; a column "
            f"range (col_lo={layout.col_lo}, col_hi={layout.col_hi}) is scored for inference only")
    plan = plan_backward(p, o, need_q, need_d, strategy)
    fp32_out = p.normalize
    if plan.kernel == "torch":
        block = o.torch_block_bytes
        if layout is not None:
            return _torch_path.packed_bwd_torch(layout, grad, Q, D, saved, q_inv, d_inv, need_q,
                                                need_d, fp32_out, block)
        if p.tau:
            return _torch_path.smooth_bwd_blocked(grad, Q, D, d_mask, saved, p.tau, need_q,
                                                  need_d, fp32_out, block)
        return _torch_path.maxsim_bwd_blocked(grad, Q, D, saved, q_inv, d_inv, need_q, need_d,
                                              fp32_out, block)
    backward = _launch()[1]
    if layout is not None:
        return backward.backward_packed(plan, o.fp32_precision, layout, grad, Q, D, saved, q_inv,
                                        d_inv, need_q, need_d, fp32_out)
    if plan.kernel == "smooth":
        return backward.backward_smooth(plan, o.fp32_precision, grad, Q, D, d_mask, saved, p.tau,
                                        need_q, need_d, fp32_out)
    return backward.backward_dense(plan, o.fp32_precision, grad, Q, D, saved, q_inv, d_inv,
                                   need_q, need_d, fp32_out)


# ------------------------------------------------------------------------------------------------
# Normalization
# ------------------------------------------------------------------------------------------------


def inverse_norms(x: Tensor, backend: str) -> Tensor:
    """``1 / max(‖token‖, 1e-12)`` (fp32; float64 for float64), detached, once per token.

    On the Triton path a kernel reads each token once; ``vector_norm(dtype=float32)`` would first
    write an fp32 copy of a 16-bit input.
    """
    if backend == "triton" and not torch.compiler.is_compiling():
        # (Under torch.compile the PyTorch expression below, which the compiler traces.)
        return _launch()[0].inverse_norms(x.detach(), NORM_EPS)
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    norm = torch.linalg.vector_norm(x.detach(), dim=-1, dtype=dtype)
    return 1.0 / norm.clamp_min(NORM_EPS)


class NormalizeTokens(torch.autograd.Function):
    """``F.normalize(x, dim=-1)`` whose backward is :func:`normalize_backward`: a token that
    receives no gradient gets exactly 0, so a masked token's values (NaN included) never leak."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.nn.functional.normalize(x, dim=-1, eps=NORM_EPS)

    @staticmethod
    @autocast_off
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        return normalize_backward(x, grad.to(compute))


# ------------------------------------------------------------------------------------------------
# The dense ops
# ------------------------------------------------------------------------------------------------


def _score_dtype(Q: Tensor) -> torch.dtype:
    return torch.float64 if Q.dtype == torch.float64 else torch.float32


@torch.library.custom_op("fusedmaxsim::maxsim_fwd", mutates_args=())
def maxsim_fwd(
    Q: Tensor, D: Tensor, q_mask: Tensor | None, d_mask: Tensor | None, q_inv: Tensor | None,
    d_inv: Tensor | None, save_argmax: bool, backend: str, fp32_precision: str, strategy: str,
    tau: float,
) -> tuple[Tensor, Tensor]:
    """Scores ``[Nq, Ncols]`` (fp32; fp64 for fp64 inputs) and argmax ``[Nq, Ncols, Lq]`` (or
    empty). ``tau > 0``: the smooth max, and each row's log-sum-exp (fp32) in place of the argmax."""
    p = dense_problem(Q, D, q_mask, d_mask, normalize=q_inv is not None, tau=tau,
                      save_argmax=save_argmax)
    scores, saved = run_forward(p, options_for(Q, backend, fp32_precision), Q, D, q_mask, d_mask,
                                q_inv, d_inv)
    # An op's outputs must be its own: the launcher's shared empty placeholder is not.
    return scores, saved if save_argmax else saved.new_empty((0,))


@maxsim_fwd.register_fake
def _(Q, D, q_mask, d_mask, q_inv, d_inv, save_argmax, backend, fp32_precision, strategy, tau):
    Nq, Lq = Q.shape[0], Q.shape[1]
    scores = Q.new_empty((Nq, D.shape[-3]), dtype=_score_dtype(Q))
    saved_dtype = argmax_dtype(D.shape[-2])
    if tau:  # float64 always runs on the PyTorch path, which keeps float64 rows
        saved_dtype = _score_dtype(Q)
    return scores, Q.new_empty((Nq, D.shape[-3], Lq) if save_argmax else (0,), dtype=saved_dtype)


@torch.library.custom_op("fusedmaxsim::maxsim_bwd", mutates_args=())
def maxsim_bwd(
    grad_scores: Tensor, Q: Tensor, D: Tensor, argmax: Tensor, q_inv: Tensor | None,
    d_inv: Tensor | None, d_mask: Tensor | None, need_grad_q: bool, need_grad_d: bool,
    strategy: str, backend: str, fp32_precision: str, tau: float,
) -> tuple[Tensor, Tensor]:
    """``(grad_Q, grad_D)``; an unneeded one is an empty tensor."""
    p = dense_problem(Q, D, None, d_mask, normalize=q_inv is not None, tau=tau, save_argmax=True)
    return run_backward(p, options_for(Q, backend, fp32_precision), strategy, grad_scores, Q, D,
                        argmax, q_inv, d_inv, d_mask, need_grad_q, need_grad_d)


def _grad_like(x: Tensor, needed: bool, fp32_out: bool) -> Tensor:
    if not needed:
        return x.new_empty((0,))
    keep = fp32_out and x.dtype != torch.float64
    return x.new_empty(x.shape, dtype=torch.float32 if keep else x.dtype)


@maxsim_bwd.register_fake
def _(grad_scores, Q, D, argmax, q_inv, d_inv, d_mask, need_grad_q, need_grad_d, strategy,
      backend, fp32_precision, tau):
    fp32_out = q_inv is not None
    return _grad_like(Q, need_grad_q, fp32_out), _grad_like(D, need_grad_d, fp32_out)


# ------------------------------------------------------------------------------------------------
# The packed ops
# ------------------------------------------------------------------------------------------------


def _layout(Q, D, cu_q, cu_d, pair_q, pair_d, max_q, max_d, col_lo, col_hi) -> RaggedLayout:
    return RaggedLayout(cu_q, cu_d, Q.shape[0], D.shape[0], max_q, max_d, pair_q, pair_d,
                        col_lo, None if col_hi < 0 else col_hi)


@torch.library.custom_op("fusedmaxsim::maxsim_packed_fwd", mutates_args=())
def maxsim_packed_fwd(
    Q: Tensor, D: Tensor, cu_q: Tensor, cu_d: Tensor, pair_q: Tensor | None,
    pair_d: Tensor | None, q_mask: Tensor | None, d_mask: Tensor | None, q_inv: Tensor | None,
    d_inv: Tensor | None, max_q: int, max_d: int, col_lo: int, col_hi: int, save_argmax: bool,
    backend: str, fp32_precision: str, strategy: str,
) -> tuple[Tensor, Tensor]:
    """Scores of a packed layout (``[Nq, n_cols]``, or ``[P]`` for a pair list; ``col_hi < 0``:
    up to the last document) and, when saved, the int32 argmax (``[n_cols, ΣLq]`` or
    ``[P, max_q]``)."""
    layout = _layout(Q, D, cu_q, cu_d, pair_q, pair_d, max_q, max_d, col_lo, col_hi)
    p = packed_problem(layout, Q, q_mask, d_mask, normalize=q_inv is not None,
                       save_argmax=save_argmax)
    scores, saved = run_forward(p, options_for(Q, backend, fp32_precision), Q, D, q_mask, d_mask,
                                q_inv, d_inv, layout)
    return scores, saved if save_argmax else saved.new_empty((0,))


@maxsim_packed_fwd.register_fake
def _(Q, D, cu_q, cu_d, pair_q, pair_d, q_mask, d_mask, q_inv, d_inv, max_q, max_d, col_lo,
      col_hi, save_argmax, backend, fp32_precision, strategy):
    if pair_q is not None:
        out, saved = (pair_q.shape[0],), (pair_q.shape[0], max_q)
    else:
        n_cols = (cu_d.shape[0] - 1 if col_hi < 0 else col_hi) - col_lo
        out, saved = (cu_q.shape[0] - 1, n_cols), (n_cols, Q.shape[0])
    return (Q.new_empty(out, dtype=_score_dtype(Q)),
            Q.new_empty(saved if save_argmax else (0,), dtype=torch.int32))


@torch.library.custom_op("fusedmaxsim::maxsim_packed_bwd", mutates_args=())
def maxsim_packed_bwd(
    grad_scores: Tensor, Q: Tensor, D: Tensor, argmax: Tensor, cu_q: Tensor, cu_d: Tensor,
    pair_q: Tensor | None, pair_d: Tensor | None, q_inv: Tensor | None, d_inv: Tensor | None,
    max_q: int, max_d: int, col_lo: int, col_hi: int, need_grad_q: bool, need_grad_d: bool,
    strategy: str, backend: str, fp32_precision: str,
) -> tuple[Tensor, Tensor]:
    """``(grad_Q, grad_D)`` of a packed layout; an unneeded one is an empty tensor."""
    layout = _layout(Q, D, cu_q, cu_d, pair_q, pair_d, max_q, max_d, col_lo, col_hi)
    p = packed_problem(layout, Q, None, None, normalize=q_inv is not None, save_argmax=True)
    return run_backward(p, options_for(Q, backend, fp32_precision), strategy, grad_scores, Q, D,
                        argmax, q_inv, d_inv, None, need_grad_q, need_grad_d, layout)


@maxsim_packed_bwd.register_fake
def _(grad_scores, Q, D, argmax, cu_q, cu_d, pair_q, pair_d, q_inv, d_inv, max_q, max_d, col_lo,
      col_hi, need_grad_q, need_grad_d, strategy, backend, fp32_precision):
    fp32_out = q_inv is not None
    return _grad_like(Q, need_grad_q, fp32_out), _grad_like(D, need_grad_d, fp32_out)


# ------------------------------------------------------------------------------------------------
# The PLAID ops: residual documents (gradient to Q only) and the approximate score
# ------------------------------------------------------------------------------------------------


def _residual_docs(codes, residuals, starts, lengths, doc_ids, centroids, bucket_weights,
                   max_len, nbits, bit_order) -> ResidualDocs:
    return ResidualDocs(codes, residuals, starts, lengths, None if max_len < 0 else max_len,
                        doc_ids, centroids, bucket_weights, nbits, bit_order, False)


@torch.library.custom_op("fusedmaxsim::maxsim_residual_fwd", mutates_args=())
def maxsim_residual_fwd(
    Q: Tensor, codes: Tensor, residuals: Tensor, starts: Tensor, lengths: Tensor,
    doc_ids: Tensor | None, centroids: Tensor, bucket_weights: Tensor, q_mask: Tensor | None,
    q_inv: Tensor | None, max_len: int, nbits: int, bit_order: str, normalize: bool,
    save_argmax: bool, backend: str, fp32_precision: str,
) -> tuple[Tensor, Tensor]:
    """Scores ``[Nq, Ncols]`` of ``Q`` against PLAID documents (``_problem.ResidualDocs`` as its
    tensors; ``max_len < 0``: unknown) and, when saved, the argmax ``[Nq, Ncols, Lq]``."""
    docs = _residual_docs(codes, residuals, starts, lengths, doc_ids, centroids, bucket_weights,
                          max_len, nbits, bit_order)
    p = residual_problem(docs, Q, q_mask, normalize=normalize, save_argmax=save_argmax)
    scores, saved = run_forward(p, options_for(Q, backend, fp32_precision), Q, None, q_mask,
                                None, q_inv, None, docs)
    return scores, saved if save_argmax else saved.new_empty((0,))


@maxsim_residual_fwd.register_fake
def _(Q, codes, residuals, starts, lengths, doc_ids, centroids, bucket_weights, q_mask, q_inv,
      max_len, nbits, bit_order, normalize, save_argmax, backend, fp32_precision):
    n_cols = starts.shape[0] if doc_ids is None else doc_ids.shape[1]
    dtype = _score_dtype(Q)  # the front door brings Q to float64 with float64 centroids
    saved = argmax_dtype(codes.shape[0] if max_len < 0 else max_len)
    return (Q.new_empty((Q.shape[0], n_cols), dtype=dtype),
            Q.new_empty((Q.shape[0], n_cols, Q.shape[1]) if save_argmax else (0,), dtype=saved))


@torch.library.custom_op("fusedmaxsim::maxsim_residual_bwd", mutates_args=())
def maxsim_residual_bwd(
    grad_scores: Tensor, Q: Tensor, argmax: Tensor, codes: Tensor, residuals: Tensor,
    starts: Tensor, lengths: Tensor, centroids: Tensor, bucket_weights: Tensor,
    q_inv: Tensor | None, max_len: int, nbits: int, bit_order: str, normalize: bool,
    backend: str, fp32_precision: str,
) -> Tensor:
    """``grad_Q`` with respect to the (normalized) queries; the index is frozen."""
    docs = _residual_docs(codes, residuals, starts, lengths, None, centroids, bucket_weights,
                          max_len, nbits, bit_order)
    p = residual_problem(docs, Q, None, normalize=normalize, save_argmax=True)
    return run_backward(p, options_for(Q, backend, fp32_precision), "auto", grad_scores, Q, None,
                        argmax, q_inv, None, None, True, False, docs)[0]


@maxsim_residual_bwd.register_fake
def _(grad_scores, Q, argmax, codes, residuals, starts, lengths, centroids, bucket_weights, q_inv,
      max_len, nbits, bit_order, normalize, backend, fp32_precision):
    return _grad_like(Q, True, normalize)


def _residual_setup_context(ctx, inputs, output) -> None:
    (Q, codes, residuals, starts, lengths, doc_ids, centroids, bucket_weights, q_mask, q_inv,
     max_len, nbits, bit_order, normalize, save_argmax, backend, fp32_precision) = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(Q, output[1], codes, residuals, starts, lengths, centroids,
                          bucket_weights, q_inv)
    ctx.consts = (max_len, nbits, bit_order, normalize, backend, fp32_precision)


@autocast_off
def _residual_backward(ctx, grad_scores: Tensor, _grad_saved):
    Q, argmax, codes, residuals, starts, lengths, centroids, weights, q_inv = ctx.saved_tensors
    max_len, nbits, bit_order, normalize, backend, fp32_precision = ctx.consts
    grad = grad_scores.to(_score_dtype(Q)) if grad_scores.dtype != _score_dtype(Q) else \
        grad_scores
    grad_q = maxsim_residual_bwd(grad, Q, argmax, codes, residuals, starts, lengths, centroids,
                                 weights, q_inv, max_len, nbits, bit_order, normalize, backend,
                                 fp32_precision)
    if q_inv is not None:
        grad_q = normalize_backward(Q, grad_q, q_inv)
    return (grad_q, *(None,) * 16)


torch.library.register_autograd("fusedmaxsim::maxsim_residual_fwd", _residual_backward,
                                setup_context=_residual_setup_context)


# ------------------------------------------------------------------------------------------------
# The fused projection head: documents as hidden states, projected inside
# ------------------------------------------------------------------------------------------------


def _hidden_forward(p: Problem, o: Options, Q: Tensor, H: Tensor, W: Tensor, b: Tensor | None,
                    q_mask, d_mask) -> tuple[Tensor, Tensor]:
    """Scores and the argmax of ``Q`` against ``normalize?(F.linear(H, W, b))`` (``p``: their
    ``hidden_problem``), as planned: fused (each document tile projected on chip) or the
    projection written once, then the dense plan."""
    normalize, save_argmax = p.normalize, p.save_argmax
    plan = plan_forward(p, o)
    if plan.hidden_route == "fused":
        return _launch()[0].forward_hidden(plan, p, o.fp32_precision, Q, H, W, b, q_mask, d_mask)
    Qc, P = promote_pair(Q, torch.nn.functional.linear(H, W, b))
    q_inv = d_inv = None
    if normalize:  # the documents' tokens only: Q comes as given
        d_inv = inverse_norms(P, o.backend)
        q_inv = torch.ones(Q.shape[:2], dtype=d_inv.dtype, device=Q.device)
    pd = dense_problem(Qc, P, q_mask, d_mask, normalize=normalize, save_argmax=save_argmax)
    return run_forward(pd, o, Qc, P, q_mask, d_mask, q_inv, d_inv)


@torch.library.custom_op("fusedmaxsim::maxsim_hidden_fwd", mutates_args=())
def maxsim_hidden_fwd(
    Q: Tensor, H: Tensor, W: Tensor, b: Tensor | None, q_mask: Tensor | None,
    d_mask: Tensor | None, normalize: bool, save_argmax: bool, backend: str, fp32_precision: str,
) -> tuple[Tensor, Tensor]:
    """Scores ``[Nq, Ncols]`` of ``Q`` against the projected hidden states and, when saved, the
    argmax ``[Nq, Ncols, Lq]``."""
    p = hidden_problem(Q, H, W, b, q_mask, d_mask, normalize=normalize, save_argmax=save_argmax)
    scores, saved = _hidden_forward(p, options_for(Q, backend, fp32_precision), Q, H, W, b,
                                    q_mask, d_mask)
    return scores, saved if save_argmax else saved.new_empty((0,))


@maxsim_hidden_fwd.register_fake
def _(Q, H, W, b, q_mask, d_mask, normalize, save_argmax, backend, fp32_precision):
    Nq, Lq, Ncols = Q.shape[0], Q.shape[1], H.shape[-3]
    dtype = torch.float64 if torch.float64 in (Q.dtype, H.dtype) else torch.float32
    return (Q.new_empty((Nq, Ncols), dtype=dtype),
            Q.new_empty((Nq, Ncols, Lq) if save_argmax else (0,), dtype=argmax_dtype(H.shape[-2])))


@torch.library.custom_op("fusedmaxsim::maxsim_hidden_bwd", mutates_args=())
def maxsim_hidden_bwd(
    grad_scores: Tensor, Q: Tensor, H: Tensor, W: Tensor, b: Tensor | None, argmax: Tensor,
    normalize: bool, need_q: bool, need_h: bool, need_w: bool, need_b: bool, backend: str,
    fp32_precision: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(grad_Q, grad_H, grad_W, grad_b)`` in the inputs' dtypes (grad_Q in Q's), from the
    argmax; an unneeded one is an empty tensor."""
    p = hidden_problem(Q, H, W, b, None, None, normalize=normalize, save_argmax=True)
    grads = _hidden_grads(p, options_for(Q, backend, fp32_precision), grad_scores, Q, H, W, b,
                          argmax, (need_q, need_h, need_w, need_b))
    return tuple(Q.new_empty((0,)) if g is None else g for g in grads)


def _hidden_grads(p: Problem, o: Options, grad_scores, Q, H, W, b, argmax, needs):
    """The projection head's gradients as planned (``plan_hidden_backward`` of ``p``, the
    forward's problem: the Triton kernels, by entry or by token tile, or the PyTorch closed
    form), each in its input's dtype; None where not needed."""
    normalize = p.normalize
    plan = plan_hidden_backward(p, o, needs[0], Q.dtype != H.dtype)
    if plan.kernel != "torch":
        return list(_launch()[1].backward_hidden(plan, o.fp32_precision, grad_scores, Q, H, W, b,
                                                 argmax, normalize, needs))
    grads = _torch_path.hidden_bwd_torch(grad_scores, Q, H, W, b, argmax, normalize, *needs,
                                         plan.hidden_cols, plan.hidden_by_entry)
    return [None if g is None else g.to(x.dtype) for g, x in zip(grads, (Q, H, W, b))]


@autocast_off
def _hidden_backward_of(ctx, grad_scores: Tensor, traced: bool) -> list:
    """Both autograd nodes' backward (the registered op's, ``traced``, and ``HiddenFunction``'s):
    the gradients, marked first order under ``create_graph=True``."""
    Q, H, W, b, argmax = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:4])
    needs[3] = needs[3] and b is not None
    if traced:
        grads = maxsim_hidden_bwd(grad_scores, Q, H, W, b, argmax, ctx.normalize, *needs,
                                  ctx.options.backend, ctx.options.fp32_precision)
        grads = [g if need else None for g, need in zip(grads, needs)]
    else:
        with torch.no_grad():
            grads = _hidden_grads(ctx.problem, ctx.options, grad_scores, Q, H, W, b, argmax,
                                  needs)
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # create_graph=True
        grads = [None if g is None else _FirstOrderOnly.apply(g, Q, H, grad_scores)
                 for g in grads]
    return grads


@maxsim_hidden_bwd.register_fake
def _(grad_scores, Q, H, W, b, argmax, normalize, need_q, need_h, need_w, need_b, backend,
      fp32_precision):
    return (torch.empty_like(Q) if need_q else Q.new_empty((0,)),
            torch.empty_like(H) if need_h else Q.new_empty((0,)),
            torch.empty_like(W) if need_w else Q.new_empty((0,)),
            torch.empty_like(b) if need_b and b is not None else Q.new_empty((0,)))


def _hidden_setup_context(ctx, inputs, output) -> None:
    Q, H, W, b, q_mask, d_mask, normalize, save_argmax, backend, fp32_precision = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(Q, H, W, b, output[1])
    ctx.normalize = normalize
    ctx.options = options_for(Q, backend, fp32_precision)


def _hidden_backward(ctx, grad_scores: Tensor, _grad_saved):
    return (*_hidden_backward_of(ctx, grad_scores, traced=True), *(None,) * 6)


torch.library.register_autograd("fusedmaxsim::maxsim_hidden_fwd", _hidden_backward,
                                setup_context=_hidden_setup_context)


class HiddenFunction(torch.autograd.Function):
    """The hidden ops' forward and backward without the dispatcher's per-call cost (eager calls;
    under ``torch.compile`` the registered ops). ``b`` may be None; ``rest`` holds the masks,
    ``normalize`` and the options."""

    @staticmethod
    def forward(ctx, Q, H, W, b, rest):
        q_mask, d_mask, normalize, o = rest
        p = hidden_problem(Q, H, W, b, q_mask, d_mask, normalize=normalize, save_argmax=True)
        scores, argmax = _hidden_forward(p, o, Q, H, W, b, q_mask, d_mask)
        ctx.save_for_backward(Q, H, W, b, argmax)
        ctx.options, ctx.problem = o, p
        return scores

    @staticmethod
    def backward(ctx, grad_scores):
        return (*_hidden_backward_of(ctx, grad_scores, traced=False), None)


@autocast_off
def scores_hidden(Q: Tensor, H: Tensor, W: Tensor, b: Tensor | None, q_mask, d_mask,
                  normalize: bool) -> Tensor:
    """Scores of checked inputs, with autograd to ``Q``, ``H``, ``W`` and ``b`` when any needs
    it (the argmax saved only then); through the registered op under ``torch.compile``."""
    o = options_for(Q)
    save_argmax = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (Q, H, W, b))
    if torch.compiler.is_compiling():
        return maxsim_hidden_fwd(Q, H, W, b, q_mask, d_mask, normalize, save_argmax, o.backend,
                                 o.fp32_precision)[0]
    if not save_argmax:
        p = hidden_problem(Q, H, W, b, q_mask, d_mask, normalize=normalize, save_argmax=False)
        return _hidden_forward(p, o, Q, H, W, b, q_mask, d_mask)[0]
    return HiddenFunction.apply(Q, H, W, b, (q_mask, d_mask, normalize, o))


# ------------------------------------------------------------------------------------------------
# Autograd of both: one backward, through the registered op when traced
# ------------------------------------------------------------------------------------------------


class _Call:
    """What a backward needs of its forward, besides the saved tensors (one object: the eager
    ``Function.apply`` costs the host about 1 µs an argument)."""

    __slots__ = ("p", "o", "strategy", "q_mask", "d_mask", "q_inv", "d_inv", "layout")

    def __init__(self, p, o, strategy, q_mask, d_mask, q_inv, d_inv, layout=None):
        self.p, self.o, self.strategy = p, o, strategy
        self.q_mask, self.d_mask, self.q_inv, self.d_inv = q_mask, d_mask, q_inv, d_inv
        self.layout = layout


def _save(ctx, call: _Call, Q: Tensor, D: Tensor, saved: Tensor) -> None:
    # Only the tensors there are: each saved entry costs the backward an unpack and a version
    # check, a few µs on a call that the host's time decides.
    p = call.p
    ctx.save_for_backward(
        Q, D, saved, *((call.q_inv, call.d_inv) if p.normalize else ()),
        *((call.d_mask,) if p.tau else ()),
    )
    ctx.call = call


@autocast_off
def _grads(ctx, grad_scores: Tensor, traced: bool) -> tuple[Tensor | None, Tensor | None]:
    """``(grad_Q, grad_D)`` from what ``_save`` kept; None for an input that needs no gradient.

    ``traced``: the backward of a registered op, which the compiler traces with fake tensors, so
    it must call the registered backward op rather than the launchers.
    """
    need_q, need_d = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_q or need_d):
        return None, None
    call = ctx.call
    p, o, layout = call.p, call.o, call.layout
    if not p.save_argmax:
        raise RuntimeError(
            "fusedmaxsim was called while no input required grad, so no argmax was saved; "
            "set requires_grad on Q or D before the call"
        )
    Q, D, saved, *optional = ctx.saved_tensors
    q_inv, d_inv = optional[:2] if p.normalize else (None, None)
    d_mask = optional[-1] if p.tau else None
    grad_type = _score_dtype(Q)
    grad = grad_scores if grad_scores.dtype == grad_type else grad_scores.to(grad_type)
    if traced or torch.compiler.is_compiling():
        if layout is None:
            grad_q, grad_d = maxsim_bwd(grad, Q, D, saved, q_inv, d_inv, d_mask, need_q, need_d,
                                        call.strategy, o.backend, o.fp32_precision, p.tau)
        else:
            grad_q, grad_d = maxsim_packed_bwd(
                grad, Q, D, saved, layout.cu_q, layout.cu_d, layout.pair_q, layout.pair_d, q_inv,
                d_inv, layout.max_q, layout.max_d, layout.col_lo,
                -1 if layout.col_hi is None else layout.col_hi, need_q, need_d, call.strategy,
                o.backend, o.fp32_precision)
    else:
        grad_q, grad_d = run_backward(p, o, call.strategy, grad, Q, D, saved, q_inv, d_inv,
                                      d_mask, need_q, need_d, layout)
    if p.normalize:
        grad_q = normalize_backward(Q, grad_q, q_inv) if need_q else None
        grad_d = normalize_backward(D, grad_d, d_inv) if need_d else None
    return (grad_q if need_q else None), (grad_d if need_d else None)


def _traced_options(backend: str, fp32_precision: str) -> Options:
    """The options a registered op's autograd keeps: on that path the backward calls the
    registered backward op with the backend and precision only, and the op resolves the other
    settings when it runs. (Reading the settings here, while torch.compile traces, would make its
    guards on the settings' cache fail.)"""
    return Options(backend, fp32_precision, False, False, False, 0)


def _dense_setup_context(ctx, inputs, output) -> None:
    Q, D, q_mask, d_mask, q_inv, d_inv, save_argmax, backend, fp32_precision, strategy, tau = inputs
    ctx.mark_non_differentiable(output[1])  # the smooth max's saved rows are float: no gradient
    p = dense_problem(Q, D, q_mask, d_mask, normalize=q_inv is not None, tau=tau,
                      save_argmax=save_argmax)
    _save(ctx, _Call(p, _traced_options(backend, fp32_precision), strategy, q_mask, d_mask, q_inv,
                     d_inv), Q, D, output[1])


def _packed_setup_context(ctx, inputs, output) -> None:
    (Q, D, cu_q, cu_d, pair_q, pair_d, q_mask, d_mask, q_inv, d_inv, max_q, max_d, col_lo, col_hi,
     save_argmax, backend, fp32_precision, strategy) = inputs
    ctx.mark_non_differentiable(output[1])
    layout = _layout(Q, D, cu_q, cu_d, pair_q, pair_d, max_q, max_d, col_lo, col_hi)
    p = packed_problem(layout, Q, q_mask, d_mask, normalize=q_inv is not None,
                       save_argmax=save_argmax)
    _save(ctx, _Call(p, _traced_options(backend, fp32_precision), strategy, q_mask, d_mask, q_inv,
                     d_inv, layout), Q, D, output[1])


def _dense_backward(ctx, grad_scores: Tensor, _grad_saved):
    return (*_grads(ctx, grad_scores, traced=True), *(None,) * 9)


def _packed_backward(ctx, grad_scores: Tensor, _grad_saved):
    return (*_grads(ctx, grad_scores, traced=True), *(None,) * 16)


torch.library.register_autograd("fusedmaxsim::maxsim_fwd", _dense_backward,
                                setup_context=_dense_setup_context)
torch.library.register_autograd("fusedmaxsim::maxsim_packed_fwd", _packed_backward,
                                setup_context=_packed_setup_context)


DOUBLE_BACKWARD_MESSAGE = (
    "fusedmaxsim: double backward is not supported. fusedmaxsim's scores cannot be "
    "differentiated twice (their backward is not itself differentiable), so gradients taken "
    "with create_graph=True cannot be backpropagated again; fusedmaxsim.reference.maxsim_ref "
    "(which materializes the similarity grid) supports higher-order gradients"
)


class _FirstOrderOnly(torch.autograd.Function):
    """Passes a gradient through unchanged and raises :data:`DOUBLE_BACKWARD_MESSAGE` when
    differentiated. ``anchors`` (the forward's inputs) tie the gradient to the graph, so that a
    second backward reaches this node rather than failing with PyTorch's generic "does not
    require grad"."""

    @staticmethod
    def forward(ctx, grad, *anchors):
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(DOUBLE_BACKWARD_MESSAGE)


def _first_order_grads(ctx, grad_scores: Tensor) -> tuple:
    """The backward under ``create_graph=True``: the gradients computed as usual (without
    recording a graph through them), each marked first order only."""
    with torch.no_grad():
        grads = _grads(ctx, grad_scores, traced=False)
    anchors = (*ctx.saved_tensors[:2], grad_scores)
    return tuple(None if g is None else _FirstOrderOnly.apply(g, *anchors) for g in grads)


class MaxSimFunction(torch.autograd.Function):
    """The registered ops' forward and backward, without the dispatcher's per-call cost.

    Eager calls take this path; under ``torch.compile`` the front doors call the registered ops,
    which the compiler can trace. Only ``Q`` and ``D`` are inputs to autograd; ``call`` holds the
    rest (masks and inverse norms, which never receive a gradient, the problem and options).
    """

    @staticmethod
    def forward(ctx, Q, D, call: _Call):
        scores, saved = run_forward(call.p, call.o, Q, D, call.q_mask, call.d_mask, call.q_inv,
                                    call.d_inv, call.layout)
        _save(ctx, call, Q, D, saved)
        return scores

    @staticmethod
    def backward(ctx, grad_scores):
        # The engine runs a backward with grad mode on only under create_graph=True: there the
        # gradients are marked first order, so that a second backward through them raises a
        # clear error. Without it (every training step) that marking's host time is skipped
        # (design.md, "Host cost").
        if torch.is_grad_enabled():
            return _first_order_grads(ctx, grad_scores) + (None,)
        return _grads(ctx, grad_scores, traced=False) + (None,)


# ------------------------------------------------------------------------------------------------
# Entry points of the front doors
# ------------------------------------------------------------------------------------------------


def scores_dense(p: Problem, o: Options, strategy: str, Q, D, q_mask, d_mask, q_inv,
                 d_inv) -> Tensor:
    """Scores of a dense problem, with autograd when ``p.save_argmax``."""
    if not p.save_argmax and not torch.compiler.is_compiling():
        # Inference: no autograd node, no dispatcher.
        return run_forward(p, o, Q, D, q_mask, d_mask, q_inv, d_inv)[0]
    if torch.compiler.is_compiling():
        return maxsim_fwd(Q, D, q_mask, d_mask, q_inv, d_inv, p.save_argmax, o.backend,
                          o.fp32_precision, strategy, p.tau)[0]
    return MaxSimFunction.apply(Q, D, _Call(p, o, strategy, q_mask, d_mask, q_inv, d_inv))


def scores_packed(p: Problem, o: Options, strategy: str, layout: RaggedLayout, Q, D, q_mask,
                  d_mask, q_inv, d_inv) -> Tensor:
    """Scores of a packed problem, with autograd when ``p.save_argmax``."""
    if not p.save_argmax and not torch.compiler.is_compiling():
        return run_forward(p, o, Q, D, q_mask, d_mask, q_inv, d_inv, layout)[0]
    if torch.compiler.is_compiling():
        return maxsim_packed_fwd(
            Q, D, layout.cu_q, layout.cu_d, layout.pair_q, layout.pair_d, q_mask, d_mask, q_inv,
            d_inv, layout.max_q, layout.max_d, layout.col_lo,
            -1 if layout.col_hi is None else layout.col_hi, p.save_argmax, o.backend,
            o.fp32_precision, strategy)[0]
    return MaxSimFunction.apply(Q, D, _Call(p, o, strategy, q_mask, d_mask, q_inv, d_inv,
                                            layout))


def scores_residual(p: Problem, o: Options, Q: Tensor, docs: ResidualDocs, q_mask,
                    q_inv) -> Tensor:
    """Scores of ``Q`` against compressed documents, with autograd to ``Q`` when
    ``p.save_argmax`` (the index is frozen); through the registered op under ``torch.compile``."""
    if torch.compiler.is_compiling():
        return maxsim_residual_fwd(
            Q, docs.codes, docs.residuals, docs.starts, docs.lengths, docs.doc_ids,
            docs.centroids, docs.bucket_weights, q_mask, q_inv,
            -1 if docs.max_len is None else docs.max_len, docs.nbits, docs.bit_order,
            p.normalize, p.save_argmax, o.backend, o.fp32_precision)[0]
    if not p.save_argmax:
        return run_forward(p, o, Q, docs.codes, q_mask, None, q_inv, None, docs)[0]
    return MaxSimFunction.apply(Q, docs.codes, _Call(p, o, "auto", q_mask, None, q_inv, None,
                                                     docs))


# ------------------------------------------------------------------------------------------------
# PLAID approximate scores (plaid_approx_score, and the search pipeline's pruning step)
# ------------------------------------------------------------------------------------------------

from ._plan import plan_approx
from ._problem import approx_problem, check_approx_internal, padded_starts

_approx_launcher = None


def approx_scores(cs: Tensor, codes: Tensor, starts: Tensor, lengths: Tensor,
                  doc_ids: Tensor | None = None, hits: Tensor | None = None) -> Tensor:
    """PLAID's approximate (IVF pruning) scores, no autograd: ``score[q, j] = Σ_s max_{t <
    lengths[j]} cs[q, codes[starts[j] + t], s]``, the max exact, the sum in fp32 (float64 for
    float64 ``cs``); a query token whose max is -inf adds 0 (an empty document scores 0).

    Args:
        cs: ``[Nq, n_centroids, Lq]`` float centroid scores, any strides.
        codes: ``[T]`` int64 or int32 centroid ids, every document's back to back.
        starts: ``[Nd]`` int64, the first token of each document in ``codes``.
        lengths: ``[Nd]`` integers, each document's tokens.
        doc_ids: optional ``[Nq, C]`` int64, each query's candidate documents; an id < 0 is "no
            candidate" and scores -inf.
        hits: optional ``[Nq, Nd]`` bool (instead of ``doc_ids``): query ``q``'s candidates are
            the documents of ``hits[q]`` true, the others score -inf (the PyTorch path reads
            the largest count back: one synchronization on a GPU).

    Returns ``[Nq, C]`` (``[Nq, Nd]`` without ``doc_ids``) fp32. Nothing is checked by value
    and nothing synchronizes on the Triton path: a document whose range leaves ``codes``, a
    candidate id ``>= Nd``, or an id outside ``[0, n_centroids)`` in a document's tokens scores
    NaN, never a read out of bounds. The plan (``_plan.plan_approx``) picks the Triton kernel on
    CUDA, the PyTorch path elsewhere, or as forced (``forced_plan(kernel="torch")``)."""
    check_approx_internal(cs, codes, starts, lengths, doc_ids)
    if hits is not None:
        if doc_ids is not None or hits.dtype != torch.bool or hits.device != cs.device or \
                hits.shape != (cs.shape[0], lengths.shape[0]):
            raise ValueError("hits must be [Nq, Nd] bool on the scores' device, without doc_ids")
        return _approx(cs, codes, starts, lengths, None, options_for(cs), hits.contiguous())
    return approx_checked(cs, codes, starts, lengths, doc_ids)


def approx_checked(cs, codes, starts, lengths, doc_ids=None, *,
                   padded_len: int | None = None) -> Tensor:
    """:func:`approx_scores` of arguments a front door has checked already; with
    ``padded_len``, ``starts`` None: document ``j`` starts at ``j · padded_len``."""
    o = options_for(cs)
    if torch.compiler.is_compiling():
        if padded_len is not None:
            starts, lengths = padded_starts(lengths, padded_len)
        return plaid_approx(cs, codes, starts, lengths, doc_ids, o.backend)
    return _approx(cs, codes, starts, lengths, doc_ids, o, padded_len=padded_len)


def _approx(cs, codes, starts, lengths, doc_ids, o: Options, hits=None,
            padded_len: int | None = None) -> Tensor:
    global _approx_launcher
    n_cols = lengths.shape[0] if doc_ids is None else doc_ids.shape[1]
    plan = plan_approx(approx_problem(cs, n_cols, doc_ids is not None, hits is not None), o)
    if plan.kernel == "torch":
        if padded_len is not None:
            starts, lengths = padded_starts(lengths, padded_len)
        return _torch_path.approx_scores_torch(plan.torch_block_elems, cs, codes, starts, lengths,
                                               doc_ids, hits)
    if _approx_launcher is None:  # imported on first use: the PyTorch path never imports Triton
        from ._launch.approx import approx_scores as _approx_launcher
    return _approx_launcher(plan, cs, codes, starts, lengths, doc_ids, hits, padded_len)


@torch.library.custom_op("fusedmaxsim::plaid_approx", mutates_args=())
def plaid_approx(cs: Tensor, codes: Tensor, starts: Tensor, lengths: Tensor,
                 doc_ids: Tensor | None, backend: str) -> Tensor:
    """:func:`approx_scores` as a registered op (``torch.compile``); no gradient."""
    return _approx(cs, codes, starts, lengths, doc_ids, options_for(cs, backend))


@plaid_approx.register_fake
def _(cs, codes, starts, lengths, doc_ids, backend):
    n_cols = starts.shape[0] if doc_ids is None else doc_ids.shape[1]
    return cs.new_empty((cs.shape[0], n_cols), dtype=_score_dtype(cs))


__all__ += ["approx_checked", "approx_scores"]
