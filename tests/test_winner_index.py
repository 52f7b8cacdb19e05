"""The winner index (each column's rows sorted by the token they won) and the document-owned
grad_D that reads its rows through it, against a stable sort and the float64 reference."""

import pytest
import torch
from helpers import assert_backward_bitwise_reproducible, leaf, masks_with_holes

from fusedmaxsim import forced_plan, maxsim, settings
from fusedmaxsim._launch.backward import _winner_index, _winner_index_buffers
from fusedmaxsim._plan import (
    MEASURED,
    BwdConfig,
    bwd_heuristic,
    index_row_dtype,
    index_tiles,
    plan_backward,
    winner_index_cols,
)
from fusedmaxsim._problem import Problem, options_for
from fusedmaxsim.reference import maxsim_ref
from fusedmaxsim.testing import assert_close_to_reference


@pytest.fixture(autouse=True)
def _index_at_every_size():
    """The index serves problems above 2^32 multiply-adds; these tests' are tiny."""
    with forced_plan(INDEX_MIN_MACS=0):
        yield


def lowmem_plan(tiles, per_query_docs, Nq, Ncols, Lq, Ld, dim, dtype=torch.float32, **forced):
    """The lowmem backward's plan (both gradients, the Triton path) of a problem of these sizes
    under ``tiles`` and the ``forced`` decisions: whether grad_D goes through the winner index,
    and how (no tensors: the planner reads sizes only)."""
    p = Problem(
        layout="candidates" if per_query_docs else "cross", Nq=Nq, Ncols=Ncols, Lq=Lq, Ld=Ld,
        dim=dim, dtype=dtype, device=torch.device("cpu"), has_q_mask=False, has_d_mask=False,
        normalize=False, norm_from_tiles=False, tau=0.0, save_argmax=True, tma_ready=True,
    )
    with forced_plan(bwd_tiles=tiles, **forced):
        return plan_backward(p, options_for(torch.empty(0), "triton"), True, True, "lowmem")


def uses_winner_index(tiles, per_query_docs, Nq, Ncols, Lq, Ld, dim) -> bool:
    return lowmem_plan(tiles, per_query_docs, Nq, Ncols, Lq, Ld, dim).winner_index


def expected_index(argmax: torch.Tensor, col_base: int, n_cols: int, block_t: int, n_tiles: int):
    """Each column's rows whose token falls in each tile, tile after tile, in the scan's order
    (chunks of query tokens, within each the queries in order); and the count of each tile."""
    Nq, _, Lq = argmax.shape
    scan_tokens = min(MEASURED["INDEX_SCAN_TOKENS"], 1 << max(Lq - 1, 0).bit_length())
    order = torch.tensor([i * Lq + s for s0 in range(0, Lq, scan_tokens) for i in range(Nq)
                          for s in range(s0, min(Lq, s0 + scan_tokens))])
    won = argmax[:, col_base:col_base + n_cols].permute(1, 0, 2).reshape(n_cols, Nq * Lq).long()
    rows, counts = [], []
    for tokens in won:
        tiles = torch.where(tokens >= 0, tokens // block_t, -1)[order]
        rows.append(torch.cat([order[tiles == k] for k in range(n_tiles)]))
        counts.append(torch.stack([(tiles == k).sum() for k in range(n_tiles)]))
    return rows, torch.stack(counts)


@pytest.mark.parametrize("Nq, Lq, Ncols, Ld, block_t, col_base, n_cols", [
    (3, 7, 5, 13, 4, 0, 5),    # in the interpreter, two token chunks of 4 (the second partial)
    (9, 11, 4, 40, 16, 1, 2),  # 99 rows in several steps; columns past column 0
    (1, 1, 2, 1, 16, 0, 2),    # one row, one token
])
@pytest.mark.parametrize("tiles_a_scan", [1, 2, 4])  # 4 and 3 tiles: whole and partial groups
@pytest.mark.parametrize("row_dtype", [torch.int16, torch.int32])
def test_index_groups_each_column_by_tile_in_scan_order(
    device, Nq, Lq, Ncols, Ld, block_t, col_base, n_cols, tiles_a_scan, row_dtype
):
    plan = lowmem_plan(BwdConfig(16, block_t, 16, 16, 4, 1), False, Nq, Ncols, Lq, Ld, 1,
                       winner_index=True, INDEX_TILES=tiles_a_scan, index_row_dtype=row_dtype)
    n_tiles = -(-Ld // block_t)
    assert plan.winner_index and plan.index_row_dtype == row_dtype
    assert plan.index_tiles == min(tiles_a_scan, 1 << max(n_tiles - 1, 0).bit_length())
    argmax = torch.randint(-1, Ld, (Nq, Ncols, Lq), device=device, dtype=torch.int16)
    argmax[:, :, 0] = Ld - 1  # the last token, won by many rows
    buffers = _winner_index_buffers(torch.empty(Nq, Lq, 1, device=device), n_cols, n_tiles,
                                    plan.index_row_dtype)
    rows, counts = _winner_index(plan, argmax, col_base, n_cols, buffers)
    assert rows.dtype == row_dtype
    want_rows, want_counts = expected_index(argmax.cpu(), col_base, n_cols, block_t, n_tiles)
    assert torch.equal(counts.cpu().long(), want_counts)
    for col in range(n_cols):
        n = int(want_counts[col].sum())
        assert torch.equal(rows[col, :n].cpu().long(), want_rows[col])


def test_index_of_columns_without_winners(device):
    argmax = torch.full((4, 3, 5), -1, device=device, dtype=torch.int16)
    argmax[:, 1] = 5  # token 5: the second tile of 4 tokens
    plan = lowmem_plan(BwdConfig(16, 4, 16, 16, 4, 1), False, 4, 3, 5, 8, 1, winner_index=True)
    buffers = _winner_index_buffers(torch.empty(4, 5, 1, device=device), 3, 2,
                                    plan.index_row_dtype)
    rows, counts = _winner_index(plan, argmax, 0, 3, buffers)
    assert counts.tolist() == [[0, 0], [0, 20], [0, 0]]
    assert rows[1].tolist() == expected_index(argmax.cpu(), 1, 1, 4, 2)[0][0].tolist()
    assert sorted(rows[1].tolist()) == list(range(20))


def test_index_rows_are_int16_where_every_row_number_fits():
    assert index_row_dtype(256, 128) == torch.int16  # rows 0 .. 32767
    assert index_row_dtype(257, 128) == torch.int32
    plan = lowmem_plan(BwdConfig(16, 32, 16, 16, 4, 1), False, 257, 2, 128, 96, 1,
                       winner_index=True)
    rows, counts = _winner_index_buffers(torch.empty(257, 128, 1), 2, 3, plan.index_row_dtype)
    assert (rows.dtype, rows.shape, counts.dtype) == (torch.int32, (2, 257 * 128), torch.int32)


def test_index_chunks_are_even():
    """Columns in chunks of at most the memory share's, the chunks as even as their count allows."""
    row_dtype = index_row_dtype(4, 8)
    column_bytes = 2 * 4 * 8 + 4 * 3  # int16 rows and int32 counts
    assert row_dtype == torch.int16
    with forced_plan(INDEX_SHARE=1):
        for most, chunk in ((5, 4), (3, 3), (2, 2), (4, 4), (7, 7), (100, 7), (1, 1)):
            budget = most * column_bytes
            grad_d = torch.empty(budget // 2, dtype=torch.float16)
            grad_d_bytes = grad_d.numel() * grad_d.element_size()
            assert winner_index_cols(4, 8, 7, 3, grad_d_bytes, row_dtype) == chunk, most


def test_index_scans_one_tile_at_a_time_where_its_fields_could_overflow():
    """Four tiles share an int64 in 16-bit fields, whose per-slot counts take one a step."""
    assert index_tiles(16, 128, 128, 128, scan=1024) == 4
    assert index_tiles(3, 128, 128, 128, scan=1024) == 4
    assert index_tiles(2, 128, 128, 128, scan=1024) == 2
    assert index_tiles(16, (1 << 16) * 8 - 8, 128, 128, scan=1024) == 4  # 2^16 - 1 steps
    assert index_tiles(16, (1 << 16) * 8, 128, 128, scan=1024) == 1


# Interpreter tiles: 16-token grad_D tiles, so 29 and 77 tokens span several; 16 rows a product.
TILES = BwdConfig(16, 16, 16, 128, 4, 1)


def gradients(Q, D, q_mask, d_mask, grad):
    q, d = leaf(Q), leaf(D)
    with settings.use_backend("triton"), forced_plan(bwd_tiles=TILES):
        maxsim(q, d, q_mask, d_mask, backward="lowmem").backward(grad)
    return q.grad, d.grad


def reference_gradients(Q, D, q_mask, d_mask, grad):
    """The float64 gradients, masked tokens zeroed first (what they hold must not matter)."""
    q = leaf(torch.where(q_mask[..., None], Q, 0.0).double())
    d = leaf(torch.where(d_mask[..., None], D, 0.0).double())
    maxsim_ref(q, d, q_mask, d_mask).backward(grad.double())
    return q.grad, d.grad


def test_nan_in_masked_tokens_stays_out_of_the_index(device):
    """The indexed grad_D loads every indexed row's query tokens without looking at its argmax
    (each row there won a token): a masked query token, NaN here, must never be such a row, and
    a masked document token never wins one."""
    assert uses_winner_index(TILES, False, 4, 5, 9, 40, 96)
    Q = torch.randn(4, 9, 96, device=device)
    D = torch.randn(5, 40, 96, device=device)
    q_mask = masks_with_holes((4, 9), device)
    d_mask = masks_with_holes((5, 40), device)
    d_mask[1:, 3] = True
    grad = torch.randn(4, 5, device=device)
    ref_q, ref_d = reference_gradients(Q, D, q_mask, d_mask, grad)
    Q[~q_mask] = float("nan")
    D[~d_mask] = float("nan")
    grad_q, grad_d = gradients(Q, D, q_mask, d_mask, grad)
    assert torch.isfinite(grad_d).all() and torch.isfinite(grad_q).all()
    assert_close_to_reference(grad_d, ref_d, 1e-5, "grad_D")
    assert_close_to_reference(grad_q, ref_q, 1e-5, "grad_Q")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("Nq, Lq, Nd, Ld", [(3, 7, 5, 29), (5, 13, 3, 77), (4, 1, 2, 17)])
@pytest.mark.parametrize("chunks", ["one-chunk", "a-column-a-chunk"])
def test_lowmem_grad_d_through_the_index(device, dtype, Nq, Lq, Nd, Ld, chunks):
    assert uses_winner_index(TILES, False, Nq, Nd, Lq, Ld, 96)
    share = {"INDEX_SHARE": 1 << 40} if chunks == "a-column-a-chunk" else {}
    assert lowmem_plan(TILES, False, Nq, Nd, Lq, Ld, 96, dtype, **share).index_cols == (
        1 if share else Nd)
    Q = torch.randn(Nq, Lq, 96, device=device, dtype=dtype)
    D = torch.randn(Nd, Ld, 96, device=device, dtype=dtype)
    D[:, 1] = D[:, 0]  # tied tokens: the lower index wins every time, so it collects many rows
    q_mask = masks_with_holes((Nq, Lq), device)
    d_mask = masks_with_holes((Nd, Ld), device)
    d_mask[1:, 3] = True  # every document but the fully masked first has a valid token
    grad = torch.randn(Nq, Nd, device=device)
    with forced_plan(**share):
        grad_q, grad_d = gradients(Q, D, q_mask, d_mask, grad)
    ref_q, ref_d = reference_gradients(Q, D, q_mask, d_mask, grad)
    bound = 1e-2 if dtype == torch.float16 else 1e-5
    assert_close_to_reference(grad_q, ref_q, bound, "grad_Q")
    assert_close_to_reference(grad_d, ref_d, bound, "grad_D")
    assert torch.all(grad_d[0] == 0)  # the fully masked document


def test_fp16_grad_d_takes_a_loss_scaled_gradient(device):
    """A gradient scaler's ``g`` can pass fp16's largest value (65504) where ``g · Q`` does not:
    fp16 rows are weighted before the product, not through ``g`` in the one-hot."""
    Q = (torch.randn(3, 7, 64, device=device) / 100).half()
    D = (torch.randn(4, 40, 64, device=device) / 100).half()
    grad = 1e5 * torch.randn(3, 4, device=device)
    grad_q, grad_d = gradients(Q, D, None, None, grad)
    q, d = leaf(Q.double()), leaf(D.double())
    maxsim_ref(q, d).backward(grad.double())
    assert_close_to_reference(grad_d, d.grad, 1e-2, "grad_D")
    assert_close_to_reference(grad_q, q.grad, 1e-2, "grad_Q")


@pytest.mark.parametrize("per_query_docs", [False, True], ids=["cross", "candidates"])
def test_fp16_grad_d_scales_each_document_by_its_own_gradients(device, per_query_docs):
    """fp16 ``g`` is brought into range per document (column): a document whose gradients are
    1e-2 keeps its digits beside one whose gradients reach 1e4 (one scale for all would take
    them below fp16's normal range), one entry past fp16's largest value does not overflow, and
    a document of zero gradients gets zeros. Checked document by document, since one bound over
    the whole tensor would not see the small documents."""
    Q = (torch.randn(3, 7, 64, device=device) / 10).half()
    shape = (3, 4, 40, 64) if per_query_docs else (4, 40, 64)
    D = (torch.randn(*shape, device=device) / 10).half()
    scales = torch.tensor([1e4, 1e-2, 0.0, 3.0], device=device)
    grad = torch.randn(3, 4, device=device) * scales
    grad[0, 3] = 7e4  # one entry past fp16's range in a document of small ones
    grad_q, grad_d = gradients(Q, D, None, None, grad)
    q, d = leaf(Q.double()), leaf(D.double())
    maxsim_ref(q, d).backward(grad.double())
    docs = d.grad.shape[-3]
    for j in range(docs):
        assert_close_to_reference(grad_d[..., j, :, :], d.grad[..., j, :, :], 1e-2,
                                  f"grad_D of document {j}")
    assert torch.all(grad_d[..., 2, :, :] == 0)
    assert_close_to_reference(grad_q, q.grad, 1e-2, "grad_Q")


def test_chunks_of_the_index_change_no_bit(device):
    Q = torch.randn(6, 9, 64, device=device, dtype=torch.float16)
    D = torch.randn(7, 50, 64, device=device, dtype=torch.float16)
    grad = torch.randn(6, 7, device=device)
    assert lowmem_plan(TILES, False, 6, 7, 9, 50, 64, torch.float16).index_cols == 7
    _, whole = gradients(Q, D, None, None, grad)
    with forced_plan(INDEX_SHARE=1 << 40):
        row_dtype = index_row_dtype(6, 9)
        assert winner_index_cols(6, 9, 7, 4, D.numel() * D.element_size(), row_dtype) == 1
        assert lowmem_plan(TILES, False, 6, 7, 9, 50, 64, torch.float16).index_cols == 1
        _, chunked = gradients(Q, D, None, None, grad)
    assert torch.equal(whole, chunked)


def test_grad_d_through_the_index_is_bitwise_reproducible(device):
    Q = torch.randn(4, 9, 64, device=device, dtype=torch.float16)
    D = torch.randn(5, 50, 64, device=device, dtype=torch.float16)
    D[:, :10] = D[:, :1]  # many rows on one token: the sum's order is the index's

    def backward_of(q, d):
        with settings.use_backend("triton"), forced_plan(bwd_tiles=TILES):
            maxsim(q, d, backward="lowmem").sum().backward()

    assert_backward_bitwise_reproducible(backward_of, Q, D, runs=3)


def test_the_index_is_used_where_a_column_has_several_tiles_and_the_gpu_decides():
    tiles = bwd_heuristic(32, 128, 2, False)

    def uses(*args):
        with forced_plan(INDEX_MIN_MACS=1 << 32):
            return uses_winner_index(*args)

    assert uses(tiles, False, 128, 128, 32, 300, 128)  # train_colbert
    assert uses(tiles, False, 128, 128, 128, 1 << 16, 128)  # long documents: no length limit
    assert not uses(tiles, True, 128, 128, 32, 300, 128)  # per-query candidates: own rows only
    assert not uses(tiles, False, 1024, 1024, 32, tiles.block_t, 128)  # one token tile
    assert not uses(tiles, False, 32, 32, 32, 180, 128)  # host-bound: two launches more lose


def test_one_token_tile_scans_every_row(device):
    """Documents of one tile take the scan without an index: the same gradients."""
    Q = torch.randn(3, 7, 64, device=device)
    D = torch.randn(4, 40, 64, device=device)
    grad = torch.randn(3, 4, device=device)
    with settings.use_fp32_precision("ieee"):
        indexed = gradients(Q, D, None, None, grad)
        q, d = leaf(Q), leaf(D)
        one_tile = BwdConfig(16, 64, 16, 128, 4, 1)
        with settings.use_backend("triton"), forced_plan(bwd_tiles=one_tile):
            assert not uses_winner_index(one_tile, False, 3, 4, 7, 40, 64)
            maxsim(q, d, backward="lowmem").backward(grad)
    torch.testing.assert_close(indexed[1], d.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(indexed[0], q.grad, rtol=1e-6, atol=1e-6)
