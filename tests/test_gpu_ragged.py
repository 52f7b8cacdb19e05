"""GPU suite of the ragged and retrieval paths (``pytest -m gpu``): real bf16/fp16 kernels on
realistic length distributions, no host synchronization, broken promises that leave the CUDA
context alive, streaming from pinned memory, bounded memory.

Bounds are ``max|out − ref| / max|ref|`` against the float64 per-segment loop: 2e-2 for bf16 and
5e-3 for fp16, on scores and gradients alike.
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_backward_bitwise_reproducible, assert_no_host_synchronization, leaf
from test_ragged import check_packed, loop_reference

from fusedmaxsim import (
    maxsim,
    maxsim_padded,
    maxsim_ragged,
    maxsim_varlen,
    retrieve,
    score_pairs_packed,
)
from fusedmaxsim.planning import recording
from fusedmaxsim.testing import assert_close_to_reference

pytestmark = pytest.mark.gpu

BOUNDS = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (5e-3, 5e-3)}


def lengths(n: int, low: int, high: int, extra=()) -> list[int]:
    return [*extra, *torch.randint(low, high + 1, (n,)).tolist()]


def offsets(lens, device="cuda"):
    return torch.tensor([0, *lens], device=device).cumsum(0)


def tokens(lens, dim, dtype):
    return F.normalize(torch.randn(sum(lens), dim, device="cuda"), dim=-1).to(dtype)


# name: (query lengths, document lengths, d)
SHAPES = {
    "colbert-passages": (lambda: lengths(12, 8, 32), lambda: lengths(40, 30, 300), 128),
    "colpali-pages": (lambda: lengths(6, 10, 30), lambda: lengths(10, 700, 1030), 128),
    "edge-d96": (lambda: lengths(5, 1, 40, extra=(0, 1)), lambda: lengths(7, 1, 200, extra=(0, 1, 64)), 96),
}


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("strategy", ["unified", "lowmem"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_varlen_half_precision_parity(shape, dtype, strategy, normalize):
    lq_fn, ld_fn, dim = SHAPES[shape]
    lq, ld = lq_fn(), ld_fn()
    Q, D = tokens(lq, dim, dtype), tokens(ld, dim, dtype)
    q_mask = torch.rand(sum(lq), device="cuda") > 0.1
    out = check_packed(
        maxsim_varlen, Q, D, offsets(lq), offsets(ld), q_mask=q_mask, normalize=normalize,
        backward=strategy, tol=BOUNDS[dtype], max_seqlen_q=max(lq), max_seqlen_d=max(ld),
    )
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("strategy", ["unified", "lowmem"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_pairs_half_precision_parity(shape, dtype, strategy):
    lq_fn, ld_fn, dim = SHAPES[shape]
    lq, ld = lq_fn(), ld_fn()
    Q, D = tokens(lq, dim, dtype), tokens(ld, dim, dtype)
    n_pairs = 3 * len(ld)
    pairs = (torch.randint(0, len(lq), (n_pairs,)).tolist(), torch.randint(0, len(ld), (n_pairs,)).tolist())
    check_packed(
        score_pairs_packed, Q, D, offsets(lq), offsets(ld), pairs=pairs, backward=strategy,
        tol=BOUNDS[dtype],
    )


def test_padded_candidates_and_lists_on_gpu():
    B, C, Lq, Ld = 4, 8, 32, 300
    queries = leaf(F.normalize(torch.randn(B, Lq, 128, device="cuda"), dim=-1).bfloat16())
    documents = leaf(F.normalize(torch.randn(B, C, Ld, 128, device="cuda"), dim=-1).bfloat16())
    qlen = torch.randint(1, Lq + 1, (B,), device="cuda")
    dlen = torch.randint(30, Ld + 1, (B, C), device="cuda")
    out = maxsim_padded(queries, documents, qlen, dlen)
    ref = torch.stack([
        torch.stack([
            maxsim_padded_ref(queries[b, : qlen[b]], documents[b, c, : dlen[b, c]]) for c in range(C)
        ])
        for b in range(B)
    ])
    assert_close_to_reference(out, ref, 2e-2, "padded scores")
    qs = [queries[b, : qlen[b]].detach() for b in range(B)]
    ds = [documents[b, c, : dlen[b, c]].detach() for b in range(B) for c in range(C)]
    full = maxsim_ragged(qs, ds)
    assert_close_to_reference(full.view(B, B, C)[torch.arange(B), torch.arange(B)], ref, 2e-2, "lists")


def maxsim_padded_ref(q, d):
    from fusedmaxsim.reference import maxsim_ref

    return maxsim_ref(q.double(), d.double())


def test_no_host_synchronization_when_the_maxima_are_given():
    lq, ld = lengths(8, 8, 32), lengths(24, 30, 300)
    Q, D = leaf(tokens(lq, 128, torch.bfloat16)), leaf(tokens(ld, 128, torch.bfloat16))
    cu_q, cu_d = offsets(lq), offsets(ld)
    pq = torch.randint(0, len(lq), (50,), device="cuda")
    pd = torch.randint(0, len(ld), (50,), device="cuda")
    qs = [torch.randn(n, 128, device="cuda") for n in lq]

    def calls():
        for strategy in ("unified", "lowmem"):
            out = maxsim_varlen(Q, D, cu_q, cu_d, max(lq), max(ld), normalize=True, backward=strategy)
            out.sum().backward()
            pairs = score_pairs_packed(
                Q, D, cu_q, cu_d, pq, pd, max_seqlen_q=max(lq), max_seqlen_d=max(ld), backward=strategy
            )
            pairs.sum().backward()
        maxsim_ragged(qs, qs)  # lengths known on the host

    assert_no_host_synchronization(calls)


def test_a_broken_promise_scores_nan_and_the_cuda_context_survives():
    lq, ld = [5, 40, 3], [100, 900, 7]
    Q, D = tokens(lq, 128, torch.bfloat16), tokens(ld, 128, torch.bfloat16)
    out = maxsim_varlen(Q, D, offsets(lq), offsets(ld), 16, 128)  # query 1 and document 1 exceed
    torch.cuda.synchronize()
    assert torch.isnan(out[1]).all() and torch.isnan(out[:, 1]).all()
    assert torch.isfinite(out[[0, 2]][:, [0, 2]]).all()
    bad = torch.tensor([0, 7, 100], device="cuda")  # offsets past the packed rows, unchecked
    maxsim_varlen(Q, D, offsets(lq), bad, 40, 1000)
    pairs = score_pairs_packed(Q, D, offsets(lq), offsets(ld), torch.tensor([0, 9], device="cuda"),
                               torch.tensor([0, 0], device="cuda"), max_seqlen_q=40, max_seqlen_d=900)
    torch.cuda.synchronize()
    assert torch.isnan(pairs[1]) and torch.isfinite(pairs[0])
    assert (torch.ones(4, device="cuda") * 2).sum().item() == 8  # the context is alive
    with pytest.raises(ValueError, match="max_seqlen_q=16 is below"):
        maxsim_varlen(Q, D, offsets(lq), offsets(ld), 16, 1000, validate=True)
    with pytest.raises(ValueError, match="cu_seqlens_d must end at"):
        maxsim_varlen(Q, D, offsets(lq), bad, validate=True)


@pytest.mark.parametrize("fn", ["varlen", "pairs"])
def test_lowmem_is_bitwise_reproducible_on_gpu(fn):
    lq, ld = lengths(32, 8, 32), lengths(64, 30, 300)
    Q, D = tokens(lq, 128, torch.bfloat16), tokens(ld, 128, torch.bfloat16)
    pq = torch.randint(0, len(lq), (256,), device="cuda")
    pd = torch.randint(0, len(ld), (256,), device="cuda")

    def backward_of(q, d):
        if fn == "varlen":
            out = maxsim_varlen(q, d, offsets(lq), offsets(ld), backward="lowmem")
        else:
            out = score_pairs_packed(q, d, offsets(lq), offsets(ld), pq, pd, backward="lowmem")
        out.backward(torch.linspace(-1, 1, out.numel(), device="cuda").view(out.shape))

    assert_backward_bitwise_reproducible(backward_of, Q, D, runs=3)


def test_varlen_equals_dense_maxsim_on_equal_lengths():
    Q = F.normalize(torch.randn(16, 32, 128, device="cuda"), dim=-1).bfloat16()
    D = F.normalize(torch.randn(24, 300, 128, device="cuda"), dim=-1).bfloat16()
    dense = maxsim(Q, D)
    varlen = maxsim_varlen(Q.reshape(-1, 128), D.reshape(-1, 128), offsets([32] * 16), offsets([300] * 24), 32, 300)
    torch.testing.assert_close(varlen, dense, rtol=1e-3, atol=1e-3)


def ranked(scores, k):
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    return order.values[..., :k], order.indices[..., :k]


@pytest.mark.parametrize("layout", ["dense", "packed"])
def test_retrieve_is_the_full_ranking_and_streams_equal(layout):
    Q = F.normalize(torch.randn(8, 32, 128, device="cuda"), dim=-1).bfloat16()
    n_docs = 3000
    if layout == "dense":
        D = F.normalize(torch.randn(n_docs, 64, 128, device="cuda"), dim=-1).bfloat16()
        D[[10, 2000]] = D[1500].clone()  # ties across chunks
        full = maxsim(Q, D)
        kwargs = {}
    else:
        ld = lengths(n_docs, 0, 120)
        D = tokens(ld, 128, torch.bfloat16)
        cu = offsets(ld)
        full = maxsim_varlen(Q.reshape(-1, 128), D, offsets([32] * 8), cu)
        kwargs = {"cu_seqlens_d": cu}
    ref_scores, ref_indices = ranked(full, 100)
    with recording() as plans:
        scores, indices = retrieve(Q, D, 100, chunk=700, **kwargs)
    assert torch.equal(indices, ref_indices)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-5)
    # A dense corpus runs the dense forward (the plan maxsim makes for its documents), a packed
    # one the packed kernel, a chunk at a time.
    assert [p.Ncols for p, _ in plans] == [700, 700, 700, 700, 200]
    assert {p.layout for p, _ in plans} == {"cross" if layout == "dense" else "packed"}
    if layout == "dense":
        with torch.no_grad(), recording() as maxsim_plans:
            maxsim(Q, D[:700])
        assert maxsim_plans == plans[:1]
    host = D.cpu().pin_memory()
    host_kwargs = {k: v.cpu() for k, v in kwargs.items()}
    with recording() as plans:
        s_scores, s_indices = retrieve(Q, host, 100, chunk=700, **host_kwargs)
    assert {p.layout for p, _ in plans} == {"cross" if layout == "dense" else "packed"}
    assert s_indices.device.type == "cuda"
    assert torch.equal(s_indices, indices) and torch.equal(s_scores, scores)
    _, d_indices = retrieve(Q, host, 100, **host_kwargs)  # default buffers
    assert torch.equal(d_indices, indices)


def test_retrieve_memory_is_bounded_by_the_chunk():
    Q = F.normalize(torch.randn(512, 32, 128, device="cuda"), dim=-1).bfloat16()
    D = F.normalize(torch.randn(40000, 32, 128, device="cuda"), dim=-1).bfloat16()

    def peak(chunk):
        retrieve(Q, D, 10, chunk=chunk)  # warm up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        retrieve(Q, D, 10, chunk=chunk)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    small, whole = peak(1000), peak(40000)
    assert small < whole / 8, f"chunk 1000: {small / 2**20:.1f} MiB, one chunk: {whole / 2**20:.1f} MiB"


def test_loop_reference_agrees_with_dense_reference_on_gpu():
    """The oracle of this suite against the dense one, on equal lengths."""
    from fusedmaxsim.reference import maxsim_ref

    Q = torch.randn(3, 7, 64, device="cuda", dtype=torch.float64)
    D = torch.randn(4, 11, 64, device="cuda", dtype=torch.float64)
    loop = loop_reference(Q.reshape(-1, 64), D.reshape(-1, 64), offsets([7] * 3), offsets([11] * 4))
    torch.testing.assert_close(loop, maxsim_ref(Q, D))
