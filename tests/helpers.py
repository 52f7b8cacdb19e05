"""Shared test helpers: random problems and the float64 comparison of scores and gradients."""

from __future__ import annotations

import torch

from fusedmaxsim import maxsim, maxsim_pairs
from fusedmaxsim.reference import maxsim_pairs_ref, maxsim_ref
from fusedmaxsim.testing import TOLERANCES, assert_close_to_reference


def masks_with_holes(shape, device, *, fully_masked_first: bool = True) -> torch.Tensor:
    """A random bool mask (holes anywhere, as PyLate's skiplist makes) whose first row is all False."""
    mask = torch.rand(shape, device=device) > 0.3
    if fully_masked_first and mask.dim() >= 2 and mask.shape[0] > 1:
        mask[0] = False
    return mask


# Odd sizes on purpose (Lq=7, Ld=13, d=96): nothing is a multiple of a tile.
LAYOUTS = {
    # name: (Q shape, D shape)
    "cross": ((3, 7, 96), (5, 13, 96)),
    "candidates": ((3, 7, 96), (3, 4, 13, 96)),
    "pairs": ((4, 7, 96), (4, 13, 96)),
}


def random_problem(layout, dtype, device, masks=True):
    """``(Q, D, q_mask, d_mask)`` of ``LAYOUTS[layout]``; the masks' first rows fully masked."""
    q_shape, d_shape = LAYOUTS[layout]
    Q = torch.randn(q_shape, device=device, dtype=dtype)
    D = torch.randn(d_shape, device=device, dtype=dtype)
    q_mask = masks_with_holes(q_shape[:-1], device) if masks else None
    d_mask = masks_with_holes(d_shape[:-1], device) if masks else None
    return Q, D, q_mask, d_mask


def compiled_and_eager_step(device, Nq, Lq, Ld, d_in, d_out):
    """A training step (projection, normalize, MaxSim, cross-entropy at temperature 0.05) under
    ``torch.compile(fullgraph=True)`` and eagerly, on the same inputs, in fp32 with IEEE
    products: ``((loss, weight grad) compiled, (loss, weight grad) eager)``."""
    from fusedmaxsim import settings

    torch._dynamo.reset()
    proj = torch.nn.Linear(d_in, d_out, device=device)

    def step(q_in, d_in, d_mask):
        Q = torch.nn.functional.normalize(proj(q_in), dim=-1)
        D = torch.nn.functional.normalize(proj(d_in), dim=-1)
        scores = maxsim(Q, D, d_mask=d_mask)
        return torch.nn.functional.cross_entropy(
            scores / 0.05, torch.arange(scores.shape[0], device=device)
        )

    q_in = torch.randn(Nq, Lq, d_in, device=device)
    docs = torch.randn(Nq, Ld, d_in, device=device)
    d_mask = torch.rand(Nq, Ld, device=device) > 0.2
    results = []
    with settings.use_fp32_precision("ieee"):
        for fn in (torch.compile(step, fullgraph=True), step):
            proj.weight.grad = None
            loss = fn(q_in, docs, d_mask)
            loss.backward()
            results.append((loss.detach(), proj.weight.grad.clone()))
    return results


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def assert_backward_bitwise_reproducible(backward_of, Q, D, runs: int = 2) -> None:
    """``backward_of(q, d)`` (a forward and its backward on fresh leaves) gives bitwise equal
    gradients of Q and D in every one of ``runs`` runs."""
    grads = []
    for _ in range(runs):
        q, d = leaf(Q), leaf(D)
        backward_of(q, d)
        grads.append((q.grad, d.grad))
    for q_grad, d_grad in grads[1:]:
        assert torch.equal(q_grad, grads[0][0]) and torch.equal(d_grad, grads[0][1])


def compare_with_float64(call, ref_call, Q, D, tol, *, inference=True):
    """Scores and both gradients (a random grad_output, then the stride-0 one that
    ``loss.sum().backward()`` passes) of ``call(Q, D)`` against ``ref_call(Q64, D64)`` in
    float64; with ``inference``, the ``no_grad`` forward too. Returns the scores."""
    score_tol, grad_tol = tol or TOLERANCES[Q.dtype]
    Q, D = leaf(Q), leaf(D)
    Q64, D64 = leaf(Q.double()), leaf(D.double())

    out = call(Q, D)
    ref = ref_call(Q64, D64)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert_close_to_reference(out, ref, score_tol, "scores")
    if inference:
        with torch.no_grad():  # inference has its own path: no argmax, norms taken from the tiles
            assert_close_to_reference(call(Q, D), ref, score_tol, "scores (no_grad)")

    grad_out = torch.randn_like(out)
    gq, gd = torch.autograd.grad(out, (Q, D), grad_out)
    rq, rd = torch.autograd.grad(ref, (Q64, D64), grad_out.double())
    assert gq.dtype == Q.dtype and gd.dtype == D.dtype
    assert_close_to_reference(gq, rq, grad_tol, "grad_Q")
    assert_close_to_reference(gd, rd, grad_tol, "grad_D")

    call(Q, D).sum().backward()
    ref_call(Q64, D64).sum().backward()
    assert_close_to_reference(Q.grad, Q64.grad, grad_tol, "grad_Q (sum)")
    assert_close_to_reference(D.grad, D64.grad, grad_tol, "grad_D (sum)")
    return out


def check_against_reference(
    Q, D, q_mask=None, d_mask=None, *, normalize=False, backward=None, pairs=False, tol=None,
    **reduction,
):
    """:func:`compare_with_float64` for ``maxsim`` (or ``maxsim_pairs``) and its reference.

    ``reduction``: ``reduction=`` and ``tau=``, passed to the function and the reference alike.
    """
    fused, oracle = (maxsim_pairs, maxsim_pairs_ref) if pairs else (maxsim, maxsim_ref)
    return compare_with_float64(
        lambda q, d: fused(q, d, q_mask, d_mask, normalize=normalize, backward=backward, **reduction),
        lambda q, d: oracle(q, d, q_mask, d_mask, normalize=normalize, **reduction),
        Q, D, tol,
    )


def assert_no_host_synchronization(calls):
    """``calls()`` once (compiling what it needs), then again with any host synchronization an
    error (CUDA only)."""
    calls()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        calls()
    finally:
        torch.cuda.set_sync_debug_mode(0)
