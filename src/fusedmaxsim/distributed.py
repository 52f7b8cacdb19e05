"""Past one device, on ``torch.distributed``: sharded retrieval and cross-rank in-batch negatives.

Every function here is collective: each rank of the process group calls it, in the same order
(NCCL for CUDA tensors, gloo on the CPU; ``torchrun`` starts the processes). Nothing but scores,
ids and sizes crosses ranks, except in :func:`all_gather`, whose point is to gather embeddings.

* :func:`shard_range`: the contiguous range of a corpus each rank holds; :func:`shard`, that
  range of a (memory-mapped) corpus.
* :func:`retrieve`: each rank scores its shard with :func:`fusedmaxsim.retrieve`; the per-rank
  top-k (scores and global ids) are gathered and merged. The global corpus is the shards in rank
  order; equal scores rank the lower global id first, so the result is :func:`fusedmaxsim
  .retrieve`'s over the concatenated corpus.
* :func:`plaid_search`: the same merge over each rank's shard of a PLAID index
  (:func:`fusedmaxsim.plaid.load` with ``shard=``): the best ``top_k`` of the shards' searches.
* :func:`all_gather`: a differentiable gather of a tensor's rows from every rank (uneven counts
  allowed), for in-batch negatives across ranks: the gradient of each gathered row returns to
  the rank that owns it, summed over the ranks that used it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from . import retrieval
from ._problem import check_bool, check_int

__all__ = ["all_gather", "plaid_search", "retrieve", "shard", "shard_range"]


def _group_facts(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fusedmaxsim.distributed needs an initialized process group "
                           "(torch.distributed.init_process_group, e.g. under torchrun)")
    return dist.get_rank(group), dist.get_world_size(group)


def _comm_device(group, device: torch.device) -> torch.device:
    """Where the collectives' tensors live: the GPU for NCCL, the CPU otherwise (gloo)."""
    if dist.get_backend(group) == "nccl":
        return device if device.type == "cuda" else torch.device("cuda",
                                                                   torch.cuda.current_device())
    return torch.device("cpu")


def shard_range(n_docs: int, rank: int | None = None, world_size: int | None = None, *,
                group=None) -> tuple[int, int]:
    """Documents ``[start, stop)`` of rank ``rank`` (default: this process's rank in ``group``) when
    ``n_docs`` documents are split over ``world_size`` ranks in order, as evenly as counts allow
    (the first ``n_docs % world_size`` ranks hold one more). Needs no process group when both
    ``rank`` and ``world_size`` are given."""
    n_docs = check_int("n_docs", n_docs, optional=False, low=0, bound=">= 0")
    if rank is None or world_size is None:
        own_rank, own_world = _group_facts(group)
        rank = own_rank if rank is None else rank
        world_size = own_world if world_size is None else world_size
    world_size = check_int("world_size", world_size, optional=False, low=1, bound=">= 1")
    rank = check_int("rank", rank, optional=False, low=0, bound=">= 0")
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    base, extra = divmod(n_docs, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def shard(x, *, group=None):
    """This rank's rows of ``x`` (:func:`shard_range` of ``len(x)``): a slice, so a corpus
    memory-mapped from disk (``torch.from_file``, ``numpy.load(..., mmap_mode="r")``) is read
    only where this rank's documents lie. Any sliceable sequence works (a tensor, an array, a
    list of documents)."""
    start, stop = shard_range(len(x), group=group)
    return x[start:stop]


def _gather_rows(t: Tensor, group, dst: int | None) -> list[Tensor] | None:
    """Every rank's ``t`` (same shape everywhere), on every rank (``dst=None``) or on ``dst``
    only (None elsewhere)."""
    rank, world = _group_facts(group)
    comm = _comm_device(group, t.device)
    local = t.to(comm).contiguous()
    if dst is None:
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local, group=group)
    else:
        parts = [torch.empty_like(local) for _ in range(world)] if rank == dst else None
        dist.gather(local, parts, dst=dist.get_global_rank(group, dst) if group else dst,
                    group=group)
        if parts is None:
            return None
    return [p.to(t.device) for p in parts]


def _offsets(n_local: int, group, device: torch.device) -> list[int]:
    """The global id of each rank's first document (shards in rank order) and the total."""
    sizes = _gather_rows(torch.tensor([n_local], device=device), group, None)
    counts = [int(s) for s in torch.cat(sizes).tolist()]
    firsts = [0]
    for c in counts:
        firsts.append(firsts[-1] + c)
    return firsts


def _broadcast_queries(Q, q_mask, src: int, group, device: torch.device):
    """``Q`` (and ``q_mask``) from rank ``src`` to every rank, on ``device`` there."""
    rank, _ = _group_facts(group)
    comm = _comm_device(group, device)
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    root = dist.get_global_rank(group, src) if group else src
    header = torch.zeros(6, dtype=torch.int64, device=comm)
    if rank == src:
        if not isinstance(Q, Tensor) or Q.dtype not in dtypes or Q.dim() not in (2, 3):
            raise ValueError("Q on the source rank must be a float [Nq, Lq, d] or [Lq, d] tensor")
        shape = ([1] if Q.dim() == 2 else []) + list(Q.shape)
        header = torch.tensor([*shape, dtypes.index(Q.dtype), q_mask is not None, Q.dim()],
                              dtype=torch.int64, device=comm)
    dist.broadcast(header, root, group=group)
    nq, lq, d, dtype, has_mask, ndim = header.tolist()
    q = Q.to(comm).reshape(nq, lq, d).contiguous() if rank == src else torch.empty(
        (nq, lq, d), dtype=dtypes[dtype], device=comm)
    dist.broadcast(q, root, group=group)
    mask = None
    if has_mask:
        mask = q_mask.to(comm).reshape(nq, lq).to(torch.uint8).contiguous() if rank == src \
            else torch.empty((nq, lq), dtype=torch.uint8, device=comm)
        dist.broadcast(mask, root, group=group)
        mask = mask.bool().to(device)
    q = q.to(device)
    return (q[0], None if mask is None else mask[0]) if ndim == 2 else (q, mask)


def _merge(scores: Tensor, ids: Tensor, top_k: int, total: int, largest: bool, group,
           dst: int | None):
    """The global top-k of every rank's ``(scores, global ids)`` ``[Nq, <= top_k]``: padded to
    ``top_k`` with entries that rank last, gathered, sorted by (score, then lower id)."""
    squeeze = scores.dim() == 1
    if squeeze:
        scores, ids = scores.unsqueeze(0), ids.unsqueeze(0)
    nq, k = scores.shape
    pad = top_k - k
    if pad:
        fill = float("-inf") if largest else float("inf")
        scores = torch.cat([scores, scores.new_full((nq, pad), fill)], 1)
        ids = torch.cat([ids, ids.new_full((nq, pad), torch.iinfo(torch.int64).max)], 1)
    # One tensor a rank: the scores' bits beside the ids (float64 keeps float32 exactly).
    packed = torch.stack([scores.double().view(torch.int64), ids.long()], 0)
    parts = _gather_rows(packed, group, dst)
    if parts is None:
        return None
    every = torch.cat(parts, 2)
    all_scores, all_ids = every[0].view(torch.float64).to(scores.dtype), every[1]
    by_id = all_ids.sort(dim=1, stable=True).indices  # equal scores: the lower id first
    all_scores, all_ids = all_scores.gather(1, by_id), all_ids.gather(1, by_id)
    best = all_scores.sort(dim=1, descending=largest, stable=True).indices[:, :min(top_k, total)]
    out = all_scores.gather(1, best), all_ids.gather(1, best)
    return (out[0][0], out[1][0]) if squeeze else out


def retrieve(Q: Tensor | None, D: Tensor, top_k: int, q_mask: Tensor | None = None,
             d_mask: Tensor | None = None, *, group=None, src: int | None = None,
             dst: int | None = None, largest: bool = True,
             **kwargs) -> tuple[Tensor, Tensor] | None:
    """The ``top_k`` best documents of every query over a corpus sharded across ranks.

    Each rank passes its shard as ``D`` (and ``d_mask``, ``cu_seqlens_d``, ... as
    :func:`fusedmaxsim.retrieve` takes them; ``kwargs`` go there) and scores it; the shards in
    rank order form the global corpus, whose document ids the results use. Per query the ranks'
    ``top_k`` (scores and global ids, never embeddings) are gathered and merged: equal scores
    rank the lower global id first, so the result equals ``fusedmaxsim.retrieve`` over the
    concatenated corpus. An empty shard, or ``top_k`` above a shard's size, is fine.

    Args:
        Q: the queries on every rank (``src=None``), or on rank ``src`` only (then ``None``
            elsewhere; they are broadcast, with ``q_mask``).
        group: the process group (default: the world).
        dst: return the result on rank ``dst`` only (``None`` on the others); default: on every
            rank.
        largest: as :func:`fusedmaxsim.retrieve`'s.

    Returns ``(scores, ids)``, each ``[Nq, k]`` (``[k]`` for a 2-D ``Q``), ``k = min(top_k,
    global Nd)``, on each rank's device.
    """
    top_k = check_int("top_k", top_k, optional=False, low=1, bound=">= 1")
    largest = check_bool("largest", largest)
    rank, _ = _group_facts(group)
    device = D.device
    if src is not None:
        Q, q_mask = _broadcast_queries(Q, q_mask, src, group, device)
    n_local = (kwargs["cu_seqlens_d"].shape[0] - 1 if kwargs.get("cu_seqlens_d") is not None
               else (1 if D.dim() == 2 else D.shape[0]))
    firsts = _offsets(n_local, group, device)
    if n_local:
        scores, ids = retrieval.retrieve(Q, D, top_k, q_mask, d_mask, largest=largest, **kwargs)
    else:  # an empty shard: nothing of its own to offer
        nq = () if Q.dim() == 2 else (Q.shape[0],)
        scores = torch.empty((*nq, 0), dtype=torch.float64 if Q.dtype == torch.float64
                             else torch.float32, device=Q.device)
        ids = torch.empty((*nq, 0), dtype=torch.int64, device=Q.device)
    return _merge(scores, ids + firsts[rank], top_k, firsts[-1], largest, group, dst)


def plaid_search(Q: Tensor | None, index, top_k: int = 10, *, group=None, src: int | None = None,
                 dst: int | None = None, **kwargs) -> tuple[Tensor, Tensor] | None:
    """The PLAID search over an index sharded across ranks: each rank searches its shard
    (``index``, e.g. ``fusedmaxsim.plaid.load(path, shard=(rank, world_size))``) with
    :func:`fusedmaxsim.plaid.plaid_search` (``kwargs`` go there), and the per-rank ``top_k`` are
    merged as :func:`retrieve` merges them (global ids: the shards in rank order). Each shard
    prunes its own candidates, so this equals one index's search only where no pruning drops a
    document (every centroid probed, every candidate scored); ids -1 where fewer documents were
    found. ``Q``, ``src``, ``dst`` and ``group`` as in :func:`retrieve`."""
    from .plaid import plaid_search as search_one
    top_k = check_int("top_k", top_k, optional=False, low=1, bound=">= 1")
    rank, _ = _group_facts(group)
    if src is not None:
        Q, q_mask = _broadcast_queries(Q, kwargs.pop("q_mask", None), src, group, index.device)
        kwargs["q_mask"] = q_mask
    firsts = _offsets(index.n_docs, group, index.device)
    scores, ids = search_one(Q, index, top_k, **kwargs)
    found = ids >= 0
    ids = torch.where(found, ids + firsts[rank], torch.iinfo(torch.int64).max)
    merged = _merge(scores, ids, top_k, top_k, True, group, dst)
    if merged is None:
        return None
    scores, ids = merged
    return scores, torch.where(ids == torch.iinfo(torch.int64).max, -1, ids)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group, sizes: list[int], rank: int) -> Tensor:
        rows = max(sizes)
        padded = x.new_zeros((rows, *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = _gather_rows(padded, group, None)
        ctx.group, ctx.sizes, ctx.rank = group, sizes, rank
        return torch.cat([p[:n] for p, n in zip(parts, sizes)])

    @staticmethod
    def backward(ctx, grad: Tensor):
        comm = _comm_device(ctx.group, grad.device)
        total = grad.to(comm).contiguous().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
        first = sum(ctx.sizes[: ctx.rank])
        return total[first: first + ctx.sizes[ctx.rank]].to(grad.device), None, None, None


def all_gather(x: Tensor, *, group=None) -> Tensor:
    """Every rank's rows of ``x`` (``[n_r, ...]``, ``n_r`` may differ by rank), concatenated in
    rank order, differentiably: the gradient reaching each gathered row is summed over the ranks
    and returned to the rank that owns the row. With a loss that adds up the ranks' losses, the
    gradients are those of one process running the concatenated batch (under
    ``DistributedDataParallel``, which averages parameter gradients over ranks, scale each rank's
    loss by the world size to keep that equality)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    rank, _ = _group_facts(group)
    sizes = [int(s) for s in torch.cat(_gather_rows(
        torch.tensor([x.shape[0]], device=x.device), group, None)).tolist()]
    return _AllGather.apply(x, group, sizes, rank)
