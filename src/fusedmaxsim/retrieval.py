"""Top-k retrieval by MaxSim in bounded memory, and a stateless scoring module for training loops.

:func:`retrieve` scores the corpus a chunk of documents at a time and folds each chunk's scores
into a running top-k, so memory holds one chunk of scores (``Nq × chunk``) and ``Nq × k`` winners,
never the ``[Nq, Nd]`` matrix. A corpus may be dense (``[Nd, Ld, d]`` with a mask) or packed
(``[ΣLd, d]`` with ``cu_seqlens_d``), on the GPU or in CPU memory: a CPU corpus scored by GPU
queries is streamed, the copy of the next chunk overlapping the scoring of this one.

Ranking: scores in decreasing order (increasing with ``largest=False``, as in :func:`torch.topk`);
equal scores go to the lowest document index; NaN ranks above every number (as in
:func:`torch.topk`: first by default, last with ``largest=False``). The merge is exact, so the
chunking changes nothing but, on the PyTorch path, the last bit of a score (BLAS blocks its
products by shape).

Defaults: ``normalize`` defaults to ``False`` here as everywhere in the library, where
late-interaction-kernels' ``retrieve`` and ``MaxSimScorer`` default to ``True``. A call that leaves
it unset gets a one-time ``UserWarning`` saying so (per function, per process); passing
``normalize=`` explicitly silences it.
"""

from __future__ import annotations

import dataclasses
import operator
import sys
import time
import warnings

import torch
from torch import Tensor

from ._autograd import autocast_off, inverse_norms, run_forward
from ._problem import (
    D_AXES,
    Q_AXES,
    RaggedLayout,
    _check_float,
    _check_mask,
    build_layout,
    check_backward,
    check_bool,
    check_int,
    dense_as_packed,
    dense_problem,
    options_for,
    packed_problem,
)

__all__ = ["MaxSimScorer", "retrieve"]

_SCORE_BLOCK_BYTES = 256 << 20  # default chunk: its scores and their sort keys' temporaries
_BYTES_PER_SCORE = 32  # fp32 score, int64 key and the int64 temporaries that build it
_STREAM_BUFFER_BYTES = 256 << 20  # default chunk of a streamed corpus: each of two device buffers
_LOW = 1 << 32


# --------------------------------------------------------------------------------------------
# Running top-k
# --------------------------------------------------------------------------------------------


_NEGATIVE_NAN_BITS = -(1 << 22)  # 0xFFC00000: a NaN with the sign bit set, below -inf in a key


def _order_keys(scores: Tensor, first: int, largest: bool = True) -> Tensor:
    """One int64 per score whose order is (score, then lower index): the float's bits made
    monotone in the high half, the complement of the document index in the low half. Unique
    keys make ``topk`` exact and deterministic, with no tie left to an unstable sort.

    ``largest=False`` keys the negated scores, NaN still last: the best keys are then the lowest
    scores (:func:`_decode_keys` and ``0.0 - value`` bring the scores back)."""
    s = scores.float() + 0.0  # -0.0 becomes +0.0
    if largest:
        s = torch.where(torch.isnan(s), float("nan"), s)  # one NaN, above +inf
    else:
        s = 0.0 - s  # +0.0 stays +0.0
        low_nan = torch.tensor(_NEGATIVE_NAN_BITS, dtype=torch.int32).view(torch.float32)
        s = torch.where(torch.isnan(s), low_nan.to(s.device), s)  # one NaN, below -inf
    bits = s.view(torch.int32).to(torch.int64)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    index = torch.arange(first, first + s.shape[1], device=s.device, dtype=torch.int64)
    return ordered * _LOW + (_LOW - 1 - index)


def _decode_keys(keys: Tensor) -> tuple[Tensor, Tensor]:
    index = (_LOW - 1) - (keys & (_LOW - 1))
    ordered = keys >> 32
    bits = torch.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF).to(torch.int32)
    return bits.view(torch.float32), index


class _RunningTopK:
    """The best ``k`` documents so far of every query (the lowest scores if not ``largest``)."""

    def __init__(self, k: int, exact_keys: bool, largest: bool = True):
        self.k = k
        self.exact_keys = exact_keys  # fp32 scores and fewer than 2**32 documents
        self.largest = largest
        self.keys: Tensor | None = None
        self.scores: Tensor | None = None
        self.indices: Tensor | None = None

    def add(self, scores: Tensor, first: int) -> None:
        if self.exact_keys:
            keys = _order_keys(scores, first, self.largest)
            if self.keys is not None:
                best = keys.topk(min(self.k, keys.shape[1]), dim=1).values
                keys = torch.cat([self.keys, best], dim=1)
            self.keys = keys.topk(min(self.k, keys.shape[1]), dim=1).values  # sorted
            return
        # float64: a stable sort of (winners so far, then this chunk) keeps lower indices first.
        index = torch.arange(first, first + scores.shape[1], device=scores.device)
        index = index.expand(scores.shape[0], -1)
        if self.scores is not None:
            scores = torch.cat([self.scores, scores], dim=1)
            index = torch.cat([self.indices, index], dim=1)
        order = torch.sort(scores, dim=1, descending=self.largest, stable=True).indices
        order = order[:, : self.k]
        self.scores, self.indices = scores.gather(1, order), index.gather(1, order)

    def result(self, n_queries: int, device, dtype) -> tuple[Tensor, Tensor]:
        if self.exact_keys and self.keys is not None:
            scores, indices = _decode_keys(self.keys)
            return (scores if self.largest else 0.0 - scores), indices
        if self.scores is not None:
            return self.scores, self.indices
        return (
            torch.zeros((n_queries, 0), dtype=dtype, device=device),
            torch.zeros((n_queries, 0), dtype=torch.int64, device=device),
        )


# --------------------------------------------------------------------------------------------
# Corpora and chunks
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Corpus:
    """A dense (``[Nd, Ld, d]``, mask ``[Nd, Ld]``) or packed (``[ΣLd, d]``, mask ``[ΣLd]``,
    offsets) corpus; ``offsets`` lives on the corpus's device, ``host_offsets`` on the CPU."""

    tokens: Tensor
    mask: Tensor | None
    offsets: Tensor | None = None
    host_offsets: list[int] | None = None
    max_len: int = 0

    @property
    def packed(self) -> bool:
        return self.offsets is not None

    @property
    def n_docs(self) -> int:
        return self.offsets.numel() - 1 if self.packed else self.tokens.shape[0]

    def row_range(self, c0: int, c1: int) -> tuple[int, int]:
        return (self.host_offsets[c0], self.host_offsets[c1]) if self.packed else (c0, c1)


def _ranges_by_count(n_docs: int, chunk: int) -> list[tuple[int, int]]:
    return [(c0, min(n_docs, c0 + chunk)) for c0 in range(0, n_docs, chunk)]


def _ranges_by_rows(offsets: list[int], max_rows: int) -> list[tuple[int, int]]:
    """Consecutive documents holding at most ``max_rows`` tokens (at least one document)."""
    ranges, c0 = [], 0
    n_docs = len(offsets) - 1
    while c0 < n_docs:
        c1 = c0 + 1
        while c1 < n_docs and offsets[c1 + 1] - offsets[c0] <= max_rows:
            c1 += 1
        ranges.append((c0, c1))
        c0 = c1
    return ranges


class _Progress:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, total: int, enabled: bool, width: int = 30):
        self.total, self.enabled, self.width = total, enabled, width
        self.start = time.perf_counter()
        self.done = 0
        if enabled:
            self._draw()

    def _draw(self) -> None:
        frac = self.done / self.total if self.total else 1.0
        filled = round(frac * self.width)
        elapsed = time.perf_counter() - self.start
        sys.stderr.write(
            f"\rretrieve {frac * 100:5.1f}% |{'#' * filled}{'.' * (self.width - filled)}| "
            f"{self.done}/{self.total} docs {elapsed:6.1f}s"
        )
        sys.stderr.flush()

    def update(self, docs: int) -> None:
        self.done += docs
        if self.enabled:
            self._draw()

    def close(self) -> None:
        if self.enabled:
            self._draw()
            sys.stderr.write("\n")
            sys.stderr.flush()


class _Prefetcher:
    """Copies chunks of a host corpus into two device buffers on a side stream.

    The copy of chunk ``n + 1`` waits only until chunk ``n - 1`` has released its buffer, so it
    overlaps the scoring of chunk ``n``. On a CPU "device" (tests) the copies are plain and
    immediate; the buffer logic is the same. A pinned corpus (``D.pin_memory()``) copies at full
    bandwidth; a pageable one still overlaps, slower.
    """

    def __init__(self, corpus: _Corpus, ranges, device: torch.device):
        self.corpus, self.ranges, self.device = corpus, ranges, device
        rows = max(corpus.row_range(c0, c1)[1] - corpus.row_range(c0, c1)[0] for c0, c1 in ranges)
        docs = max(c1 - c0 for c0, c1 in ranges)
        tail = tuple(corpus.tokens.shape[1:])
        dtype = corpus.tokens.dtype
        self.tokens = [torch.empty((rows, *tail), dtype=dtype, device=device) for _ in range(2)]
        self.masks = [None, None]
        if corpus.mask is not None:
            mask_tail = tuple(corpus.mask.shape[1:])
            self.masks = [
                torch.empty((rows, *mask_tail), dtype=torch.bool, device=device) for _ in range(2)
            ]
        self.offsets = [
            torch.empty(docs + 1, dtype=torch.int64, device=device) if corpus.packed else None
            for _ in range(2)
        ]
        self.cuda = device.type == "cuda"
        self.keepalive: list = [None, None]
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.ready = [torch.cuda.Event() for _ in range(2)]
            self.free = [torch.cuda.Event() for _ in range(2)]

    def load(self, n: int) -> None:
        c0, c1 = self.ranges[n]
        r0, r1 = self.corpus.row_range(c0, c1)
        slot = n % 2
        local = None
        if self.corpus.packed:
            local = torch.tensor(self.corpus.host_offsets[c0 : c1 + 1], dtype=torch.int64) - r0
            if self.cuda:
                local = local.pin_memory()
        if not self.cuda:
            self._copy(slot, r0, r1, c1 - c0, local)
            return
        with torch.cuda.stream(self.copy_stream):
            if n >= 2:
                self.copy_stream.wait_event(self.free[slot])
            self._copy(slot, r0, r1, c1 - c0, local)
            self.ready[slot].record(self.copy_stream)
        self.keepalive[slot] = local  # a pinned source must outlive its asynchronous copy

    def _copy(self, slot: int, r0: int, r1: int, n_docs: int, local: Tensor | None) -> None:
        self.tokens[slot][: r1 - r0].copy_(self.corpus.tokens[r0:r1], non_blocking=True)
        if self.corpus.mask is not None:
            self.masks[slot][: r1 - r0].copy_(self.corpus.mask[r0:r1], non_blocking=True)
        if local is not None:
            self.offsets[slot][: n_docs + 1].copy_(local, non_blocking=True)

    def get(self, n: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
        c0, c1 = self.ranges[n]
        r0, r1 = self.corpus.row_range(c0, c1)
        slot = n % 2
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.ready[slot])
        mask = self.masks[slot][: r1 - r0] if self.masks[slot] is not None else None
        offsets = self.offsets[slot][: c1 - c0 + 1] if self.corpus.packed else None
        return self.tokens[slot][: r1 - r0], mask, offsets

    def release(self, n: int) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        self.free[n % 2].record(torch.cuda.current_stream(self.device))
        return self.free[n % 2]


# --------------------------------------------------------------------------------------------
# retrieve
# --------------------------------------------------------------------------------------------


def _check_top_k(top_k: object) -> int:
    return check_int("top_k", top_k, optional=False, low=1, bound="positive")


def _check_chunk(chunk: object) -> int | None:
    return check_int("chunk", chunk, optional=True, low=1, bound="positive (documents per chunk)")


_WARNED_DEFAULT_NORMALIZE: set[str] = set()


def _normalize_or_default(normalize: object, name: str) -> bool:
    """``normalize=`` checked; left unset (None), ``False``, with a one-time warning per
    function and process: late-interaction-kernels' ``retrieve`` and ``MaxSimScorer`` default to
    ``True``, so the same call there ranks differently."""
    if normalize is not None:
        return check_bool("normalize", normalize)
    if name not in _WARNED_DEFAULT_NORMALIZE:
        _WARNED_DEFAULT_NORMALIZE.add(name)
        warnings.warn(
            f"fusedmaxsim.{name} defaults to normalize=False (late-interaction-kernels' {name} "
            "defaults to normalize=True); pass normalize= explicitly to silence this",
            UserWarning,
            stacklevel=3,
        )
    return False


def _corpus(D: object, d_mask, cu_seqlens_d, max_seqlen_d, dim: int, validate) -> _Corpus:
    D = _check_float("D", D)
    if D.shape[-1] != dim:
        raise ValueError(
            f"Q and D must share the embedding dim d, got d = {dim} and D {tuple(D.shape)}"
        )
    if cu_seqlens_d is None:
        if max_seqlen_d is not None:
            raise ValueError("max_seqlen_d goes with a packed corpus (cu_seqlens_d=...)")
        if D.dim() not in (2, 3):
            raise ValueError(
                f"D must be [Nd, Ld, d] (or [Ld, d], one document), or packed [ΣLd, d] with "
                f"cu_seqlens_d; got shape {tuple(D.shape)}"
            )
        d_mask = _check_mask("d_mask", d_mask, tuple(D.shape[:-1]), "D", D.device,
                             dims=D_AXES[D.dim()])
        if D.dim() == 2:
            D = D.unsqueeze(0)
            d_mask = None if d_mask is None else d_mask.unsqueeze(0)
        return _Corpus(D, d_mask)
    if D.dim() != 2:
        raise ValueError(
            f"a packed corpus is [ΣLd, d] with cu_seqlens_d; got D of shape {tuple(D.shape)}"
        )
    d_mask = _check_mask("d_mask", d_mask, (D.shape[0],), "D", D.device)
    # The offsets are checked with the packing module's rules, against an empty query side.
    no_queries = D.new_empty((0, dim))
    layout = build_layout(
        no_queries, D, torch.zeros(1, dtype=torch.int64), cu_seqlens_d, 0, max_seqlen_d,
        validate=validate, q_name="Q", d_name="D",
    )
    host = layout.cu_d.tolist() if layout.cu_d.device.type == "cpu" else None
    return _Corpus(D, d_mask, layout.cu_d, host, layout.max_d)


def retrieve(
    Q: Tensor,
    D: Tensor,
    top_k: int,
    q_mask: Tensor | None = None,
    d_mask: Tensor | None = None,
    *,
    cu_seqlens_d: Tensor | None = None,
    max_seqlen_d: int | None = None,
    normalize: bool | None = None,
    chunk: int | None = None,
    largest: bool = True,
    sorted: bool = True,
    progress: bool = False,
    validate: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """The ``top_k`` best documents of every query by MaxSim, in memory bounded by the chunk.

    Inference only (no autograd). A dense corpus is scored chunk by chunk exactly as
    :func:`fusedmaxsim.maxsim` scores the same data (the same plan, the same kernel), a packed
    one as :func:`fusedmaxsim.maxsim_varlen` does.

    Args:
        Q (torch.Tensor): queries, `[Nq, Lq, d]` or `[Lq, d]`, on the device that scores.
        D (torch.Tensor): the corpus: `[Nd, Ld, d]` (or `[Ld, d]`, one document), or packed
            `[ΣLd, d]` with ``cu_seqlens_d``. On ``Q``'s device, or in CPU memory while ``Q`` is
            on a GPU: then it is streamed chunk by chunk (pin it with ``D.pin_memory()`` for full
            copy bandwidth), and only two chunks ever live on the GPU. ``Q`` and ``D`` of two
            dtypes are promoted to a common one, chunk by chunk (an in-memory packed corpus
            once, as a copy).
        top_k (int): documents per query; more than the corpus holds returns the whole corpus,
            ranked.
        q_mask (torch.Tensor, optional): `[Nq, Lq]`, nonzero = valid.
        d_mask (torch.Tensor, optional): `[Nd, Ld]`, or `[ΣLd]` for a packed corpus; on ``D``'s
            device.
        cu_seqlens_d (torch.Tensor, optional): `[Nd + 1]` offsets of a packed corpus (see
            :func:`fusedmaxsim.maxsim_varlen`); on the CPU for a streamed corpus.
        max_seqlen_d (int, optional): the longest document of a packed corpus.
        normalize (bool, optional): L2-normalize every token first. Default: ``False``; left
            unset, the first call of the process warns once that late-interaction-kernels'
            ``retrieve`` defaults to ``True`` (pass ``normalize=`` to silence it).
        chunk (int, optional): documents scored at a time. Default: as many as 256 MiB of scores
            allow (a streamed corpus: as many as fit a 256 MiB buffer).
        largest (bool): ``True`` (default): the ``top_k`` highest scores, best first.
            ``False``: the ``top_k`` lowest, lowest first (:func:`torch.topk`'s ``largest``; NaN
            then ranks last).
        sorted (bool): :func:`torch.topk`'s keyword, accepted: the results come sorted either
            way (``sorted=False`` leaves the order unspecified, which sorted satisfies).
        progress (bool): draw a progress bar on stderr. Default: ``False``.
        validate (bool, optional): checks of a packed corpus's offsets, as in
            :func:`fusedmaxsim.maxsim_varlen`.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: ``(scores, indices)``, each `[Nq, k]` with
        ``k = min(top_k, Nd)`` (`[k]` for a 2-D ``Q``): float32 scores in decreasing order
        (increasing with ``largest=False``) and int64 document indices; equal scores rank the
        lower index first.

    Examples::

        >>> Q = torch.randn(4, 32, 128)
        >>> D = torch.randn(1000, 180, 128)
        >>> scores, indices = retrieve(Q, D, top_k=10, chunk=256, normalize=True)
        >>> scores.shape, indices.shape
        (torch.Size([4, 10]), torch.Size([4, 10]))
    """
    k = _check_top_k(top_k)
    chunk = _check_chunk(chunk)
    normalize = _normalize_or_default(normalize, "retrieve")
    progress = check_bool("progress", progress)
    largest = check_bool("largest", largest)
    check_bool("sorted", sorted)
    Q = _check_float("Q", Q)
    if Q.dim() not in (2, 3):
        raise ValueError(f"Q must be [Lq, d] or [Nq, Lq, d], got shape {tuple(Q.shape)}")
    q_mask = _check_mask("q_mask", q_mask, tuple(Q.shape[:-1]), "Q", Q.device, dims=Q_AXES[Q.dim()])
    squeeze = Q.dim() == 2
    if squeeze:
        Q = Q.unsqueeze(0)
        q_mask = None if q_mask is None else q_mask.unsqueeze(0)
    corpus = _corpus(D, d_mask, cu_seqlens_d, max_seqlen_d, Q.shape[-1], validate)
    device = Q.device
    stream = corpus.tokens.device != device
    if stream and not (corpus.tokens.device.type == "cpu" and device.type == "cuda"):
        raise ValueError(
            f"Q is on {device} but D is on {corpus.tokens.device}: Q and D must be on the same "
            "device, or D in CPU memory while Q is on a GPU (it is then streamed)"
        )
    with torch.no_grad():
        scores, indices = _retrieve(
            Q, q_mask, corpus, k, normalize, chunk, progress, stream, largest=largest
        )
    if squeeze:
        scores, indices = scores.squeeze(0), indices.squeeze(0)
    return scores, indices


def _chunk_ranges(corpus: _Corpus, chunk: int | None, n_queries: int, stream: bool):
    """Document ranges scored at a time: ``chunk`` documents; by default, as many as 256 MiB
    of scores allow, or (streamed) as many as fill a 256 MiB buffer, whole documents only."""
    if chunk is None and stream:
        # A buffer holds this many tokens (packed corpus) or documents (dense corpus).
        unit_bytes = corpus.tokens[0].numel() * corpus.tokens.element_size()
        units = _STREAM_BUFFER_BYTES // max(1, unit_bytes)
        if corpus.packed:
            return _ranges_by_rows(corpus.host_offsets, max(corpus.max_len, units))
        return _ranges_by_count(corpus.n_docs, max(1, units))
    if chunk is None:
        chunk = max(1, _SCORE_BLOCK_BYTES // (_BYTES_PER_SCORE * max(n_queries, 1)))
    return _ranges_by_count(corpus.n_docs, chunk)


class _ChunkScorer:
    """Scores of every query against the documents ``[c0, c1)``, whichever the corpus layout:
    a dense chunk as :func:`fusedmaxsim.maxsim` scores it (the same problem, so the same plan),
    a streamed packed chunk through its own offsets, an in-memory packed corpus through its
    columns ``[c0, c1)`` (no host slicing)."""

    def __init__(self, Q: Tensor, q_mask, corpus: _Corpus, normalize: bool, stream: bool):
        self.dtype = torch.promote_types(Q.dtype, corpus.tokens.dtype)
        self.Q, self.q_mask = Q.to(self.dtype), q_mask
        self.corpus, self.normalize, self.stream = corpus, normalize, stream
        self.options = options_for(self.Q)
        # A dense chunk on the Triton path normalizes from its tiles, as maxsim's inference does.
        self.from_tiles = normalize and not corpus.packed and self.options.backend == "triton"
        self.q_inv = inverse_norms(self.Q, self.options.backend) \
            if normalize and not self.from_tiles else None
        if corpus.packed:
            self.Qp, self.cu_q, self.qm = dense_as_packed(self.Q, q_mask)
            self.qi = None if self.q_inv is None else self.q_inv.reshape(-1)
        if corpus.packed and not stream:
            # Every chunk reads the whole corpus through its offsets: prepare it once.
            self.tokens, self.d_inv = self._prepare(corpus.tokens)
            self.whole = RaggedLayout(
                self.cu_q, corpus.offsets, self.Qp.shape[0], corpus.tokens.shape[0],
                self.Q.shape[1], corpus.max_len,
            )

    def _prepare(self, tokens: Tensor) -> tuple[Tensor, Tensor | None]:
        tokens = tokens.to(self.dtype)
        needs_norms = self.normalize and not self.from_tiles
        return tokens, inverse_norms(tokens, self.options.backend) if needs_norms else None

    def __call__(self, c0: int, c1: int, tokens: Tensor, mask, offsets) -> Tensor:
        if self.corpus.packed and not self.stream:
            layout, tokens, d_inv = self.whole.columns(c0, c1), self.tokens, self.d_inv
        else:
            tokens, d_inv = self._prepare(tokens)
            if not self.corpus.packed:
                p = dense_problem(self.Q, tokens, self.q_mask, mask, normalize=self.normalize,
                                  norm_from_tiles=self.from_tiles)
                return run_forward(p, self.options, self.Q, tokens, self.q_mask, mask,
                                   self.q_inv, d_inv)[0]
            layout = RaggedLayout(
                self.cu_q, offsets, self.Qp.shape[0], tokens.shape[0], self.Q.shape[1],
                self.corpus.max_len,
            )
        p = packed_problem(layout, self.Qp, self.qm, mask, normalize=self.normalize)
        return run_forward(p, self.options, self.Qp, tokens, self.qm, mask, self.qi, d_inv,
                           layout)[0]


@autocast_off
def _retrieve(Q, q_mask, corpus: _Corpus, k: int, normalize: bool, chunk: int | None,
              progress: bool, stream: bool, largest: bool = True) -> tuple[Tensor, Tensor]:
    """The chunk loop shared by in-memory and streamed corpora."""
    device = Q.device
    ranges = _chunk_ranges(corpus, chunk, Q.shape[0], stream)
    score = _ChunkScorer(Q, q_mask, corpus, normalize, stream)
    out_dtype = torch.float64 if score.dtype == torch.float64 else torch.float32
    top = _RunningTopK(k, exact_keys=out_dtype == torch.float32 and corpus.n_docs < _LOW,
                       largest=largest)
    bar = _Progress(corpus.n_docs, progress)
    prefetch = _Prefetcher(corpus, ranges, device) if stream and ranges else None
    if prefetch is not None:
        prefetch.load(0)
    pending = None  # the previous chunk's completion, which the host waits for
    for n, (c0, c1) in enumerate(ranges):
        if prefetch is not None:
            tokens, mask, offsets = prefetch.get(n)
        else:
            tokens, mask, offsets = _chunk_view(corpus, c0, c1)
        top.add(score(c0, c1, tokens, mask, offsets), c0)
        done = prefetch.release(n) if prefetch is not None else _record(device, progress)
        if pending is not None:
            pending.synchronize()  # one chunk stays queued on the GPU while the host waits
        if prefetch is not None and n + 1 < len(ranges):
            prefetch.load(n + 1)
        pending = done
        bar.update(c1 - c0)
    bar.close()
    return top.result(Q.shape[0], device, out_dtype)


def _chunk_view(corpus: _Corpus, c0: int, c1: int):
    """An in-memory chunk: views for a dense corpus; the whole packed corpus (its columns are
    chosen by the layout, so no offsets are sliced on the host)."""
    if corpus.packed:
        return corpus.tokens, corpus.mask, None
    mask = corpus.mask[c0:c1] if corpus.mask is not None else None
    return corpus.tokens[c0:c1], mask, None


def _record(device: torch.device, wanted: bool):
    if not wanted or device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


# --------------------------------------------------------------------------------------------
# MaxSimScorer
# --------------------------------------------------------------------------------------------


def _check_pad_token(token: object) -> int | None:
    """``mask_pad_token``: None or an integer token id (negative ids allowed, no bool)."""
    if token is None:
        return None
    if isinstance(token, bool):
        raise TypeError(f"mask_pad_token must be an int token id or None, got {token!r}")
    try:
        return operator.index(token)
    except TypeError:
        raise TypeError(
            f"mask_pad_token must be an int token id or None, got {type(token).__name__}"
        ) from None


class MaxSimScorer(torch.nn.Module):
    """Stateless MaxSim scoring as a module, one front door for every layout.

    ``forward`` follows the caller's grad mode (it never turns gradients on or off), so it drops
    into training loops and ``torch.no_grad()`` evaluation alike; :meth:`score` is the explicit
    inference call, :meth:`retrieve` the top-k one. The module holds no parameters.

    Args:
        normalize (bool, optional): L2-normalize every token first. Default: ``False`` (as every
            function of the library); left unset, the first construction of the process warns
            once that late-interaction-kernels' ``MaxSimScorer`` defaults to ``True`` (pass
            ``normalize=`` to silence it).
        backward (str, optional): the gradient strategy, as in :func:`fusedmaxsim.maxsim`.
        mask_pad_token (int, optional): the padding token id: :meth:`forward_with_ids` then
            builds the masks from token ids (``ids != mask_pad_token``). Default: ``None``.

    Example::

        scorer = MaxSimScorer(normalize=True)
        loss = F.cross_entropy(scorer(Q, D, q_mask, d_mask) / 0.05, labels)
        loss.backward()
    """

    def __init__(
        self,
        *,
        normalize: bool | None = None,
        backward: str | None = None,
        mask_pad_token: int | None = None,
    ) -> None:
        super().__init__()
        self.normalize = _normalize_or_default(normalize, "MaxSimScorer")
        self.backward = check_backward(backward)
        self.mask_pad_token = _check_pad_token(mask_pad_token)

    def extra_repr(self) -> str:
        return (f"normalize={self.normalize}, backward={self.backward!r}, "
                f"mask_pad_token={self.mask_pad_token!r}")

    def forward(
        self,
        Q,
        D,
        q_mask: Tensor | None = None,
        d_mask: Tensor | None = None,
        *,
        cu_seqlens_q: Tensor | None = None,
        cu_seqlens_d: Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_d: int | None = None,
    ) -> Tensor:
        """Scores ``[Nq, Nd]`` (or as :func:`fusedmaxsim.maxsim` shapes them), with autograd.

        * lists of `[L, d]` tensors: :func:`fusedmaxsim.maxsim_ragged`;
        * ``cu_seqlens_d`` (packed documents): :func:`fusedmaxsim.maxsim_varlen`, with
          ``Q`` packed (``cu_seqlens_q``) or a dense `[Nq, Lq, d]` batch (``q_mask`` allowed);
        * otherwise :func:`fusedmaxsim.maxsim` (dense, masks, per-query candidates).
        """
        from .api import maxsim, maxsim_ragged, maxsim_varlen

        if isinstance(Q, (list, tuple)) or isinstance(D, (list, tuple)):
            if q_mask is not None or d_mask is not None:
                raise ValueError("lists of sequences carry their lengths: pass no masks with them")
            return maxsim_ragged(Q, D, normalize=self.normalize, backward=self.backward)
        if cu_seqlens_q is not None or cu_seqlens_d is not None:
            if cu_seqlens_d is None:
                raise ValueError(
                    "cu_seqlens_q needs cu_seqlens_d: packed queries score packed documents"
                )
            if cu_seqlens_q is None:
                Q = _check_float("Q", Q)
                if Q.dim() != 3:
                    raise ValueError(
                        f"without cu_seqlens_q, Q must be [Nq, Lq, d], got shape {tuple(Q.shape)}"
                    )
                q_mask = _check_mask("q_mask", q_mask, tuple(Q.shape[:-1]), "Q", Q.device,
                                     dims=Q_AXES[3])
                Q, cu_seqlens_q, q_mask = dense_as_packed(Q, q_mask)
                max_seqlen_q = Q.shape[0] // max(cu_seqlens_q.numel() - 1, 1)
            return maxsim_varlen(
                Q, D, cu_seqlens_q, cu_seqlens_d, max_seqlen_q, max_seqlen_d, q_mask=q_mask,
                d_mask=d_mask, normalize=self.normalize, backward=self.backward,
            )
        return maxsim(Q, D, q_mask, d_mask, normalize=self.normalize, backward=self.backward)

    def forward_with_ids(self, Q, D, q_ids: Tensor, d_ids: Tensor, **layout) -> Tensor:
        """:meth:`forward` with masks built from token ids: ``q_ids != mask_pad_token`` and
        ``d_ids != mask_pad_token``, of the token axes of ``Q`` and ``D`` (e.g. ``[Nq, Lq]`` and
        ``[Nd, Ld]``). Other keywords (``cu_seqlens_d=`` ...) pass through to :meth:`forward`."""
        if self.mask_pad_token is None:
            raise ValueError(
                "forward_with_ids requires mask_pad_token set on the scorer: "
                "MaxSimScorer(mask_pad_token=<the padding token id>)"
            )
        masks = []
        for name, ids, tokens, owner in (("q_ids", q_ids, Q, "Q"), ("d_ids", d_ids, D, "D")):
            if not isinstance(ids, Tensor):
                raise TypeError(
                    f"{name} must be a torch.Tensor of token ids, got {type(ids).__name__}"
                )
            if isinstance(tokens, Tensor) and tuple(ids.shape) != tuple(tokens.shape[:-1]):
                raise ValueError(
                    f"{name} must have shape {tuple(tokens.shape[:-1])} (the token axes of "
                    f"{owner} {tuple(tokens.shape)}), got {tuple(ids.shape)}"
                )
            masks.append(ids != self.mask_pad_token)
        return self.forward(Q, D, masks[0], masks[1], **layout)

    def score(self, *args, **kwargs) -> Tensor:
        """:meth:`forward` without autograd: no argmax is saved, whatever the inputs require."""
        with torch.no_grad():
            return self.forward(*args, **kwargs)

    def retrieve(
        self,
        Q: Tensor,
        D: Tensor,
        top_k: int,
        q_mask: Tensor | None = None,
        d_mask: Tensor | None = None,
        **kwargs,
    ) -> tuple[Tensor, Tensor]:
        """:func:`retrieve` with this module's ``normalize``; other keywords pass through."""
        return retrieve(Q, D, top_k, q_mask, d_mask, normalize=self.normalize, **kwargs)
