"""PLAID's approximate score (fusedmaxsim.plaid.plaid_approx_score, and the search pipeline's
internal ``_autograd.approx_scores``) against the float64 oracle, on the Triton kernel
(interpreted) and the PyTorch path: padded and packed documents, per-query candidates, odd
sizes, strides, empty batches, out-of-range values and every error."""

import pytest
import torch

from fusedmaxsim import forced_plan, settings
from fusedmaxsim._autograd import approx_scores
from fusedmaxsim._plan import ApproxTiles
from fusedmaxsim.plaid import plaid_approx_score
from fusedmaxsim.planning import recording
from fusedmaxsim.reference import plaid_approx_score_ref

K = 13  # odd on purpose, like every size here
LENGTHS = [20, 0, 1, 17, 9, 3, 8]  # empty, one token, several token steps (8 a step, interpreted)


def _cs(Nq, Lq, dtype=torch.float32, n_centroids=K):
    shape = (n_centroids, Lq) if Nq is None else (Nq, n_centroids, Lq)
    return torch.randn(shape).to(dtype)


def _padded(lengths=LENGTHS, Ld=20, n_centroids=K, pad=-1):
    """Padded ids, the padding past each length holding ``pad`` (out of range: ignored)."""
    codes = torch.randint(0, n_centroids, (len(lengths), Ld))
    lengths = torch.tensor(lengths, dtype=torch.int64)
    codes[torch.arange(Ld) >= lengths[:, None]] = pad
    return codes, lengths


def _packed(codes, lengths):
    flat = torch.cat([row[:n] for row, n in zip(codes, lengths.tolist())]) if len(lengths) else \
        codes.new_empty(0)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    return flat, cu


def _assert_matches(out, ref, tol=1e-5):
    """Every element: the same NaN and infinities, finite values within ``tol`` of the scale."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    out, ref = out.double(), ref.double()
    assert torch.equal(out.isnan(), ref.isnan()), (out, ref)
    finite = ref.isfinite()
    assert torch.equal(out.isfinite(), finite) and torch.equal(out[~finite & ~ref.isnan()],
                                                               ref[~finite & ~ref.isnan()])
    if finite.any():
        scale = ref[finite].abs().max().clamp_min(1.0)
        assert (out[finite] - ref[finite]).abs().max() <= tol * scale, (out, ref)


@pytest.mark.parametrize("Lq", [1, 7, 33])
@pytest.mark.parametrize("Nq", [None, 5])
def test_padded_and_packed(Nq, Lq, backend):
    """Padded (the padding's ids out of range, ignored) and packed documents, one query and a
    batch of five (two query blocks, interpreted), 1, 7 and 33 query tokens (33: three chunks)."""
    cs = _cs(Nq, Lq)
    codes, lengths = _padded()
    ref = plaid_approx_score_ref(cs, codes, lengths)
    out = plaid_approx_score(cs, codes, lengths)
    assert out.dtype == torch.float32 and out.shape == ((7,) if Nq is None else (Nq, 7))
    _assert_matches(out, ref)
    flat, cu = _packed(codes, lengths)
    _assert_matches(plaid_approx_score(cs, flat, cu_seqlens=cu), ref)
    _assert_matches(plaid_approx_score(cs, flat, cu_seqlens=cu.int()), ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtypes(dtype, backend):
    """fp16 (what PLAID engines write) and bf16: the max is exact, the sum fp32; float64: the
    PyTorch path, float64 scores."""
    cs = _cs(3, 7, dtype)
    codes, lengths = _padded()
    out = plaid_approx_score(cs, codes.int(), lengths.int())
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    _assert_matches(out, plaid_approx_score_ref(cs, codes, lengths),
                    1e-12 if dtype == torch.float64 else 1e-5)


def test_strides(backend):
    """cs transposed (query tokens not adjacent) or skipping centroids, strided codes, both."""
    codes, lengths = _padded()
    wide = torch.randint(0, K, (7, 40))
    wide[:, ::2] = codes
    for cs in (torch.randn(3, 7, K).transpose(1, 2), torch.randn(3, 2 * K, 7)[:, ::2],
               torch.randn(K, 3, 7).permute(1, 0, 2)):
        ref = plaid_approx_score_ref(cs, codes, lengths)
        _assert_matches(plaid_approx_score(cs, wide[:, ::2], lengths), ref)
        flat, cu = _packed(codes, lengths)
        spread = torch.full((2 * flat.shape[0],), -5)
        spread[::2] = flat
        _assert_matches(plaid_approx_score(cs, spread[::2], cu_seqlens=cu), ref)


def test_candidates(backend):
    """``approx_scores`` with per-query candidates: ids < 0 score -inf, an id past the documents
    NaN, repeated ids alike; int32 and int64 ids."""
    cs = _cs(3, 9)
    codes, lengths = _padded()
    ref = plaid_approx_score_ref(cs, codes, lengths)
    starts = torch.arange(7) * codes.shape[1]
    doc_ids = torch.tensor([[0, -1, 5, 2, 6], [3, 3, -1, 1, -7], [4, 0, 1, 7, 6]])
    expected = torch.where(doc_ids < 0, float("-inf"), ref.gather(1, doc_ids.clamp(0, 6)))
    expected[2, 3] = float("nan")  # document 7 does not exist
    for ids in (doc_ids, doc_ids.int()):
        out = approx_scores(cs, codes.flatten(), starts, lengths, ids)
        assert out.dtype == torch.float32
        _assert_matches(out, expected)
    _assert_matches(approx_scores(cs, codes.flatten().int(), starts, lengths.int()), ref)
    # Per-query candidates over a strided doc_ids, and no candidate at all.
    wide = torch.full((3, 10), -1)
    wide[:, ::2] = doc_ids
    _assert_matches(approx_scores(cs, codes.flatten(), starts, lengths, wide[:, ::2]), expected)
    none = approx_scores(cs, codes.flatten(), starts, lengths, torch.full((3, 2), -1))
    assert torch.equal(none, torch.full((3, 2), float("-inf")))


@pytest.mark.parametrize("slot_programs", [None, 1, 2, 3])
def test_hits(backend, slot_programs):
    """Hits (the search's candidates): query q's documents of hits[q] true are scored, the rest
    -inf; a query of no hit, one, some and all; the corpus walked by one program a query, two,
    three (a share that ends within a step) or the plan's."""
    cs = _cs(4, 9)
    codes, lengths = _padded()
    ref = plaid_approx_score_ref(cs, codes, lengths)
    starts = torch.arange(7) * codes.shape[1]
    hits = torch.zeros(4, 7, dtype=torch.bool)
    hits[1, 6] = True
    hits[2, [0, 2, 3, 5]] = True
    hits[3] = True
    expected = torch.where(hits, ref, float("-inf"))
    forced = {} if slot_programs is None else {"approx_slot_programs": slot_programs}
    with forced_plan(**forced):
        out = approx_scores(cs, codes.flatten(), starts, lengths, hits=hits)
    assert out.shape == (4, 7)
    _assert_matches(out, expected)
    for bad in (hits[:3], hits.int(), hits[:, :6]):
        with pytest.raises(ValueError, match=r"hits must be \[Nq, Nd\] bool"):
            approx_scores(cs, codes.flatten(), starts, lengths, hits=bad)
    with pytest.raises(ValueError, match=r"without doc_ids"):
        approx_scores(cs, codes.flatten(), starts, lengths, torch.zeros(4, 2).long(), hits)


def test_empty_batches(backend):
    cs = _cs(2, 7)
    codes, lengths = _padded()
    assert plaid_approx_score(cs, codes[:0], lengths[:0]).shape == (2, 0)
    assert plaid_approx_score(_cs(0, 7), codes, lengths).shape == (0, 7)
    assert plaid_approx_score(cs, codes.new_empty(0), cu_seqlens=torch.tensor([0])).shape == (2, 0)
    assert plaid_approx_score(cs[0], codes[:0], lengths[:0]).shape == (0,)
    zero = torch.zeros(2, 7)
    assert torch.equal(plaid_approx_score(_cs(2, 0), codes, lengths), zero)  # Lq = 0
    assert torch.equal(plaid_approx_score(cs, codes[:, :0], torch.zeros(7, dtype=torch.int64)),
                       zero)  # max_Ld = 0
    assert torch.equal(plaid_approx_score(cs, codes.new_empty(0), cu_seqlens=torch.zeros(8,
                       dtype=torch.int64)), zero)  # every document empty, T = 0
    no_centroids = _cs(2, 7, n_centroids=0)
    assert torch.equal(plaid_approx_score(no_centroids, codes, torch.zeros(7, dtype=torch.int64)),
                       zero)
    # Without centroids any token's id is out of range: NaN, unchecked; empty documents 0.
    out = plaid_approx_score(no_centroids, codes, lengths, validate=False)
    assert torch.equal(out.isnan(), (lengths > 0).expand(2, 7)) and not out[:, 1].any()
    assert approx_scores(cs, codes.flatten(), torch.arange(7) * 20, lengths,
                         torch.zeros(2, 0, dtype=torch.int64)).shape == (2, 0)


def test_infinities_and_nan(backend):
    """A column of -inf adds 0 (its max is -inf); +inf and NaN reach the scores that select them."""
    cs = _cs(2, 7)
    codes, lengths = _padded()
    cs[:, :, 3] = float("-inf")
    cs[1, 4, 5] = float("nan")
    cs[0, 2, 6] = float("inf")
    _assert_matches(plaid_approx_score(cs, codes, lengths), plaid_approx_score_ref(cs, codes,
                                                                                   lengths))


def test_out_of_range_values(backend):
    """Checked on the CPU: a clear error. Unchecked (validate=False): that document's scores are
    NaN, every other is unchanged, nothing read out of bounds."""
    cs = _cs(2, 7)
    codes, lengths = _padded()
    good = plaid_approx_score(cs, codes, lengths)
    bad = codes.clone()
    bad[3, 2] = K  # inside document 3 (17 tokens)
    bad[5, 0] = -2
    with pytest.raises(ValueError, match=r"codes must be centroid ids in \[0, 13\) .* got values "
                                         r"in \[-2, 13\]"):
        plaid_approx_score(cs, bad, lengths)
    long = lengths.clone()
    long[4] = 21
    with pytest.raises(ValueError, match=r"doc_lengths must lie in \[0, 20\]"):
        plaid_approx_score(cs, codes, long)
    long[6] = -1
    out = plaid_approx_score(cs, bad, long, validate=False)
    broken = torch.tensor([False, False, False, True, True, True, True])
    assert out[:, broken].isnan().all() and torch.equal(out[:, ~broken], good[:, ~broken])

    flat, cu = _packed(bad, lengths)
    with pytest.raises(ValueError, match=r"codes must be centroid ids in \[0, 13\)"):
        plaid_approx_score(cs, flat, cu_seqlens=cu)
    out = plaid_approx_score(cs, flat, cu_seqlens=cu, validate=False)
    assert out[:, [3, 5]].isnan().all() and torch.equal(out[:, [0, 1, 2, 4, 6]],
                                                        good[:, [0, 1, 2, 4, 6]])
    flat, cu = _packed(codes, lengths)
    ids_past_end = torch.cat([flat, torch.tensor([-3, 99])])  # belong to no document: ignored
    assert torch.equal(plaid_approx_score(cs, ids_past_end, cu_seqlens=cu), good)
    for broken_cu, message in (
            (cu + 1, r"cu_seqlens must start at 0, got cu_seqlens\[0\] = 1"),
            (torch.tensor([0, 20, 10, 31, 40, 49, 52, 58]),
             r"cu_seqlens must be non-decreasing .* a length of -10"),
            (torch.cat([cu[:-1], cu[-1:] + 1]), r"cu_seqlens must end within the 58 ids of codes")):
        with pytest.raises(ValueError, match=message):
            plaid_approx_score(cs, flat, cu_seqlens=broken_cu)
    # Unchecked: a negative length, and a document past the ids, score NaN.
    out = plaid_approx_score(cs, flat, cu_seqlens=torch.tensor([0, 20, 10, 31, 40, 49, 52, 60]),
                             validate=False)
    assert torch.equal(out.isnan(), torch.tensor([0, 1, 0, 0, 0, 0, 1]).bool().expand(2, 7))
    assert torch.equal(out[:, 0], good[:, 0])
    # The internal entry point checks no values: ranges out of the ids, NaN.
    starts = torch.tensor([0, 20, -1, 55, 40])
    out = approx_scores(cs, flat, starts, torch.tensor([20, 0, 1, 4, -1]))
    assert torch.equal(out.isnan(), torch.tensor([False, False, True, True, True]).expand(2, 5))
    assert torch.equal(out[:, :2], good[:, :2])


def test_the_plan_says_how_it_runs(backend):
    cs = _cs(3, 7)
    codes, lengths = _padded()
    with recording() as plans:
        expected = plaid_approx_score(cs, codes, lengths)
    problem, plan = plans[0]
    assert problem.layout == "approx" and plan.kernel == backend
    with forced_plan(kernel="torch"), recording() as plans:
        _assert_matches(plaid_approx_score(cs, codes, lengths), expected)
    assert plans[0][1].kernel == "torch"
    with recording() as plans:
        approx_scores(cs, codes.flatten(), torch.arange(7) * 20, lengths,
                      torch.tensor([[1, 2]] * 3))
    assert plans[0][0].layout == "approx candidates" and plans[0][1].kernel == backend


def test_forced_tiles_and_launches(backend):
    """Other tiles, one query a block, and a launch for each query (the grid's split)."""
    cs = _cs(3, 7)
    codes, lengths = _padded()
    ref = plaid_approx_score_ref(cs, codes, lengths)
    for tiles in (ApproxTiles(4, 1, 16, 4, 1), ApproxTiles(8, 2, 4, 4, 1)):
        with forced_plan(approx_tiles=tiles, approx_launch_queries=1):
            _assert_matches(plaid_approx_score(cs, codes, lengths), ref)
            _assert_matches(approx_scores(cs, codes.flatten(), torch.arange(7) * 20, lengths,
                                          torch.tensor([[6, 3], [0, 4], [1, -1]])),
                            torch.stack([ref[0, [6, 3]], ref[1, [0, 4]],
                                         torch.tensor([ref[2, 1], float("-inf")])]))


def test_torch_path_blocks():
    """The PyTorch path's blocks of documents and of queries, and of candidate pairs: the same
    scores however small the budget."""
    cs = _cs(3, 7)
    codes, lengths = _padded()
    ref = plaid_approx_score_ref(cs, codes, lengths)
    doc_ids = torch.tensor([[6, 0, -1], [3, 3, 1], [0, 4, 2]])
    expected = torch.where(doc_ids < 0, float("-inf"), ref.gather(1, doc_ids.clamp(min=0)))
    with settings.use_backend("torch"):
        for block_bytes in (None, 64, 4096):
            settings.set_torch_block_bytes(block_bytes)
            try:
                _assert_matches(plaid_approx_score(cs, codes, lengths), ref)
                _assert_matches(approx_scores(cs, codes.flatten(), torch.arange(7) * 20, lengths,
                                              doc_ids), expected)
            finally:
                settings.set_torch_block_bytes(None)


def test_no_gradient():
    cs = _cs(2, 7).requires_grad_()
    codes, lengths = _padded()
    out = plaid_approx_score(cs, codes, lengths)
    assert not out.requires_grad and out.grad_fn is None


def test_every_error_names_the_argument():
    cs = _cs(2, 7)
    codes, lengths = _padded()
    flat, cu = _packed(codes, lengths)

    def call(*args, **kwargs):
        return plaid_approx_score(*args, **kwargs)

    cases = [
        (TypeError, r"query_centroid_scores must be float16, bfloat16, float32 or float64",
         lambda: call(cs.int(), codes, lengths)),
        (TypeError, r"query_centroid_scores must be a torch.Tensor", lambda: call([1.0], codes,
                                                                                  lengths)),
        (ValueError, (r"query_centroid_scores must be \[n_centroids, Lq\] or \[Nq, "
                      r"n_centroids, Lq\], got shape \(13,\)"),
         lambda: call(cs[0, :, 0], codes, lengths)),
        (TypeError, r"codes must be an integer tensor", lambda: call(cs, codes.float(), lengths)),
        (TypeError, r"codes must be a torch.Tensor", lambda: call(cs, [[1]], lengths)),
        (ValueError, r"codes must be \[B, max_Ld\] \(padded documents, with doc_lengths",
         lambda: call(cs, flat, lengths)),
        (ValueError, r"codes must be 1-D \[T\] \(packed documents, with cu_seqlens=\)",
         lambda: call(cs, codes, cu_seqlens=cu)),
        (ValueError, r"codes is on meta but query_centroid_scores is on cpu",
         lambda: call(cs, codes.to("meta"), lengths)),
        (ValueError, r"needs doc_lengths \[B\] with padded codes", lambda: call(cs, codes)),
        (ValueError, r"pass doc_lengths with padded codes .* not both",
         lambda: call(cs, flat, lengths, cu_seqlens=cu)),
        (ValueError, r"doc_lengths must have shape \(7,\)", lambda: call(cs, codes, lengths[:3])),
        (TypeError, r"doc_lengths must be an integer tensor",
         lambda: call(cs, codes, lengths.float())),
        (TypeError, r"doc_lengths must be a torch.Tensor", lambda: call(cs, codes, [3] * 7)),
        (TypeError, r"cu_seqlens must be an integer tensor",
         lambda: call(cs, flat, cu_seqlens=cu.float())),
        (ValueError, r"cu_seqlens must be 1-D", lambda: call(cs, flat, cu_seqlens=cu[None])),
        (ValueError, r"cu_seqlens must hold N \+ 1 offsets",
         lambda: call(cs, flat, cu_seqlens=cu[:0])),
        (TypeError, r"validate must be True, False or None",
         lambda: call(cs, codes, lengths, validate="yes")),
    ]
    for error, message, run in cases:
        with pytest.raises(error, match=message):
            run()
    starts = torch.arange(7) * 20
    internal = [
        (ValueError, r"query_centroid_scores must be \[Nq, n_centroids, Lq\]",
         lambda: approx_scores(cs[0], flat, starts, lengths)),
        (ValueError, r"codes must be \[T\] centroid ids", lambda: approx_scores(cs, codes, starts,
                                                                               lengths)),
        (TypeError, r"starts must be an integer tensor",
         lambda: approx_scores(cs, flat, starts.float(), lengths)),
        (ValueError, r"starts and lengths must have the same length \[Nd\]",
         lambda: approx_scores(cs, flat, starts, lengths[:3])),
        (ValueError, r"lengths must be \[Nd\] tokens of each document",
         lambda: approx_scores(cs, flat, starts, lengths[None])),
        (ValueError, r"doc_ids must be \[Nq, C\] with Nq = 2",
         lambda: approx_scores(cs, flat, starts, lengths, torch.zeros(3, 4, dtype=torch.int64))),
        (TypeError, r"doc_ids must be an integer tensor",
         lambda: approx_scores(cs, flat, starts, lengths, torch.zeros(2, 4))),
        (ValueError, r"doc_ids is on meta", lambda: approx_scores(
            cs, flat, starts, lengths, torch.zeros(2, 4, dtype=torch.int64, device="meta"))),
    ]
    for error, message, run in internal:
        with pytest.raises(error, match=message):
            run()
