"""GPU suite for the fused projection head (``pytest -m gpu``): maxsim_from_hidden on CUDA, both
routes (the fused Triton kernel and the projection written once) and both backwards (the Triton
kernels, the PyTorch closed form), bf16/fp16/fp32 scores and all four gradients against the
float64 chain; opcheck of its ops and a compiled step."""

import pytest
import torch
import torch.nn.functional as F
from helpers import masks_with_holes

from fusedmaxsim import forced_plan, maxsim, maxsim_from_hidden, settings
from fusedmaxsim._autograd import maxsim_hidden_bwd, maxsim_hidden_fwd
from fusedmaxsim.planning import MEASURED, ForwardPlan, recording
from fusedmaxsim.reference import maxsim_ref
from fusedmaxsim.testing import relative_error, relative_error_fro

pytestmark = pytest.mark.gpu

BOUNDS = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (5e-3, 1e-2), torch.float32: (1e-5, 1e-4)}


def _chain(Q, H, W, b, q_mask, d_mask, normalize):
    P = F.linear(H.double(), W.double(), None if b is None else b.double())
    P = P + (P.to(H.dtype).double() - P).detach()
    return maxsim_ref(Q.double(), F.normalize(P, dim=-1) if normalize else P, q_mask, d_mask)


def _inputs(layout, dtype, Nq=3, Lq=37, K=4, Nd=9, Ld=300, d=128, d_model=384, bias=True):
    """Hidden states in {-1, 0, 1}, W and b in sixteenths: every projected value is a multiple
    of 1/16 below 2^8 / 16 in magnitude, exact in fp32 and in 16 bits whatever the order of the
    sum, so the fused kernel, F.linear and the float64 chain round nothing (a 16-bit projection
    summed in another order could otherwise move a near-tie's winner)."""
    Q = F.normalize(torch.randn(Nq, Lq, d, device="cuda"), dim=-1).to(dtype)
    shape = (Nq, K) if layout == "candidates" else (Nd,)
    H = torch.randint(-1, 2, (*shape, Ld, d_model), device="cuda").to(dtype)
    W = (torch.randint(-1, 2, (d, d_model), device="cuda") * (torch.rand(d, d_model, device="cuda")
                                                              < 0.1) / 16).to(dtype)
    b = (torch.randint(-8, 9, (d,), device="cuda") / 16).to(dtype) if bias else None
    return Q, H, W, b


# Both Triton backwards on every case; the PyTorch closed form on bf16 only (the slower one).
PARITY = [(dtype, layout, route, masked, backward)
          for backward, dtypes in (("entries", (torch.bfloat16, torch.float16, torch.float32)),
                                   ("tiles", (torch.bfloat16, torch.float16, torch.float32)),
                                   ("torch", (torch.bfloat16,)))
          for dtype in dtypes for layout in ("cross", "candidates")
          for route in ("fused", "unfused") for masked in (False, True)]


@pytest.mark.parametrize("dtype, layout, route, masked, backward", PARITY, ids=[
    f"{str(c[0])[6:]}-{c[1]}-{c[2]}-{'masked' if c[3] else 'plain'}-{c[4]}" for c in PARITY])
def test_hidden_parity_on_cuda(dtype, layout, route, masked, backward):
    Q, H, W, b = _inputs(layout, dtype)
    q_mask = masks_with_holes(Q.shape[:-1], "cuda") if masked else None
    d_mask = masks_with_holes(H.shape[:-1], "cuda") if masked else None
    if masked:  # a masked token's hidden state never matters, NaN included
        H = H.masked_fill(~d_mask.unsqueeze(-1), float("nan"))
    leaves = [t.detach().requires_grad_() for t in (Q, H, W, b)]
    refs = [t.detach().double().requires_grad_() for t in (Q, H.nan_to_num(0.0), W, b)]
    with forced_plan(hidden_route=route, hidden_bwd_kernel=backward):
        out = maxsim_from_hidden(*leaves, q_mask, d_mask)
        ref = _chain(*refs, q_mask, d_mask, True)
        ts, tg = BOUNDS[dtype]
        assert relative_error(out, ref) <= ts
        grad = torch.randn_like(ref)
        out.backward(grad.float())
        ref.backward(grad)
    for name, a, r in zip("QHWb", leaves, refs):
        assert a.grad.dtype == a.dtype and torch.isfinite(a.grad).all(), name
        assert relative_error_fro(a.grad, r.grad) <= tg, (name, relative_error_fro(a.grad, r.grad))


SHORT_TILES = MEASURED["HIDDEN_SHORT_TILES"]  # the fused head's short tiles (NOTES §80, §83)


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
@pytest.mark.parametrize("layout", ["cross", "candidates"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_short_tiles_parity_on_cuda(dtype, layout, masked):
    """The fused forward at the short tiles (64 tokens, 4 warps), which the plan takes for
    documents that its long tiles pad (300 tokens), in a training step with the argmax: scores
    and all four gradients within the float64 chain's bounds."""
    Q, H, W, b = _inputs(layout, dtype, d_model=392)
    q_mask = masks_with_holes(Q.shape[:-1], "cuda") if masked else None
    d_mask = masks_with_holes(H.shape[:-1], "cuda") if masked else None
    leaves = [t.detach().requires_grad_() for t in (Q, H, W, b)]
    refs = [t.detach().double().requires_grad_() for t in (Q, H, W, b)]
    ref = _chain(*refs, q_mask, d_mask, True)
    grad = torch.randn_like(ref)
    with forced_plan(hidden_route="fused", hidden_bwd_kernel="entries",
                     HIDDEN_SHORT_TILES=SHORT_TILES), recording() as plans:
        out = maxsim_from_hidden(*leaves, q_mask, d_mask)
        out.backward(grad.float())
    (forward,) = [plan for _, plan in plans if isinstance(plan, ForwardPlan)]
    assert forward.tiles.block_n == SHORT_TILES[0]
    ts, tg = BOUNDS[dtype]
    assert relative_error(out, ref) <= ts
    ref.backward(grad)
    for name, a, r in zip("QHWb", leaves, refs):
        assert relative_error_fro(a.grad, r.grad) <= tg, (name, relative_error_fro(a.grad, r.grad))


@pytest.mark.parametrize("route", ["fused", "unfused"])
def test_autocast_changes_nothing_on_cuda(route):
    """Under torch.autocast (bf16 on CUDA) fp32 inputs are scored as without it, bit for bit:
    the head on each route and maxsim normalized, the backward inside the autocast block."""
    Q, H, W, b = _inputs("cross", torch.float32)
    D = F.normalize(torch.randn(5, 70, 128, device="cuda"), dim=-1)
    calls = ((lambda q, h, w, bb: maxsim_from_hidden(q, h, w, bb), (Q, H, W, b)),
             (lambda q, d: maxsim(q, d, normalize=True), (Q, D)))
    for fn, inputs in calls:
        found = []
        for on in (False, True):
            leaves = [t.detach().requires_grad_() for t in inputs]
            with forced_plan(hidden_route=route), torch.autocast("cuda", torch.bfloat16,
                                                                 enabled=on):
                out = fn(*leaves)
                torch.manual_seed(2)
                out.backward(torch.randn_like(out))
            found.append([out, *(t.grad for t in leaves)])
        assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(*found))


@pytest.mark.parametrize("kernel", ["entries", "tiles"])
@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_triton_backward_in_chunks_through_the_index_on_cuda(layout, kernel):
    """Each Triton backward in one-column chunks (the token tiles through the winner index on
    the cross product) and in one chunk, bf16 with a stride-0 upstream gradient: every
    gradient within the bound of the float64 chain; no host synchronization."""
    Q, H, W, b = _inputs(layout, torch.bfloat16, Nq=4, Lq=32, K=3, Nd=7, Ld=260)
    grads = {}
    for name, decisions in (("one chunk", {}),
                            ("columns", dict(HIDDEN_BWD_MIN_BUFFER_BYTES=0,
                                             HIDDEN_BWD_BUFFER_SHARE=2**40, winner_index=True))):
        if layout == "candidates" or kernel == "entries":
            decisions.pop("winner_index", None)
        leaves = [t.detach().requires_grad_() for t in (Q, H, W, b)]
        with forced_plan(hidden_bwd_kernel=kernel, **decisions):
            out = maxsim_from_hidden(*leaves)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                out.sum().backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        grads[name] = [t.grad for t in leaves]
    refs = [t.detach().double().requires_grad_() for t in (Q, H, W, b)]
    _chain(*refs, None, None, True).sum().backward()
    for name, found in grads.items():
        for g, r, which in zip(found, refs, "QHWb"):
            err = relative_error_fro(g, r.grad)
            assert err <= BOUNDS[torch.bfloat16][1], (name, which, err)


@pytest.mark.parametrize("kernel", ["entries", "tiles"])
def test_triton_backwards_with_wide_rows_on_cuda(kernel):
    """d = 256 and 512 (the entries kernel holds fewer entries a program): bf16 gradients within
    the bound of the float64 chain."""
    for d in (256, 512):
        Q, H, W, b = _inputs("cross", torch.bfloat16, Nq=3, Lq=40, Nd=4, Ld=300, d=d,
                             d_model=384)
        leaves = [t.detach().requires_grad_() for t in (Q, H, W, b)]
        refs = [t.detach().double().requires_grad_() for t in (Q, H, W, b)]
        with forced_plan(hidden_bwd_kernel=kernel):
            out = maxsim_from_hidden(*leaves)
            grad = torch.randn_like(out)
            out.backward(grad)
        _chain(*refs, None, None, True).backward(grad.double())
        for name, a, r in zip("QHWb", leaves, refs):
            err = relative_error_fro(a.grad, r.grad)
            assert err <= BOUNDS[torch.bfloat16][1], (d, name, err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_inference_matches_unfused_and_long_inputs(dtype):
    """A long query (several query chunks), d_model not a multiple of the kernel's step, no
    bias, no normalize: the fused route equals the written projection's scores."""
    Q, H, W, _ = _inputs("cross", dtype, Nq=2, Lq=130, Nd=5, Ld=77, d=96, d_model=200)
    with torch.no_grad():
        outs = {}
        for route in ("fused", "unfused"):
            with forced_plan(hidden_route=route):
                outs[route] = maxsim_from_hidden(Q, H, W, None, normalize=False)
    ref = _chain(Q, H, W, None, None, None, False)
    assert relative_error(outs["fused"], ref) <= BOUNDS[dtype][0]
    assert relative_error(outs["unfused"], ref) <= BOUNDS[dtype][0]


def test_hidden_ops_pass_opcheck_and_compile_on_cuda():
    Q, H, W, b = _inputs("cross", torch.bfloat16, Ld=64)
    for route in ("fused", "unfused"):
        with forced_plan(hidden_route=route):
            for save in (False, True):
                args = (Q, H, W, b, None, None, True, save, "triton", "ieee")
                torch.library.opcheck(maxsim_hidden_fwd, args)
    scores, argmax = maxsim_hidden_fwd(Q, H, W, b, None, None, True, True, "triton", "ieee")
    for backward in ("entries", "tiles", "torch"):
        with forced_plan(hidden_bwd_kernel=backward):
            torch.library.opcheck(maxsim_hidden_bwd, (torch.randn_like(scores), Q, H, W, b,
                                                      argmax, True, True, True, True, True,
                                                      "triton", "ieee"))

    torch._dynamo.reset()
    # fp32 in exact IEEE products: the compiled and eager steps must agree to fp32's rounding
    # (in bf16, a different order of the loss's backward moves a few weight-gradient roundings).
    settings.set_fp32_precision("ieee")
    torch.backends.cuda.matmul.allow_tf32 = False
    linear = torch.nn.Linear(384, 128, device="cuda")
    Q, H = Q.float(), H.float()

    def step(Q, H):
        scores = maxsim_from_hidden(Q, H, linear.weight, linear.bias)
        return F.cross_entropy(scores / 0.05, torch.arange(scores.shape[0], device="cuda"))

    Qs, Hs = Q[:3].detach(), H[:3].detach()
    eager = step(Qs, Hs)
    eager.backward()
    g_eager = linear.weight.grad.clone()
    linear.weight.grad = None
    compiled = torch.compile(step, fullgraph=True)(Qs, Hs)
    compiled.backward()
    settings.set_fp32_precision(None)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(linear.weight.grad, g_eager)
