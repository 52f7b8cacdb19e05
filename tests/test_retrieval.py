"""retrieve and MaxSimScorer on both paths: exact top-k (ties to the lowest index) against a full
stable sort, chunked and streamed equal to in-memory, dense and packed corpora, every error."""

import pytest
import torch
from helpers import leaf, masks_with_holes

from fusedmaxsim import maxsim, maxsim_varlen, settings
from fusedmaxsim.planning import recording
from fusedmaxsim.retrieval import MaxSimScorer, _corpus, _retrieve, retrieve

DIM = 24


def ranked(scores: torch.Tensor, k: int):
    """The reference ranking: a stable descending sort keeps the lower index first among ties."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    return order.values[..., :k], order.indices[..., :k]


def packed_corpus(n_docs: int, max_len: int = 9, dtype=torch.float32):
    lengths = torch.randint(0, max_len + 1, (n_docs,))
    lengths[1] = 0
    lengths[2] = 1
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return torch.randn(int(cu[-1]), DIM, dtype=dtype), cu


@pytest.mark.parametrize(
    "chunk,normalize", [(None, False), (1, True), (4, False)], ids=["whole-raw", "1-normalize", "4-raw"]
)
def test_dense_corpus_top_k_is_the_full_ranking(backend, chunk, normalize):
    Q = torch.randn(3, 5, DIM)
    D = torch.randn(11, 9, DIM)
    q_mask = masks_with_holes((3, 5), "cpu", fully_masked_first=False)
    d_mask = masks_with_holes((11, 9), "cpu")  # the first document is empty: it scores 0
    full = maxsim(Q, D, q_mask, d_mask, normalize=normalize)
    scores, indices = retrieve(Q, D, 7, q_mask, d_mask, normalize=normalize, chunk=chunk)
    ref_scores, ref_indices = ranked(full, 7)
    assert scores.dtype == torch.float32 and indices.dtype == torch.int64
    assert torch.equal(indices, ref_indices)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [None, 4])
def test_packed_corpus_top_k_is_the_full_ranking(backend, chunk):
    Q = torch.randn(3, 5, DIM)
    D, cu = packed_corpus(11)
    d_mask = torch.rand(D.shape[0]) > 0.2
    q_mask = masks_with_holes((3, 5), "cpu", fully_masked_first=False)
    Qp, cu_q = Q.reshape(-1, DIM), torch.arange(4) * 5
    full = maxsim_varlen(Qp, D, cu_q, cu, q_mask=q_mask.reshape(-1), d_mask=d_mask)
    scores, indices = retrieve(Q, D, 6, q_mask, d_mask, cu_seqlens_d=cu, chunk=chunk)
    ref_scores, ref_indices = ranked(full, 6)
    assert torch.equal(indices, ref_indices)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-5)


def test_top_k_beyond_the_corpus_returns_it_all_ranked(backend):
    Q, D = torch.randn(2, 5, DIM), torch.randn(6, 9, DIM)
    scores, indices = retrieve(Q, D, 100, chunk=4)
    assert scores.shape == (2, 6) and torch.equal(indices, ranked(maxsim(Q, D), 6)[1])
    empty_scores, empty_indices = retrieve(Q, D[:0], 5)
    assert empty_scores.shape == (2, 0) and empty_indices.shape == (2, 0)


def test_one_query_and_one_document_drop_their_axis(backend):
    Q, D = torch.randn(5, DIM), torch.randn(9, DIM)
    scores, indices = retrieve(Q, D, 3)
    assert scores.shape == (1,) and indices.tolist() == [0]
    torch.testing.assert_close(scores, maxsim(Q, D).reshape(1))


@pytest.mark.parametrize("chunk", [2, 3, 100])
def test_ties_go_to_the_lowest_document_index(backend, chunk):
    """Copies of one document across chunk boundaries: the lower indices rank first, whatever
    the chunking; documents with no valid token tie at 0."""
    Q = torch.randn(2, 5, DIM)
    D = torch.randn(10, 9, DIM)
    D[[1, 4, 5, 8]] = D[7] = torch.randn(9, DIM) * 3
    d_mask = torch.ones(10, 9, dtype=torch.bool)
    d_mask[[0, 2, 9]] = False
    full = maxsim(Q, D, d_mask=d_mask)
    _, indices = retrieve(Q, D, 10, d_mask=d_mask, chunk=chunk)
    assert torch.equal(indices, ranked(full, 10)[1])
    for row in indices.tolist():
        copies = [i for i in row if i in (1, 4, 5, 7, 8)]
        empty = [i for i in row if i in (0, 2, 9)]
        assert copies == sorted(copies) and empty == sorted(empty)


def test_nan_ranks_first_as_in_torch_topk(backend):
    Q, D = torch.randn(1, 5, DIM), torch.randn(6, 9, DIM)
    D[3, 2, 0] = float("nan")
    scores, indices = retrieve(Q, D, 3, chunk=2)
    assert indices[0, 0] == 3 and torch.isnan(scores[0, 0]) and not torch.isnan(scores[0, 1:]).any()


def test_float64_ranks_with_the_same_rule():
    Q = torch.randn(2, 5, DIM, dtype=torch.float64)
    D = torch.randn(12, 9, DIM, dtype=torch.float64)
    D[[3, 6, 10]] = D[0].clone()
    scores, indices = retrieve(Q, D, 8, chunk=5)
    ref_scores, ref_indices = ranked(maxsim(Q, D), 8)
    assert scores.dtype == torch.float64 and torch.equal(indices, ref_indices)
    torch.testing.assert_close(scores, ref_scores)


@pytest.mark.parametrize("layout", ["dense", "packed"])
def test_streamed_chunks_equal_in_memory_chunks(backend, layout):
    """The streaming path (two buffers, copies of chunk n + 1 while chunk n scores) run on the CPU."""
    Q = torch.randn(3, 5, DIM)
    if layout == "dense":
        D, cu = torch.randn(9, 9, DIM), None
        d_mask = masks_with_holes((9, 9), "cpu")
    else:
        D, cu = packed_corpus(9)
        d_mask = torch.rand(D.shape[0]) > 0.2
    corpus = _corpus(D, d_mask, cu, None, DIM, None)
    for chunk in (2, 4):
        streamed = _retrieve(Q, None, corpus, 7, True, chunk, False, True)
        in_memory = _retrieve(Q, None, corpus, 7, True, chunk, False, False)
        assert torch.equal(streamed[1], in_memory[1]) and torch.equal(streamed[0], in_memory[0])
    public = retrieve(Q, D, 7, d_mask=d_mask, cu_seqlens_d=cu, normalize=True)
    assert torch.equal(public[1], in_memory[1])
    if layout == "dense":  # the same documents as a packed corpus of equal lengths
        as_packed = _corpus(D.reshape(-1, DIM), d_mask.reshape(-1), torch.arange(10) * 9, None,
                            DIM, None)
        packed_view = _retrieve(Q, None, as_packed, 7, True, 4, False, True)
        assert torch.equal(packed_view[1], in_memory[1])
        torch.testing.assert_close(packed_view[0], in_memory[0])


def test_default_streamed_chunks_hold_whole_documents():
    from fusedmaxsim.retrieval import _ranges_by_rows

    ranges = _ranges_by_rows([0, 3, 3, 10, 11, 30], max_rows=8)
    assert ranges == [(0, 2), (2, 4), (4, 5)]  # a document longer than the buffer stands alone


@pytest.mark.parametrize("layout", ["dense", "packed"])
def test_memory_is_bounded_by_the_chunk(backend, layout):
    """Each scoring call sees at most ``chunk`` documents: a dense corpus through the dense
    forward, the very problem ``maxsim`` plans for those documents; a packed corpus through the
    packed kernel, over its columns of the chunk."""
    Q = torch.randn(2, 5, DIM)
    if layout == "dense":
        D, cu = torch.randn(20, 9, DIM), None
    else:
        D, cu = packed_corpus(20)
    with recording() as plans:
        retrieve(Q, D, 3, cu_seqlens_d=cu, chunk=6)
    assert [p.Ncols for p, _ in plans] == [6, 6, 6, 2]
    assert [p.layout for p, _ in plans] == ["cross" if layout == "dense" else "packed"] * 4
    assert not any(p.save_argmax for p, _ in plans)
    if layout == "dense":
        with torch.no_grad(), recording() as maxsim_plans:
            maxsim(Q, D[:6])
        assert maxsim_plans == plans[:1]


def test_progress_bar_goes_to_stderr(capsys):
    retrieve(torch.randn(2, 5, DIM), torch.randn(9, 4, DIM), 3, chunk=4, progress=True)
    captured = capsys.readouterr()
    assert captured.out == "" and "9/9 docs" in captured.err and captured.err.endswith("\n")


def test_retrieve_never_records_a_graph(backend):
    Q, D = leaf(torch.randn(2, 5, DIM)), leaf(torch.randn(6, 9, DIM))
    scores, _ = retrieve(Q, D, 3)
    assert scores.grad_fn is None and not scores.requires_grad


@pytest.mark.parametrize(
    "call,error,pattern",
    [
        (lambda: retrieve(torch.randn(2, 5, 8), torch.randn(6, 9, 8), 0), ValueError, "top_k must be positive, got 0"),
        (lambda: retrieve(torch.randn(2, 5, 8), torch.randn(6, 9, 8), -3), ValueError, "top_k must be positive"),
        (lambda: retrieve(torch.randn(2, 5, 8), torch.randn(6, 9, 8), 2.0), TypeError, "top_k must be an int"),
        (lambda: retrieve(torch.randn(2, 5, 8), torch.randn(6, 9, 8), True), TypeError, "top_k must be an int"),
        (lambda: retrieve(torch.randn(2, 5, 8), torch.randn(6, 9, 8), 3, chunk=0), ValueError, "chunk must be positive"),
        (lambda: retrieve(torch.randn(2, 5, 8), torch.randn(6, 9, 8), 3, chunk="big"), TypeError, "chunk must be an int"),
        (lambda: retrieve(torch.randn(1, 2, 5, 8), torch.randn(6, 9, 8), 3), ValueError, r"Q must be \[Lq, d\] or \[Nq, Lq, d\]"),
        (lambda: retrieve(torch.randn(2, 5, 8), torch.randn(1, 6, 9, 8), 3), ValueError, r"D must be \[Nd, Ld, d\]"),
        (lambda: retrieve(torch.randn(2, 5, 8), torch.randn(6, 9, 7), 3), ValueError, "share the embedding dim d"),
        (lambda: retrieve(torch.randn(2, 5, 8), torch.randn(6, 9, 8).to("meta"), 3), ValueError, "Q is on cpu but D is on meta: Q and D must be on the same device"),
        (lambda: retrieve(torch.randn(2, 5, 8), torch.randn(6, 9, 8), 3, q_mask=torch.ones(2, 4)), ValueError, r"q_mask must be \[Nq, Lq\] = \(2, 5\)"),
        (lambda: retrieve(torch.randn(5, 8), torch.randn(6, 9, 8), 3, q_mask=torch.ones(4)), ValueError, r"q_mask must be \[Lq\] = \(5,\)"),
        (lambda: retrieve(torch.randn(2, 5, 8), torch.randn(6, 9, 8), 3, d_mask=torch.ones(6, 8)), ValueError, r"d_mask must be \[Nd, Ld\] = \(6, 9\)"),
        (lambda: retrieve(torch.randn(2, 5, 8), torch.randn(6, 9, 8), 3, normalize="yes"), TypeError, r"normalize must be True or False \(a Python bool\), got 'yes'"),
        (lambda: retrieve(torch.randn(2, 5, 8), torch.randn(6, 9, 8), 3, largest=0), TypeError, r"largest must be True or False \(a Python bool\), got 0"),
        (lambda: retrieve(torch.randn(2, 5, 8), torch.randn(6, 9, 8), 3, sorted="no"), TypeError, r"sorted must be True or False"),
        (lambda: retrieve(torch.randn(2, 5, 8), torch.randn(6, 9, 8), 3, max_seqlen_d=9), ValueError, "max_seqlen_d goes with a packed corpus"),
        (lambda: retrieve(torch.randn(2, 5, 8), torch.randn(10, 8), 3, cu_seqlens_d=torch.tensor([0, 4, 9])), ValueError, r"cu_seqlens_d must end at .* D.shape\[0\] = 10"),
        (lambda: retrieve(torch.randn(2, 5, 8), torch.randn(10, 8), 3, cu_seqlens_d=torch.tensor([0, 6, 10]), max_seqlen_d=5), ValueError, r"max_seqlen_d=5 is below"),
        (lambda: retrieve(torch.randn(2, 5, 8), torch.randn(10, 8), 3, cu_seqlens_d=torch.tensor([0, 10]), d_mask=torch.ones(9)), ValueError, r"d_mask must have shape \(10,\)"),
        (lambda: retrieve(torch.randn(2, 5, 8), torch.randn(2, 5, 8), 3, cu_seqlens_d=torch.tensor([0, 10])), ValueError, r"a packed corpus is \[ΣLd, d\]"),
        (lambda: retrieve(torch.randn(2, 5, 8).int(), torch.randn(6, 9, 8), 3), TypeError, "Q must be float16"),
    ],
)
def test_bad_input_is_refused_with_a_clear_message(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


# ---------------------------------------------------------------------------------------------
# MaxSimScorer
# ---------------------------------------------------------------------------------------------


def test_scorer_follows_the_callers_grad_mode(backend):
    scorer = MaxSimScorer(normalize=True)
    assert list(scorer.parameters()) == [] and "normalize=True" in repr(scorer)
    Q, D = leaf(torch.randn(2, 5, DIM)), leaf(torch.randn(3, 9, DIM))
    out = scorer(Q, D)
    torch.testing.assert_close(out, maxsim(Q, D, normalize=True))
    out.sum().backward()
    assert Q.grad is not None and D.grad is not None
    with torch.no_grad():
        assert scorer(Q, D).grad_fn is None
    assert scorer.score(Q, D).grad_fn is None
    assert torch.is_grad_enabled()  # score restores the caller's mode
    with torch.enable_grad():
        assert scorer(Q, D).grad_fn is not None


def test_scorer_is_one_front_door_for_every_layout(backend):
    scorer = MaxSimScorer()
    Q = torch.randn(2, 5, DIM)
    D, cu = packed_corpus(4)
    q_mask = masks_with_holes((2, 5), "cpu", fully_masked_first=False)
    varlen = maxsim_varlen(Q.reshape(-1, DIM), D, torch.arange(3) * 5, cu, q_mask=q_mask.reshape(-1))
    torch.testing.assert_close(scorer(Q, D, q_mask, cu_seqlens_d=cu), varlen)
    torch.testing.assert_close(
        scorer(Q.reshape(-1, DIM), D, cu_seqlens_q=torch.arange(3) * 5, cu_seqlens_d=cu), maxsim_varlen(Q.reshape(-1, DIM), D, torch.arange(3) * 5, cu)
    )
    docs = [D[int(cu[j]) : int(cu[j + 1])] for j in range(4)]
    torch.testing.assert_close(scorer(list(Q), docs), maxsim_varlen(Q.reshape(-1, DIM), D, torch.arange(3) * 5, cu))
    scores, indices = scorer.retrieve(Q, D, 2, cu_seqlens_d=cu)
    assert scores.shape == (2, 2) and indices.shape == (2, 2)
    with pytest.raises(ValueError, match="cu_seqlens_q needs cu_seqlens_d"):
        scorer(Q, D, cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="pass no masks"):
        scorer(list(Q), docs, q_mask)
    with pytest.raises(ValueError, match="backward= must be one of"):
        MaxSimScorer(backward="fast")


def test_scorer_retrieve_uses_its_normalize(backend):
    Q, D = torch.randn(2, 5, DIM), torch.randn(7, 9, DIM) * torch.rand(7, 1, 1) * 5
    on, off = MaxSimScorer(normalize=True), MaxSimScorer()
    assert torch.equal(on.retrieve(Q, D, 7)[1], ranked(maxsim(Q, D, normalize=True), 7)[1])
    assert torch.equal(off.retrieve(Q, D, 7)[1], ranked(maxsim(Q, D), 7)[1])


def test_streaming_a_cpu_corpus_needs_a_gpu_or_the_same_device():
    with settings.use_backend("torch"), pytest.raises(ValueError, match="in CPU memory while Q is on a GPU"):
        retrieve(torch.randn(2, 5, 8).to("meta"), torch.randn(6, 9, 8), 3)


# ---------------------------------------------------------------------------------------------
# torch.topk's keywords, mask_pad_token, the default of normalize
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_largest_false_returns_the_lowest_scores_first(backend, chunk, dtype):
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("float64 runs on the PyTorch path")
    Q, D = torch.randn(3, 5, DIM, dtype=dtype), torch.randn(11, 9, DIM, dtype=dtype)
    D[4] = float("nan")  # a NaN score ranks last of the lowest, as in torch.topk
    d_mask = masks_with_holes((11, 9), "cpu")  # document 0 is empty: it scores 0
    D[7], d_mask[7] = D[2], d_mask[2]  # a tie: the lower index first
    full = maxsim(Q, D, d_mask=d_mask)
    scores, indices = retrieve(Q, D, 11, d_mask=d_mask, normalize=False, largest=False, chunk=chunk)
    order = torch.sort(full, dim=-1, stable=True)  # ascending, NaN last
    assert torch.equal(indices, order.indices)
    torch.testing.assert_close(scores, order.values, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.equal(indices[:, -1], torch.full((3,), 4))
    assert (indices == 2).nonzero()[:, 1].lt((indices == 7).nonzero()[:, 1]).all()
    scores, indices = retrieve(Q, D, 4, d_mask=d_mask, normalize=False, largest=False, chunk=chunk)
    assert torch.equal(indices, order.indices[:, :4])


def test_sorted_false_is_accepted_and_still_sorted(backend):
    Q, D = torch.randn(2, 5, DIM), torch.randn(9, 6, DIM)
    for largest in (True, False):
        assert all(torch.equal(a, b) for a, b in zip(
            retrieve(Q, D, 5, normalize=False, largest=largest, sorted=False),
            retrieve(Q, D, 5, normalize=False, largest=largest)))


def test_scorer_forward_with_ids_masks_the_pad_token(backend):
    Q, D = leaf(torch.randn(2, 5, DIM)), leaf(torch.randn(3, 9, DIM))
    q_ids, d_ids = torch.randint(1, 50, (2, 5)), torch.randint(1, 50, (3, 9))
    q_ids[:, -2:] = -100
    d_ids[0] = -100  # a document made of padding scores 0
    d_ids[1, 4:] = -100
    scorer = MaxSimScorer(normalize=True, mask_pad_token=-100)
    assert "mask_pad_token=-100" in repr(scorer)
    out = scorer.forward_with_ids(Q, D, q_ids, d_ids)
    torch.testing.assert_close(out, maxsim(Q, D, q_ids != -100, d_ids != -100, normalize=True))
    assert torch.equal(out[:, 0], torch.zeros(2))
    out.sum().backward()
    assert torch.equal(Q.grad[:, -2:], torch.zeros(2, 2, DIM))
    # Packed documents: ids of the packed rows.
    D, cu = packed_corpus(4)
    d_ids = torch.randint(0, 3, (D.shape[0],))
    packed = scorer.forward_with_ids(Q, D, q_ids, d_ids, cu_seqlens_d=cu)
    torch.testing.assert_close(packed, scorer(Q, D, q_ids != -100, d_ids != -100, cu_seqlens_d=cu))


@pytest.mark.parametrize(
    "call,error,pattern",
    [
        (lambda: MaxSimScorer(normalize=False).forward_with_ids(torch.randn(2, 5, 8), torch.randn(3, 6, 8), torch.zeros(2, 5), torch.zeros(3, 6)),
         ValueError, r"forward_with_ids requires mask_pad_token set on the scorer"),
        (lambda: MaxSimScorer(normalize=False, mask_pad_token=0).forward_with_ids(torch.randn(2, 5, 8), torch.randn(3, 6, 8), torch.zeros(2, 4), torch.zeros(3, 6)),
         ValueError, r"q_ids must have shape \(2, 5\) \(the token axes of Q \(2, 5, 8\)\), got \(2, 4\)"),
        (lambda: MaxSimScorer(normalize=False, mask_pad_token=0).forward_with_ids(torch.randn(2, 5, 8), torch.randn(3, 6, 8), torch.zeros(2, 5), [0] * 6),
         TypeError, r"d_ids must be a torch.Tensor of token ids, got list"),
        (lambda: MaxSimScorer(normalize=False, mask_pad_token=1.0), TypeError, r"mask_pad_token must be an int token id or None, got float"),
        (lambda: MaxSimScorer(normalize=False, mask_pad_token=True), TypeError, r"mask_pad_token must be an int token id or None, got True"),
        (lambda: MaxSimScorer(normalize=1), TypeError, r"normalize must be True or False \(a Python bool\), got 1"),
    ],
)
def test_scorer_bad_input_is_refused_with_a_clear_message(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


_DEFAULT_NORMALIZE_SCRIPT = """
import warnings
import torch
from fusedmaxsim import MaxSimScorer, retrieve

Q, D = torch.randn(2, 5, 8), torch.randn(6, 9, 8)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    retrieve(Q, D, 3, normalize=False)  # explicit: silent
    MaxSimScorer(normalize=True)
    plain = retrieve(Q, D, 3)  # the default: one warning per function and process
    retrieve(Q, D, 3)
    scorer = MaxSimScorer()
    MaxSimScorer()
assert scorer.normalize is False
assert torch.equal(plain[1], retrieve(Q, D, 3, normalize=False)[1])
for w in caught:
    print(w.category.__name__, w.filename == __file__, w.message)
"""


def test_leaving_normalize_unset_warns_once_per_function(tmp_path):
    """retrieve and MaxSimScorer default to normalize=False where late-interaction-kernels
    defaults to True: a call relying on the default warns once per process (a fresh process, as
    the warning is once per process)."""
    import subprocess
    import sys

    script = tmp_path / "default_normalize.py"
    script.write_text(_DEFAULT_NORMALIZE_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True)
    expected = [
        f"UserWarning True fusedmaxsim.{name} defaults to normalize=False "
        f"(late-interaction-kernels' {name} defaults to normalize=True); "
        "pass normalize= explicitly to silence this"
        for name in ("retrieve", "MaxSimScorer")
    ]
    assert out.stdout.splitlines() == expected, out.stdout + out.stderr
