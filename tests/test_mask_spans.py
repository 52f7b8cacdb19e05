"""Document masks of every shape: the kernels read each document's mask once, skip the tokens
outside the span of its valid ones, and drop the per-similarity mask when the span has no hole.

Each kind of mask is checked against the float64 reference (scores and both gradients), with NaN
in every masked document token: a token outside the span, or a hole inside it, that leaked into a
max would show. Documents of 37 tokens take several mask-scan steps and several tiles under the
interpreter.
"""

import pytest
import torch
from helpers import check_against_reference, masks_with_holes
from test_ragged import check_packed, offsets

from fusedmaxsim import maxsim, maxsim_varlen

LQ, LD, DIM = 7, 37, 32


def span_mask(kind: str, lo: int, hi: int, ld: int) -> torch.Tensor:
    """One document's ``[ld]`` mask whose valid tokens lie in ``[lo, hi)`` in the named pattern."""
    t = torch.arange(ld)
    if kind == "padded":  # valid tokens first, padding after (ColBERT, PyLate)
        return t < hi - lo
    if kind == "left_padded":
        return t >= ld - (hi - lo)
    mask = (t >= lo) & (t < hi)
    if kind == "holes":  # a span with tokens missing inside it
        mask &= masks_with_holes((ld,), "cpu", fully_masked_first=False)
    return mask


def span_masks(kind: str, rows: tuple[int, ...], ld: int) -> torch.Tensor:
    """``rows + (ld,)`` masks; the first spans are the edge cases: empty, one token, the whole
    document, the last token, one token inside."""
    n = torch.Size(rows).numel()
    ends = [(0, 0), (0, 1), (0, ld), (ld - 1, ld), (5, 6)]
    ends += [sorted(torch.randint(0, ld + 1, (2,)).tolist()) for _ in range(max(0, n - len(ends)))]
    return torch.stack([span_mask(kind, lo, hi, ld) for lo, hi in ends[:n]]).reshape(*rows, ld)


def with_nan_where_masked(D: torch.Tensor, d_mask: torch.Tensor) -> torch.Tensor:
    D = D.clone()
    D[~d_mask] = float("nan")
    return D


KINDS = ["padded", "left_padded", "span", "holes"]


@pytest.mark.parametrize("strategy", ["unified", "lowmem"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["cross", "candidates"])
def test_document_spans_match_the_reference(backend, device, layout, kind, strategy):
    Q = torch.randn(3, LQ, DIM, device=device)
    doc_rows = (6,) if layout == "cross" else (3, 2)
    d_mask = span_masks(kind, doc_rows, LD).to(device)
    D = torch.randn(*doc_rows, LD, DIM, device=device)
    D = with_nan_where_masked(D, d_mask)
    # The reference zeroes nothing: it needs finite masked tokens to stay NaN-free itself.
    clean = torch.where(d_mask[..., None], D, 0.0)
    out = check_against_reference(Q, clean, d_mask=d_mask, backward=strategy)
    torch.testing.assert_close(maxsim(Q, D, d_mask=d_mask), out.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_document_spans_match_the_reference(backend, device, kind):
    lengths, spans = [LD, 1, 0, 20], [(5, 30), (0, 1), (0, 0), (3, 20)]
    d_mask = torch.cat([span_mask(kind, lo, hi, n) for n, (lo, hi) in zip(lengths, spans)])
    Q, D = torch.randn(2 * LQ, DIM), torch.randn(sum(lengths), DIM)
    D = torch.where(d_mask[:, None], D, 0.0)
    Q, D, d_mask = Q.to(device), D.to(device), d_mask.to(device)
    cu_q, cu_d = offsets([LQ, LQ]).to(device), offsets(lengths).to(device)
    check_packed(maxsim_varlen, Q, D, cu_q, cu_d, d_mask=d_mask)
