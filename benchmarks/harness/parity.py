"""The parity gate: no provider is timed before its results match the float64 oracle.

:func:`reference_outputs` runs ``fusedmaxsim.reference.maxsim_ref`` in float64 on exactly the
providers' inputs, in exact blocks of the output for the largest shapes (``block_elems``
similarities at a time). :func:`check_parity` compares a provider's scores in the max norm
(:data:`SCORE_TOL`, by input dtype) and its gradients in the Frobenius norm (:data:`GRAD_TOL`),
and says what is out of tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .shapes import Case, Shape

# Parity tolerances against float64. Scores: max|out - ref| / max|ref|, by input dtype.
SCORE_TOL = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-2}
# Gradients: ‖out - ref‖ / ‖ref‖ (Frobenius), every dtype. A near-tie of the max decided otherwise
# than in float64 (two similarities within fp32 rounding of each other, or within the 16 units in
# the last place of the Gluon training forward's coded max) sends a whole query token's gradient
# to another document token, which the max norm reports as an error the size of a gradient row
# however few such tokens there are; the Frobenius norm weighs how many. 1e-2 (the bound of the
# GPU tests' large shapes) is about a hundred such decisions among train_colpali's two million,
# so a kernel that gets even a small share of its maxima wrong is still refused (NOTES.md section
# 46). The max-norm error is recorded beside it (`grad_q_rel_err`, `grad_d_rel_err`).
GRAD_TOL = 1e-2

# Largest float64 grid block the reference builds at once (elements): keeps the oracle of the
# biggest shapes within a few GiB while staying exact (see reference_outputs).
REF_BLOCK_ELEMS = 1 << 26


@dataclass
class Reference:
    scores: torch.Tensor
    grad_q: torch.Tensor | None
    grad_d: torch.Tensor | None


def ref_blocks(shape: Shape, block_elems: int = REF_BLOCK_ELEMS) -> tuple:
    """Rows (queries) and columns (documents or candidates) per reference block of at most
    ``block_elems`` similarities (but never less than one query against one document)."""
    per_pair = shape.lq * shape.ld
    cols = max(1, min(shape.nd, block_elems // per_pair))
    rows = max(1, min(shape.nq, block_elems // (cols * per_pair)))
    return rows, cols


def reference_outputs(case: Case, block_elems: int = REF_BLOCK_ELEMS) -> Reference:
    """Scores and gradients of the float64 oracle on exactly the providers' inputs.

    The oracle materialises the similarity grid, which in float64 would not fit for the largest
    shapes, so it runs on blocks of the output (``block_elems`` similarities, see
    :func:`ref_blocks`). Blocks are independent in the forward and their gradients add up in the
    backward, so the result is the same as one big call.
    """
    from fusedmaxsim.reference import maxsim_ref

    shape = case.shape
    Q = case.Q.detach().double().requires_grad_(case.training)
    D = case.D.detach().double().requires_grad_(case.training)
    scores = torch.empty(shape.out_shape, dtype=torch.float64, device=Q.device)
    rows, cols = ref_blocks(shape, block_elems)
    for i0 in range(0, shape.nq, rows):
        qi = slice(i0, i0 + rows)
        for j0 in range(0, shape.nd, cols):
            dj = slice(j0, j0 + cols)
            if shape.layout == "cross":
                D_blk = D[dj]
                dm = None if case.d_mask is None else case.d_mask[dj]
            else:
                D_blk = D[qi, dj]
                dm = None if case.d_mask is None else case.d_mask[qi, dj]
            qm = None if case.q_mask is None else case.q_mask[qi]
            block = maxsim_ref(Q[qi], D_blk, qm, dm, normalize=shape.normalize)
            if case.training:
                block.backward(case.grad_out[qi, dj].double())
            scores[qi, dj] = block.detach()
    return Reference(scores, Q.grad, D.grad)


def rel_err(x: torch.Tensor | None, ref: torch.Tensor) -> float:
    """``max|x - ref| / max|ref|``; infinite for a missing or non-finite result."""
    if x is None:
        return math.inf
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"output shape {tuple(x.shape)}, expected {tuple(ref.shape)}")
    diff = (x.detach().double() - ref).abs().max().item()
    if not math.isfinite(diff):
        return math.inf
    scale = ref.abs().max().item()
    return diff / scale if scale > 0 else diff


def fro_err(x: torch.Tensor | None, ref: torch.Tensor) -> float:
    """``‖x - ref‖ / ‖ref‖`` (:func:`fusedmaxsim.testing.relative_error_fro`); infinite for a
    missing or non-finite result."""
    from fusedmaxsim.testing import relative_error_fro

    if x is None:
        return math.inf
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"output shape {tuple(x.shape)}, expected {tuple(ref.shape)}")
    err = relative_error_fro(x, ref)
    return err if math.isfinite(err) else math.inf


def check_parity(out: torch.Tensor, grads, ref: Reference, case: Case) -> dict:
    """Relative errors against the oracle and whether they are within tolerance: scores in the
    max norm, gradients in the Frobenius norm (see :data:`GRAD_TOL`; their max-norm errors are
    recorded too)."""
    dtype = case.shape.dtype
    result = {"score_rel_err": rel_err(out, ref.scores), "score_tol": SCORE_TOL[dtype]}
    problems = []
    if not result["score_rel_err"] <= SCORE_TOL[dtype]:
        problems.append(f"score rel err {result['score_rel_err']:.2e} > {SCORE_TOL[dtype]:.0e}")
    if case.training:
        result["grad_tol"] = GRAD_TOL
        for name, got, want in (("grad_q", grads[0], ref.grad_q), ("grad_d", grads[1], ref.grad_d)):
            result[f"{name}_rel_err"] = rel_err(got, want)
            err = result[f"{name}_fro_err"] = fro_err(got, want)
            if got is None:
                problems.append(f"no {name}")
            elif not err <= GRAD_TOL:
                problems.append(f"{name} Frobenius rel err {err:.2e} > {GRAD_TOL:.0e}")
    result["parity_ok"] = not problems
    result["parity_problems"] = "; ".join(problems) or None
    return result
