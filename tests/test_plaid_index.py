"""PLAID indexes (fusedmaxsim.plaid.load, PlaidIndex, plaid_search, maxsim_residual_varlen):
fast-plaid's own indexes and answers (tests/fixtures/fast_plaid, written by fast-plaid 1.7 on a
GPU), the packed layout against the float64 oracle, and every error of the loader."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fusedmaxsim.plaid import (
    PlaidIndex, decompress_residuals, load, maxsim_residual, maxsim_residual_varlen, plaid_search,
)
from fusedmaxsim.reference import decompress_residuals_ref, maxsim_residual_ref
from fusedmaxsim.testing import TOLERANCES, assert_close_to_reference

FIXTURE = Path(__file__).parent / "fixtures" / "fast_plaid"


def _queries():
    Q = torch.from_numpy(np.load(FIXTURE / "queries.npy"))
    lengths = torch.tensor(json.loads((FIXTURE / "query_lengths.json").read_text()))
    return Q, torch.arange(Q.shape[1])[None] < lengths[:, None]


@pytest.mark.parametrize("nbits", [2, 4])
def test_fast_plaid_index_loads_and_decompresses_as_fast_plaid(nbits):
    """The tokens equal fast-plaid's get_embeddings (its own decompression, normalized; fp16)."""
    index = load(FIXTURE / f"nbits{nbits}")
    answers = json.loads((FIXTURE / f"nbits{nbits}" / "answers.json").read_text())
    assert (index.n_docs, index.dim, index.nbits) == (answers["n_docs"], answers["dim"], nbits)
    assert index.centroids.shape[0] == answers["n_centroids"]
    assert index.nbytes == index.codes.nbytes + index.residuals.nbytes
    assert f"{index.n_docs} documents" in repr(index)
    theirs = torch.from_numpy(np.load(FIXTURE / f"nbits{nbits}" / "decompressed.npy")).float()
    rows = theirs.shape[0]  # the first documents' tokens
    ours = decompress_residuals(index.codes[:rows], index.residuals[:rows], index.centroids,
                                index.bucket_weights, nbits).float()
    ours = ours / ours.norm(dim=-1, keepdim=True)
    assert (ours - theirs).abs().max() < 1e-3  # two fp16 roundings apart at most


def test_documents_are_fast_plaids_embeddings():
    """PlaidIndex.documents: fast-plaid's get_embeddings, document by document."""
    index = load(FIXTURE / "nbits4")
    theirs = torch.from_numpy(np.load(FIXTURE / "nbits4" / "decompressed.npy")).float()
    n = int((index.doc_lengths.cumsum(0) <= theirs.shape[0]).sum())
    ours = index.documents(range(n))
    assert [t.shape[0] for t in ours] == index.doc_lengths[:n].tolist()
    assert (torch.cat(ours).float() - theirs).abs().max() < 1e-3
    two = index.documents([5, 2], normalize=False)
    assert two[0].dtype == index.centroids.dtype and two[1].shape == (index.doc_lengths[2], 64)
    assert index.documents([]) == []
    with pytest.raises(ValueError, match=r"ids must be documents of the index, in \[0, 240\)"):
        index.documents([240])


@pytest.mark.parametrize("nbits", [2, 4])
def test_search_finds_fast_plaids_documents(nbits, backend):
    """For every setting fast-plaid was asked (pruned to 16 exact scores, 4 or 1 probes, every
    centroid probed and every document scored): the same documents, and scores within 1e-3
    relative (fast-plaid's similarities are fp16, ours fp32)."""
    index = load(FIXTURE / f"nbits{nbits}")
    answers = json.loads((FIXTURE / f"nbits{nbits}" / "answers.json").read_text())
    Q, q_mask = _queries()
    names = list(answers["results"])
    if backend == "triton":  # interpreted: two queries, the setting with the fewest exact scores
        Q, q_mask, names = Q[:2], q_mask[:2], ["pruned"]
    for name in names:
        results, kw = answers["results"][name][:Q.shape[0]], answers["settings"][name]
        scores, ids = index.search(Q, kw["top_k"], n_probe=kw["n_ivf_probe"],
                                   n_candidates=kw["n_full_scores"], q_mask=q_mask)
        assert scores.dtype == torch.float32 and ids.dtype == torch.int64
        for q, theirs in enumerate(results):
            n = len(theirs["ids"])
            assert set(ids[q, :n].tolist()) == set(theirs["ids"]), (name, q)
            assert torch.all(scores[q, :-1] >= scores[q, 1:])
            by_id = dict(zip(theirs["ids"], theirs["scores"]))
            for s, j in zip(scores[q, :n].tolist(), ids[q, :n].tolist()):
                assert abs(s - by_id[j]) <= 1e-3 * max(1.0, abs(by_id[j])), (name, q, j)


def _packed_index(Nd=13, d=20, nbits=2, K=6, seed=0, dtype=torch.float32, max_len=9):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (Nd,), generator=gen)
    lengths[:3] = torch.tensor([0, 1, max_len])[:Nd]
    T = int(lengths.sum())
    codes = torch.randint(0, K, (T,), generator=gen)
    residuals = torch.randint(0, 256, (T, -(-d * nbits // 8)), generator=gen, dtype=torch.uint8)
    centroids = torch.randn(K, d, generator=gen).to(dtype)
    weights = (torch.randn(1 << nbits, generator=gen) * 0.2).to(dtype)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return codes, residuals, cu, centroids, weights, lengths


def _padded(codes, residuals, cu, fill=0):
    lengths = cu[1:] - cu[:-1]
    Ld = int(lengths.max()) if lengths.numel() else 0
    pc = torch.full((len(lengths), Ld), fill, dtype=codes.dtype)
    pr = torch.zeros((len(lengths), Ld, residuals.shape[1]), dtype=torch.uint8)
    for j, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        pc[j, : b - a], pr[j, : b - a] = codes[a:b], residuals[a:b]
    return pc, pr, lengths


@pytest.mark.parametrize("bit_order", ["big", "little"])
@pytest.mark.parametrize("nbits", [1, 2, 4, 8])
def test_varlen_scores_and_gradients(nbits, bit_order, backend):
    """Packed documents (empty, length 1, trailing rows past the last offset), a masked query:
    scores and grad_Q (random grad_output, then sum().backward()) against the float64 oracle of
    the padded documents."""
    codes, residuals, cu, centroids, weights, lengths = _packed_index(nbits=nbits)
    codes = torch.cat([codes, torch.tensor([99])])  # a trailing row, out of range: never read
    residuals = torch.cat([residuals, residuals[:1]])
    pc, pr, _ = _padded(codes, residuals, cu)
    Q = torch.randn(3, 5, 20, requires_grad=True)
    q_mask = torch.ones(3, 5, dtype=torch.bool)
    q_mask[1] = False
    q_mask[2, 1] = False
    Q64 = Q.detach().double().requires_grad_()
    kw = dict(q_mask=q_mask, bit_order=bit_order)
    out = maxsim_residual_varlen(Q, codes, residuals, cu, centroids, weights, nbits,
                                 validate=False, **kw)
    ref = maxsim_residual_ref(Q64, pc, pr, lengths, centroids, weights, nbits, **kw)
    score_tol, grad_tol = TOLERANCES[torch.float32]
    assert_close_to_reference(out, ref, score_tol, "scores")
    g = torch.randn_like(out)
    gq, = torch.autograd.grad(out, Q, g)
    rq, = torch.autograd.grad(ref, Q64, g.double())
    assert_close_to_reference(gq, rq, grad_tol, "grad_Q")
    maxsim_residual_varlen(Q, codes, residuals, cu, centroids, weights, nbits, validate=False,
                           **kw).sum().backward()
    maxsim_residual_ref(Q64, pc, pr, lengths, centroids, weights, nbits, **kw).sum().backward()
    assert_close_to_reference(Q.grad, Q64.grad, grad_tol, "grad_Q (sum)")


def test_varlen_equals_padded_and_handles_empty_batches(backend):
    codes, residuals, cu, centroids, weights, lengths = _packed_index(Nd=7, d=13, nbits=4)
    pc, pr, _ = _padded(codes, residuals, cu)
    Q = torch.randn(2, 4, 13).transpose(1, 2).contiguous().transpose(1, 2)  # strided
    a = maxsim_residual_varlen(Q, codes, residuals, cu, centroids, weights, 4, max_seqlen_d=9)
    b = maxsim_residual(Q, pc, pr, lengths, centroids, weights, 4)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    one = maxsim_residual_varlen(Q[0], codes, residuals, cu, centroids, weights, 4)
    assert one.shape == (7,)
    none = maxsim_residual_varlen(Q, codes, residuals, cu[:1], centroids, weights, 4)
    assert none.shape == (2, 0)
    assert maxsim_residual_varlen(Q[:0], codes, residuals, cu, centroids, weights, 4).shape == \
        (0, 7)


def test_varlen_unchecked_offsets_score_nan(backend):
    """validate=False: a document whose rows run past the codes, or whose length is negative,
    scores NaN; the others are untouched."""
    codes, residuals, cu, centroids, weights, _ = _packed_index(Nd=5, d=8, nbits=2)
    bad = cu.clone()
    bad[-1] = codes.shape[0] + 3  # the last document runs past the rows
    Q = torch.randn(2, 3, 8)
    out = maxsim_residual_varlen(Q, codes, residuals, bad, centroids, weights, 2, validate=False)
    good = maxsim_residual_varlen(Q, codes, residuals, cu, centroids, weights, 2)
    assert torch.isnan(out[:, -1]).all()
    torch.testing.assert_close(out[:, :-1], good[:, :-1])


def test_varlen_errors():
    codes, residuals, cu, centroids, weights, _ = _packed_index(Nd=4, d=8, nbits=2)
    Q = torch.randn(2, 3, 8)
    T = codes.shape[0]
    cases = [
        (TypeError, r"codes must be an integer", dict(codes=codes.float())),
        (ValueError, r"codes must be \[T\]", dict(codes=codes[None])),
        (ValueError, r"residuals must be \[T, ceil\(d \* nbits / 8\)\]",
         dict(residuals=residuals[:, :1])),
        (ValueError, r"cu_seqlens_d must start at 0", dict(cu_seqlens_d=cu + 1)),
        (ValueError, r"cu_seqlens_d must be non-decreasing",
         dict(cu_seqlens_d=torch.tensor([0, 3, 2, T]))),
        (ValueError, rf"cu_seqlens_d must end within the {T} rows",
         dict(cu_seqlens_d=torch.tensor([0, 1, 2, T + 1]))),
        (ValueError, r"max_seqlen_d=0 is below the longest document", dict(max_seqlen_d=0)),
        (ValueError, r"codes must be centroid ids in \[0, 6\)", dict(codes=codes + 6)),
        (ValueError, r"nbits must be one of", dict(nbits=3)),
    ]
    base = dict(Q=Q, codes=codes, residuals=residuals, cu_seqlens_d=cu, centroids=centroids,
                bucket_weights=weights, nbits=2)
    for error, message, change in cases:
        kw = {**base, **change}
        with pytest.raises(error, match=message):
            maxsim_residual_varlen(kw.pop("Q"), kw.pop("codes"), kw.pop("residuals"),
                                   kw.pop("cu_seqlens_d"), kw.pop("centroids"),
                                   kw.pop("bucket_weights"), kw.pop("nbits"), **kw)


def _exact_top(Q, index, q_mask, top_k):
    """The float64 oracle of the search's exact stage over every document: tokens decompressed
    and L2-normalized, queries as given."""
    scores = torch.full((Q.shape[0], index.n_docs), 0.0, dtype=torch.float64)
    for j in range(index.n_docs):
        a, n = int(index.doc_starts[j]), int(index.doc_lengths[j])
        if n == 0:
            continue
        D = decompress_residuals_ref(index.codes[a:a + n], index.residuals[a:a + n],
                                     index.centroids, index.bucket_weights, index.nbits).double()
        D = D / D.norm(dim=-1, keepdim=True)
        sim = Q.double() @ D.T  # [Nq, Lq, n]
        best = sim.max(-1).values.masked_fill(~q_mask, 0)
        scores[:, j] = best.sum(-1)
    return scores.topk(top_k, dim=1)


def test_search_of_an_index_built_from_tensors_is_exact_when_exhaustive(backend):
    """Every centroid probed and every candidate scored: the true top-k of the float64 oracle.
    Fewer documents found than top_k: the rows end in -1 / -inf."""
    codes, residuals, cu, centroids, weights, lengths = _packed_index(Nd=11, d=16, nbits=4, K=5)
    index = PlaidIndex.from_tensors(centroids, weights, 4, codes, residuals, lengths)
    Q = torch.randn(3, 6, 16)
    q_mask = torch.ones(3, 6, dtype=torch.bool)
    q_mask[2, 4:] = False
    scores, ids = plaid_search(Q, index, 4, n_probe=5, n_candidates=4 * 11, q_mask=q_mask)
    ref = _exact_top(Q, index, q_mask, 4)
    assert torch.equal(ids, ref.indices)
    assert_close_to_reference(scores, ref.values, TOLERANCES[torch.float32][0], "scores")
    s, i = plaid_search(Q[0], index, 20, n_probe=5, n_candidates=1000)
    assert s.shape == i.shape == (20,)
    found = (lengths > 0).nonzero().flatten().tolist()  # an empty document is in no list
    n = len(found)
    assert (i[n:] == -1).all() and torch.isinf(s[n:]).all() and (s[n:] < 0).all()
    assert sorted(i[:n].tolist()) == found


def test_inverted_lists_built_from_tensors():
    codes = torch.tensor([2, 2, 0, 1, 2, 0])
    lengths = torch.tensor([2, 0, 3, 1])  # documents 0: [2, 2], 2: [0, 1, 2], 3: [0]
    index = PlaidIndex.from_tensors(torch.randn(3, 8), torch.zeros(4), 2, codes,
                                    torch.zeros(6, 2, dtype=torch.uint8), lengths)
    lists = [index.ivf[index.ivf_offsets[c]:index.ivf_offsets[c + 1]].tolist() for c in range(3)]
    assert lists == [[2, 3], [2], [0, 2]]


def test_search_errors():
    codes, residuals, cu, centroids, weights, lengths = _packed_index(Nd=4, d=8, nbits=2)
    index = PlaidIndex.from_tensors(centroids, weights, 2, codes, residuals, lengths)
    Q = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match=r"Q has d = 9 but the index has d = 8"):
        plaid_search(torch.randn(2, 3, 9), index)
    with pytest.raises(ValueError, match=r"Q is on meta but the index is on cpu"):
        plaid_search(Q.to("meta"), index)
    with pytest.raises(ValueError, match=r"top_k must be >= 1, got 0"):
        plaid_search(Q, index, 0)
    with pytest.raises(ValueError, match=r"n_probe must be >= 1, got 0"):
        plaid_search(Q, index, n_probe=0)
    with pytest.raises(TypeError, match=r"n_candidates must be an int"):
        plaid_search(Q, index, n_candidates=2.5)
    with pytest.raises(TypeError, match=r"index must be a fusedmaxsim.plaid.PlaidIndex"):
        plaid_search(Q, "index")
    with pytest.raises(TypeError, match=r"cuda_graph must be a bool, got int"):
        plaid_search(Q, index, cuda_graph=1)
    with pytest.raises(ValueError, match=r"cuda_graph=True needs the index on a CUDA device"):
        plaid_search(Q, index, cuda_graph=True)
    with pytest.raises(ValueError, match=r"cuda_graph=True searches without a subset"):
        plaid_search(Q, index, subset=[0, 1], cuda_graph=True)
    with pytest.raises(ValueError, match=r"codes must be centroid ids in \[0, 6\)"):
        PlaidIndex.from_tensors(centroids, weights, 2, codes + 6, residuals, lengths)


def _copy(tmp_path, nbits=2) -> Path:
    path = tmp_path / "index"
    shutil.copytree(FIXTURE / f"nbits{nbits}", path)
    return path


def _save(path, array):
    np.save(path, array, allow_pickle=False)


def _unmerged(path):
    """A chunk file beside the merged one that the manifest does not list as merged."""
    shutil.copy(path / "merged_codes.npy", path / "0.codes.npy")
    os.remove(path / "merged_codes.manifest.json")


@pytest.mark.parametrize("damage, message", [
    (lambda p: os.remove(p / "metadata.json"), r"metadata.json: missing"),
    (lambda p: os.remove(p / "centroids.npy"), r"centroids.npy: missing"),
    (lambda p: os.remove(p / "doclens.0.json"), r"doclens.0.json: missing"),
    (lambda p: (p / "metadata.json").write_text("{"), r"metadata.json: not valid JSON"),
    (lambda p: (p / "metadata.json").write_text('{"nbits": 3, "num_chunks": 1}'),
     r"metadata.json: nbits must be one of \(1, 2, 4, 8\), got 3"),
    (lambda p: (p / "doclens.0.json").write_text("[1, -2]"),
     r"doclens.0.json: must be a list of token counts"),
    (lambda p: (p / "doclens.0.json").write_text("[1, 2]"),
     r"metadata.json: num_documents = 240, but the doclens files list 2 documents"),
    (lambda p: _save(p / "bucket_weights.npy", np.zeros(3, np.float32)),
     r"bucket_weights.npy: must be float \[2 \*\* nbits\] = \(4,\)"),
    (lambda p: _save(p / "merged_residuals.npy", np.zeros((6229, 15), np.uint8)),
     r"merged_residuals.npy: must be uint8 \[6229, 16\]"),
    (lambda p: _save(p / "merged_codes.npy", np.zeros(100, np.int64)),
     r"merged_codes.npy: must be int \[R >= 6212\]"),
    (lambda p: _save(p / "merged_codes.npy", np.full(6229, 5000, np.int64)),
     r"merged_codes.npy: holds centroid ids outside \[0, 1024\)"),
    (lambda p: _save(p / "ivf.npy", np.full(5982, 999, np.int64)),
     r"ivf.npy: holds document ids outside \[0, 240\)"),
    (lambda p: _save(p / "ivf_lengths.npy", np.ones(1024, np.int32)),
     r"ivf_lengths.npy: must be counts >= 0 adding up to the 5982 entries"),
    (lambda p: np.save(p / "centroids.npy", np.array([{"a": 1}], dtype=object),
                       allow_pickle=True),
     r"centroids.npy: holds '\|O'; an index file holds plain little-endian numbers"),
    (lambda p: (p / "merged_codes.npy").write_bytes((p / "merged_codes.npy").read_bytes()[:-8]),
     r"merged_codes.npy: truncated: its header promises <i8 \(6229,\)"),
    (lambda p: (p / "centroids.npy").write_bytes(b"not numpy at all"),
     r"centroids.npy: not an .npy file"),
    (lambda p: (p / "centroids.npy").write_bytes(b"\x93NUMPY\x01\x00\x10\x00{'descr': <f4' }\n"),
     r"centroids.npy: unreadable .npy header \"{'descr': <f4' }\""),
    (lambda p: _unmerged(p),
     r"chunk files 0.codes.npy hold updates not merged into it yet"),
])
def test_loader_names_the_damaged_file(tmp_path, damage, message):
    path = _copy(tmp_path)
    damage(path)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load(path)


def test_loader_reads_unmerged_chunks_and_runs_nothing(tmp_path):
    """Without the merged files, the chunk files are read; a pickle is never loaded."""
    path = _copy(tmp_path)
    whole = load(path)
    T = int(whole.doc_lengths.sum())
    for suffix in ("codes", "residuals"):
        _save(path / f"0.{suffix}.npy", np.load(path / f"merged_{suffix}.npy")[:T])
        os.remove(path / f"merged_{suffix}.npy")
    chunks = load(path)
    assert torch.equal(chunks.codes, whole.codes[:T])
    assert torch.equal(chunks.residuals, whole.residuals[:T])
    with pytest.raises(FileNotFoundError, match=r"not a directory"):
        load(tmp_path / "nowhere")


def _fast_plaid_search_ref(q, index, n_probe, n_full, top_k, subset=None):
    """fast-plaid's search of one query, ported from its Rust source (search.rs, ``search``)
    with plain loops: subset centroids, probe, inverted lists, approximate scores, the two
    prunings, exact scores of the decompressed, normalized tokens, top-k. ``q [Lq, d]``."""
    cs = index.centroids.float() @ q.float().T  # [K, Lq]
    if subset is not None:
        cells = sorted({int(c) for j in subset for c in index.codes[
            int(index.doc_starts[j]):int(index.doc_starts[j] + index.doc_lengths[j])]})
        local = cs[cells].topk(min(n_probe, len(cells)), dim=0).indices
        probed = {cells[int(i)] for i in local.flatten()} if cells else set()
    else:
        probed = {int(c) for c in cs.topk(n_probe, dim=0).indices.flatten()}
    pids = sorted({int(d) for c in probed
                   for d in index.ivf[index.ivf_offsets[c]:index.ivf_offsets[c + 1]]})
    if subset is not None:
        pids = sorted(set(pids) & {int(j) for j in subset})
    approx = []
    for j in pids:
        a, n = int(index.doc_starts[j]), int(index.doc_lengths[j])
        approx.append(cs[index.codes[a:a + n].long()].max(0).values.sum().item())
    order = sorted(range(len(pids)), key=lambda i: -approx[i])
    keep = [pids[i] for i in order[:max(1, n_full // 4)]]
    exact = {}
    for j, D in zip(keep, index.documents(keep)):
        exact[j] = (q.double() @ D.double().T).max(1).values.sum().item()
    return sorted(exact, key=lambda j: -exact[j])[:top_k]


def test_search_with_subsets_is_fast_plaids_pipeline():
    """Against a port of fast-plaid's search: no subset, one subset for every query (the probe
    restricted to its centroids), one subset a query (an empty one among them)."""
    # Many centroids for few tokens: approximate scores do not tie (a tie at a pruning boundary
    # may go either way).
    codes, residuals, cu, centroids, weights, lengths = _packed_index(Nd=40, d=16, nbits=2,
                                                                      K=200, max_len=12)
    index = PlaidIndex.from_tensors(centroids, weights, 2, codes, residuals, lengths)
    Q = torch.nn.functional.normalize(torch.randn(3, 5, 16), dim=-1)
    gen = torch.Generator().manual_seed(3)
    shared = torch.randperm(40, generator=gen)[:15].tolist()
    per_query = [torch.randperm(40, generator=gen)[:10].tolist(), [], [7, 3, 31]]
    for subset, subsets in ((None, [None] * 3), (shared, [shared] * 3),
                            (per_query, per_query)):
        _, ids = plaid_search(Q, index, 5, n_probe=3, n_candidates=24, subset=subset)
        for q in range(3):
            ref = _fast_plaid_search_ref(Q[q], index, 3, 24, 5, subsets[q])
            found = [j for j in ids[q].tolist() if j >= 0]
            assert found == ref, (subset is None, q)


def test_subset_errors():
    codes, residuals, cu, centroids, weights, lengths = _packed_index(Nd=6, d=8, nbits=2)
    index = PlaidIndex.from_tensors(centroids, weights, 2, codes, residuals, lengths)
    Q = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match=r"subset must hold documents of the index, in \[0, 6\)"):
        plaid_search(Q, index, subset=[1, 6])
    with pytest.raises(ValueError, match=r"subset\[1\] must hold documents of the index"):
        plaid_search(Q, index, subset=[[1], [-1]])
    with pytest.raises(ValueError, match=r"one a query \(2\), got 3 sequences"):
        plaid_search(Q, index, subset=[[1], [2], [3]])
    with pytest.raises(ValueError, match=r"subset is empty: give None for no filter"):
        plaid_search(Q, index, subset=[])
    with pytest.raises(ValueError, match=r"subset must be a 1-D sequence of document ids"):
        plaid_search(Q, index, subset=torch.tensor([0.5]))


def test_registered_plaid_ops_pass_opcheck():
    """The PLAID ops on the PyTorch path: schema, fake tensors, autograd registration and AOT
    dispatch: the residual forward (every document, normalized or not, masked; candidates with a
    missing one; inference), its backward, and the approximate score."""
    fwd, bwd = torch.ops.fusedmaxsim.maxsim_residual_fwd, torch.ops.fusedmaxsim.maxsim_residual_bwd
    codes, residuals, cu, centroids, weights, lengths = _packed_index(Nd=6, d=12, nbits=4)
    starts = cu[:-1].clone()
    Q = torch.randn(2, 5, 12, requires_grad=True)
    q_mask = torch.rand(2, 5) > 0.3
    q_inv = 1.0 / Q.detach().norm(dim=-1)
    ids = torch.tensor([[3, -1, 0], [5, 5, 2]])
    index = (codes, residuals, starts, lengths)
    for doc_ids, mask, inv, normalize, max_len, save in (
            (None, q_mask, q_inv, True, 9, True), (None, None, None, False, -1, True),
            (ids, None, None, True, 9, False), (None, q_mask, q_inv, True, 9, False)):
        q = Q if save else Q.detach()
        torch.library.opcheck(fwd, (q, *index, doc_ids, centroids, weights, mask, inv, max_len, 4,
                                    "big", normalize, save, "torch", "ieee"))
    scores, argmax = fwd(Q, *index, None, centroids, weights, q_mask, q_inv, 9, 4, "big", True,
                         True, "torch", "ieee")
    torch.library.opcheck(bwd, (torch.randn_like(scores), Q.detach(), argmax, *index, centroids,
                                weights, q_inv, 9, 4, "big", True, "torch", "ieee"))
    cs = torch.randn(2, 6, 5)
    torch.library.opcheck(torch.ops.fusedmaxsim.plaid_approx,
                          (cs, codes % 6, starts, lengths, None, "torch"))
    torch.library.opcheck(torch.ops.fusedmaxsim.plaid_approx,
                          (cs, codes % 6, starts, lengths, ids, "torch"))


@pytest.mark.skipif(not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "c++",
                                                      "clang++")),
                    reason="torch.compile's CPU backend (Inductor) needs a C++ compiler, none found")
def test_torch_compile_fullgraph_plaid_training_step():
    """maxsim_residual_varlen (max_seqlen_d given), maxsim_residual and plaid_approx_score under
    torch.compile(fullgraph=True), on the PyTorch path: the eager step's scores and grad_Q."""
    from fusedmaxsim import settings
    from fusedmaxsim.plaid import plaid_approx_score
    torch._dynamo.reset()
    codes, residuals, cu, centroids, weights, lengths = _packed_index(Nd=7, d=16, nbits=2)
    pc, pr, _ = _padded(codes, residuals, cu)
    cs = torch.randn(3, 6, 4)
    grad = torch.randn(3, 7)

    def step(q):
        a = maxsim_residual_varlen(q, codes, residuals, cu, centroids, weights, 2,
                                   max_seqlen_d=9, validate=False)
        b = maxsim_residual(q, pc, pr, lengths, centroids, weights, 2, validate=False)
        c = plaid_approx_score(cs, codes, cu_seqlens=cu, validate=False)
        return a + b * 0.5, c

    results = []
    with settings.use_backend("torch"):
        for fn in (torch.compile(step, fullgraph=True), step):
            q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(0)).requires_grad_()
            out, approx = fn(q)
            out.backward(grad)
            results.append((out.detach(), approx, q.grad))
    for compiled, eager in zip(*results):
        torch.testing.assert_close(compiled, eager)


def test_search_gathers_the_probe_in_blocks_of_queries():
    """The PyTorch path's probe a query at a time (forced) finds what one block finds."""
    from fusedmaxsim import forced_plan
    index = load(FIXTURE / "nbits2")
    Q, q_mask = _queries()
    whole = index.search(Q, 10, n_probe=4, n_candidates=256, q_mask=q_mask)
    with forced_plan(kernel="torch", PROBE_GATHER_IDS=1):
        blocks = index.search(Q, 10, n_probe=4, n_candidates=256, q_mask=q_mask)
    assert torch.equal(whole[1], blocks[1]) and torch.equal(whole[0], blocks[0])


@pytest.mark.parametrize("forced", [{}, {"PROBE_BLOCK": 2}, {"kernel": "torch"},
                                    {"kernel": "torch", "PROBE_GATHER_IDS": 1}])
def test_probe_marks_the_documents_of_the_probed_lists(backend, forced):
    """The probe's bitmap against sets built in Python: cells probed twice, -1, out of range
    (-2 and n_cells: nothing), a cell of an empty list, a query probing nothing; list steps of
    2 entries (forced) cross the lists' ends."""
    from fusedmaxsim._plaid_index import _probed_documents
    from fusedmaxsim.planning import forced_plan, recording
    from fusedmaxsim._problem import options_for
    g = torch.Generator().manual_seed(3)
    n_docs, n_cells = 11, 6
    lengths = torch.randint(1, 5, (n_docs,), generator=g)
    lengths[4] = 0
    codes = torch.randint(0, n_cells - 1, (int(lengths.sum()),), generator=g)  # cell 5: empty
    d = 8
    index = PlaidIndex.from_tensors(torch.randn(n_cells, d), torch.randn(4), 2, codes,
                                    torch.zeros(codes.shape[0], d * 2 // 8, dtype=torch.uint8),
                                    lengths)
    cells = torch.tensor([[0, 3, 3, -1, 5], [-1, -1, -1, -1, -1], [2, -2, 6, 1, 4],
                          [4, 4, 4, 4, 4]])
    starts = (torch.cumsum(lengths, 0) - lengths).tolist()
    docs_of = {c: {j for j in range(n_docs)
                   if c in codes[starts[j]:starts[j] + lengths[j]].tolist()}
               for c in range(n_cells)}
    expected = torch.zeros(4, n_docs, dtype=torch.bool)
    for q, row in enumerate(cells.tolist()):
        for c in row:
            for j in docs_of.get(c, ()):
                expected[q, j] = True
    with forced_plan(**forced), recording() as plans:
        for ids in (cells, cells.int()):
            hit = _probed_documents(index, ids, options_for(torch.zeros(1)))
            assert hit.dtype == torch.bool and torch.equal(hit, expected)
    assert {plan.kernel for _, plan in plans} == {forced.get("kernel", backend)}
    assert _probed_documents(index, cells[:0], options_for(torch.zeros(1))).shape == (0, n_docs)
