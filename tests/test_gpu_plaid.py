"""GPU suite for PLAID residual documents (``pytest -m gpu``): maxsim_residual and
maxsim_residual_varlen on CUDA against the float64 oracle, no host synchronization on their
path and no compilation per document length; the search against fast-plaid's answers (the
committed fixture, and fast-plaid itself where it is installed)."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_no_host_synchronization, masks_with_holes

from fusedmaxsim.kernels.forward import _maxsim_residual_fwd_kernel
from fusedmaxsim.plaid import (
    PlaidIndex, decompress_residuals, load, maxsim_residual, maxsim_residual_varlen,
)
from fusedmaxsim.reference import decompress_residuals_ref, maxsim_residual_ref
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
@pytest.mark.parametrize("nbits", [1, 2, 4, 8])
def test_residual_parity_on_cuda(dtype, nbits):
    """Every width, both orders' default (fast-plaid's), fp32 weights with fp16 centroids."""
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


@pytest.mark.parametrize("bit_order", ["big", "little"])
@pytest.mark.parametrize("nbits", [1, 2, 4, 8])
@pytest.mark.parametrize("dtypes", [
    (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32), (torch.float32, torch.float32)], ids=str)
def test_decoded_values_exact_on_cuda(dtypes, nbits, bit_order):
    """The kernel's decoded values bit for bit: one-hot query tokens against one-token
    documents (no normalization) score exactly a token's value in one dimension, which must be
    decompress_residuals' (fp32 sum rounded to the centroids' dtype), bf16 included."""
    d, n = 128, 300
    codes = torch.randint(0, 64, (n, 1), device="cuda")
    residuals = torch.randint(0, 256, (n, 1, d * nbits // 8), device="cuda", dtype=torch.uint8)
    centroids = (torch.randn(64, d, device="cuda") * 100).to(dtypes[0])  # sums that round
    weights = (torch.randn(1 << nbits, device="cuda") * 0.1).to(dtypes[1])
    Q = torch.eye(d, device="cuda", dtype=dtypes[0])[:, None, :]
    out = maxsim_residual(Q, codes, residuals, torch.ones(n, dtype=torch.int64, device="cuda"),
                          centroids, weights, nbits, normalize=False, bit_order=bit_order)
    tokens = decompress_residuals(codes, residuals, centroids, weights, nbits,
                                  bit_order=bit_order)[:, 0]
    assert torch.equal(out, tokens.float().T)


def test_residual_has_no_host_synchronization():
    codes, residuals, lengths, centroids, weights = _index(20, 64, 128, 2)
    Q = torch.randn(3, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def calls():
        with torch.no_grad():
            maxsim_residual(Q, codes, residuals, lengths, centroids, weights, 2)
        maxsim_residual(Q, codes, residuals, lengths, centroids, weights, 2).sum().backward()

    assert_no_host_synchronization(calls)


def _packed(Nd, max_len, d, nbits, n_centroids=4096, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (Nd,), device="cuda", generator=gen)
    lengths[0] = 0
    T = int(lengths.sum())
    codes = torch.randint(0, n_centroids, (T,), device="cuda", generator=gen)
    residuals = torch.randint(0, 256, (T, d * nbits // 8), device="cuda", dtype=torch.uint8,
                              generator=gen)
    centroids = torch.randn(n_centroids, d, device="cuda", generator=gen).half()
    weights = torch.randn(1 << nbits, device="cuda", generator=gen) * 0.1
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    return codes, residuals, cu, centroids, weights, lengths


def _padded(codes, residuals, cu, lengths):
    Ld = int(lengths.max())
    pos = torch.arange(Ld, device="cuda")
    valid = pos < lengths[:, None]
    rows = torch.where(valid, cu[:-1, None] + pos, 0)
    return codes[rows], residuals[rows]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("nbits", [2, 4])
def test_varlen_parity_on_cuda(dtype, nbits):
    codes, residuals, cu, centroids, weights, lengths = _packed(57, 180, 128, nbits)
    pc, pr = _padded(codes, residuals, cu, lengths)
    Q = torch.randn(6, 32, 128, device="cuda", dtype=dtype, requires_grad=True)
    q_mask = masks_with_holes((6, 32), "cuda")
    Q64 = Q.detach().double().requires_grad_()
    out = maxsim_residual_varlen(Q, codes, residuals, cu, centroids, weights, nbits,
                                 q_mask=q_mask)
    ref = maxsim_residual_ref(Q64, pc, pr, lengths, centroids, weights, nbits, q_mask=q_mask)
    assert_close_to_reference(out, ref, BOUNDS[dtype], "scores")
    g = torch.randn_like(out)
    gq, = torch.autograd.grad(out, Q, g)
    rq, = torch.autograd.grad(ref, Q64, g.double())
    assert_close_to_reference(gq, rq, BOUNDS[dtype], "grad_Q")


def _compiled(kernel) -> int:
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def test_varlen_compiles_once_and_never_synchronizes():
    """Inference on GPU offsets without max_seqlen_d: no synchronization, and a batch whose
    longest document differs compiles nothing new."""
    Q = torch.randn(4, 32, 128, device="cuda", dtype=torch.float16)
    first = _packed(40, 70, 128, 2, seed=1)
    second = _packed(33, 300, 128, 2, seed=2)
    with torch.no_grad():
        maxsim_residual_varlen(Q, *first[:5], 2)
        before = _compiled(_maxsim_residual_fwd_kernel)
        maxsim_residual_varlen(Q, *second[:5], 2)
        assert _compiled(_maxsim_residual_fwd_kernel) == before

    def calls():
        with torch.no_grad():
            maxsim_residual_varlen(Q, *second[:5], 2)

    assert_no_host_synchronization(calls)


FIXTURE = Path(__file__).parent / "fixtures" / "fast_plaid"


def _check_against(answers_results, settings, index, Q, q_mask, ties=False):
    """Our search against fast-plaid's answers: the same ids, scores within its 1e-3. With
    ``ties``, a query may swap one document at the cut for one that our exact scores put
    within 1e-3 of the cut or above it: a near-tie that fast-plaid's fp16 scoring, on an index
    its GPU k-means builds anew each run, settles either way."""
    for name, results in answers_results.items():
        kw = settings[name]
        scores, ids = index.search(Q, kw["top_k"], n_probe=kw["n_ivf_probe"],
                                   n_candidates=kw["n_full_scores"], q_mask=q_mask)
        for q, theirs in enumerate(results):
            n = len(theirs["ids"])
            missing = set(theirs["ids"]) - set(ids[q, :n].tolist())
            if ties and len(missing) == 1:
                exact = index.score(Q[q:q + 1], q_mask=None if q_mask is None else
                                    q_mask[q:q + 1])[0]
                cut = float(scores[q, n - 1])
                m = missing.pop()
                assert float(exact[m]) >= cut - 1e-3 * max(1.0, abs(cut)), (name, q, m, cut)
            else:
                assert not missing, (name, q, missing)
            by_id = dict(zip(theirs["ids"], theirs["scores"]))
            for s, j in zip(scores[q, :n].tolist(), ids[q, :n].tolist()):
                if j not in by_id:  # the swapped document of a near-tie
                    continue
                assert abs(s - by_id[j]) <= 1e-3 * max(1.0, abs(by_id[j])), (name, q, j)


@pytest.mark.parametrize("nbits", [2, 4])
def test_search_on_cuda_finds_fast_plaids_documents(nbits):
    index = load(FIXTURE / f"nbits{nbits}", device="cuda")
    answers = json.loads((FIXTURE / f"nbits{nbits}" / "answers.json").read_text())
    Q = torch.from_numpy(np.load(FIXTURE / "queries.npy")).cuda()
    lengths = torch.tensor(json.loads((FIXTURE / "query_lengths.json").read_text()))
    q_mask = (torch.arange(Q.shape[1])[None] < lengths[:, None]).cuda()
    _check_against(answers["results"], answers["settings"], index, Q, q_mask)


@pytest.mark.skipif(importlib.util.find_spec("fast_plaid") is None,
                    reason="fast-plaid is not installed (its wheels exist for torch 2.11 only)")
@pytest.mark.parametrize("nbits", [2, 4])
def test_search_equals_fast_plaid_on_an_index_it_builds(tmp_path, nbits):
    from fast_plaid import search as fp_search
    gen = torch.Generator().manual_seed(nbits)
    topics = torch.nn.functional.normalize(torch.randn(64, 128, generator=gen), dim=-1)
    docs = []
    for _ in range(600):
        n = int(torch.randint(20, 120, (1,), generator=gen))
        t = topics[torch.randint(0, 64, (n,), generator=gen)] + 0.3 * torch.randn(
            n, 128, generator=gen)
        docs.append(torch.nn.functional.normalize(t, dim=-1).cuda())
    Q = topics[torch.randint(0, 64, (16, 32), generator=gen)]
    Q = torch.nn.functional.normalize(Q + 0.4 * torch.randn(Q.shape, generator=gen), dim=-1)
    Q = Q.half().cuda()
    theirs = fp_search.FastPlaid(index=str(tmp_path / "index"), device="cuda:0")
    theirs.create(documents_embeddings=docs, nbits=nbits, seed=0)
    index = load(tmp_path / "index", device="cuda")
    settings = {"default": {"top_k": 10, "n_ivf_probe": 8, "n_full_scores": 4096},
                "pruned": {"top_k": 10, "n_ivf_probe": 4, "n_full_scores": 128}}
    results = {}
    for name, kw in settings.items():
        found = theirs.search(queries_embeddings=Q.float(), show_progress=False, **kw)
        results[name] = [{"ids": [i for i, _ in r], "scores": [s for _, s in r]} for r in found]
    _check_against(results, settings, index, Q, None, ties=True)
    theirs.close()


def test_search_from_tensors_on_cuda_is_exact_when_exhaustive():
    codes, residuals, cu, centroids, weights, lengths = _packed(300, 90, 128, 4, n_centroids=64)
    index = PlaidIndex.from_tensors(centroids.float(), weights, 4, codes, residuals, lengths)
    Q = torch.randn(8, 32, 128, device="cuda")
    scores, ids = index.search(Q, 10, n_probe=64, n_candidates=4 * 300)
    pc, pr = _padded(codes, residuals, cu, lengths)
    D = decompress_residuals_ref(pc, pr, centroids.float(), weights, 4).double()
    D = D / D.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    valid = torch.arange(pc.shape[1], device="cuda") < lengths[:, None]
    sim = torch.einsum("qsd,jtd->qjst", Q.double(), D).masked_fill(~valid[None, :, None], -1e9)
    ref = sim.max(-1).values.sum(-1)
    ref[:, lengths == 0] = float("-inf")  # an empty document is in no inverted list
    top = ref.topk(10, dim=1)
    assert torch.equal(ids, top.indices)
    assert_close_to_reference(scores, top.values, 1e-5, "scores")
    assert index.score(Q).shape == (8, 300)


def test_search_never_synchronizes_and_its_graph_equals_it():
    """The eager search reads nothing back; its CUDA graph (captured on the first call, replayed
    for a new query of the same shape, with and without a query mask) gives the eager results,
    and a query finding fewer documents than top_k ends in ids -1."""
    codes, residuals, cu, centroids, weights, lengths = _packed(400, 90, 128, 2, n_centroids=256)
    index = PlaidIndex.from_tensors(centroids, weights, 2, codes, residuals, lengths)
    Q1, Q2 = torch.randn(2, 5, 32, 128, device="cuda").half().unbind(0)
    mask = masks_with_holes((5, 32), "cuda")
    kw = dict(n_probe=4, n_candidates=256)
    assert_no_host_synchronization(lambda: index.search(Q1, 10, q_mask=mask, **kw))
    for q_mask in (None, mask):
        for Q in (Q1, Q2):
            eager = index.search(Q, 10, q_mask=q_mask, **kw)
            graph = index.search(Q, 10, q_mask=q_mask, cuda_graph=True, **kw)
            assert torch.equal(graph[1], eager[1]) and torch.equal(graph[0], eager[0])
    assert len(index._graphs) == 2
    grad = index.search(Q2.clone().requires_grad_(), 10, cuda_graph=True, **kw)  # no autograd
    assert torch.equal(grad[1], index.search(Q2, 10, **kw)[1]) and len(index._graphs) == 2
    few = index.search(Q1[:1], 500, n_probe=1, n_candidates=8, cuda_graph=True)
    assert torch.equal(few[1], index.search(Q1[:1], 500, n_probe=1, n_candidates=8)[1])
    assert (few[1][0, 2:] == -1).all() and (few[0][0, 2:] == float("-inf")).all()
    index.release_graphs()
    assert not index._graphs


def test_plaid_ops_pass_opcheck_and_compile_on_cuda():
    """The PLAID ops on the Triton path: opcheck of the residual forward (every document and
    candidates), its backward and the approximate score; a compiled training step equals the
    eager one."""
    fwd, bwd = torch.ops.fusedmaxsim.maxsim_residual_fwd, torch.ops.fusedmaxsim.maxsim_residual_bwd
    codes, residuals, cu, centroids, weights, lengths = _packed(9, 70, 128, 2)
    index = (codes, residuals, cu[:-1].clone(), lengths)
    Q = torch.randn(3, 32, 128, device="cuda", dtype=torch.float16, requires_grad=True)
    q_inv = 1.0 / Q.detach().float().norm(dim=-1)
    ids = torch.tensor([[3, -1], [8, 0], [2, 2]], device="cuda")
    for doc_ids, save in ((None, True), (ids, False)):
        torch.library.opcheck(fwd, (Q if save else Q.detach(), *index, doc_ids, centroids,
                                    weights, None, q_inv, 70, 2, "big", True, save, "triton",
                                    "ieee"))
    scores, argmax = fwd(Q, *index, None, centroids, weights, None, q_inv, 70, 2, "big", True,
                         True, "triton", "ieee")
    torch.library.opcheck(bwd, (torch.randn_like(scores), Q.detach(), argmax, *index, centroids,
                                weights, q_inv, 70, 2, "big", True, "triton", "ieee"))
    cs = torch.randn(3, 4096, 32, device="cuda", dtype=torch.float16)
    torch.library.opcheck(torch.ops.fusedmaxsim.plaid_approx,
                          (cs, codes, index[2], lengths, None, "triton"))

    def step(q):
        return maxsim_residual_varlen(q, codes, residuals, cu, centroids, weights, 2,
                                      max_seqlen_d=70)

    torch._dynamo.reset()
    grad = torch.randn(3, 9, device="cuda")
    results = []
    for fn in (torch.compile(step, fullgraph=True), step):
        q = Q.detach().clone().requires_grad_()
        out = fn(q)
        out.backward(grad)
        results.append((out.detach(), q.grad))
    for compiled, eager in zip(*results):
        torch.testing.assert_close(compiled, eager)
