"""The PyTorch path: bounded memory, block-size independence, and the registered ops' contracts."""

import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import check_against_reference, leaf, masks_with_holes

from fusedmaxsim import forced_plan, maxsim, maxsim_varlen, reference, settings
from fusedmaxsim.planning import recording
from fusedmaxsim._plan import plan_blocks


@pytest.mark.parametrize("per_query_docs", [False, True])
@pytest.mark.parametrize("budget", [1, 500, 10_000, 10**6])
def test_block_plan_respects_the_budget(per_query_docs, budget):
    Nq, Ncols, Lq, Ld, dim = 9, 11, 32, 300, 64
    bq, bc, rows = plan_blocks(Nq, Ncols, Lq, Ld, dim, per_query_docs, budget)
    assert 1 <= bq <= Nq and 1 <= bc <= Ncols and 1 <= rows <= Lq
    docs = bc * Ld * dim * (bq if per_query_docs else 1)
    used = bq * bc * rows * Ld + docs
    # Over budget only in the documented case: one document row alone exceeds it.
    assert used <= budget or (bq, bc, rows) == (1, 1, 1)


@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_results_do_not_depend_on_the_block_size(layout):
    Q = torch.randn(5, 9, 16)
    D = torch.randn(*((5, 3) if layout == "candidates" else (7,)), 11, 16)
    q_mask = torch.rand(Q.shape[:-1]) > 0.3
    d_mask = torch.rand(D.shape[:-1]) > 0.3
    results = []
    for budget in (64, 4096, 2**28):
        Qg, Dg = leaf(Q), leaf(D)
        with settings.use_backend("torch"):
            settings.set_torch_block_bytes(budget)
            try:
                out = maxsim(Qg, Dg, q_mask, d_mask, normalize=True)
                out.backward(torch.ones_like(out))
            finally:
                settings.set_torch_block_bytes(None)
        results.append((out, Qg.grad, Dg.grad))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


MEMORY_PROBE = textwrap.dedent(
    """
    import resource, sys, torch
    from fusedmaxsim import maxsim, settings
    from fusedmaxsim.reference import maxsim_ref
    Q = torch.randn(64, 32, 32)
    D = torch.randn(512, 256, 32)          # the naive grid: 64*512*32*256 fp32 = 1 GiB
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if sys.argv[1] == "blocked":
        settings.set_torch_block_bytes(16 * 2**20)
        with settings.use_backend("torch"):
            maxsim(Q, D)
    else:
        maxsim_ref(Q, D)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)  # MiB
    """
)


def _peak_mib(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip().splitlines()[-1])


def test_blocked_path_stays_within_its_memory_bound():
    blocked = _peak_mib("blocked")
    naive = _peak_mib("naive")
    assert naive > 900, f"the probe should need a 1 GiB grid naively, measured {naive} MiB"
    assert blocked < 200, f"blocked path grew the peak by {blocked} MiB with a 16 MiB budget"


def test_registered_ops_pass_opcheck():
    from fusedmaxsim import _autograd

    Q = torch.randn(2, 5, 16, requires_grad=True)
    D = torch.randn(3, 7, 16, requires_grad=True)
    q_mask = torch.rand(2, 5) > 0.2
    d_mask = torch.rand(3, 7) > 0.2
    q_inv = torch.rand(2, 5) + 0.5
    d_inv = torch.rand(3, 7) + 0.5
    for args in (
        (Q, D, q_mask, d_mask, None, None, True, "torch", "tf32", "auto", 0.0),
        (Q, D, None, None, q_inv, d_inv, True, "torch", "ieee", "lowmem", 0.0),
        (Q, D, q_mask, d_mask, None, None, True, "torch", "tf32", "auto", 0.25),
    ):
        torch.library.opcheck(_autograd.maxsim_fwd, args)
    for tau in (0.0, 0.25):
        scores, saved = _autograd.maxsim_fwd(Q, D, q_mask, d_mask, None, None, True, "torch", "tf32", "auto", tau)
        grad = torch.randn_like(scores)
        torch.library.opcheck(
            _autograd.maxsim_bwd,
            (grad, Q.detach(), D.detach(), saved.detach(), None, None, d_mask, True, True, "lowmem",
             "torch", "tf32", tau),
        )


@pytest.mark.parametrize("doc_major", [False, True])
@pytest.mark.parametrize("case", ["masked", "normalized", "smoothmax", "odd", "strided", "empty"])
def test_both_orientations_match_float64(doc_major, case):
    """The PyTorch path's two layouts of the cross product's similarities (``[Nq, Lq, Nd, Ld]``
    or document-major ``[Nd, Ld, Nq, Lq]``), forced through the plan: scores and both gradients
    against float64, with fully masked rows, normalization, the smooth max, odd sizes, strided
    inputs and an empty batch."""
    torch.manual_seed(7)
    Q, D = torch.randn(3, 11, 24), torch.randn(5, 13, 24)
    q_mask = d_mask = None
    kwargs = {}
    if case == "masked":
        q_mask, d_mask = masks_with_holes((3, 11), "cpu"), masks_with_holes((5, 13), "cpu")
    elif case == "normalized":
        kwargs["normalize"] = True
    elif case == "smoothmax":
        d_mask = masks_with_holes((5, 13), "cpu")
        kwargs.update(reduction="smoothmax", tau=0.5)
    elif case == "odd":
        Q, D = torch.randn(1, 1, 3), torch.randn(7, 1, 3)
    elif case == "strided":
        Q, D = torch.randn(3, 24, 11).transpose(1, 2), torch.randn(13, 5, 24).transpose(0, 1)
    elif case == "empty":
        Q = torch.randn(0, 11, 24)
    with settings.use_backend("torch"), forced_plan(doc_major=doc_major), recording() as plans:
        check_against_reference(Q, D, q_mask, d_mask, tol=(1e-5, 1e-5), **kwargs)
    forwards = [plan for _, plan in plans if plan.__class__.__name__ == "ForwardPlan"]
    assert forwards and all(plan.doc_major == doc_major for plan in forwards)


def test_the_orientation_rule():
    """On a CPU the cross product is document-major for 32 and for 192-256 query rows
    (design.md, PyTorch path); candidates and other sizes stay query-major."""
    def orientation(Nq, Lq, D):
        with settings.use_backend("torch"), recording() as plans:
            maxsim(torch.randn(Nq, Lq, 8), D)
        return plans[0][1].doc_major

    docs = torch.randn(4, 9, 8)
    assert orientation(1, 32, docs) and orientation(8, 32, docs) and orientation(6, 32, docs)
    assert not orientation(1, 8, docs) and not orientation(4, 32, docs)
    assert not orientation(9, 32, docs) and not orientation(1, 33, docs)
    assert not orientation(2, 32, torch.randn(2, 3, 9, 8))  # candidates
    with forced_plan(TORCH_DOC_MAJOR_ROWS=((1, 8),)):
        assert orientation(1, 8, docs) and not orientation(1, 32, docs)


def _max_terms_abs(Q, D, q_mask, d_mask, normalize):
    """Σ over a query's valid tokens of |max similarity| in float64: the scale of the bf16
    product's rounding bound."""
    Q, D = Q.double(), D.double()
    if normalize:
        Q, D = (torch.nn.functional.normalize(x, dim=-1) for x in (Q, D))
    sim = torch.einsum("qsd,...ntd->qnst", Q, D) if D.dim() == 3 else torch.einsum(
        "qsd,qntd->qnst", Q, D)
    if d_mask is not None:
        dm = d_mask[None, :, None, :] if d_mask.dim() == 2 else d_mask[:, :, None, :]
        sim = sim.masked_fill(~dm, float("-inf"))
    best = sim.amax(-1).nan_to_num(neginf=0.0).abs()
    if q_mask is not None:
        best = best * q_mask[:, None, :]
    return best.sum(-1)


@pytest.mark.parametrize("layout", ["cross", "candidates"])
@pytest.mark.parametrize("case", ["plain", "masked", "normalized", "strided", "empty"])
def test_bf16_product_within_its_rounding_bound(layout, case):
    """bf16 inference on a CPU multiplies in bf16 (the plan's ``bf16_product``): each token's
    maximum similarity is rounded to bf16 (2^-9 relative; 2^-8 with the documents' norms applied
    to the rounded similarities) before the fp32 sum, so the scores lie within that bound of
    float64, and forced off the fp32 product matches float64 closely."""
    torch.manual_seed(3)
    Q = torch.randn(4, 9, 24)
    D = torch.randn(*((4, 3) if layout == "candidates" else (6,)), 13, 24)
    q_mask = d_mask = None
    normalize = case == "normalized"
    if case == "masked":
        q_mask = masks_with_holes((4, 9), "cpu")
        d_mask = masks_with_holes(D.shape[:-1], "cpu")
    elif case == "strided":
        Q = torch.randn(4, 24, 9).transpose(1, 2)
    elif case == "empty":
        Q = torch.randn(0, 9, 24)
        D = D[:0] if layout == "candidates" else D
    Q, D = Q.bfloat16(), D.bfloat16()
    ref = reference.maxsim_ref(Q.double(), D.double(), q_mask, d_mask, normalize=normalize)
    bound = 2.0**-8 * _max_terms_abs(Q, D, q_mask, d_mask, normalize) + 1e-5
    for forced in (None, False):
        decisions = {} if forced is None else {"bf16_product": forced}
        with settings.use_backend("torch"), forced_plan(**decisions), recording() as plans:
            out = maxsim(Q, D, q_mask, d_mask, normalize=normalize)
        assert plans[0][1].bf16_product == (forced is None)
        assert out.dtype == torch.float32 and out.shape == ref.shape
        err = (out.double() - ref).abs()
        if forced is None:
            assert bool((err <= bound).all()), (err - bound).max()
        else:
            assert bool((err <= 1e-4 * (1 + ref.abs())).all()), err.max()


def test_the_bf16_product_rule():
    """The bf16 product is taken for bf16 inference on a CPU only: not for fp16 or fp32, not when
    a gradient will be needed (rounded similarities tie and would move the argmax), not for the
    smooth max, not for the packed layouts."""
    def product(Q, D, **kwargs):
        with settings.use_backend("torch"), recording() as plans:
            maxsim(Q, D, **kwargs)
        return plans[0][1].bf16_product

    Q, D = torch.randn(2, 5, 8), torch.randn(3, 7, 8)
    assert product(Q.bfloat16(), D.bfloat16())
    assert product(Q.bfloat16(), D.bfloat16(), normalize=True)
    assert not product(Q.half(), D.half()) and not product(Q, D)
    assert not product(Q.bfloat16().requires_grad_(), D.bfloat16())
    assert not product(Q.bfloat16(), D.bfloat16(), reduction="smoothmax", tau=0.5)
    with settings.use_backend("torch"), recording() as plans:
        maxsim_varlen(Q.bfloat16().flatten(0, 1), D.bfloat16().flatten(0, 1),
                      torch.tensor([0, 5, 10]), torch.tensor([0, 7, 14, 21]), 5, 7)
    assert not plans[0][1].bf16_product


def test_the_bf16_orientation_rule():
    """The bf16 product is document-major when the query rows are a multiple of 64 (oneDNN's AMX
    product, design.md "PyTorch path"), query-major otherwise; forcing either still holds."""
    def orientation(Nq, Lq):
        with settings.use_backend("torch"), recording() as plans:
            maxsim(torch.randn(Nq, Lq, 8).bfloat16(), torch.randn(3, 5, 8).bfloat16())
        return plans[0][1].doc_major

    assert orientation(1, 64) and orientation(2, 64) and orientation(4, 32)
    assert not orientation(1, 32) and not orientation(3, 32) and not orientation(1, 96)
    with forced_plan(TORCH_BF16_DOC_MAJOR_ROW_MULTIPLE=32):
        assert orientation(1, 32) and not orientation(1, 48)
    with forced_plan(doc_major=False):
        assert not orientation(1, 64)
