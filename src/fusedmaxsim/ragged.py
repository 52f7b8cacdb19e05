"""MaxSim on ragged inputs: packed sequences, sparse pair lists, padded candidates, lists.

Every function here scores with the one MaxSim inner loop of the dense path and keeps its
semantics (see :mod:`fusedmaxsim.api`): fp32 scores (float64 for float64 inputs), masked or empty
sequences score 0, NaN propagates, ties go to the lowest document-token index, gradients come in
the input dtype and only those needed are computed, fp32 is never computed in half precision.

Packed layout (FlashAttention's ``cu_seqlens`` convention)
----------------------------------------------------------
``Q_packed [ΣLq, d]`` holds the queries' tokens back to back and ``cu_seqlens_q [Nq + 1]`` (int32
or int64, starting at 0, non-decreasing, ending at ``ΣLq``) where each starts: query ``i`` is
``Q_packed[cu_seqlens_q[i]:cu_seqlens_q[i + 1]]``. Documents likewise. Padding is never stored,
read or computed: a 30-token passage costs 30 tokens, whatever the longest one is.

Offsets may live on the CPU or on the tokens' device. ``max_seqlen_q`` / ``max_seqlen_d`` are the
longest lengths; they choose tiles and bound the saved argmax, and no loop runs to them.

* Given for offsets on the GPU, nothing synchronizes with the host: the offsets' values are then
  trusted, and a sequence longer than its promised maximum scores NaN (no out-of-bounds access,
  no dead CUDA context; malformed offsets give wrong numbers, never a crash). ``validate=True``
  checks everything at the cost of one synchronization.
* Omitted, they are read from the offsets: one synchronization, which also checks every value.
* Offsets on the CPU are always checked (it costs nothing), unless ``validate=False``.

A failed check is a ``ValueError`` raised before anything runs on the device.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import NamedTuple

import torch
from torch import Tensor

from . import _blocked, _ops, settings
from ._validate import _check_float, _check_mask, check_backward, check_same_space, promote_pair, select_backend

__all__ = [
    "PackedBatch",
    "maxsim_padded",
    "maxsim_ragged",
    "maxsim_varlen",
    "pack_padded",
    "score_pairs_packed",
]


# --------------------------------------------------------------------------------------------
# Layout and checks
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RaggedLayout:
    """Which (query, document) pairs are scored, and where each sequence's tokens lie.

    ``pair_q`` / ``pair_d`` name the pairs of a pair list; without them every query meets the
    documents ``[col_lo, col_hi)``. ``max_q`` / ``max_d`` are the promised maximum lengths.
    """

    cu_q: Tensor
    cu_d: Tensor
    rows_q: int
    rows_d: int
    max_q: int
    max_d: int
    pair_q: Tensor | None = None
    pair_d: Tensor | None = None
    col_lo: int = 0
    col_hi: int | None = None  # None: the last document

    @property
    def n_queries(self) -> int:
        return self.cu_q.numel() - 1

    @property
    def n_docs(self) -> int:
        return self.cu_d.numel() - 1

    @property
    def n_cols(self) -> int:
        return (self.n_docs if self.col_hi is None else self.col_hi) - self.col_lo

    @property
    def n_pairs(self) -> int:
        return 0 if self.pair_q is None else self.pair_q.numel()

    def columns(self, lo: int, hi: int) -> RaggedLayout:
        """The cross product restricted to the documents ``[lo, hi)``."""
        return dataclasses.replace(self, col_lo=lo, col_hi=hi)


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _to_device(t: Tensor, device: torch.device) -> Tensor:
    """A host index tensor on the tokens' device, copied without synchronizing the host."""
    if t.device == device:
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_index(name: str, t: object, device: torch.device, what: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor ({what}), got {type(t).__name__}")
    dtype = t.dtype
    if dtype not in _INDEX_DTYPES:
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor (int32 or int64), got {dtype}")
        t = t.long()
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D ({what}), got shape {_shape(t)}")
    where = t.device
    if where != device and where.type != "cpu":
        raise ValueError(f"{name} is on {where} but the tokens are on {device}")
    return t


def _check_offsets(name: str, cu: object, device: torch.device) -> Tensor:
    cu = _check_index(name, cu, device, "offsets [N + 1]")
    if cu.numel() == 0:
        raise ValueError(f"{name} must hold N + 1 offsets starting at 0, got an empty tensor")
    return cu


def _check_max_seqlen(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or None, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _check_validate(validate: object) -> bool | None:
    if validate not in (None, True, False):
        raise TypeError(f"validate must be True, False or None, got {validate!r}")
    return validate


def _offset_facts(cu: Tensor) -> Tensor:
    """``[first, last, shortest, longest]`` of a 1-D offsets tensor, on its device, as int64."""
    cu = cu.long()
    if cu.numel() == 1:
        return torch.stack([cu[0], cu[0], cu.new_zeros(()), cu.new_zeros(())])
    lengths = cu[1:] - cu[:-1]
    return torch.stack([cu[0], cu[-1], lengths.min(), lengths.max()])


def _index_facts(idx: Tensor) -> Tensor:
    """``[lowest, highest]`` of an index tensor (``[0, -1]`` when empty: nothing to refuse)."""
    idx = idx.long()
    if idx.numel() == 0:
        return torch.tensor([0, -1], device=idx.device)
    return torch.stack([idx.min(), idx.max()])


def _check_offset_values(name, facts, rows, tokens, max_len, max_name) -> None:
    first, last, shortest, longest = facts
    if first != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {first}")
    if shortest < 0:
        raise ValueError(
            f"{name} must be non-decreasing (every length >= 0); it holds a length of {shortest}"
        )
    if last != rows:
        raise ValueError(
            f"{name} must end at the number of packed rows, {tokens}.shape[0] = {rows}; "
            f"got {name}[-1] = {last}"
        )
    if max_len is not None and longest > max_len:
        raise ValueError(
            f"{max_name}={max_len} is below the longest sequence in {name} ({longest} tokens)"
        )


def _check_pair_values(name: str, facts, count: int, cu_name: str) -> None:
    low, high = facts
    if low < 0 or high >= count:
        raise ValueError(
            f"{name} must index the {count} sequences of {cu_name} (0 <= index < {count}), "
            f"got indices in [{low}, {high}]"
        )


def build_layout(
    Q: Tensor,
    D: Tensor,
    cu_seqlens_q: object,
    cu_seqlens_d: object,
    max_seqlen_q: object,
    max_seqlen_d: object,
    pair_q_idx: object = None,
    pair_d_idx: object = None,
    *,
    validate: object = None,
    q_name: str = "Q_packed",
    d_name: str = "D_packed",
) -> RaggedLayout:
    """Check offsets, maxima and pair indices (values: see the module docstring) and move them
    to the tokens' device. At most one host synchronization, and none when the maxima are given
    for offsets on the GPU without ``validate=True``."""
    validate = _check_validate(validate)
    device = Q.device
    cu_q = _check_offsets("cu_seqlens_q", cu_seqlens_q, device)
    cu_d = _check_offsets("cu_seqlens_d", cu_seqlens_d, device)
    max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_d = _check_max_seqlen("max_seqlen_d", max_seqlen_d)
    pairs = pair_q_idx is not None or pair_d_idx is not None
    if pairs:
        if pair_q_idx is None or pair_d_idx is None:
            raise ValueError("pair_q_idx and pair_d_idx go together; got only one of them")
        pair_q = _check_index("pair_q_idx", pair_q_idx, device, "query index of each pair [P]")
        pair_d = _check_index("pair_d_idx", pair_d_idx, device, "document index of each pair [P]")
        if pair_q.shape != pair_d.shape:
            raise ValueError(
                f"pair_q_idx and pair_d_idx must have the same length, got {_shape(pair_q)} "
                f"and {_shape(pair_d)}"
            )
    rows_q, rows_d = Q.shape[0], D.shape[0]
    tensors = [cu_q, cu_d, pair_q, pair_d] if pairs else [cu_q, cu_d]
    needs_max = [max_q is None, max_d is None, False, False]
    remote = [n for n, t in enumerate(tensors) if t.device.type != "cpu"]
    sync = validate is True or any(needs_max[n] for n in remote)
    local = [
        n for n, t in enumerate(tensors)
        if t.device.type == "cpu" and (validate is not False or needs_max[n])
    ]
    facts: dict[int, list[int]] = {}
    if (sync and remote) or local:  # the fast path (GPU offsets, maxima given) skips all this
        summarize = [_offset_facts, _offset_facts, _index_facts, _index_facts]
        if sync and remote:
            summaries = [summarize[n](tensors[n]) for n in remote]
            values = torch.cat(summaries).tolist()  # the one host synchronization
            for n, summary in zip(remote, summaries):
                facts[n], values = values[: summary.numel()], values[summary.numel() :]
        for n in local:
            facts[n] = summarize[n](tensors[n]).tolist()
        if validate is not False:
            checks = [
                lambda f: _check_offset_values(
                    "cu_seqlens_q", f, rows_q, q_name, max_q, "max_seqlen_q"),
                lambda f: _check_offset_values(
                    "cu_seqlens_d", f, rows_d, d_name, max_d, "max_seqlen_d"),
                lambda f: _check_pair_values(
                    "pair_q_idx", f, cu_q.numel() - 1, "cu_seqlens_q"),
                lambda f: _check_pair_values(
                    "pair_d_idx", f, cu_d.numel() - 1, "cu_seqlens_d"),
            ]
            for n in sorted(facts):
                checks[n](facts[n])
    max_q = max(0, facts[0][3]) if max_q is None else max_q
    max_d = max(0, facts[1][3]) if max_d is None else max_d
    return RaggedLayout(
        cu_q=_to_device(cu_q, device),
        cu_d=_to_device(cu_d, device),
        rows_q=rows_q,
        rows_d=rows_d,
        max_q=max_q,
        max_d=max_d,
        pair_q=_to_device(pair_q, device) if pairs else None,
        pair_d=_to_device(pair_d, device) if pairs else None,
    )


def _check_tokens(Q: object, D: object, q_name: str, d_name: str) -> tuple[Tensor, Tensor]:
    Q = _check_float(q_name, Q)
    D = _check_float(d_name, D)
    for name, t, what in ((q_name, Q, "ΣLq"), (d_name, D, "ΣLd")):
        if t.dim() != 2:
            raise ValueError(
                f"{name} must be 2-D [{what}, d] (tokens packed back to back), got shape "
                f"{_shape(t)}; padded batches go to fusedmaxsim.maxsim or maxsim_padded"
            )
    check_same_space(Q, D, q_name, d_name)
    return promote_pair(Q, D)


def _check_packed_mask(name: str, mask: object, rows: int, owner: str, device) -> Tensor | None:
    return _check_mask(name, mask, (rows,), owner, device, axes="one entry per packed row")


# --------------------------------------------------------------------------------------------
# The PyTorch path: the packed sequences are padded a bounded block at a time and scored by the
# dense path's blocked implementation, so that both paths share one contract.
# --------------------------------------------------------------------------------------------


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _lengths(cu: Tensor, rows: int) -> Tensor:
    """Sequence lengths, with offsets clamped into ``[0, rows]`` as the kernels clamp them."""
    cu = cu.long()
    lo = cu[:-1].clamp(0, rows)
    hi = torch.maximum(cu[1:].clamp(max=rows), lo)
    return hi - lo


def _padded_rows(cu: Tensor, seqs: Tensor, width: int, rows: int) -> tuple[Tensor, Tensor]:
    """Packed row of every slot of a ``[len(seqs), width]`` padded view, and which slots hold a
    token of their sequence (the rows of the others are clamped into range and never matter)."""
    cu = cu.long()
    lo = cu[seqs].clamp(0, rows)
    hi = torch.maximum(cu[seqs + 1].clamp(max=rows), lo)
    slots = torch.arange(width, device=cu.device)
    inside = slots < (hi - lo)[:, None]
    return (lo[:, None] + slots).clamp(max=max(rows - 1, 0)), inside


def _gather(x: Tensor | None, idx: Tensor) -> Tensor | None:
    if x is None:
        return None
    if x.shape[0] == 0:
        return x.new_zeros((*idx.shape, *x.shape[1:]))
    return x[idx]


@dataclasses.dataclass
class _Padded:
    """Some sequences of one side gathered into a padded block."""

    rows: Tensor  # [n, width] packed row of each slot
    inside: Tensor  # [n, width] the slot holds a token of its sequence
    valid: Tensor  # inside, and not masked
    tokens: Tensor  # [n, width, d]
    inv: Tensor | None  # [n, width] inverse norms


def _pad(cu, seqs, width, rows, X, mask, inv, keep=None) -> _Padded:
    idx, inside = _padded_rows(cu, seqs, width, rows)
    if keep is not None:
        inside = inside & keep[:, None]
    valid = inside if mask is None else inside & _gather(mask, idx)
    return _Padded(idx, inside, valid, _gather(X, idx), _gather(inv, idx))


def _column_groups(lengths: list[int], max_len: int, dim: int, budget: int):
    """Consecutive documents whose padded block (``count · width · d``) fits the budget, each
    padded to its own longest document, not the corpus's."""
    start, width = 0, 0
    for n, length in enumerate(lengths):
        w = max(width, min(length, max_len))
        if n > start and (n + 1 - start) * max(w, 1) * dim > budget:
            yield start, n, width
            start, w = n, min(length, max_len)
        width = w
    if start < len(lengths):
        yield start, len(lengths), width


def _too_long(lengths: Tensor, bound: int) -> Tensor:
    return lengths > bound


def _cross_fwd_torch(layout, Q, D, q_mask, d_mask, q_inv, d_inv, save_argmax, block_bytes):
    ct = _compute_dtype(Q)
    device, dim = Q.device, Q.shape[1]
    n_q, n_cols, rows_q = layout.n_queries, layout.n_cols, layout.rows_q
    scores = torch.zeros((n_q, n_cols), dtype=ct, device=device)
    argmax_shape = (n_cols, rows_q) if save_argmax else (0,)
    argmax = torch.full(argmax_shape, -1, dtype=torch.int32, device=device)
    if n_q == 0 or n_cols == 0:
        return scores, argmax
    len_q = _lengths(layout.cu_q, rows_q)
    len_d = _lengths(layout.cu_d[layout.col_lo : layout.col_lo + n_cols + 1], layout.rows_d)
    width_q = min(int(len_q.max()), layout.max_q)
    qp = _pad(layout.cu_q, torch.arange(n_q, device=device), width_q, rows_q, Q, q_mask, q_inv)
    q_rows = qp.rows[qp.inside]
    for c0, c1, width_d in _column_groups(len_d.tolist(), layout.max_d, dim, block_bytes // 4):
        docs = torch.arange(layout.col_lo + c0, layout.col_lo + c1, device=device)
        dp = _pad(layout.cu_d, docs, width_d, layout.rows_d, D, d_mask, d_inv)
        s, a = _blocked.maxsim_fwd_blocked(
            qp.tokens, dp.tokens, qp.valid, dp.valid, qp.inv, dp.inv, save_argmax, block_bytes
        )
        scores[:, c0:c1] = s
        if save_argmax:
            argmax[c0:c1, q_rows] = a.permute(1, 0, 2)[:, qp.inside].to(argmax.dtype)
    # As on the GPU: a sequence longer than its promised maximum scores NaN.
    broken = _too_long(len_q, layout.max_q)[:, None] | _too_long(len_d, layout.max_d)[None, :]
    return torch.where(broken, float("nan"), scores), argmax


def _cross_bwd_torch(layout, grad, Q, D, argmax, q_inv, d_inv, need_q, need_d, block_bytes):
    ct = _compute_dtype(Q)
    device, dim = Q.device, Q.shape[1]
    n_q, n_cols, rows_q = layout.n_queries, layout.n_cols, layout.rows_q
    grad_q = torch.zeros(Q.shape, dtype=ct, device=device) if need_q else None
    grad_d = torch.zeros(D.shape, dtype=ct, device=device) if need_d else None
    if n_q == 0 or n_cols == 0:
        return grad_q, grad_d
    len_q = _lengths(layout.cu_q, rows_q)
    len_d = _lengths(layout.cu_d, layout.rows_d)
    width_q = min(int(len_q.max()), layout.max_q)
    qp = _pad(layout.cu_q, torch.arange(n_q, device=device), width_q, rows_q, Q, None, q_inv)
    q_rows = qp.rows[qp.inside]
    grad_qp = torch.zeros((n_q, width_q, dim), dtype=ct, device=device) if need_q else None
    for c0, c1, width_d in _column_groups(len_d.tolist(), layout.max_d, dim, block_bytes // 4):
        docs = torch.arange(c0, c1, device=device)
        dp = _pad(layout.cu_d, docs, width_d, layout.rows_d, D, None, d_inv)
        arg = torch.full((c1 - c0, n_q, width_q), -1, dtype=torch.int32, device=device)
        arg[:, qp.inside] = argmax[c0:c1, q_rows]
        gq, gd = _blocked.maxsim_bwd_blocked(
            grad[:, c0:c1], qp.tokens, dp.tokens, arg.permute(1, 0, 2), qp.inv, dp.inv,
            need_q, need_d, True, block_bytes,
        )
        if need_q:
            grad_qp += gq
        if need_d:
            grad_d[dp.rows[dp.inside]] = gd[dp.inside]
    if need_q:
        grad_q[q_rows] = grad_qp[qp.inside]
    return grad_q, grad_d


class _PairBlocks:
    """The pair list in blocks of pairs, each side padded to its longest sequence (capped by the
    promised maximum), a block holding at most the PyTorch path's budget of tokens."""

    def __init__(self, layout, dim: int, block_bytes: int):
        self.layout = layout
        self.len_q = _lengths(layout.cu_q, layout.rows_q)
        self.len_d = _lengths(layout.cu_d, layout.rows_d)
        self.width_q = min(int(self.len_q.max()) if self.len_q.numel() else 0, layout.max_q)
        self.width_d = min(int(self.len_d.max()) if self.len_d.numel() else 0, layout.max_d)
        per_pair = max(1, (self.width_q + self.width_d) * max(dim, 1))
        self.step = max(1, (block_bytes // 4) // per_pair)

    def __iter__(self):
        layout = self.layout
        for p0 in range(0, layout.n_pairs, self.step):
            sl = slice(p0, min(layout.n_pairs, p0 + self.step))
            pq, pd = layout.pair_q[sl].long(), layout.pair_d[sl].long()
            ok = (pq >= 0) & (pq < layout.n_queries) & (pd >= 0) & (pd < layout.n_docs)
            yield sl, torch.where(ok, pq, 0), torch.where(ok, pd, 0), ok

    def pad(self, pq, pd, ok, Q, D, q_mask, d_mask, q_inv, d_inv) -> tuple[_Padded, _Padded]:
        layout = self.layout
        qp = _pad(layout.cu_q, pq, self.width_q, layout.rows_q, Q, q_mask, q_inv, keep=ok)
        dp = _pad(layout.cu_d, pd, self.width_d, layout.rows_d, D, d_mask, d_inv, keep=ok)
        return qp, dp


def _pairs_fwd_torch(layout, Q, D, q_mask, d_mask, q_inv, d_inv, save_argmax, block_bytes):
    ct = _compute_dtype(Q)
    n_pairs = layout.n_pairs
    scores = torch.zeros(n_pairs, dtype=ct, device=Q.device)
    argmax = torch.full(
        (n_pairs, layout.max_q) if save_argmax else (0,), -1, dtype=torch.int32, device=Q.device
    )
    if n_pairs == 0:
        return scores, argmax
    if layout.n_queries == 0 or layout.n_docs == 0:  # every index is out of range
        return scores.fill_(float("nan")), argmax
    blocks = _PairBlocks(layout, Q.shape[1], block_bytes)
    for sl, pq, pd, ok in blocks:
        qp, dp = blocks.pad(pq, pd, ok, Q, D, q_mask, d_mask, q_inv, d_inv)
        s, a = _blocked.maxsim_fwd_blocked(
            qp.tokens, dp.tokens.unsqueeze(1), qp.valid, dp.valid.unsqueeze(1), qp.inv,
            None if dp.inv is None else dp.inv.unsqueeze(1), save_argmax, block_bytes,
        )
        broken = ~ok | _too_long(blocks.len_q[pq], layout.max_q)
        broken = broken | _too_long(blocks.len_d[pd], layout.max_d)
        scores[sl] = torch.where(broken, float("nan"), s[:, 0])
        if save_argmax:
            argmax[sl, : blocks.width_q] = a[:, 0].to(argmax.dtype)
    return scores, argmax


def _pairs_bwd_torch(layout, grad, Q, D, argmax, q_inv, d_inv, need_q, need_d, block_bytes):
    ct = _compute_dtype(Q)
    grad_q = torch.zeros(Q.shape, dtype=ct, device=Q.device) if need_q else None
    grad_d = torch.zeros(D.shape, dtype=ct, device=D.device) if need_d else None
    if layout.n_pairs == 0 or layout.n_queries == 0 or layout.n_docs == 0:
        return grad_q, grad_d
    blocks = _PairBlocks(layout, Q.shape[1], block_bytes)
    for sl, pq, pd, ok in blocks:
        qp, dp = blocks.pad(pq, pd, ok, Q, D, None, None, q_inv, d_inv)
        gq, gd = _blocked.maxsim_bwd_blocked(
            grad[sl].unsqueeze(1), qp.tokens, dp.tokens.unsqueeze(1),
            argmax[sl, : blocks.width_q].unsqueeze(1), qp.inv,
            None if dp.inv is None else dp.inv.unsqueeze(1), need_q, need_d, True, block_bytes,
        )
        # Pairs share queries and documents: their gradients add up (index_put_ with
        # accumulate sorts the indices on CUDA: deterministic, where index_add_ uses atomics).
        if need_q:
            grad_q.index_put_((qp.rows[qp.inside],), gq[qp.inside], accumulate=True)
        if need_d:
            grad_d.index_put_((dp.rows[dp.inside],), gd[:, 0][dp.inside], accumulate=True)
    return grad_q, grad_d


# --------------------------------------------------------------------------------------------
# Dispatch and autograd
# --------------------------------------------------------------------------------------------


def _launch():
    from . import _launch_ragged  # imports triton only when a Triton path runs

    return _launch_ragged


def forward_impl(layout, Q, D, q_mask, d_mask, q_inv, d_inv, save_argmax, backend, fp32_precision):
    """Scores and (when ``save_argmax``) the argmax, on the path ``backend`` names."""
    args = (layout, Q, D, q_mask, d_mask, q_inv, d_inv, save_argmax)
    if backend == "triton":
        return _launch().ragged_fwd(*args, fp32_precision)
    fwd = _pairs_fwd_torch if layout.pair_q is not None else _cross_fwd_torch
    return fwd(*args, settings.torch_block_bytes())


def _backward_impl(layout, grad, Q, D, argmax, q_inv, d_inv, need_q, need_d, strategy, fp32_out,
                   backend, fp32_precision):
    if backend == "triton":
        return _launch().ragged_bwd(
            layout, grad, Q, D, argmax, q_inv, d_inv, need_q, need_d, strategy, fp32_out,
            fp32_precision,
        )
    bwd = _pairs_bwd_torch if layout.pair_q is not None else _cross_bwd_torch
    grad_q, grad_d = bwd(layout, grad, Q, D, argmax, q_inv, d_inv, need_q, need_d,
                         settings.torch_block_bytes())
    keep = fp32_out and Q.dtype != torch.float64
    out_q = torch.float32 if keep else Q.dtype
    out_d = torch.float32 if keep else D.dtype
    return (grad_q.to(out_q) if need_q else None), (grad_d.to(out_d) if need_d else None)


def resolve_strategy(strategy: str) -> str:
    """``auto``: "lowmem" under ``torch.use_deterministic_algorithms(True)``, else "unified" (its
    split gather keeps the GPU busy when few queries own many pairs); "unified" under
    deterministic algorithms is refused as in the dense path."""
    _ops.refuse_nondeterministic(strategy)
    if strategy == "auto":
        return "lowmem" if torch.are_deterministic_algorithms_enabled() else "unified"
    return strategy


class RaggedMaxSimFunction(torch.autograd.Function):
    """Autograd of the packed layouts: the forward saves the argmax, the backward gathers."""

    @staticmethod
    def forward(ctx, Q, D, layout, q_mask, d_mask, q_inv, d_inv, backend, fp32_precision, strategy):
        scores, argmax = forward_impl(
            layout, Q, D, q_mask, d_mask, q_inv, d_inv, True, backend, fp32_precision
        )
        ctx.save_for_backward(Q, D, argmax, q_inv, d_inv)
        ctx.layout, ctx.backend = layout, backend
        ctx.fp32_precision, ctx.strategy = fp32_precision, strategy
        return scores

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_scores):
        Q, D, argmax, q_inv, d_inv = ctx.saved_tensors
        need_q, need_d = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        none = (None,) * 8
        if not (need_q or need_d):
            return None, None, *none
        normalize = q_inv is not None
        grad_q, grad_d = _backward_impl(
            ctx.layout, grad_scores.to(_compute_dtype(Q)), Q, D, argmax, q_inv, d_inv, need_q,
            need_d, resolve_strategy(ctx.strategy), normalize, ctx.backend,
            ctx.fp32_precision,
        )
        if normalize:
            grad_q = _ops.normalize_backward(Q, grad_q, q_inv) if need_q else None
            grad_d = _ops.normalize_backward(D, grad_d, d_inv) if need_d else None
        return (grad_q if need_q else None), (grad_d if need_d else None), *none


def score_layout(layout, Q, D, q_mask, d_mask, normalize: bool, strategy: str) -> Tensor:
    """Scores of ``layout``'s pairs, with autograd when a gradient will be needed."""
    backend = select_backend(Q)
    q_inv = _ops.inverse_norms(Q, backend) if normalize else None
    d_inv = _ops.inverse_norms(D, backend) if normalize else None
    fp32_precision = settings.fp32_precision()
    if torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad):
        return RaggedMaxSimFunction.apply(
            Q, D, layout, q_mask, d_mask, q_inv, d_inv, backend, fp32_precision, strategy
        )
    return forward_impl(
        layout, Q, D, q_mask, d_mask, q_inv, d_inv, False, backend, fp32_precision
    )[0]


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def maxsim_varlen(
    Q_packed: Tensor,
    D_packed: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_d: Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_d: int | None = None,
    *,
    q_mask: Tensor | None = None,
    d_mask: Tensor | None = None,
    normalize: bool = False,
    backward: str | None = None,
    validate: bool | None = None,
) -> Tensor:
    """MaxSim of every packed query against every packed document, ``[Nq, Nd]``, with autograd.

    Each document is read over its own length, so ragged corpora cost their real size, not
    ``Nd × max_seqlen_d``; the saved argmax is ``[Nd, ΣLq]`` int32, with no padding either.

    Args:
        Q_packed (torch.Tensor): query tokens back to back, shape `[ΣLq, d]`.
        D_packed (torch.Tensor): document tokens back to back, shape `[ΣLd, d]`.
        cu_seqlens_q (torch.Tensor): `[Nq + 1]` int32 or int64 offsets into ``Q_packed``.
        cu_seqlens_d (torch.Tensor): `[Nd + 1]` offsets into ``D_packed``.
        max_seqlen_q (int, optional): the longest query. Given (with ``max_seqlen_d``) for offsets
            on the GPU, no host synchronization happens. See the module docstring.
        max_seqlen_d (int, optional): the longest document.
        q_mask (torch.Tensor, optional): `[ΣLq]`, nonzero = valid (e.g. a punctuation skiplist).
        d_mask (torch.Tensor, optional): `[ΣLd]`.
        normalize (bool): L2-normalize every token first. Default: ``False``.
        backward (str, optional): ``"auto"`` / ``None`` (unified, or lowmem under
            ``torch.use_deterministic_algorithms(True)``), ``"unified"`` (fp32 atomics, fastest)
            or ``"lowmem"`` (every gradient row owned by one program: bitwise reproducible).
        validate (bool, optional): ``True`` checks every value (one synchronization);
            ``False`` checks none; ``None`` checks what costs nothing. Default: ``None``.

    Returns:
        torch.Tensor: `[Nq, Nd]` float32 scores; an empty query or document scores 0.

    Examples::

        >>> Q = torch.randn(5 + 7, 128)          # two queries, 5 and 7 tokens
        >>> D = torch.randn(30 + 300 + 120, 128)  # three passages
        >>> maxsim_varlen(Q, D, torch.tensor([0, 5, 12]), torch.tensor([0, 30, 330, 450])).shape
        torch.Size([2, 3])
    """
    Q, D = _check_tokens(Q_packed, D_packed, "Q_packed", "D_packed")
    q_mask = _check_packed_mask("q_mask", q_mask, Q.shape[0], "Q_packed", Q.device)
    d_mask = _check_packed_mask("d_mask", d_mask, D.shape[0], "D_packed", D.device)
    strategy = check_backward(backward)
    layout = build_layout(
        Q, D, cu_seqlens_q, cu_seqlens_d, max_seqlen_q, max_seqlen_d, validate=validate
    )
    return score_layout(layout, Q, D, q_mask, d_mask, bool(normalize), strategy)


def score_pairs_packed(
    Q_packed: Tensor,
    D_packed: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_d: Tensor,
    pair_q_idx: Tensor,
    pair_d_idx: Tensor,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_d: int | None = None,
    q_mask: Tensor | None = None,
    d_mask: Tensor | None = None,
    normalize: bool = False,
    backward: str | None = None,
    validate: bool | None = None,
) -> Tensor:
    """MaxSim of listed ``(query, document)`` pairs only, ``[P]``, with autograd.

    For sparse workloads (a reranker's scheduler, hard negatives gathered from a shared pool):
    no ``[Nq, Nd]`` matrix is formed. Pairs may share queries and documents; their gradients add
    up. The saved argmax is ``[P, max_seqlen_q]`` int32.

    Args:
        Q_packed (torch.Tensor): `[ΣLq, d]`.
        D_packed (torch.Tensor): `[ΣLd, d]`.
        cu_seqlens_q (torch.Tensor): `[Nq + 1]` offsets into ``Q_packed``.
        cu_seqlens_d (torch.Tensor): `[Nd + 1]` offsets into ``D_packed``.
        pair_q_idx (torch.Tensor): `[P]` int32 or int64, the query of each pair.
        pair_d_idx (torch.Tensor): `[P]`, the document of each pair. Indices are checked with the
            offsets (module docstring); an unchecked index out of range scores NaN and reads
            nothing.
        max_seqlen_q, max_seqlen_d, q_mask, d_mask, normalize, backward, validate: as in
            :func:`maxsim_varlen`. ``"lowmem"`` sorts the pairs by query and by document once
            per backward, on the device.

    Returns:
        torch.Tensor: `[P]` float32 scores; an empty pair list gives an empty tensor.
    """
    Q, D = _check_tokens(Q_packed, D_packed, "Q_packed", "D_packed")
    q_mask = _check_packed_mask("q_mask", q_mask, Q.shape[0], "Q_packed", Q.device)
    d_mask = _check_packed_mask("d_mask", d_mask, D.shape[0], "D_packed", D.device)
    strategy = check_backward(backward)
    layout = build_layout(
        Q, D, cu_seqlens_q, cu_seqlens_d, max_seqlen_q, max_seqlen_d, pair_q_idx, pair_d_idx,
        validate=validate,
    )
    return score_layout(layout, Q, D, q_mask, d_mask, bool(normalize), strategy)


def _sequence_list(name: str, seqs: object) -> list[Tensor]:
    if isinstance(seqs, Tensor):
        if seqs.dim() != 3:
            raise ValueError(
                f"{name} must be a list of [L, d] tensors or one [N, L, d] tensor, got shape "
                f"{_shape(seqs)}"
            )
        return list(seqs.unbind(0))
    if not isinstance(seqs, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(seqs).__name__}")
    for n, t in enumerate(seqs):
        _check_float(f"{name}[{n}]", t)
        if t.dim() != 2:
            raise ValueError(f"{name}[{n}] must be 2-D [L, d], got shape {_shape(t)}")
    return list(seqs)


def _pack_list(name: str, seqs: list[Tensor], dim: int, dtype, device):
    """The sequences back to back, their offsets (on the host: known without a sync) and the
    longest length."""
    for n, t in enumerate(seqs):
        if t.shape[1] != dim:
            raise ValueError(
                f"every sequence must have the embedding dim d = {dim}; {name}[{n}] has {_shape(t)}"
            )
        if t.device != device:
            raise ValueError(f"every sequence must be on {device}; {name}[{n}] is on {t.device}")
    lengths = [t.shape[0] for t in seqs]
    offsets = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    if seqs:
        packed = torch.cat([t.to(dtype) for t in seqs])
    else:
        packed = torch.empty((0, dim), dtype=dtype, device=device)
    return packed, offsets, max(lengths, default=0)


def maxsim_ragged(
    queries: list[Tensor] | Tensor,
    documents: list[Tensor] | Tensor,
    *,
    normalize: bool = False,
    backward: str | None = None,
) -> Tensor:
    """MaxSim of lists of variable-length sequences, ``[Nq, Nd]``, packed without padding.

    The form evaluators hand over (PyLate's, colpali-engine's ``score_multi_vector``): one
    ``[L, d]`` tensor per query and per document. The lengths are known on the host, so nothing
    synchronizes; the tensors are concatenated once (autograd flows back to each of them).

    Args:
        queries (list[torch.Tensor]): `[Lq_i, d]` each (or one `[Nq, Lq, d]` tensor).
        documents (list[torch.Tensor]): `[Ld_j, d]` each (or one `[Nd, Ld, d]` tensor).
        normalize (bool): L2-normalize every token first. Default: ``False``.
        backward (str, optional): as in :func:`maxsim_varlen`.

    Returns:
        torch.Tensor: `[Nq, Nd]` float32 scores.
    """
    qs = _sequence_list("queries", queries)
    ds = _sequence_list("documents", documents)
    strategy = check_backward(backward)
    everything = qs + ds
    if not everything:
        return torch.zeros((0, 0))
    dim, device = everything[0].shape[1], everything[0].device
    dtype = everything[0].dtype
    for t in everything[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    Q, cu_q, max_q = _pack_list("queries", qs, dim, dtype, device)
    D, cu_d, max_d = _pack_list("documents", ds, dim, dtype, device)
    layout = build_layout(Q, D, cu_q, cu_d, max_q, max_d, validate=False)
    return score_layout(layout, Q, D, None, None, bool(normalize), strategy)


def _check_lengths(name: str, lengths: object, shape: tuple[int, ...], device) -> Tensor:
    if not isinstance(lengths, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(lengths).__name__}")
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {lengths.dtype}")
    if _shape(lengths) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {_shape(lengths)}")
    if lengths.device.type != "cpu" and lengths.device != device:
        raise ValueError(f"{name} is on {lengths.device} but the tokens are on {device}")
    return lengths


def _check_padded(queries: object, documents: object):
    Q = _check_float("queries", queries)
    D = _check_float("documents", documents)
    if Q.dim() != 3:
        raise ValueError(f"queries must be [B, Lq, d], got shape {_shape(Q)}")
    if D.dim() != 4:
        raise ValueError(
            f"documents must be [B, C, Ld, d] (C candidates per query), got shape {_shape(D)}"
        )
    if D.shape[0] != Q.shape[0]:
        raise ValueError(
            f"queries and documents must share the batch size B, got {_shape(Q)} and {_shape(D)}"
        )
    check_same_space(Q, D, "queries", "documents")
    return Q, D


def _check_length_range(name: str, low: int, high: int, extent: int) -> None:
    if low < 0 or high > extent:
        raise ValueError(
            f"{name} must lie in [0, {extent}] (the padded extent), got values in [{low}, {high}]"
        )


def _length_range_errors(name: str, lengths: Tensor, extent: int) -> None:
    if lengths.numel():
        _check_length_range(name, *torch.stack([lengths.min(), lengths.max()]).tolist(), extent)


def maxsim_padded(
    queries: Tensor,
    documents: Tensor,
    query_lengths: Tensor,
    doc_lengths: Tensor,
    *,
    normalize: bool = False,
    backward: str | None = None,
    validate: bool | None = None,
) -> Tensor:
    """Rerank padded candidates given their lengths: ``[B, C]``, with autograd.

    Query ``b`` is ``queries[b, :query_lengths[b]]`` and its candidate ``c`` is
    ``documents[b, c, :doc_lengths[b, c]]``. The lengths become masks of the per-query
    candidate layout of :func:`fusedmaxsim.maxsim`: no packing copy and no host synchronization.

    Args:
        queries (torch.Tensor): `[B, Lq, d]`.
        documents (torch.Tensor): `[B, C, Ld, d]`.
        query_lengths (torch.Tensor): `[B]` integers in `[0, Lq]`.
        doc_lengths (torch.Tensor): `[B, C]` integers in `[0, Ld]`. Lengths on the CPU are checked
            (unless ``validate=False``); on the GPU only with ``validate=True`` (one
            synchronization). An unchecked length outside its range makes its scores NaN.
        normalize, backward: as in :func:`fusedmaxsim.maxsim`.

    Returns:
        torch.Tensor: `[B, C]` float32 scores.
    """
    from .api import maxsim

    Q, D = _check_padded(queries, documents)
    B, C, Ld = D.shape[0], D.shape[1], D.shape[2]
    Lq = Q.shape[1]
    validate = _check_validate(validate)
    qlen = _check_lengths("query_lengths", query_lengths, (B,), Q.device)
    dlen = _check_lengths("doc_lengths", doc_lengths, (B, C), Q.device)
    checked = True
    for name, lengths, extent in (("query_lengths", qlen, Lq), ("doc_lengths", dlen, Ld)):
        if validate is True or (validate is None and lengths.device.type == "cpu"):
            _length_range_errors(name, lengths, extent)
        else:
            checked = False
    qlen, dlen = _to_device(qlen, Q.device), _to_device(dlen, Q.device)
    q_mask = torch.arange(Lq, device=Q.device) < qlen[:, None]
    d_mask = torch.arange(Ld, device=Q.device) < dlen[..., None]
    scores = maxsim(Q, D, q_mask, d_mask, normalize=normalize, backward=backward)
    if not checked:
        broken = ((qlen < 0) | (qlen > Lq))[:, None] | (dlen < 0) | (dlen > Ld)
        scores = torch.where(broken, float("nan"), scores)
    return scores


class PackedBatch(NamedTuple):
    """Padded candidates in the packed layout of :func:`score_pairs_packed` (pair ``b·C + c`` is
    query ``b`` against its candidate ``c``); unpacks as a tuple in this order."""

    Q_packed: Tensor
    cu_seqlens_q: Tensor
    D_packed: Tensor
    cu_seqlens_d: Tensor
    pair_q_idx: Tensor
    pair_d_idx: Tensor
    max_seqlen_q: int
    max_seqlen_d: int


def _offsets_from(lengths: Tensor) -> Tensor:
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.reshape(-1).long(), 0, out=cu[1:])
    return cu


def _int32_if_fits(t: Tensor, bound: int) -> Tensor:
    return t.int() if bound < 2**31 else t


def pack_padded(
    queries: Tensor, documents: Tensor, query_lengths: Tensor, doc_lengths: Tensor
) -> PackedBatch:
    """Drop the padding of padded candidates: the :class:`PackedBatch` for
    :func:`score_pairs_packed` (or :func:`maxsim_varlen`), differentiable with respect to
    ``queries`` and ``documents``.

    The packed sizes are data-dependent, so this synchronizes once (reading the totals and
    maxima), and therefore always checks that every length lies in ``[0, extent]``.

    Args:
        queries (torch.Tensor): `[B, Lq, d]`.
        documents (torch.Tensor): `[B, C, Ld, d]`.
        query_lengths (torch.Tensor): `[B]`.
        doc_lengths (torch.Tensor): `[B, C]`.

    Returns:
        PackedBatch: packed tokens, int32 offsets, pair indices ``b`` and ``b·C + c``, and the
        maxima as Python ints.
    """
    Q, D = _check_padded(queries, documents)
    B, C, Ld = D.shape[0], D.shape[1], D.shape[2]
    Lq, dim, device = Q.shape[1], Q.shape[2], Q.device
    qlen = _to_device(_check_lengths("query_lengths", query_lengths, (B,), device), device).long()
    dlen = _to_device(_check_lengths("doc_lengths", doc_lengths, (B, C), device), device).long()
    Q, D = promote_pair(Q, D)
    if B == 0:
        zero = torch.zeros(1, dtype=torch.int32, device=device)
        none = torch.zeros(0, dtype=torch.int32, device=device)
        return PackedBatch(
            Q.new_empty((0, dim)), zero, D.new_empty((0, dim)), zero, none, none, 0, 0
        )
    stats = [qlen.min(), qlen.max(), qlen.sum()]
    stats += [dlen.min(), dlen.max(), dlen.sum()] if dlen.numel() else [qlen.new_zeros(())] * 3
    q_low, q_high, total_q, d_low, d_high, total_d = torch.stack(stats).tolist()
    _check_length_range("query_lengths", q_low, q_high, Lq)
    _check_length_range("doc_lengths", d_low, d_high, Ld)
    cu_q, cu_d = _offsets_from(qlen), _offsets_from(dlen)

    def rows(lengths: Tensor, cu: Tensor, total: int) -> tuple[Tensor, Tensor]:
        seq = torch.repeat_interleave(
            torch.arange(lengths.numel(), device=device), lengths.reshape(-1), output_size=total
        )
        return seq, torch.arange(total, device=device) - cu[seq]

    q_seq, q_tok = rows(qlen, cu_q, total_q)
    d_seq, d_tok = rows(dlen, cu_d, total_d)
    pair_q = torch.arange(B, device=device, dtype=torch.int32).repeat_interleave(C)
    pair_d = torch.arange(B * C, device=device, dtype=torch.int32)
    return PackedBatch(
        Q_packed=Q[q_seq, q_tok],
        cu_seqlens_q=_int32_if_fits(cu_q, total_q),
        D_packed=D[d_seq // C, d_seq % C, d_tok],
        cu_seqlens_d=_int32_if_fits(cu_d, total_d),
        pair_q_idx=pair_q,
        pair_d_idx=pair_d,
        max_seqlen_q=q_high,
        max_seqlen_d=d_high if dlen.numel() else 0,
    )


def dense_as_packed(Q: Tensor, q_mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """A dense ``[N, L, d]`` batch as packed rows with offsets ``0, L, 2L, …`` (a view when the
    strides allow), and its mask flattened."""
    n, length, dim = Q.shape
    cu = torch.arange(n + 1, device=Q.device, dtype=torch.int64) * length
    return Q.reshape(n * length, dim), cu, None if q_mask is None else q_mask.reshape(-1)
