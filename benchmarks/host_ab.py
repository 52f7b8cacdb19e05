"""A call's wall time for two source trees, alternating in fresh processes on one machine: what a
change does, apart from the machine's own speed (which moves more between processes than many
changes weigh). Each process times its calls back to back, one synchronize per round, the best
of five rounds.

    python3 benchmarks/host_ab.py SRC_BEFORE SRC_AFTER [--rounds N] [--device cuda|cpu]

On CUDA: a training step, ``maxsim(Q, D).backward(g)`` (bf16), on the host-bound training rows
of the suite, and the forward without gradient on rerank_colbert's shape (the Gluon forward's
launch path, host-bound). On a CPU (the PyTorch path): the forward without gradient, fp32, on
reranking and in-batch shapes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

# name, Nq, Lq, K or Nd, Ld, per-query candidates, a training step (else a no_grad forward)
CUDA_SHAPES = (("train_small_batch", 32, 32, 32, 180, False, True),
               ("train_kd", 64, 32, 32, 300, True, True),
               ("train_kd_colpali", 32, 32, 16, 1030, True, True),
               ("train_colbert", 128, 32, 128, 300, False, True),
               ("rerank_colbert forward", 1, 32, 1000, 300, False, False))
CPU_SHAPES = (("rerank 1 x 100, 32 x 300", 1, 32, 100, 300, False, False),
              ("batch 16 x 64, 32 x 180", 16, 32, 64, 180, False, False),
              ("rerank 1 x 20, 128 x 1030", 1, 128, 20, 1030, False, False),
              ("candidates 8 x 16, 32 x 180", 8, 32, 16, 180, True, False))

CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
import torch
from fusedmaxsim import maxsim
device = sys.argv[2]
dtype = torch.bfloat16 if device == "cuda" else torch.float32
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
for name, nq, lq, nd, ld, kd, training in %s:
    Q = torch.randn(nq, lq, 128, device=device, dtype=dtype).requires_grad_(training)
    shape = (nq, nd, ld, 128) if kd else (nd, ld, 128)
    D = torch.randn(*shape, device=device, dtype=dtype).requires_grad_(training)
    g = torch.randn(nq, nd, device=device)
    def step():
        Q.grad = D.grad = None
        maxsim(Q, D).backward(g)
    def forward():
        with torch.no_grad():
            maxsim(Q, D)
    call, calls = (step, 200) if training else (forward, 400) if device == "cuda" else (forward, 10)
    for _ in range(max(3, calls // 4)):
        call()
    best = float("inf")
    for _ in range(5):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        sync()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    print(f"{name} {best:.1f}")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    child = CHILD % (CUDA_SHAPES if args.device == "cuda" else CPU_SHAPES,)
    what = "us a call" if args.device == "cuda" else "us a forward"
    for r in range(args.rounds):
        for label, src in (("before", args.before), ("after", args.after)):
            out = subprocess.run([sys.executable, "-c", child, src, args.device],
                                 capture_output=True, text=True, check=False)
            rows = " | ".join(out.stdout.split("\n")[:-1]) or out.stderr[-300:]
            print(f"round {r} {label:6s} ({what}): {rows}", flush=True)


if __name__ == "__main__":
    main()
