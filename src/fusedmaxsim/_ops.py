"""MaxSim as two ``torch.library`` custom ops, with autograd and fake (meta) implementations.

``fusedmaxsim::maxsim_fwd`` returns the scores and, when a gradient will be needed, the argmax;
``fusedmaxsim::maxsim_bwd`` turns the argmax back into gradients. Being registered ops, they trace
under ``torch.compile(fullgraph=True)`` without graph breaks and pass ``torch.library.opcheck``.
Each op runs the Triton launchers or the blocked PyTorch path, as the ``backend`` argument says
(decided once, in the public API, before anything runs).

With ``normalize``, the inverse norms enter as inputs (detached); the kernels produce gradients
with respect to the normalized tokens and this module applies the normalization's Jacobian, so the
result equals ``F.normalize`` followed by MaxSim.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from . import _blocked, settings
from ._configs import argmax_dtype

NORM_EPS = 1e-12  # F.normalize's default


_launch_module = None


def _launch():
    """The Triton launchers, imported on first use: the PyTorch path never imports Triton."""
    global _launch_module
    if _launch_module is None:
        from . import _launch as module

        _launch_module = module
    return _launch_module


@torch.library.custom_op("fusedmaxsim::maxsim_fwd", mutates_args=())
def maxsim_fwd(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None,
    d_mask: Tensor | None,
    q_inv: Tensor | None,
    d_inv: Tensor | None,
    save_argmax: bool,
    backend: str,
    fp32_precision: str,
    strategy: str,
    tau: float,
) -> tuple[Tensor, Tensor]:
    """Scores ``[Nq, Ncols]`` (fp32; fp64 for fp64 inputs) and argmax ``[Nq, Ncols, Lq]`` (or
    empty). ``tau > 0``: the smooth max, and each row's log-sum-exp (fp32) in place of the argmax."""
    scores, argmax = maxsim_fwd_impl(
        Q, D, q_mask, d_mask, q_inv, d_inv, save_argmax, backend, fp32_precision, strategy, tau
    )
    # An op's outputs must be its own: the launcher's shared empty placeholder is not.
    return scores, argmax if save_argmax else argmax.new_empty((0,))


def maxsim_fwd_impl(
    Q, D, q_mask, d_mask, q_inv, d_inv, save_argmax, backend, fp32_precision, strategy, tau
):
    if backend == "triton":
        return _launch().maxsim_fwd(
            Q, D, q_mask, d_mask, q_inv, d_inv, save_argmax, fp32_precision, tau=tau
        )
    return _blocked.maxsim_fwd_blocked(
        Q, D, q_mask, d_mask, q_inv, d_inv, save_argmax, settings.torch_block_bytes(), tau
    )


def maxsim_fwd_normalized(Q, D, q_mask, d_mask, fp32_precision: str) -> Tensor:
    """Inference scores of the normalized tokens, the norms taken from the tiles in the kernel
    (Triton only; nothing saved for a backward)."""
    return _launch().maxsim_fwd(
        Q, D, q_mask, d_mask, None, None, False, fp32_precision, norm_from_tiles=True
    )[0]


@maxsim_fwd.register_fake
def _(Q, D, q_mask, d_mask, q_inv, d_inv, save_argmax, backend, fp32_precision, strategy, tau):
    Nq, Lq = Q.shape[0], Q.shape[1]
    Ncols = D.shape[-3]
    out_dtype = torch.float64 if Q.dtype == torch.float64 else torch.float32
    scores = Q.new_empty((Nq, Ncols), dtype=out_dtype)
    saved_dtype = argmax_dtype(D.shape[-2])
    if tau:  # float64 always runs on the PyTorch path, which keeps float64 rows
        saved_dtype = torch.float64 if Q.dtype == torch.float64 else torch.float32
    argmax = Q.new_empty((Nq, Ncols, Lq) if save_argmax else (0,), dtype=saved_dtype)
    return scores, argmax


@torch.library.custom_op("fusedmaxsim::maxsim_bwd", mutates_args=())
def maxsim_bwd(
    grad_scores: Tensor,
    Q: Tensor,
    D: Tensor,
    argmax: Tensor,
    q_inv: Tensor | None,
    d_inv: Tensor | None,
    d_mask: Tensor | None,
    need_grad_q: bool,
    need_grad_d: bool,
    strategy: str,
    fp32_out: bool,
    backend: str,
    fp32_precision: str,
    tau: float,
) -> tuple[Tensor, Tensor]:
    """``(grad_Q, grad_D)``; an unneeded one is an empty tensor. ``d_mask`` is read only by the
    smooth max (``tau > 0``), whose backward recomputes the similarities."""
    return maxsim_bwd_impl(
        grad_scores, Q, D, argmax, q_inv, d_inv, d_mask, need_grad_q, need_grad_d, strategy,
        fp32_out, backend, fp32_precision, tau,
    )


def maxsim_bwd_impl(
    grad_scores, Q, D, argmax, q_inv, d_inv, d_mask, need_grad_q, need_grad_d, strategy, fp32_out,
    backend, fp32_precision, tau,
):
    if tau:
        if backend == "triton":
            from ._launch_smooth import smooth_bwd

            return smooth_bwd(
                grad_scores, Q, D, d_mask, argmax, tau, need_grad_q, need_grad_d, fp32_out,
                fp32_precision,
            )
        return _blocked.smooth_bwd_blocked(
            grad_scores, Q, D, d_mask, argmax, tau, need_grad_q, need_grad_d, fp32_out,
            settings.torch_block_bytes(),
        )
    if backend == "triton":
        return _launch().maxsim_bwd(
            grad_scores, Q, D, argmax, q_inv, d_inv, need_grad_q, need_grad_d, strategy, fp32_out,
            fp32_precision,
        )
    return _blocked.maxsim_bwd_blocked(
        grad_scores, Q, D, argmax, q_inv, d_inv, need_grad_q, need_grad_d, fp32_out,
        settings.torch_block_bytes(),
    )


@maxsim_bwd.register_fake
def _(grad_scores, Q, D, argmax, q_inv, d_inv, d_mask, need_grad_q, need_grad_d, strategy,
      fp32_out, backend, fp32_precision, tau):
    def grad_like(x: Tensor, needed: bool) -> Tensor:
        if not needed:
            return x.new_empty((0,))
        keep = fp32_out and x.dtype != torch.float64
        return x.new_empty(x.shape, dtype=torch.float32 if keep else x.dtype)

    return grad_like(Q, need_grad_q), grad_like(D, need_grad_d)


def inverse_norms(x: Tensor, backend: str) -> Tensor:
    """``1 / max(‖token‖, 1e-12)`` (fp32; float64 for float64), detached, once per token.

    On the Triton path a kernel reads each token once; ``vector_norm(dtype=float32)`` would first
    write an fp32 copy of a 16-bit input.
    """
    if backend == "triton":
        return _launch().inverse_norms(x.detach(), NORM_EPS)
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    norm = torch.linalg.vector_norm(x.detach(), dim=-1, dtype=dtype)
    return 1.0 / norm.clamp_min(NORM_EPS)


def refuse_nondeterministic(strategy: str) -> None:
    """``backward="unified"`` under ``torch.use_deterministic_algorithms(True)``: raise (or warn in
    warn-only mode), as PyTorch does for its own nondeterministic operations."""
    if strategy != "unified" or not torch.are_deterministic_algorithms_enabled():
        return
    message = (
        "backward='unified' uses fp32 atomics and is not deterministic, but "
        "torch.use_deterministic_algorithms(True) is set; use backward='lowmem' or 'auto'"
    )
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(message, stacklevel=4)
    else:
        raise RuntimeError(message)


# Below this many multiply-adds (Nq·Ncols·Lq·Ld·d) a training call is bound by the host, not the
# GPU: there "lowmem" allocates nothing but the gradients, while "unified" adds an fp32 buffer's
# zero fill and cast (two more launches). Measured on the H200 at 32×32 queries and documents of
# 32×180 tokens (7.5e8): the backward's host time 60 µs lowmem against 85 µs unified
# (benchmarks/NOTES.md, section 9).
HOST_BOUND_MACS = 1 << 32

# From this many multiply-adds up, a cross product's training step with 16-bit inputs is bound by
# the GPU, and there "lowmem" (through the winner index) is about as fast as "unified" and
# bitwise reproducible: on the H200 its steps took 9% less GPU time than unified's at 2^36, 1-6%
# less at 2^38 and 2% more at 2^40, at the same peak memory (benchmarks/NOTES.md section 45).
# Below it (down to HOST_BOUND_MACS) unified's fewer launches decide. fp32 inputs keep unified:
# lowmem's one-hot products run at ``fp32_precision`` (TF32 by default), unified adds in fp32.
LOWMEM_CROSS_MACS = 1 << 36


def resolve_strategy(
    strategy: str, *, per_query_docs: bool, Nq: int, Ncols: int, Lq: int, Ld: int, dim: int,
    sixteen_bit: bool = False,
) -> str:
    """The backward strategy for ``auto``, and the determinism guard for ``unified``."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    if strategy == "auto":
        # Measured on the H200 (benchmarks/NOTES.md): per-query candidates share no document, and
        # there the document-owned products win; small problems go by host time; in between,
        # unified's atomic scatter, with fewer launches than lowmem's winner index.
        macs = Nq * Ncols * Lq * Ld * dim
        if (deterministic or per_query_docs or macs <= HOST_BOUND_MACS
                or (sixteen_bit and macs >= LOWMEM_CROSS_MACS)):
            return "lowmem"
        return "unified"
    refuse_nondeterministic(strategy)
    return strategy


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


class NormalizeTokens(torch.autograd.Function):
    """``F.normalize(x, dim=-1)`` whose backward is :func:`normalize_backward`: a token that
    receives no gradient gets exactly 0, so a masked token's values (NaN included) never leak."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.nn.functional.normalize(x, dim=-1, eps=NORM_EPS)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        return normalize_backward(x, grad.to(compute))


def _save(
    ctx, Q, D, d_mask, argmax, q_inv, d_inv, save_argmax, backend, fp32_precision, strategy, tau
) -> None:
    # Only the tensors there are: each saved entry costs the backward an unpack and a version
    # check, a few µs on a call that the host's time decides.
    normalize = q_inv is not None
    ctx.save_for_backward(
        Q, D, argmax, *((q_inv, d_inv) if normalize else ()), *((d_mask,) if tau else ())
    )
    ctx.normalize = normalize
    ctx.tau = tau
    ctx.backend = backend
    ctx.fp32_precision = fp32_precision
    ctx.strategy = strategy
    ctx.saved_argmax = save_argmax


def _grads(ctx, grad_scores: Tensor, traced: bool) -> tuple[Tensor | None, Tensor | None]:
    """``(grad_Q, grad_D)`` from what ``_save`` kept; None for an input that needs no gradient.

    ``traced``: the backward of the registered op, which the compiler traces with fake tensors,
    so it must call the registered backward op rather than the launchers.
    """
    need_q, need_d = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_q or need_d):
        return None, None
    if not ctx.saved_argmax:
        raise RuntimeError(
            "maxsim was called while no input required grad, so no argmax was saved; "
            "set requires_grad on Q or D before the call"
        )
    Q, D, argmax, *optional = ctx.saved_tensors
    normalize = ctx.normalize
    q_inv, d_inv = optional[:2] if normalize else (None, None)
    d_mask = optional[-1] if ctx.tau else None
    strategy = resolve_strategy(
        ctx.strategy, per_query_docs=D.dim() == 4, Nq=Q.shape[0], Ncols=D.shape[-3], Lq=Q.shape[1],
        Ld=D.shape[-2], dim=D.shape[-1], sixteen_bit=Q.element_size() == 2,
    )
    bwd = maxsim_bwd if traced or torch.compiler.is_compiling() else maxsim_bwd_impl
    grad_type = torch.float64 if Q.dtype == torch.float64 else torch.float32
    grad_q, grad_d = bwd(
        grad_scores if grad_scores.dtype == grad_type else grad_scores.to(grad_type),
        Q, D, argmax, q_inv, d_inv, d_mask, need_q, need_d, strategy, normalize, ctx.backend,
        ctx.fp32_precision, ctx.tau,
    )
    if normalize:
        grad_q = normalize_backward(Q, grad_q, q_inv) if need_q else None
        grad_d = normalize_backward(D, grad_d, d_inv) if need_d else None
    return (grad_q if need_q else None), (grad_d if need_d else None)


def _setup_context(ctx, inputs, output) -> None:
    Q, D, _q_mask, d_mask, q_inv, d_inv, save_argmax, backend, fp32_precision, strategy, tau = inputs
    ctx.mark_non_differentiable(output[1])  # the smooth max's saved rows are float: no gradient
    _save(
        ctx, Q, D, d_mask, output[1], q_inv, d_inv, save_argmax, backend, fp32_precision, strategy,
        tau,
    )


def _backward(ctx, grad_scores: Tensor, _grad_argmax):
    return (*_grads(ctx, grad_scores, traced=True), *(None,) * 9)


torch.library.register_autograd("fusedmaxsim::maxsim_fwd", _backward, setup_context=_setup_context)


@torch.autograd.function.once_differentiable
def _backward_once(ctx, grad_scores):
    return _grads(ctx, grad_scores, traced=False) + (None,)


class MaxSimFunction(torch.autograd.Function):
    """The same forward and backward as the registered op, without the dispatcher's per-call cost.

    Eager calls take this path; under ``torch.compile`` the API calls the registered op instead,
    which the compiler can trace. Only ``Q`` and ``D`` are inputs to autograd; ``options`` holds
    the rest (masks and inverse norms, which never receive a gradient, and the settings):
    ``Function.apply`` costs the host about 1 µs an argument.
    """

    @staticmethod
    def forward(ctx, Q, D, options):
        q_mask, d_mask, q_inv, d_inv, save_argmax, backend, fp32_precision, strategy, tau = options
        scores, argmax = maxsim_fwd_impl(
            Q, D, q_mask, d_mask, q_inv, d_inv, save_argmax, backend, fp32_precision, strategy, tau
        )
        _save(
            ctx, Q, D, d_mask, argmax, q_inv, d_inv, save_argmax, backend, fp32_precision, strategy,
            tau,
        )
        return scores

    @staticmethod
    def backward(ctx, grad_scores):
        # The engine runs a backward with grad mode on only under create_graph=True: there the
        # once-differentiable wrapper makes a second backward through these gradients raise.
        # Without it (every training step) the wrapper's host time is skipped (NOTES section 27).
        if torch.is_grad_enabled():
            return _backward_once(ctx, grad_scores)
        return _grads(ctx, grad_scores, traced=False) + (None,)


def maxsim_scores(
    Q, D, q_mask, d_mask, q_inv, d_inv, save_argmax, backend, fp32_precision, strategy, tau
):
    """Scores with autograd: the registered op when compiling, the plain Function otherwise."""
    options = (q_mask, d_mask, q_inv, d_inv, save_argmax, backend, fp32_precision, strategy, tau)
    if torch.compiler.is_compiling():
        return maxsim_fwd(Q, D, *options)[0]
    return MaxSimFunction.apply(Q, D, options)
