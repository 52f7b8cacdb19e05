"""Probes of PLAID (design.md "PLAID"): the residual kernel's tiles
(``_maxsim_residual_fwd_kernel``), on the kernel bench's shapes and on the search's rescoring
(one query a block against its own candidates); the approximate score's tiles; the search's
steps."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from fusedmaxsim import forced_plan
from fusedmaxsim._autograd import run_forward
from fusedmaxsim._plaid_index import PlaidIndex
from fusedmaxsim._plan import FwdConfig, recording
from fusedmaxsim._problem import options_for, residual_problem

# name: (documents, tokens a document, queries, nbits, candidates a query or 0: every document)
SHAPES = {
    "5000x200 nbits2 Nq1": (5000, 200, 1, 2, 0),
    "5000x200 nbits2 Nq32": (5000, 200, 32, 2, 0),
    "5000x512 nbits4 Nq1": (5000, 512, 1, 4, 0),
    "5000x512 nbits4 Nq32": (5000, 512, 32, 4, 0),
    "search 32x1024 of 25000x256 nbits2": (25000, 256, 32, 2, 1024),
}


def _inputs(Nd, Ld, Nq, nbits, dim=128, n_centroids=4096):
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = torch.randint(Ld // 2, Ld + 1, (Nd,), device="cuda", generator=gen)
    total = int(lengths.sum())
    codes = torch.randint(0, n_centroids, (total,), device="cuda", generator=gen)
    residuals = torch.randint(0, 256, (total, dim * nbits // 8), device="cuda", generator=gen,
                              dtype=torch.uint8)
    centroids = F.normalize(torch.randn(n_centroids, dim, device="cuda"), dim=-1).half()
    weights = torch.linspace(-0.05, 0.05, 1 << nbits, device="cuda")
    index = PlaidIndex.from_tensors(centroids, weights, nbits, codes, residuals, lengths,
                                    validate=False)
    Q = F.normalize(torch.randn(Nq, 32, dim, device="cuda"), dim=-1).half()
    return index, Q


def _call(index, Q, n_cand):
    if not n_cand:
        return lambda: index.score(Q)
    ids = torch.randint(0, index.n_docs, (Q.shape[0], n_cand), device="cuda")
    docs = index._docs(ids)
    p = residual_problem(docs, Q, None, normalize=True, save_argmax=False)
    o = options_for(Q)
    return lambda: run_forward(p, o, Q, None, None, None, None, None, docs)[0]


def residual_tiles():
    """Inference forward (ms) by document tile, warps and stages (the plan's query rows), then
    for the best three of those (cross product, 32 queries) 4 and 8 queries a block; beside the
    plan's choice."""
    for name, (Nd, Ld, Nq, nbits, n_cand) in SHAPES.items():
        index, Q = _inputs(Nd, Ld, Nq, nbits)
        call = _call(index, Q, n_cand)
        with torch.no_grad(), recording() as plans:
            ref = call()
        base = plans[-1][1].tiles
        with torch.no_grad():
            planned = do_bench(call)
        print(f"{name}: plan {planned:.3f} ms ({base})", flush=True)
        results = {}

        def run(block_n, warps, stages, qpb, regs=None):
            key = (block_n, warps, stages, qpb, regs)
            if key in results:
                return
            cfg = FwdConfig(32, qpb, block_n, 128, warps, stages, max_registers=regs)
            try:
                with torch.no_grad(), forced_plan(fwd_tiles=cfg):
                    out = call()
                    err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-9)).item()
                    results[key] = (do_bench(call), err)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: reported
                print(f"  n{block_n} w{warps} s{stages} q{qpb} r{regs}: {type(exc).__name__}",
                      flush=True)

        for block_n, warps, stages in itertools.product((16, 32, 64), (4, 8), (1, 2)):
            run(block_n, warps, stages, base.queries_per_block)
        best = sorted(results, key=lambda k: results[k][0])[:3]
        for block_n, warps, stages, qpb, _ in best:
            for regs in (128, 96, 80):  # a register cap: more programs an SM
                run(block_n, warps, stages, qpb, regs)
            if not n_cand and Nq > 1:
                for other in (4, 8):
                    run(block_n, warps, stages, other)
        ranked = sorted(results.items(), key=lambda kv: kv[1][0])
        for (block_n, warps, stages, qpb, regs), (ms, err) in ranked[:10] + ranked[-2:]:
            print(f"  n{block_n} w{warps} s{stages} q{qpb} r{regs}: {ms:.3f}  (err {err:.1e})",
                  flush=True)
        del index, Q
        torch.cuda.empty_cache()


def residual_profile():
    """Where the kernel stands: the plan's forward on each shape, ms and tokens decompressed a
    nanosecond (every (query block, document) pair decompresses its document once)."""
    for name, (Nd, Ld, Nq, nbits, n_cand) in SHAPES.items():
        index, Q = _inputs(Nd, Ld, Nq, nbits)
        call = _call(index, Q, n_cand)
        with torch.no_grad(), recording() as plans:
            call()
        with torch.no_grad():
            ms = do_bench(call)
        if n_cand:
            tokens = Nq * n_cand * float(index.doc_lengths.float().mean())
        else:
            qpb = plans[-1][1].tiles.queries_per_block
            tokens = -(-Nq // qpb) * float(index.doc_lengths.sum())
        print(f"{name}: {ms:.3f} ms, {tokens / ms / 1e6:.2f} tokens/ns", flush=True)


APPROX_SHAPES = {  # name: (documents, tokens a document, queries)
    "5000x200 Nq1": (5000, 200, 1),
    "5000x512 Nq1": (5000, 512, 1),
    "25000x512 Nq1": (25000, 512, 1),
    "5000x512 Nq32": (5000, 512, 32),
}


def approx_tiles():
    """``plaid_approx_score`` (ms, ``do_bench``) on padded documents: the front door with the
    plan's tiles, the same kernel through ``approx_scores`` (packed offsets made beforehand: the
    front door's own host and tensor cost is the difference), then the kernel's tiles (tokens a
    step, warps, stages) through the front door, the best eight and the worst two."""
    from fusedmaxsim._autograd import approx_scores
    from fusedmaxsim._plan import ApproxTiles
    from fusedmaxsim.plaid import plaid_approx_score

    for name, (Nd, Ld, Nq) in APPROX_SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        lengths = torch.randint(Ld // 2, Ld + 1, (Nd,), device="cuda", generator=gen)
        codes = torch.randint(0, 4096, (Nd, Ld), device="cuda", generator=gen)
        centroids = F.normalize(torch.randn(4096, 128, device="cuda"), dim=-1)
        Q = F.normalize(torch.randn(Nq, 32, 128, device="cuda"), dim=-1)
        cs = torch.einsum("kd,qsd->qks", centroids, Q).half()
        starts = torch.arange(Nd, device="cuda") * Ld
        with recording() as plans:
            ref = plaid_approx_score(cs, codes, lengths)
        front = do_bench(lambda: plaid_approx_score(cs, codes, lengths))
        inner = do_bench(lambda: approx_scores(cs, codes.flatten(), starts, lengths))
        print(f"{name}: front door {front:.4f} ms, approx_scores {inner:.4f} ms; plan "
              f"{plans[-1][1].tiles}", flush=True)
        rows = []
        for block_t, warps, stages in itertools.product((64, 128, 256), (2, 4, 8), (1, 2, 3)):
            lq_tile, qpb = plans[-1][1].tiles.lq_tile, plans[-1][1].tiles.queries_per_block
            tiles = ApproxTiles(lq_tile, qpb, block_t, warps, stages)
            try:
                with forced_plan(approx_tiles=tiles):
                    ok = torch.equal(plaid_approx_score(cs, codes, lengths), ref)
                    rows.append((do_bench(lambda: plaid_approx_score(cs, codes, lengths)),
                                 block_t, warps, stages, ok))
            except Exception as exc:  # noqa: BLE001 - reported
                print(f"  t{block_t} w{warps} s{stages}: {type(exc).__name__}", flush=True)
        rows.sort()
        for ms, block_t, warps, stages, ok in rows[:8] + rows[-2:]:
            print(f"  t{block_t} w{warps} s{stages}: {ms:.4f}{'' if ok else '  (differs!)'}",
                  flush=True)


def _search_index(n_docs, nbits=2):
    """A clustered corpus of the search bench (``bench_plaid_search``: 200-300 tokens, its toy
    compression and centroid count), its index and 32 queries of 32 tokens."""
    import math

    import bench_plaid_search as bench
    g = torch.Generator(device="cuda").manual_seed(bench.SEED)
    topics = F.normalize(torch.randn(1024, bench.DIM, device="cuda", generator=g), dim=-1)
    tokens, lens = bench.make_corpus(n_docs, topics, (200, 300), torch.device("cuda"))
    K = min(tokens.shape[0], 2 ** int(math.log2(16 * math.sqrt(tokens.shape[0]))))
    centroids, weights, codes, residuals = bench.toy_compress(tokens, nbits, K)
    index = PlaidIndex.from_tensors(centroids, weights, nbits, codes, residuals, lens,
                                    validate=False)
    return index, bench.make_queries(32, 32, topics, torch.device("cuda"))


def search_steps():
    """The search's steps (ms, ``do_bench``) at 10k and 100k documents, 1 and 32 queries
    (``n_probe`` 8, 1,024 rescored): the probe's top-k over centroid-major scores ``[Nq, K,
    Lq]`` (dim 1: what the approximate score reads) against token-major ``[Nq, Lq, K]`` (dim -1:
    a second product), each with its product; the probe's bitmap by the PyTorch path and by the
    Triton kernel; the top 1,024 of the approximate scores by ``topk`` and by ``sort``; the
    whole search, eager and as a CUDA graph."""
    from fusedmaxsim._autograd import approx_scores
    from fusedmaxsim._plaid_index import _probed_documents

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    do_bench(lambda: x @ x, rep=2000)  # the clocks up before the first measurement
    for n_docs in (10_000, 100_000):
        index, queries = _search_index(n_docs)
        C = index.centroids
        print(f"{n_docs} documents: {index.centroids.shape[0]} centroids, longest list "
              f"{index.max_list_len}, {index.ivf.shape[0]} list entries", flush=True)
        for Nq in (1, 32):
            Q = queries[:Nq]
            o = options_for(Q)
            times = {
                "product [Nq, K, Lq]": lambda: torch.matmul(C, Q.transpose(1, 2)),
                "product + topk dim 1": lambda: torch.matmul(C, Q.transpose(1, 2)).topk(8, 1),
                "product [Nq, Lq, K]": lambda: torch.matmul(Q, C.T),
                "product + topk dim -1": lambda: torch.matmul(Q, C.T).topk(8, -1),
            }
            cs = torch.matmul(C, Q.transpose(1, 2))
            cells = cs.topk(8, 1).indices.flatten(1)
            def probe_torch():
                with forced_plan(kernel="torch"):
                    return _probed_documents(index, cells, o)

            old = probe_torch()
            times["probe, PyTorch path"] = probe_torch
            new = _probed_documents(index, cells, o)
            times["probe, Triton"] = lambda: _probed_documents(index, cells, o)
            approx = approx_scores(cs, index.codes, index.doc_starts, index.doc_lengths, hits=new)
            times["approx over hits"] = lambda: approx_scores(
                cs, index.codes, index.doc_starts, index.doc_lengths, hits=new)
            times["topk 1024 of approx"] = lambda: approx.topk(1024, 1, sorted=False)
            times["sort of approx"] = lambda: approx.sort(1, descending=True)
            times["search eager"] = lambda: index.search(Q, 10, n_probe=8, n_candidates=4096)
            index.search(Q, 10, n_probe=8, n_candidates=4096, cuda_graph=True)
            times["search graph"] = lambda: index.search(Q, 10, n_probe=8, n_candidates=4096,
                                                         cuda_graph=True)
            same = torch.equal(old, new)
            print(f"  Nq={Nq}: {int(new.sum())} candidates; bitmaps equal: {same}", flush=True)
            for name, fn in times.items():
                print(f"    {name}: {do_bench(fn):.4f}", flush=True)
        index.release_graphs()


def _random_index(n_docs, length=300, K=65536, nbits=2):
    """The search bench's scale index (random codes and residuals) and 32 queries of 32 tokens
    near its centroids."""
    g = torch.Generator(device="cuda").manual_seed(3)
    centroids = F.normalize(torch.randn(K, 128, device="cuda", generator=g), dim=-1).half()
    T = n_docs * length
    codes = torch.randint(0, K, (T,), device="cuda", dtype=torch.int32, generator=g)
    residuals = torch.randint(0, 256, (T, 128 * nbits // 8), device="cuda", dtype=torch.uint8,
                              generator=g)
    index = PlaidIndex.from_tensors(centroids, torch.linspace(-0.05, 0.05, 1 << nbits,
                                                              device="cuda"),
                                    nbits, codes, residuals,
                                    torch.full((n_docs,), length, device="cuda"), validate=False)
    q = centroids[torch.randint(0, K, (32, 32), device="cuda", generator=g)].float()
    noise = torch.randn(q.shape, device="cuda", generator=g)
    return index, F.normalize(q + 0.3 / 128 ** 0.5 * noise, dim=-1).half()


def approx_hits(blocks=(64, 128), waves_an_sm=(32, 64, 128, 256, 512)):
    """The approximate score over the search's hits (ms, ``do_bench``) by documents a step
    (``APPROX_HIT_BLOCK``) and programs an SM (``APPROX_HIT_WAVES``): the clustered 100k corpus
    of the search bench and the random 1M-document index of its scale run, 1 and 32 queries
    (``n_probe`` 8); every result equal to the plan's. (Record ``58792f8`` swept steps of
    16-256 and 8-64 programs an SM.)"""
    from fusedmaxsim._autograd import approx_scores
    from fusedmaxsim._plaid_index import _probed_documents

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    do_bench(lambda: x @ x, rep=2000)  # the clocks up before the first measurement
    for name, make in (("100k clustered", lambda: _search_index(100_000)),
                       ("1M random", lambda: _random_index(1_000_000))):
        index, queries = make()
        for Nq in (1, 32):
            Q = queries[:Nq]
            cs = torch.matmul(index.centroids, Q.transpose(1, 2))
            hits = _probed_documents(index, cs.topk(8, 1).indices.flatten(1), options_for(Q))

            def call():
                return approx_scores(cs, index.codes, index.doc_starts, index.doc_lengths,
                                     hits=hits)

            ref = call()
            print(f"{name}, Nq={Nq}: {int(hits.sum())} hits; plan {do_bench(call):.4f}",
                  flush=True)
            rows = []
            for block, waves in itertools.product(blocks, waves_an_sm):
                with forced_plan(APPROX_HIT_BLOCK=block, APPROX_HIT_WAVES=waves):
                    ok = torch.equal(call(), ref)
                    rows.append((do_bench(call), block, waves, ok))
            rows.sort()
            for ms, block, waves, ok in rows:
                print(f"  block {block} waves {waves}: {ms:.4f}{'' if ok else '  (differs!)'}",
                      flush=True)
        del index
        torch.cuda.empty_cache()
