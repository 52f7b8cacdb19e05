"""``fusedmaxsim bench``: the fused op against naive PyTorch on this machine, parity first.

For a few cross-product shapes (``D [Nd, Ld, d]``, no masks) it times ``fusedmaxsim.maxsim`` and
the naive formula (einsum over the full ``[Nq, Nd, Lq, Ld]`` grid, amax, sum) on the same inputs
in the same dtype: the median wall time of one synchronized call, after a warm-up. First, the
fused scores (and gradients with ``--backward``) are compared with the naive formula in float32
on the same inputs; past ``fusedmaxsim.testing.TOLERANCES`` no speedup is reported and the
command exits with 1. The suite against the peer libraries is in the repository's benchmarks/.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from . import settings
from .testing import TOLERANCES, relative_error, relative_error_fro

# name: (Nq, Nd, Lq, Ld, d)
GPU_SHAPES = {
    "colbert_rerank": (1, 1000, 32, 300, 128),
    "colbert_batch": (32, 32, 32, 300, 128),
    "colbert_train": (128, 128, 32, 300, 128),
    "colpali_rerank": (1, 256, 128, 1024, 128),
    "long_docs": (4, 16, 32, 4096, 128),
}
CPU_SHAPES = {
    "colbert_rerank": (1, 100, 32, 300, 128),
    "colbert_batch": (8, 8, 32, 300, 128),
    "colpali_rerank": (1, 16, 128, 1024, 128),
}
DTYPES = ("bfloat16", "float16", "float32")


def naive_maxsim(Q: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """What the fused op replaces: the full similarity grid, its max, its sum, in Q's dtype."""
    return torch.einsum("ash,bth->abst", Q, D).amax(-1).sum(-1).float()


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--device", default=None,
                        help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="input dtype of both sides (default: bfloat16 on CUDA, float32 "
                             "on CPU)")
    parser.add_argument("--shapes", default=None,
                        help="comma list of shape names, or NqxNdxLqxLdxd such as 4x64x32x300x128 "
                             f"(names on CUDA: {', '.join(GPU_SHAPES)}; on CPU: "
                             f"{', '.join(CPU_SHAPES)}; default: all of the device's)")
    parser.add_argument("--backward", action="store_true",
                        help="time forward plus backward (a training step) instead of the forward")
    parser.add_argument("--rep-ms", type=float, default=100.0,
                        help="time spent timing each side of each shape, in ms (default: 100)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    return parser


def _parse_shapes(spec: str | None, presets: dict) -> dict:
    if not spec:
        return dict(presets)
    shapes = {}
    for name in filter(None, (s.strip() for s in spec.split(","))):
        if name in presets:
            shapes[name] = presets[name]
            continue
        try:
            dims = tuple(int(n) for n in name.lower().split("x"))
        except ValueError:
            dims = ()
        if len(dims) != 5 or min(dims) < 1:
            raise ValueError(f"unknown shape {name!r}: a name ({', '.join(presets)}) "
                             "or NqxNdxLqxLdxd")
        shapes[name] = dims
    return shapes


def _median_ms(fn, sync, rep_ms: float, before=lambda: None) -> float:
    """Median of synchronized calls over about ``rep_ms`` (at least 5), after two warm-up calls."""
    def call() -> float:
        before()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - start) * 1e3

    call()
    estimate = max(call(), 1e-3)
    times = sorted(call() for _ in range(max(5, min(1000, int(rep_ms / estimate)))))
    return times[len(times) // 2]


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}"


def bench_shape(name, dims, dtype, device, backward: bool, rep_ms: float) -> dict:
    from . import maxsim

    nq, nd, lq, ld, dim = dims
    gen = torch.Generator(device=device).manual_seed(0)
    Q = torch.randn(nq, lq, dim, generator=gen, device=device)
    D = torch.randn(nd, ld, dim, generator=gen, device=device)
    Q, D = (torch.nn.functional.normalize(x, dim=-1).to(dtype).requires_grad_(backward)
            for x in (Q, D))
    grad = torch.randn(nq, nd, generator=gen, device=device)
    row = {"shape": name, "dims": list(dims), "fused_ms": None, "naive_ms": None, "speedup": None,
           "score_err": None, "grad_err": None, "parity": False, "error": None}
    score_tol, grad_tol = TOLERANCES[dtype]
    try:  # the parity gate: fused against the naive formula in float32, on the same inputs
        Q32, D32 = (x.detach().float().requires_grad_(backward) for x in (Q, D))
        ref, out = naive_maxsim(Q32, D32), maxsim(Q, D)
        row["score_err"] = relative_error(out, ref)
        if backward:
            ref.backward(grad)
            out.backward(grad)
            row["grad_err"] = max(relative_error_fro(Q.grad, Q32.grad),
                                  relative_error_fro(D.grad, D32.grad))
    except Exception as exc:  # noqa: BLE001 - reported, never hidden
        row["error"] = f"gate: {_error(exc)}"
        return row
    row["parity"] = row["score_err"] <= score_tol and (row["grad_err"] or 0.0) <= grad_tol
    if not row["parity"]:
        row["error"] = "fused disagrees with naive beyond tolerance: not timed"
        return row
    sync = (lambda: torch.cuda.synchronize(device)) if Q.is_cuda else (lambda: None)

    def reset():
        Q.grad = D.grad = None

    for key, fn in (("fused_ms", maxsim), ("naive_ms", naive_maxsim)):
        if backward:
            def step(fn=fn):
                fn(Q, D).backward(grad)
        else:
            def step(fn=fn):
                with torch.no_grad():
                    fn(Q, D)
        try:
            row[key] = _median_ms(step, sync, rep_ms, reset)
        except Exception as exc:  # noqa: BLE001 - e.g. the naive grid out of memory: reported
            row["error"] = f"{key[:-3]}: {_error(exc)}"
    if row["fused_ms"] and row["naive_ms"]:
        row["speedup"] = row["naive_ms"] / row["fused_ms"]
    return row


def run_bench(args: argparse.Namespace) -> int:
    """Prints the table; 0 when every shape passed parity and was timed, 1 otherwise, 2 on bad
    arguments."""
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("CUDA is not available")
        shapes = _parse_shapes(args.shapes, GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)
    except ValueError as exc:
        print(f"fusedmaxsim bench: {exc}", file=sys.stderr)
        return 2
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    mode = "forward + backward" if args.backward else "forward"
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    fused = "fusedmaxsim.maxsim"
    if device.type == "cpu" and settings.backend() != "triton":
        fused += ", on a CPU its blocked PyTorch path (it bounds the grid's memory, not its time)"
    grads = " (scores; gradients in the Frobenius norm)" if args.backward else ""
    header = (f"{'shape':<20}{'Nq x Nd, Lq x Ld, d':<26}{'fused ms':>10}{'naive ms':>10}"
              f"{'speedup':>9}{'error':>9}  parity")
    if not args.json:
        print(f"fusedmaxsim bench on {device} ({where}): {mode}, {dtype_name} inputs, no masks")
        print(f"fused:    {fused}")
        print(f"baseline: naive PyTorch in {dtype_name}: einsum over the [Nq, Nd, Lq, Ld] grid, "
              "amax, sum")
        print("time:     median wall ms of one synchronized call, after a warm-up")
        print(f"parity:   relative error of fused against the naive formula in float32 on the "
              f"same inputs, at most {TOLERANCES[dtype][0]:.0e}{grads}; past it, no speedup\n")
        print(header + "\n" + "-" * len(header), flush=True)
    rows = []
    for name, dims in shapes.items():
        row = bench_shape(name, dims, dtype, device, args.backward, args.rep_ms)
        rows.append(row)
        if not args.json:
            nq, nd, lq, ld, dim = dims
            errs = [e for e in (row["score_err"], row["grad_err"]) if e is not None]
            err = f"{max(errs):>9.1e}" if errs else f"{'-':>9}"
            cells = "".join(f"{row[k]:>10.3f}" if row[k] is not None else f"{'-':>10}"
                            for k in ("fused_ms", "naive_ms"))
            speedup = f"{row['speedup']:>8.2f}x" if row["speedup"] else f"{'-':>9}"
            note = f"  ({row['error']})" if row["error"] else ""
            print(f"{name:<20}{f'{nq} x {nd}, {lq} x {ld}, {dim}':<26}{cells}{speedup}{err}"
                  f"  {'ok' if row['parity'] else 'FAIL'}{note}", flush=True)
    failed = sum(not r["parity"] for r in rows)
    slower = sum(r["speedup"] is not None and r["speedup"] < 1 for r in rows)
    timed = sum(r["speedup"] is not None for r in rows)
    if args.json:
        print(json.dumps({"device": str(device), "dtype": dtype_name, "mode": mode,
                          "baseline": f"naive PyTorch in {dtype_name}", "rows": rows}, indent=1))
    else:
        print(f"\nfused slower than naive on {slower} of {timed} timed shapes; parity failed on "
              f"{failed} of {len(rows)}" + (" (no speedup reported there)" if failed else ""))
    return 1 if failed or timed < len(rows) else 0
