"""Packed sequences, pair lists, padded candidates and lists, against a per-segment loop of the
float64 reference, on both paths (Triton interpreted on CPU, and PyTorch).

Lengths include 0 and 1 on purpose (an empty query or document scores 0 and gets 0 gradient), and
d = 40 is not a power of two, so every tail mask runs.
"""

import os
import shutil

import pytest
import torch
from helpers import assert_backward_bitwise_reproducible, compare_with_float64, leaf

from fusedmaxsim import (
    forced_plan,
    maxsim,
    maxsim_padded,
    maxsim_ragged,
    maxsim_varlen,
    pack_padded,
    score_pairs_packed,
    settings,
)
from fusedmaxsim.planning import BackwardPlan, BwdConfig, ForwardPlan, FwdConfig, recording
from fusedmaxsim.reference import maxsim_ref
from fusedmaxsim.testing import assert_close_to_reference

DIM = 40
Q_LENGTHS = [3, 0, 1, 7]
D_LENGTHS = [5, 1, 0, 13]
PAIRS = ([0, 3, 2, 0, 1, 3], [3, 0, 2, 3, 2, 1])  # repeats a pair, shares queries and documents

# A pairwise covering of dtype x strategy x normalize: every pair of values meets once, at half
# the cost of the full product under the interpreter.
COMBOS = [
    pytest.param(torch.float32, "unified", False, id="fp32-unified-raw"),
    pytest.param(torch.float32, "lowmem", True, id="fp32-lowmem-normalize"),
    pytest.param(torch.float16, "unified", True, id="fp16-unified-normalize"),
    pytest.param(torch.float16, "lowmem", False, id="fp16-lowmem-raw"),
]


def offsets(lengths, dtype=torch.int64):
    return torch.tensor([0, *lengths]).cumsum(0).to(dtype)


def packed(lengths, dtype=torch.float32, dim=DIM):
    return torch.randn(sum(lengths), dim, dtype=dtype)


def segment(x, cu, i):
    return x[int(cu[i]) : int(cu[i + 1])]


def loop_reference(Q, D, cu_q, cu_d, q_mask=None, d_mask=None, normalize=False, pairs=None):
    """Scores by calling the float64 reference on every (query, document) segment pair."""
    n_q, n_d = cu_q.numel() - 1, cu_d.numel() - 1
    scored = list(zip(*pairs)) if pairs is not None else [(i, j) for i in range(n_q) for j in range(n_d)]
    out = []
    for i, j in scored:
        qm = None if q_mask is None else segment(q_mask, cu_q, i)
        dm = None if d_mask is None else segment(d_mask, cu_d, j)
        out.append(maxsim_ref(segment(Q, cu_q, i), segment(D, cu_d, j), qm, dm, normalize=normalize))
    scores = torch.stack(out) if out else Q.new_zeros(0)
    return scores if pairs is not None else scores.reshape(n_q, n_d)


def check_packed(fn, Q, D, cu_q, cu_d, *, pairs=None, q_mask=None, d_mask=None, normalize=False,
                 backward=None, tol=None, **kwargs):
    """Scores and both gradients (a random grad_output, then a stride-0 one) against float64."""
    index = (torch.tensor(pairs[0], device=Q.device), torch.tensor(pairs[1], device=Q.device)) if pairs else ()
    return compare_with_float64(
        lambda q, d: fn(q, d, cu_q, cu_d, *index, q_mask=q_mask, d_mask=d_mask,
                        normalize=normalize, backward=backward, **kwargs),
        lambda q, d: loop_reference(q, d, cu_q, cu_d, q_mask, d_mask, normalize, pairs),
        Q, D, tol,
    )


def masks():
    q_mask = torch.rand(sum(Q_LENGTHS)) > 0.3
    d_mask = torch.rand(sum(D_LENGTHS)) > 0.3
    q_mask[:3] = False  # the first query is fully masked
    return q_mask, d_mask


@pytest.mark.parametrize("dtype,strategy,normalize", COMBOS)
def test_varlen_matches_a_loop_over_segments(backend, dtype, strategy, normalize):
    Q, D = packed(Q_LENGTHS, dtype), packed(D_LENGTHS, dtype)
    q_mask, d_mask = masks()
    out = check_packed(
        maxsim_varlen, Q, D, offsets(Q_LENGTHS), offsets(D_LENGTHS), q_mask=q_mask, d_mask=d_mask,
        normalize=normalize, backward=strategy,
    )
    # The fully masked first query, the empty second query and the empty third document score 0.
    assert torch.all(out[0] == 0) and torch.all(out[1] == 0) and torch.all(out[:, 2] == 0)


@pytest.mark.parametrize("dtype,strategy,normalize", COMBOS)
def test_pairs_match_a_loop_over_segments(backend, dtype, strategy, normalize):
    Q, D = packed(Q_LENGTHS, dtype), packed(D_LENGTHS, dtype)
    q_mask, d_mask = masks()
    check_packed(
        score_pairs_packed, Q, D, offsets(Q_LENGTHS), offsets(D_LENGTHS), pairs=PAIRS,
        q_mask=q_mask, d_mask=d_mask, normalize=normalize, backward=strategy,
    )


def test_without_masks_and_with_int32_offsets(backend):
    Q, D = packed(Q_LENGTHS), packed(D_LENGTHS)
    cu_q, cu_d = offsets(Q_LENGTHS, torch.int32), offsets(D_LENGTHS, torch.int32)
    check_packed(maxsim_varlen, Q, D, cu_q, cu_d)
    check_packed(score_pairs_packed, Q, D, cu_q, cu_d, pairs=PAIRS)


def test_bf16_parity(backend):
    """The interpreter computes bf16 dots in fp32 (its bf16 dot is wrong); the GPU suite covers real bf16."""
    Q, D = packed(Q_LENGTHS, torch.bfloat16), packed(D_LENGTHS, torch.bfloat16)
    check_packed(maxsim_varlen, Q, D, offsets(Q_LENGTHS), offsets(D_LENGTHS), backward="lowmem")
    check_packed(score_pairs_packed, Q, D, offsets(Q_LENGTHS), offsets(D_LENGTHS), pairs=PAIRS)


def test_given_maxima_are_exact_and_larger_ones_change_nothing(backend):
    Q, D = packed(Q_LENGTHS), packed(D_LENGTHS)
    cu_q, cu_d = offsets(Q_LENGTHS), offsets(D_LENGTHS)
    exact = maxsim_varlen(Q, D, cu_q, cu_d, max(Q_LENGTHS), max(D_LENGTHS))
    torch.testing.assert_close(exact, maxsim_varlen(Q, D, cu_q, cu_d))
    torch.testing.assert_close(exact, maxsim_varlen(Q, D, cu_q, cu_d, 9, 100), rtol=1e-6, atol=1e-6)


def test_packed_equals_padded_on_equal_lengths(backend):
    Qd = torch.randn(3, 7, DIM)
    Dd = torch.randn(4, 11, DIM)
    dense = maxsim(Qd, Dd)
    varlen = maxsim_varlen(Qd.reshape(-1, DIM), Dd.reshape(-1, DIM), offsets([7] * 3), offsets([11] * 4))
    torch.testing.assert_close(varlen, dense, rtol=1e-5, atol=1e-5)
    pairs = score_pairs_packed(
        Qd.reshape(-1, DIM), Dd[:3].reshape(-1, DIM), offsets([7] * 3), offsets([11] * 3),
        torch.arange(3), torch.arange(3),
    )
    torch.testing.assert_close(pairs, dense[:, :3].diagonal(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", ["unified", "lowmem"])
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
def test_varlen_and_maxsim_on_the_padded_equivalent_agree(backend, strategy, normalize):
    """The same problem through two front doors: ``maxsim_varlen`` on ragged sequences and
    ``maxsim`` on their padded, masked equivalent give the same scores and gradients (1e-4
    relative, IEEE fp32), with a random and a stride-0 ``grad_output``."""
    lq, ld = [5, 1, 0, 7], [9, 3, 12, 0, 6]
    Qp, Dp = packed(lq), packed(ld)
    Qd = torch.zeros(len(lq), max(lq), DIM)
    Dd = torch.zeros(len(ld), max(ld), DIM)
    q_mask = torch.zeros(len(lq), max(lq), dtype=torch.bool)
    d_mask = torch.zeros(len(ld), max(ld), dtype=torch.bool)
    for i, n in enumerate(lq):
        Qd[i, :n], q_mask[i, :n] = Qp[sum(lq[:i]):sum(lq[:i + 1])], True
    for j, n in enumerate(ld):
        Dd[j, :n], d_mask[j, :n] = Dp[sum(ld[:j]):sum(ld[:j + 1])], True
    with settings.use_fp32_precision("ieee"):
        for grad in (torch.randn(len(lq), len(ld)), None):
            Qv, Dv, Qm, Dm = leaf(Qp), leaf(Dp), leaf(Qd), leaf(Dd)
            varlen = maxsim_varlen(Qv, Dv, offsets(lq), offsets(ld), normalize=normalize,
                                   backward=strategy)
            dense = maxsim(Qm, Dm, q_mask, d_mask, normalize=normalize, backward=strategy)
            torch.testing.assert_close(varlen, dense, rtol=1e-4, atol=1e-5)
            (varlen.sum() if grad is None else (varlen * grad).sum()).backward()
            (dense.sum() if grad is None else (dense * grad).sum()).backward()
            torch.testing.assert_close(Qv.grad, Qm.grad[q_mask], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(Dv.grad, Dm.grad[d_mask], rtol=1e-4, atol=1e-5)


def test_ragged_lists_match_a_loop_and_reach_every_tensor(backend):
    qs = [leaf(torch.randn(n, DIM)) for n in Q_LENGTHS]
    ds = [leaf(torch.randn(n, DIM)) for n in D_LENGTHS]
    out = maxsim_ragged(qs, ds)
    ref = loop_reference(torch.cat(qs).double(), torch.cat(ds).double(), offsets(Q_LENGTHS), offsets(D_LENGTHS))
    assert_close_to_reference(out, ref, 2e-3, "scores")
    out.sum().backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in qs + ds)
    # A 3-D tensor counts as equal-length sequences.
    dense_q = torch.randn(2, 5, DIM)
    torch.testing.assert_close(maxsim_ragged(dense_q, ds), maxsim_ragged(list(dense_q), ds))


def test_ragged_gradients_match_the_reference(backend):
    qs = [leaf(torch.randn(n, DIM)) for n in Q_LENGTHS]
    ds = [leaf(torch.randn(n, DIM)) for n in D_LENGTHS]
    q64 = [leaf(q.double()) for q in qs]
    d64 = [leaf(d.double()) for d in ds]
    ref_fn = lambda: torch.stack([torch.stack([maxsim_ref(q, d, normalize=True) for d in d64]) for q in q64])
    grad = torch.randn(len(qs), len(ds))
    maxsim_ragged(qs, ds, normalize=True).backward(grad)
    ref_fn().backward(grad.double())
    maxsim_ragged(qs, ds, normalize=True).sum().backward()  # a stride-0 grad_output, accumulated
    ref_fn().sum().backward()
    for got, want in zip(qs + ds, q64 + d64):
        expected = torch.zeros_like(want) if want.grad is None else want.grad  # empty: no graph
        assert_close_to_reference(got.grad, expected, 2e-3, "grad")


def test_maxsim_padded_matches_a_loop_and_pack_padded_agrees(backend):
    B, C, Lq, Ld = 3, 4, 6, 9
    queries, documents = leaf(torch.randn(B, Lq, DIM)), leaf(torch.randn(B, C, Ld, DIM))
    qlen = torch.tensor([6, 0, 1])
    dlen = torch.tensor([[9, 1, 0, 4], [3, 3, 3, 3], [0, 9, 2, 5]])
    out = maxsim_padded(queries, documents, qlen, dlen)
    ref = torch.stack([
        torch.stack([
            maxsim_ref(queries[b, : qlen[b]].double(), documents[b, c, : dlen[b, c]].double())
            for c in range(C)
        ])
        for b in range(B)
    ])
    assert_close_to_reference(out, ref, 2e-3, "scores")
    grad = torch.randn(B, C)
    gq, gd = torch.autograd.grad(out, (queries, documents), grad)
    rq, rd = torch.autograd.grad(ref, (queries, documents), grad.double(), retain_graph=True)
    assert_close_to_reference(gq, rq, 2e-3, "grad queries")
    assert_close_to_reference(gd, rd, 2e-3, "grad documents")
    assert torch.all(gq[0, 6:] == 0) and torch.all(gd[0, 2] == 0)  # padding gets exactly 0
    maxsim_padded(queries, documents, qlen, dlen).sum().backward()  # a stride-0 grad_output
    rq, rd = torch.autograd.grad(ref.sum(), (queries, documents))
    assert_close_to_reference(queries.grad, rq, 2e-3, "grad queries (sum)")
    assert_close_to_reference(documents.grad, rd, 2e-3, "grad documents (sum)")

    batch = pack_padded(queries, documents, qlen, dlen)
    assert batch.max_seqlen_q == 6 and batch.max_seqlen_d == 9
    assert batch.Q_packed.shape == (7, DIM) and batch.D_packed.shape == (int(dlen.sum()), DIM)
    Q_packed, cu_q, D_packed, cu_d, pair_q, pair_d, max_q, max_d = batch
    flat = score_pairs_packed(Q_packed, D_packed, cu_q, cu_d, pair_q, pair_d, max_seqlen_q=max_q, max_seqlen_d=max_d)
    torch.testing.assert_close(flat.view(B, C), out, rtol=1e-5, atol=1e-5)
    gq2, gd2 = torch.autograd.grad(flat.view(B, C), (queries, documents), grad)
    torch.testing.assert_close(gq2, gq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gd2, gd, rtol=1e-5, atol=1e-5)


# Tile paths that tiny default configurations do not take: queries longer than the tile (the
# chunk loop), two queries per tile, and backward blocks that a document or query spans.
FORCED = [
    pytest.param(FwdConfig(16, 1, 16, 64, 4, 1), BwdConfig(16, 16, 16, 64, 4, 1), "unified", id="chunked"),
    pytest.param(FwdConfig(16, 2, 16, 64, 4, 1), BwdConfig(16, 16, 32, 64, 4, 1), "lowmem", id="two-queries"),
    pytest.param(FwdConfig(16, 2, 16, 64, 4, 1, query_in_registers=True), BwdConfig(16, 16, 32, 64, 4, 1),
                 "unified", id="query-in-registers"),
]


@pytest.mark.parametrize("fwd,bwd,strategy", FORCED)
def test_forced_tile_paths(fwd, bwd, strategy, device):
    lq, ld = [19, 0, 33], [33, 1, 17]
    Q, D = packed(lq, dim=64).to(device), packed(ld, dim=64).to(device)
    q_mask = (torch.rand(sum(lq)) > 0.2).to(device)
    cu_q, cu_d = offsets(lq).to(device), offsets(ld).to(device)
    with settings.use_backend("triton"), forced_plan(fwd_tiles=fwd, bwd_tiles=bwd):
        check_packed(maxsim_varlen, Q, D, cu_q, cu_d, q_mask=q_mask, backward=strategy)
        check_packed(
            score_pairs_packed, Q, D, cu_q, cu_d, pairs=([0, 2, 2, 1], [0, 0, 2, 1]),
            q_mask=q_mask, backward=strategy,
        )


def test_a_too_small_unchecked_maximum_scores_nan_and_nothing_else(backend):
    """Unchecked (``validate=False``), a broken promise is loud and local, never a bad read."""
    Q, D = packed(Q_LENGTHS), packed(D_LENGTHS)
    cu_q, cu_d = offsets(Q_LENGTHS), offsets(D_LENGTHS)
    full = maxsim_varlen(Q, D, cu_q, cu_d)
    out = maxsim_varlen(Q, D, cu_q, cu_d, 3, 5, validate=False)  # query 3 (7) and document 3 (13) exceed
    assert torch.isnan(out[3]).all() and torch.isnan(out[:, 3]).all()
    keep = torch.tensor([0, 1, 2])
    torch.testing.assert_close(out[keep][:, [0, 1, 2]], full[keep][:, [0, 1, 2]])
    pairs = score_pairs_packed(Q, D, cu_q, cu_d, torch.tensor([0, 3, 0]), torch.tensor([0, 0, 3]),
                               max_seqlen_q=3, max_seqlen_d=5, validate=False)
    assert not torch.isnan(pairs[0]) and torch.isnan(pairs[1:]).all()


def test_unchecked_bad_offsets_and_pair_indices_stay_in_bounds(backend):
    """Offsets beyond the packed rows are clamped (as documented); bad pair indices score NaN."""
    Q, D = packed([2, 3]), packed([4, 4])
    cu_q = torch.tensor([0, 2, 100])  # the last query claims rows it does not have
    out = maxsim_varlen(Q, D, cu_q, offsets([4, 4]), 100, 4, validate=False)
    torch.testing.assert_close(out, maxsim_varlen(Q, D, offsets([2, 3]), offsets([4, 4])))
    pairs = score_pairs_packed(Q, D, offsets([2, 3]), offsets([4, 4]), torch.tensor([0, 5, -1]),
                               torch.tensor([1, 0, 0]), max_seqlen_q=3, max_seqlen_d=4, validate=False)
    assert not torch.isnan(pairs[0]) and torch.isnan(pairs[1:]).all()


def test_empty_inputs(backend):
    Q, D = leaf(packed([3, 2])), leaf(packed([4]))
    none_q = maxsim_varlen(Q[:0], D, torch.zeros(1, dtype=torch.int64), offsets([4]))
    assert none_q.shape == (0, 1)
    none_d = maxsim_varlen(Q, D[:0], offsets([3, 2]), torch.zeros(1, dtype=torch.int64))
    assert none_d.shape == (2, 0)
    none_d.sum().backward()
    assert torch.all(Q.grad == 0)
    no_pairs = score_pairs_packed(Q, D, offsets([3, 2]), offsets([4]), torch.tensor([], dtype=torch.int64),
                                  torch.tensor([], dtype=torch.int64))
    assert no_pairs.shape == (0,) and no_pairs.dtype == torch.float32
    no_pairs.sum().backward()
    assert torch.all(D.grad == 0)
    empty_seqs = maxsim_varlen(Q, D, torch.tensor([0, 0, 5]), torch.tensor([0, 0, 4]))
    assert torch.all(empty_seqs[0] == 0) and torch.all(empty_seqs[:, 0] == 0)
    no_batch = pack_padded(torch.randn(0, 3, 8), torch.randn(0, 2, 4, 8), torch.zeros(0, dtype=torch.int64),
                           torch.zeros(0, 2, dtype=torch.int64))
    assert no_batch.Q_packed.shape == (0, 8) and no_batch.pair_q_idx.numel() == 0 and no_batch.max_seqlen_q == 0
    no_candidates = pack_padded(torch.randn(2, 3, 8), torch.randn(2, 0, 4, 8), torch.tensor([3, 1]),
                                torch.zeros(2, 0, dtype=torch.int64))
    assert no_candidates.D_packed.shape == (0, 8) and no_candidates.cu_seqlens_q.tolist() == [0, 3, 4]
    assert maxsim_padded(torch.randn(2, 3, 8), torch.randn(2, 0, 4, 8), torch.tensor([3, 1]),
                         torch.zeros(2, 0, dtype=torch.int64)).shape == (2, 0)


def test_ties_go_to_the_lowest_index(backend):
    Q = leaf(torch.randn(5, DIM))
    D = torch.randn(9, DIM)
    D[2] = D[6] = D[7] = Q.sum(0).detach() * 10  # wins for every query token
    D = leaf(D)
    maxsim_varlen(Q, D, offsets([5]), offsets([9])).sum().backward()
    assert D.grad[2].abs().sum() > 0 and torch.all(D.grad[6] == 0) and torch.all(D.grad[7] == 0)


def test_nan_propagates_only_from_valid_tokens(backend):
    Q, D = packed([3, 4]), packed([5, 6])
    D[7, 0] = float("nan")  # in the second document
    out = maxsim_varlen(Q, D, offsets([3, 4]), offsets([5, 6]))
    assert torch.isnan(out[:, 1]).all() and not torch.isnan(out[:, 0]).any()
    d_mask = torch.ones(11, dtype=torch.bool)
    d_mask[7] = False
    assert not torch.isnan(maxsim_varlen(Q, D, offsets([3, 4]), offsets([5, 6]), d_mask=d_mask)).any()


def test_fp32_is_never_computed_in_half_precision(backend):
    Q, D = packed(Q_LENGTHS) * 300, packed(D_LENGTHS) * 300
    check_packed(maxsim_varlen, Q, D, offsets(Q_LENGTHS), offsets(D_LENGTHS), tol=(1e-3, 1e-3))


def test_mixed_dtypes_are_promoted_and_grads_keep_each_dtype(backend):
    Q = leaf(packed(Q_LENGTHS, torch.float16))
    D = leaf(packed(D_LENGTHS, torch.float32))
    out = maxsim_varlen(Q, D, offsets(Q_LENGTHS), offsets(D_LENGTHS))
    ref = loop_reference(Q.double(), D.double(), offsets(Q_LENGTHS), offsets(D_LENGTHS))
    assert_close_to_reference(out, ref, 1e-3)
    out.sum().backward()
    assert Q.grad.dtype == torch.float16 and D.grad.dtype == torch.float32


def test_non_contiguous_packed_tokens(backend):
    Q = torch.randn(DIM, sum(Q_LENGTHS)).T  # d is not the fastest axis
    D = torch.randn(sum(D_LENGTHS), 2 * DIM)[:, ::2]
    assert Q.stride(-1) != 1 and D.stride(-1) != 1
    check_packed(maxsim_varlen, Q, D, offsets(Q_LENGTHS), offsets(D_LENGTHS), backward="lowmem")
    check_packed(score_pairs_packed, Q, D, offsets(Q_LENGTHS), offsets(D_LENGTHS), pairs=PAIRS)


@pytest.mark.parametrize("fn", ["varlen", "pairs"])
def test_lowmem_backward_is_bitwise_reproducible(backend, fn):
    Q, D = packed(Q_LENGTHS), packed(D_LENGTHS)

    def backward_of(q, d):
        if fn == "varlen":
            out = maxsim_varlen(q, d, offsets(Q_LENGTHS), offsets(D_LENGTHS), backward="lowmem")
        else:
            out = score_pairs_packed(q, d, offsets(Q_LENGTHS), offsets(D_LENGTHS), torch.tensor(PAIRS[0]),
                                     torch.tensor(PAIRS[1]), backward="lowmem")
        out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))

    assert_backward_bitwise_reproducible(backward_of, Q, D)


@pytest.mark.parametrize("fn", ["varlen", "pairs"])
def test_lowmem_grad_d_scans_at_one_stage(fn):
    """The packed document-owned grad_D scans its rows in a loop in every program: it launches at
    the dense scans' one stage, whatever the configuration's (docs/design.md, Measured
    constants: DD_SCAN_STAGES; Packed layouts)."""
    Q, D = leaf(packed(Q_LENGTHS)), leaf(packed(D_LENGTHS))
    tiles = BwdConfig(16, 32, 16, 64, 4, 2)
    with settings.use_backend("triton"), forced_plan(bwd_tiles=tiles), recording() as plans:
        if fn == "varlen":
            out = maxsim_varlen(Q, D, offsets(Q_LENGTHS), offsets(D_LENGTHS), backward="lowmem")
        else:
            out = score_pairs_packed(Q, D, offsets(Q_LENGTHS), offsets(D_LENGTHS),
                                     torch.tensor(PAIRS[0]), torch.tensor(PAIRS[1]), backward="lowmem")
        out.sum().backward()
    backward = [(p, plan) for p, plan in plans if isinstance(plan, BackwardPlan)]
    assert [(p.layout, plan.kernel, plan.strategy, plan.tiles) for p, plan in backward] == [
        ("packed" if fn == "varlen" else "pairs", "triton", "lowmem", tiles)]
    # The document-owned grad_D's launch takes the plan's stages, not the tiles' two.
    assert [plan.dd_scan_stages for _, plan in backward] == [1]
    assert D.grad is not None and Q.grad is not None


def test_deterministic_mode_picks_lowmem_and_refuses_unified(device):
    Q, D = leaf(packed(Q_LENGTHS).to(device)), leaf(packed(D_LENGTHS).to(device))
    cu_q, cu_d = offsets(Q_LENGTHS).to(device), offsets(D_LENGTHS).to(device)
    torch.use_deterministic_algorithms(True)
    try:
        with settings.use_backend("triton"):
            maxsim_varlen(Q, D, cu_q, cu_d).sum().backward()
            with pytest.raises(RuntimeError, match="not deterministic"):
                maxsim_varlen(Q, D, cu_q, cu_d, backward="unified").sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)


def test_no_argmax_without_grad_and_only_needed_gradients(backend):
    Q, D = leaf(packed(Q_LENGTHS)), packed(D_LENGTHS)
    args = (offsets(Q_LENGTHS), offsets(D_LENGTHS))
    with recording() as plans:
        with torch.no_grad():
            maxsim_varlen(Q, D, *args)
        with torch.inference_mode():
            maxsim_varlen(Q, D, *args)
        maxsim_varlen(Q.detach(), D, *args)
        maxsim_varlen(Q, D, *args).sum().backward()
    forward = [p for p, plan in plans if isinstance(plan, ForwardPlan)]
    backward = [(p, plan) for p, plan in plans if isinstance(plan, BackwardPlan)]
    assert [p.save_argmax for p in forward] == [False, False, False, True]
    # One backward, of the call that saved the argmax, and only Q's gradient (D needs none).
    assert len(backward) == 1 and backward[0][0] == forward[-1]
    assert backward[0][1].kernel == ("torch" if backend == "torch" else "triton")
    assert Q.grad is not None and D.grad is None
    # The flags reach the backward: an unneeded gradient comes back empty, uncomputed.
    scores, argmax = torch.ops.fusedmaxsim.maxsim_packed_fwd(
        Q.detach(), D, *args, None, None, None, None, None, None, max(Q_LENGTHS), max(D_LENGTHS),
        0, -1, True, backend, "ieee", "auto")
    grad_q, grad_d = torch.ops.fusedmaxsim.maxsim_packed_bwd(
        torch.ones_like(scores), Q.detach(), D, argmax, *args, None, None, None, None,
        max(Q_LENGTHS), max(D_LENGTHS), 0, -1, True, False, "unified", backend, "ieee")
    assert grad_q.shape == Q.shape and grad_d.numel() == 0
    torch.testing.assert_close(grad_q, Q.grad)


def test_float64_runs_on_the_pytorch_path_and_passes_gradcheck():
    lq, ld = [2, 0, 1], [3, 1, 0, 2]
    Q = torch.randn(sum(lq), 4, dtype=torch.float64, requires_grad=True)
    D = torch.randn(sum(ld), 4, dtype=torch.float64, requires_grad=True)
    cu_q, cu_d = offsets(lq), offsets(ld)
    pq, pd = torch.tensor([0, 2, 0]), torch.tensor([0, 3, 0])
    with settings.use_backend("triton"):  # float64 still takes the exact PyTorch path
        assert maxsim_varlen(Q, D, cu_q, cu_d).dtype == torch.float64
    torch.autograd.gradcheck(lambda q, d: maxsim_varlen(q, d, cu_q, cu_d), (Q, D))
    torch.autograd.gradcheck(lambda q, d: maxsim_varlen(q, d, cu_q, cu_d, normalize=True), (Q, D))
    torch.autograd.gradcheck(lambda q, d: score_pairs_packed(q, d, cu_q, cu_d, pq, pd), (Q, D))


def test_registered_packed_ops_pass_opcheck():
    """The packed layouts' registered ops on the PyTorch path (the dense ones: test_blocked.py):
    schema, fake tensors, autograd registration and AOT dispatch, for a packed cross product
    (masked; normalized over a range of documents, the forward alone) and a pair list, each
    strategy, inference too, and the backward with each gradient alone."""
    fwd, bwd = torch.ops.fusedmaxsim.maxsim_packed_fwd, torch.ops.fusedmaxsim.maxsim_packed_bwd
    lq, ld = [3, 0, 4], [5, 1, 0, 6]
    Q = torch.randn(sum(lq), 16, requires_grad=True)
    D = torch.randn(sum(ld), 16, requires_grad=True)
    cu_q, cu_d = offsets(lq), offsets(ld)
    pair_q, pair_d = torch.tensor([0, 2, 2, 1, 0]), torch.tensor([3, 0, 3, 1, 3])
    q_mask, d_mask = torch.rand(sum(lq)) > 0.2, torch.rand(sum(ld)) > 0.2
    q_inv, d_inv = torch.rand(sum(lq)) + 0.5, torch.rand(sum(ld)) + 0.5
    max_q, max_d = max(lq), max(ld)
    # (pairs, masks, inverse norms, col_lo, col_hi, fp32_precision, strategy)
    cases = [
        (None, (q_mask, d_mask), (None, None), 0, -1, "tf32", "auto"),
        (None, (None, None), (q_inv, d_inv), 1, 3, "ieee", "lowmem"),
        ((pair_q, pair_d), (q_mask, d_mask), (None, None), 0, -1, "tf32", "unified"),
        ((pair_q, pair_d), (None, None), (q_inv, d_inv), 0, -1, "ieee", "lowmem"),
    ]
    for pairs, masks, norms, col_lo, col_hi, precision, strategy in cases:
        index = pairs or (None, None)
        # Inference (no argmax saved) on inputs that need no gradient: a backward would refuse.
        # A range of documents without autograd: its backward is
        # test_packed_backward_refuses_a_column_range's.
        whole = (col_lo, col_hi) == (0, -1)
        for q, d, save_argmax in ((Q if whole else Q.detach(), D if whole else D.detach(), True),
                                  (Q.detach(), D.detach(), False)):
            torch.library.opcheck(fwd, (q, d, cu_q, cu_d, *index, *masks, *norms, max_q, max_d,
                                        col_lo, col_hi, save_argmax, "torch", precision, strategy))
        scores, argmax = fwd(Q, D, cu_q, cu_d, *index, *masks, *norms, max_q, max_d, col_lo,
                             col_hi, True, "torch", precision, strategy)
        assert scores.shape == ((pair_q.numel(),) if pairs else (len(lq), (col_hi % 5) - col_lo))
        if not whole:
            col_lo, col_hi = 0, -1
            scores, argmax = fwd(Q, D, cu_q, cu_d, *index, *masks, *norms, max_q, max_d, 0, -1,
                                 True, "torch", precision, strategy)
        grad = torch.randn_like(scores)
        for need_q, need_d in ((True, True), (True, False), (False, True)):
            torch.library.opcheck(bwd, (grad, Q.detach(), D.detach(), argmax.detach(), cu_q, cu_d,
                                        *index, *norms, max_q, max_d, col_lo, col_hi, need_q,
                                        need_d, strategy, "torch", precision))


@pytest.mark.parametrize("strategy", ["unified", "lowmem"])
def test_packed_backward_refuses_a_column_range(backend, strategy):
    """The registered packed forward scores a range of documents ``[1, 3)`` as the whole cross
    product's columns (inference, as retrieve's chunks); the backward covers every document of
    its layout, so it refuses a range with a clear error instead of returning wrong gradients."""
    fwd, bwd = torch.ops.fusedmaxsim.maxsim_packed_fwd, torch.ops.fusedmaxsim.maxsim_packed_bwd
    lq, ld = [3, 0, 4], [5, 1, 0, 6]
    Q, D = torch.randn(sum(lq), 16), torch.randn(sum(ld), 16)
    cu_q, cu_d = offsets(lq), offsets(ld)
    common = (cu_q, cu_d, None, None)
    part, part_argmax = fwd(Q, D, *common, None, None, None, None, 4, 6, 1, 3, True, backend,
                            "ieee", strategy)
    whole, _ = fwd(Q, D, *common, None, None, None, None, 4, 6, 0, -1, True, backend, "ieee",
                   strategy)
    torch.testing.assert_close(part, whole[:, 1:3])
    with pytest.raises(ValueError, match=r"column range \(col_lo=1, col_hi=3\) is scored for "
                                         r"inference only"):
        bwd(torch.randn_like(part), Q, D, part_argmax, *common, None, None, 4, 6, 1, 3, True,
            True, strategy, backend, "ieee")


def _cpu_compiler_missing() -> bool:
    return not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++"))


@pytest.mark.skipif(_cpu_compiler_missing(),
                    reason="torch.compile's CPU backend (Inductor) needs a C++ compiler, none found")
def test_torch_compile_fullgraph_varlen_training_step():
    """``maxsim_varlen`` and its backward under ``torch.compile(fullgraph=True)`` on the PyTorch
    path (the registered packed ops traced with their fake tensors): the eager step's scores
    and gradients. The maxima are given and the checks off: nothing reads the offsets' values
    on the host while tracing."""
    torch._dynamo.reset()
    Q, D = packed(Q_LENGTHS), packed(D_LENGTHS)
    cu_q, cu_d = offsets(Q_LENGTHS), offsets(D_LENGTHS)
    q_mask, d_mask = masks()
    grad = torch.randn(len(Q_LENGTHS), len(D_LENGTHS))

    def step(q, d):
        scores = maxsim_varlen(q, d, cu_q, cu_d, max(Q_LENGTHS), max(D_LENGTHS), q_mask=q_mask,
                               d_mask=d_mask, normalize=True, validate=False)
        return scores * 2.0

    results = []
    with settings.use_backend("torch"):
        for fn in (torch.compile(step, fullgraph=True), step):
            q, d = leaf(Q), leaf(D)
            out = fn(q, d)
            out.backward(grad)
            results.append((out.detach(), q.grad, d.grad))
    for compiled, eager in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Every bad input gets a clear error naming the argument, before anything runs.
# ---------------------------------------------------------------------------------------------

QE, DE = torch.randn(5, 8), torch.randn(7, 8)
CQ, CD = torch.tensor([0, 2, 5]), torch.tensor([0, 3, 7])
PQ, PD = torch.tensor([0, 1]), torch.tensor([1, 0])


def varlen(**kw):
    args = {"Q_packed": QE, "D_packed": DE, "cu_seqlens_q": CQ, "cu_seqlens_d": CD, **kw}
    return lambda: maxsim_varlen(**args)


def pairs(**kw):
    args = {"Q_packed": QE, "D_packed": DE, "cu_seqlens_q": CQ, "cu_seqlens_d": CD,
            "pair_q_idx": PQ, "pair_d_idx": PD, **kw}
    return lambda: score_pairs_packed(**args)


@pytest.mark.parametrize(
    "call,error,pattern",
    [
        (varlen(cu_seqlens_q=torch.tensor([[0, 2, 5]])), ValueError, r"cu_seqlens_q must be 1-D"),
        (varlen(cu_seqlens_q=torch.tensor([], dtype=torch.int64)), ValueError, r"cu_seqlens_q must hold N \+ 1 offsets"),
        (varlen(cu_seqlens_q=torch.tensor([0.0, 2.0, 5.0])), TypeError, r"cu_seqlens_q must be an integer tensor"),
        (varlen(cu_seqlens_q=[0, 2, 5]), TypeError, r"cu_seqlens_q must be a torch.Tensor"),
        (varlen(cu_seqlens_q=torch.tensor([1, 2, 5])), ValueError, r"cu_seqlens_q must start at 0, got cu_seqlens_q\[0\] = 1"),
        (varlen(cu_seqlens_d=torch.tensor([0, 4, 3, 7])), ValueError, r"cu_seqlens_d must be non-decreasing.*-1"),
        (varlen(cu_seqlens_q=torch.tensor([0, 2, 4])), ValueError, r"cu_seqlens_q must end at .* Q_packed.shape\[0\] = 5; got cu_seqlens_q\[-1\] = 4"),
        (varlen(cu_seqlens_d=torch.tensor([0, 3, 9])), ValueError, r"cu_seqlens_d must end at .* D_packed.shape\[0\] = 7"),
        (varlen(max_seqlen_q=2), ValueError, r"max_seqlen_q=2 is below the longest sequence in cu_seqlens_q \(3 tokens\)"),
        (varlen(max_seqlen_d=3), ValueError, r"max_seqlen_d=3 is below the longest sequence in cu_seqlens_d \(4 tokens\)"),
        (varlen(max_seqlen_q=-1), ValueError, r"max_seqlen_q must be >= 0"),
        (varlen(max_seqlen_q=2.5), TypeError, r"max_seqlen_q must be an int or None"),
        (varlen(cu_seqlens_q=CQ.to("meta")), ValueError, r"cu_seqlens_q is on meta but the tokens are on cpu"),
        (varlen(D_packed=DE.to("meta")), ValueError, r"Q_packed is on cpu but D_packed is on meta"),
        (varlen(D_packed=torch.randn(7, 9)), ValueError, r"share the embedding dim d.*\(5, 8\).*\(7, 9\)"),
        (varlen(Q_packed=QE.reshape(1, 5, 8)), ValueError, r"Q_packed must be 2-D \[ΣLq, d\].*maxsim_padded"),
        (varlen(Q_packed=QE.int()), TypeError, r"Q_packed must be float16, bfloat16, float32 or float64"),
        (varlen(q_mask=torch.ones(4, dtype=torch.bool)), ValueError, r"q_mask must have shape \(5,\)"),
        (varlen(d_mask=torch.ones(7, dtype=torch.bool).to("meta")), ValueError, r"d_mask is on meta"),
        (varlen(backward="csr"), ValueError, r"backward= must be one of"),
        (varlen(validate="yes"), TypeError, r"validate must be True, False or None"),
        (pairs(pair_q_idx=torch.tensor([0, 2])), ValueError, r"pair_q_idx must index the 2 sequences of cu_seqlens_q .* got indices in \[0, 2\]"),
        (pairs(pair_d_idx=torch.tensor([-1, 0])), ValueError, r"pair_d_idx must index the 2 sequences of cu_seqlens_d .* \[-1, 0\]"),
        (pairs(pair_d_idx=torch.tensor([0, 1, 1])), ValueError, r"pair_q_idx and pair_d_idx must have the same length"),
        (pairs(pair_q_idx=torch.tensor([[0, 1]])), ValueError, r"pair_q_idx must be 1-D"),
        (pairs(pair_d_idx=torch.tensor([0.0, 1.0])), TypeError, r"pair_d_idx must be an integer tensor"),
        (pairs(pair_q_idx=None), ValueError, r"pair_q_idx and pair_d_idx go together"),
    ],
)
def test_bad_input_is_refused_with_a_clear_message(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


@pytest.mark.parametrize(
    "call,error,pattern",
    [
        (lambda: maxsim_padded(torch.randn(2, 3, 8), torch.randn(2, 4, 8), torch.tensor([1, 2]), torch.ones(2, 4)),
         ValueError, r"documents must be \[B, C, Ld, d\]"),
        (lambda: maxsim_padded(torch.randn(2, 3, 8), torch.randn(3, 1, 4, 8), torch.tensor([1, 2]), torch.ones(3, 1)),
         ValueError, r"share the batch size B"),
        (lambda: maxsim_padded(torch.randn(2, 3, 8), torch.randn(2, 1, 4, 8), torch.tensor([1, 2, 3]), torch.ones(2, 1, dtype=torch.int64)),
         ValueError, r"query_lengths must have shape \(2,\), got \(3,\)"),
        (lambda: maxsim_padded(torch.randn(2, 3, 8), torch.randn(2, 1, 4, 8), torch.tensor([1, 4]), torch.ones(2, 1, dtype=torch.int64)),
         ValueError, r"query_lengths must lie in \[0, 3\] .* \[1, 4\]"),
        (lambda: maxsim_padded(torch.randn(2, 3, 8), torch.randn(2, 1, 4, 8), torch.tensor([1, 2]), torch.ones(2, 1)),
         TypeError, r"doc_lengths must be an integer tensor"),
        (lambda: pack_padded(torch.randn(2, 3, 8), torch.randn(2, 1, 4, 8), torch.tensor([1, 2]), torch.tensor([[5], [1]])),
         ValueError, r"doc_lengths must lie in \[0, 4\]"),
        (lambda: maxsim_ragged(torch.randn(3, 8), [torch.randn(2, 8)]), ValueError, r"queries must be a list of \[L, d\] tensors"),
        (lambda: maxsim_ragged("abc", [torch.randn(2, 8)]), TypeError, r"queries must be a list or tuple"),
        (lambda: maxsim_ragged([torch.randn(2, 8)], [torch.randn(2, 9)]), ValueError, r"embedding dim d = 8; documents\[0\]"),
        (lambda: maxsim_ragged([torch.randn(2, 8, 1)], [torch.randn(2, 8)]), ValueError, r"queries\[0\] must be 2-D"),
    ],
)
def test_bad_padded_and_list_input_is_refused(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_unchecked_padded_lengths_out_of_range_score_nan(backend):
    queries, documents = torch.randn(2, 3, 8), torch.randn(2, 2, 4, 8)
    out = maxsim_padded(queries, documents, torch.tensor([3, 5]), torch.tensor([[4, -1], [2, 2]]), validate=False)
    assert not torch.isnan(out[0, 0]) and torch.isnan(out[0, 1]) and torch.isnan(out[1]).all()
