"""PyLate parity: every adapter returns what PyLate's torch path returns, losses and gradients too.

The data is built to hit what PyLate's training actually feeds the scorers: bool and float 0/1
masks, document masks with holes in the middle (the punctuation skiplist), padding on the right
and on the left, strided views, and query tokens whose every valid similarity is negative (the
one case where multiply-by-mask and exclusion disagree).
"""

from __future__ import annotations

import doctest
import functools
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from _hosts import CallCounter

from fusedmaxsim.integrations import pylate as fp
from fusedmaxsim.reference import maxsim_ref
from fusedmaxsim.testing import relative_error

pytest.importorskip("pylate.scores")
losses = pytest.importorskip("pylate.losses")
import pylate.scores
from pylate.scores import colbert as host

pytestmark = pytest.mark.integrations

TOL = 1e-5
HOST_FUNCTIONS = {name: getattr(host, name) for name in fp._FUNCTIONS}
HOST_CALL = host.ColBERTScores.__call__


def unit(*shape, dtype=torch.float32):
    return F.normalize(torch.randn(*shape, dtype=torch.float64), dim=-1).to(dtype)


def holes(*shape, p=0.3):
    """A bool mask with random holes, right padding on odd rows and left padding on even rows."""
    mask = torch.rand(*shape) > p
    rows = mask.view(-1, shape[-1])
    for row in range(rows.shape[0]):
        pad = row % 3 + 1
        if row % 2:
            rows[row, -pad:] = False
        else:
            rows[row, :pad] = False
    return mask


def host_torch(name, *args, **kwargs):
    return HOST_FUNCTIONS[name](*args, backend="torch", **kwargs)


def assert_same(out, ref, tol=TOL):
    assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
    assert out.shape == ref.shape
    assert relative_error(out, ref) <= tol, relative_error(out, ref)


def negative_case_hits(Q, D, q_mask, d_mask):
    """How many (query token, document) pairs have every valid similarity < 0 and a masked token."""
    sim = torch.einsum("ash,bth->abst", Q.double(), D.double())
    valid = d_mask.bool()[None, :, None, :]
    best = sim.masked_fill(~valid, float("-inf")).amax(-1)
    hit = (best < 0) & (best > float("-inf")) & (~d_mask.bool()).any(-1)[None, :, None]
    if q_mask is not None:
        hit &= q_mask.bool()[:, None, :]
    return int(hit.sum())


# --------------------------------------------------------------------------------------------
# Scoring functions
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_colbert_scores_matches_pylate_with_holes_and_padding(mask_dtype):
    Q, D = unit(5, 7, 16), unit(6, 11, 16)
    q_mask, d_mask = holes(5, 7).to(mask_dtype), holes(6, 11).to(mask_dtype)
    assert negative_case_hits(Q, D, q_mask, d_mask) > 0
    assert_same(
        fp.colbert_scores(Q, D, q_mask, d_mask), host_torch("colbert_scores", Q, D, q_mask, d_mask)
    )
    assert_same(
        fp.colbert_scores(Q, D, None, d_mask), host_torch("colbert_scores", Q, D, None, d_mask)
    )
    assert_same(
        fp.colbert_scores(Q, D, q_mask, None), host_torch("colbert_scores", Q, D, q_mask, None)
    )
    assert_same(fp.colbert_scores(Q, D), host_torch("colbert_scores", Q, D))


def test_colbert_scores_strided_views():
    big_q, big_d = unit(5, 14, 32), unit(11, 6, 16).transpose(0, 1)  # D: [6, 11, 16], strided
    Q = big_q[:, ::2, ::2]  # [5, 7, 16], not contiguous
    D = big_d
    d_mask = holes(11, 6).t()  # a transposed mask
    assert not Q.is_contiguous() and not D.is_contiguous() and not d_mask.is_contiguous()
    assert_same(
        fp.colbert_scores(Q, D, None, d_mask), host_torch("colbert_scores", Q, D, None, d_mask)
    )


def test_colbert_scores_gradients_match_pylate():
    Q, D = unit(4, 6, 16).requires_grad_(), unit(5, 9, 16).requires_grad_()
    q_mask, d_mask = holes(4, 6).float(), holes(5, 9)
    weights = torch.randn(4, 5)
    ours = torch.autograd.grad((fp.colbert_scores(Q, D, q_mask, d_mask) * weights).sum(), (Q, D))
    ref = torch.autograd.grad(
        (host_torch("colbert_scores", Q, D, q_mask, d_mask) * weights).sum(), (Q, D)
    )
    for a, b in zip(ours, ref):
        assert relative_error(a, b) <= TOL


def test_colbert_kd_scores_matches_pylate():
    Q = unit(4, 6, 16).requires_grad_()
    big = unit(4, 3, 18, 16)
    D = big[:, :, ::2].detach().requires_grad_()  # leaf, then a strided view of it below
    view = D.transpose(1, 2).transpose(1, 2)
    q_mask, d_mask = holes(4, 6).float(), holes(4, 3, 9).float()
    ours = fp.colbert_kd_scores(Q, view, q_mask, d_mask)
    ref = host_torch("colbert_kd_scores", Q, view, q_mask, d_mask)
    assert_same(ours, ref)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(ours, (Q, D), g), torch.autograd.grad(ref, (Q, D), g)):
        assert relative_error(a, b) <= TOL


def test_colbert_kd_scores_rejects_3d_documents():
    with pytest.raises(ValueError, match="4-D"):
        fp.colbert_kd_scores(unit(2, 3, 8), unit(2, 4, 8))


def test_pairwise_without_pairs_is_refused():
    with pytest.raises(ValueError, match=r"colbert_scores_pairwise needs at least one \(query, "
                                         r"document\) pair"):
        fp.colbert_scores_pairwise([], [unit(4, 8)])


def test_exclude_semantics_differs_exactly_where_documented():
    """host - exclude = Σ max(0, -best valid similarity) over tokens, for docs with a hole."""
    Q, D = unit(5, 7, 16, dtype=torch.float64), unit(6, 11, 16, dtype=torch.float64)
    d_mask = holes(6, 11)
    exclude = fp.colbert_scores(Q, D, None, d_mask, mask_semantics="exclude")
    assert_same(exclude, maxsim_ref(Q, D, None, d_mask), tol=1e-12)
    best = (
        torch.einsum("ash,bth->abst", Q, D)
        .masked_fill(~d_mask[None, :, None, :], float("-inf"))
        .amax(-1)
    )
    has_hole = (~d_mask).any(-1)[None, :, None]
    gap = torch.where(has_hole & (best < 0), -best, torch.zeros_like(best)).sum(-1)
    assert gap.sum() > 0
    torch.testing.assert_close(host_torch("colbert_scores", Q, D, None, d_mask) - exclude, gap)


@pytest.mark.parametrize(
    ("dtype", "mask_dtype", "expected"),
    [
        (torch.bfloat16, torch.bool, torch.bfloat16),
        (torch.float16, torch.bool, torch.float16),
        (torch.bfloat16, torch.float32, torch.float32),  # PyLate's float mask promotes
    ],
)
def test_half_precision_returns_the_host_dtype(dtype, mask_dtype, expected):
    Q, D = unit(3, 5, 16, dtype=dtype), unit(4, 6, 16, dtype=dtype)
    d_mask = holes(4, 6).to(mask_dtype)
    ours, ref = (
        fp.colbert_scores(Q, D, None, d_mask),
        host_torch("colbert_scores", Q, D, None, d_mask),
    )
    assert ours.dtype == ref.dtype == expected
    assert relative_error(ours, maxsim_ref(Q, D * d_mask[..., None].to(dtype))) <= 1e-2


def test_pairwise_padded_tensors_include_padding_like_pylate():
    Q, D = unit(4, 6, 16), unit(4, 9, 16)
    D[:, 6:] = 0.0  # zero padding takes part in the max, as in PyLate's loop
    assert_same(fp.colbert_scores_pairwise(Q, D), host_torch("colbert_scores_pairwise", Q, D))


@pytest.mark.parametrize("as_numpy", [False, True])
def test_pairwise_ragged_lists_like_the_evaluators(as_numpy):
    queries = [unit(n, 16) for n in (3, 8, 5, 1)]
    documents = [unit(n, 16) for n in (12, 2, 7, 30)]
    if as_numpy:
        queries, documents = [q.numpy() for q in queries], [d.numpy() for d in documents]
    with CallCounter(fp) as counter:
        ours = fp.colbert_scores_pairwise(queries, documents)
    assert counter.count("maxsim_pairs") == 1  # one call, not a Python loop
    assert_same(ours, host_torch("colbert_scores_pairwise", queries, documents))


def test_pairwise_ragged_gradients():
    queries = [unit(n, 16).requires_grad_() for n in (3, 8, 5)]
    documents = [unit(n, 16).requires_grad_() for n in (12, 2, 7)]
    leaves = queries + documents
    ours = torch.autograd.grad(fp.colbert_scores_pairwise(queries, documents).sum(), leaves)
    ref = torch.autograd.grad(
        host_torch("colbert_scores_pairwise", queries, documents).sum(), leaves
    )
    for a, b in zip(ours, ref):
        assert relative_error(a, b) <= TOL


# --------------------------------------------------------------------------------------------
# ColBERTScores: one fused call over the [B, N, Ld, d] stack
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("semantics", ["host", "exclude"])
def test_colbert_scores_class_is_one_call_in_query_major_order(semantics):
    Q, D = unit(5, 6, 16), unit(5, 3, 9, 16)
    d_mask = holes(5, 3, 9)
    with CallCounter(fp) as counter:
        ours = fp.ColBERTScores(mask_semantics=semantics)(Q, D, documents_mask=d_mask)
    assert counter.count() == 1
    flat_docs = counter.calls[0][1][1]
    assert flat_docs.shape == (15, 9, 16)
    if semantics == "exclude":  # nothing to zero-fill: the flattened stack is a view
        assert flat_docs.data_ptr() == D.data_ptr()
        assert_same(ours, maxsim_ref(Q, D.reshape(15, 9, 16), None, d_mask.reshape(15, 9)))
    else:
        assert_same(ours, HOST_CALL(host.ColBERTScores(), Q, D, None, d_mask, backend="torch"))


def test_colbert_scores_class_strided_stack():
    Q = unit(4, 6, 16)
    D = unit(3, 4, 9, 16).transpose(0, 1)  # [4, 3, 9, 16], not viewable as [12, 9, 16]
    d_mask = holes(3, 4, 9).transpose(0, 1).float()
    ref = HOST_CALL(host.ColBERTScores(), Q, D, None, d_mask, backend="torch")
    assert_same(fp.ColBERTScores()(Q, D, None, d_mask), ref)


# --------------------------------------------------------------------------------------------
# The three losses, on a tiny stand-in for pylate.models.ColBERT
# --------------------------------------------------------------------------------------------

VOCAB, DIM, SKIP = 40, 16, [3, 4]  # ids 3 and 4 play the punctuation of the skiplist


class TinyColBERT(torch.nn.Module):
    """What PyLate's losses use of a ColBERT model: token embeddings, skiplist, query expansion."""

    def __init__(self, do_query_expansion: bool) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(VOCAB, DIM)
        self.skiplist = SKIP
        self.do_query_expansion = do_query_expansion

    def forward(self, features):
        # batch-minor memory layout: the embeddings, and the query slices the losses take of
        # them, reach the scorers as strided views
        tokens = self.table(features["input_ids"]).transpose(0, 1).contiguous().transpose(0, 1)
        return {"token_embeddings": tokens}


def features(rows: int, length: int, left: bool = False) -> dict[str, torch.Tensor]:
    ids = torch.randint(5, VOCAB, (rows, length))
    ids[torch.rand(rows, length) < 0.2] = SKIP[0]  # holes
    ids[torch.rand(rows, length) < 0.1] = SKIP[1]
    attention = torch.ones(rows, length, dtype=torch.long)
    for row in range(rows):
        pad = row % 3
        if pad:
            span = slice(0, pad) if left else slice(length - pad, length)
            attention[row, span] = 0
            ids[row, span] = 0
    return {"input_ids": ids, "attention_mask": attention}


def batch(B=4, N=2, Lq=6, Ld=8):
    return [features(B, Lq)] + [features(B, Ld, left=bool(k % 2)) for k in range(N)]


def run(loss_fn, model, sentence_features, labels=None):
    model.zero_grad(set_to_none=True)
    value = loss_fn(sentence_features, labels) if labels is not None else loss_fn(sentence_features)
    value.backward()
    return value.detach(), model.table.weight.grad.clone()


def assert_loss_parity(make_loss, sentence_features, labels=None, do_query_expansion=False):
    """PyLate's torch path vs fusedmaxsim passed explicitly vs fusedmaxsim through patch().

    ``make_loss(model, route)`` builds the loss; route ``"exclude"`` must come out *different*,
    which shows the batch exercises the case where the two mask semantics disagree.
    """
    torch.manual_seed(0)
    model = TinyColBERT(do_query_expansion)
    ref_loss, ref_grad = run(make_loss(model, None), model, sentence_features, labels)
    exclude_loss, _ = run(make_loss(model, "exclude"), model, sentence_features, labels)
    assert relative_error(exclude_loss, ref_loss) > 1e-4
    results = {}
    with CallCounter(fp) as counter:
        explicit = make_loss(model, "explicit")
        results["explicit"] = run(explicit, model, sentence_features, labels)
        fp.patch()
        results["patched"] = run(make_loss(model, None), model, sentence_features, labels)
        fp.unpatch()
    assert counter.count() >= 2
    for route, (loss, grad) in results.items():
        assert relative_error(loss, ref_loss) <= TOL, (route, loss, ref_loss)
        assert relative_error(grad, ref_grad) <= TOL, (route, relative_error(grad, ref_grad))


def metric(route):
    """``score_metric=`` for a route: PyLate's default (None) or a fusedmaxsim ColBERTScores."""
    if route is None:
        return None
    return fp.ColBERTScores(mask_semantics="exclude" if route == "exclude" else "host")


@pytest.mark.parametrize("do_query_expansion", [True, False])
def test_contrastive_loss_and_gradients(do_query_expansion):
    def make(model, route):
        return losses.Contrastive(model=model, score_metric=metric(route), temperature=0.5)

    assert_loss_parity(make, batch(N=3), do_query_expansion=do_query_expansion)


def test_contrastive_with_score_chunks():
    def make(model, route):
        return losses.Contrastive(model=model, score_metric=metric(route), score_mini_batch_size=3)

    assert_loss_parity(make, batch(B=5))


def test_cached_contrastive_loss_and_gradients():
    def make(model, route):
        return losses.CachedContrastive(model=model, score_metric=metric(route), mini_batch_size=2)

    assert_loss_parity(make, batch(B=5, N=2), do_query_expansion=False)


@pytest.mark.parametrize("normalize_scores", [True, False])
def test_distillation_loss_and_gradients(normalize_scores):
    B, K = 4, 3

    def make(model, route):
        kwargs = {"normalize_scores": normalize_scores}
        if route == "explicit":
            kwargs["score_metric"] = fp.colbert_kd_scores
        if route == "exclude":
            kwargs["score_metric"] = functools.partial(
                fp.colbert_kd_scores, mask_semantics="exclude"
            )
        return losses.Distillation(model=model, **kwargs)

    sentence_features = [features(B, 6), features(B * K, 9)]
    assert_loss_parity(make, sentence_features, labels=torch.randn(B, K), do_query_expansion=False)


# --------------------------------------------------------------------------------------------
# patch() / unpatch(), the environment switches, PyLate's own doctests
# --------------------------------------------------------------------------------------------


def importers():
    """Every place PyLate 1.6 keeps one of the scoring functions."""
    import pylate.evaluation.colbert_distillation as distillation_eval
    import pylate.evaluation.colbert_triplet as triplet_eval
    import pylate.scores.similarity_functions as similarity
    from pylate.losses import distillation
    from pylate.rank import rank

    return [
        (host, "colbert_scores"),
        (host, "colbert_scores_pairwise"),
        (host, "colbert_kd_scores"),
        (pylate.scores, "colbert_scores"),
        (pylate.scores, "colbert_scores_pairwise"),
        (pylate.scores, "colbert_kd_scores"),
        (distillation, "colbert_kd_scores"),
        (distillation_eval, "colbert_kd_scores"),
        (triplet_eval, "colbert_scores_pairwise"),
        (rank, "colbert_scores"),
        (similarity, "colbert_scores"),
        (similarity, "colbert_scores_pairwise"),
    ]


def test_patch_reaches_every_importer_and_unpatch_restores_them():
    sites = importers()
    for _ in range(2):  # idempotent
        fp.patch()
    assert fp.is_patched()
    for module, name in sites:
        assert getattr(module, name) is getattr(fp, name), (module.__name__, name)
    assert losses.Distillation.__init__.__defaults__[0] is fp.colbert_kd_scores
    assert host.ColBERTScores.__call__ is fp._stacked_scores
    for _ in range(2):
        fp.unpatch()
    assert not fp.is_patched()
    for module, name in sites:
        assert getattr(module, name) is HOST_FUNCTIONS[name], (module.__name__, name)
    assert losses.Distillation.__init__.__defaults__[0] is HOST_FUNCTIONS["colbert_kd_scores"]
    assert host.ColBERTScores.__call__ is HOST_CALL


def test_patch_reaches_losses_built_before_it():
    torch.manual_seed(0)
    model = TinyColBERT(do_query_expansion=True)
    loss = losses.Contrastive(model=model)  # holds a PyLate ColBERTScores instance
    fp.patch()
    with CallCounter(fp) as counter:
        loss(batch())
    assert counter.count("maxsim") == 1


@pytest.mark.parametrize(
    ("env", "value"),
    [("FUSEDMAXSIM_DISABLE", "1"), ("PYLATE_SCORES_BACKEND", "torch")],
)
def test_environment_hands_calls_back_to_pylate(monkeypatch, env, value):
    Q, D, d_mask = unit(3, 5, 16), unit(4, 6, 16), holes(4, 6)
    fp.patch()
    monkeypatch.setenv(env, value)  # read at call time
    with CallCounter(fp) as counter:
        out = pylate.scores.colbert_scores(Q, D, documents_mask=d_mask)
        stacked = host.ColBERTScores()(Q, unit(4, 2, 6, 16))
        pylate.scores.colbert_kd_scores(Q, unit(3, 2, 6, 16))
        pylate.scores.colbert_scores_pairwise(Q, unit(3, 6, 16))
        fp.ColBERTScores()(Q, unit(4, 2, 6, 16))  # the explicit route too
        fp.colbert_kd_scores(Q, unit(3, 2, 6, 16))
    assert counter.count() == 0
    assert torch.equal(out, host_torch("colbert_scores", Q, D, None, d_mask))
    assert stacked.shape == (3, 8)
    monkeypatch.delenv(env)
    with CallCounter(fp) as counter:
        pylate.scores.colbert_scores(Q, D, documents_mask=d_mask)
    assert counter.count() == 1


def test_explicit_backends_keep_pylate_semantics():
    Q, D = unit(2, 3, 8), unit(2, 4, 8)
    with pytest.raises(ValueError):
        fp.colbert_scores(Q, D, backend="nope")
    with pytest.raises(RuntimeError, match="CUDA or MPS"):
        fp.colbert_scores(Q, D, backend="lik")
    with CallCounter(fp) as counter:
        fp.colbert_scores(Q, D, backend="auto")
    assert counter.count() == 1


def test_pylate_doctests_pass_on_fusedmaxsim():
    """The examples in PyLate's own docstrings, run with the patched names in scope."""
    fp.patch()
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    with CallCounter(fp) as counter:
        for name, fn in HOST_FUNCTIONS.items():
            for test in finder.find(fn, name, globs=dict(vars(host))):
                runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted >= 15 and result.failed == 0
    assert counter.count() >= 3


def test_swap_references_covers_globals_and_defaults(monkeypatch):
    from fusedmaxsim.integrations import swap_references

    def old():
        pass

    def new():
        pass

    def f(metric=old, *, key=old):
        pass

    class C:
        def m(self, metric=old):
            pass

    f.__module__ = C.__module__ = "fakehost.sub"
    sub = types.ModuleType("fakehost.sub")
    sub.f, sub.C, sub.alias = f, C, old
    other = types.ModuleType("fakehostile")  # same prefix, another package: left alone
    other.alias = old
    for module in (types.ModuleType("fakehost"), sub, other):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    swap_references("fakehost", {id(old): (old, new)})
    assert sub.alias is new and other.alias is old
    assert f.__defaults__ == (new,) and f.__kwdefaults__ == {"key": new}
    assert C.m.__defaults__ == (new,)


def test_patch_without_pylate_says_what_is_missing(monkeypatch):
    # PyLate made unimportable, as where it is not installed (None in sys.modules stops an import).
    for name in ("pylate", "pylate.scores", "pylate.scores.colbert", "pylate.scores.scores"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match="needs PyLate"):
        fp.patch()
    assert not fp.is_patched()


def _gathered_parity(rank, world, init, do_query_expansion):
    """One rank of a gloo group: PyLate's contrastive loss with ``gather_across_devices=True``
    (its own differentiable all-gather of the documents), its torch scoring against
    fusedmaxsim's, explicit and patched; each rank its own batch, the same model; and the
    patched ranks' losses and gradients added up against one process on the whole batch."""
    import torch.distributed as dist

    from fusedmaxsim import settings

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        every = []
        for r in range(world):  # every rank's batch, made on every rank
            torch.manual_seed(100 + r)
            every.append(batch(B=3, N=2))

        def make(model, route):
            return losses.Contrastive(model=model, score_metric=metric(route), temperature=0.5,
                                      gather_across_devices=True)

        with settings.use_backend("torch"):
            assert_loss_parity(make, every[rank], do_query_expansion=do_query_expansion)
            # Added up over the ranks: one process's loss and gradients on the concatenated
            # batch, times world² (each rank's mean over its queries, times the world size).
            torch.manual_seed(0)
            model = TinyColBERT(do_query_expansion)
            fp.patch()
            try:
                loss, grad = run(make(model, None), model, every[rank])
            finally:
                fp.unpatch()
            dist.all_reduce(loss)
            dist.all_reduce(grad)
            concatenated = [{k: torch.cat([f[i][k] for f in every]) for k in every[0][i]}
                            for i in range(len(every[0]))]
            ref_loss, ref_grad = run(losses.Contrastive(model=model, temperature=0.5), model,
                                     concatenated)
        assert relative_error(loss, ref_loss * world**2) <= TOL, (rank, loss, ref_loss)
        assert relative_error(grad, ref_grad * world**2) <= TOL, rank
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("do_query_expansion", [True, False])
def test_contrastive_gathered_across_ranks(tmp_path, do_query_expansion):
    """Under torch.distributed (2 gloo processes) with PyLate gathering the documents across
    ranks, the patched scoring gives PyLate's loss and gradients on every rank, and their sum
    over the ranks is one process's on the concatenated batch."""
    import torch.multiprocessing as mp

    mp.spawn(_gathered_parity, args=(2, f"file://{tmp_path}/pg", do_query_expansion), nprocs=2,
             join=True)
