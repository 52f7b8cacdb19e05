"""PLAID indexes: fast-plaid's directories read in place, and the search pipeline on the device.

The on-disk format (fast-plaid 1.x, what PyLate's PLAID index writes), one directory:

* ``metadata.json``: ``nbits``, ``num_chunks``, ``num_documents``, ...;
* ``centroids.npy`` ``[K, d]`` float16; ``bucket_weights.npy`` ``[2 ** nbits]`` (float32 on disk,
  read as the centroids' dtype, as fast-plaid reads it); the bucket cutoffs and average residual
  serve compression only and are not read;
* ``doclens.{i}.json``: the token counts of chunk ``i``'s documents;
* ``merged_codes.npy`` ``[R]`` int64 and ``merged_residuals.npy`` ``[R, d · nbits / 8]`` uint8:
  every document's tokens back to back (``R >= T``, the sum of the lengths: fast-plaid pads the
  end); before fast-plaid first merges them, ``{i}.codes.npy`` / ``{i}.residuals.npy`` per chunk;
* ``ivf.npy`` ``[E]`` int64 and ``ivf_lengths.npy`` ``[K]`` int32: each centroid's documents (those
  with a token of that centroid), the lists back to back.

Only these tensors are read, by a parser of the ``.npy`` header that accepts plain little-endian
numbers (never a pickle); the large payloads are memory-mapped (copy-on-write, never written).
"""

from __future__ import annotations

import ast
import json
import math
import os

import torch
from torch import Tensor

from ._autograd import autocast_off, run_forward
from ._plan import forced_key, plan_probe
from ._problem import (
    NBITS, Options, ResidualDocs, _check_residual_query, check_int, check_residual_varlen,
    options_for, probe_problem, residual_problem, weight_table,
)
from ._torch_path import decompress_residuals as _decompress
from ._torch_path import probe_torch

_NPY_DTYPES = {
    "<i8": torch.int64, "<i4": torch.int32, "|u1": torch.uint8, "<u1": torch.uint8,
    "|i1": torch.int8, "<f2": torch.float16, "<f4": torch.float32, "<f8": torch.float64,
}


def read_npy(path: str) -> Tensor:
    """An ``.npy`` file as a CPU tensor memory-mapped from it (copy-on-write). Plain
    little-endian numbers in C order only; anything else is a ``ValueError`` naming the file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(12)
            if len(head) < 10 or head[:6] != b"\x93NUMPY":
                raise ValueError(f"{path}: not an .npy file")
            wide = head[6] >= 2
            hlen = int.from_bytes(head[8:12] if wide else head[8:10], "little")
            offset = (12 if wide else 10) + hlen
            f.seek(offset - hlen)
            header = f.read(hlen).decode("latin1")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing") from None
    try:
        meta = ast.literal_eval(header)
        descr, fortran, shape = meta["descr"], meta["fortran_order"], tuple(meta["shape"])
    except (ValueError, SyntaxError, KeyError, TypeError):
        raise ValueError(f"{path}: unreadable .npy header {header.strip()!r}") from None
    dtype = _NPY_DTYPES.get(descr) if isinstance(descr, str) else None
    if dtype is None:
        raise ValueError(f"{path}: holds {descr!r}; an index file holds plain little-endian "
                         f"numbers ({', '.join(_NPY_DTYPES)})")
    if fortran and len(shape) > 1:
        raise ValueError(f"{path}: Fortran order; an index file is in C order")
    n = math.prod(shape)
    need = offset + n * dtype.itemsize
    if size < need:
        raise ValueError(f"{path}: truncated: its header promises {descr} {shape} ({need} bytes "
                         f"with the header), the file holds {size}")
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.from_file(path, shared=False, size=need, dtype=torch.uint8)[offset:]
    if offset % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).view(shape)


def _read_json(directory: str, name: str):
    path = os.path.join(directory, name)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _payload(directory: str, suffix: str, num_chunks: int) -> Tensor:
    """``codes`` or ``residuals``: the merged file, mapped, or the chunks' files, concatenated."""
    merged = os.path.join(directory, f"merged_{suffix}.npy")
    staged = [i for i in range(num_chunks)
              if os.path.exists(os.path.join(directory, f"{i}.{suffix}.npy"))]
    if os.path.exists(merged):
        if staged:
            manifest = _read_json(directory, f"merged_{suffix}.manifest.json") if os.path.exists(
                os.path.join(directory, f"merged_{suffix}.manifest.json")) else {}
            pending = [i for i in staged if not manifest.get(f"{i}.{suffix}.npy", {}).get("merged")]
            if pending:
                raise ValueError(
                    f"{merged}: chunk files {', '.join(f'{i}.{suffix}.npy' for i in pending)} "
                    "hold updates not merged into it yet; open the index with fast-plaid once "
                    "to merge them")
        return read_npy(merged)
    if len(staged) != num_chunks:
        missing = sorted(set(range(num_chunks)) - set(staged))
        raise FileNotFoundError(
            f"{merged}: missing, and so are chunk files "
            f"{', '.join(f'{i}.{suffix}.npy' for i in missing)}")
    parts = [read_npy(os.path.join(directory, f"{i}.{suffix}.npy")) for i in range(num_chunks)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def _fail(directory: str, name: str, what: str):
    raise ValueError(f"{os.path.join(directory, name)}: {what}")


def read_fast_plaid(directory: str, validate: bool = True) -> dict:
    """The tensors of a fast-plaid index directory, on the CPU, checked for consistency (with
    ``validate``, also every centroid id and inverted-list entry for its range)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory}: not a directory (a fast-plaid index is one)")
    meta = _read_json(directory, "metadata.json")
    nbits, num_chunks = meta.get("nbits"), meta.get("num_chunks")
    if isinstance(nbits, bool) or nbits not in NBITS:
        _fail(directory, "metadata.json", f"nbits must be one of {NBITS}, got {nbits!r}")
    if not isinstance(num_chunks, int) or isinstance(num_chunks, bool) or num_chunks < 0:
        _fail(directory, "metadata.json", f"num_chunks must be an int >= 0, got {num_chunks!r}")
    centroids = read_npy(os.path.join(directory, "centroids.npy"))
    if centroids.dim() != 2 or not centroids.dtype.is_floating_point:
        _fail(directory, "centroids.npy", f"must be float [K, d], got {centroids.dtype} "
                                          f"{tuple(centroids.shape)}")
    K, dim = centroids.shape
    weights = read_npy(os.path.join(directory, "bucket_weights.npy"))
    if tuple(weights.shape) != (1 << nbits,) or not weights.dtype.is_floating_point:
        _fail(directory, "bucket_weights.npy", f"must be float [2 ** nbits] = ({1 << nbits},) "
                                               f"for nbits={nbits}, got {weights.dtype} "
                                               f"{tuple(weights.shape)}")
    lengths = []
    for i in range(num_chunks):
        chunk = _read_json(directory, f"doclens.{i}.json")
        if not isinstance(chunk, list) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in chunk):
            _fail(directory, f"doclens.{i}.json", "must be a list of token counts (ints >= 0)")
        lengths.extend(chunk)
    n_docs = meta.get("num_documents", len(lengths))
    if n_docs != len(lengths):
        _fail(directory, "metadata.json", f"num_documents = {n_docs}, but the doclens files "
                                          f"list {len(lengths)} documents")
    T = sum(lengths)
    codes = _payload(directory, "codes", num_chunks)
    residuals = _payload(directory, "residuals", num_chunks)
    packed_dim = -(-dim * nbits // 8)
    if codes.dim() != 1 or codes.dtype not in (torch.int64, torch.int32) or codes.shape[0] < T:
        _fail(directory, "merged_codes.npy", f"must be int [R >= {T}] (the documents' {T} "
                                             f"tokens), got {codes.dtype} {tuple(codes.shape)}")
    if residuals.dtype != torch.uint8 or tuple(residuals.shape) != (codes.shape[0], packed_dim):
        _fail(directory, "merged_residuals.npy",
              f"must be uint8 [{codes.shape[0]}, {packed_dim}] (a row per code, "
              f"ceil(d * nbits / 8) bytes), got {residuals.dtype} {tuple(residuals.shape)}")
    ivf = ivf_lengths = None
    if os.path.exists(os.path.join(directory, "ivf.npy")):
        ivf = read_npy(os.path.join(directory, "ivf.npy"))
        ivf_lengths = read_npy(os.path.join(directory, "ivf_lengths.npy"))
        if ivf.dim() != 1 or ivf.dtype.is_floating_point:
            _fail(directory, "ivf.npy", f"must be int [E], got {ivf.dtype} {tuple(ivf.shape)}")
        if tuple(ivf_lengths.shape) != (K,) or ivf_lengths.dtype.is_floating_point:
            _fail(directory, "ivf_lengths.npy", f"must be int [{K}] (a count per centroid), got "
                                                f"{ivf_lengths.dtype} {tuple(ivf_lengths.shape)}")
        if ivf_lengths.numel() and (int(ivf_lengths.min()) < 0
                                    or int(ivf_lengths.sum()) != ivf.shape[0]):
            _fail(directory, "ivf_lengths.npy", f"must be counts >= 0 adding up to the "
                                                f"{ivf.shape[0]} entries of ivf.npy")
    if validate:
        if T and not (0 <= int(codes[:T].min()) and int(codes[:T].max()) < K):
            _fail(directory, "merged_codes.npy", f"holds centroid ids outside [0, {K})")
        if ivf is not None and ivf.numel() and not (
                0 <= int(ivf.min()) and int(ivf.max()) < n_docs):
            _fail(directory, "ivf.npy", f"holds document ids outside [0, {n_docs})")
    return {"nbits": nbits, "centroids": centroids, "bucket_weights": weights.to(centroids.dtype),
            "codes": codes, "residuals": residuals,
            "doc_lengths": torch.tensor(lengths, dtype=torch.int64), "ivf": ivf,
            "ivf_lengths": ivf_lengths}


def token_rows(starts: Tensor, lengths: Tensor, total: int | None = None) -> Tensor:
    """The rows of documents ``(starts, lengths)``, back to back: ``[Σ lengths]`` int64.
    ``total`` (their sum, if the caller knows it) saves reading it back from a GPU."""
    if total is None:
        total = int(lengths.sum())
    first = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - first, lengths, output_size=total) + torch.arange(
        total, device=starts.device)


def build_ivf(codes: Tensor, starts: Tensor, lengths: Tensor, n_centroids: int):
    """Each centroid's documents (those with a token of it), sorted, back to back, and the
    lists' lengths: ``(ivf [E], ivf_lengths [K])``."""
    n_docs = lengths.shape[0]
    total = int(lengths.sum())
    doc = torch.repeat_interleave(torch.arange(n_docs, device=codes.device), lengths,
                                  output_size=total)
    rows = token_rows(starts, lengths, total)
    keys = torch.unique(codes[rows].long() * max(n_docs, 1) + doc)
    cells = keys // max(n_docs, 1)
    return keys % max(n_docs, 1), torch.bincount(cells, minlength=n_centroids)


class PlaidIndex:
    """A PLAID (ColBERTv2) index on one device: documents as centroid ids and residual codes,
    packed back to back, and the inverted lists the search probes.

    Open a fast-plaid directory with :func:`fusedmaxsim.plaid.load`, or build one from tensors
    with :meth:`from_tensors`. :meth:`search` runs the whole PLAID pipeline on the device;
    :meth:`score` scores queries against every document, in place.

    Attributes: ``centroids [K, d]``, ``bucket_weights [2 ** nbits]``, ``nbits``, ``bit_order``,
    ``codes [R]``, ``residuals [R, ceil(d · nbits / 8)]``, ``doc_lengths [Nd]`` and
    ``doc_starts [Nd]`` (int64: document ``j`` is rows ``[doc_starts[j], doc_starts[j] +
    doc_lengths[j])``), ``ivf [E]`` and ``ivf_offsets [K + 1]`` (the documents of centroid ``c``:
    ``ivf[ivf_offsets[c]:ivf_offsets[c + 1]]``, or None without inverted lists).
    """

    def __init__(self, centroids: Tensor, bucket_weights: Tensor, nbits: int, codes: Tensor,
                 residuals: Tensor, doc_lengths: Tensor, ivf: Tensor | None,
                 ivf_lengths: Tensor | None, *, bit_order: str = "big"):
        device = centroids.device
        self.centroids, self.bucket_weights = centroids, bucket_weights.to(device)
        self.nbits, self.bit_order = nbits, bit_order
        self._weight_table = weight_table(self.bucket_weights, nbits, bit_order)
        self.codes, self.residuals = codes.to(device), residuals.to(device)
        lengths = doc_lengths.long()
        self.doc_starts = (torch.cumsum(lengths, 0) - lengths).to(device)
        self.doc_lengths = lengths.to(device)
        self._host_lengths = lengths.cpu()  # sizes known on the host (subset filters)
        self.max_doc_len = int(lengths.max()) if lengths.numel() else 0
        self.ivf = self.ivf_offsets = None
        self.max_list_len = 0
        if ivf is not None:
            counts = ivf_lengths.long()
            self.ivf = ivf.to(device)
            self.ivf_offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(device)
            self.max_list_len = int(counts.max()) if counts.numel() else 0
        self._graphs: dict = {}

    @classmethod
    def from_tensors(cls, centroids: Tensor, bucket_weights: Tensor, nbits: int, codes: Tensor,
                     residuals: Tensor, doc_lengths: Tensor, *, bit_order: str = "big",
                     validate: bool = True) -> PlaidIndex:
        """An index from its tensors (on the centroids' device): ``codes [T]`` and ``residuals
        [T, ceil(d · nbits / 8)]`` the documents' tokens back to back, ``doc_lengths [Nd]``; the
        inverted lists are built from the codes. ``validate``: check every id's range (one
        synchronization on a GPU)."""
        lengths = doc_lengths.long().to(centroids.device)
        cu = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
        no_query = centroids.new_zeros((1, 0, centroids.shape[1]))  # the checks need a Q
        check_residual_varlen(no_query, codes, residuals, cu, centroids, bucket_weights, nbits,
                              bit_order, None, None, validate, False)
        ivf, ivf_lengths = build_ivf(codes.to(centroids.device), cu[:-1], lengths,
                                     centroids.shape[0])
        return cls(centroids, bucket_weights, nbits, codes, residuals, lengths, ivf, ivf_lengths,
                   bit_order=bit_order)

    @property
    def n_docs(self) -> int:
        return self.doc_lengths.shape[0]

    @property
    def dim(self) -> int:
        return self.centroids.shape[1]

    @property
    def device(self) -> torch.device:
        return self.centroids.device

    @property
    def nbytes(self) -> int:
        """Bytes of the documents: codes and residuals."""
        return self.codes.nbytes + self.residuals.nbytes

    def __repr__(self) -> str:
        return (f"PlaidIndex({self.n_docs} documents, {self.doc_lengths.sum().item()} tokens, "
                f"d={self.dim}, nbits={self.nbits}, {self.centroids.shape[0]} centroids, "
                f"{self.nbytes / 2**20:.1f} MiB of codes and residuals on {self.device})")

    def _docs(self, doc_ids: Tensor | None) -> ResidualDocs:
        return ResidualDocs(self.codes, self.residuals, self.doc_starts, self.doc_lengths,
                            self.max_doc_len, doc_ids, self.centroids, self.bucket_weights,
                            self.nbits, self.bit_order, True, self._weight_table)

    def documents(self, ids, *, normalize: bool = True) -> list[Tensor]:
        """Documents ``ids`` (ints) decompressed: a ``[L_j, d]`` tensor each, in the centroids'
        dtype, L2-normalized by default (what fast-plaid's ``get_embeddings`` returns). Reads
        the lengths back to the host (one synchronization on a GPU)."""
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.n_docs):
            raise ValueError(f"ids must be documents of the index, in [0, {self.n_docs}), got "
                             f"values in [{int(ids.min())}, {int(ids.max())}]")
        ids = ids.to(self.device)
        lengths = self.doc_lengths[ids]
        rows = token_rows(self.doc_starts[ids], lengths)
        tokens = _decompress(self.codes[rows], self.residuals[rows], self.centroids,
                             self.bucket_weights, self.nbits, self.bit_order)
        if normalize:
            tokens = torch.nn.functional.normalize(tokens.float(), dim=-1).to(tokens.dtype)
        return list(tokens.split(lengths.tolist()))

    def score(self, Q: Tensor, *, q_mask: Tensor | None = None, normalize: bool = True):
        """MaxSim of ``Q`` against every document: ``[Nq, Nd]``, as
        :func:`fusedmaxsim.plaid.maxsim_residual_varlen` (autograd to ``Q``)."""
        from .plaid import maxsim_residual_varlen
        cu = torch.cat([self.doc_starts, (self.doc_starts[-1:] + self.doc_lengths[-1:])]) \
            if self.n_docs else self.doc_starts.new_zeros(1)
        return maxsim_residual_varlen(Q, self.codes, self.residuals, cu, self.centroids,
                                      self.bucket_weights, self.nbits, normalize=normalize,
                                      q_mask=q_mask, bit_order=self.bit_order,
                                      max_seqlen_d=self.max_doc_len, validate=False)

    def search(self, Q: Tensor, top_k: int = 10, *, n_probe: int = 8, n_candidates: int = 4096,
               q_mask: Tensor | None = None, subset=None,
               cuda_graph: bool = False) -> tuple[Tensor, Tensor]:
        """:func:`plaid_search` of this index."""
        return plaid_search(Q, self, top_k, n_probe=n_probe, n_candidates=n_candidates,
                            q_mask=q_mask, subset=subset, cuda_graph=cuda_graph)

    def _graph(self, Q: Tensor, q_mask: Tensor | None, top_k: int, n_probe: int,
               n_candidates: int) -> _SearchGraph:
        """The CUDA graph of searches like this one, captured on first use."""
        mask = None if q_mask is None else (q_mask.dtype, tuple(q_mask.shape))
        key = (tuple(Q.shape), Q.dtype, Q.device, mask, top_k, n_probe, n_candidates,
               options_for(Q), forced_key())
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = _SearchGraph(self, Q, q_mask, top_k, n_probe,
                                                     n_candidates)
        return graph

    def release_graphs(self) -> None:
        """Forget the CUDA graphs of ``search(..., cuda_graph=True)`` and free their buffers."""
        self._graphs.clear()


def load(path: str | os.PathLike, device: str | torch.device | None = None, *,
         validate: bool = True, shard: tuple[int, int] | None = None) -> PlaidIndex:
    """Open a fast-plaid index directory (what PyLate's PLAID index writes) in place.

    Only tensors are read (``.npy`` headers parsed, never a pickle); the codes and residuals are
    memory-mapped, then moved to ``device`` (default: the CPU, where they stay mapped). The
    bucket weights are read in the centroids' dtype, as fast-plaid reads them. A missing,
    truncated or inconsistent file is an error naming the file; ``validate`` (default) also
    checks every centroid id and inverted-list entry for its range.

    ``shard=(rank, world_size)``: only the documents of
    :func:`fusedmaxsim.distributed.shard_range` for that rank (their rows read from the mapped
    files; the inverted lists rebuilt for them), ids local to the shard (0 is its first
    document), for :func:`fusedmaxsim.distributed.plaid_search`.
    """
    t = read_fast_plaid(os.fspath(path), validate and shard is None)
    device = torch.device("cpu") if device is None else torch.device(device)
    codes, residuals, lengths, ivf, ivf_lengths = (t["codes"], t["residuals"], t["doc_lengths"],
                                                   t["ivf"], t["ivf_lengths"])
    if shard is not None:
        from .distributed import shard_range
        start, stop = shard_range(lengths.shape[0], *shard)
        first = int(lengths[:start].sum())
        lengths = lengths[start:stop]
        rows = slice(first, first + int(lengths.sum()))
        codes, residuals = codes[rows], residuals[rows]
        n_centroids = t["centroids"].shape[0]
        if validate and codes.numel() and not (
                0 <= int(codes.min()) and int(codes.max()) < n_centroids):
            _fail(os.fspath(path), "merged_codes.npy", f"holds centroid ids outside "
                                                       f"[0, {n_centroids})")
        starts = torch.cumsum(lengths, 0) - lengths
        ivf, ivf_lengths = (None, None) if ivf is None else build_ivf(codes, starts, lengths,
                                                                        n_centroids)
    return PlaidIndex(t["centroids"].to(device), t["bucket_weights"], t["nbits"], codes,
                      residuals, lengths, ivf, ivf_lengths)


_probe_launcher = None


def _probed_documents(index: PlaidIndex, cells: Tensor, o: Options) -> Tensor:
    """``[Nq, Nd]`` bool: the documents in the inverted lists of each query's probed ``cells
    [Nq, P]`` (-1: none), by the plan's kernel (``_plan.plan_probe``)."""
    global _probe_launcher
    plan = plan_probe(probe_problem(cells, index.n_docs, index.max_list_len), o)
    if plan.kernel == "torch":
        return probe_torch(plan.launch_queries, cells, index.ivf_offsets, index.ivf,
                           index.n_docs, index.max_list_len)
    if _probe_launcher is None:  # imported on first use: the PyTorch path never imports Triton
        from ._launch.probe import probe as _probe_launcher
    return _probe_launcher(plan, cells, index.ivf_offsets, index.ivf, index.n_docs)


def _subset_ids(index: PlaidIndex, ids, what: str) -> Tensor:
    ids = ids.cpu() if isinstance(ids, Tensor) else torch.as_tensor(list(ids))
    if ids.numel() == 0:
        ids = ids.long()
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() != 1:
        raise ValueError(f"{what} must be a 1-D sequence of document ids (ints), got "
                         f"{ids.dtype} of shape {tuple(ids.shape)}")
    ids = ids.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= index.n_docs):
        raise ValueError(f"{what} must hold documents of the index, in [0, {index.n_docs}), got "
                         f"values in [{int(ids.min())}, {int(ids.max())}]")
    return ids


def _subset_masks(index: PlaidIndex, subset, Nq: int) -> tuple[Tensor, Tensor]:
    """fast-plaid's ``subset``: the documents ``[Nq or 1, Nd]`` each query may return, and the
    centroids ``[Nq or 1, K]`` of their tokens, the only ones it probes. One sequence of ids for
    every query, or one a query; sizes come from the host's copy of the lengths, so nothing
    synchronizes once the ids are on the host."""
    shared = isinstance(subset, Tensor) or all(
        isinstance(x, int) and not isinstance(x, bool) for x in subset)
    if not isinstance(subset, Tensor) and len(subset) == 0:
        raise ValueError("subset is empty: give None for no filter, or one (possibly empty) "
                         "sequence a query")
    if shared:
        per_query = [_subset_ids(index, subset, "subset")]
    else:
        if len(subset) != Nq:
            raise ValueError(f"subset must be one sequence of document ids for every query, or "
                             f"one a query ({Nq}), got {len(subset)} sequences")
        per_query = [_subset_ids(index, ids, f"subset[{q}]") for q, ids in enumerate(subset)]
    device, n_centroids = index.device, index.centroids.shape[0]
    docs = torch.zeros((len(per_query), index.n_docs), dtype=torch.bool, device=device)
    cells = torch.zeros((len(per_query), n_centroids), dtype=torch.bool, device=device)
    for q, ids in enumerate(per_query):
        total = int(index._host_lengths[ids].sum())
        ids = ids.to(device)
        docs[q, ids] = True
        rows = token_rows(index.doc_starts[ids], index.doc_lengths[ids], total)
        cells[q, index.codes[rows].long()] = True
    return docs, cells


@autocast_off
def plaid_search(Q: Tensor, index: PlaidIndex, top_k: int = 10, *, n_probe: int = 8,
                 n_candidates: int = 4096, q_mask: Tensor | None = None, subset=None,
                 cuda_graph: bool = False) -> tuple[Tensor, Tensor]:
    """The PLAID search of ``Q`` in ``index``, on its device: ``(scores [Nq, top_k] fp32, ids
    [Nq, top_k] int64)``, best first (``[top_k]`` each for a single query ``[Lq, d]``).

    fast-plaid's pipeline (``n_probe`` is its ``n_ivf_probe``, ``n_candidates`` its
    ``n_full_scores``), batched over queries:

    1. the queries in the centroids' dtype, and their centroid scores ``centroids @ qᵀ``;
    2. each query token probes its ``n_probe`` best centroids; the candidates are the documents
       of their inverted lists;
    3. each candidate's approximate score (:func:`fusedmaxsim.plaid.plaid_approx_score`: the
       centroid scores of its tokens, max over tokens, summed over query tokens);
    4. the best ``max(1, n_candidates // 4)`` by that score are scored exactly: decompressed on
       chip, the documents' tokens L2-normalized, the queries as given (ColBERT's encoders
       normalize them), fp32 similarities (:func:`fusedmaxsim.plaid.maxsim_residual`'s kernel);
    5. the ``top_k`` best. Where a query finds fewer documents its row ends in ids -1, scores
       -inf.

    ``q_mask [Nq, Lq]`` (nonzero = a real token): masked tokens probe nothing and add nothing.
    ``subset`` (fast-plaid's filter): document ids, one sequence for every query or one a query;
    a query then probes only the centroids of its subset's tokens and returns only its subset's
    documents (ids checked on the host; a subset on the GPU is read back first).

    Every shape in the pipeline is known from the inputs' shapes and the index, so on a GPU
    nothing synchronizes before the result (a subset's ids aside). ``cuda_graph=True`` (CUDA,
    no ``subset``) runs it as a CUDA graph: captured on the first call of each query shape,
    mask shape, dtype, ``top_k``, ``n_probe``, ``n_candidates`` and settings, then replayed,
    which removes the host's cost of launching its two dozen operations (each graph keeps its
    buffers until :meth:`PlaidIndex.release_graphs`, and serves one call at a time: not from
    several threads at once). Memory holds the centroid scores and, for each query, a
    candidate bitmap and approximate scores as wide as the corpus (5 bytes a document), never
    a decompressed document. No gradient; eager only (not under
    ``torch.compile``).
    """
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            "fusedmaxsim.plaid.plaid_search runs eagerly; call it outside the compiled function")
    Q, q_mask, squeeze = _check_residual_query(Q, q_mask)
    if not isinstance(index, PlaidIndex):
        raise TypeError(f"index must be a fusedmaxsim.plaid.PlaidIndex, got "
                        f"{type(index).__name__}")
    top_k = check_int("top_k", top_k, optional=False, low=1, bound=">= 1")
    n_probe = check_int("n_probe", n_probe, optional=False, low=1, bound=">= 1")
    n_candidates = check_int("n_candidates", n_candidates, optional=False, low=1, bound=">= 1")
    if Q.shape[-1] != index.dim:
        raise ValueError(f"Q has d = {Q.shape[-1]} but the index has d = {index.dim}")
    if Q.device != index.device:
        raise ValueError(f"Q is on {Q.device} but the index is on {index.device}")
    if index.ivf is None:
        raise ValueError("the index has no inverted lists (fast-plaid's compress_only): it can "
                         "be scored (PlaidIndex.score), not searched")
    if not isinstance(cuda_graph, bool):
        raise TypeError(f"cuda_graph must be a bool, got {type(cuda_graph).__name__}")
    if cuda_graph:
        if subset is not None:
            raise ValueError("cuda_graph=True searches without a subset (a subset's ids are "
                             "read on the host); give subset=None or cuda_graph=False")
        if Q.device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs the index on a CUDA device, not {Q.device}")
        scores, ids = index._graph(Q, q_mask, top_k, n_probe, n_candidates)(Q, q_mask)
    else:
        scores, ids = _search(index, Q, q_mask, top_k, n_probe, n_candidates, subset)
    return (scores[0], ids[0]) if squeeze else (scores, ids)


def _search(index: PlaidIndex, Q: Tensor, q_mask: Tensor | None, top_k: int, n_probe: int,
            n_candidates: int, subset) -> tuple[Tensor, Tensor]:
    """:func:`plaid_search` of checked arguments, ``Q [Nq, Lq, d]``: every shape from the
    arguments' shapes and the index, nothing read back (a subset aside)."""
    from ._autograd import approx_scores
    with torch.no_grad():
        Nq, Lq, _ = Q.shape
        Qc = Q.to(index.centroids.dtype)
        o = options_for(Qc)
        cs = torch.matmul(index.centroids, Qc.transpose(1, 2))  # [Nq, K, Lq]
        allowed = None
        probe = cs
        if subset is not None:
            allowed, allowed_cells = _subset_masks(index, subset, Nq)
            probe = cs.masked_fill(~allowed_cells[:, :, None], float("-inf"))
        cells = probe.topk(min(n_probe, cs.shape[1]), dim=1) if Lq else None
        if cells is None:
            cells = cs.new_zeros((Nq, 0, 0), dtype=torch.int64)
        elif subset is not None:  # fewer centroids than n_probe in the subset: the rest probe none
            cells = cells.indices.masked_fill(cells.values == float("-inf"), -1)
        else:
            cells = cells.indices
        if q_mask is not None:
            valid = q_mask.bool()
            cells = cells.masked_fill(~valid[:, None, :], -1)
            cs = cs.masked_fill(~valid[:, None, :], 0)
        hit = _probed_documents(index, cells.flatten(1), o)
        if allowed is not None:
            hit &= allowed
        approx = approx_scores(cs, index.codes, index.doc_starts, index.doc_lengths, hits=hit)
        n_exact = min(max(1, n_candidates // 4), index.n_docs)
        best = approx.topk(n_exact, dim=1, sorted=False)  # order: the rescoring's
        # -inf: no candidate (a query with fewer candidates than n_exact)
        ids = best.indices.masked_fill(best.values == float("-inf"), -1)
        docs = index._docs(ids)
        p = residual_problem(docs, Qc, q_mask, normalize=True, save_argmax=False)
        exact = run_forward(p, o, Qc, None, q_mask, None, None, None, docs)[0]
        k = min(top_k, n_exact)
        scores, order = exact.float().topk(k, dim=1)
        ids = ids.gather(1, order)
        if k < top_k:
            scores = torch.cat([scores, scores.new_full((Nq, top_k - k), float("-inf"))], 1)
            ids = torch.cat([ids, ids.new_full((Nq, top_k - k), -1)], 1)
    return scores, ids


class _SearchGraph:
    """One shape's search as a CUDA graph: the query (and mask) copied into the graph's own
    buffers, the graph replayed, its results copied out."""

    def __init__(self, index: PlaidIndex, Q: Tensor, q_mask: Tensor | None, top_k: int,
                 n_probe: int, n_candidates: int):
        self.device = Q.device
        self.Q = Q.detach().clone()
        self.q_mask = None if q_mask is None else q_mask.detach().clone()

        def run():
            return _search(index, self.Q, self.q_mask, top_k, n_probe, n_candidates, None)

        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run()  # compiles the kernels and fills the plans' caches outside the capture
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.scores, self.ids = run()

    def __call__(self, Q: Tensor, q_mask: Tensor | None) -> tuple[Tensor, Tensor]:
        with torch.no_grad(), torch.cuda.device(self.device):
            self.Q.copy_(Q)
            if q_mask is not None:
                self.q_mask.copy_(q_mask)
            self.graph.replay()
            return self.scores.clone(), self.ids.clone()
