"""One call of each forward-bound row's kernels inside an NVTX range ``profile``, for Nsight
Compute to read the hardware counters of (benchmarks/NOTES.md section 29): where the forward's
time goes (tensor pipe, L2, shared memory, warp stalls), which GPU time alone cannot split.

    ncu --clock-control none --nvtx --nvtx-include "profile/" --section ... \
        python3 benchmarks/ncu_forward.py [ROW ...]

Each row's call runs twice first (compiles, warms the caches), then once inside the range. The
rows print their names in order, so the report's kernels can be matched to them.

    python3 benchmarks/ncu_forward.py --summarize DIR

reads what benchmarks/ncu_forward.sh left in DIR and prints one table of the sections' main
figures per kernel, then the stall reasons and the most-sampled SASS lines of the profiled rows.
"""

from __future__ import annotations

import collections
import csv
import gzip
import io
import os
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
# maxsim, and the autograd layer's plan-and-launch (the training forward without its backward):
from fusedmaxsim import maxsim  # noqa: E402
from fusedmaxsim._autograd import run_forward  # noqa: E402
from fusedmaxsim._problem import dense_problem, options_for  # noqa: E402

os.environ.setdefault("LIK_SUPPRESS_NORM_WARN", "1")


def _inputs(nq: int, nd: int, lq: int, ld: int, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    Q = torch.randn(nq, lq, 128, device="cuda", dtype=dtype, generator=g)
    D = torch.randn(nd, ld, 128, device="cuda", dtype=dtype, generator=g)
    return Q, D


def _ours(nq, nd, lq, ld, *, normalize=False, save_argmax=False):
    Q, D = _inputs(nq, nd, lq, ld)
    if save_argmax:  # the training forward's own launch, without the backward
        p, o = dense_problem(Q, D, None, None, save_argmax=True), options_for(Q)
        return lambda: run_forward(p, o, Q, D, None, None, None, None)

    def call():
        with torch.no_grad():
            maxsim(Q, D, normalize=normalize)

    return call


def _lik(nq, nd, lq, ld, *, normalize=False):
    import late_interaction_kernels as lik

    Q, D = _inputs(nq, nd, lq, ld)

    def call():
        with torch.no_grad():
            lik.maxsim(Q, D, normalize=normalize)

    return call


def _plaid_approx(nd, ld, *, lik=False):
    """One query's approximate score on padded ids (bench_plaid's approx inputs)."""
    from fusedmaxsim.plaid import plaid_approx_score

    g = torch.Generator(device="cuda").manual_seed(0)
    codes = torch.randint(0, 4096, (nd, ld), device="cuda", generator=g)
    lengths = torch.randint(ld // 2, ld + 1, (nd,), device="cuda", generator=g)
    centroids = torch.nn.functional.normalize(torch.randn(4096, 128, device="cuda"), dim=-1)
    Q = torch.nn.functional.normalize(torch.randn(32, 128, device="cuda"), dim=-1)
    cs = (centroids @ Q.T)[None].half()
    if lik:
        from late_interaction_kernels.plaid import plaid_approx_score as lik_approx

        cs32 = cs[0].float()
        return lambda: lik_approx(cs32, codes, lengths)
    return lambda: plaid_approx_score(cs, codes, lengths)


def _plaid_residual(nd, ld, nq, n_cand):
    """The residual kernel (nbits 2): the search's rescoring (``n_cand`` candidates a query) or
    the cross product (``n_cand`` 0); the PLAID probes' inputs."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from probes.plaid import _call, _inputs

    index, Q = _inputs(nd, ld, nq, 2)
    call = _call(index, Q, n_cand)

    def run():
        with torch.no_grad():
            call()

    return run


ROWS = {
    "batch_colbert": lambda: _ours(256, 256, 32, 300),
    "rerank_colpali": lambda: _ours(1, 1000, 128, 1024),
    "rerank_colpali_norm": lambda: _ours(1, 1000, 128, 1024, normalize=True),
    "rerank_colpali_1030": lambda: _ours(1, 1000, 1030, 1030),
    "longquery": lambda: _ours(4, 64, 2048, 1024),
    "train_colpali_fwd": lambda: _ours(128, 128, 128, 1024, save_argmax=True),
    "train_colpali_nograd": lambda: _ours(128, 128, 128, 1024),
    "lik_rerank_colpali_norm": lambda: _lik(1, 1000, 128, 1024, normalize=True),
    "lik_batch_colbert": lambda: _lik(256, 256, 32, 300),
    "approx_5000x200": lambda: _plaid_approx(5000, 200),
    "approx_25000x200": lambda: _plaid_approx(25000, 200),
    "approx_25000x512": lambda: _plaid_approx(25000, 512),
    "lik_approx_5000x200": lambda: _plaid_approx(5000, 200, lik=True),
    "lik_approx_25000x200": lambda: _plaid_approx(25000, 200, lik=True),
    "rescore_1x1024": lambda: _plaid_residual(10000, 300, 1, 1024),
    "rescore_32x1024": lambda: _plaid_residual(10000, 300, 32, 1024),
    "residual_5000x200": lambda: _plaid_residual(5000, 200, 1, 0),
}


SUMMARY_METRICS = (
    "sm__inst_executed_pipe_tensor_op_gmma", "sm__pipe_shared_cycles_active", "Duration",
    "DRAM Throughput", "L2 Cache Throughput", "L1/TEX Cache Throughput", "Compute (SM) Throughput",
    "Issue Slots Busy", "No Eligible", "Active Warps Per Scheduler", "Eligible Warps Per Scheduler",
    "Registers Per Thread", "Dynamic Shared Memory Per Block", "Block Limit Registers",
    "Achieved Occupancy", "L2 Hit Rate", "Block Size", "Grid Size", "Local Memory Spilling Requests",
)


def summarize(folder: Path) -> None:
    text = (folder / "ncu_forward.txt").read_text()
    rows = re.findall(r"^row (\S+)$", text, flags=re.M)
    kernels = re.split(r"\n  \S+ \([^\n]*\)x\([^\n]*\), Context[^\n]*\n", text)[1:]
    print(f"{'metric':40s}" + "".join(f"{name[:15]:>16s}" for name in rows))
    for metric in SUMMARY_METRICS:
        values = []
        for body in kernels:
            found = re.search(re.escape(metric) + r"[^\n]*?\s([\d,.]+)\s*\n", body)
            values.append(found.group(1) if found else "-")
        print(f"{metric[:40]:40s}" + "".join(f"{v:>16s}" for v in values))
    sass = folder / "src_sass.csv.gz"
    if not sass.exists():
        return
    source_rows = re.findall(r"^row (\S+)$", (folder / "ncu_src.log").read_text(), flags=re.M)
    for name, block in zip(source_rows, gzip.open(sass, "rt").read().split('"Kernel Name"')[1:]):
        lines = list(csv.DictReader(io.StringIO(block.split("\n", 1)[1])))
        reasons = [c for c in lines[0] if c.startswith("stall_") and "Not Issued" not in c]
        samples = sum(int(r["Warp Stall Sampling (All Samples)"] or 0) for r in lines)
        totals = collections.Counter()
        for r in lines:
            for c in reasons:
                totals[c[6:]] += int(r[c] or 0)
        print(f"\n{name}: {samples} warp samples; by reason: "
              + ", ".join(f"{c} {v / samples:.1%}" for c, v in totals.most_common(8)))
        for r in sorted(lines, key=lambda r: -int(r["Warp Stall Sampling (All Samples)"] or 0))[:8]:
            share = int(r["Warp Stall Sampling (All Samples)"]) / samples
            top = sorted(((int(r[c] or 0), c[6:]) for c in reasons), reverse=True)[:2]
            print(f"  {share:6.1%}  {r['Source'].strip()[:56]:56s} "
                  + ", ".join(f"{c} {v}" for v, c in top))


def main() -> None:
    if sys.argv[1:2] == ["--summarize"]:
        summarize(Path(sys.argv[2]))
        return
    names = sys.argv[1:] or list(ROWS)
    for name in names:
        try:
            call = ROWS[name]()
            call()
            call()
        except Exception as exc:  # noqa: BLE001 (a missing peer: the other rows still run)
            print(f"row {name}: skipped ({type(exc).__name__}: {exc})", flush=True)
            continue
        torch.cuda.synchronize()
        print(f"row {name}", flush=True)
        torch.cuda.nvtx.range_push("profile")
        call()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
