"""The winner index (each column's rows sorted by the token they won) and the document-owned
grad_D that reads its rows through it, against a stable sort and the float64 reference."""

import pytest
import torch
from helpers import assert_backward_bitwise_reproducible, leaf, masks_with_holes

from fusedmaxsim import _launch, maxsim, settings
from fusedmaxsim._configs import BwdConfig, bwd_config, forced_configs
from fusedmaxsim.reference import maxsim_ref
from fusedmaxsim.testing import assert_close_to_reference


def expected_index(argmax: torch.Tensor, col_base: int, n_cols: int, Ld: int):
    """Rows of each column in the order of the token won, then of the row (a stable sort),
    and each token's start; the rows that won nothing left out."""
    Nq, _, Lq = argmax.shape
    won = argmax[:, col_base:col_base + n_cols].permute(1, 0, 2).reshape(n_cols, Nq * Lq).long()
    rows, starts = [], []
    for tokens in won:
        keep = torch.nonzero(tokens >= 0).flatten()
        order = torch.sort(tokens[keep], stable=True).indices
        rows.append(keep[order])
        counts = torch.bincount(tokens[keep], minlength=Ld)
        starts.append(torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]))
    return rows, torch.stack(starts)


@pytest.mark.parametrize("Nq, Lq, Ncols, Ld, col_base, n_cols", [
    (3, 7, 5, 13, 0, 5),     # one block of rows
    (9, 11, 4, 40, 1, 2),    # 99 rows: four blocks, a chunk of columns past column 0
    (1, 1, 2, 1, 0, 2),      # one row, one token
])
def test_index_is_a_stable_sort_of_each_column(device, Nq, Lq, Ncols, Ld, col_base, n_cols):
    argmax = torch.randint(-1, Ld, (Nq, Ncols, Lq), device=device, dtype=torch.int16)
    argmax[:, :, 0] = Ld - 1  # the last token, won by many rows
    buffers = _launch._winner_index_buffers(torch.empty(Nq, Lq, 1, device=device), n_cols, Ld)
    rows, starts = _launch._winner_index(argmax, col_base, n_cols, Ld, buffers)
    want_rows, want_starts = expected_index(argmax.cpu(), col_base, n_cols, Ld)
    assert torch.equal(starts.cpu().long(), want_starts)
    for col in range(n_cols):
        n = int(want_starts[col, -1])
        assert torch.equal(rows[col, :n].cpu().long(), want_rows[col])


def test_index_counts_every_row_when_a_column_has_no_winner(device):
    argmax = torch.full((4, 3, 5), -1, device=device, dtype=torch.int16)
    argmax[:, 1] = 2
    buffers = _launch._winner_index_buffers(torch.empty(4, 5, 1, device=device), 3, 6)
    rows, starts = _launch._winner_index(argmax, 0, 3, 6, buffers)
    assert starts[0].tolist() == [0] * 7 and starts[2].tolist() == [0] * 7
    assert starts[1].tolist() == [0, 0, 0, 20, 20, 20, 20]
    assert rows[1].tolist() == list(range(20))


# Interpreter tiles: 16-token grad_D tiles, so 29 and 77 tokens span several; 16 rows a product.
TILES = BwdConfig(16, 16, 16, 128, 4, 1)


def gradients(Q, D, q_mask, d_mask, grad):
    q, d = leaf(Q), leaf(D)
    with settings.use_backend("triton"), forced_configs(bwd=TILES):
        maxsim(q, d, q_mask, d_mask, backward="lowmem").backward(grad)
    return q.grad, d.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("Nq, Lq, Nd, Ld", [(3, 7, 5, 29), (5, 13, 3, 77), (4, 1, 2, 17)])
@pytest.mark.parametrize("chunks", ["one-chunk", "a-column-a-chunk"])
def test_lowmem_grad_d_through_the_index(device, dtype, Nq, Lq, Nd, Ld, chunks, monkeypatch):
    assert _launch._uses_winner_index(TILES, False, Ld)
    if chunks == "a-column-a-chunk":
        monkeypatch.setattr(_launch, "_INDEX_SHARE", 1 << 40)
    Q = torch.randn(Nq, Lq, 96, device=device, dtype=dtype)
    D = torch.randn(Nd, Ld, 96, device=device, dtype=dtype)
    D[:, 1] = D[:, 0]  # tied tokens: the lower index wins every time, so it collects many rows
    q_mask = masks_with_holes((Nq, Lq), device)
    d_mask = masks_with_holes((Nd, Ld), device)
    d_mask[1:, 3] = True  # every document but the fully masked first has a valid token
    grad = torch.randn(Nq, Nd, device=device)
    grad_q, grad_d = gradients(Q, D, q_mask, d_mask, grad)
    clean_q = leaf(torch.where(q_mask[..., None], Q, 0.0).double())
    clean_d = leaf(torch.where(d_mask[..., None], D, 0.0).double())
    maxsim_ref(clean_q, clean_d, q_mask, d_mask).backward(grad.double())
    bound = 1e-2 if dtype == torch.float16 else 1e-5
    assert_close_to_reference(grad_q, clean_q.grad, bound, "grad_Q")
    assert_close_to_reference(grad_d, clean_d.grad, bound, "grad_D")
    assert torch.all(grad_d[0] == 0)  # the fully masked document


def test_chunks_of_the_index_change_no_bit(device, monkeypatch):
    Q = torch.randn(6, 9, 64, device=device, dtype=torch.float16)
    D = torch.randn(7, 50, 64, device=device, dtype=torch.float16)
    grad = torch.randn(6, 7, device=device)
    _, whole = gradients(Q, D, None, None, grad)
    monkeypatch.setattr(_launch, "_INDEX_SHARE", 1 << 40)
    assert _launch._winner_index_cols(Q, 7, 50, torch.empty_like(D)) == 1
    _, chunked = gradients(Q, D, None, None, grad)
    assert torch.equal(whole, chunked)


def test_grad_d_through_the_index_is_bitwise_reproducible(device):
    Q = torch.randn(4, 9, 64, device=device, dtype=torch.float16)
    D = torch.randn(5, 50, 64, device=device, dtype=torch.float16)
    D[:, :10] = D[:, :1]  # many rows on one token: the sum's order is the index's

    def backward_of(q, d):
        with settings.use_backend("triton"), forced_configs(bwd=TILES):
            maxsim(q, d, backward="lowmem").sum().backward()

    assert_backward_bitwise_reproducible(backward_of, Q, D, runs=3)


def test_the_index_is_used_only_where_it_pays_and_fits():
    tiles = bwd_config(Lq=32, dim=128, elem_bytes=2)
    assert not _launch._uses_winner_index(tiles, True, 300)  # per-query candidates: own rows only
    assert not _launch._uses_winner_index(tiles, False, tiles.block_t)  # one token tile
    assert _launch._uses_winner_index(tiles, False, tiles.block_t + 1)
    assert not _launch._uses_winner_index(tiles, False, _launch.WINNER_INDEX_BINS)


def test_documents_past_the_bins_scan_every_row(device, monkeypatch):
    """Without the index (more tokens than bins), the same gradients from the full scan."""
    Q = torch.randn(3, 7, 64, device=device)
    D = torch.randn(4, 40, 64, device=device)
    grad = torch.randn(3, 4, device=device)
    with settings.use_fp32_precision("ieee"):
        indexed = gradients(Q, D, None, None, grad)
        monkeypatch.setattr(_launch, "WINNER_INDEX_BINS", 32)
        assert not _launch._uses_winner_index(TILES, False, 40)
        scanned = gradients(Q, D, None, None, grad)
    torch.testing.assert_close(indexed[1], scanned[1], rtol=1e-6, atol=1e-6)
    assert torch.equal(indexed[0], scanned[0])
