"""Forward and gradients of maxsim / maxsim_pairs against the float64 reference, on both paths.

Shapes are odd on purpose (Lq=7, Ld=13, d=96): nothing is a multiple of a tile, so every tail
mask in the kernels is exercised.
"""

import dataclasses

import pytest
import torch
from helpers import (
    LAYOUTS,
    assert_backward_bitwise_reproducible,
    check_against_reference,
    compiled_and_eager_step,
    leaf,
    masks_with_holes,
    random_problem,
)

from fusedmaxsim import forced_plan, maxsim, maxsim_pairs, settings
from fusedmaxsim._plan import (
    BackwardPlan,
    BwdConfig,
    ForwardPlan,
    FwdConfig,
    plan_backward,
    plan_forward,
)
from fusedmaxsim._problem import dense_problem, options_for
from fusedmaxsim.planning import recording
from fusedmaxsim.reference import maxsim_ref
from fusedmaxsim.testing import assert_close_to_reference


def launch_forward(Q, D, q_mask, d_mask, q_inv, d_inv, save_argmax, fp32_precision, tau=0.0):
    """The dense Triton forward launcher on the plan of these inputs (decisions forced by the
    caller's ``forced_plan`` apply): ``(scores, argmax or the smooth max's rows)``."""
    from fusedmaxsim._launch.forward import forward_dense

    p = dense_problem(Q, D, q_mask, d_mask, normalize=q_inv is not None, tau=tau,
                      save_argmax=save_argmax)
    plan = plan_forward(p, options_for(Q, "triton", fp32_precision))
    return forward_dense(plan, p, fp32_precision, Q, D, q_mask, d_mask, q_inv, d_inv)


def launch_backward(grad, Q, D, argmax, q_inv, d_inv, need_q, need_d, strategy, fp32_out,
                    fp32_precision):
    """The dense Triton backward launcher on the plan of these inputs: ``(grad_Q, grad_D)``."""
    from fusedmaxsim._launch.backward import backward_dense

    p = dense_problem(Q, D, None, None, normalize=q_inv is not None, save_argmax=True)
    plan = plan_backward(p, options_for(Q, "triton", fp32_precision), need_q, need_d, strategy)
    return backward_dense(plan, fp32_precision, grad, Q, D, argmax, q_inv, d_inv, need_q, need_d,
                          fp32_out)


def inverse_norms(x):
    from fusedmaxsim._launch.forward import inverse_norms

    return inverse_norms(x, 1e-12)


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("strategy", ["unified", "lowmem"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parity_with_masks(backend, device, layout, dtype, strategy, normalize):
    Q, D, q_mask, d_mask = random_problem(layout, dtype, device)
    out = check_against_reference(
        Q, D, q_mask, d_mask, normalize=normalize, backward=strategy, pairs=layout == "pairs"
    )
    # The fully masked first query (and first document) scores exactly 0.
    assert torch.all(out[0] == 0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parity_without_masks(backend, device, layout):
    Q, D, _, _ = random_problem(layout, torch.float32, device, masks=False)
    check_against_reference(Q, D, pairs=layout == "pairs")


def test_bf16_parity(backend, device):
    """bf16 in the interpreter runs with fp32 dots (its bf16 dot is wrong); the GPU suite covers real bf16."""
    Q, D, q_mask, d_mask = random_problem("cross", torch.bfloat16, device)
    check_against_reference(Q, D, q_mask, d_mask, backward="lowmem")
    check_against_reference(Q, D, q_mask, d_mask, backward="unified")


@pytest.mark.parametrize(
    "q_shape,d_shape,out_shape",
    [
        ((7, 32), (13, 32), ()),
        ((7, 32), (5, 13, 32), (5,)),
        ((3, 7, 32), (13, 32), (3,)),
    ],
)
def test_two_dimensional_inputs_drop_their_axis(backend, device, q_shape, d_shape, out_shape):
    Q = torch.randn(q_shape, device=device)
    D = torch.randn(d_shape, device=device)
    q_mask = torch.rand(q_shape[:-1], device=device) > 0.2
    d_mask = torch.rand(d_shape[:-1], device=device) > 0.2
    out = check_against_reference(Q, D, q_mask, d_mask)
    assert out.shape == out_shape


@pytest.mark.parametrize("Lq,Ld", [(1, 1), (1, 13), (7, 1), (16, 32), (17, 33)])
def test_small_and_boundary_lengths(backend, device, Lq, Ld):
    Q = torch.randn(2, Lq, 48, device=device)
    D = torch.randn(3, Ld, 48, device=device)
    check_against_reference(Q, D)


def test_non_contiguous_inputs(backend, device):
    """PyLate passes D[:, j] slices of a [B, N, Ld, d] stack; masks sliced the same way."""
    stack = torch.randn(4, 3, 13, 64, device=device)
    stack_mask = torch.rand(4, 3, 13, device=device) > 0.3
    D, d_mask = stack[:, 1], stack_mask[:, 1]
    Q = torch.randn(3, 64, 7, device=device).transpose(1, 2)  # d is not the fastest axis
    q_mask = (torch.rand(7, 3, device=device) > 0.2).T
    assert not D.is_contiguous() and Q.stride(-1) != 1 and not q_mask.is_contiguous()
    check_against_reference(Q, D, q_mask, d_mask, backward="lowmem")
    check_against_reference(Q, D, q_mask, d_mask, backward="unified")
    Dc = torch.randn(3, 2, 13, 64, device=device)[:, :, :, :].transpose(1, 0).contiguous().transpose(1, 0)
    check_against_reference(Q, Dc)


@pytest.mark.parametrize(
    "q_shape,d_shape,out_shape",
    [
        ((0, 7, 32), (5, 13, 32), (0, 5)),
        ((3, 7, 32), (0, 13, 32), (3, 0)),
        ((3, 7, 32), (3, 0, 13, 32), (3, 0)),
        ((0, 7, 32), (0, 4, 13, 32), (0, 4)),
    ],
)
def test_empty_batches(backend, device, q_shape, d_shape, out_shape):
    Q = leaf(torch.randn(q_shape, device=device))
    D = leaf(torch.randn(d_shape, device=device))
    out = maxsim(Q, D)
    assert out.shape == out_shape and out.dtype == torch.float32
    out.sum().backward()
    assert Q.grad.shape == Q.shape and D.grad.shape == D.shape


@pytest.mark.parametrize("q_len,d_len", [(0, 13), (7, 0), (0, 0)])
def test_zero_lengths_score_zero(backend, device, q_len, d_len):
    Q = leaf(torch.randn(3, q_len, 32, device=device))
    D = leaf(torch.randn(4, d_len, 32, device=device))
    out = maxsim(Q, D)
    assert out.shape == (3, 4) and torch.all(out == 0)
    out.sum().backward()
    assert torch.all(Q.grad == 0) and torch.all(D.grad == 0)


@pytest.mark.parametrize("strategy", ["unified", "lowmem"])
def test_fully_masked_rows_and_docs_get_exact_zero_gradient(backend, device, strategy):
    Q = leaf(torch.randn(3, 7, 32, device=device))
    D = leaf(torch.randn(4, 13, 32, device=device))
    q_mask = torch.ones(3, 7, dtype=torch.bool, device=device)
    d_mask = torch.ones(4, 13, dtype=torch.bool, device=device)
    q_mask[1] = False
    q_mask[2, 3] = False
    d_mask[2] = False
    d_mask[0, 5:] = False
    out = maxsim(Q, D, q_mask, d_mask, backward=strategy)
    assert torch.all(out[1] == 0) and torch.all(out[:, 2] == 0)
    out.backward(torch.randn_like(out))
    assert torch.all(Q.grad[1] == 0) and torch.all(Q.grad[2, 3] == 0)
    assert torch.all(D.grad[2] == 0) and torch.all(D.grad[0, 5:] == 0)


def test_mask_dtypes_nonzero_means_valid(backend, device):
    Q = torch.randn(2, 7, 32, device=device)
    D = torch.randn(3, 13, 32, device=device)
    bool_mask = torch.rand(3, 13, device=device) > 0.4
    expected = maxsim(Q, D, d_mask=bool_mask)
    for mask in (bool_mask.float(), bool_mask.int(), bool_mask.to(torch.uint8), bool_mask * 0.5):
        torch.testing.assert_close(maxsim(Q, D, d_mask=mask), expected, rtol=0, atol=0)


def test_ties_go_to_the_lowest_index(backend, device):
    """Three identical copies of the winning doc token: only the first one receives gradient."""
    Q = leaf(torch.randn(1, 5, 32, device=device))
    D = torch.randn(1, 9, 32, device=device)
    D[0, 2] = D[0, 6] = D[0, 7] = Q[0].sum(0).detach() * 10  # wins for every query token
    D = leaf(D)
    out = maxsim(Q, D)
    out.sum().backward()
    assert D.grad[0, 2].abs().sum() > 0
    assert torch.all(D.grad[0, 6] == 0) and torch.all(D.grad[0, 7] == 0)
    torch.testing.assert_close(out, maxsim_ref(Q.double(), D.double()).float())


def test_nan_propagates_only_from_valid_tokens(backend, device):
    Q = torch.randn(2, 7, 32, device=device)
    D = torch.randn(3, 13, 32, device=device)
    D[1, 4, 0] = float("nan")
    out = maxsim(Q, D)
    assert torch.isnan(out[:, 1]).all() and not torch.isnan(out[:, [0, 2]]).any()
    d_mask = torch.ones(3, 13, dtype=torch.bool, device=device)
    d_mask[1, 4] = False
    assert not torch.isnan(maxsim(Q, D, d_mask=d_mask)).any()
    Q[1, 2, 5] = float("nan")
    out = maxsim(Q, D, d_mask=d_mask)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()


def test_fp32_is_never_computed_in_half_precision(backend, device):
    """Products far above fp16's 65504 must come out right."""
    Q = torch.randn(2, 7, 32, device=device) * 300
    D = torch.randn(3, 13, 32, device=device) * 300
    check_against_reference(Q, D, tol=(1e-3, 1e-3))


def test_mixed_dtypes_are_promoted_and_grads_keep_each_dtype(backend, device):
    Q = torch.randn(2, 7, 32, device=device, dtype=torch.float16)
    D = torch.randn(3, 13, 32, device=device, dtype=torch.float32)
    Q, D = leaf(Q), leaf(D)
    out = maxsim(Q, D)
    torch.testing.assert_close(out, maxsim_ref(Q.double(), D.double()).float(), rtol=1e-3, atol=1e-3)
    out.sum().backward()
    assert Q.grad.dtype == torch.float16 and D.grad.dtype == torch.float32


def test_candidates_equal_a_loop_over_cross_products(backend, device):
    Q = torch.randn(3, 7, 32, device=device)
    D = torch.randn(3, 4, 13, 32, device=device)
    d_mask = masks_with_holes((3, 4, 13), device, fully_masked_first=False)
    out = maxsim(Q, D, d_mask=d_mask)
    for i in range(3):
        torch.testing.assert_close(out[i], maxsim(Q[i : i + 1], D[i], d_mask=d_mask[i])[0])


def test_pairs_equal_the_diagonal_of_the_cross_product(backend, device):
    Q = torch.randn(4, 7, 32, device=device)
    D = torch.randn(4, 13, 32, device=device)
    d_mask = masks_with_holes((4, 13), device, fully_masked_first=False)
    torch.testing.assert_close(maxsim_pairs(Q, D, d_mask=d_mask), maxsim(Q, D, d_mask=d_mask).diagonal())


def test_lowmem_backward_is_bitwise_reproducible(backend, device):
    Q, D, q_mask, d_mask = random_problem("cross", torch.float32, device)
    assert_backward_bitwise_reproducible(
        lambda q, d: maxsim(q, d, q_mask, d_mask, backward="lowmem").sum().backward(), Q, D
    )


def test_deterministic_mode_picks_lowmem_and_refuses_unified(device):

    Q, D = leaf(torch.randn(2, 7, 32, device=device)), leaf(torch.randn(3, 13, 32, device=device))
    torch.use_deterministic_algorithms(True)
    try:
        with settings.use_backend("triton"):
            maxsim(Q, D).sum().backward()  # auto -> lowmem
            with pytest.raises(RuntimeError, match="not deterministic"):
                maxsim(Q, D, backward="unified").sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_normalize_zero_and_huge_tokens(backend, device, grad):
    """Zero tokens normalize to zero (F.normalize's eps), huge ones to unit length, on both the
    inference path (norms from the tiles) and the training path (norms computed first)."""
    Q = torch.randn(3, 7, 96, device=device)
    D = torch.randn(5, 13, 96, device=device)
    Q[0, 2] = 0.0
    D[1, 4] = 0.0
    Q[1, 0] *= 1e18
    D[2, 3] *= 1e18
    Q, D = Q.requires_grad_(grad), D.requires_grad_(grad)
    ref = maxsim_ref(Q.detach().double(), D.detach().double(), normalize=True)
    assert_close_to_reference(maxsim(Q, D, normalize=True), ref, 1e-5, "scores")


def problem(Nq, Ncols, Lq, Ld, dim, per_query_docs=False, sixteen_bit=True):
    """The :class:`Problem` of a training call of these sizes (no tensors: the planner's policy
    functions read sizes only)."""
    from fusedmaxsim._problem import Problem

    return Problem(
        layout="candidates" if per_query_docs else "cross", Nq=Nq, Ncols=Ncols, Lq=Lq, Ld=Ld,
        dim=dim, dtype=torch.float16 if sixteen_bit else torch.float32, device=torch.device("cpu"),
        has_q_mask=False, has_d_mask=False, normalize=False, norm_from_tiles=False, tau=0.0,
        save_argmax=True, tma_ready=True,
    )


def test_auto_strategy_rule():
    from fusedmaxsim._plan import resolve_strategy

    def auto(Nq, Ncols, Lq, Ld, dim, per_query_docs=False, sixteen_bit=True):
        p = problem(Nq, Ncols, Lq, Ld, dim, per_query_docs, sixteen_bit)
        return resolve_strategy(p, "auto", False)[0]

    assert auto(32, 32, 32, 180, 128) == "lowmem"  # host-bound: no fp32 buffer to fill and cast
    assert auto(128, 128, 32, 300, 128) == "unified"  # 2^34: fewer launches than the winner index
    assert auto(128, 128, 32, 300, 128, per_query_docs=True) == "lowmem"
    assert auto(256, 256, 32, 300, 128) == "lowmem"  # 2^36: GPU-bound, lowmem as fast
    assert auto(128, 128, 128, 1024, 128) == "lowmem"  # train_colpali, 2^38
    assert auto(128, 128, 128, 1024, 128, sixteen_bit=False) == "unified"  # fp32: exact adds
    candidates = problem(1, 1, 1, 1, 1, per_query_docs=True)
    assert resolve_strategy(candidates, "unified", False)[0] == "unified"


def test_no_argmax_is_saved_without_grad(backend, device):
    """Recorded where every forward of the backend is planned, the inference shortcut's included
    (a call without autograd goes straight to the launcher, with no autograd node)."""
    Q = leaf(torch.randn(2, 7, 32, device=device))
    D = leaf(torch.randn(3, 13, 32, device=device))
    with recording() as plans:
        with torch.no_grad():
            maxsim(Q, D)
        with torch.inference_mode():
            maxsim(Q, D)
        maxsim(Q.detach(), D.detach())
        maxsim(Q, D)
    forwards = [(p, plan) for p, plan in plans if isinstance(plan, ForwardPlan)]
    assert [p.save_argmax for p, _ in forwards] == [False, False, False, True]


def test_only_the_needed_gradient_is_computed(backend, device):
    """One backward, planned for grad_Q alone: on the Triton path that plan runs no grad_D
    kernel (the plan for both gradients adds the document-owned grad_D)."""
    Q = leaf(torch.randn(2, 7, 32, device=device))
    D = torch.randn(3, 13, 32, device=device)
    with recording() as plans:
        maxsim(Q, D).sum().backward()
    backwards = [(p, plan) for p, plan in plans if isinstance(plan, BackwardPlan)]
    assert len(backwards) == 1 and Q.grad is not None and D.grad is None
    p, plan = backwards[0]
    o = options_for(Q)
    assert plan == plan_backward(p, o, True, False, "auto")
    if backend == "triton":
        assert plan != plan_backward(p, o, True, True, "auto")


def test_double_backward_is_refused_clearly(backend, device):
    """Under ``create_graph=True`` the first gradients are the usual ones, and a second backward
    through them raises instead of silently missing this op's part."""
    Q = leaf(torch.randn(2, 7, 32, device=device))
    D = leaf(torch.randn(3, 13, 32, device=device))
    (gq,) = torch.autograd.grad(maxsim(Q, D).sum(), Q, create_graph=True)
    (plain,) = torch.autograd.grad(maxsim(Q, D).sum(), Q)
    assert torch.equal(gq.detach(), plain)
    with pytest.raises(RuntimeError, match="fusedmaxsim: double backward is not supported"):
        gq.sum().backward()


def test_float64_runs_on_the_pytorch_path_and_passes_gradcheck(device):

    Q = torch.randn(2, 5, 8, device=device, dtype=torch.float64, requires_grad=True)
    D = torch.randn(3, 6, 8, device=device, dtype=torch.float64, requires_grad=True)
    q_mask = torch.rand(2, 5, device=device) > 0.2
    with settings.use_backend("triton"):  # float64 still takes the exact PyTorch path
        out = maxsim(Q, D, q_mask)
    assert out.dtype == torch.float64
    torch.autograd.gradcheck(lambda q, d: maxsim(q, d, q_mask), (Q, D))
    torch.autograd.gradcheck(lambda q, d: maxsim(q, d, normalize=True), (Q, D))
    Dc = torch.randn(2, 3, 6, 8, device=device, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda q, d: maxsim(q, d), (Q, Dc))


# Tile paths that the default configuration does not take on these shapes: queries longer than
# one tile (the run-time chunk loop), several short queries packed into one tile, and a backward
# whose query tokens span several blocks.
FORCED = [
    pytest.param(FwdConfig(16, 1, 16, 64, 4, 1), BwdConfig(16, 16, 16, 64, 4, 1), 40, id="chunked-Lq40"),
    pytest.param(FwdConfig(16, 2, 16, 64, 4, 1), BwdConfig(16, 16, 16, 64, 4, 1), 7, id="packed-2-queries"),
    pytest.param(FwdConfig(16, 4, 32, 64, 4, 1), BwdConfig(32, 32, 32, 64, 4, 1), 13, id="packed-4-queries"),
    pytest.param(FwdConfig(16, 2, 16, 64, 4, 1, query_in_registers=True), BwdConfig(16, 16, 16, 64, 4, 1), 40,
                 id="query-in-registers"),
]


@pytest.mark.parametrize("fwd,bwd,Lq", FORCED)
@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_forced_tile_paths(device, fwd, bwd, Lq, layout):

    Q = torch.randn(5, Lq, 64, device=device)
    D = torch.randn(*((5, 3) if layout == "candidates" else (6,)), 29, 64, device=device)
    q_mask = masks_with_holes(Q.shape[:-1], device)
    d_mask = masks_with_holes(D.shape[:-1], device)
    if layout == "candidates":
        fwd = dataclasses.replace(fwd, queries_per_block=1)
    with settings.use_backend("triton"), forced_plan(fwd_tiles=fwd, bwd_tiles=bwd):
        chunked = check_against_reference(Q, D, q_mask, d_mask, backward="lowmem")
        check_against_reference(Q, D, q_mask, d_mask, backward="unified")
    with settings.use_backend("triton"):
        unchunked = maxsim(Q, D, q_mask, d_mask)
    torch.testing.assert_close(chunked, unchunked, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_query_tile_in_registers_changes_no_bit(device, layout):
    """The query tile routed through a product with a zero operand (so that Hopper's products
    read it from registers) is the same tile: scores and argmax bit for bit, 16-bit inputs."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter's bf16 dot is wrong
    Q = torch.randn(3, 70 if device == "cuda" else 20, 64, device=device).to(dtype)
    D = torch.randn(*((3, 2) if layout == "candidates" else (5,)), 45, 64, device=device).to(dtype)
    rows = 64 if device == "cuda" else 16
    base = FwdConfig(rows, 1, 16 if device != "cuda" else 32, 64, 4, 1 if device != "cuda" else 2)
    outputs = []
    for in_registers in (False, True):
        with forced_plan(fwd_tiles=dataclasses.replace(base, query_in_registers=in_registers)):
            outputs.append(launch_forward(Q, D, None, None, None, None, True, "tf32"))
    assert torch.equal(outputs[0][0], outputs[1][0])
    assert torch.equal(outputs[0][1], outputs[1][1])


def test_torch_compile_fullgraph_matches_eager(backend, device):
    """A training step under ``torch.compile(fullgraph=True)`` traces the registered ops and
    gives the eager step's loss and gradients (fp32, same inputs)."""
    (loss, grad), (eager_loss, eager_grad) = compiled_and_eager_step(device, 4, 7, 13, 16, 32)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, eager_grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("strategy", ["unified", "lowmem"])
@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_nan_in_masked_tokens_reaches_no_gradient(backend, device, layout, strategy, normalize):
    """Masked tokens are excluded, not zero-filled: NaN there changes no score and no gradient."""
    Q, D, q_mask, d_mask = random_problem(layout, torch.float32, device)
    Q[~q_mask] = float("nan")
    D[~d_mask] = float("nan")
    Q, D = leaf(Q), leaf(D)
    out = maxsim(Q, D, q_mask, d_mask, normalize=normalize, backward=strategy)
    grad = torch.randn_like(out)
    gq, gd = torch.autograd.grad(out, (Q, D), grad)
    clean_q = torch.where(q_mask[..., None], Q.detach(), 0.0).double().requires_grad_()
    clean_d = torch.where(d_mask[..., None], D.detach(), 0.0).double().requires_grad_()
    ref = maxsim_ref(clean_q, clean_d, q_mask, d_mask, normalize=normalize)
    rq, rd = torch.autograd.grad(ref, (clean_q, clean_d), grad.double())
    assert_close_to_reference(out, ref, 1e-5, "scores")
    assert_close_to_reference(gq, rq, 1e-4, "grad_Q")
    assert_close_to_reference(gd, rd, 1e-4, "grad_D")


@pytest.mark.parametrize("needs", ["both", "d_only"])
@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_unified_grad_d_through_column_chunks(device, layout, needs):
    """Past a size, the unified backward scatters grad_D through an fp32 buffer of a few columns
    at a time and casts each chunk into grad_D: forced here down to two columns per chunk."""
    from fusedmaxsim._plan import scatter_chunk_cols

    Q, D, q_mask, d_mask = random_problem(layout, torch.float16, device)
    Ncols = D.shape[-3]
    # Small: one buffer.
    assert scatter_chunk_cols(Ncols, D.numel(), D.element_size(), False) == Ncols
    # A buffer as large as the 16-bit grad_D holds half its columns in fp32: 2 of 5 or 4.
    chunked = {"SCATTER_BUFFER_MAX_BYTES": 0, "SCATTER_BUFFER_SHARE": 1,
               "DRAIN_BLOCK": 64}  # several blocks per group and chunk
    with forced_plan(**chunked):
        assert scatter_chunk_cols(Ncols, D.numel(), D.element_size(), False) == 2
    Q, D = leaf(Q), leaf(D)
    Q.requires_grad_(needs == "both")
    with settings.use_backend("triton"), forced_plan(**chunked), recording() as plans:
        out = maxsim(Q, D, q_mask, d_mask, backward="unified")
        grad = torch.randn_like(out)
        (out * grad).sum().backward()
    backward = [plan for _, plan in plans if isinstance(plan, BackwardPlan)]
    assert [(b.strategy, b.scatter_chunk_cols, b.drain_block) for b in backward] == [
        ("unified", 2, 64)]
    Q64, D64 = leaf(Q.detach().double()), leaf(D.detach().double())
    Q64.requires_grad_(needs == "both")
    (maxsim_ref(Q64, D64, q_mask, d_mask) * grad.double()).sum().backward()
    assert_close_to_reference(D.grad, D64.grad, 1e-2, "grad_D")
    if needs == "both":
        assert_close_to_reference(Q.grad, Q64.grad, 1e-2, "grad_Q")
    else:
        assert Q.grad is None


@pytest.mark.parametrize("cols_per_step", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_gather_columns_a_step(device, layout, cols_per_step):
    """The gather kernel of grad_Q walks its columns ``cols_per_step`` at a time; a program's
    last step may hold fewer (5 columns here on the cross product), and each width gives the
    reference's gradients. (A gather that also scatters grad_D always takes one.)"""
    Q, D, q_mask, d_mask = random_problem(layout, torch.float32, device)
    Q, D = leaf(Q), leaf(D)
    with settings.use_backend("triton"), forced_plan(gather_step=(cols_per_step, None)), \
            recording() as plans:
        out = maxsim(Q, D, q_mask, d_mask, backward="lowmem")
        grad = torch.randn_like(out)
        (out * grad).sum().backward()
    assert [plan.gather_step for _, plan in plans if isinstance(plan, BackwardPlan)] == [
        (cols_per_step, None)]
    Q64, D64 = leaf(Q.detach().double()), leaf(D.detach().double())
    (maxsim_ref(Q64, D64, q_mask, d_mask) * grad.double()).sum().backward()
    assert_close_to_reference(Q.grad, Q64.grad, 1e-5, "grad_Q")
    assert_close_to_reference(D.grad, D64.grad, 1e-5, "grad_D")


@pytest.mark.parametrize("Lq", [5, 20])  # rows in one block of 16 (loaded once), or in two
@pytest.mark.parametrize("Nq, K", [(4, 4), (3, 3)])  # 3 tiles a program, or 2 then 1
def test_lowmem_grad_d_of_candidates_over_several_token_tiles(device, Nq, K, Lq):
    """Per-query candidates: a program of the document-owned grad_D writes several token tiles
    (75 tokens: tiles of 32, the last partial), its rows loaded once when they fit one block.
    Four SMs on every device, so 16 or 9 documents get 3 or 2 tiles a program."""
    Q = leaf(torch.randn(Nq, Lq, 96, device=device, dtype=torch.float16))
    D = leaf(torch.randn(Nq, K, 75, 96, device=device, dtype=torch.float16))
    q_mask = masks_with_holes((Nq, Lq), device)
    d_mask = masks_with_holes((Nq, K, 75), device)
    with settings.use_backend("triton"), recording() as plans, forced_plan(
            sm_count=4, bwd_tiles=BwdConfig(16, 32, 16, 128, 4, 1)):
        out = maxsim(Q, D, q_mask, d_mask, backward="lowmem")
        grad = torch.randn_like(out)
        out.backward(grad)
    (plan,) = [plan for _, plan in plans if isinstance(plan, BackwardPlan)]
    in_one_block = Lq <= 16
    assert plan.rows_in_one_block == in_one_block
    assert plan.dd_tiles_per_program == ((3 if Nq * K == 16 else 2) if in_one_block else 1)
    clean_q = leaf(torch.where(q_mask[..., None], Q.detach(), 0.0).double())
    clean_d = leaf(torch.where(d_mask[..., None], D.detach(), 0.0).double())
    maxsim_ref(clean_q, clean_d, q_mask, d_mask).backward(grad.double())
    assert_close_to_reference(Q.grad, clean_q.grad, 1e-2, "grad_Q")
    assert_close_to_reference(D.grad, clean_d.grad, 1e-2, "grad_D")


@pytest.mark.parametrize("strategy", ["unified", "lowmem"])
@pytest.mark.parametrize("need_q,need_d", [(True, True), (True, False), (False, True), (False, False)])
def test_launcher_returns_an_empty_tensor_for_each_gradient_not_asked_for(device, strategy, need_q, need_d):
    """The backward launcher's contract, which the registered op relies on (its outputs are
    tensors): a gradient nobody asked for is an empty tensor of Q's dtype, the others are whole."""
    Q = torch.randn(3, 7, 32, device=device)
    D = torch.randn(4, 13, 32, device=device)
    _, argmax = launch_forward(Q, D, None, None, None, None, True, "ieee")
    grad_scores = torch.randn(3, 4, device=device)
    gq, gd = launch_backward(grad_scores, Q, D, argmax, None, None, need_q, need_d, strategy,
                             False, "ieee")
    Q64, D64 = leaf(Q.double()), leaf(D.double())
    rq, rd = torch.autograd.grad(maxsim_ref(Q64, D64), (Q64, D64), grad_scores.double())
    for got, ref, needed in ((gq, rq, need_q), (gd, rd, need_d)):
        if needed:
            assert_close_to_reference(got, ref, 1e-4, "gradient")
        else:
            assert got.shape == (0,) and got.dtype == Q.dtype


@pytest.mark.parametrize("mode", ["max", "normalize", "smooth"])
@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_query_chunks_split_over_programs_match_one_program(device, layout, mode):
    """A long query's chunks run in neighbouring programs, each writing its part of the scores,
    which the launcher adds up: the scores of one program walking every chunk (to fp32 rounding
    of the sum's order) and the same argmax, with every chunk its own program, with two programs
    sharing three chunks unevenly, and in the sliced launch of huge query batches. The policy
    keeps per-query candidates in one program (measured slower split); the kernel takes the
    splits there all the same."""
    from fusedmaxsim._plan import chunk_splits

    Q = torch.randn(5, 40, 64, device=device)
    D = torch.randn(*((5, 3) if layout == "candidates" else (6,)), 29, 64, device=device)
    q_mask, d_mask = masks_with_holes(Q.shape[:-1], device), masks_with_holes(D.shape[:-1], device)
    q_inv = d_inv = None
    if mode == "normalize":
        q_inv, d_inv = inverse_norms(Q), inverse_norms(D)

    def forward():
        # "ieee": fp32 products, also on a GPU, whose default TF32 would round them to 1e-3
        return launch_forward(Q, D, q_mask, d_mask, q_inv, d_inv, True, "ieee",
                              tau=0.1 if mode == "smooth" else 0.0)

    with forced_plan(fwd_tiles=FwdConfig(16, 1, 16, 64, 4, 1)):  # three 16-row chunks of 40 rows
        want_splits = 1 if layout == "candidates" else 3
        assert chunk_splits(40, 16, 5, D.shape[-3], layout == "candidates") == want_splits
        with recording() as plans:
            split = forward()
        assert [plan.splits for _, plan in plans] == [want_splits]
        results = {}
        for name, splits, grid_y in (("one", 1, 65535), ("two", 2, 65535), ("sliced", 3, 2)):
            with forced_plan(splits=splits, max_grid_y=grid_y), recording() as plans:
                results[name] = forward()
            assert [(plan.splits, plan.max_grid_y) for _, plan in plans] == [(splits, grid_y)]
    for name, (scores, saved) in results.items():
        torch.testing.assert_close(scores, split[0], rtol=1e-6, atol=1e-6, msg=name)
        assert torch.equal(saved, split[1]), name
    want = maxsim_ref(Q.double(), D.double(), q_mask, d_mask, normalize=mode == "normalize",
                      reduction="smoothmax" if mode == "smooth" else "max")
    torch.testing.assert_close(split[0].double(), want, rtol=1e-5, atol=1e-5)


def test_chunk_splits_policy():
    """One program per chunk on the cross product, fewer where the partial scores would pass
    their byte cap; one for a single chunk and for per-query candidates."""
    from fusedmaxsim._plan import MEASURED, chunk_splits

    assert chunk_splits(1030, 128, 1, 1000, False) == 9
    assert chunk_splits(1030, 128, 1, 1000, True) == 1
    assert chunk_splits(128, 128, 1, 1000, False) == 1
    assert chunk_splits(7, 16, 3, 5, False) == 1
    cap = MEASURED["SPLIT_PARTIALS_MAX_BYTES"] // 4
    assert chunk_splits(1024, 128, cap // 1000 // 3, 1000, False) == 3
    assert chunk_splits(1024, 128, cap, 1000, False) == 1


def test_gather_step_policy():
    """Eight columns a step at 8 warps below two programs an SM, four below four, else one at the
    configuration's warps; a gather that also scatters grad_D takes one column whatever its grid."""
    from fusedmaxsim._launch.backward import _gather_constants
    from fusedmaxsim._plan import gather_step

    assert gather_step(32, 132, False) == (8, 8)
    assert gather_step(263, 132, False) == (8, 8)
    assert gather_step(264, 132, False) == (4, 8)
    assert gather_step(527, 132, False) == (4, 8)
    assert gather_step(528, 132, False) == (1, None)
    assert gather_step(32, 132, True) == (1, None)
    # The backward's plans on 132 SMs, and the gather's constexprs the launcher builds from them.
    Q, D = torch.randn(2, 7, 32), torch.randn(3, 13, 32)
    p = dense_problem(Q, D, None, None, save_argmax=True)
    gathers = set()
    for strategy in ("lowmem", "unified"):
        with forced_plan(sm_count=132):
            plan = plan_backward(p, options_for(Q, "triton", "ieee"), True, True, strategy)
        scatters = plan.strategy == "unified" and plan.scatter_chunk_cols == p.Ncols  # one buffer
        meta = _gather_constants(plan.tiles, False, False, True, plan.atomic_q, scatters,
                                 plan.gather_step).kwargs
        assert (meta["COLS_PER_STEP"], meta["num_warps"]) == (
            plan.gather_step[0], plan.gather_step[1] or plan.tiles.num_warps)
        gathers.add((meta["COLS_PER_STEP"], meta["SCATTER_GRAD_D"], meta["num_warps"]))
    assert gathers == {(8, False, 8), (1, True, 4)}


def test_grad_d_scans_run_at_one_stage():
    """The document-owned grad_D's programs that scan their rows in a loop (cross product;
    candidates longer than a product's rows) launch at one pipeline stage; those that load their
    rows once keep the configuration's stages (docs/design.md, "Backward: document-owned
    grad_D")."""
    from fusedmaxsim._launch.backward import _dd_constants

    cfg = BwdConfig(16, 32, 16, 32, 4, 2)
    grad_d = []
    for lq, d_shape in ((7, (3, 13, 32)), (7, (2, 3, 13, 32)), (20, (2, 3, 13, 32))):
        Q, D = torch.randn(2, lq, 32), torch.randn(d_shape)
        p = dense_problem(Q, D, None, None, save_argmax=True)
        with forced_plan(bwd_tiles=cfg):
            plan = plan_backward(p, options_for(Q, "triton", "ieee"), False, True, "lowmem")
        assert plan.tiles == cfg and plan.dd_scan_stages == 1 and not plan.winner_index
        per_query_docs = p.layout == "candidates"
        # The constexprs the launcher builds from the plan for the document-owned grad_D.
        meta = _dd_constants(plan.tiles, per_query_docs, plan.rows_in_one_block, plan.winner_index,
                             False, Q.dtype, "ieee", plan.dd_scan_stages, plan.index_scan).kwargs
        assert meta["ROWS_IN_ONE_BLOCK"] == plan.rows_in_one_block
        grad_d.append((per_query_docs, plan.rows_in_one_block, meta["num_stages"]))
    assert grad_d == [(False, False, 1), (True, True, 2), (True, False, 1)]


def test_auto_backward_follows_the_dtype_at_large_cross_products():
    """``auto`` passes the input's width to the rule: with its thresholds moved down to these
    sizes, a 16-bit cross product takes lowmem and an fp32 one unified (docs/design.md,
    "Backward strategies")."""
    with forced_plan(HOST_BOUND_MACS=0, LOWMEM_CROSS_MACS=1), recording() as plans:
        for dtype in (torch.float16, torch.float32):
            Q, D = leaf(torch.randn(2, 5, 16).to(dtype)), leaf(torch.randn(3, 6, 16).to(dtype))
            maxsim(Q, D).sum().backward()
    seen = [plan.strategy for _, plan in plans if isinstance(plan, BackwardPlan)]
    assert seen == ["lowmem", "unified"]


@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_query_batches_beyond_the_grid_go_in_slices(device, layout):
    """A query batch larger than the grid's second axis is launched in slices of queries (and, for
    per-query candidates, of their documents, masks and inverse norms): forced here down to two
    blocks a slice, the result is the one-launch result, bit for bit."""
    Q = torch.randn(9, 7, 96, device=device)
    D = torch.randn(*((9, 4) if layout == "candidates" else (5,)), 13, 96, device=device)
    q_mask, d_mask = masks_with_holes(Q.shape[:-1], device), masks_with_holes(D.shape[:-1], device)
    q_inv, d_inv = inverse_norms(Q), inverse_norms(D)
    args = (Q, D, q_mask, d_mask, q_inv, d_inv, True, "tf32")
    with recording() as plans:
        whole = launch_forward(*args)
    ((_, plan),) = plans
    assert plan.kernel == "triton" and plan.max_grid_y >= Q.shape[0]
    assert Q.shape[0] > 2 * plan.tiles.queries_per_block  # so that there are several slices
    with forced_plan(max_grid_y=2), recording() as plans:
        sliced = launch_forward(*args)
    assert [(p.tiles, p.max_grid_y) for _, p in plans] == [(plan.tiles, 2)]
    assert torch.equal(whole[0], sliced[0])
    assert torch.equal(whole[1], sliced[1])
