"""Sharded retrieval on several GPUs: fusedmaxsim.distributed.retrieve, one process a GPU.

A synthetic corpus of ``--docs`` documents × ``--ld`` tokens × d = 128 (fp16, normalized; the
same data whatever the number of processes: document ``j`` comes from seed ``j``'s chunk) is
split over the ranks (``distributed.shard_range``); each rank holds its shard on its GPU. 32
queries of 32 tokens are on every rank. Measured, after warm-up, in rounds separated by
barriers: throughput at batch 32 (queries/s, top ``--top-k``) and latency at batch 1 (ms, the
median over the queries), each the median of ``--rounds`` rounds of the slowest rank's time.

Parity first: on a small corpus (the first ``--check-docs`` documents) the sharded result must
equal ``fusedmaxsim.retrieve`` over the whole of it on rank 0 (the same ids); a failure is
recorded and no time is.

Run it once a number of GPUs, into the same ``--out``: each run adds its row
(``distributed_bench.json``) and the markdown puts every row beside the one-process run::

    torchrun --nproc-per-node 1 benchmarks/bench_distributed.py --out DIR
    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --out DIR
    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --out DIR --device cpu --quick

(``--device cpu``: gloo on the CPU, the smoke run.) NCCL runs with ``NCCL_NVLS_ENABLE=0``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.records import environment  # noqa: E402

from fusedmaxsim import distributed, retrieve  # noqa: E402

DIM, LQ, CHUNK = 128, 32, 4096


def corpus_part(start: int, stop: int, ld: int, device) -> torch.Tensor:
    """Documents ``[start, stop)`` of the synthetic corpus, the same whoever makes them."""
    parts = []
    for c0 in range(start - start % CHUNK, stop, CHUNK):
        g = torch.Generator(device=device).manual_seed(c0)
        block = torch.randn(CHUNK, ld, DIM, device=device, generator=g, dtype=torch.float16)
        lo, hi = max(start, c0) - c0, min(stop, c0 + CHUNK) - c0
        parts.append(F.normalize(block[lo:hi].float(), dim=-1).half())
    return torch.cat(parts) if parts else torch.empty((0, ld, DIM), dtype=torch.float16,
                                                      device=device)


def timed(fn, device, reps: int) -> float:
    """The slowest rank's time per call (ms) over ``reps`` calls."""
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    ms = torch.tensor([(time.perf_counter() - t0) / reps * 1e3])
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--docs", type=int, default=200_000)
    p.add_argument("--ld", type=int, default=128)
    p.add_argument("--top-k", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--check-docs", type=int, default=2000)
    p.add_argument("--quick", action="store_true", help="a tiny corpus (smoke run)")
    a = p.parse_args(argv)
    if a.quick:
        a.docs, a.ld, a.rounds, a.check_docs = 600, 16, 1, 300
    cuda = a.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else \
        torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    g = torch.Generator(device=device).manual_seed(1)
    Q = F.normalize(torch.randn(32, LQ, DIM, device=device, generator=g), dim=-1).half()
    row = {"world_size": world, "backend": dist.get_backend(), "docs": a.docs, "ld": a.ld,
           "top_k": a.top_k}

    # Parity on a small corpus: the sharded ids equal one process's over the whole.
    start, stop = distributed.shard_range(a.check_docs)
    small = corpus_part(start, stop, a.ld, device)
    got = distributed.retrieve(Q, small, a.top_k, normalize=False, dst=0)
    if rank == 0:
        ref = retrieve(Q, corpus_part(0, a.check_docs, a.ld, device), a.top_k, normalize=False)
        row["parity"] = bool(torch.equal(got[1], ref[1]))
    flag = torch.tensor([int(row.get("parity", True))])
    dist.broadcast(flag, 0)
    del small

    if flag.item():
        start, stop = distributed.shard_range(a.docs)
        shard = corpus_part(start, stop, a.ld, device)
        batch = lambda: distributed.retrieve(Q, shard, a.top_k, normalize=False)  # noqa: E731
        single = lambda: distributed.retrieve(Q[0], shard, a.top_k, normalize=False)  # noqa: E731
        batch(), single()
        batch_ms = [timed(batch, device, 3) for _ in range(a.rounds)]
        one_ms = [timed(single, device, 5) for _ in range(a.rounds)]
        row["batch32_ms"] = statistics.median(batch_ms)
        row["qps"] = 32 / row["batch32_ms"] * 1e3
        row["latency_ms"] = statistics.median(one_ms)
        if cuda:
            row["peak_gib_rank0"] = torch.cuda.max_memory_allocated() / 2**30
    if rank == 0:
        write(a, row)
        print(json.dumps(row), flush=True)
    dist.destroy_process_group()
    return 0


def write(a, row) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "distributed_bench.json"
    rec = json.loads(path.read_text()) if path.exists() else {
        "environment": environment(torch.device(a.device)), "rows": []}
    rec["rows"] = [r for r in rec["rows"] if r["world_size"] != row["world_size"]] + [row]
    rec["rows"].sort(key=lambda r: r["world_size"])
    path.write_text(json.dumps(rec, indent=1, default=str))
    env, base = rec["environment"], next((r for r in rec["rows"] if r["world_size"] == 1), None)
    lines = ["# Sharded retrieval: fusedmaxsim.distributed.retrieve", "",
             f"- device: {env.get('gpu') or env.get('cpu')}; torch {env.get('torch')}; "
             f"git {env.get('git_sha')}",
             f"- {row['docs']} documents × {row['ld']} tokens × {DIM} (fp16), 32 queries × {LQ}, "
             f"top {row['top_k']}; the corpus split over the processes, one a GPU", "",
             "| processes | backend | parity | batch 32 (ms) | queries/s | × 1 process | "
             "latency, batch 1 (ms) | × 1 process |", "|---|---|---|---|---|---|---|---|"]
    for r in rec["rows"]:
        if "qps" not in r:
            lines.append(f"| {r['world_size']} | {r['backend']} | ✗ | – | – | – | – | – |")
            continue
        xq = f"{r['qps'] / base['qps']:.2f}" if base and "qps" in base else "–"
        xl = f"{r['latency_ms'] / base['latency_ms']:.2f}" if base and "qps" in base else "–"
        lines.append(f"| {r['world_size']} | {r['backend']} | ✓ | {r['batch32_ms']:.2f} | "
                     f"{r['qps']:.0f} | {xq} | {r['latency_ms']:.3f} | {xl} |")
    (out / "distributed_bench.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
