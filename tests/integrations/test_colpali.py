"""colpali-engine parity: scores and losses equal the host's einsum path.

The embeddings are built the way ColVision models return them: L2-normalised tokens multiplied by
the attention mask, so padding rows are exact zeros, on the right for queries and documents and on
the left for documents gathered across ranks. Gradients are compared where they reach the model
(through that mask) and on every non-padding row of the embeddings.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
import torch.nn.functional as F
from _hosts import CallCounter, import_colpali

if not import_colpali():
    pytest.skip("colpali-engine is not installed", allow_module_level=True)

from fusedmaxsim.integrations import colpali as fc
from fusedmaxsim.testing import relative_error

host_dispatch = importlib.import_module("colpali_engine.utils.maxsim")
host_losses = importlib.import_module("colpali_engine.loss.late_interaction_losses")
host_processing = importlib.import_module("colpali_engine.utils.processing_utils")
Processor = host_processing.BaseVisualRetrieverProcessor

pytestmark = pytest.mark.integrations

TOL = 1e-5
LOSSES = list(fc._INBATCH_LOSSES) + list(fc._NEGATIVE_LOSSES)
HOST_INBATCH, HOST_KD = host_dispatch.maxsim_inbatch, host_dispatch.maxsim_kd
HOST_SCORE = Processor.__dict__["score_multi_vector"]


def colvision(*shape, pad=0, left=False, dtype=torch.float32):
    """Embeddings as a ColVision model outputs them: unit tokens times the attention mask."""
    x = F.normalize(torch.randn(*shape, dtype=torch.float64), dim=-1)
    mask = torch.ones(shape[:-1], dtype=torch.float64)
    rows = mask.view(-1, shape[-2])
    for row in range(rows.shape[0]):
        n = row % (pad + 1)  # 0 to pad padding tokens
        if n and left:
            rows[row, :n] = 0
        elif n:
            rows[row, -n:] = 0
    return (x * mask[..., None]).to(dtype), mask


# --------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------


def test_maxsim_inbatch_zero_padding_on_both_sides():
    q, _ = colvision(5, 7, 32, pad=3)
    d, _ = colvision(6, 12, 32, pad=5, left=True)
    ours, ref = fc.maxsim_inbatch(q, d), host_dispatch._torch_maxsim(q, d)
    assert ours.dtype == ref.dtype and relative_error(ours, ref) <= TOL


def test_maxsim_inbatch_strided_views():
    q = colvision(5, 14, 64)[0][:, ::2, ::2]
    d = colvision(12, 6, 32)[0].transpose(0, 1)
    assert not q.is_contiguous() and not d.is_contiguous()
    assert relative_error(fc.maxsim_inbatch(q, d), host_dispatch._torch_maxsim(q, d)) <= TOL


def test_maxsim_kd_matches_host():
    q, _ = colvision(4, 7, 32, pad=2)
    d = colvision(4, 3, 18, 32, pad=4, left=True)[0][:, :, ::2]
    ours, ref = fc.maxsim_kd(q, d), host_dispatch._torch_maxsim_kd(q, d)
    assert ours.shape == (4, 3) and relative_error(ours, ref) <= TOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_returns_the_host_dtype_at_least_as_accurately(dtype):
    """Same dtype as the host's half-precision einsum; fp32 accumulation rounded once is never
    further from the exact scores than the host's result (by more than the final rounding)."""
    q, d = torch.randn(3, 6, 32, dtype=dtype), torch.randn(3, 5, 8, 32, dtype=dtype)
    ours, ref = fc.maxsim_kd(q, d), host_dispatch._torch_maxsim_kd(q, d)
    assert ours.dtype == ref.dtype == dtype
    exact = host_dispatch._torch_maxsim_kd(q.double(), d.double())
    rounding = torch.finfo(dtype).eps * exact.abs()
    assert ((ours.double() - exact).abs() <= (ref.double() - exact).abs() + rounding).all()


def test_score_multi_vector_ragged_lists_in_blocks():
    qs = [colvision(n, 32)[0] for n in (3, 9, 1, 6, 4)]
    ps = [colvision(n, 32)[0] for n in (40, 7, 13)]
    with CallCounter(fc) as counter:
        ours = fc.score_multi_vector(qs, ps, batch_size=2)
    assert counter.count("maxsim") == 3 * 2  # one fused call per block pair
    ref = HOST_SCORE.__func__(qs, ps, batch_size=2)
    assert ours.dtype == torch.float32 and ours.device.type == "cpu"
    assert relative_error(ours, ref) <= TOL
    padded = fc.score_multi_vector(
        torch.nn.utils.rnn.pad_sequence(qs, batch_first=True),
        torch.nn.utils.rnn.pad_sequence(ps, batch_first=True),
    )
    assert (
        relative_error(
            padded,
            HOST_SCORE.__func__(
                torch.nn.utils.rnn.pad_sequence(qs, batch_first=True),
                torch.nn.utils.rnn.pad_sequence(ps, batch_first=True),
            ),
        )
        <= TOL
    )


def test_score_multi_vector_rejects_empty_inputs():
    with pytest.raises(ValueError, match="queries"):
        fc.score_multi_vector([], [torch.randn(3, 8)])
    with pytest.raises(ValueError, match="passages"):
        fc.score_multi_vector([torch.randn(3, 8)], [])


def test_wrong_ranks_and_names_are_refused():
    q, d = torch.randn(2, 3, 8), torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match=r"maxsim_inbatch expects query \[B, Lq, d\] and a 3-D "
                                         r"doc, got \(2, 3, 8\) and \(2, 1, 4, 8\)"):
        fc.maxsim_inbatch(q, d[:, None])
    with pytest.raises(ValueError, match=r"maxsim_kd expects query \[B, Lq, d\] and a 4-D doc, "
                                         r"got \(2, 3, 8\) and \(2, 4, 8\)"):
        fc.maxsim_kd(q, d)
    with pytest.raises(AttributeError, match="module 'fusedmaxsim.integrations.colpali' has no "
                                             "attribute 'ColbertLos'"):
        fc.ColbertLos


# --------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------


class Encoder(torch.nn.Module):
    """Weights -> ColVision-style embeddings, so gradients can be compared where they land."""

    def __init__(self, dim=32):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x, mask):
        return F.normalize(self.proj(x), dim=-1) * mask[..., None]


def loss_inputs(negatives: bool, offset: int = 0):
    """Inputs and masks: queries [B, 6], docs [B + offset, 11] left-padded, negatives [B, 3, 9]."""
    B = 4
    q, q_mask = colvision(B, 6, 32, pad=2)
    d, d_mask = colvision(B + offset, 11, 32, pad=4, left=True)
    parts = [(q, q_mask), (d, d_mask)]
    if negatives:
        parts.append(colvision(B, 3, 9, 32, pad=3))
    return parts


def strided(x):
    """The same values in batch-minor memory layout: a non-contiguous view."""
    return x.transpose(0, 1).contiguous().transpose(0, 1)


def run_loss(loss_fn, encoder, parts, offset):
    encoder.zero_grad(set_to_none=True)
    leaves = [encoder(x.float(), m.float()).detach().requires_grad_() for x, m in parts]
    value = loss_fn(*map(strided, leaves), offset=offset)
    embedding_grads = torch.autograd.grad(value, leaves, retain_graph=True)
    value = loss_fn(*[strided(encoder(x.float(), m.float())) for x, m in parts], offset=offset)
    value.backward()
    non_padding = [g * (m[..., None] != 0) for g, (_, m) in zip(embedding_grads, parts)]
    return value.detach(), encoder.proj.weight.grad.clone(), non_padding


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"normalize_scores": False},
        {"pos_aware_negative_filtering": True},
        {"use_smooth_max": True},
        {"use_smooth_max": True, "tau": 0.5, "normalize_scores": False},
    ],
    ids=["default", "raw-scores", "filtering", "smooth-max", "smooth-max-tau0.5"],
)
def test_loss_and_gradients_match_host(name, options):
    negatives = name in fc._NEGATIVE_LOSSES
    # rectangular in-batch scores with an offset, as across ranks; ColbertSigmoidLoss itself
    # only handles the square case
    offset = {
        "ColbertSigmoidLoss": 0,
        "ColbertNegativeCELoss": 1,
        "ColbertPairwiseNegativeCELoss": 1,
    }.get(name, 2)
    parts = loss_inputs(negatives, offset)
    torch.manual_seed(0)
    encoder = Encoder()
    ref = run_loss(getattr(host_losses, name)(**options), encoder, parts, offset)
    with CallCounter(fc) as counter:
        explicit = run_loss(getattr(fc, name)(**options), encoder, parts, offset)
        fc.patch()
        patched = run_loss(getattr(host_losses, name)(**options), encoder, parts, offset)
        fc.unpatch()
    if negatives:  # positives through maxsim_pairs, negatives through the candidate layout
        assert counter.count("maxsim_pairs") == 4  # two routes, two passes each
    assert counter.count("maxsim") >= 2
    for route, (loss, weight_grad, grads) in {"explicit": explicit, "patched": patched}.items():
        assert relative_error(loss, ref[0]) <= TOL, route
        assert relative_error(weight_grad, ref[1]) <= TOL, route
        for a, b in zip(grads, ref[2]):
            assert relative_error(a, b) <= TOL, route


@pytest.mark.parametrize("name", LOSSES)
def test_smooth_max_is_fused(name, monkeypatch):
    """use_smooth_max=True goes through the fused smooth max (no einsum grid) and gives the
    host's loss; FUSEDMAXSIM_DISABLE=1 hands it back to the host."""
    parts = loss_inputs(name in fc._NEGATIVE_LOSSES)
    leaves = [x.float() for x, _ in parts]
    ref = getattr(host_losses, name)(use_smooth_max=True)(*leaves)
    with CallCounter(fc) as counter:
        ours = getattr(fc, name)(use_smooth_max=True)(*leaves)
    assert counter.count() > 0
    assert relative_error(ours, ref) <= TOL
    monkeypatch.setenv("FUSEDMAXSIM_DISABLE", "1")
    with CallCounter(fc) as counter:
        host = getattr(fc, name)(use_smooth_max=True)(*leaves)
    assert counter.count() == 0
    assert torch.equal(host, ref)


def test_zero_embeddings_give_the_host_values():
    """colpali-engine's own check: all-zero embeddings score 0 everywhere, so CE is log(B)."""
    B = 3
    loss = fc.ColbertLoss(temperature=1.0, normalize_scores=False)(
        torch.zeros(B, 1, 4), torch.zeros(B, 1, 4)
    )
    torch.testing.assert_close(loss, torch.log(torch.tensor(float(B))))


# --------------------------------------------------------------------------------------------
# patch() / unpatch() and the environment switches
# --------------------------------------------------------------------------------------------


def test_patch_and_unpatch_every_entry_point():
    sites = [
        (host_dispatch, "maxsim_inbatch"),
        (host_dispatch, "maxsim_kd"),
        (host_losses, "maxsim_inbatch"),
        (host_losses, "maxsim_kd"),
        (host_processing, "maxsim_inbatch"),
    ]
    forwards = {n: getattr(host_losses, n).forward for n in fc._NEGATIVE_LOSSES}
    for _ in range(2):
        fc.patch()
    assert fc.is_patched()
    for module, name in sites:
        assert getattr(module, name) is getattr(fc, name)
    assert Processor.score_multi_vector is fc.score_multi_vector
    assert host_losses.ColbertNegativeCELoss.forward is fc.negative_ce_forward
    assert host_losses.ColbertPairwiseNegativeCELoss.forward is fc.pairwise_negative_ce_forward
    for _ in range(2):
        fc.unpatch()
    assert not fc.is_patched()
    assert host_dispatch.maxsim_inbatch is HOST_INBATCH and host_losses.maxsim_kd is HOST_KD
    assert host_processing.maxsim_inbatch is HOST_INBATCH
    assert Processor.__dict__["score_multi_vector"] is HOST_SCORE
    for name, forward in forwards.items():
        assert getattr(host_losses, name).forward is forward


@pytest.mark.parametrize(
    ("env", "value"), [("FUSEDMAXSIM_DISABLE", "1"), ("COLPALI_SCORES_BACKEND", "torch")]
)
def test_environment_hands_calls_back_to_colpali(monkeypatch, env, value):
    fc.patch()
    monkeypatch.setenv(env, value)  # read at call time
    q, d, neg = (x.float() for x, _ in loss_inputs(negatives=True))
    with CallCounter(fc) as counter:
        host_losses.ColbertNegativeCELoss()(q, d, neg)
        host_losses.ColbertLoss()(q, d)
        fc.ColbertPairwiseNegativeCELoss()(q, d, neg)
        Processor.score_multi_vector(list(q), list(d))
    assert counter.count() == 0
    monkeypatch.delenv(env)
    with CallCounter(fc) as counter:
        host_losses.ColbertLoss()(q, d)
    assert counter.count() == 1


def test_strict_lik_backend_still_raises_on_cpu(monkeypatch):
    monkeypatch.setenv("COLPALI_SCORES_BACKEND", "lik")
    lik = importlib.import_module("colpali_engine.utils._lik_backend")
    with pytest.raises(lik.LIKUnsupportedError):
        fc.maxsim_inbatch(torch.randn(2, 3, 8), torch.randn(2, 4, 8))


def test_patch_without_colpali_says_what_is_missing(monkeypatch):
    # colpali-engine made unimportable, as where it is not installed.
    for name in ("colpali_engine", "colpali_engine.utils", "colpali_engine.utils.maxsim"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match="needs colpali-engine"):
        fc.patch()
    assert not fc.is_patched()


def _gathered_worker(rank, world, init, name):
    """One rank of a gloo group, as colpali-engine's ContrastiveTrainer scores across ranks: the
    documents left-padded to the longest rank's (what accelerate's ``pad_across_processes(...,
    pad_first=True)`` does), gathered as colpali-engine's ``concat_all_gather`` gathers
    (``torch.distributed.nn.functional.all_gather``, concatenated: its trainer module imports
    peft, which the pinned integrations leave out), the loss at ``offset = rank · B``, scored by
    fusedmaxsim (patched). The ranks' losses and gradients, added up, must be one process's on
    the concatenated batch with the host's own scoring. (The host's scoring under that gather on
    gloo is not the reference: its gradients came out far from one process's.)"""
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_gather

    from fusedmaxsim import settings

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        B, longest = 3, 9 + 2 * (world - 1)
        data = []
        for r in range(world):  # every rank's batch, made on every rank
            torch.manual_seed(10 + r)
            q, q_mask = colvision(B, 6, 32, pad=2)
            data.append((q, q_mask, *colvision(B, 9 + 2 * r, 32, pad=3)))
        torch.manual_seed(0)
        encoder = Encoder()  # the same weights on every rank

        def padded(d, d_mask):
            return F.pad(encoder(d, d_mask), (0, 0, longest - d.shape[1], 0))

        def run(value):
            value.backward()
            return value.detach(), encoder.proj.weight.grad.clone()

        q, q_mask, d, d_mask = data[rank]
        with settings.use_backend("torch"):
            fc.patch()
            try:
                encoder.zero_grad(set_to_none=True)
                loss, grad = run(getattr(host_losses, name)()(
                    encoder(q, q_mask), torch.cat(all_gather(padded(d, d_mask)), dim=0),
                    offset=rank * B))
            finally:
                fc.unpatch()
            dist.all_reduce(loss)
            dist.all_reduce(grad)
            encoder.zero_grad(set_to_none=True)
            docs = torch.cat([padded(dd, mm) for _, _, dd, mm in data])
            host = getattr(host_losses, name)()
            ref_loss, ref_grad = run(sum(host(encoder(qq, qm), docs, offset=r * B)
                                         for r, (qq, qm, _, _) in enumerate(data)))
        assert relative_error(loss, ref_loss) <= TOL, (rank, loss, ref_loss)
        assert relative_error(grad, ref_grad) <= TOL, (rank, relative_error(grad, ref_grad))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["ColbertLoss", "ColbertPairwiseCELoss"])
def test_losses_gathered_across_ranks(tmp_path, name):
    """Under torch.distributed (2 gloo processes) with documents gathered across ranks the way
    colpali-engine's trainer gathers them, the patched losses and gradients, added up over the
    ranks, are one process's on the concatenated batch."""
    import torch.multiprocessing as mp

    mp.spawn(_gathered_worker, args=(2, f"file://{tmp_path}/pg", name), nprocs=2, join=True)
