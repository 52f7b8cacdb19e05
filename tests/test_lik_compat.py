"""Calls written for late-interaction-kernels (LIK) 0.4.5, run against fusedmaxsim.

Each case is one call as a LIK user writes it, against a module ``m``. With ``m = fusedmaxsim``
the result is checked against LIK's documented semantics, computed here by a float64 einsum
(these checks always run). Where LIK is installed (``pip install "fusedmaxsim[bench]"``), the same
call also runs with ``m = late_interaction_kernels`` where LIK has a CPU path (``MaxSimScorer``,
``retrieve``, ``maxsim_padded``), and the calls LIK runs only through Triton on CUDA (``maxsim``,
``maxsim_pairs``, ``maxsim_varlen``) are compared with LIK's own CPU reference instead.

The one default that differs, ``normalize`` of ``retrieve`` and ``MaxSimScorer`` (LIK: True,
fusedmaxsim: False), is passed explicitly in every case; ``test_retrieval.py`` checks its
warning. ``docs/migrating-from-lik.md`` lists every name, keyword and default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import fusedmaxsim

try:
    import late_interaction_kernels as lik
except ImportError:  # the comparisons with LIK itself are skipped, with this reason
    lik = None

NO_LIK = (
    "late-interaction-kernels is not installed (it comes with fusedmaxsim[bench]); the checks of "
    "its documented semantics ran without it"
)

NQ, ND, K, LQ, LD, DIM = 3, 5, 4, 6, 9, 16


def oracle(Q, D, q_mask=None, d_mask=None, normalize=False) -> torch.Tensor:
    """LIK's documented MaxSim in float64: masked document tokens are -inf before the max, a
    query token with no valid document token adds 0, masked query tokens add 0; 2-D inputs
    squeezed. ``D`` is ``[Nd, Ld, d]`` (every query against every document) or ``[Nq, K, Ld, d]``
    (each query against its own K candidates)."""
    squeeze_q, squeeze_d = Q.dim() == 2, D.dim() == 2
    Q = Q.double().unsqueeze(0) if squeeze_q else Q.double()
    D = D.double().unsqueeze(0) if squeeze_d else D.double()
    if q_mask is not None and q_mask.dim() == 1:
        q_mask = q_mask.unsqueeze(0)
    if d_mask is not None and d_mask.dim() == D.dim() - 2:
        d_mask = d_mask.unsqueeze(0)
    if normalize:
        Q, D = F.normalize(Q, dim=-1), F.normalize(D, dim=-1)
    if D.dim() == 4:
        sim = torch.einsum("ild,iktd->iklt", Q, D)  # [Nq, K, Lq, Ld]
        valid_d = None if d_mask is None else (d_mask != 0)[:, :, None, :]
    else:
        sim = torch.einsum("ild,jtd->ijlt", Q, D)  # [Nq, Nd, Lq, Ld]
        valid_d = None if d_mask is None else (d_mask != 0)[None, :, None, :]
    if valid_d is not None:
        sim = sim.masked_fill(~valid_d, float("-inf"))
    best = sim.amax(dim=-1)
    best = torch.where(torch.isneginf(best), torch.zeros_like(best), best)
    if q_mask is not None:
        best = best * (q_mask != 0).double()[:, None, :]
    scores = best.sum(dim=-1)
    if squeeze_d:
        scores = scores.squeeze(1)
    if squeeze_q:
        scores = scores.squeeze(0)
    return scores


def top(scores: torch.Tensor, k: int, largest: bool = True):
    return torch.topk(scores, min(k, scores.shape[-1]), dim=-1, largest=largest)


@dataclasses.dataclass
class Data:
    Q: torch.Tensor
    D: torch.Tensor
    DK: torch.Tensor  # per-query candidates [Nq, K, Ld, d]
    q_mask: torch.Tensor
    d_mask: torch.Tensor
    dk_mask: torch.Tensor
    q_ids: torch.Tensor
    d_ids: torch.Tensor


def make_data() -> Data:
    g = torch.Generator().manual_seed(7)
    Q = torch.randn(NQ, LQ, DIM, generator=g)
    # Documents of different norms, so that normalize changes the ranking.
    D = torch.randn(ND, LD, DIM, generator=g) * torch.linspace(0.5, 3.0, ND)[:, None, None]
    DK = torch.randn(NQ, K, LD, DIM, generator=g)
    q_mask = torch.rand(NQ, LQ, generator=g) > 0.3
    q_mask[:, 0] = True
    d_mask = torch.rand(ND, LD, generator=g) > 0.3
    d_mask[:, 0] = True
    d_mask[1] = False  # a fully masked document scores exactly 0
    dk_mask = torch.rand(NQ, K, LD, generator=g) > 0.3
    dk_mask[..., 0] = True
    pad = 0
    q_ids = torch.where(q_mask, torch.randint(1, 100, (NQ, LQ), generator=g), pad)
    d_ids = torch.where(d_mask, torch.randint(1, 100, (ND, LD), generator=g), pad)
    return Data(Q, D, DK, q_mask, d_mask, dk_mask, q_ids, d_ids)


def packed(x: torch.Tensor, lengths: list[int]):
    """``x [N, L, d]`` packed to its first ``lengths[i]`` tokens each, with int64 offsets."""
    rows = torch.cat([x[i, :n] for i, n in enumerate(lengths)])
    return rows, torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


Q_LENGTHS, D_LENGTHS = [6, 2, 4], [9, 1, 0, 5, 7]


def varlen_call(m, x: Data):
    """The packed call of LIK's signature: tokens, offsets, then the maxima positionally."""
    Qp, cu_q = packed(x.Q, Q_LENGTHS)
    Dp, cu_d = packed(x.D, D_LENGTHS)
    return m.maxsim_varlen(Qp, Dp, cu_q, cu_d, max(Q_LENGTHS), max(D_LENGTHS))


def varlen_lik_reference(m, x: Data):
    Qp, cu_q = packed(x.Q, Q_LENGTHS)
    Dp, cu_d = packed(x.D, D_LENGTHS)
    return m.reference.maxsim_reference_varlen(Qp, Dp, cu_q, cu_d)


def padded_lengths(positive: bool = False):
    """``query_lengths [B]`` and ``doc_lengths [B, C]``; with an empty candidate unless
    ``positive`` (LIK's ``validate=True`` refuses empty sequences)."""
    dlen = torch.tensor([[9, 1, 4, 2], [0, 9, 3, 7], [5, 5, 9, 1]])
    return torch.tensor([6, 3, 1]), dlen.clamp_min(1) if positive else dlen


def padded_masks(positive: bool = False):
    qlen, dlen = padded_lengths(positive)
    return torch.arange(LQ) < qlen[:, None], torch.arange(LD) < dlen[..., None]


def _packed_batch(m, x: Data):
    """LIK's ``pack_padded`` (from its ``padded`` module; fusedmaxsim has it at the top level)
    unpacked as a tuple: the tokens and offsets of ``maxsim_varlen``."""
    pack = m.pack_padded if m is fusedmaxsim else m.padded.pack_padded
    batch = pack(x.Q, x.DK, *padded_lengths(positive=True), validate=True)
    Qp, cu_q, Dp, cu_d, _pair_q, _pair_d, max_q, max_d = batch
    return Qp, Dp, cu_q, cu_d, max_q, max_d


@dataclasses.dataclass
class Case:
    name: str
    call: Callable  # (module, Data) -> Tensor or (scores, indices)
    expected: Callable  # Data -> the float64 result of LIK's documented semantics
    lik: str  # "cpu": LIK runs the call on CPU; else the LIK function, which needs CUDA
    lik_reference: Callable | None = None  # (lik, Data) -> LIK's CPU reference of that call
    unordered: bool = False  # LIK leaves the order of the top-k unspecified (sorted=False)


CASES = [
    Case("maxsim cross product", lambda m, x: m.maxsim(x.Q, x.D),
         lambda x: oracle(x.Q, x.D), "maxsim",
         lambda m, x: m.reference.maxsim_reference(x.Q, x.D)),
    Case("maxsim masks", lambda m, x: m.maxsim(x.Q, x.D, q_mask=x.q_mask, d_mask=x.d_mask),
         lambda x: oracle(x.Q, x.D, x.q_mask, x.d_mask), "maxsim",
         lambda m, x: m.reference.maxsim_reference(x.Q, x.D, x.q_mask, x.d_mask)),
    Case("maxsim integer masks (nonzero = valid)",
         lambda m, x: m.maxsim(x.Q, x.D, x.q_mask.int(), x.d_mask.to(torch.uint8)),
         lambda x: oracle(x.Q, x.D, x.q_mask, x.d_mask), "maxsim",
         lambda m, x: m.reference.maxsim_reference(x.Q, x.D, x.q_mask, x.d_mask)),
    Case("maxsim normalize=True",
         lambda m, x: m.maxsim(x.Q, x.D, x.q_mask, x.d_mask, normalize=True),
         lambda x: oracle(x.Q, x.D, x.q_mask, x.d_mask, normalize=True), "maxsim",
         lambda m, x: m.reference.maxsim_reference(x.Q, x.D, x.q_mask, x.d_mask, normalize=True)),
    Case("maxsim one query [Lq, d]", lambda m, x: m.maxsim(x.Q[0], x.D, q_mask=x.q_mask[0]),
         lambda x: oracle(x.Q[0], x.D, x.q_mask[0]), "maxsim",
         lambda m, x: m.reference.maxsim_reference(x.Q[0], x.D, x.q_mask[0])),
    Case("maxsim one document [Ld, d]", lambda m, x: m.maxsim(x.Q, x.D[0], d_mask=x.d_mask[0]),
         lambda x: oracle(x.Q, x.D[0], None, x.d_mask[0]), "maxsim",
         lambda m, x: m.reference.maxsim_reference(x.Q, x.D[0], None, x.d_mask[0])),
    Case("maxsim both 2-D: a scalar",
         lambda m, x: m.maxsim(x.Q[1], x.D[2], x.q_mask[1], x.d_mask[2], backward="unified"),
         lambda x: oracle(x.Q[1], x.D[2], x.q_mask[1], x.d_mask[2]), "maxsim",
         lambda m, x: m.reference.maxsim_reference(x.Q[1], x.D[2], x.q_mask[1], x.d_mask[2])),
    Case("maxsim candidates [Nq, K, Ld, d]",
         lambda m, x: m.maxsim(x.Q, x.DK, q_mask=x.q_mask, d_mask=x.dk_mask, backward="lowmem"),
         lambda x: oracle(x.Q, x.DK, x.q_mask, x.dk_mask), "maxsim",
         lambda m, x: torch.stack([m.reference.maxsim_reference(
             x.Q[i], x.DK[i], x.q_mask[i], x.dk_mask[i]) for i in range(NQ)])),
    Case("maxsim_pairs", lambda m, x: m.maxsim_pairs(
             x.Q, x.D[:NQ], x.q_mask, x.d_mask[:NQ], normalize=True, backward=None),
         lambda x: oracle(x.Q, x.D[:NQ], x.q_mask, x.d_mask[:NQ], normalize=True).diagonal(),
         "maxsim_pairs",
         lambda m, x: m.reference.maxsim_reference(
             x.Q, x.D[:NQ], x.q_mask, x.d_mask[:NQ], normalize=True).diagonal()),
    Case("maxsim_varlen, int64 offsets, maxima given", varlen_call,
         lambda x: oracle(x.Q, x.D, torch.arange(LQ) < torch.tensor(Q_LENGTHS)[:, None],
                          torch.arange(LD) < torch.tensor(D_LENGTHS)[:, None]),
         "maxsim_varlen", varlen_lik_reference),
    Case("maxsim_padded", lambda m, x: m.maxsim_padded(x.Q, x.DK, *padded_lengths()),
         lambda x: oracle(x.Q, x.DK, *padded_masks()), "cpu"),
    Case("maxsim_padded validate=True",
         lambda m, x: m.maxsim_padded(x.Q, x.DK, *padded_lengths(positive=True), validate=True),
         lambda x: oracle(x.Q, x.DK, *padded_masks(positive=True)), "cpu"),
    Case("pack_padded validate=True, then maxsim_varlen",
         lambda m, x: m.maxsim_varlen(*_packed_batch(m, x)),
         lambda x: oracle(x.Q, x.DK.flatten(0, 1), padded_masks(True)[0],
                          padded_masks(True)[1].flatten(0, 1)), "maxsim_varlen",
         lambda m, x: m.reference.maxsim_reference_varlen(*_packed_batch(m, x)[:4])),
    Case("MaxSimScorer forward", lambda m, x: m.MaxSimScorer(normalize=True, backward="unified")(
             x.Q, x.D, q_mask=x.q_mask, d_mask=x.d_mask),
         lambda x: oracle(x.Q, x.D, x.q_mask, x.d_mask, normalize=True), "cpu"),
    Case("MaxSimScorer score", lambda m, x: m.MaxSimScorer(normalize=False).score(x.Q, x.D),
         lambda x: oracle(x.Q, x.D), "cpu"),
    Case("MaxSimScorer forward_with_ids",
         lambda m, x: m.MaxSimScorer(normalize=True, mask_pad_token=0).forward_with_ids(
             x.Q, x.D, x.q_ids, x.d_ids),
         lambda x: oracle(x.Q, x.D, x.q_mask, x.d_mask, normalize=True), "cpu"),
    Case("MaxSimScorer retrieve", lambda m, x: m.MaxSimScorer(normalize=True).retrieve(
             x.Q, x.D, 3, x.q_mask, x.d_mask, chunk=2),
         lambda x: top(oracle(x.Q, x.D, x.q_mask, x.d_mask, normalize=True), 3), "cpu"),
    Case("retrieve", lambda m, x: m.retrieve(x.Q, x.D, top_k=4, normalize=True),
         lambda x: top(oracle(x.Q, x.D, normalize=True), 4), "cpu"),
    Case("retrieve chunked, masks", lambda m, x: m.retrieve(
             x.Q, x.D, 3, x.q_mask, x.d_mask, normalize=False, chunk=2),
         lambda x: top(oracle(x.Q, x.D, x.q_mask, x.d_mask), 3), "cpu"),
    Case("retrieve largest=False", lambda m, x: m.retrieve(
             x.Q, x.D, 3, normalize=True, chunk=2, largest=False, sorted=True),
         lambda x: top(oracle(x.Q, x.D, normalize=True), 3, largest=False), "cpu"),
    Case("retrieve sorted=False (sorted anyway)", lambda m, x: m.retrieve(
             x.Q, x.D, 3, normalize=True, sorted=False),
         lambda x: top(oracle(x.Q, x.D, normalize=True), 3), "cpu", unordered=True),
    Case("retrieve top_k beyond the corpus", lambda m, x: m.retrieve(
             x.Q, x.D, 100, normalize=True),
         lambda x: top(oracle(x.Q, x.D, normalize=True), 100), "cpu"),
    Case("retrieve one query [Lq, d]", lambda m, x: m.retrieve(
             x.Q[0], x.D, 2, q_mask=x.q_mask[0], normalize=True),
         lambda x: top(oracle(x.Q[0], x.D, x.q_mask[0], normalize=True), 2), "cpu"),
]


def _assert_same(got, expected, rtol=1e-5, atol=1e-5):
    """Scores within fp32 rounding of the float64 value; ``(scores, indices)`` pairs with the
    indices equal."""
    if isinstance(expected, tuple):
        got_scores, got_indices = got
        want_scores, want_indices = expected
        assert got_indices.dtype == torch.int64
        assert torch.equal(got_indices, want_indices)
        got, expected = got_scores, want_scores
    assert got.dtype == torch.float32
    assert got.shape == expected.shape
    torch.testing.assert_close(got.double(), expected.double(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_lik_call_has_lik_semantics_in_fusedmaxsim(backend, case):
    x = make_data()
    _assert_same(case.call(fusedmaxsim, x), case.expected(x))


def test_fully_masked_documents_and_queries_score_exactly_zero(backend):
    x = make_data()
    q_mask = x.q_mask.clone()
    q_mask[2] = False
    scores = fusedmaxsim.maxsim(x.Q, x.D, q_mask, x.d_mask, normalize=True)
    assert torch.equal(scores[:, 1], torch.zeros(NQ)) and torch.equal(scores[2], torch.zeros(ND))


def test_outputs_are_float32_for_every_16_and_32_bit_input(backend):
    x = make_data()
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert fusedmaxsim.maxsim(x.Q.to(dtype), x.D.to(dtype)).dtype == torch.float32


@pytest.mark.skipif(lik is None, reason=NO_LIK)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_lik_call_gives_lik_result(case):
    x = make_data()
    ours = case.call(fusedmaxsim, x)
    if case.lik == "cpu":
        theirs = case.call(lik, x)
        if case.unordered:  # LIK's order is unspecified: compare its results sorted
            order = theirs[0].argsort(dim=-1, descending=True)
            theirs = theirs[0].gather(-1, order), theirs[1].gather(-1, order)
        _assert_same(ours, theirs)
        return
    # LIK runs this call only through Triton on CUDA tensors: its CPU reference instead.
    theirs = case.lik_reference(lik, x)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Errors: LIK users' tests match these phrases of LIK's messages
# ---------------------------------------------------------------------------------------------

Q3, D3, DK4 = torch.randn(3, 16, 32), torch.randn(5, 24, 32), torch.randn(3, 4, 24, 32)

# (name, call(m), LIK's phrase, whether LIK itself raises it on CPU)
ERRORS = [
    ("candidates with a 2-D Q", lambda m: m.maxsim(Q3[0], DK4), "needs Q to be", True),
    ("candidates with another Nq", lambda m: m.maxsim(Q3, torch.randn(5, 4, 24, 32)),
     r"D.shape\[0\] == Q.shape\[0\]", True),
    ("candidates with a bad q_mask", lambda m: m.maxsim(Q3, DK4, q_mask=torch.ones(3, 17, dtype=torch.bool)),
     "q_mask must be", True),
    ("candidates with a bad d_mask", lambda m: m.maxsim(Q3, DK4, d_mask=torch.ones(3, 4, 23, dtype=torch.bool)),
     "d_mask must be", True),
    ("cross product with a bad q_mask", lambda m: m.maxsim(Q3, D3, q_mask=torch.ones(3, 17)),
     "q_mask must be", False),  # LIK does not check mask shapes on the cross product
    ("maxsim_pairs batch mismatch", lambda m: m.maxsim_pairs(Q3, D3), r"Q.shape\[0\] == D.shape\[0\]", True),
    ("maxsim_pairs 2-D D", lambda m: m.maxsim_pairs(Q3, D3[0]), r"\[B, L, d\]", True),
    ("maxsim_pairs 4-D D", lambda m: m.maxsim_pairs(Q3, DK4), r"\[B, L, d\]", True),
    ("embedding dims", lambda m: m.maxsim(Q3, torch.randn(3, 4, 24, 16)), "must share the embedding dim", True),
    ("maxsim_varlen 3-D tokens", lambda m: m.maxsim_varlen(Q3, D3, torch.tensor([0, 16]), torch.tensor([0, 24])),
     "Q_packed must be 2-D", True),
    ("invalid backward", lambda m: m.MaxSimScorer(normalize=True, backward="nope"), "backward", True),
    ("retrieve top_k=0", lambda m: m.retrieve(Q3, D3, top_k=0, normalize=True), "top_k", True),
    ("retrieve on two devices", lambda m: m.retrieve(Q3, D3.to("meta"), top_k=1, normalize=True),
     "same device", True),
    ("forward_with_ids without mask_pad_token", lambda m: m.MaxSimScorer(normalize=True).forward_with_ids(
        Q3, D3, torch.zeros(3, 16, dtype=torch.long), torch.zeros(5, 24, dtype=torch.long)),
     "mask_pad_token", True),
]


@pytest.mark.parametrize("call,phrase", [(c, p) for _, c, p, _ in ERRORS], ids=[n for n, *_ in ERRORS])
def test_errors_contain_the_phrase_of_lik_messages(call, phrase):
    with pytest.raises(ValueError, match=phrase):
        call(fusedmaxsim)


@pytest.mark.skipif(lik is None, reason=NO_LIK)
@pytest.mark.parametrize("call,phrase,raises", [(c, p, r) for _, c, p, r in ERRORS],
                         ids=[n for n, *_ in ERRORS])
def test_lik_itself_raises_those_phrases(call, phrase, raises):
    if not raises:
        pytest.skip("late-interaction-kernels does not check mask shapes on the cross product")
    with pytest.raises(ValueError, match=phrase):
        call(lik)


def test_lik_keywords_are_accepted():
    """Every keyword of LIK's signatures of the functions both libraries share."""
    import inspect

    ours = {
        "maxsim": ["q_mask", "d_mask", "normalize", "backward"],
        "maxsim_pairs": ["q_mask", "d_mask", "normalize", "backward"],
        "maxsim_varlen": ["max_seqlen_q", "max_seqlen_d"],
        "maxsim_padded": ["validate"],
        "pack_padded": ["validate"],
        "score_pairs_packed": ["max_seqlen_q", "max_seqlen_d"],
        "retrieve": ["q_mask", "d_mask", "normalize", "chunk", "largest", "sorted"],
    }
    for name, keywords in ours.items():
        params = inspect.signature(getattr(fusedmaxsim, name)).parameters
        assert set(keywords) <= set(params), (name, set(keywords) - set(params))
    scorer = inspect.signature(fusedmaxsim.MaxSimScorer).parameters
    assert {"normalize", "backward", "mask_pad_token"} <= set(scorer)
    for method in ("forward", "score", "retrieve", "forward_with_ids", "extra_repr"):
        assert callable(getattr(fusedmaxsim.MaxSimScorer, method))
    assert fusedmaxsim.PackedBatch._fields == (
        "Q_packed", "cu_seqlens_q", "D_packed", "cu_seqlens_d", "pair_q_idx", "pair_d_idx",
        "max_seqlen_q", "max_seqlen_d",
    )
