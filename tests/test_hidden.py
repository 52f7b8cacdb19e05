"""maxsim_from_hidden and ProjectionHead: scores and the four gradients against an independent
float64 chain (F.linear rounded to the inputs' dtype, F.normalize, the float64 MaxSim), through
both routes of the plan, every error message."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers import masks_with_holes

from fusedmaxsim import ProjectionHead, forced_plan, maxsim_from_hidden, settings
from fusedmaxsim.planning import MEASURED, recording
from fusedmaxsim.reference import maxsim_ref
from fusedmaxsim.testing import relative_error, relative_error_fro

TOL = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 1e-4), torch.float16: (3e-3, 2e-2)}


def chain_ref(Q, H, W, b, q_mask, d_mask, normalize):
    """The float64 chain: the projection rounded to H's dtype (as F.linear's output; gradients
    straight through the rounding), normalized, scored by the float64 reference."""
    P = F.linear(H.double(), W.double(), None if b is None else b.double())
    P = P + (P.to(H.dtype).double() - P).detach()
    if normalize:
        P = F.normalize(P, dim=-1)
    return maxsim_ref(Q.double(), P, q_mask, d_mask)


def leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


def check(Q, H, W, b, q_mask=None, d_mask=None, normalize=True, sum_loss=False, route=None,
          H_ref=None, backward=None):
    """Scores and every gradient against the chain, under a forced route and backward (or the
    plan's). ``H_ref``: the chain's hidden states where ``H`` holds NaN in masked tokens."""
    dtype = H.dtype
    ts, tg = TOL[dtype]
    Qg, Hg, Wg, bg = leaves(Q, H, W, b)
    Qr, Hr, Wr, br = leaves(Q, H if H_ref is None else H_ref, W, b)
    decisions = {} if route is None else {"hidden_route": route}
    if backward is not None:
        decisions["hidden_bwd_kernel"] = backward
    with forced_plan(**decisions):
        out = maxsim_from_hidden(Qg, Hg, Wg, bg, q_mask, d_mask, normalize=normalize)
        ref = chain_ref(Qr, Hr, Wr, br, q_mask, d_mask, normalize)
        assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert relative_error(out, ref) <= ts, relative_error(out, ref)
        if out.numel() == 0:
            return
        if sum_loss:
            out.sum().backward()
            ref.sum().backward()
        else:
            g = torch.randn_like(ref)
            out.backward(g.to(out.dtype))
            ref.backward(g)
    for name, a, r in (("Q", Qg, Qr), ("H", Hg, Hr), ("W", Wg, Wr), ("b", bg, br)):
        if a is None:
            continue
        assert a.grad is not None and a.grad.dtype == a.dtype, name
        assert torch.isfinite(a.grad).all(), name
        if name == "H" and d_mask is not None:  # masked tokens receive exactly 0
            assert bool((a.grad[~d_mask] == 0).all())
        err = relative_error_fro(a.grad, r.grad)
        assert err <= tg, f"grad_{name}: {err:.2e}"


def problem(layout, dtype, Nq=3, Lq=5, K=4, Nd=6, Ld=9, d=24, d_model=40, bias=True):
    Q = torch.randn(Nq, Lq, d, dtype=dtype)
    H = torch.randn(*((Nq, K) if layout == "candidates" else (Nd,)), Ld, d_model, dtype=dtype)
    W = (torch.randn(d, d_model) / d_model**0.5).to(dtype)
    b = torch.randn(d, dtype=dtype) if bias else None
    return Q, H, W, b


@pytest.mark.parametrize("layout", ["cross", "candidates"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_float64_matches_the_chain_and_gradcheck(layout, normalize, bias):
    Q, H, W, b = problem(layout, torch.float64, bias=bias)
    check(Q, H, W, b, normalize=normalize)
    inputs = [t for t in leaves(Q, H, W, b) if t is not None]

    def fn(*args):
        return maxsim_from_hidden(*args, normalize=normalize)

    assert torch.autograd.gradcheck(fn, tuple(inputs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["cross", "candidates"])
@pytest.mark.parametrize("case", ["plain", "masked", "sum", "odd", "strided", "one_token",
                                  "even_dim"])
@pytest.mark.parametrize("route, backward", [("fused", "entries"), ("fused", "tiles"),
                                             ("unfused", "entries"), ("unfused", "tiles"),
                                             ("torch", None)])
def test_every_route_matches_the_chain(dtype, layout, case, route, backward):
    """The fused Triton kernel (under the interpreter here) and the route that writes the
    projection once, each with both Triton backwards, and the PyTorch path."""
    kw = {}
    if case == "odd":
        kw = dict(Nq=1, Lq=3, K=1, Nd=1, Ld=7, d=3, d_model=5)
    if case == "one_token":
        kw = dict(Lq=1, Ld=1)
    if case == "even_dim":  # d a power of two: the tiles' width, W read unmasked
        kw = dict(d=32, Ld=37)
    Q, H, W, b = problem(layout, dtype, **kw)
    q_mask = d_mask = H_ref = None
    if case == "masked":
        q_mask = masks_with_holes(Q.shape[:-1], "cpu")
        d_mask = masks_with_holes(H.shape[:-1], "cpu")
        H_ref = H
        H = H.masked_fill(~d_mask.unsqueeze(-1), float("nan"))  # masked values never matter
    if case == "strided":
        H = H.transpose(-1, -2).contiguous().transpose(-1, -2)
        W = W.t().contiguous().t()
        Q = Q.transpose(0, 1).contiguous().transpose(0, 1)
    with settings.use_backend("torch" if route == "torch" else "triton"):
        check(Q, H, W, b, q_mask, d_mask, sum_loss=case == "sum",
              route="unfused" if route == "torch" else route, H_ref=H_ref, backward=backward)


@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_backward_by_entry_and_by_row_agree(layout):
    """The closed-form backward recomputes winners one row an entry where entries are fewer
    than rows (long documents), every row of a chunk otherwise (the plan's choice, and each
    forced on both shapes); chunks of any width agree."""
    for Nq, Ld in ((1, 17), (4, 3)):  # entries < rows, then entries > rows
        Q, H, W, b = problem(layout, torch.float64, Nq=Nq, Ld=Ld)
        with recording() as plans:
            check(Q, H, W, b)
        chosen = [plan for _, plan in plans if plan.__class__.__name__ == "BackwardPlan"]
        assert chosen and chosen[0].hidden_by_entry == (Nq == 1)
        for by_entry in (False, True):
            with forced_plan(hidden_by_entry=by_entry), recording() as plans:
                check(Q, H, W, b)
                check(Q, H.transpose(-1, -3).contiguous().transpose(-1, -3), W, b)  # strided
            assert all(plan.hidden_by_entry == by_entry for _, plan in plans
                       if plan.__class__.__name__ == "BackwardPlan")
        for block in (1, 2**30):
            settings.set_torch_block_bytes(block)
            try:
                with recording() as plans:
                    check(Q, H, W, b)
                cols = [plan.hidden_cols for _, plan in plans
                        if plan.__class__.__name__ == "BackwardPlan"]
                assert cols == [1 if block == 1 else H.shape[-3]]
            finally:
                settings.set_torch_block_bytes(None)


def _head_plans(plans):
    return [plan for _, plan in plans if getattr(plan, "hidden_cols", 0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["cross", "candidates"])
@pytest.mark.parametrize("kernel", ["entries", "tiles"])
def test_triton_backward_chunks_index_and_partials(dtype, layout, kernel):
    """Each of the head's Triton backwards (the interpreter here): one column a chunk of its
    buffers or two (the last chunk short), grad_W in one fp32 partial or many, the token tiles
    through the winner index or not (the cross product); the entries in blocks, entries of one
    row in different blocks (17 on the cross product, 16 a block here); each agrees with the
    chain."""
    Q, H, W, b = problem(layout, dtype, Nq=2, Lq=17 if kernel == "entries" else 5, K=3, Nd=5,
                         Ld=23)
    one_column = dict(HIDDEN_BWD_MIN_BUFFER_BYTES=0, HIDDEN_BWD_BUFFER_SHARE=2**40)
    # Two columns a chunk, the last chunk short (5 documents, or 3 candidates): a column's
    # buffers as the planner counts them (entries: a token, grad_P and an fp32 g·P̂ an entry;
    # token tiles: a token, grad_P, P and an inverse norm a row).
    Nq, Lq, dim = Q.shape
    groups, Ld, size = (Nq if layout == "candidates" else 1), H.shape[-2], Q.element_size()
    column_bytes = (groups * (1 if layout == "candidates" else Nq) * Lq * (4 + dim * (size + 4))
                    if kernel == "entries" else groups * Ld * (4 + dim * size * 2 + 4))
    two_columns = dict(HIDDEN_BWD_MIN_BUFFER_BYTES=2 * column_bytes,
                       HIDDEN_BWD_BUFFER_SHARE=2**40)
    cases = [({}, None), (one_column, 1), (two_columns, 2),
             (dict(HIDDEN_WEIGHT_PARTIAL_SHARE=2**40), None),
             (dict(HIDDEN_WEIGHT_PARTIAL_SHARE=1, HIDDEN_WEIGHT_WAVES=64), None)]
    if layout == "cross" and kernel == "tiles":
        cases += [(dict(winner_index=True, **one_column), 1), (dict(winner_index=False), None)]
    for decisions, cols in cases:
        decisions = dict(decisions, hidden_bwd_kernel=kernel)
        with settings.use_backend("triton"), forced_plan(**decisions), recording() as plans:
            check(Q, H, W, b)
        (plan,) = _head_plans(plans)
        assert plan.kernel == kernel and plan.strategy == "lowmem"
        if cols is not None:
            assert plan.hidden_cols == cols
        if "HIDDEN_WEIGHT_PARTIAL_SHARE" in decisions:
            assert (plan.weight_groups == 1) == (decisions["HIDDEN_WEIGHT_PARTIAL_SHARE"] > 1)
        if "winner_index" in decisions:
            assert plan.winner_index == decisions["winner_index"]


@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_triton_backward_computes_only_what_is_asked(layout):
    """Each input alone needing its gradient (and the bias absent): the same gradient as when
    all four are asked for, on both backwards."""
    Q, H, W, b = problem(layout, torch.float32, Ld=11)
    g = torch.randn(Q.shape[0], H.shape[-3])
    for kernel in ("entries", "tiles", "torch"):
        with settings.use_backend("triton"), forced_plan(hidden_bwd_kernel=kernel):
            every = leaves(Q, H, W, b)
            maxsim_from_hidden(*every).backward(g)
            for k in range(4):
                one = [t.detach().requires_grad_(i == k) for i, t in enumerate((Q, H, W, b))]
                maxsim_from_hidden(*one).backward(g)
                torch.testing.assert_close(one[k].grad, every[k].grad, rtol=0, atol=0)
                assert all(t.grad is None for i, t in enumerate(one) if i != k)
            no_bias = leaves(Q, H, W)
            out = maxsim_from_hidden(*no_bias, None)
            out.backward(g)
            ref = leaves(Q, H, W)
            chain_ref(*ref, None, None, None, True).backward(g.double())
            for a, r in zip(no_bias, ref):
                assert relative_error_fro(a.grad, r.grad) <= TOL[torch.float32][1]


def test_the_backward_rule_and_its_errors():
    """On the Triton backend for fp16/bf16/fp32 with Q and H_d of one dtype: the entries kernel
    where a document's query tokens are fewer than its tokens / HIDDEN_BWD_ENTRY_SHARE, the
    token tiles elsewhere; the closed form on the PyTorch backend, for float64 and mixed dtypes;
    forcing checked."""
    def kernel(Q, H, backend, **decisions):
        W = torch.randn(8, 16, dtype=H.dtype)
        with settings.use_backend(backend), forced_plan(**decisions), recording() as plans:
            maxsim_from_hidden(Q.requires_grad_(), H, W).sum().backward()
        return _head_plans(plans)[0].kernel

    Q, H = torch.randn(2, 4, 8), torch.randn(3, 5, 16)  # 2 · 4 query tokens, 5 tokens
    assert kernel(Q, H, "triton") == "tiles"
    assert kernel(Q, H, "torch") == "torch"
    assert kernel(Q.double(), H.double(), "triton") == "torch"
    assert kernel(Q, H.half(), "triton") == "torch"  # mixed: the query promoted
    long_docs = torch.randn(3, 2 * 4 * 3 + 1, 16)  # 8 query tokens, 25 tokens
    assert kernel(Q, long_docs, "triton") == "entries"
    assert kernel(Q, long_docs, "triton", HIDDEN_BWD_ENTRY_SHARE=3) == "entries"
    assert kernel(Q, long_docs, "triton", HIDDEN_BWD_ENTRY_SHARE=4) == "tiles"
    candidates = torch.randn(2, 3, 5, 16)  # per-query candidates: 4 query tokens a document
    assert kernel(Q, candidates, "triton") == "entries"
    for forced in ("entries", "tiles", "torch"):
        assert kernel(Q, H, "triton", hidden_bwd_kernel=forced) == forced
    with pytest.raises(ValueError, match="hidden_bwd_kernel must be 'entries', 'tiles' or "
                                         "'torch', got 'gpu'"):
        kernel(Q, H, "triton", hidden_bwd_kernel="gpu")
    for Qx, Hx, backend in ((Q, H, "torch"), (Q.double(), H.double(), "triton"),
                            (Q, H.half(), "triton")):
        for forced in ("entries", "tiles"):
            with pytest.raises(ValueError, match=f"hidden_bwd_kernel='{forced}' needs the "
                                                 "Triton backend, fp16, bf16 or fp32 inputs"):
                kernel(Qx, Hx, backend, hidden_bwd_kernel=forced)


def test_a_hidden_block_the_kernels_cannot_step_is_refused():
    """HIDDEN_TILES' split-K step (forcible as every measured constant) must be a power of two
    of at least 16 (tl.dot's least)."""
    Q, H, W = torch.randn(2, 4, 8), torch.randn(3, 5, 16), torch.randn(8, 16)
    with settings.use_backend("triton"), forced_plan(hidden_route="fused",
                                                     HIDDEN_TILES=(16, 24, 4, 1)):
        with pytest.raises(ValueError, match=r"hidden_block must be a power of two >= 16, got 24"):
            maxsim_from_hidden(Q, H, W)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_batches_and_lengths(backend):
    for shape_q, shape_h in (((0, 5, 8), (3, 4, 16)), ((2, 5, 8), (0, 4, 16)),
                             ((2, 0, 8), (3, 4, 16)), ((2, 5, 8), (3, 0, 16))):
        Q, H = torch.randn(shape_q), torch.randn(shape_h)
        W, b = torch.randn(8, 16), torch.randn(8)
        Qg, Hg, Wg, bg = leaves(Q, H, W, b)
        with settings.use_backend(backend):
            out = maxsim_from_hidden(Qg, Hg, Wg, bg)
            assert out.shape == (shape_q[0], shape_h[0]) and bool((out == 0).all())
            out.sum().backward()
        for t in (Qg, Hg, Wg, bg):
            assert t.grad is not None and bool((t.grad == 0).all())


def test_a_2d_query_and_no_grad():
    Q, H, W, b = problem("cross", torch.float32)
    out = maxsim_from_hidden(Q[0], H, W, b)
    assert out.shape == (6,)
    torch.testing.assert_close(out, maxsim_from_hidden(Q, H, W, b)[0])
    with torch.no_grad(), recording() as plans:
        maxsim_from_hidden(Q.requires_grad_(), H, W, b)
    assert plans and not plans[0][0].save_argmax


def test_the_route_rule():
    """Fused while each document tile is projected at most HIDDEN_FUSED_MAX_PASSES times and the
    hidden states are at most HIDDEN_FUSED_MAX_BYTES, or beyond that where each tile is projected
    once and the tiles pad the document by at most HIDDEN_FUSED_MAX_PADDING; the PyTorch path
    always writes the projection once."""
    def route(Q, H, backend):
        with settings.use_backend(backend), recording() as plans:
            maxsim_from_hidden(Q, H, torch.randn(8, 16))
        return next(plan for _, plan in plans if plan.hidden_route).hidden_route

    H = torch.randn(3, 5, 16)
    assert route(torch.randn(1, 32, 8), H, "torch") == "unfused"
    assert route(torch.randn(1, 32, 8), H, "triton") == "fused"
    assert route(torch.randn(64, 32, 8), H, "triton") == "unfused"  # many query blocks
    assert route(torch.randn(64, 32, 8), torch.randn(64, 2, 5, 16), "triton") == "fused"
    assert route(torch.randn(1, 200, 8), H, "triton") == "unfused"  # several query chunks
    with forced_plan(HIDDEN_FUSED_MAX_BYTES=3 * 5 * 16 * 4 - 1):  # H is 960 bytes
        assert route(torch.randn(1, 32, 8), H, "triton") == "unfused"
    with forced_plan(HIDDEN_FUSED_MAX_PASSES=10**6):
        assert route(torch.randn(64, 32, 8), H, "triton") == "fused"
    # Beyond the bytes: 16-token tiles pad 16 tokens by 0, 15 by 1/15, 13 by 3/13.
    with forced_plan(HIDDEN_FUSED_MAX_BYTES=0, HIDDEN_TILES=(16, 16, 4, 1)):
        for Ld, expected in ((16, "fused"), (15, "fused"), (13, "unfused")):
            assert route(torch.randn(1, 32, 8), torch.randn(3, Ld, 16), "triton") == expected
        with forced_plan(HIDDEN_FUSED_MAX_PADDING=0):
            assert route(torch.randn(1, 32, 8), torch.randn(3, 15, 16), "triton") == "unfused"
        assert route(torch.randn(64, 32, 8), torch.randn(3, 16, 16), "triton") == "unfused"
    with pytest.raises(ValueError, match="hidden_route must be 'fused' or 'unfused'"):
        with forced_plan(hidden_route="both"):
            route(torch.randn(1, 4, 8), H, "torch")
    with pytest.raises(ValueError, match="hidden_route='fused' needs the Triton backend"):
        with forced_plan(hidden_route="fused"):
            route(torch.randn(1, 4, 8), H, "torch")


def test_the_short_tiles_rule():
    """HIDDEN_SHORT_TILES where HIDDEN_TILES' tiles pad a document by more than
    HIDDEN_FUSED_MAX_PADDING and the short ones pad it less; the route's padding line then
    counts the short tiles'. None (the default under the interpreter): never. Forced tiles win."""
    def plan(Ld, **decisions):
        with settings.use_backend("triton"), forced_plan(**decisions), recording() as plans:
            maxsim_from_hidden(torch.randn(1, 4, 8), torch.randn(3, Ld, 16), torch.randn(8, 16))
        forward = next(plan for _, plan in plans if plan.hidden_route)
        return forward.tiles.block_n, forward.hidden_route, forward

    if MEASURED["HIDDEN_SHORT_TILES"] is None:
        assert plan(47)[0] == MEASURED["HIDDEN_TILES"][0]
    both = dict(HIDDEN_TILES=(32, 16, 4, 1), HIDDEN_SHORT_TILES=(16, 16, 4, 1),
                HIDDEN_FUSED_MAX_BYTES=0, HIDDEN_FUSED_MAX_PADDING=1 / 8)
    # 32-token tiles pad 47 tokens by 36%, 16-token ones by 2%: short, and fused.
    block_n, route, forward = plan(47, **both)
    assert (block_n, route) == (16, "fused")
    assert forward.reasons[-1].startswith("tiles: HIDDEN_SHORT_TILES (HIDDEN_TILES' pad by 36%)")
    assert plan(47, **dict(both, HIDDEN_SHORT_TILES=None))[:2] == (32, "unfused")
    # 40 tokens: 60% and 20%, short and unfused; 60: 7%, long; 64: none; 17: 88% either way.
    assert plan(40, **both)[:2] == (16, "unfused")
    assert plan(60, **both)[:2] == (32, "fused")
    assert plan(64, **both)[:2] == (32, "fused")
    assert plan(17, **both)[:2] == (32, "unfused")
    assert plan(17, **dict(both, HIDDEN_SHORT_TILES=(8, 16, 4, 1)))[0] == 8  # 41%
    tiles = dataclasses.replace(forward.tiles, block_n=32)
    block_n, _, forced = plan(47, fwd_tiles=tiles, **both)
    assert block_n == 32 and forced.reasons[-1].startswith("tiles: forced, ")


def test_projection_head_module():
    linear = torch.nn.Linear(16, 8)
    head = ProjectionHead.from_linear(linear)
    assert head.weight is linear.weight and head.bias is linear.bias
    assert "d_model=16, d=8, bias=True, normalize=True" in repr(head)
    Q, H = head.project(torch.randn(2, 5, 16)), torch.randn(3, 7, 16)
    torch.testing.assert_close(head(Q, H), maxsim_from_hidden(Q, H, linear.weight, linear.bias))
    head(Q.detach(), H).sum().backward()
    assert linear.weight.grad is not None and linear.bias.grad is not None
    plain = ProjectionHead(16, 8, bias=False, normalize=False)
    assert plain.bias is None and not plain.normalize
    torch.testing.assert_close(plain.project(H), F.linear(H, plain.weight))
    with pytest.raises(TypeError, match="linear must be a torch.nn.Linear, got Conv1d"):
        ProjectionHead.from_linear(torch.nn.Conv1d(2, 2, 1))
    with pytest.raises(TypeError, match="normalize must be True or False"):
        ProjectionHead(16, 8, normalize=1)


def test_double_backward_raises_a_clear_error():
    Q, H, W, b = leaves(*problem("cross", torch.float64))
    out = maxsim_from_hidden(Q, H, W, b)
    (gq,) = torch.autograd.grad(out.sum(), Q, create_graph=True)
    with pytest.raises(RuntimeError, match="fusedmaxsim: double backward is not supported"):
        gq.sum().backward()


@pytest.mark.parametrize("args, error, message", [
    (dict(Q=torch.randn(2, 3, 4, 5)), ValueError, r"Q must be \[Lq, d\] or \[Nq, Lq, d\]"),
    (dict(H=torch.randn(4, 16)), ValueError, r"H_d must be \[Nd, Ld, d_model\] or \[Nq, K, Ld"),
    (dict(W=torch.randn(8)), ValueError, r"W must be \[d, d_model\]"),
    (dict(W=torch.randn(8, 15)), ValueError, r"must have H_d's d_model = 16 columns"),
    (dict(W=torch.randn(9, 16)), ValueError, r"must project to Q's embedding dim d = 8"),
    (dict(b=torch.randn(9)), ValueError, r"b must be \[d\] = \(8,\)"),
    (dict(W=torch.randn(8, 16).double()), TypeError, r"W must have H_d's dtype torch.float32 "
     r"\(as F.linear requires outside autocast; nothing is cast here, under autocast either\), "
     r"got torch.float64"),
    (dict(b=torch.randn(8).half()), TypeError, r"b must have H_d's dtype"),
    (dict(H=torch.randn(3, 2, 5, 16)), ValueError, r"per-query candidate layout .* same Nq"),
    (dict(q_mask=torch.ones(2, 5, dtype=torch.bool)), ValueError, r"q_mask must be \[Nq, Lq\]"),
    (dict(d_mask=torch.ones(3, 4, dtype=torch.bool)), ValueError, r"d_mask must be \[Nd, Ld\]"),
    (dict(H=torch.randn(3, 5, 16).long()), TypeError, r"H_d must be float16, bfloat16"),
    (dict(normalize="yes"), TypeError, r"normalize must be True or False"),
    (dict(backward="fast"), ValueError, r"backward= must be one of"),
])
def test_errors(args, error, message):
    kw = dict(Q=torch.randn(2, 4, 8), H=torch.randn(3, 5, 16), W=torch.randn(8, 16),
              b=torch.randn(8))
    kw.update(args)
    rest = {k: kw.pop(k) for k in ("q_mask", "d_mask", "normalize", "backward") if k in kw}
    with pytest.raises(error, match=message):
        maxsim_from_hidden(kw["Q"], kw["H"], kw["W"], kw["b"], **rest)


def test_mixed_query_dtype_is_promoted():
    """An fp32 Q against bf16 hidden states: the projection (bf16, as F.linear's) promoted with Q."""
    Q, H, W, b = problem("cross", torch.float32)
    Hb, Wb, bb = H.bfloat16(), W.bfloat16(), b.bfloat16()
    out = maxsim_from_hidden(Q, Hb, Wb, bb)
    ref = chain_ref(Q, Hb, Wb, bb, None, None, True)
    assert relative_error(out, ref) <= 1e-5


def test_normalizing_front_doors_compile_on_the_triton_backend():
    """Under torch.compile the inverse norms are the traced PyTorch expression (the Triton
    launcher cannot be traced): maxsim(normalize=True), maxsim_residual_varlen and
    maxsim_from_hidden compile with fullgraph=True on the Triton backend (the interpreter here)
    and equal eager, scores and grad_Q."""
    from fusedmaxsim import maxsim
    from fusedmaxsim.plaid import maxsim_residual_varlen

    torch._dynamo.reset()
    d = 32
    lengths = torch.tensor([5, 0, 9])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    codes = torch.randint(0, 16, (int(cu[-1]),))
    residuals = torch.randint(0, 256, (codes.shape[0], d * 2 // 8), dtype=torch.uint8)
    centroids, weights = torch.randn(16, d), torch.randn(4) * 0.1
    D, H, W, b = torch.randn(3, 9, d), torch.randn(3, 9, 20), torch.randn(d, 20), torch.randn(d)
    steps = [
        lambda q: maxsim(q, D, normalize=True),
        lambda q: maxsim_residual_varlen(q, codes, residuals, cu, centroids, weights, 2,
                                         max_seqlen_d=9),
        lambda q: maxsim_from_hidden(q, H, W, b),
    ]
    Q = torch.randn(2, 7, d)
    with settings.use_backend("triton"):
        for step in steps:
            results = []
            for fn in (torch.compile(step, fullgraph=True), step):
                q = Q.clone().requires_grad_()
                out = fn(q)
                out.sum().backward()
                results.append((out.detach(), q.grad))
            torch.testing.assert_close(*[r[0] for r in results])
            torch.testing.assert_close(*[r[1] for r in results])
