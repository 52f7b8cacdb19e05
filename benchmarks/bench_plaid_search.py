r"""End-to-end PLAID search: fusedmaxsim.plaid against fast-plaid 1.7 (the engine PyLate uses).

Corpora (``--docs``): synthetic ColBERT-like documents of 200-300 tokens, d = 128, each token
one of its document's 16 topics (of 4096) plus noise, normalized, made on the device from a
fixed seed. fast-plaid indexes each (``FastPlaid.create``, ``--nbits``; seconds recorded);
fusedmaxsim opens that directory in place (``plaid.load``; ``nbytes`` checked between the
residual bytes and fast-plaid's code and residual files). 32 queries × 32 tokens around the same
topics; both engines get the same fp16 values and settings (``top_k``, ``n_probe`` =
``n_ivf_probe``, ``n_candidates`` = ``n_full_scores``).

Parity gate, before any timing: per query the share of fusedmaxsim's top-k ids that fast-plaid
also returns, and the largest |score difference| over the ids both return. A mean agreement
below 0.99 or a difference above 1e-3·max(1, |score|) fails the corpus: its figures are
recorded, no speedup is. Recall@k of both against exact MaxSim over the uncompressed fp16
tokens (``fusedmaxsim.retrieve``).

Timing, in interleaved rounds (the engines' order rotates per query and round; the median of the
rounds): latency at batch 1 (median over the queries) and throughput at batch 32 (one call).
fusedmaxsim: CUDA events, the median of ``--reps`` back-to-back calls after warmup (its wall
time per synchronous call beside it); fast-plaid (host-synchronous): wall clock around each
call after ``torch.cuda.synchronize()``. Targets: ≥ 10× latency, ≥ 20× throughput. On CUDA
the search runs twice more, as a CUDA graph (``cuda_graph=True``; its results must equal the
eager search's first): events and wall clock, its latency speedup by the wall clock. Memory: the
allocator peak of one batch-32 search of ours above what was allocated before it, against the
compressed candidates (``n_candidates`` documents' codes and residuals per query, times the
batch) plus the outputs; target ≤ 1.2×.

``--scale N``: fusedmaxsim alone on N documents × 300 tokens of random tensors
(``PlaidIndex.from_tensors``; random codes fill every inverted list evenly, a pessimistic case):
latency at batch 1 and 32, a smoke check (ids in range, scores finite). Without fast-plaid, or
on a CPU, fusedmaxsim's index comes from a toy compression (random tokens as centroids, nearest
centroid codes, quantile buckets) and fast-plaid's columns read "not installed".

    PYTHONPATH=src python benchmarks/bench_plaid_search.py --out DIR
    PYTHONPATH=src python benchmarks/bench_plaid_search.py --out DIR \
        --docs 10000,100000 --scale 1000000
    PYTHONPATH=src python benchmarks/bench_plaid_search.py --quick --device cpu --out DIR  # smoke

Writes ``plaid_search_bench.json`` and ``.md`` into ``--out``, rewritten after every corpus.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from importlib import metadata
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.records import environment  # noqa: E402
from harness.util import json_safe  # noqa: E402

DIM, TOPICS_PER_DOC, QUERY_TOPICS, SEED = 128, 16, 4, 0
AGREEMENT_MIN, SCORE_TOL = 0.99, 1e-3
LATENCY_X, THROUGHPUT_X, MEMORY_X = 10.0, 20.0, 1.2
STEM = "plaid_search_bench"


# -- fusedmaxsim: every call of its PLAID API is here (imported on first use) ------------------

def ours_load(path, device):
    from fusedmaxsim.plaid import load
    return load(path, device=str(device))


def ours_from_tensors(centroids, weights, nbits, codes, residuals, lengths):
    from fusedmaxsim.plaid import PlaidIndex
    return PlaidIndex.from_tensors(centroids, weights, nbits, codes, residuals, lengths,
                                   bit_order="big")


def ours_search(index, Q, a, graph=False):  # -> (scores [Nq, k] fp32, ids [Nq, k] int64)
    return index.search(Q, top_k=a.top_k, n_probe=a.n_probe, n_candidates=a.n_candidates,
                        cuda_graph=graph)


def ours_describe(index):
    return {k: int(getattr(index, k)) for k in ("n_docs", "nbits", "dim", "nbytes")}


def exact_ids(Q, tokens, lengths, k):
    """Top-k ids by exact MaxSim over the uncompressed (fp16) tokens."""
    from fusedmaxsim import retrieve
    cu = F.pad(lengths.cumsum(0), (1, 0))
    return retrieve(Q, tokens, k, cu_seqlens_d=cu, max_seqlen_d=int(lengths.max()),
                    normalize=False)[1]


# -- fast-plaid ------------------------------------------------------------------------------

def fast_plaid_version():
    try:
        return metadata.version("fast-plaid")
    except metadata.PackageNotFoundError:
        return None


def fp_open(path, device):  # the index on the GPU whole ("high"): its fastest placement
    from fast_plaid import search
    index = device.index if device.index is not None else torch.cuda.current_device()
    return search.FastPlaid(index=path, device=f"cuda:{index}", index_gpu_memory="high")


def fp_search(fp, Q, a):  # -> per query a list of (doc_id, score)
    return fp.search(queries_embeddings=Q, top_k=a.top_k, n_ivf_probe=a.n_probe,
                     n_full_scores=a.n_candidates, show_progress=False)


# -- data ------------------------------------------------------------------------------------

def make_corpus(n_docs, topics, lengths, device, chunk=8192):
    """Packed fp32 tokens [ΣLd, d] and the lengths [Nd]: each document picks 16 topics, each
    token one of them plus noise of norm ~0.5, normalized."""
    g = torch.Generator(device=device).manual_seed(SEED + n_docs)
    lens = torch.randint(lengths[0], lengths[1] + 1, (n_docs,), device=device, generator=g)
    doc_topics = torch.randint(0, topics.shape[0], (n_docs, TOPICS_PER_DOC), device=device,
                               generator=g)
    parts = []
    for j in range(0, n_docs, chunk):
        doc = torch.repeat_interleave(torch.arange(j, min(j + chunk, n_docs), device=device),
                                      lens[j:j + chunk])
        pick = torch.randint(0, TOPICS_PER_DOC, doc.shape, device=device, generator=g)
        t = topics[doc_topics[doc, pick]]
        noise = torch.randn(t.shape, device=device, generator=g)
        parts.append(F.normalize(t + 0.5 / DIM ** 0.5 * noise, dim=-1))
    return torch.cat(parts), lens


def make_queries(n_q, l_q, topics, device):
    g = torch.Generator(device=device).manual_seed(SEED + 1)
    own = torch.randint(0, topics.shape[0], (n_q, QUERY_TOPICS), device=device, generator=g)
    pick = torch.randint(0, QUERY_TOPICS, (n_q, l_q), device=device, generator=g)
    t = topics[own.gather(1, pick)]
    noise = torch.randn(t.shape, device=device, generator=g)
    return F.normalize(t + 0.7 / DIM ** 0.5 * noise, dim=-1).half()


def toy_compress(tokens, nbits, n_centroids, chunk=1 << 15):
    """A k-means-free PLAID compression: random tokens as centroids, nearest-centroid codes,
    residuals in 2**nbits per-dimension quantile buckets, packed as fast-plaid packs them (each
    code least significant bit first, bytes most significant bit first: bit_order "big")."""
    g = torch.Generator(device=tokens.device).manual_seed(SEED + 2)
    pick = torch.randperm(tokens.shape[0], device=tokens.device, generator=g)[:n_centroids]
    centroids = F.normalize(tokens[pick].float(), dim=-1)
    x = tokens[:chunk].float()
    sample = (x - centroids[(x @ centroids.T).argmax(1)]).flatten()[:1 << 22]
    levels = torch.arange(1 << nbits, device=tokens.device, dtype=torch.float32) / (1 << nbits)
    cutoffs = torch.quantile(sample, levels[1:])
    weights = torch.quantile(sample, levels + 0.5 / (1 << nbits))
    shifts = torch.arange(nbits, device=tokens.device)
    msb_first = 7 - torch.arange(8, device=tokens.device)
    codes, residuals = [], []
    for x in tokens.split(chunk):
        x = x.float()
        c = (x @ centroids.T).argmax(1)
        bits = (torch.bucketize(x - centroids[c], cutoffs).unsqueeze(-1) >> shifts) & 1
        residuals.append((bits.reshape(len(x), -1, 8) << msb_first).sum(-1).to(torch.uint8))
        codes.append(c)
    return centroids.half(), weights, torch.cat(codes), torch.cat(residuals)


# -- measuring -------------------------------------------------------------------------------

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_ms(fn, device, reps):
    """Median ms of ``reps`` synchronous calls by the wall clock."""
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def event_ms(fn, device, reps):
    """Median ms of ``reps`` back-to-back calls by CUDA events (wall clock on a CPU)."""
    if device.type != "cuda":
        return wall_ms(fn, device, reps)
    marks = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(reps)]
    _sync(device)
    for start, end in marks:
        start.record()
        fn()
        end.record()
    _sync(device)
    return statistics.median(s.elapsed_time(e) for s, e in marks)


def interleaved(timers, rounds):
    """``{engine: [timer per item]}`` → ``{engine: [median over rounds per item]}``; the engines'
    order rotates with every item and round."""
    names, n = list(timers), len(next(iter(timers.values())))
    got = {name: [[] for _ in range(n)] for name in names}
    for r in range(rounds):
        for i in range(n):
            k = (r + i) % len(names)
            for name in names[k:] + names[:k]:
                got[name][i].append(timers[name][i]())
    return {name: [statistics.median(x) for x in got[name]] for name in names}


def speed(engines, Q, a, device):
    """Latency at batch 1 (median over queries) and throughput at batch Nq of every engine:
    ``engines`` maps a name to ``(fn(Q), timer)``."""
    for fn, _ in engines.values():  # warm every shape first (autotuning, lazy index loads)
        for _ in range(3):
            fn(Q[:1]), fn(Q)
    _sync(device)
    one = interleaved({n: [lambda i=i, f=f, t=t: t(lambda: f(Q[i:i + 1]), device, a.reps)
                           for i in range(Q.shape[0])] for n, (f, t) in engines.items()}, a.rounds)
    full = interleaved({n: [lambda f=f, t=t: t(lambda: f(Q), device, a.reps)]
                        for n, (f, t) in engines.items()}, a.rounds)
    return {n: {"latency_ms": statistics.median(one[n]), "batch_ms": full[n][0],
                "qps": Q.shape[0] / full[n][0] * 1e3} for n in engines}


def parity(scores, ids, fp_results):
    agree, abs_diff, rel_diff = [], 0.0, 0.0
    for i, res in enumerate(fp_results):
        mine = {d: s for d, s in zip(ids[i].tolist(), scores[i].tolist()) if d >= 0}
        theirs = {int(d): float(s) for d, s in res}
        both = mine.keys() & theirs.keys()
        agree.append(len(both) / max(len(mine), len(theirs), 1))
        for d in both:
            diff = abs(mine[d] - theirs[d])
            abs_diff, rel_diff = max(abs_diff, diff), max(rel_diff, diff / max(1.0, abs(theirs[d])))
    mean = statistics.mean(agree)
    failed = None
    if mean < AGREEMENT_MIN or rel_diff > SCORE_TOL:
        failed = f"agreement {mean:.3f} (min {AGREEMENT_MIN}), max rel |Δscore| {rel_diff:.1e}"
    return {"agreement": mean, "agreement_min": min(agree), "per_query": agree,
            "max_abs_diff": abs_diff, "max_rel_diff": rel_diff, "failed": failed}


def recall(found, exact, k):
    return statistics.mean(len({d for d in f if d >= 0} & set(e)) / k
                           for f, e in zip(found, exact.tolist()))


def peak_bytes(fn, device):
    _sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    _sync(device)
    return torch.cuda.max_memory_allocated(device) - base


def attempt(fn, n_docs):
    """``fn()``, or a row recording its error (the traceback goes to stdout): never hidden."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc(file=sys.stdout)
        error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
        log(f"{n_docs} documents failed: {error}")
        return {"docs": n_docs, "error": error}


# -- one corpus ------------------------------------------------------------------------------

def profile_search(fn, Q, device, reps=5, top=12):
    """Where one search's time goes: the wall time per call, the GPU kernels' time per call
    (torch.profiler), and the kernels taking most of it, at batch 1 and at the full batch."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    out = {}
    for label, q in (("batch 1", Q[:1]), (f"batch {Q.shape[0]}", Q)):
        fn(q)
        _sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn(q)
            _sync(device)
            wall = (time.perf_counter() - t0) / reps * 1e3
        kernels = []
        for e in prof.key_averages():
            us = getattr(e, "self_device_time_total", None)
            if us is None:
                us = getattr(e, "self_cuda_time_total", 0)
            if e.device_type == DeviceType.CUDA and us > 0:
                kernels.append((e.key[:90], us / reps / 1e3, e.count / reps))
        kernels.sort(key=lambda k: -k[1])
        out[label] = {"wall_ms": wall, "gpu_ms": sum(k[1] for k in kernels),
                      "launches": sum(k[2] for k in kernels),
                      "kernels": [{"name": n, "ms": ms, "calls": c} for n, ms, c in kernels[:top]]}
        log(f"profile {label}: wall {wall:.3f} ms, GPU {out[label]['gpu_ms']:.3f} ms, "
            f"{out[label]['launches']:g} kernels; " + "; ".join(
                f"{n[:40]} {ms:.4f}x{c:g}" for n, ms, c in kernels))
    return out


def run_corpus(n_docs, a, device, topics, Q, workdir):
    row = {"docs": n_docs, "nbits": a.nbits}
    tokens, lens = make_corpus(n_docs, topics, a.lengths, device)
    T = row["tokens"] = tokens.shape[0]
    fp, disk = None, 0
    if fast_plaid_version() is not None and device.type == "cuda":
        path = os.path.join(workdir, f"docs{n_docs}")
        shutil.rmtree(path, ignore_errors=True)
        fp, t0 = fp_open(path, device), time.perf_counter()
        fp.create(documents_embeddings=list(tokens.split(lens.tolist())), nbits=a.nbits, seed=SEED)
        t1 = time.perf_counter()
        ours = ours_load(path, device)
        _sync(device)
        row["build_s"], row["load_s"] = t1 - t0, time.perf_counter() - t1
        log(f"fast-plaid built {n_docs} documents in {row['build_s']:.1f} s; loaded in "
            f"{row['load_s']:.2f} s")
        row["n_centroids"] = json.loads(Path(path, "metadata.json").read_text())["num_partitions"]
        disk = sum(os.path.getsize(f) for f in (Path(path, "merged_codes.npy"),
                                                Path(path, "merged_residuals.npy")) if f.exists())
    else:
        row["fast_plaid"] = "not installed" if fast_plaid_version() is None else "needs CUDA"
        K = row["n_centroids"] = min(T, 2 ** int(math.log2(16 * math.sqrt(T))))
        t0 = time.perf_counter()
        centroids, weights, codes, residuals = toy_compress(tokens, a.nbits, K)
        ours = ours_from_tensors(centroids, weights, a.nbits, codes, residuals, lens)
        _sync(device)
        row["toy_build_s"] = time.perf_counter() - t0
    index = row["index"] = ours_describe(ours)
    floor = T * DIM * a.nbits // 8  # the residual bytes alone
    index.update(residual_bytes=floor, disk_bytes=disk or None,
                 nbytes_ok=floor <= index["nbytes"] and (not disk or index["nbytes"] <= disk))
    tokens16 = tokens.half()
    del tokens
    exact = exact_ids(Q, tokens16, lens, a.top_k)
    del tokens16
    with torch.no_grad():
        scores, ids = ours_search(ours, Q, a)
        row["recall_ours"] = recall(ids.tolist(), exact, a.top_k)
        engines = {"ours": (lambda q: ours_search(ours, q, a), event_ms),
                   "ours_wall": (lambda q: ours_search(ours, q, a), wall_ms)}
        if device.type == "cuda":
            g_scores, g_ids = ours_search(ours, Q, a, graph=True)
            row["graph_equal"] = bool(torch.equal(g_ids, ids) and torch.equal(g_scores, scores))
            if row["graph_equal"]:
                engines["ours_graph"] = (lambda q: ours_search(ours, q, a, True), event_ms)
                engines["ours_graph_wall"] = (lambda q: ours_search(ours, q, a, True), wall_ms)
        if fp is not None:
            res = fp_search(fp, Q, a)
            row["recall_fast_plaid"] = recall([[d for d, _ in r] for r in res], exact, a.top_k)
            row["parity"] = parity(scores, ids, res)
            engines["fast_plaid"] = (lambda q: fp_search(fp, q, a), wall_ms)
        p = row.get("parity") or {}
        log(f"agreement {p.get('agreement')}, max rel |Δscore| {p.get('max_rel_diff')}; recall "
            f"ours {row['recall_ours']:.3f}, fast-plaid {row.get('recall_fast_plaid')}")
        row["speed"] = s = speed(engines, Q, a, device)
        if device.type == "cuda":
            peak = peak_bytes(lambda: ours_search(ours, Q, a), device)
            cand = (Q.shape[0] * min(a.n_candidates, n_docs) * (T / n_docs) * index["nbytes"] / T
                    + Q.shape[0] * a.top_k * 12)  # candidates' codes and residuals, outputs
            row["memory"] = {"peak_bytes": peak, "candidate_bytes": cand, "ratio": peak / cand}
            if a.profile:
                try:
                    row["profile"] = profile_search(lambda q: ours_search(ours, q, a), Q, device)
                except Exception as e:  # the profile is an extra: it never costs the corpus
                    log(f"profile failed: {type(e).__name__}: {e}")
    gate = fp is not None and row["parity"]["failed"] is None
    row["latency_x"] = s["fast_plaid"]["latency_ms"] / s["ours"]["latency_ms"] if gate else None
    row["throughput_x"] = s["ours"]["qps"] / s["fast_plaid"]["qps"] if gate else None
    graph = gate and "ours_graph" in s
    # The graph's speedups: latency by the wall clock around a synchronous call, as
    # fast-plaid's.
    row["graph_latency_x"] = (s["fast_plaid"]["latency_ms"] / s["ours_graph_wall"]["latency_ms"]
                              if graph else None)
    row["graph_throughput_x"] = (s["ours_graph"]["qps"] / s["fast_plaid"]["qps"] if graph
                                 else None)
    log(f"latency ms {({n: round(v['latency_ms'], 3) for n, v in s.items()})}, qps "
        f"{({n: round(v['qps']) for n, v in s.items()})}, memory {row.get('memory')}")
    if fp is not None:
        fp.close()
    return row


def run_scale(n_docs, a, device, length=300):
    g = torch.Generator(device=device).manual_seed(SEED + 3)
    K, T = a.scale_centroids, n_docs * length
    centroids = F.normalize(torch.randn(K, DIM, device=device, generator=g), dim=-1).half()
    codes = torch.randint(0, K, (T,), device=device, dtype=torch.int32, generator=g)
    residuals = torch.randint(0, 256, (T, DIM * a.nbits // 8), device=device, dtype=torch.uint8,
                              generator=g)
    weights = torch.linspace(-0.05, 0.05, 1 << a.nbits, device=device)
    lens = torch.full((n_docs,), length, device=device)
    t0 = time.perf_counter()
    ours = ours_from_tensors(centroids, weights, a.nbits, codes, residuals, lens)
    _sync(device)
    row = {"docs": n_docs, "tokens": T, "n_centroids": K, "build_s": time.perf_counter() - t0}
    del codes, residuals
    row["index"] = ours_describe(ours)
    q = centroids[torch.randint(0, K, (a.queries, a.query_len), device=device, generator=g)]
    noise = torch.randn(q.shape, device=device, generator=g)
    Q = F.normalize(q.float() + 0.3 / DIM ** 0.5 * noise, dim=-1).half()
    with torch.no_grad():
        scores, ids = ours_search(ours, Q, a)
        found = ids >= 0
        row["smoke_ok"] = bool(((ids >= -1) & (ids < n_docs)).all()
                               and torch.isfinite(scores[found]).all() and found.any())
        engines = {"ours": (lambda x: ours_search(ours, x, a), event_ms)}
        if device.type == "cuda":
            engines["ours_graph"] = (lambda x: ours_search(ours, x, a, True), event_ms)
        row["speed"] = speed(engines, Q, a, device)
    log(f"scale: {row['speed']}, smoke {row['smoke_ok']}")
    return row


# -- records ---------------------------------------------------------------------------------

def _f(x, fmt, target=None, above=True):
    """A number, with ✓/✗ against its target where it has one; – where not measured."""
    if x is None:
        return "–"
    mark = "" if target is None else (" ✓" if (x >= target if above else x <= target) else " ✗")
    return format(x, fmt) + mark


def _row(*cells):
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(*head):
    return ["", _row(*head), _row(*["---"] * len(head))]


def markdown(rec):
    env, st, rows = rec["environment"], rec["settings"], rec["corpora"]
    lines = [
        "# PLAID search: fusedmaxsim against fast-plaid", "",
        (f"- device: {env.get('gpu') or env.get('cpu')}; torch {env.get('torch')}, triton "
         f"{env.get('triton')}, fast-plaid {env.get('fast_plaid') or 'not installed'}; "
         f"git {env.get('git_sha')}"),
        (f"- {st['queries']} queries × {st['query_len']} tokens, d = {DIM}, nbits {st['nbits']}, "
         f"top_k {st['top_k']}, n_probe {st['n_probe']}, n_candidates {st['n_candidates']}; "
         f"{st['rounds']} interleaved rounds of {st['reps']} calls"),
        *_table("docs", "tokens", "K", "build s", "nbytes MiB", "id agreement", "max rel Δscore",
                "recall@k fast-plaid", "recall@k ours")]
    for r in rows:
        if "error" in r:
            lines.append(_row(r["docs"], f"✗ {r['error']}"))
            continue
        p, ix, na = r.get("parity") or {}, r["index"], r.get("fast_plaid")
        build = f"{r['build_s']:.1f}" if "build_s" in r else f"{r['toy_build_s']:.1f} (toy)"
        lines.append(_row(
            r["docs"], r["tokens"], r["n_centroids"], build,
            f"{ix['nbytes'] / 2**20:.1f}{'' if ix['nbytes_ok'] else ' ✗'}",
            na or _f(p.get("agreement"), ".3f", AGREEMENT_MIN),
            na or _f(p.get("max_rel_diff"), ".1e", SCORE_TOL, above=False),
            na or _f(r.get("recall_fast_plaid"), ".3f"), f"{r['recall_ours']:.3f}"))
    lines += _table("docs", "latency ms fast-plaid", "ours", "ours wall", f"× (≥ {LATENCY_X:g})",
                    "qps fast-plaid", "ours", f"× (≥ {THROUGHPUT_X:g})", "peak MiB",
                    "candidates MiB", f"ratio (≤ {MEMORY_X:g})")
    for r in (r for r in rows if "speed" in r):
        s, m, na = r["speed"], r.get("memory") or {}, r.get("fast_plaid")
        fps = s.get("fast_plaid", {})
        no_x = "✗ parity" if (r.get("parity") or {}).get("failed") else "–"
        lines.append(_row(
            r["docs"], na or _f(fps.get("latency_ms"), ".2f"), f"{s['ours']['latency_ms']:.3f}",
            f"{s['ours_wall']['latency_ms']:.3f}",
            _f(r["latency_x"], ".1f", LATENCY_X) if r["latency_x"] else no_x,
            na or _f(fps.get("qps"), ".0f"), f"{s['ours']['qps']:.0f}",
            _f(r["throughput_x"], ".1f", THROUGHPUT_X) if r["throughput_x"] else no_x,
            *(_f(m[k] / 2**20 if k in m else None, ".1f")
              for k in ("peak_bytes", "candidate_bytes")),
            _f(m.get("ratio"), ".2f", MEMORY_X, above=False)))
    graphs = [r for r in rows if "ours_graph" in r.get("speed", {})]
    if graphs:
        lines += ["", "The same searches as CUDA graphs (`cuda_graph=True`; results equal to "
                      "the eager search's, checked first):"]
        lines += _table("docs", "latency ms fast-plaid", "graph", "graph wall",
                        f"× wall (≥ {LATENCY_X:g})", "qps fast-plaid", "graph",
                        f"× (≥ {THROUGHPUT_X:g})")
        for r in graphs:
            s, fps = r["speed"], r["speed"].get("fast_plaid", {})
            lines.append(_row(
                r["docs"], _f(fps.get("latency_ms"), ".2f"),
                f"{s['ours_graph']['latency_ms']:.3f}",
                f"{s['ours_graph_wall']['latency_ms']:.3f}",
                _f(r.get("graph_latency_x"), ".1f", LATENCY_X), _f(fps.get("qps"), ".0f"),
                f"{s['ours_graph']['qps']:.0f}", _f(r.get("graph_throughput_x"), ".1f",
                                                    THROUGHPUT_X)))
    failed = [f"- {r['docs']} documents: {r['parity']['failed']}" for r in rows
              if (r.get("parity") or {}).get("failed")]
    lines += ["", "Parity failures (no speedup reported):", "", *failed] if failed else []
    r = rec.get("scale")
    if r:
        lines += ["", "Scale, fusedmaxsim alone (random index):"]
        lines += _table("docs", "tokens", "K", "nbytes GiB", "build s", "search", "latency ms",
                        f"ms at batch {st['queries']}", "qps", "smoke")
        if "error" in r:
            lines.append(_row(r["docs"], f"✗ {r['error']}"))
        else:
            for name, s in r["speed"].items():
                lines.append(_row(r["docs"], r["tokens"], r["n_centroids"],
                                  f"{r['index']['nbytes'] / 2**30:.2f}", f"{r['build_s']:.1f}",
                                  "graph" if name == "ours_graph" else "eager",
                                  f"{s['latency_ms']:.3f}", f"{s['batch_ms']:.3f}",
                                  f"{s['qps']:.0f}", "✓" if r["smoke_ok"] else "✗"))
    for r in (r for r in rows if "profile" in r):
        lines += ["", f"Where our search's time goes, {r['docs']} documents (torch.profiler, per "
                      "call):"]
        for label, prof in r["profile"].items():
            launches = f", {prof['launches']:g} launches" if "launches" in prof else ""
            lines += ["", f"- {label}: wall {prof['wall_ms']:.3f} ms, GPU kernels "
                          f"{prof['gpu_ms']:.3f} ms{launches}", ""]
            lines += _table("kernel", "ms", "launches")[1:]
            lines += [_row(k["name"].replace("|", "/"), f"{k['ms']:.4f}", f"{k['calls']:g}")
                      for k in prof["kernels"]]
    return "\n".join(lines) + "\n"


def write(rec, out):
    for name, text in ((f"{STEM}.json", json.dumps(json_safe(rec), indent=1, default=str)),
                       (f"{STEM}.md", markdown(rec))):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out / name)


_T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - _T0:6.1f} s] {msg}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="a tiny corpus and 4 queries (smoke run)")
    p.add_argument("--docs", default="10000", help="comma list of corpus sizes")
    p.add_argument("--nbits", type=int, default=2)
    p.add_argument("--queries", type=int, default=32)
    p.add_argument("--query-len", type=int, default=32)
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--n-probe", type=int, default=8, help="fast-plaid's n_ivf_probe")
    p.add_argument("--n-candidates", type=int, default=4096, help="fast-plaid's n_full_scores")
    p.add_argument("--topics", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5, help="calls per timed measurement")
    p.add_argument("--scale", type=int, default=0, help="documents of the ours-only scale run")
    p.add_argument("--scale-centroids", type=int, default=1 << 16)
    p.add_argument("--profile", action="store_true",
                   help="break our search's time into GPU kernels (torch.profiler), per corpus")
    p.add_argument("--index-dir", help="where fast-plaid's indexes go (default: a temporary one)")
    a = p.parse_args(argv)
    a.lengths = (200, 300)
    if a.quick:
        a.docs, a.queries, a.topics, a.lengths, a.rounds, a.reps = "300", 4, 64, (20, 40), 1, 2
    device, out = torch.device(a.device), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(environment(device), fast_plaid=fast_plaid_version())
    settings = {k: getattr(a, k) for k in ("nbits", "queries", "query_len", "top_k", "n_probe",
                                           "n_candidates", "topics", "rounds", "reps", "lengths")}
    rec = {"schema": "fusedmaxsim.plaid_search_bench/1", "environment": env, "settings": settings,
           "corpora": [], "scale": None}
    g = torch.Generator(device=device).manual_seed(SEED)
    topics = F.normalize(torch.randn(a.topics, DIM, device=device, generator=g), dim=-1)
    Q = make_queries(a.queries, a.query_len, topics, device)
    workdir = a.index_dir or tempfile.mkdtemp(prefix="plaid_search_bench_")
    try:
        for n_docs in (int(x) for x in a.docs.split(",")):
            log(f"corpus of {n_docs} documents")
            rec["corpora"].append(attempt(lambda n=n_docs: run_corpus(n, a, device, topics, Q,
                                                                      workdir), n_docs))
            write(rec, out)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if a.scale:
            log(f"scale run: {a.scale} documents")
            rec["scale"] = attempt(lambda: run_scale(a.scale, a, device), a.scale)
            write(rec, out)
    finally:
        if a.index_dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(markdown(rec), flush=True)
    return 1 if any("error" in r for r in rec["corpora"] + [rec["scale"] or {}]) else 0


if __name__ == "__main__":
    sys.exit(main())
