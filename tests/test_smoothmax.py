"""The smooth max (``reduction="smoothmax"``): ``tau · logsumexp(s / tau)`` over document tokens,
forward and gradients against the float64 reference on both paths, with the max's mask semantics.
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    LAYOUTS,
    assert_backward_bitwise_reproducible,
    check_against_reference,
    leaf,
    random_problem,
)

from fusedmaxsim import maxsim, maxsim_pairs, settings
from fusedmaxsim.reference import maxsim_ref
from fusedmaxsim.testing import assert_close_to_reference


@pytest.mark.parametrize("tau", [0.1, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parity_with_masks(backend, device, layout, dtype, tau):
    Q, D, q_mask, d_mask = random_problem(layout, dtype, device)
    out = check_against_reference(
        Q, D, q_mask, d_mask, pairs=layout == "pairs", reduction="smoothmax", tau=tau
    )
    assert torch.all(out[0] == 0)  # the fully masked first query


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parity_without_masks_and_normalized(backend, device, layout):
    Q, D, _, _ = random_problem(layout, torch.float32, device, masks=False)
    check_against_reference(Q, D, pairs=layout == "pairs", reduction="smoothmax", tau=0.3)
    check_against_reference(
        Q, D, pairs=layout == "pairs", normalize=True, reduction="smoothmax", tau=0.05
    )


def test_bf16_parity(backend, device):
    Q, D, q_mask, d_mask = random_problem("cross", torch.bfloat16, device)
    check_against_reference(Q, D, q_mask, d_mask, reduction="smoothmax", tau=0.5)


def test_fully_masked_documents_score_zero_and_get_zero_gradient(backend, device):
    Q, D, q_mask, d_mask = random_problem("cross", torch.float32, device)
    Q, D = leaf(Q), leaf(D)
    out = maxsim(Q, D, q_mask, d_mask, reduction="smoothmax")
    out.backward(torch.randn_like(out))
    assert torch.all(out[:, 0] == 0)  # document 0 is fully masked
    assert torch.all(D.grad[0] == 0) and torch.all(Q.grad[0] == 0)
    assert torch.all(D.grad[~d_mask] == 0)  # masked tokens take no part in the softmax


@pytest.mark.parametrize("Lq,Ld", [(1, 1), (1, 13), (7, 1), (0, 5), (5, 0)])
def test_small_and_empty_lengths(backend, device, Lq, Ld):
    Q = torch.randn(2, Lq, 32, device=device)
    D = torch.randn(3, Ld, 32, device=device)
    if Lq and Ld:
        check_against_reference(Q, D, reduction="smoothmax", tau=0.2)
    else:
        Q, D = leaf(Q), leaf(D)
        out = maxsim(Q, D, reduction="smoothmax")
        assert out.shape == (2, 3) and torch.all(out == 0)
        out.sum().backward()
        assert torch.all(Q.grad == 0) and torch.all(D.grad == 0)


@pytest.mark.parametrize("q_shape,d_shape", [((0, 7, 16), (3, 13, 16)), ((2, 7, 16), (0, 13, 16))])
def test_empty_batches(backend, device, q_shape, d_shape):
    out = maxsim(torch.randn(q_shape, device=device), torch.randn(d_shape, device=device),
                 reduction="smoothmax")
    assert out.shape == (q_shape[0], d_shape[0])


def test_two_dimensional_inputs_and_non_contiguous_views(backend, device):
    Q = torch.randn(3, 96, 7, device=device).transpose(1, 2)  # [3, 7, 96], strided
    D = torch.randn(5, 26, 96, device=device)[:, ::2]  # [5, 13, 96], every other token
    check_against_reference(Q, D, reduction="smoothmax", tau=0.5)
    check_against_reference(Q[0], D[1], reduction="smoothmax", tau=0.5)


def test_small_tau_tends_to_the_max(backend, device):
    Q, D, q_mask, d_mask = random_problem("cross", torch.float32, device)
    smooth = maxsim(Q, D, q_mask, d_mask, reduction="smoothmax", tau=1e-4)
    hard = maxsim(Q, D, q_mask, d_mask)
    assert_close_to_reference(smooth, hard.double(), 1e-3, "tau -> 0")


def test_large_similarities_do_not_overflow(backend, device):
    """Similarities up to ~150 with tau = 0.5: exp(s / tau) overflows fp32 unless the kernel
    shifts by the running max."""
    Q = torch.randn(2, 7, 32, device=device) * 3
    D = torch.randn(3, 13, 32, device=device) * 3
    assert (torch.einsum("qsh,dth->qdst", Q, D) / 0.5).max() > 88  # exp() of it is inf in fp32
    check_against_reference(Q, D, reduction="smoothmax", tau=0.5)


def test_backward_is_bitwise_reproducible(backend, device):
    Q, D, q_mask, d_mask = random_problem("cross", torch.float32, device)
    assert_backward_bitwise_reproducible(
        lambda q, d: maxsim(q, d, q_mask, d_mask, reduction="smoothmax").sum().backward(), Q, D
    )


def test_pairs_equal_the_diagonal(backend, device):
    Q, D, _, _ = random_problem("pairs", torch.float32, device, masks=False)
    diagonal = maxsim(Q, D, reduction="smoothmax").diagonal()
    torch.testing.assert_close(maxsim_pairs(Q, D, reduction="smoothmax"), diagonal)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(reduction="mean"), r"reduction= must be one of \('max', 'smoothmax'\)"),
        (dict(reduction="smoothmax", tau=0.0), "tau= must be a finite number > 0"),
        (dict(reduction="smoothmax", tau=-1.0), "tau= must be a finite number > 0"),
        (dict(reduction="smoothmax", tau=float("nan")), "tau= must be a finite number > 0"),
        (dict(reduction="smoothmax", tau=True), "tau= must be a finite number > 0"),
        (dict(reduction="smoothmax", tau="0.1"), "tau= must be a finite number > 0"),
    ],
)
def test_bad_reduction_arguments(kwargs, message):
    Q, D = torch.randn(2, 3, 8), torch.randn(4, 5, 8)
    with pytest.raises(ValueError, match=message):
        maxsim(Q, D, **kwargs)
    with pytest.raises(ValueError, match=message):
        maxsim_pairs(Q, D[:2], **kwargs)


def test_torch_compile_fullgraph(backend, device):
    torch._dynamo.reset()
    Q, D, q_mask, d_mask = random_problem("cross", torch.float32, device)
    Q, D = leaf(Q), leaf(D)

    def loss(Q, D):
        scores = maxsim(Q, D, q_mask, d_mask, reduction="smoothmax", tau=0.2)
        return F.cross_entropy(scores, torch.arange(3, device=device))

    with settings.use_fp32_precision("ieee"):
        compiled = torch.compile(loss, fullgraph=True)(Q, D)
        gq, gd = torch.autograd.grad(compiled, (Q, D))
        eager = loss(Q, D)
        rq, rd = torch.autograd.grad(eager, (Q, D))
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(gq, rq)
    torch.testing.assert_close(gd, rd)


def test_reference_matches_colpali_formula(device):
    """The reference is colpali-engine's `tau * logsumexp(s / tau)` with no masks."""
    Q = torch.randn(2, 5, 16, device=device, dtype=torch.float64)
    D = torch.randn(3, 9, 16, device=device, dtype=torch.float64)
    sim = torch.einsum("bnd,csd->bcns", Q, D)
    expected = (0.1 * torch.logsumexp(sim / 0.1, dim=3)).sum(dim=2)
    torch.testing.assert_close(maxsim_ref(Q, D, reduction="smoothmax", tau=0.1), expected)


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
def test_nan_in_masked_tokens_is_never_read(backend, device, normalize):
    """NaN in masked query and document tokens changes neither the scores nor any gradient."""
    Q, D, q_mask, d_mask = random_problem("cross", torch.float32, device)
    Q[~q_mask] = float("nan")
    D[~d_mask] = float("nan")
    Q, D = leaf(Q), leaf(D)
    grad = torch.randn(3, 5, device=device)
    out = maxsim(Q, D, q_mask, d_mask, normalize=normalize, reduction="smoothmax", tau=0.3)
    gq, gd = torch.autograd.grad(out, (Q, D), grad)
    clean_q = torch.where(q_mask[..., None], Q.detach(), 0.0).double().requires_grad_()
    clean_d = torch.where(d_mask[..., None], D.detach(), 0.0).double().requires_grad_()
    ref = maxsim_ref(
        clean_q, clean_d, q_mask, d_mask, normalize=normalize, reduction="smoothmax", tau=0.3
    )
    rq, rd = torch.autograd.grad(ref, (clean_q, clean_d), grad.double())
    assert_close_to_reference(out, ref, 1e-5, "scores")
    assert_close_to_reference(gq, rq, 1e-4, "grad_Q")
    assert_close_to_reference(gd, rd, 1e-4, "grad_D")
    # and a NaN in a valid token still reaches its scores
    Q2 = Q.detach().clone()
    Q2[1][q_mask[1].nonzero()[0]] = float("nan")
    out = maxsim(Q2, D.detach(), q_mask, d_mask, reduction="smoothmax")
    assert torch.isnan(out[1, 1:]).all() and not torch.isnan(out[2]).any()
