"""PLAID residual documents (fusedmaxsim.plaid): the unpacking of the codes against independent
encoders, and maxsim_residual's scores and gradients against the float64 oracle."""

import numpy as np
import pytest
import torch
from helpers import masks_with_holes

from fusedmaxsim import forced_plan, settings
from fusedmaxsim.plaid import decompress_residuals, maxsim_residual
from fusedmaxsim.planning import recording
from fusedmaxsim.reference import maxsim_residual_ref
from fusedmaxsim.testing import TOLERANCES, assert_close_to_reference

NBITS = [1, 2, 4, 8]
ORDERS = ["big", "little"]


def _pack(buckets: np.ndarray, nbits: int, bit_order: str) -> torch.Tensor:
    """An independent encoder: each bucket's bits least significant first, the stream packed by
    NumPy's packbits in ``bit_order`` (what ColBERT's and fast-plaid's indexers do for "big")."""
    bits = (buckets[..., None] >> np.arange(nbits)) & 1  # [..., d, nbits]
    stream = bits.reshape(*buckets.shape[:-1], -1).astype(np.uint8)
    return torch.from_numpy(np.packbits(stream, axis=-1, bitorder=bit_order))


def _index(Nd=5, Ld=9, d=20, n_centroids=7, nbits=2, bit_order="big", dtype=torch.float32,
           seed=0):
    """A random index: codes, residuals (through :func:`_pack`), centroids, bucket weights."""
    gen = np.random.default_rng(seed)
    codes = torch.from_numpy(gen.integers(0, n_centroids, (Nd, Ld)))
    residuals = _pack(gen.integers(0, 1 << nbits, (Nd, Ld, d)), nbits, bit_order)
    centroids = torch.from_numpy(gen.standard_normal((n_centroids, d))).to(dtype)
    weights = torch.from_numpy(gen.standard_normal(1 << nbits) * 0.1).to(dtype)
    return codes, residuals, centroids, weights


@pytest.mark.parametrize("bit_order", ORDERS)
@pytest.mark.parametrize("nbits", NBITS)
@pytest.mark.parametrize("d", [16, 13])
def test_unpacking_recovers_every_code(nbits, bit_order, d):
    """Zero centroids and bucket weights 0, 1, 2, ...: every decompressed value is its code
    (odd d: the last byte is partly padding)."""
    buckets = np.random.default_rng(1).integers(0, 1 << nbits, (4, 6, d))
    residuals = _pack(buckets, nbits, bit_order)
    assert residuals.shape[-1] == -(-d * nbits // 8)
    codes = torch.zeros(4, 6, dtype=torch.int64)
    out = decompress_residuals(codes, residuals, torch.zeros(1, d),
                               torch.arange(1 << nbits, dtype=torch.float32), nbits,
                               bit_order=bit_order)
    assert torch.equal(out, torch.from_numpy(buckets).float())


def _fast_plaid_decompress(codes, residuals, centroids, bucket_weights, nbits):
    """fast-plaid's own decompression (rust/utils/residual_codec.rs, ported line by line): each
    byte through its bit-reversal map, then split into codes from the most significant end."""
    mask = (1 << nbits) - 1
    reversed_map = []
    for i in range(256):
        out, pos = 0, 8
        while pos >= nbits:
            segment = (i >> (pos - nbits)) & mask
            rev = 0
            for k in range(nbits):
                if segment & (1 << k):
                    rev |= 1 << (nbits - 1 - k)
            out |= rev
            if pos > nbits:
                out <<= nbits
            pos -= nbits
        reversed_map.append(out)
    keys = 8 // nbits
    table = [[(b >> (k * nbits)) & mask for k in reversed(range(keys))] for b in range(256)]
    rev = torch.tensor(reversed_map)[residuals.long()]
    buckets = torch.tensor(table)[rev].flatten(-2)
    return centroids[codes] + bucket_weights[buckets]


@pytest.mark.parametrize("nbits", [1, 2, 4])
def test_big_order_is_fast_plaids(nbits):
    codes, residuals, centroids, weights = _index(nbits=nbits, d=32)
    ours = decompress_residuals(codes, residuals, centroids, weights, nbits)
    assert torch.equal(ours, _fast_plaid_decompress(codes, residuals, centroids, weights, nbits))


def _check(Q, index, lengths, nbits, bit_order="big", q_mask=None, normalize=True, tol=None):
    """Scores (grad mode and no_grad) and grad_Q (a random grad_output, then the stride-0 one of
    ``sum().backward()``) against the float64 oracle."""
    score_tol, grad_tol = tol or TOLERANCES[Q.dtype]
    Q = Q.detach().requires_grad_()
    Q64 = Q.detach().double().requires_grad_()
    kwargs = dict(normalize=normalize, q_mask=q_mask, bit_order=bit_order)
    out = maxsim_residual(Q, *index[:1], index[1], lengths, *index[2:], nbits, **kwargs)
    # The oracle rounds the decompressed tokens to the centroids' dtype, as the library does.
    ref = maxsim_residual_ref(Q64, *index[:2], lengths, *index[2:], nbits, **kwargs)
    assert out.dtype == (torch.float64 if Q.dtype == torch.float64 else torch.float32)
    assert_close_to_reference(out, ref, score_tol, "scores")
    with torch.no_grad():
        assert_close_to_reference(
            maxsim_residual(Q, index[0], index[1], lengths, *index[2:], nbits, **kwargs), ref,
            score_tol, "scores (no_grad)")
    if out.numel():
        g = torch.randn_like(out)
        gq, = torch.autograd.grad(out, Q, g)
        rq, = torch.autograd.grad(ref, Q64, g.double())
        assert gq.dtype == Q.dtype
        assert_close_to_reference(gq, rq, grad_tol, "grad_Q")
    maxsim_residual(Q, index[0], index[1], lengths, *index[2:], nbits, **kwargs).sum().backward()
    maxsim_residual_ref(Q64, *index[:2], lengths, *index[2:], nbits, **kwargs).sum().backward()
    assert_close_to_reference(Q.grad, Q64.grad, grad_tol, "grad_Q (sum)")
    return out


@pytest.mark.parametrize("bit_order", ORDERS)
@pytest.mark.parametrize("nbits", NBITS)
def test_scores_and_gradients(nbits, bit_order, backend):
    """Masked query tokens (a fully masked query), an empty document and one of length 1."""
    index = _index(nbits=nbits, bit_order=bit_order)
    lengths = torch.tensor([9, 0, 1, 4, 8])
    Q = torch.randn(3, 6, 20)
    _check(Q, index, lengths, nbits, bit_order, q_mask=masks_with_holes((3, 6), "cpu"))


@pytest.mark.parametrize("bit_order", ORDERS)
@pytest.mark.parametrize("nbits", NBITS)
def test_odd_dim_in_tile_steps(nbits, bit_order, backend):
    """33 dimensions (a last byte partly padding, a tile partly past d) in 32-token steps of
    40-token documents: the oracle's scores."""
    index = _index(Nd=4, Ld=40, d=33, nbits=nbits, bit_order=bit_order)
    lengths = torch.tensor([40, 33, 0, 1])
    _check(torch.randn(2, 5, 33), index, lengths, nbits, bit_order)


@pytest.mark.parametrize("bit_order", ORDERS)
@pytest.mark.parametrize("nbits", NBITS)
@pytest.mark.parametrize("dtypes", [(torch.float16, torch.float16), (torch.float16, torch.float32),
                                    (torch.float32, torch.float32)], ids=str)
def test_decoded_values_exact(nbits, bit_order, dtypes, backend):
    """Each decoded value bit for bit: one-hot query tokens against one-token documents score
    exactly the token's value in that dimension, which must equal decompress_residuals' (the
    sum of centroid and bucket weight in fp32, rounded to the centroids' dtype) for centroids
    and weights of one dtype or of two. 19 dimensions: a tile past d."""
    d, n = 19, 12
    codes, residuals, centroids, weights = _index(Nd=n, Ld=1, d=d, n_centroids=5, nbits=nbits,
                                                  bit_order=bit_order, seed=3)
    centroids = (centroids * 100).to(dtypes[0])  # far apart in scale: the sum rounds
    weights = weights.to(dtypes[1])
    Q = torch.eye(d, dtype=dtypes[0])[:, None, :]  # [d, 1, d]
    out = maxsim_residual(Q, codes, residuals, torch.ones(n, dtype=torch.int64), centroids,
                          weights, nbits, normalize=False, bit_order=bit_order)
    tokens = decompress_residuals(codes, residuals, centroids, weights, nbits,
                                  bit_order=bit_order)[:, 0]  # [n, d]
    assert torch.equal(out, tokens.float().T)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("normalize", [False, True])
def test_dtypes_and_normalize(dtype, normalize, backend):
    """Queries in every dtype against fp16 centroids (float64: float64 centroids)."""
    index = _index(nbits=4, d=13, dtype=torch.float64 if dtype == torch.float64 else torch.float16)
    _check(torch.randn(2, 5, 13).to(dtype), index, torch.tensor([9, 3, 0, 9, 2]), 4,
           normalize=normalize)


def test_blocks_orientation_and_strides():
    """Documents decompressed a few at a time, both product orientations, a strided Q and a
    2-D Q: the same results."""
    index = _index(Nd=11, nbits=2)
    lengths = torch.randint(0, 10, (11,))
    Q = torch.randn(6, 3, 20).transpose(0, 1)  # [3, 6, 20], strided
    whole = _check(Q, index, lengths, 2)
    settings.set_torch_block_bytes(4096)
    try:
        with recording() as plans:
            blocked = _check(Q, index, lengths, 2)
        assert plans[0][1].blocks[1] < 11
        for doc_major in (False, True):
            with forced_plan(doc_major=doc_major):
                assert torch.allclose(_check(Q, index, lengths, 2), whole, atol=1e-5)
    finally:
        settings.set_torch_block_bytes(None)
    assert torch.allclose(blocked, whole, atol=1e-5)
    one = maxsim_residual(Q[1], index[0], index[1], lengths, *index[2:], 2)
    assert one.shape == (11,) and torch.allclose(one, whole[1], atol=1e-6)


def test_empty_batches(backend):
    index = _index(nbits=2)
    lengths = torch.tensor([9, 0, 1, 4, 8])
    assert _check(torch.randn(0, 6, 20), index, lengths, 2).shape == (0, 5)
    assert torch.equal(_check(torch.randn(2, 0, 20), index, lengths, 2), torch.zeros(2, 5))
    empty = tuple(t[:0] for t in index[:2]) + index[2:]
    assert _check(torch.randn(2, 6, 20), empty, lengths[:0], 2).shape == (2, 0)


def test_the_plan_says_how_it_runs(backend):
    index = _index(nbits=2)
    with recording() as plans:
        maxsim_residual(torch.randn(1, 6, 20), index[0], index[1], torch.tensor([9] * 5),
                        *index[2:], 2)
    problem, plan = plans[0]
    assert problem.layout == "residual" and plan.kernel == backend
    assert plan.blocks[1] == 5  # the backward's blocks, on both paths
    with forced_plan(kernel="torch"), recording() as plans:
        maxsim_residual(torch.randn(1, 6, 20), index[0], index[1], torch.tensor([9] * 5),
                        *index[2:], 2)
    assert plans[0][1].kernel == "torch"


def test_out_of_range_lengths_and_ids(backend):
    """Checked on the CPU (a clear error); unchecked (validate=False), that document's scores
    are NaN and every other is unchanged."""
    codes, residuals, centroids, weights = _index(nbits=2)
    Q = torch.randn(2, 6, 20)
    good = maxsim_residual(Q, codes, residuals, torch.tensor([9, 2, 3, 4, 5]), centroids,
                           weights, 2)
    with pytest.raises(ValueError, match=r"doc_lengths must lie in \[0, 9\]"):
        maxsim_residual(Q, codes, residuals, torch.tensor([9, 2, 10, 4, 5]), centroids,
                        weights, 2)
    bad_codes = codes.clone()
    bad_codes[3, 1] = 7
    with pytest.raises(ValueError, match=r"codes must be centroid ids in \[0, 7\)"):
        maxsim_residual(Q, bad_codes, residuals, torch.tensor([9, 2, 3, 4, 5]), centroids,
                        weights, 2)
    out = maxsim_residual(Q, bad_codes, residuals, torch.tensor([9, 2, 10, 4, -1]), centroids,
                          weights, 2, validate=False)
    assert out[:, 2:].isnan().all() and torch.equal(out[:, :2], good[:, :2])


def test_every_error_names_the_argument():
    codes, residuals, centroids, weights = _index(nbits=2)
    Q, lengths = torch.randn(2, 6, 20), torch.tensor([9, 2, 3, 4, 5])

    def call(**changes):
        args = dict(Q=Q, codes=codes, residuals=residuals, doc_lengths=lengths,
                    centroids=centroids, bucket_weights=weights, nbits=2)
        args.update(changes)
        return maxsim_residual(**args)

    cases = [
        (ValueError, r"nbits must be one of \(1, 2, 4, 8\), got 3", dict(nbits=3)),
        (ValueError, r"nbits must be one of .* got True", dict(nbits=True)),
        (ValueError, r"Q must be \[Lq, d\] or \[Nq, Lq, d\]", dict(Q=torch.randn(20))),
        (TypeError, r"Q must be float16, bfloat16, float32 or float64", dict(Q=Q.int())),
        (ValueError, r"centroids must be \[n_centroids, d\] with Q's d = 20",
         dict(centroids=centroids[:, :4])),
        (ValueError, r"bucket_weights must be \[2 \*\* nbits\] = \(4,\)",
         dict(bucket_weights=weights[:3])),
        (TypeError, r"codes must be an integer torch.Tensor", dict(codes=codes.float())),
        (ValueError, r"codes must be \[Nd, Ld\]", dict(codes=codes[0])),
        (TypeError, r"residuals must be a torch.uint8 tensor", dict(residuals=residuals.int())),
        (ValueError, r"residuals must be \[Nd, Ld, ceil\(d \* nbits / 8\)\] = \(5, 9, 5\)",
         dict(residuals=residuals[..., :4])),
        (ValueError, r"doc_lengths must have shape \(5,\)", dict(doc_lengths=lengths[:4])),
        (TypeError, r"doc_lengths must be an integer tensor", dict(doc_lengths=lengths.float())),
        (ValueError, r"q_mask must be \[Nq, Lq\] = \(2, 6\)",
         dict(q_mask=torch.ones(2, 5, dtype=torch.bool))),
        (TypeError, r"normalize must be True or False", dict(normalize=1)),
        (TypeError, r"validate must be True, False or None", dict(validate="yes")),
        (ValueError, r"bit_order must be one of \('big', 'little'\), got 'middle'",
         dict(bit_order="middle")),
        (ValueError, r"centroids is on meta but Q is on cpu", dict(centroids=centroids.to("meta"))),
    ]
    for error, message, changes in cases:
        with pytest.raises(error, match=message):
            call(**changes)
    with pytest.raises(ValueError, match=r"residuals must be uint8 \[\*codes.shape"):
        decompress_residuals(codes, residuals[..., :4], centroids, weights, 2)
