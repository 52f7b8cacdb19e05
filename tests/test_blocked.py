"""The PyTorch path: bounded memory, block-size independence, and the registered ops' contracts."""

import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import leaf

from fusedmaxsim import maxsim, settings
from fusedmaxsim._torch_path import plan_blocks


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
