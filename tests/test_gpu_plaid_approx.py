"""GPU suite for PLAID's approximate score (``pytest -m gpu``): plaid_approx_score and the search
pipeline's ``approx_scores`` on CUDA against the float64 oracle at realistic sizes, no host
synchronization, one compiled kernel for every document length, and late-interaction-kernels'
``plaid_approx_score`` where it is importable."""

import pytest
import torch
from helpers import assert_no_host_synchronization

from fusedmaxsim._autograd import approx_scores
from fusedmaxsim.plaid import plaid_approx_score
from fusedmaxsim.reference import plaid_approx_score_ref

pytestmark = pytest.mark.gpu

# The max is exact, the sum over 32 query tokens fp32 (in another order than the oracle's).
TOL = 1e-5


def _relative(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _index(Nd, Ld, n_centroids=4096, Lq=32, Nq=8, dtype=torch.float16, seed=0):
    """Centroid scores as an engine makes them (normalized centroids against normalized query
    tokens, in ``dtype``), padded ids, lengths 0 to ``Ld`` (the first document empty)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    centroids = torch.nn.functional.normalize(
        torch.randn(n_centroids, 128, device="cuda", generator=gen), dim=-1)
    Q = torch.nn.functional.normalize(torch.randn(Nq, Lq, 128, device="cuda", generator=gen), dim=-1)
    cs = torch.einsum("kd,qsd->qks", centroids, Q).to(dtype)
    codes = torch.randint(0, n_centroids, (Nd, Ld), device="cuda", generator=gen)
    lengths = torch.randint(0, Ld + 1, (Nd,), device="cuda", generator=gen)
    lengths[0] = 0
    return cs, codes, lengths


def _packed(codes, lengths):
    valid = torch.arange(codes.shape[1], device="cuda") < lengths[:, None]
    cu = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64, device="cuda")
    cu[1:] = lengths.cumsum(0)
    return codes[valid], cu


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("Nq", [1, 8, 32])
def test_approx_parity_on_cuda(dtype, Nq):
    """Padded and packed documents, every query against every document; 1500 documents of up to
    300 tokens, 4096 centroids, 32 query tokens."""
    cs, codes, lengths = _index(1500, 300, Nq=Nq, dtype=dtype)
    ref = plaid_approx_score_ref(cs, codes, lengths)
    out = plaid_approx_score(cs, codes, lengths)
    assert out.dtype == torch.float32 and out.shape == (Nq, 1500)
    assert _relative(out, ref) <= TOL
    assert torch.equal(out[:, 0], torch.zeros(Nq, device="cuda"))  # the empty document
    flat, cu = _packed(codes, lengths)
    assert _relative(plaid_approx_score(cs, flat, cu_seqlens=cu), ref) <= TOL
    assert _relative(plaid_approx_score(cs[0], codes.int(), lengths.int()), ref[0]) <= TOL
    # Query tokens not adjacent in memory: copied once by the launcher, same scores.
    strided = cs.transpose(1, 2).contiguous().transpose(1, 2)
    assert _relative(plaid_approx_score(strided, codes, lengths), ref) <= TOL


@pytest.mark.parametrize("Lq", [1, 7, 33, 300])
def test_approx_odd_query_lengths_on_cuda(Lq):
    """Query lengths off the tile sizes (300: several chunks), an odd number of centroids."""
    cs, codes, lengths = _index(400, 129, n_centroids=1001, Lq=Lq, Nq=5)
    ref = plaid_approx_score_ref(cs, codes, lengths)
    assert _relative(plaid_approx_score(cs, codes, lengths), ref) <= TOL


def test_approx_candidates_on_cuda():
    """The search pipeline's call: 16 queries, 4096 candidates each, padded with -1."""
    cs, codes, lengths = _index(5000, 256, Nq=16)
    flat, cu = _packed(codes, lengths)
    starts, lens = cu[:-1], lengths
    doc_ids = torch.randint(0, 5000, (16, 4096), device="cuda")
    doc_ids[:, 3000:] = -1
    out = approx_scores(cs, flat, starts, lens, doc_ids)
    full = plaid_approx_score_ref(cs, codes, lengths)
    expected = torch.where(doc_ids < 0, float("-inf"), full.gather(1, doc_ids.clamp(min=0)))
    assert torch.equal(out.isinf(), expected.isinf())
    assert _relative(out[:, :3000], expected[:, :3000]) <= TOL


@pytest.mark.parametrize("Nq", [1, 32])
def test_approx_hits_on_cuda(Nq):
    """The search's call: each query's candidates as a bitmap over 20,000 documents (a tenth,
    half, all or none of them), the others -inf."""
    cs, codes, lengths = _index(20000, 256, Nq=Nq)
    flat, cu = _packed(codes, lengths)
    g = torch.Generator(device="cuda").manual_seed(1)
    density = torch.tensor([0.1, 0.5, 1.0, 0.0], device="cuda").repeat(Nq)[:Nq, None]
    hits = torch.rand(Nq, 20000, device="cuda", generator=g) < density
    out = approx_scores(cs, flat, cu[:-1], lengths, hits=hits)
    full = plaid_approx_score_ref(cs, codes, lengths)
    assert torch.equal(out.isinf(), ~hits)
    assert _relative(torch.where(hits, out, 0), torch.where(hits, full, 0)) <= TOL


def test_approx_unchecked_values_on_cuda():
    """On the GPU nothing is checked unless asked: out-of-range ids and lengths score NaN;
    validate=True raises."""
    cs, codes, lengths = _index(50, 40, Nq=2)
    lengths[1:] = 40
    good = plaid_approx_score(cs, codes, lengths)
    bad, long = codes.clone(), lengths.clone()
    bad[3, 5] = 4096
    long[7] = 41
    out = plaid_approx_score(cs, bad, long)
    assert out[:, [3, 7]].isnan().all()
    keep = [j for j in range(50) if j not in (3, 7)]
    assert torch.equal(out[:, keep], good[:, keep])
    with pytest.raises(ValueError, match="doc_lengths must lie in"):
        plaid_approx_score(cs, bad, long, validate=True)
    with pytest.raises(ValueError, match="codes must be centroid ids"):
        plaid_approx_score(cs, bad, lengths, validate=True)


def test_approx_has_no_host_synchronization():
    cs, codes, lengths = _index(300, 64, Nq=4)
    flat, cu = _packed(codes, lengths)
    doc_ids = torch.randint(-1, 300, (4, 100), device="cuda")

    def calls():
        plaid_approx_score(cs, codes, lengths)
        plaid_approx_score(cs, flat, cu_seqlens=cu)
        approx_scores(cs, flat, cu[:-1], lengths, doc_ids)
        approx_scores(cs, flat, cu[:-1], lengths, hits=(lengths > 32).expand(4, -1))

    assert_no_host_synchronization(calls)


def test_approx_compiles_once_for_every_length():
    """Document lengths, counts and padded extents are run-time values: one compiled kernel."""
    from fusedmaxsim._launch.runtime import launcher
    from fusedmaxsim.kernels.approx import _plaid_approx_kernel

    cached = launcher(_plaid_approx_kernel)
    if not cached.enabled:
        pytest.skip("FUSEDMAXSIM_TRITON_FAST_LAUNCH=0: the launches are not counted here")
    plaid_approx_score(*_index(10, 20, Nq=4))
    before = len(cached.compiled)
    for Nd, Ld in ((37, 300), (501, 129), (3, 1), (2000, 512)):
        plaid_approx_score(*_index(Nd, Ld, Nq=4))
    assert len(cached.compiled) == before


@pytest.mark.parametrize("Nq", [1, 4])
def test_approx_matches_late_interaction_kernels(Nq):
    """late-interaction-kernels' plaid_approx_score (fp32 scores, one query a call) gives the same
    scores: fp16 centroid scores are exact in fp32, the maxes are the same values."""
    try:
        from late_interaction_kernels.plaid import plaid_approx_score as lik_approx
    except ImportError:
        pytest.skip("late-interaction-kernels is not importable here")
    cs, codes, lengths = _index(2000, 300, Nq=Nq)
    ours = plaid_approx_score(cs, codes, lengths)
    theirs = torch.stack([lik_approx(cs[q].float(), codes, lengths) for q in range(Nq)])
    assert _relative(ours, theirs) <= TOL
