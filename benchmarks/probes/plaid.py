"""Probes of the PLAID residual kernel (``_maxsim_residual_fwd_kernel``; design.md "PLAID"): its
tiles, on the kernel bench's shapes and on the search's
rescoring (one query a block against its own candidates)."""

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
