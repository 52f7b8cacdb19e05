"""Ragged MaxSim benchmark: packed sequences, pair lists and top-k retrieval against the peers.

Times fusedmaxsim's ``maxsim_varlen``, ``score_pairs_packed``, ``maxsim_padded`` and ``retrieve``
against late-interaction-kernels 0.4.5 (``maxsim_varlen``, ``score_pairs_packed``, ``retrieve``)
and flash-maxsim 0.3.0 (``flash_maxsim_varlen`` for pairs, ``flash_maxsim_packed`` for one query
against packed documents, called once per query) when they are importable, and against
fusedmaxsim's padded ``maxsim`` on the same data. Lengths follow realistic distributions: ColBERT
passages of 30-300 tokens, ColPali pages of 700-1030.

Every provider passes a parity gate against a float64 reference before it is timed; one that
fails is recorded with its error and never timed, so a fast wrong answer cannot win. Speedups are
against the fastest peer that passed.

    PYTHONPATH=src python benchmarks/bench_ragged.py --out benchmarks/results/h200
    PYTHONPATH=src python benchmarks/bench_ragged.py --cases varlen_colbert,retrieve_100k --out results/quick
    PYTHONPATH=src python benchmarks/bench_ragged.py --quick --device cpu      # smoke run, no GPU

Writes ``ragged_bench.json`` and ``ragged_bench.md`` into ``--out`` (rewritten after every case,
so an interrupted run keeps what it measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import fusedmaxsim
except ImportError:  # a source checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import fusedmaxsim

from fusedmaxsim import maxsim, maxsim_padded, maxsim_varlen, score_pairs_packed
from fusedmaxsim.reference import maxsim_ref
from fusedmaxsim.retrieval import retrieve

SCORE_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-2}
GRAD_TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-2}
TARGET_VS_PEER = 1.2
RECORD_STEM = "ragged_bench"


# ---------------------------------------------------------------------------------------------
# Cases and data
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "cross", "pairs", "retrieve", "retrieve_stream"
    mode: str  # "inference" or "training"
    n_queries: int
    q_len: tuple[int, int]  # uniform [low, high]
    n_docs: int  # documents (cross, retrieve) or candidates per query (pairs)
    d_len: tuple[int, int]
    dim: int = 128
    top_k: int = 100
    note: str = ""


CASES = [
    Case("varlen_colbert", "cross", "inference", 32, (24, 32), 2000, (30, 300)),
    Case("varlen_colpali", "cross", "inference", 16, (10, 30), 500, (700, 1030)),
    Case("varlen_colbert_train", "cross", "training", 64, (24, 32), 256, (30, 300)),
    Case("varlen_colpali_train", "cross", "training", 32, (10, 30), 64, (700, 1030)),
    Case("pairs_colbert", "pairs", "inference", 64, (24, 32), 32, (30, 300), note="64 queries x 32 candidates"),
    Case("pairs_colpali", "pairs", "inference", 16, (10, 30), 16, (700, 1030), note="16 queries x 16 pages"),
    Case("pairs_colbert_train", "pairs", "training", 32, (24, 32), 16, (30, 300), note="32 queries x 16 candidates"),
    Case("retrieve_100k", "retrieve", "inference", 32, (32, 32), 100_000, (300, 300)),
    Case("retrieve_100k_packed", "retrieve", "inference", 32, (32, 32), 100_000, (30, 300)),
    Case("retrieve_100k_stream", "retrieve_stream", "inference", 32, (32, 32), 100_000, (300, 300),
         note="corpus in pinned CPU memory"),
]
QUICK = [
    Case("varlen_colbert", "cross", "inference", 4, (5, 9), 12, (3, 30), dim=32),
    Case("varlen_colbert_train", "cross", "training", 4, (5, 9), 8, (3, 30), dim=32),
    Case("pairs_colbert", "pairs", "inference", 4, (5, 9), 3, (3, 30), dim=32),
    Case("pairs_colbert_train", "pairs", "training", 4, (5, 9), 3, (3, 30), dim=32),
    Case("retrieve_100k", "retrieve", "inference", 3, (8, 8), 300, (20, 20), dim=32, top_k=10),
    Case("retrieve_100k_packed", "retrieve", "inference", 3, (8, 8), 300, (3, 20), dim=32, top_k=10),
    Case("retrieve_100k_stream", "retrieve_stream", "inference", 3, (8, 8), 300, (20, 20), dim=32, top_k=10),
]


@dataclasses.dataclass
class Data:
    """One case's inputs in every layout the providers take."""

    q_lens: list
    d_lens: list
    Q_packed: torch.Tensor
    D_packed: torch.Tensor
    cu_q: torch.Tensor  # int32
    cu_d: torch.Tensor
    Q_pad: torch.Tensor  # [Nq, Lq, d]
    q_mask: torch.Tensor
    D_pad: torch.Tensor | None  # [Nd, Ld, d] (cross) or [B, C, Ld, d] (pairs)
    d_mask: torch.Tensor | None
    pair_q: torch.Tensor | None = None
    pair_d: torch.Tensor | None = None


def _lengths(n: int, bounds: tuple[int, int], gen: torch.Generator) -> list:
    low, high = bounds
    return torch.randint(low, high + 1, (n,), generator=gen).tolist()


def _tokens(n: int, dim: int, dtype, device, gen) -> torch.Tensor:
    """Unit-norm tokens, drawn on the device (a 100k-document corpus is 30M tokens)."""
    out = torch.empty(n, dim, device=device, dtype=dtype)
    for start in range(0, n, 1 << 22):  # bounded fp32 temporaries
        block = torch.randn(min(n - start, 1 << 22), dim, device=device, generator=gen)
        out[start : start + block.shape[0]] = F.normalize(block, dim=-1).to(dtype)
    return out


def _pad(packed: torch.Tensor, lens: list, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = packed.new_zeros((len(lens), width, packed.shape[1]))
    mask = torch.zeros((len(lens), width), dtype=torch.bool, device=packed.device)
    start = 0
    for i, n in enumerate(lens):
        out[i, :n] = packed[start : start + n]
        mask[i, :n] = True
        start += n
    return out, mask


def make_data(case: Case, dtype, device, pad_docs: bool = True) -> Data:
    gen = torch.Generator().manual_seed(0)
    gen_tokens = torch.Generator(device=device).manual_seed(0)
    n_docs = case.n_docs * case.n_queries if case.kind == "pairs" else case.n_docs
    q_lens = _lengths(case.n_queries, case.q_len, gen)
    d_lens = _lengths(n_docs, case.d_len, gen)
    Q_packed = _tokens(sum(q_lens), case.dim, dtype, device, gen_tokens)
    D_packed = _tokens(sum(d_lens), case.dim, dtype, device, gen_tokens)
    cu_q = torch.tensor([0, *q_lens], device=device).cumsum(0).int()
    cu_d = torch.tensor([0, *d_lens], device=device).cumsum(0).int()
    Q_pad, q_mask = _pad(Q_packed, q_lens, max(q_lens))
    D_pad = d_mask = None
    if pad_docs:
        D_pad, d_mask = _pad(D_packed, d_lens, max(d_lens))
    data = Data(q_lens, d_lens, Q_packed, D_packed, cu_q, cu_d, Q_pad, q_mask, D_pad, d_mask)
    if case.kind == "pairs":
        B, C = case.n_queries, case.n_docs
        data.pair_q = torch.arange(B, device=device, dtype=torch.int32).repeat_interleave(C)
        data.pair_d = torch.arange(B * C, device=device, dtype=torch.int32)
        data.D_pad = D_pad.view(B, C, *D_pad.shape[1:])
        data.d_mask = d_mask.view(B, C, -1)
    return data


# ---------------------------------------------------------------------------------------------
# float64 references (blocked, bounded memory)
# ---------------------------------------------------------------------------------------------


def _unpad(grad_pad: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return grad_pad[mask]  # row-major over (sequence, token): the packed order


def reference(case: Case, data: Data, grad_out: torch.Tensor | None, budget=2**28):
    """Scores (and, with ``grad_out``, packed gradients) in float64, a block of documents at a
    time so that the [Nq, block, Lq, Ld] similarities stay under ``budget`` elements."""
    Q = data.Q_pad.double().requires_grad_(grad_out is not None)
    q_mask = data.q_mask
    if case.kind == "pairs":
        B, C = data.D_pad.shape[:2]
        per = C * Q.shape[1] * data.D_pad.shape[2]
        step = max(1, budget // max(per, 1))
        scores, grad_d = [], []
        for b0 in range(0, B, step):
            sl = slice(b0, min(B, b0 + step))
            D = data.D_pad[sl].double().requires_grad_(grad_out is not None)
            s = maxsim_ref(Q[sl], D, q_mask[sl], data.d_mask[sl])
            if grad_out is not None:
                s.backward(grad_out.view(B, C)[sl].double())
                grad_d.append(D.grad)
            scores.append(s.detach())
        out = torch.cat(scores).reshape(-1)
        if grad_out is None:
            return out, None, None
        grad_d = torch.cat(grad_d).reshape(B * C, *data.D_pad.shape[2:])
        return out, _unpad(Q.grad, q_mask), _unpad(grad_d, data.d_mask.reshape(B * C, -1))
    n_docs = data.D_pad.shape[0]
    per = Q.shape[0] * Q.shape[1] * data.D_pad.shape[1]
    step = max(1, budget // max(per, 1))
    scores, grad_d = [], []
    for c0 in range(0, n_docs, step):
        sl = slice(c0, min(n_docs, c0 + step))
        D = data.D_pad[sl].double().requires_grad_(grad_out is not None)
        s = maxsim_ref(Q, D, q_mask, data.d_mask[sl])
        if grad_out is not None:
            s.backward(grad_out[:, sl].double())
            grad_d.append(D.grad)
        scores.append(s.detach())
    out = torch.cat(scores, dim=1)
    if grad_out is None:
        return out, None, None
    return out, _unpad(Q.grad, q_mask), _unpad(torch.cat(grad_d), data.d_mask)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double().reshape(ref.shape), ref.detach().double()
    if (torch.isnan(out) ^ torch.isnan(ref)).any():
        return float("inf")
    scale = ref.abs().max().item() if ref.numel() else 1.0
    return (out - ref).abs().max().item() / max(scale, 1e-30) if ref.numel() else 0.0


# ---------------------------------------------------------------------------------------------
# Providers: each returns a callable that runs one (forward or forward+backward) call
# ---------------------------------------------------------------------------------------------


class Skip(Exception):
    """The provider does not run here (not importable, no such mode, needs CUDA)."""


def _import_lik():
    try:
        import late_interaction_kernels as lik
        from late_interaction_kernels.score_pairs import score_pairs_packed as lik_pairs
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        raise Skip(f"late-interaction-kernels not importable: {exc}") from None
    return lik, lik_pairs


def _import_flash():
    try:
        import flash_maxsim
    except Exception as exc:  # noqa: BLE001
        raise Skip(f"flash-maxsim not importable: {exc}") from None
    return flash_maxsim


@dataclasses.dataclass
class Runner:
    """One provider on one case: ``fn(*leaves)`` scores; ``packed_grads`` maps the gradients of
    its own input layout to the packed one, for the parity gate only (never timed)."""

    fn: object
    leaves: tuple = ()  # None: the packed tokens
    packed_grads: object = None


def providers(case: Case, data: Data, device: torch.device, peers: bool):
    """``{name: (role, build)}``; ``build()`` returns a :class:`Runner` (or raises :class:`Skip`)."""
    max_q, max_d = max(data.q_lens), max(data.d_lens)
    cuda = device.type == "cuda"
    out = {}
    if case.kind == "cross":
        out["fusedmaxsim.varlen"] = ("ours", lambda: Runner(lambda Q, D: maxsim_varlen(
            Q, D, data.cu_q, data.cu_d, max_q, max_d)))
        if case.mode == "training":
            out["fusedmaxsim.varlen[lowmem]"] = ("ours", lambda: Runner(lambda Q, D: maxsim_varlen(
                Q, D, data.cu_q, data.cu_d, max_q, max_d, backward="lowmem")))
        out["fusedmaxsim.padded"] = ("baseline", lambda: _padded_runner(
            data, lambda Q, D: maxsim(Q, D, data.q_mask, data.d_mask)))
        if peers:
            out["lik.maxsim_varlen"] = ("peer", lambda: _lik_varlen(data, max_q, max_d, cuda))
            out["flash.packed_per_query"] = ("peer", lambda: _flash_packed(case, data, max_d, cuda))
    elif case.kind == "pairs":
        out["fusedmaxsim.pairs"] = ("ours", lambda: Runner(lambda Q, D: score_pairs_packed(
            Q, D, data.cu_q, data.cu_d, data.pair_q, data.pair_d, max_seqlen_q=max_q,
            max_seqlen_d=max_d)))
        B, C = data.D_pad.shape[:2]
        qlen = torch.tensor(data.q_lens, device=device)
        dlen = torch.tensor(data.d_lens, device=device).view(B, C)
        out["fusedmaxsim.maxsim_padded"] = ("ours", lambda: _padded_runner(
            data, lambda Q, D: maxsim_padded(Q, D, qlen, dlen).reshape(-1)))
        if peers:
            out["lik.score_pairs_packed"] = ("peer", lambda: _lik_pairs(data, max_q, max_d, cuda))
            out["flash.varlen_pairs"] = ("peer", lambda: _flash_pairs(case, data, max_q, max_d, cuda))
    return out


def _padded_runner(data: Data, fn) -> Runner:
    """A provider that takes the padded batch as it comes (the padding is not timed)."""
    q_mask, d_mask = data.q_mask, data.d_mask

    def packed_grads(gq, gd):
        return gq[q_mask], gd[d_mask]

    return Runner(fn, (data.Q_pad, data.D_pad), packed_grads)


def _lik_varlen(data: Data, max_q: int, max_d: int, cuda: bool):
    if not cuda:
        raise Skip("needs CUDA")
    lik, _ = _import_lik()
    return Runner(lambda Q, D: lik.maxsim_varlen(Q, D, data.cu_q, data.cu_d, max_q, max_d))


def _lik_pairs(data: Data, max_q: int, max_d: int, cuda: bool):
    if not cuda:
        raise Skip("needs CUDA")
    _, lik_pairs = _import_lik()
    return Runner(lambda Q, D: lik_pairs(
        Q, D, data.cu_q, data.cu_d, data.pair_q, data.pair_d, max_seqlen_q=max_q, max_seqlen_d=max_d
    ))


def _flash_packed(case: Case, data: Data, max_d: int, cuda: bool):
    """flash-maxsim scores one query against packed documents: one call per query."""
    if not cuda:
        raise Skip("needs CUDA")
    if case.mode == "training":
        raise Skip("flash_maxsim_packed has no backward")
    fm = _import_flash()
    bounds = data.cu_q.tolist()

    def fn(Q, D):
        rows = [fm.flash_maxsim_packed(Q[bounds[i] : bounds[i + 1]], D, data.cu_d, max_d)
                for i in range(len(bounds) - 1)]
        return torch.stack(rows)

    return Runner(fn)


def _flash_pairs(case: Case, data: Data, max_q: int, max_d: int, cuda: bool):
    """flash_maxsim_varlen scores pair i as (query i, document i): the queries are repeated per
    pair once, outside the timing (its API takes them that way)."""
    if not cuda:
        raise Skip("needs CUDA")
    if case.mode == "training":
        raise Skip("flash_maxsim_varlen has no backward")
    fm = _import_flash()
    bounds = data.cu_q.tolist()
    per_pair = [data.Q_packed[bounds[i] : bounds[i + 1]] for i in data.pair_q.tolist()]
    Q_pairs = torch.cat(per_pair)
    cu_pairs = torch.tensor([0, *[q.shape[0] for q in per_pair]], device=Q_pairs.device).cumsum(0).int()
    return Runner(lambda Q, D: fm.flash_maxsim_varlen(Q_pairs, D, cu_pairs, data.cu_d, max_q, max_d))


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def time_ms(fn, device: torch.device, warmup_ms: float, rep_ms: float, grad_to_none=None) -> dict:
    if device.type == "cuda":
        from triton.testing import do_bench

        med, p20, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none,
                                 quantiles=[0.5, 0.2, 0.8])
        return {"ms": med, "p20_ms": p20, "p80_ms": p80}
    fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1000
    while len(times) < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return {"ms": times[len(times) // 2], "p20_ms": times[len(times) // 5], "p80_ms": times[(4 * len(times)) // 5]}


def _slow_time_ms(fn, device, reps: int = 3) -> dict:
    """Calls of tens of milliseconds and more: a few synchronized runs after one warm-up."""
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return {"ms": times[len(times) // 2], "p20_ms": times[0], "p80_ms": times[-1]}


def peak_mib(fn, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def measure_ceilings(device: torch.device) -> dict:
    """Dense bf16 GEMM throughput, HBM copy bandwidth and pinned host-to-device bandwidth."""
    if device.type != "cuda":
        return {}
    from triton.testing import do_bench

    def gemm_ms(n: int) -> float:
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        return do_bench(lambda: a @ a, warmup=25, rep=200)

    def copy_ms(source: torch.Tensor, target: torch.Tensor) -> float:
        return do_bench(lambda: target.copy_(source, non_blocking=True), warmup=25, rep=200)

    n = 8192
    gemm = gemm_ms(n)
    copy = copy_ms(torch.empty(2**30, dtype=torch.uint8, device=device),
                   torch.empty(2**30, dtype=torch.uint8, device=device))
    h2d = copy_ms(torch.empty(2**30, dtype=torch.uint8).pin_memory(),
                  torch.empty(2**30, dtype=torch.uint8, device=device))
    return {
        "bf16_tflops": 2 * n**3 / gemm / 1e9,
        "hbm_gbps": 2 * 2**30 / copy / 1e6,  # read + write
        "h2d_gbps": 2**30 / h2d / 1e6,
    }


def floor_ms(case: Case, data: Data, ceilings: dict, element_bytes: int) -> float | None:
    """The arithmetic floor: the real (unpadded) FLOPs at the GEMM rate, or the bytes at the
    memory (or, streamed, the host link) rate, whichever is longer."""
    if not ceilings:
        return None
    if case.kind == "pairs":
        flops = sum(2 * data.q_lens[b] * data.d_lens[b * case.n_docs + c] * case.dim
                    for b in range(case.n_queries) for c in range(case.n_docs))
    else:
        flops = 2 * sum(data.q_lens) * sum(data.d_lens) * case.dim
    if case.mode == "training":
        flops *= 2  # the one-hot grad_D products redo the forward's work; the gathers are cheap
    bytes_ = (sum(data.q_lens) + sum(data.d_lens)) * case.dim * element_bytes
    rate = ceilings["h2d_gbps"] if case.kind == "retrieve_stream" else ceilings["hbm_gbps"]
    return max(flops / ceilings["bf16_tflops"] / 1e9, bytes_ / rate / 1e6)


# ---------------------------------------------------------------------------------------------
# Running a case
# ---------------------------------------------------------------------------------------------


def run_scoring_case(case: Case, dtype, device, args, ceilings) -> dict:
    data = make_data(case, dtype, device)
    training = case.mode == "training"
    n_out = (case.n_queries * case.n_docs,) if case.kind == "pairs" else (case.n_queries, case.n_docs)
    gen = torch.Generator().manual_seed(1)
    grad_out = torch.randn(n_out, generator=gen).to(device) if training else None
    ref_scores, ref_gq, ref_gd = reference(case, data, grad_out)
    record = {"case": case.name, "kind": case.kind, "mode": case.mode, "note": case.note,
              "shape": _shape_info(case, data), "providers": {}}
    record["floor_ms"] = floor_ms(case, data, ceilings, data.Q_packed.element_size())
    for name, (role, build) in providers(case, data, device, args.peers).items():
        entry = {"role": role}
        record["providers"][name] = entry
        try:
            runner = build()
            fn = runner.fn
            Q, D = (t.detach().clone() for t in (runner.leaves or (data.Q_packed, data.D_packed)))
            if training:
                Q.requires_grad_(True)
                D.requires_grad_(True)
            scores = fn(Q, D) if training else _no_grad(fn, Q, D)
            entry["score_err"] = rel_err(scores, ref_scores)
            passed = entry["score_err"] <= SCORE_TOL[dtype]
            if training:
                gq, gd = torch.autograd.grad(scores, (Q, D), grad_out.view(scores.shape))
                if runner.packed_grads is not None:
                    gq, gd = runner.packed_grads(gq, gd)
                entry["grad_q_err"], entry["grad_d_err"] = rel_err(gq, ref_gq), rel_err(gd, ref_gd)
                passed = passed and max(entry["grad_q_err"], entry["grad_d_err"]) <= GRAD_TOL[dtype]
            entry["status"] = "ok" if passed else "failed parity"
            if not passed:
                continue

            def step(fn=fn, Q=Q, D=D):
                if training:
                    fn(Q, D).backward(grad_out.view(n_out))
                else:
                    with torch.no_grad():
                        fn(Q, D)

            entry.update(time_ms(step, device, args.warmup_ms, args.rep_ms,
                                 grad_to_none=[Q, D] if training else None))
            entry["peak_mib"] = peak_mib(step, device)
        except Skip as why:
            entry["status"] = f"skipped: {why}"
        except Exception as exc:  # noqa: BLE001 - a crashing provider is a result, not an abort
            entry["status"] = f"error: {type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc(limit=4)
    return _summarize(record)


def _no_grad(fn, Q, D):
    with torch.no_grad():
        return fn(Q, D)


def _shape_info(case: Case, data: Data) -> dict:
    return {
        "n_queries": case.n_queries,
        "n_docs": len(data.d_lens),
        "q_len": list(case.q_len),
        "d_len": list(case.d_len),
        "dim": case.dim,
        "query_tokens": sum(data.q_lens),
        "doc_tokens": sum(data.d_lens),
        "padding_overhead": max(data.d_lens) * len(data.d_lens) / max(sum(data.d_lens), 1),
    }


def run_retrieve_case(case: Case, dtype, device, args, ceilings) -> dict:
    """Top-k: the parity gate checks every returned score against float64 and that no sampled
    document outscores the k-th winner; the timing runs on the full corpus."""
    packed = case.d_len[0] != case.d_len[1]
    data = make_data(case, dtype, device, pad_docs=False)
    Q = data.Q_pad  # equal query lengths: the padded batch is the queries
    if packed:
        corpus, kwargs = data.D_packed, {"cu_seqlens_d": data.cu_d, "max_seqlen_d": max(data.d_lens)}
    else:
        corpus, kwargs = data.D_packed.view(case.n_docs, case.d_len[0], case.dim), {}
    stream = case.kind == "retrieve_stream"
    if stream:
        corpus = corpus.cpu().pin_memory() if device.type == "cuda" else corpus.cpu()
        kwargs = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    record = {"case": case.name, "kind": case.kind, "mode": case.mode, "note": case.note,
              "shape": {**_shape_info(case, data), "top_k": case.top_k}, "providers": {}}
    record["floor_ms"] = floor_ms(case, data, ceilings, data.Q_packed.element_size())

    runs = {"fusedmaxsim.retrieve": ("ours", lambda: retrieve(Q, corpus, case.top_k, normalize=False, **kwargs))}
    if args.peers and not packed and not stream:
        runs["lik.retrieve"] = ("peer", lambda: _lik_retrieve(Q, corpus, case.top_k, device))
    for name, (role, call) in runs.items():
        entry = {"role": role}
        record["providers"][name] = entry
        try:
            scores, indices = call()
            entry.update(_retrieve_parity(case, data, scores, indices, dtype))
            if entry["status"] != "ok":
                continue
            entry.update(_slow_time_ms(call, device, reps=args.slow_reps))
            entry["peak_mib"] = peak_mib(call, device)
        except Skip as why:
            entry["status"] = f"skipped: {why}"
        except Exception as exc:  # noqa: BLE001
            entry["status"] = f"error: {type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc(limit=4)
    return _summarize(record)


def _lik_retrieve(Q, D, top_k, device):
    if device.type != "cuda":
        raise Skip("needs CUDA")
    lik, _ = _import_lik()
    return lik.retrieve(Q, D, top_k, normalize=False)


def _doc_scores64(data: Data, Q64: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """float64 scores of every query against the documents ``docs`` ([Nq, len(docs)])."""
    bounds = data.cu_d.tolist()
    out = torch.zeros(Q64.shape[0], len(docs), dtype=torch.float64, device=Q64.device)
    for n, j in enumerate(docs.tolist()):
        out[:, n] = maxsim_ref(Q64, data.D_packed[bounds[j] : bounds[j + 1]].double())
    return out


def _retrieve_parity(case: Case, data: Data, scores, indices, dtype) -> dict:
    k = min(case.top_k, len(data.d_lens))
    scores = scores.to(data.Q_packed.device)
    indices = indices.to(data.Q_packed.device)
    if scores.shape != (case.n_queries, k):
        return {"status": f"failed parity: shape {tuple(scores.shape)}"}
    Q64 = data.Q_pad.double()
    winners = torch.unique(indices)
    table = _doc_scores64(data, Q64, winners)
    lookup = torch.searchsorted(winners, indices)
    ref = table.gather(1, lookup)
    err = rel_err(scores, ref)
    gen = torch.Generator().manual_seed(2)
    sample = torch.randint(0, len(data.d_lens), (min(512, len(data.d_lens)),), generator=gen)
    sample = sample.to(Q64.device)
    sampled = _doc_scores64(data, Q64, sample)
    won = (sample[None, :, None] == indices[:, None, :]).any(-1)  # [Nq, sample]: a winner already
    kth = ref[:, -1:]
    scale = ref.abs().max().item()
    missed = (((sampled - kth) > SCORE_TOL[dtype] * scale) & ~won).any().item()
    ok = err <= SCORE_TOL[dtype] and not missed and bool((scores[:, :-1] >= scores[:, 1:]).all())
    return {"score_err": err, "missed_a_better_document": bool(missed),
            "status": "ok" if ok else "failed parity"}


def _summarize(record: dict) -> dict:
    timed = {n: e for n, e in record["providers"].items() if e.get("status") == "ok" and "ms" in e}
    peers = [e["ms"] for e in timed.values() if e["role"] == "peer"]
    best_peer = min(peers) if peers else None
    for entry in timed.values():
        if best_peer is not None:
            entry["speedup_vs_best_peer"] = best_peer / entry["ms"]
        if record.get("floor_ms"):
            entry["pct_of_floor"] = 100 * record["floor_ms"] / entry["ms"]
    ours = [e for e in timed.values() if e["role"] == "ours"]
    if ours and best_peer is not None:
        best = max(e["speedup_vs_best_peer"] for e in ours)
        record["target"] = {"speedup_vs_best_peer": best, "goal": TARGET_VS_PEER, "met": best >= TARGET_VS_PEER}
    return record


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------


def _git_sha() -> str | None:
    from harness.records import git_state

    sha = git_state()[0]
    return sha[:7] if sha else None


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict:
    env = {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": _version("triton"),
        "fusedmaxsim": getattr(fusedmaxsim, "__version__", None),
        "late_interaction_kernels": _version("late-interaction-kernels"),
        "flash_maxsim": _version("flash-maxsim"),
        "git_sha": _git_sha(),
        "python": platform.python_version(),
    }
    return env


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [
        "# Ragged MaxSim benchmark",
        "",
        (
            f"{env['device']} · torch {env['torch']} · triton {env['triton']} · fusedmaxsim "
            f"{env['fusedmaxsim']} ({env['git_sha']}) · late-interaction-kernels "
            f"{env['late_interaction_kernels']} · flash-maxsim {env['flash_maxsim']} · "
            f"{env['timestamp']}"
        ),
        "",
    ]
    if result.get("ceilings"):
        c = result["ceilings"]
        lines += [
            (
                f"Ceilings: bf16 GEMM {c['bf16_tflops']:.0f} TFLOP/s, HBM copy {c['hbm_gbps']:.0f} "
                f"GB/s, pinned host→device {c['h2d_gbps']:.1f} GB/s."
            ),
            "",
        ]
    lines += [
        "| case | mode | provider | status | ms (p20-p80) | vs best peer | % of floor | peak MiB | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rec in result["cases"]:
        for name, e in rec["providers"].items():
            ms = f"{e['ms']:.3f} ({e['p20_ms']:.3f}-{e['p80_ms']:.3f})" if "ms" in e else ""
            speed = f"{e['speedup_vs_best_peer']:.2f}x" if "speedup_vs_best_peer" in e else ""
            floor = f"{e['pct_of_floor']:.0f}%" if "pct_of_floor" in e else ""
            peak = f"{e['peak_mib']:.0f}" if e.get("peak_mib") is not None else ""
            errs = ", ".join(f"{k.removesuffix('_err')} {e[k]:.1e}" for k in ("score_err", "grad_q_err", "grad_d_err") if k in e)
            status = e.get("status", "").split("\n")[0][:60]
            lines.append(f"| {rec['case']} | {rec['mode']} | {name} | {status} | {ms} | {speed} | {floor} | {peak} | {errs} |")
    lines += ["", "Targets (at least 1.2x the fastest passing peer):", ""]
    for rec in result["cases"]:
        if "target" in rec:
            t = rec["target"]
            lines.append(f"- {rec['case']}: {t['speedup_vs_best_peer']:.2f}x, {'met' if t['met'] else 'NOT met'}")
    return "\n".join(lines) + "\n"


def write(result: dict, out: Path | None) -> None:
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{RECORD_STEM}.json").write_text(json.dumps(result, indent=2, default=_json_default))
    (out / f"{RECORD_STEM}.md").write_text(markdown(result))


def _json_default(value):
    return str(value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="directory for the JSON and markdown records")
    parser.add_argument("--cases", default="all", help="comma list of case names, or 'all'")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--no-peers", dest="peers", action="store_false", help="time fusedmaxsim only")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run; runs on a CPU)")
    parser.add_argument("--warmup-ms", type=float, default=25.0)
    parser.add_argument("--rep-ms", type=float, default=200.0)
    parser.add_argument("--slow-reps", type=int, default=5, help="timed runs of each retrieval")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    pool = QUICK if args.quick else CASES
    wanted = None if args.cases == "all" else set(args.cases.split(","))
    cases = [c for c in pool if wanted is None or c.name in wanted]
    unknown = (wanted or set()) - {c.name for c in pool}
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; known: {[c.name for c in pool]}")

    result = {"schema": "fusedmaxsim.bench_ragged/1", "environment": environment(device),
              "dtype": args.dtype, "ceilings": measure_ceilings(device), "cases": []}
    failed = False
    for case in cases:
        print(f"[bench_ragged] {case.name} ({case.mode})", file=sys.stderr, flush=True)
        run = run_retrieve_case if case.kind.startswith("retrieve") else run_scoring_case
        record = run(case, dtype, device, args, result["ceilings"])
        result["cases"].append(record)
        ours = [e for e in record["providers"].values() if e["role"] == "ours"]
        failed |= any(e.get("status") != "ok" for e in ours)
        write(result, args.out)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(markdown(result))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
