"""The fused projection head's forward kernel (``_launch.forward.forward_hidden``), called
directly with a hand-built Problem and ForwardPlan, against an independent float64 oracle: the
projection ``F.linear`` in float64 rounded to the input dtype, normalized in float64, then the
masked max, argmax and sum.

Sizes are odd on purpose: d=24 (BLOCK_K 32), d_model=40 (not a multiple of the d_model step),
Ld=37 with 16-token tiles (two full tiles and a tail), Lq=19 with 16-row chunks (two chunks)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import fusedmaxsim._launch.forward as launch_forward
from fusedmaxsim._launch.forward import forward_hidden
from fusedmaxsim._plan import ForwardPlan, argmax_dtype, fwd_heuristic
from fusedmaxsim._problem import HIDDEN, HIDDEN_CANDIDATES, Problem
from fusedmaxsim.testing import assert_close_to_reference

# (scores, argmax near-ties): relative bounds.
TOL = {torch.float32: 1e-4, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.float16]


def _inputs(Nq, Lq, Ncols, Ld, d, d_model, dtype, *, candidates=False, bias=True):
    """``(Q, H, W, b)``; W scaled so that the projected tokens are of order 1."""
    Q = torch.randn(Nq, Lq, d).to(dtype)
    H = torch.randn(*((Nq,) if candidates else ()), Ncols, Ld, d_model).to(dtype)
    W = (torch.randn(d, d_model) / d_model**0.5).to(dtype)
    b = torch.randn(d).to(dtype) if bias else None
    return Q, H, W, b


def _masks(Nq, Lq, Ncols, Ld, *, candidates=False):
    """``(q_mask, d_mask)``: query 0 fully masked, the others with holes; document (column) 0
    fully masked, column 1 padded (a valid prefix), column 2 with holes, the rest all valid."""
    q_mask = torch.rand(Nq, Lq) > 0.3
    q_mask[0] = False
    d_mask = torch.ones(*((Nq,) if candidates else ()), Ncols, Ld, dtype=torch.bool)
    d_mask[..., 0, :] = False
    d_mask[..., 1, Ld // 2:] = False
    d_mask[..., 2, :] = torch.rand(d_mask[..., 2, :].shape) > 0.4
    return q_mask, d_mask


def _call(Q, H, W, b, q_mask, d_mask, *, normalize, save_argmax=True, hidden_block=16,
          block_n=16, lq_tile=16, queries_per_block=None, dtype=None):
    """``forward_hidden`` with a hand-built Problem and ForwardPlan (fp32 products in IEEE)."""
    candidates = H.dim() == 4
    Nq, Lq, d = Q.shape
    dtype = dtype or H.dtype
    cfg = fwd_heuristic(max(Lq, 1), d, max(Nq, 1), candidates, dtype.itemsize)
    cfg = dataclasses.replace(cfg, block_n=block_n, lq_tile=lq_tile,
                              queries_per_block=queries_per_block or cfg.queries_per_block)
    plan = ForwardPlan("triton", cfg, hidden_route="fused", hidden_block=hidden_block)
    p = Problem(
        layout=HIDDEN_CANDIDATES if candidates else HIDDEN, Nq=Nq, Ncols=H.shape[-3], Lq=Lq,
        Ld=H.shape[-2], dim=d, dtype=dtype, device=Q.device, has_q_mask=q_mask is not None,
        has_d_mask=d_mask is not None, normalize=normalize, norm_from_tiles=normalize, tau=0.0,
        save_argmax=save_argmax, tma_ready=False, d_model=H.shape[-1], has_bias=b is not None,
    )
    return forward_hidden(plan, p, "ieee", Q, H, W, b, q_mask, d_mask)


def _reference(Q, H, W, b, q_mask, d_mask, *, normalize):
    """``(scores, argmax, S)`` in float64; ``S [Nq, Ncols, Lq, Ld]`` the similarities, -inf at
    masked document tokens."""
    P = F.linear(H.double(), W.double(), None if b is None else b.double()).to(H.dtype).double()
    if normalize:
        P = P / P.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    if H.dim() == 4:
        S = torch.einsum("isk,ictk->icst", Q.double(), P)
    else:
        S = torch.einsum("isk,jtk->ijst", Q.double(), P)
    if d_mask is not None:
        dm = d_mask if d_mask.dim() == 3 else d_mask.unsqueeze(0)
        S = S.masked_fill(~dm.unsqueeze(2), float("-inf"))
    best, arg = S.max(-1)  # the first index among ties
    adds = best != float("-inf")
    if q_mask is not None:
        adds = adds & q_mask.unsqueeze(1)
    scores = torch.where(adds, best, 0.0).sum(-1)
    return scores, torch.where(adds, arg, -1), S


def _check(out, ref, dtype, Ld, save_argmax=True):
    scores, argmax = out
    ref_scores, ref_arg, S = ref
    assert scores.dtype == torch.float32 and scores.shape == ref_scores.shape
    assert_close_to_reference(scores, ref_scores, TOL[dtype], "scores")
    if not save_argmax:
        assert argmax.numel() == 0
        return
    assert argmax.dtype == argmax_dtype(Ld) and argmax.shape == ref_arg.shape
    arg = argmax.long()
    none = ref_arg == -1
    assert torch.equal(arg == -1, none), "argmax: -1 exactly where the query token adds nothing"
    # Where the token adds: the kernel's token must be valid and reach the max; it must be the
    # reference's own where the runner-up is not within the tolerance (no near-tie).
    assert bool(((arg >= 0) & (arg < Ld))[~none].all())
    picked = S.gather(-1, arg.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    top2 = S.topk(min(2, Ld), dim=-1).values
    best = top2[..., 0]
    slack = TOL[dtype] * best.abs().clamp_min(1.0)
    assert bool((picked >= best - slack)[~none].all()), "argmax: the token reaches the max"
    if Ld > 1:
        clear = ~none & (top2[..., 0] - top2[..., 1] > slack)
        assert torch.equal(arg[clear], ref_arg[clear])
        assert int(clear.sum()) > 0.5 * int((~none).sum())  # most of them checked exactly


@pytest.mark.parametrize("masks", [False, True], ids=["no_masks", "masks"])
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("candidates", [False, True], ids=["cross", "candidates"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_scores_and_argmax(dtype, candidates, bias, normalize, masks):
    """Both layouts, with and without bias, normalization and masks (a fully masked query and
    a fully masked document among them); several query blocks and chunks, document tiles and a
    tail, and d_model steps with a tail."""
    Nq, Lq, Ncols, Ld, d, d_model = 3, 19, 4, 37, 24, 40
    Q, H, W, b = _inputs(Nq, Lq, Ncols, Ld, d, d_model, dtype, candidates=candidates, bias=bias)
    q_mask, d_mask = _masks(Nq, Lq, Ncols, Ld, candidates=candidates) if masks else (None, None)
    out = _call(Q, H, W, b, q_mask, d_mask, normalize=normalize,
                hidden_block=32 if bias else 16, queries_per_block=1 if candidates else 2)
    ref = _reference(Q, H, W, b, q_mask, d_mask, normalize=normalize)
    _check(out, ref, dtype, Ld)
    if masks:  # the fully masked query and document add nothing
        assert torch.equal(out[0][0], torch.zeros(Ncols))
        assert torch.equal(out[0][:, 0], torch.zeros(Nq))


@pytest.mark.parametrize(
    "d, d_model, hidden_block",
    [(24, 40, 32), (32, 64, 32), (16, 8, 16), (24, 1, 16), (40, 70, 16)],
    ids=["tail", "whole_steps", "only_tail", "d_model_1", "d40"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_widths(dtype, d, d_model, hidden_block):
    """d_model in whole steps, in a tail step only, and with both; d a power of two (no bound
    on the embedding dim) and not."""
    Nq, Lq, Ncols, Ld = 2, 5, 3, 21
    Q, H, W, b = _inputs(Nq, Lq, Ncols, Ld, d, d_model, dtype)
    out = _call(Q, H, W, b, None, None, normalize=True, hidden_block=hidden_block)
    _check(out, _reference(Q, H, W, b, None, None, normalize=True), dtype, Ld)


@pytest.mark.parametrize("candidates", [False, True], ids=["cross", "candidates"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_one_token_documents(dtype, candidates):
    """Ld=1: every document is one tail tile; a masked one adds nothing."""
    Nq, Lq, Ncols, Ld, d, d_model = 3, 7, 4, 1, 24, 40
    Q, H, W, b = _inputs(Nq, Lq, Ncols, Ld, d, d_model, dtype, candidates=candidates)
    d_mask = torch.ones(H.shape[:-1], dtype=torch.bool)
    d_mask[..., 1, :] = False
    out = _call(Q, H, W, b, None, d_mask, normalize=True)
    _check(out, _reference(Q, H, W, b, None, d_mask, normalize=True), dtype, Ld)
    assert bool((out[1][:, 1] == -1).all())


@pytest.mark.parametrize("candidates", [False, True], ids=["cross", "candidates"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_strided_inputs(dtype, candidates):
    """Views with no unit stride where the kernel would expect one: H with its token axis
    outermost, H with a hidden-dim stride of Ld, W transposed, Q transposed."""
    Nq, Lq, Ncols, Ld, d, d_model = 3, 6, 4, 37, 24, 40
    Q, H, W, b = _inputs(Nq, Lq, Ncols, Ld, d, d_model, dtype, candidates=candidates)
    q_mask, d_mask = _masks(Nq, Lq, Ncols, Ld, candidates=candidates)
    ref = _reference(Q, H, W, b, q_mask, d_mask, normalize=True)
    W_t = W.t().contiguous().t()
    Q_t = Q.transpose(1, 2).contiguous().transpose(1, 2)
    tok_outer = H.movedim(-2, 0).contiguous().movedim(0, -2)  # [Ld, ..., d_model] storage
    dim_strided = H.transpose(-1, -2).contiguous().transpose(-1, -2)  # stride(-1) == Ld
    for H_view in (tok_outer, dim_strided):
        assert not H_view.is_contiguous() and torch.equal(H_view, H)
        out = _call(Q_t, H_view, W_t, b, q_mask, d_mask, normalize=True)
        _check(out, ref, dtype, Ld)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_without_argmax(dtype):
    """Inference: the same scores bit for bit, and the shared empty argmax."""
    Nq, Lq, Ncols, Ld, d, d_model = 3, 19, 4, 37, 24, 40
    Q, H, W, b = _inputs(Nq, Lq, Ncols, Ld, d, d_model, dtype)
    q_mask, d_mask = _masks(Nq, Lq, Ncols, Ld)
    saved = _call(Q, H, W, b, q_mask, d_mask, normalize=True, save_argmax=True)
    out = _call(Q, H, W, b, q_mask, d_mask, normalize=True, save_argmax=False)
    _check(out, _reference(Q, H, W, b, q_mask, d_mask, normalize=True), dtype, Ld,
           save_argmax=False)
    assert torch.equal(out[0], saved[0])


def test_queries_in_another_dtype():
    """fp32 queries against fp16 hidden states: the projected tile is rounded to fp16, as
    F.linear's output is, and the similarities are fp32. Integer data keep every fp32 sum exact
    while the projections pass 2048, where fp16 rounds them: scores and argmax (ties included)
    exactly the reference's."""
    Nq, Lq, Ncols, Ld, d, d_model = 2, 5, 3, 21, 24, 40
    Q = torch.randint(-4, 5, (Nq, Lq, d)).float()
    H = torch.randint(-4, 5, (Ncols, Ld, d_model)).half()
    W = torch.randint(-100, 101, (d, d_model)).half()
    b = torch.randint(-100, 101, (d,)).half()
    scores, argmax = _call(Q, H, W, b, None, None, normalize=False, dtype=torch.float32)
    ref_scores, ref_arg, _ = _reference(Q, H, W, b, None, None, normalize=False)
    unrounded = _reference(Q, H.float(), W.float(), b.float(), None, None, normalize=False)[0]
    assert not torch.equal(unrounded, ref_scores)  # the rounding shows
    assert torch.equal(scores.double(), ref_scores)
    assert torch.equal(argmax.long(), ref_arg)


@pytest.mark.parametrize("candidates", [False, True], ids=["cross", "candidates"])
@pytest.mark.parametrize("save_argmax", [False, True])
@pytest.mark.parametrize(
    "Nq, Ncols, Lq, Ld", [(0, 4, 5, 9), (3, 0, 5, 9), (3, 4, 0, 9), (3, 4, 5, 0)],
    ids=["Nq=0", "Nd=0", "Lq=0", "Ld=0"],
)
def test_empty_problems_launch_nothing(monkeypatch, Nq, Ncols, Lq, Ld, save_argmax, candidates):
    """No kernel runs; empty queries or documents score 0, their tokens' argmax -1."""
    def no_launch(kernel):
        raise AssertionError("an empty problem launched a kernel")

    monkeypatch.setattr(launch_forward, "launcher", no_launch)
    Q, H, W, b = _inputs(Nq, Lq, Ncols, Ld, 24, 40, torch.float32, candidates=candidates)
    scores, argmax = _call(Q, H, W, b, None, None, normalize=True, save_argmax=save_argmax)
    assert scores.dtype == torch.float32 and torch.equal(scores, torch.zeros(Nq, Ncols))
    if save_argmax:
        assert argmax.dtype == argmax_dtype(Ld)
        assert torch.equal(argmax, torch.full((Nq, Ncols, Lq), -1, dtype=argmax.dtype))
    else:
        assert argmax.numel() == 0
