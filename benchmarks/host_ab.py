"""A training step's wall time per call for two source trees, alternating in fresh processes
on one machine: what a host-side change does to the host-bound training rows, apart from the
machine's own speed. Each process times `maxsim(Q, D).backward(g)` (bf16, CUDA), calls back to
back, one synchronize per round, the best of five rounds.

    python3 benchmarks/host_ab.py SRC_BEFORE SRC_AFTER [ROUNDS]
"""

from __future__ import annotations

import subprocess
import sys

SHAPES = (("train_small_batch", 32, 32, 32, 180, False), ("train_kd", 64, 32, 32, 300, True),
          ("train_kd_colpali", 32, 32, 16, 1030, True), ("train_colbert", 128, 32, 128, 300, False))

CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
import torch
from fusedmaxsim import maxsim
for name, nq, lq, nd, ld, kd in %r:
    Q = torch.randn(nq, lq, 128, device="cuda", dtype=torch.bfloat16).requires_grad_()
    shape = (nq, nd, ld, 128) if kd else (nd, ld, 128)
    D = torch.randn(*shape, device="cuda", dtype=torch.bfloat16).requires_grad_()
    g = torch.randn(nq, nd, device="cuda")
    def step():
        Q.grad = D.grad = None
        maxsim(Q, D).backward(g)
    for _ in range(50):
        step()
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(200):
            step()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / 200 * 1e6)
    print(f"{name} {best:.1f}")
""" % (SHAPES,)


def main() -> None:
    before, after = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    for r in range(rounds):
        for label, src in (("before", before), ("after", after)):
            out = subprocess.run([sys.executable, "-c", CHILD, src], capture_output=True, text=True)
            rows = " | ".join(out.stdout.split("\n")[:-1]) or out.stderr[-300:]
            print(f"round {r} {label:6s} (us a step): {rows}", flush=True)


if __name__ == "__main__":
    main()
