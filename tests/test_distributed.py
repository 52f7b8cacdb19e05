"""fusedmaxsim.distributed on gloo: 2-3 processes on this machine (spawned here), every result
against the single-process one: sharded retrieval (uneven shards, an empty one, top_k above a
shard's size, ties across ranks, queries from one rank, results on one rank), the sharded PLAID
search, and cross-rank in-batch negatives (the loss and every gradient)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from fusedmaxsim import distributed, maxsim, retrieve, settings
from fusedmaxsim.plaid import load

FIXTURE = Path(__file__).parent / "fixtures" / "fast_plaid"

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _worker(rank, world, init, comm, check, args):
    """One rank: gloo on the CPU (the PyTorch path), or on a GPU (``comm`` "nccl" or "gloo"
    over CUDA tensors: the kernels) where ``check``'s last argument is a CUDA device."""
    if comm == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(comm, init_method=init, rank=rank, world_size=world)
    try:
        with settings.use_backend("torch" if args[-1] == "cpu" else "auto"):
            check(rank, world, *args)
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path, world, check, *args, comm="gloo"):
    mp.spawn(_worker, args=(world, f"file://{tmp_path}/pg", comm, check, args), nprocs=world,
             join=True)


def _corpus(n_docs, seed=0):
    """Small integers: every similarity and score is exact whatever the order of the sums, so
    documents with equal scores tie exactly, in one process or across shards."""
    g = torch.Generator().manual_seed(seed)
    D = torch.randint(-3, 4, (n_docs, 6, 16), generator=g).float()
    d_mask = torch.rand(n_docs, 6, generator=g) > 0.3
    D[7] = D[2]  # equal scores in two shards: the lower global id ranks first
    d_mask[7] = d_mask[2]
    Q = torch.randint(-3, 4, (3, 5, 16), generator=g).float()
    return Q, D, d_mask


def _check_retrieve(rank, world, sizes, top_k, src, dst, device):
    if device == "nccl":
        device = f"cuda:{rank}"
    Q, D, d_mask = (t.to(device) for t in _corpus(sum(sizes)))
    ref = retrieve(Q, D, top_k, d_mask=d_mask, normalize=False)
    start = sum(sizes[:rank])
    shard = slice(start, start + sizes[rank])
    even = distributed.shard(torch.arange(len(D)))  # the helper's own split of the same corpus
    assert even.tolist() == list(range(*distributed.shard_range(len(D))))
    got = distributed.retrieve(Q if src is None or rank == src else None, D[shard], top_k,
                               d_mask=d_mask[shard], normalize=False, src=src, dst=dst)
    if dst is not None and rank != dst:
        assert got is None
    else:
        assert torch.equal(got[1], ref[1]), (rank, got[1], ref[1])
        torch.testing.assert_close(got[0], ref[0])
    # One query, 2-D, a packed shard: the same again.
    lengths = d_mask[shard].sum(1)
    packed = D[shard][d_mask[shard]]
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).cpu()
    one = distributed.retrieve(Q[0], packed, top_k, cu_seqlens_d=cu, normalize=False)
    ref_one = retrieve(Q[0], D, top_k, d_mask=d_mask, normalize=False)
    assert torch.equal(one[1], ref_one[1])


@pytest.mark.parametrize("sizes, top_k, src, dst", [
    ([5, 9], 4, None, None),       # even-ish shards, ties across them
    ([3, 0, 9], 7, 1, None),       # an empty shard, top_k above a shard, queries from rank 1
    ([4, 6, 2], 30, None, 2),      # top_k above the corpus, results on rank 2 only
])
def test_sharded_retrieve_equals_one_process(tmp_path, sizes, top_k, src, dst):
    _spawn(tmp_path, len(sizes), _check_retrieve, sizes, top_k, src, dst, "cpu")


def _check_plaid(rank, world, device):
    if device == "nccl":
        device = f"cuda:{rank}"
    index = load(FIXTURE / "nbits4", device)
    Q = torch.from_numpy(np.load(FIXTURE / "queries.npy")).to(device)
    lengths = torch.tensor(json.loads((FIXTURE / "query_lengths.json").read_text()))
    q_mask = (torch.arange(Q.shape[1])[None] < lengths[:, None]).to(device)
    exhaustive = {"n_probe": 1024, "n_candidates": 4 * index.n_docs, "q_mask": q_mask}
    ref = index.search(Q, 12, **exhaustive)
    shard = load(FIXTURE / "nbits4", device, shard=(rank, world))
    got = distributed.plaid_search(Q, shard, 12, **exhaustive)
    assert torch.equal(got[1], ref[1])
    torch.testing.assert_close(got[0], ref[0])


def test_sharded_plaid_search_equals_one_index_when_nothing_is_pruned(tmp_path):
    _spawn(tmp_path, 3, _check_plaid, "cpu")


def _batches(world, seed=1):
    """Each rank's queries and documents of an in-batch contrastive step: rank r holds rows r
    of both (uneven counts), and query i's positive is document i of the global batch."""
    g = torch.Generator().manual_seed(seed)
    counts = [3, 1, 2][:world]
    Q = [torch.randn(n, 4, 16, generator=g) for n in counts]
    D = [torch.randn(n, 7, 16, generator=g) for n in counts]
    return counts, Q, D


def _loss(Q, D_all, first):
    scores = maxsim(Q, D_all, normalize=False)
    labels = torch.arange(first, first + Q.shape[0], device=Q.device)
    return F.cross_entropy(scores / 0.05, labels, reduction="sum")


def _check_all_gather(rank, world, device):
    if device == "nccl":
        device = f"cuda:{rank}"
    counts, Qs, Ds = _batches(world)
    Qs, Ds = [x.to(device) for x in Qs], [x.to(device) for x in Ds]
    q = Qs[rank].clone().requires_grad_()
    d = Ds[rank].clone().requires_grad_()
    gathered = distributed.all_gather(d)
    first = sum(counts[:rank])
    loss = _loss(q, gathered, first)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    # One process, the concatenated batch, the ranks' losses added up.
    Q_all = [x.clone().requires_grad_() for x in Qs]
    D_all = [x.clone().requires_grad_() for x in Ds]
    cat = torch.cat(D_all)
    ref = sum(_loss(Q_all[r], cat, sum(counts[:r])) for r in range(world))
    ref.backward()
    torch.testing.assert_close(total, ref.detach())
    torch.testing.assert_close(q.grad, Q_all[rank].grad)
    torch.testing.assert_close(d.grad, D_all[rank].grad)


@pytest.mark.parametrize("world", [2, 3])
def test_cross_rank_negatives_equal_one_process(tmp_path, world):
    _spawn(tmp_path, world, _check_all_gather, "cpu")


@pytest.mark.gpu
def test_distributed_on_gpus(tmp_path):
    """The same checks on CUDA tensors: NCCL with one process a GPU where there are several,
    else gloo over CUDA tensors with two processes sharing the one GPU (the name of the test
    run says which: see the printed line)."""
    n = torch.cuda.device_count()
    comm, world, device = ("nccl", min(n, 3), "nccl") if n >= 2 else ("gloo", 2, "cuda")
    print(f"distributed GPU test: {comm}, {world} processes, {n} GPU(s)")
    sizes = [5, 0, 9] if world == 3 else [5, 9]
    for name in "rpg":
        (tmp_path / name).mkdir()
    _spawn(tmp_path / "r", world, _check_retrieve, sizes, 7, None, None, device, comm=comm)
    _spawn(tmp_path / "p", world, _check_plaid, device, comm=comm)
    _spawn(tmp_path / "g", world, _check_all_gather, device, comm=comm)


def test_errors_without_a_process_group():
    with pytest.raises(RuntimeError, match=r"needs an initialized process group"):
        distributed.all_gather(torch.zeros(2))
    with pytest.raises(RuntimeError, match=r"needs an initialized process group"):
        distributed.shard_range(10)
    assert distributed.shard_range(10, 3, 4) == (8, 10)
    assert [distributed.shard_range(2, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 2),
                                                                    (2, 2)]
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\), got 4"):
        distributed.shard_range(10, 4, 4)
    with pytest.raises(ValueError, match=r"world_size must be >= 1, got 0"):
        distributed.shard_range(10, 0, 0)
