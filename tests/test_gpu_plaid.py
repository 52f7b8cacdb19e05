"""GPU suite for PLAID residual documents (``pytest -m gpu``): maxsim_residual on CUDA against
the float64 oracle, and no host synchronization on its path."""

import pytest
import torch
from helpers import assert_no_host_synchronization, masks_with_holes

from fusedmaxsim.plaid import maxsim_residual
from fusedmaxsim.reference import maxsim_residual_ref
from fusedmaxsim.testing import assert_close_to_reference

pytestmark = pytest.mark.gpu

BOUNDS = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5}


def _index(Nd, Ld, d, nbits, n_centroids=4096):
    codes = torch.randint(0, n_centroids, (Nd, Ld), device="cuda")
    residuals = torch.randint(0, 256, (Nd, Ld, d * nbits // 8), device="cuda", dtype=torch.uint8)
    centroids = torch.randn(n_centroids, d, device="cuda", dtype=torch.float16)
    weights = torch.randn(1 << nbits, device="cuda") * 0.1
    lengths = torch.randint(0, Ld + 1, (Nd,), device="cuda")
    lengths[0] = 0
    return codes, residuals, lengths, centroids, weights


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("nbits", [2, 4])
def test_residual_parity_on_cuda(dtype, nbits):
    codes, residuals, lengths, centroids, weights = _index(37, 130, 128, nbits)
    Q = torch.randn(5, 32, 128, device="cuda", dtype=dtype, requires_grad=True)
    q_mask = masks_with_holes((5, 32), "cuda")
    Q64 = Q.detach().double().requires_grad_()
    out = maxsim_residual(Q, codes, residuals, lengths, centroids, weights, nbits, q_mask=q_mask)
    # The oracle rounds the decompressed tokens to the centroids' dtype, as the kernel does.
    ref = maxsim_residual_ref(Q64, codes, residuals, lengths, centroids, weights, nbits,
                              q_mask=q_mask)
    assert_close_to_reference(out, ref, BOUNDS[dtype], "scores")
    g = torch.randn_like(out)
    gq, = torch.autograd.grad(out, Q, g)
    rq, = torch.autograd.grad(ref, Q64, g.double())
    assert_close_to_reference(gq, rq, BOUNDS[dtype], "grad_Q")


def test_residual_has_no_host_synchronization():
    codes, residuals, lengths, centroids, weights = _index(20, 64, 128, 2)
    Q = torch.randn(3, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def calls():
        with torch.no_grad():
            maxsim_residual(Q, codes, residuals, lengths, centroids, weights, 2)
        maxsim_residual(Q, codes, residuals, lengths, centroids, weights, 2).sum().backward()

    assert_no_host_synchronization(calls)
