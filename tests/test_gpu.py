"""GPU suite (``pytest -m gpu``): real bf16/fp16/fp32 kernels, compile, opcheck and large shapes.

Bounds are ``max|out − ref| / max|ref|`` against float64: 2e-2 for bf16 and 5e-3 for fp16, on
scores and gradients alike, as the main peer's tests enforce.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    assert_backward_bitwise_reproducible,
    assert_no_host_synchronization,
    check_against_reference,
    compiled_and_eager_step,
    leaf,
    masks_with_holes,
)

from fusedmaxsim import (
    forced_plan,
    maxsim,
    maxsim_padded,
    maxsim_pairs,
    maxsim_varlen,
    score_pairs_packed,
    settings,
)
from fusedmaxsim._plan import MEASURED, chunk_splits, plan_forward
from fusedmaxsim._problem import dense_problem, options_for
from fusedmaxsim.planning import ForwardPlan, recording
from fusedmaxsim.reference import maxsim_ref
from fusedmaxsim.testing import assert_close_to_reference, relative_error_fro

pytestmark = pytest.mark.gpu

BOUNDS = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (5e-3, 5e-3)}

SHAPES = {
    "cross-odd": ((3, 7, 96), (5, 13, 96)),
    "cross-colbert": ((16, 32, 128), (24, 300, 128)),
    "cross-packed-lq5": ((37, 5, 64), (9, 77, 64)),
    "candidates": ((6, 33, 128), (6, 5, 200, 128)),
    "cross-d320": ((4, 20, 320), (6, 50, 320)),
    # More programs than SMs: the spill-free tiles of the argmax-saving and normalizing forwards
    # (the shapes above have fewer: two warp groups a program).
    "cross-colbert-many-programs": ((64, 32, 128), (40, 200, 128)),
    "cross-colpali-many-programs": ((6, 128, 128), (200, 90, 128)),
}


@pytest.mark.parametrize(
    "dtype,normalize",
    [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, False)],
    ids=["bf16", "bf16-normalize", "fp16"],
)
@pytest.mark.parametrize("strategy", ["unified", "lowmem"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_half_precision_parity(shape, dtype, strategy, normalize):
    q_shape, d_shape = SHAPES[shape]
    Q = torch.randn(q_shape, device="cuda", dtype=dtype)
    D = torch.randn(d_shape, device="cuda", dtype=dtype)
    q_mask = masks_with_holes(q_shape[:-1], "cuda")
    d_mask = masks_with_holes(d_shape[:-1], "cuda")
    check_against_reference(Q, D, q_mask, d_mask, normalize=normalize, backward=strategy, tol=BOUNDS[dtype])


@pytest.mark.parametrize("strategy", ["unified", "lowmem"])
def test_pairs_parity(strategy):
    Q = torch.randn(9, 31, 128, device="cuda", dtype=torch.bfloat16)
    D = torch.randn(9, 250, 128, device="cuda", dtype=torch.bfloat16)
    check_against_reference(Q, D, pairs=True, backward=strategy, tol=BOUNDS[torch.bfloat16])


def test_fp32_ieee_is_exact_tf32_is_close_and_the_default_follows_torch():
    Q = torch.randn(4, 37, 128, device="cuda")
    D = torch.randn(6, 123, 128, device="cuda")
    with settings.use_fp32_precision("ieee"):
        check_against_reference(Q, D, tol=(1e-5, 1e-5))
        check_against_reference(Q * 300, D * 300, tol=(1e-5, 1e-5))  # far above fp16's range
    ref = maxsim_ref(Q.double(), D.double())
    with settings.use_fp32_precision("tf32"):
        tf32 = maxsim(Q, D)
    assert_close_to_reference(tf32, ref, 2e-3, "tf32 scores")
    # tf32x3 (three TF32 products, an explicit setting) keeps IEEE's bounds, scores and gradients.
    with settings.use_fp32_precision("tf32x3"):
        check_against_reference(Q, D, tol=(1e-5, 1e-5))
        check_against_reference(Q * 300, D * 300, tol=(1e-5, 1e-5))
    # The default follows PyTorch: IEEE under its default "highest", TF32 under "high".
    saved = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        with settings.use_fp32_precision("ieee"):
            ieee = maxsim(Q, D)
        assert torch.equal(maxsim(Q, D), ieee)
        torch.set_float32_matmul_precision("high")
        assert torch.equal(maxsim(Q, D), tf32)
    finally:
        torch.set_float32_matmul_precision(saved)


def test_nan_and_fully_masked_on_gpu():
    Q = leaf(torch.randn(3, 40, 128, device="cuda", dtype=torch.bfloat16))
    D = torch.randn(4, 300, 128, device="cuda", dtype=torch.bfloat16)
    D[1, 200, 3] = float("nan")
    D = leaf(D)
    d_mask = torch.ones(4, 300, dtype=torch.bool, device="cuda")
    d_mask[2] = False
    q_mask = torch.ones(3, 40, dtype=torch.bool, device="cuda")
    q_mask[0] = False
    out = maxsim(Q, D, q_mask, d_mask)
    assert torch.isnan(out[1:, 1]).all() and torch.all(out[0] == 0) and torch.all(out[:, 2] == 0)
    assert not torch.isnan(out[1:, [0, 3]]).any()


def test_lowmem_is_bitwise_reproducible_on_gpu():
    Q = torch.randn(64, 32, 128, device="cuda", dtype=torch.bfloat16)
    D = torch.randn(64, 300, 128, device="cuda", dtype=torch.bfloat16)
    assert_backward_bitwise_reproducible(
        lambda q, d: maxsim(q, d, backward="lowmem").backward(torch.ones(64, 64, device="cuda")),
        Q, D, runs=3,
    )


@pytest.mark.parametrize(
    "q_shape,d_shape",
    [
        pytest.param((2, 1030, 128), (8, 1030, 128), id="Lq1030"),
        pytest.param((4, 32, 128), (6, 8192, 128), id="Ld8192"),
        pytest.param((128, 128, 128), (128, 1024, 128), id="colpali-128x128"),
        # lowmem: the winner index in three even column chunks, five token tiles (a partial group)
        pytest.param((512, 32, 128), (512, 300, 128), id="colbert-512x512"),
    ],
)
@pytest.mark.parametrize("strategy", ["unified", "lowmem"])  # lowmem at colpali: the winner index
def test_large_shapes(q_shape, d_shape, strategy):
    """The float64 reference grid would not fit (128·128·128·1024 doubles = 17 GB): it is built a
    few queries at a time, and its gradients summed over the slices."""
    Q = leaf(F.normalize(torch.randn(q_shape, device="cuda"), dim=-1).bfloat16())
    D = leaf(F.normalize(torch.randn(d_shape, device="cuda"), dim=-1).bfloat16())
    out = maxsim(Q, D, backward=strategy)
    grad = torch.randn_like(out)
    gq, gd = torch.autograd.grad(out, (Q, D), grad)
    Q64, D64 = leaf(Q.double()), leaf(D.double())
    step = max(1, 2**31 // (d_shape[0] * q_shape[1] * d_shape[1] * 8))
    ref = torch.cat([maxsim_ref(Q64[i : i + step].detach(), D64.detach()) for i in range(0, q_shape[0], step)])
    assert_close_to_reference(out, ref, 2e-2, "scores")
    for i in range(0, q_shape[0], step):
        maxsim_ref(Q64[i : i + step], D64).backward(grad[i : i + step].double())
    # Gradients as a whole (see relative_error_fro: a handful of near-ties decided differently in
    # fp32 and float64 move single rows among millions of argmax decisions).
    assert relative_error_fro(gq, Q64.grad) < 1e-2
    assert relative_error_fro(gd, D64.grad) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_smoothmax_half_precision_parity(shape, dtype):
    """colpali-engine's smooth max on unit vectors (tau 0.1, as it trains) and on raw ones."""
    q_shape, d_shape = SHAPES[shape]
    Q = F.normalize(torch.randn(q_shape, device="cuda"), dim=-1).to(dtype)
    D = F.normalize(torch.randn(d_shape, device="cuda"), dim=-1).to(dtype)
    q_mask = masks_with_holes(q_shape[:-1], "cuda")
    d_mask = masks_with_holes(d_shape[:-1], "cuda")
    check_against_reference(Q, D, q_mask, d_mask, reduction="smoothmax", tau=0.1, tol=BOUNDS[dtype])
    Q = torch.randn(q_shape, device="cuda", dtype=dtype)
    D = torch.randn(d_shape, device="cuda", dtype=dtype)
    check_against_reference(Q, D, reduction="smoothmax", tau=1.0, tol=BOUNDS[dtype])


def test_torch_compile_fullgraph_training_step():
    """A whole training step (projection, normalize, MaxSim, loss) under ``fullgraph=True``.

    fp32 with IEEE products: Inductor fuses ``F.normalize`` differently from eager, and in bf16
    those last-bit differences flip near-tied argmaxes, which the temperature then magnifies; the
    bf16 op itself is compared like for like in the next test.
    """
    (loss, grad), (eager_loss, eager_grad) = compiled_and_eager_step("cuda", 8, 32, 180, 64, 128)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, eager_grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("strategy", ["unified", "lowmem"])
def test_torch_compile_bf16_matches_eager(strategy):
    """The compiled op in bf16 on the same inputs as eager: same scores, same gradients."""
    torch._dynamo.reset()
    Q = leaf(torch.randn(8, 32, 128, device="cuda", dtype=torch.bfloat16))
    D = leaf(torch.randn(8, 180, 128, device="cuda", dtype=torch.bfloat16))
    d_mask = torch.rand(8, 180, device="cuda") > 0.2
    grad = torch.randn(8, 8, device="cuda")

    def scores(Q, D, d_mask):
        return maxsim(Q, D, d_mask=d_mask, backward=strategy)

    out = torch.compile(scores, fullgraph=True)(Q, D, d_mask)
    out.backward(grad)
    gq, gd = Q.grad.clone(), D.grad.clone()
    Q.grad = D.grad = None
    eager = scores(Q, D, d_mask)
    eager.backward(grad)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    torch.testing.assert_close(gq, Q.grad, rtol=0, atol=0)
    if strategy == "lowmem":
        torch.testing.assert_close(gd, D.grad, rtol=0, atol=0)
    else:  # fp32 atomics add in varying order: a rounding step apart here and there
        assert relative_error_fro(gd, D.grad) < 1e-3


def test_opcheck_triton_ops():
    fwd, bwd = torch.ops.fusedmaxsim.maxsim_fwd, torch.ops.fusedmaxsim.maxsim_bwd
    Q = torch.randn(3, 20, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    D = torch.randn(4, 50, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    d_mask = torch.rand(4, 50, device="cuda") > 0.2
    for tau in (0.0, 0.25):
        args = (Q, D, None, d_mask, None, None, True, "triton", "tf32", "lowmem", tau)
        torch.library.opcheck(fwd, args)
        scores, saved = fwd(*args)
        grad = torch.randn_like(scores)
        torch.library.opcheck(
            bwd,
            (grad, Q.detach(), D.detach(), saved.detach(), None, None, d_mask, True, True, "lowmem",
             "triton", "tf32", tau),
        )


def _packed_inputs(dtype=torch.bfloat16, dim=64):
    """Packed queries and documents on the GPU (lengths 0 and 1 included), their int32 offsets
    and maxima, and a pair list that repeats a pair."""
    lq, ld = [5, 0, 17, 32, 1], [40, 300, 1, 0, 120, 77]
    Q = torch.randn(sum(lq), dim, device="cuda", dtype=dtype)
    D = torch.randn(sum(ld), dim, device="cuda", dtype=dtype)
    cu_q = torch.tensor([0, *lq], device="cuda").cumsum(0).int()
    cu_d = torch.tensor([0, *ld], device="cuda").cumsum(0).int()
    pair_q = torch.tensor([0, 2, 3, 3, 4, 2, 1, 0], device="cuda")
    pair_d = torch.tensor([1, 0, 4, 4, 5, 1, 2, 3], device="cuda")
    return Q, D, cu_q, cu_d, pair_q, pair_d, max(lq), max(ld)


def test_opcheck_triton_packed_ops():
    """The packed layouts' registered ops on the Triton kernels: schema, fake tensors, autograd
    registration and AOT dispatch, for a packed cross product (masked; normalized) and a pair
    list, each strategy, and the backward with each gradient alone."""
    fwd = torch.ops.fusedmaxsim.maxsim_packed_fwd
    bwd = torch.ops.fusedmaxsim.maxsim_packed_bwd
    Q, D, cu_q, cu_d, pair_q, pair_d, max_q, max_d = _packed_inputs()
    Q, D = leaf(Q), leaf(D)
    q_mask = torch.rand(Q.shape[0], device="cuda") > 0.2
    d_mask = torch.rand(D.shape[0], device="cuda") > 0.2
    q_inv = torch.rand(Q.shape[0], device="cuda") + 0.5
    d_inv = torch.rand(D.shape[0], device="cuda") + 0.5
    for index in ((None, None), (pair_q, pair_d)):
        for masks, norms, strategy in (((q_mask, d_mask), (None, None), "unified"),
                                       ((None, None), (q_inv, d_inv), "lowmem")):
            args = (Q, D, cu_q, cu_d, *index, *masks, *norms, max_q, max_d, 0, -1, True,
                    "triton", "tf32", strategy)
            torch.library.opcheck(fwd, args)
            inference = (Q.detach(), D.detach(), *args[2:14], False, *args[15:])
            torch.library.opcheck(fwd, inference)
            scores, argmax = fwd(*args)
            grad = torch.randn_like(scores)
            for need_q, need_d in ((True, True), (True, False), (False, True)):
                torch.library.opcheck(bwd, (grad, Q.detach(), D.detach(), argmax.detach(), cu_q,
                                            cu_d, *index, *norms, max_q, max_d, 0, -1, need_q,
                                            need_d, strategy, "triton", "tf32"))


@pytest.mark.parametrize("strategy", ["unified", "lowmem"])
def test_torch_compile_packed_layouts_match_eager(strategy):
    """A training step through ``maxsim_varlen``, ``score_pairs_packed`` and ``maxsim_padded``
    under ``torch.compile(fullgraph=True)`` (maxima given, offsets and lengths on the GPU:
    nothing synchronizes while tracing), on the same bf16 inputs as eager: the same scores, the
    same gradients (lowmem bit for bit; unified's fp32 atomics add in varying order)."""
    torch._dynamo.reset()
    Q, D, cu_q, cu_d, pair_q, pair_d, max_q, max_d = _packed_inputs(dim=128)
    q_mask = torch.rand(Q.shape[0], device="cuda") > 0.1
    queries = torch.randn(4, 32, 128, device="cuda", dtype=torch.bfloat16)
    documents = torch.randn(4, 3, 180, 128, device="cuda", dtype=torch.bfloat16)
    qlen = torch.tensor([32, 1, 0, 17], device="cuda")
    dlen = torch.tensor([[180, 5, 0], [1, 180, 99], [40, 40, 40], [0, 0, 7]], device="cuda")

    def step(q_varlen, d_varlen, q_pairs, d_pairs, queries, documents):
        return (
            maxsim_varlen(q_varlen, d_varlen, cu_q, cu_d, max_q, max_d, q_mask=q_mask,
                          backward=strategy),
            score_pairs_packed(q_pairs, d_pairs, cu_q, cu_d, pair_q, pair_d, max_seqlen_q=max_q,
                               max_seqlen_d=max_d, backward=strategy),
            maxsim_padded(queries, documents, qlen, dlen, backward=strategy),
        )

    inputs = (Q, D, Q, D, queries, documents)
    grads = None
    results = []
    for fn in (torch.compile(step, fullgraph=True), step):
        leaves = [leaf(t) for t in inputs]
        outs = fn(*leaves)
        if grads is None:
            grads = [torch.randn_like(out) for out in outs]
        torch.autograd.backward(outs, grads)
        results.append(([out.detach() for out in outs], [t.grad for t in leaves]))
    (outs, grads_compiled), (eager_outs, grads_eager) = results
    for out, eager in zip(outs, eager_outs):
        torch.testing.assert_close(out, eager, rtol=0, atol=0, equal_nan=True)
    for got, want in zip(grads_compiled, grads_eager):
        if strategy == "lowmem":
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        else:  # fp32 atomics add in varying order: a rounding step apart here and there
            assert relative_error_fro(got, want) < 1e-3


def test_training_memory_stays_near_the_floor():
    """lowmem: gradients in bf16 plus the argmax, and little else (the peers: 108-116 MiB)."""
    Q = leaf(F.normalize(torch.randn(128, 128, 128, device="cuda"), dim=-1).bfloat16())
    D = leaf(F.normalize(torch.randn(128, 1024, 128, device="cuda"), dim=-1).bfloat16())
    grad = torch.randn(128, 128, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    maxsim(Q, D, backward="lowmem").backward(grad)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    floor = (Q.numel() + D.numel()) * 2 / 2**20 + 128 * 128 * 128 * 4 / 2**20
    assert peak <= 1.25 * floor + 1, f"peak {peak:.1f} MiB above the inputs, floor {floor:.1f} MiB"


@pytest.mark.parametrize("strategy", ["unified", "lowmem"])
def test_no_host_synchronization_in_a_training_step(strategy):
    """Forward and backward of every dense layout never wait for the GPU: a host sync inside a
    step would stall a training loop behind whatever the GPU still has queued."""
    q_small = leaf(torch.randn(6, 33, 128, device="cuda", dtype=torch.bfloat16))
    d_small = leaf(torch.randn(9, 200, 128, device="cuda", dtype=torch.bfloat16))
    # Past the sizes where the lowmem backward builds its winner index (more launches).
    q_big = leaf(torch.randn(64, 32, 128, device="cuda", dtype=torch.bfloat16))
    d_big = leaf(torch.randn(64, 300, 128, device="cuda", dtype=torch.bfloat16))
    candidates = leaf(torch.randn(6, 5, 200, 128, device="cuda", dtype=torch.bfloat16))
    q_mask = masks_with_holes((6, 33), "cuda")
    d_mask = masks_with_holes((9, 200), "cuda")

    def calls():
        for out in (
            maxsim(q_small, d_small, backward=strategy),
            maxsim(q_small, d_small, q_mask, d_mask, normalize=True, backward=strategy),
            maxsim(q_big, d_big, backward=strategy),
            maxsim(q_small, candidates, backward=strategy),
            maxsim_pairs(q_small, d_small[:6], backward=strategy),
            maxsim(q_small, d_small, reduction="smoothmax", backward=strategy),
        ):
            out.sum().backward()
        with torch.no_grad():
            maxsim(q_small, d_small)
            maxsim(q_big, d_big, normalize=True)

    assert_no_host_synchronization(calls)


def test_pairs_and_candidates_agree_with_cross_on_gpu():
    Q = torch.randn(5, 32, 128, device="cuda", dtype=torch.bfloat16)
    D = torch.randn(5, 100, 128, device="cuda", dtype=torch.bfloat16)
    cross = maxsim(Q, D)
    torch.testing.assert_close(maxsim_pairs(Q, D), cross.diagonal())
    cand = maxsim(Q, D.unsqueeze(0).expand(5, 5, 100, 128))
    torch.testing.assert_close(cand, cross)


@pytest.mark.parametrize("normalize", [False, True], ids=["scores", "normalize"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", ["cross-odd", "cross-colbert", "cross-colpali-many-programs"])
def test_plain_inference_shortcut_is_the_general_path(shape, dtype, normalize):
    """``maxsim``'s plain inference call (no masks, CUDA tensors, no autograd) launches its plan
    straight away, with no autograd node and no dispatcher, and gives bit for bit what the
    general path gives: the same call with ``backward="auto"`` (the same problem and plan) and,
    unnormalized, the registered op that ``torch.compile`` traces. Calls that take other paths
    (autograd, the torch backend, strided inputs) give the same scores too."""
    q_shape, d_shape = SHAPES[shape]
    Q = torch.randn(q_shape, device="cuda", dtype=dtype)
    D = torch.randn(d_shape, device="cuda", dtype=dtype)
    with torch.no_grad(), recording() as plans:
        fast = maxsim(Q, D, normalize=normalize)
        general = maxsim(Q, D, normalize=normalize, backward="auto")
    assert len(plans) == 2 and plans[0] == plans[1]
    p, plan = plans[0]
    assert not p.save_argmax and p.norm_from_tiles == normalize and plan.kernel != "torch"
    assert fast.grad_fn is None
    assert torch.equal(fast, general)
    if not normalize:
        op = torch.ops.fusedmaxsim.maxsim_fwd(Q, D, None, None, None, None, False, "triton",
                                              settings.fp32_precision(), "auto", 0.0)[0]
        assert torch.equal(fast, op)
    ref = maxsim_ref(Q.double(), D.double(), normalize=normalize)
    assert_close_to_reference(fast, ref, BOUNDS.get(dtype, (1e-2, 1e-2))[0], "scores")
    # Autograd: the general path, with a graph (the argmax saved).
    Qg = Q.clone().requires_grad_()
    with recording() as plans:
        assert maxsim(Qg, D, normalize=normalize).grad_fn is not None
    assert plans[0][0].save_argmax
    # The torch backend and a transposed D (strided, as the general path takes it).
    with torch.no_grad(), settings.use_backend("torch"), recording() as plans:
        maxsim(Q, D, normalize=normalize)
    assert [plan.kernel for _, plan in plans] == ["torch"]
    Dt = D.transpose(0, 1).contiguous().transpose(0, 1)
    with torch.no_grad():
        torch.testing.assert_close(maxsim(Q, Dt, normalize=normalize), general)


def _hopper_with_gluon() -> bool:
    from fusedmaxsim.kernels import hopper_forward

    return hopper_forward.AVAILABLE and torch.cuda.get_device_capability()[0] == 9


hopper_only = pytest.mark.skipif(
    not torch.cuda.is_available() or not _hopper_with_gluon(),
    reason="the Gluon forward runs on Hopper GPUs with triton.experimental.gluon only",
)


def _hopper_inputs(q_shape, d_shape, dtype=torch.bfloat16):
    """Random ``Q`` and ``D`` on the GPU."""
    Q = torch.randn(q_shape, device="cuda", dtype=dtype)
    D = torch.randn(d_shape, device="cuda", dtype=dtype)
    return Q, D


def _forward_plan(Q, D, normalize: bool, save_argmax: bool = False, kernel: str = "gluon"):
    """The problem of the unmasked cross product (normalizing, its norms from the tiles, as
    inference does) and its forward's plan forced onto ``kernel``, under the decisions forced
    around the call; the planner's own tiles."""
    p = dense_problem(Q, D, None, None, normalize=normalize, norm_from_tiles=normalize,
                      save_argmax=save_argmax)
    with forced_plan(kernel=kernel):
        plan = plan_forward(p, options_for(Q))
    assert plan.kernel == kernel, plan.reasons
    return p, plan


def _forward(Q, D, normalize: bool, save_argmax: bool = False, kernel: str = "gluon"):
    """``(scores, argmax, plan)`` of the forward forced onto ``kernel``, through its launcher.
    Every output is poisoned first (NaN, -7), so an element the kernel does not write fails
    the checks; a Gluon launch that fails raises here instead of falling back to Triton."""
    from fusedmaxsim._launch.forward import forward_dense

    assert settings.POISON_OUTPUTS
    p, plan = _forward_plan(Q, D, normalize, save_argmax, kernel)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            scores, argmax = forward_dense(plan, p, "tf32", Q, D, None, None, None, None)
    except RuntimeWarning:
        settings.set_hopper_kernel(None)  # the failure turned it off for the process
        raise
    return scores, argmax, plan


@hopper_only
@pytest.mark.parametrize("normalize", [False, True], ids=["scores", "normalize"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "q_shape,d_shape",
    [
        # four packed 32-token queries a block, Nq not a multiple of four; a 44-token last tile
        pytest.param((37, 32, 128), (53, 300, 128), id="packed"),
        # three 128-row chunks, one program each; documents shorter than two tiles
        pytest.param((3, 300, 128), (20, 77, 128), id="chunks"),
        pytest.param((2, 128, 64), (9, 64, 64), id="d64-one-tile"),
        pytest.param((5, 130, 128), (7, 1, 128), id="Ld1-2-row-chunk"),
        pytest.param((4, 64, 128), (11, 200, 128), id="64-rows"),
        # one 32-token query in a 64-row block (half of it empty slots)
        pytest.param((1, 32, 128), (50, 300, 128), id="one-short-query"),
    ],
)
@pytest.mark.parametrize("tiles_first", [False, True], ids=["query-first", "tiles-first"])
def test_hopper_forward_matches_reference_and_triton(tiles_first, normalize, dtype, q_shape,
                                                     d_shape):
    """The Gluon forward (``hopper_forward``), plain and normalizing (a zero token among the
    documents), on the shapes its loop treats apart, with the ring's first tiles requested
    before or after the query chunk (documents beyond or within L2): the scores of float64
    within the dtype's bound, Triton's to fp32 rounding, every score written (NaN-poisoned
    output), a NaN in a document making its column NaN and no other."""
    Q, D = _hopper_inputs(q_shape, d_shape, dtype)
    if normalize:
        D[0, 0] = 0.0
    # The kernel takes d = 64; the dispatch keeps it to the dims where it was measured faster
    # (whatever the work: the least it takes forced to 0).
    p = dense_problem(Q, D, None, None, normalize=normalize, norm_from_tiles=normalize)
    with forced_plan(HOPPER_MIN_MACS=0):
        dispatched = plan_forward(p, options_for(Q)).kernel
    assert (dispatched == "gluon") == (q_shape[-1] in MEASURED["HOPPER_DIMS"])
    with forced_plan(tiles_first=tiles_first):
        plan = _check_hopper_forward(Q, D, normalize)
    assert plan.hopper.tiles_first == tiles_first


def _check_hopper_forward(Q, D, normalize: bool):
    """The Gluon forward's scores: float64's within the dtype's bound, Triton's to fp32
    rounding, every score written (NaN-poisoned output), a NaN in a document making its column
    NaN and no other. Returns the Gluon forward's plan."""
    scores, _, plan = _forward(Q, D, normalize)
    ref = maxsim_ref(Q.double(), D.double(), normalize=normalize)
    assert_close_to_reference(scores, ref, BOUNDS[Q.dtype][0], "scores")
    want, _, _ = _forward(Q, D, normalize, kernel="triton")
    torch.testing.assert_close(scores, want, rtol=1e-5, atol=1e-5)
    D = D.clone()
    D[1, D.shape[1] // 2, 3] = float("nan")
    scores, _, _ = _forward(Q, D, normalize)
    assert scores[:, 1].isnan().all() and not scores[:, [0, 2]].isnan().any()
    return plan


_TILE_SETS = ("HOPPER_TILES", "HOPPER_PACKED_TILES", "HOPPER_NORM_TILES",
              "HOPPER_SHORT_NORM_TILES", "HOPPER_FEW_PROGRAMS_TILES", "HOPPER_SHORT_TILES")
_TILE_SHAPES = {
    "packed": ((37, 32, 128), (53, 300, 128)),
    "chunks": ((3, 300, 128), (20, 77, 128)),
    "one-short-query": ((1, 32, 128), (50, 300, 128)),
}


def _tile_cases(tile_sets, shapes, *skipped) -> list:
    """(tile set, shape) pairs but those skipped, and (as for any forward) the two-warp-group
    tiles on the padded short query: two warp groups split 128 rows, its block has 64."""
    skipped = {("HOPPER_FEW_PROGRAMS_TILES", "one-short-query"), *skipped}
    return [(t, s) for t in tile_sets for s in shapes if (t, s) not in skipped]


@hopper_only
@pytest.mark.parametrize("normalize", [False, True], ids=["scores", "normalize"])
@pytest.mark.parametrize("tile_set,shape", _tile_cases(_TILE_SETS, _TILE_SHAPES))
def test_hopper_forward_under_every_tile_set(tile_set, shape, normalize):
    """Each tile set the dispatch can take (document tile, stages, warps, register cap), forced
    onto the shapes its loop treats apart, plain and normalizing."""
    Q, D = _hopper_inputs(*_TILE_SHAPES[shape])
    with forced_plan(hopper_tiles=MEASURED[tile_set]):
        plan = _check_hopper_forward(Q, D, normalize)
    assert plan.hopper.tiles == MEASURED[tile_set]


_DOC_PASS_SHAPES = {
    "packed": _TILE_SHAPES["packed"],
    "one-short-query": _TILE_SHAPES["one-short-query"],
    "one-long-query": ((1, 128, 128), (23, 1024, 128)),
}


@hopper_only
@pytest.mark.parametrize("normalize", [False, True], ids=["scores", "normalize"])
@pytest.mark.parametrize("tiles_first", [False, True], ids=["query-first", "tiles-first"])
@pytest.mark.parametrize("docs", [2, 3, 16])
@pytest.mark.parametrize("shape", list(_DOC_PASS_SHAPES))
def test_hopper_forward_streams_several_documents_a_program(normalize, tiles_first, docs, shape):
    """Several documents a program, one pass each (the ring's refills running on into the next
    document, the query chunk loaded once): the documents uneven over the programs, a NaN in one
    document leaving the others of its program alone, with the dispatched tiles (4 or 8 warps,
    32- or 64-token tiles)."""
    Q, D = _hopper_inputs(*_DOC_PASS_SHAPES[shape])
    with forced_plan(tiles_first=tiles_first, docs_per_program=docs):
        _, plan = _forward_plan(Q, D, normalize)
        assert plan.hopper.docs_per_program == docs
        _check_hopper_forward(Q, D, normalize)


@hopper_only
@pytest.mark.parametrize("normalize", [False, True], ids=["scores", "normalize"])
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("tiles_first", [False, True], ids=["query-first", "tiles-first"])
def test_hopper_forward_walks_several_chunks_in_one_program(normalize, splits, tiles_first):
    """A program that walks several query chunks (chunk splits capped): the ring of document tiles
    carries its slots and mbarrier phases from one chunk into the next over the same document,
    the chunks uneven over the programs (five chunks over one or two programs), the next
    chunk's first tiles requested before or after its query chunk is loaded."""
    Q = torch.randn(3, 600, 128, device="cuda", dtype=torch.bfloat16)
    D = torch.randn(20, 333, 128, device="cuda", dtype=torch.bfloat16)
    with forced_plan(tiles_first=tiles_first, SPLIT_PARTIALS_MAX_BYTES=splits * 4 * 3 * 20):
        scores, _, plan = _forward(Q, D, normalize)
        assert chunk_splits(600, plan.tiles.lq_tile, 3, 20, False) == splits
    assert plan.splits == splits and plan.hopper.tiles_first == tiles_first
    assert_close_to_reference(scores, maxsim_ref(Q.double(), D.double(), normalize=normalize),
                              BOUNDS[torch.bfloat16][0], "scores")


@hopper_only
@pytest.mark.parametrize("normalize", [False, True], ids=["scores", "normalize"])
def test_hopper_forward_without_a_descriptor_template(normalize):
    """Under a Triton whose TMA descriptor is not a plain dataclass, the launcher builds the
    descriptor with its constructor instead of copying a template: the same scores, bit for
    bit."""
    from fusedmaxsim._launch.forward import _gluon_launch_values

    Q = torch.randn(5, 128, 128, device="cuda", dtype=torch.bfloat16)
    D = torch.randn(30, 333, 128, device="cuda", dtype=torch.bfloat16)
    with_template, _, plan = _forward(Q, D, normalize)
    hopper = plan.hopper
    assert hopper.descriptor_template
    template = _gluon_launch_values(Q.dtype, plan.tiles.lq_tile, hopper.queries_per_block, 128,
                                    normalize, hopper.tiles, hopper.tiles_first,
                                    hopper.docs_per_program, False)[1]
    assert template is not None  # the first launch copied a template
    with forced_plan(descriptor_template=False):
        constructed, _, plan = _forward(Q, D, normalize)
    assert not plan.hopper.descriptor_template
    assert torch.equal(constructed, with_template)
    assert_close_to_reference(constructed, maxsim_ref(Q.double(), D.double(), normalize=normalize),
                              BOUNDS[torch.bfloat16][0], "scores")


_ARGMAX_TILE_SETS = ("HOPPER_TILES", "HOPPER_PACKED_TILES", "HOPPER_FEW_PROGRAMS_TILES",
                     "HOPPER_SHORT_TILES")
_ARGMAX_SHAPES = {
    **_TILE_SHAPES,
    "Ld1": ((5, 130, 128), (7, 1, 128)),
    # 16 tiles of 64 tokens, the most a pass can code
    "one-long-query": ((1, 128, 128), (23, 1024, 128)),
}


def _check_hopper_argmax(Q, D) -> None:
    """The Gluon forward with the argmax: scores of float64 within the dtype's bound and
    Triton's within 16 units in the last place, every argmax written (poisoned output) and
    inside its document, each winner's float64 similarity the row's maximum to fp32 rounding
    and 16 units in the last place, a NaN in a document making its column NaN and no other, and
    an infinite similarity making its column's scores not finite (NaN where the tile's code is
    not 0: docs/design.md, Hopper: the coded argmax)."""
    Nq, Lq, _ = Q.shape
    Nd, Ld, _ = D.shape
    scores, argmax, _ = _forward(Q, D, False, save_argmax=True)
    assert argmax.shape == (Nq, Nd, Lq)
    assert_close_to_reference(scores, maxsim_ref(Q.double(), D.double()), BOUNDS[Q.dtype][0],
                              "scores")
    want, _, _ = _forward(Q, D, False, save_argmax=True, kernel="triton")
    torch.testing.assert_close(scores, want, rtol=1e-5, atol=1e-5)
    assert ((argmax >= 0) & (argmax < Ld)).all()
    sims = torch.einsum("isk,jtk->ijst", Q.double(), D.double())
    best = sims.amax(-1)
    won = sims.gather(-1, argmax.long().unsqueeze(-1)).squeeze(-1)
    assert ((best - won) <= 1e-5 * best.abs() + 1e-5).all()
    D = D.clone()
    D[1, D.shape[1] // 2, 3] = float("nan")
    scores, argmax, _ = _forward(Q, D, False, save_argmax=True)
    assert scores[:, 1].isnan().all() and not scores[:, [0, 2]].isnan().any()
    assert ((argmax >= 0) & (argmax < Ld)).all()
    Q = Q.clone()
    Q[..., 3] = Q[..., 3].abs() + 1  # every similarity with the infinite token is +inf
    D[1, D.shape[1] // 2, 3] = float("inf")
    scores, argmax, _ = _forward(Q, D, False, save_argmax=True)
    assert not scores[:, 1].isfinite().any() and scores[:, [0, 2]].isfinite().all()
    assert ((argmax >= 0) & (argmax < Ld)).all()


@hopper_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "tile_set,shape",
    # 32 tiles of 32 tokens: more than a pass can code
    _tile_cases(_ARGMAX_TILE_SETS, _ARGMAX_SHAPES, ("HOPPER_SHORT_TILES", "one-long-query")),
)
def test_hopper_argmax_forward_under_every_tile_set(tile_set, shape, dtype):
    """The training forward in Gluon (the argmax in the running max's low bits) under each tile
    set, on the shapes its loop treats apart."""
    Q, D = _hopper_inputs(*_ARGMAX_SHAPES[shape], dtype)
    with forced_plan(hopper_tiles=MEASURED[tile_set]):
        _check_hopper_argmax(Q, D)


@hopper_only
@pytest.mark.parametrize("docs", [2, 3, 16])
@pytest.mark.parametrize("shape", list(_DOC_PASS_SHAPES))
def test_hopper_argmax_forward_streams_several_documents_a_program(docs, shape):
    """The argmax of each document of a program's passes lands in that document's column."""
    Q, D = _hopper_inputs(*_DOC_PASS_SHAPES[shape])
    with forced_plan(docs_per_program=docs):
        _check_hopper_argmax(Q, D)


@hopper_only
def test_hopper_argmax_ties_follow_the_sign_of_the_max():
    """Documents whose tokens are one token repeated (every similarity of a row tied, across
    tiles and columns): the winner is token 0 wherever the maximum is 0 or more, the zero
    document (all similarities 0) included; where it is negative, the first token of the last
    tile (the coded values of a negative similarity order their codes the other way)."""
    Q, D = _hopper_inputs((4, 128, 128), (6, 1, 128))
    D = D.expand(-1, 1000, -1).contiguous()
    D[5] = 0.0
    _, argmax, plan = _forward(Q, D, False, save_argmax=True)
    value = torch.einsum("isk,jk->ijs", Q.double(), D[:, 0].double())
    assert (argmax[value >= 0] == 0).all()
    block_n = plan.hopper.tiles[0]
    assert (value < 0).any()
    assert (argmax[value < 0] == (1000 - 1) // block_n * block_n).all()
    assert (argmax[:, 5] == 0).all()
    assert ((argmax >= 0) & (argmax < 1000)).all()


def _forward_kernels(plans) -> list:
    """``(argmax saved, kernel)`` of each forward planned in a ``recording()`` block."""
    return [(p.save_argmax, plan.kernel) for p, plan in plans if isinstance(plan, ForwardPlan)]


@hopper_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_hopper_argmax_forward_trains(dtype):
    """``maxsim``'s training step through the Gluon forward: scores and both gradients of
    float64 within the dtype's bounds (random grad_output, and the stride-0 one of
    ``sum().backward()``), the same as through the Triton forward but for near-ties."""
    Q = torch.randn(37, 32, 128, device="cuda", dtype=dtype)
    D = torch.randn(53, 300, 128, device="cuda", dtype=dtype)
    g = torch.randn(37, 53, device="cuda")
    Qd, Dd = leaf(Q.double()), leaf(D.double())
    maxsim_ref(Qd, Dd).backward(g.double())
    for grad_out in (g, None):
        Ql, Dl = leaf(Q.clone()), leaf(D.clone())
        with forced_plan(HOPPER_MIN_MACS=0), recording() as plans:
            out = maxsim(Ql, Dl)
        assert _forward_kernels(plans) == [(True, "gluon")]
        (out.backward(grad_out) if grad_out is not None else out.sum().backward())
        if grad_out is None:
            Qd.grad = Dd.grad = None
            maxsim_ref(Qd, Dd).sum().backward()
        assert_close_to_reference(out, maxsim_ref(Q.double(), D.double()), BOUNDS[dtype][0],
                                  "scores")
        assert_close_to_reference(Ql.grad, Qd.grad, BOUNDS[dtype][1], "grad_Q")
        assert_close_to_reference(Dl.grad, Dd.grad, BOUNDS[dtype][1], "grad_D")
    assert settings.hopper_kernel()  # the Gluon launches did not fail (and fall back)


@hopper_only
def test_hopper_forward_is_what_the_dispatch_runs_where_it_applies():
    """``maxsim`` under no_grad takes the Gluon forward for unmasked 16-bit cross products, with
    or without normalization, a single short query and a grid of fewer programs than SMs
    included, and the Triton kernel for masks, the smooth max and per-query candidates; in
    training (the argmax saved) the Gluon forward where a pass's tiles fit its codes; each
    result matches float64."""
    Q = torch.randn(64, 32, 128, device="cuda", dtype=torch.bfloat16)
    D = torch.randn(80, 150, 128, device="cuda", dtype=torch.bfloat16)
    d_mask = masks_with_holes(D.shape[:-1], "cuda")
    many_docs = D.repeat(4, 1, 1)
    cases = (
        ("plain", True, lambda: maxsim(Q, D), lambda: maxsim_ref(Q.double(), D.double())),
        ("masked", False, lambda: maxsim(Q, D, d_mask=d_mask),
         lambda: maxsim_ref(Q.double(), D.double(), d_mask=d_mask)),
        ("normalize", True, lambda: maxsim(Q, D, normalize=True),
         lambda: maxsim_ref(Q.double(), D.double(), normalize=True)),
        # one 32-token query, padded to a 64-row block, against more documents than SMs
        ("one short query", True, lambda: maxsim(Q[:1], many_docs),
         lambda: maxsim_ref(Q[:1].double(), many_docs.double())),
        # 16 queries in 4 blocks against 8 documents: 32 programs, two warp groups each
        ("few programs", True, lambda: maxsim(Q[:16], D[:8]),
         lambda: maxsim_ref(Q[:16].double(), D[:8].double())),
        ("smooth max", False, lambda: maxsim(Q, D, reduction="smoothmax"),
         lambda: maxsim_ref(Q.double(), D.double(), reduction="smoothmax")),
        ("candidates", False, lambda: maxsim(Q[:8], D[:16].view(8, 2, 150, 128)),
         lambda: maxsim_ref(Q[:8].double(), D[:16].view(8, 2, 150, 128).double())),
    )
    with forced_plan(HOPPER_MIN_MACS=0):
        for name, gluon, run, ref in cases:
            with torch.no_grad(), recording() as plans:
                out = run()
            assert _forward_kernels(plans) == [(False, "gluon" if gluon else "triton")], name
            assert_close_to_reference(out, ref(), 2e-2, name)
        for normalize in (False, True):
            # Training: the forward saves the argmax, in Gluon where the pass's tiles fit its
            # codes; normalizing, with the norms computed before the kernel, on Triton's.
            with recording() as plans:
                maxsim(leaf(Q.clone()), D, normalize=normalize)
            assert _forward_kernels(plans) == [(True, "triton" if normalize else "gluon")]
        with recording() as plans:
            maxsim(leaf(Q.clone()), D.repeat(1, 8, 1))  # 19 tiles of 64 tokens: more than the codes
        assert _forward_kernels(plans) == [(True, "triton")]
        with settings.use_exact_ties(), recording() as plans:  # exact ties: Triton's argmax
            maxsim(leaf(Q.clone()), D)
        assert _forward_kernels(plans) == [(True, "triton")]
    assert settings.hopper_kernel()  # the Gluon launches did not fail (and fall back)
