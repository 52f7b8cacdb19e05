"""``torch.autocast`` changes nothing inside a call: every front door gives the same scores and
gradients, bit for bit, with autocast on (bf16 on the CPU) as without it, on both backends and
both routes of the projection head, the backward run inside the autocast block or after it."""

import pytest
import torch
import torch.nn.functional as F

from fusedmaxsim import (
    forced_plan,
    maxsim,
    maxsim_from_hidden,
    maxsim_padded,
    maxsim_pairs,
    maxsim_ragged,
    maxsim_varlen,
    retrieve,
    score_pairs_packed,
)
from fusedmaxsim.plaid import PlaidIndex, maxsim_residual, plaid_approx_score, plaid_search

GEN = torch.Generator().manual_seed(0)
Q = torch.randn(3, 5, 16, generator=GEN)
D = torch.randn(4, 9, 16, generator=GEN)
H = torch.randn(4, 9, 24, generator=GEN)
W = torch.randn(16, 24, generator=GEN) / 5
B = torch.randn(16, generator=GEN) / 10
CU_Q, CU_D = torch.tensor([0, 5, 10, 15]), torch.tensor([0, 9, 18, 27, 36])

# Each call takes the leaves (Q first) and returns the scores.
CALLS = {
    "maxsim": (lambda q, d: maxsim(q, d), (Q, D)),
    "maxsim normalized": (lambda q, d: maxsim(q, d, normalize=True), (Q, D)),
    "maxsim smoothmax normalized": (
        lambda q, d: maxsim(q, d, normalize=True, reduction="smoothmax"), (Q, D)),
    "maxsim candidates": (lambda q, d: maxsim(q, d), (Q, torch.randn(3, 2, 4, 16, generator=GEN))),
    "maxsim_pairs": (lambda q, d: maxsim_pairs(q, d, normalize=True), (Q, D[:3])),
    "maxsim_varlen": (lambda q, d: maxsim_varlen(q, d, CU_Q, CU_D, normalize=True),
                      (Q.reshape(15, 16), D.reshape(36, 16))),
    "score_pairs_packed": (
        lambda q, d: score_pairs_packed(q, d, CU_Q, CU_D, torch.tensor([0, 2, 1]),
                                        torch.tensor([3, 0, 1])),
        (Q.reshape(15, 16), D.reshape(36, 16))),
    "maxsim_ragged": (lambda q, d: maxsim_ragged([q[0, :2], q[1]], [d[0], d[1, :3]]), (Q, D)),
    "maxsim_padded": (
        lambda q, d: maxsim_padded(q, d.view(2, 2, 9, 16), torch.tensor([5, 2]),
                                   torch.tensor([[9, 1], [0, 4]])), (Q[:2], D)),
    "maxsim_from_hidden": (lambda q, h, w, b: maxsim_from_hidden(q, h, w, b), (Q, H, W, B)),
}


def _run(name, autocast, backward_inside, decisions):
    fn, inputs = CALLS[name]
    leaves = [t.clone().requires_grad_() for t in inputs]
    with forced_plan(**decisions):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = fn(*leaves)
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
            if backward_inside:
                out.backward(g)
        if not backward_inside:
            out.backward(g)
    return out, [t.grad for t in leaves]


@pytest.mark.parametrize("backward_inside", [False, True], ids=["backward-after", "backward-inside"])
@pytest.mark.parametrize("name", list(CALLS))
def test_autocast_changes_nothing(name, backward_inside, backend):
    """The head on each of the backend's routes (the PyTorch path has the unfused one only)."""
    routes = ("fused", "unfused") if "hidden" in name and backend == "triton" else (None,)
    for route in routes:
        decisions = {} if route is None else {"hidden_route": route}
        out, grads = _run(name, False, False, decisions)
        out_ac, grads_ac = _run(name, True, backward_inside, decisions)
        assert out_ac.dtype == out.dtype
        torch.testing.assert_close(out_ac, out, rtol=0, atol=0)
        for g_ac, g in zip(grads_ac, grads):
            assert g_ac.dtype == g.dtype
            torch.testing.assert_close(g_ac, g, rtol=0, atol=0)


def test_autocast_changes_nothing_in_retrieval_and_plaid(backend):
    """Inference: top-k retrieval, PLAID's residual scores, approximate scores and search."""
    gen = torch.Generator().manual_seed(2)
    d, n_centroids, nbits = 16, 6, 2
    lengths = torch.tensor([3, 0, 5, 1, 4])
    codes = torch.randint(0, n_centroids, (5, 5), generator=gen)
    residuals = torch.randint(0, 256, (5, 5, d * nbits // 8), generator=gen, dtype=torch.uint8)
    centroids = F.normalize(torch.randn(n_centroids, d, generator=gen), dim=-1)
    weights = torch.randn(1 << nbits, generator=gen) * 0.1
    flat = torch.cat([codes[i, :n] for i, n in enumerate(lengths.tolist())])
    flat_res = torch.cat([residuals[i, :n] for i, n in enumerate(lengths.tolist())])
    index = PlaidIndex.from_tensors(centroids, weights, nbits, flat, flat_res, lengths)
    cs = torch.randn(3, n_centroids, 5, generator=gen)

    def calls():
        return (*retrieve(Q, D, 2, normalize=True),
                maxsim_residual(Q, codes, residuals, lengths, centroids, weights, nbits),
                plaid_approx_score(cs, codes, lengths),
                *plaid_search(Q, index, 2, n_probe=2, n_candidates=3))

    plain = calls()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = calls()
    for a, b in zip(under, plain):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_autocast_changes_nothing_compiled():
    """A forward compiled with ``fullgraph=True`` (the eager compiler backend) under autocast,
    and its backward: the scores and gradients of the plain eager call."""
    def scores(q, d):
        return maxsim(q, d, normalize=True)

    found = []
    for fn, on in ((scores, False), (torch.compile(scores, fullgraph=True, backend="eager"), True)):
        leaves = [t.clone().requires_grad_() for t in (Q, D)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
            out = fn(*leaves)
            out.backward(torch.ones_like(out))
        found.append([out.detach(), *(t.grad for t in leaves)])
    for a, b in zip(*found):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)
