"""``fusedmaxsim bench``: the fused op against naive PyTorch on this machine, parity first.

For a few cross-product shapes (``D [Nd, Ld, d]``, no masks) it times ``fusedmaxsim.maxsim`` and
the naive formula (einsum over the full ``[Nq, Nd, Lq, Ld]`` grid, amax, sum) on the same inputs
in the same dtype and, for 16-bit inputs, the naive formula on float32 copies too (the precision
of the fused similarities): the median wall time of one synchronized call, after a warm-up, the
sides called in alternation. First, the fused scores (and gradients with ``--backward``) are
compared with the naive formula in float32 on the same inputs; past
``fusedmaxsim.testing.TOLERANCES`` no speedup is reported and the command exits with 1. The
summary counts, for each baseline, the shapes where the fused op is slower, level (the 95%
interval of the rounds' speedups holds 1) and faster. The suite against the peer libraries is in
the repository's benchmarks/.
"""

from __future__ import annotations

import argparse
import json
import math
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


def _interleaved_times(fns: dict, sync, rep_ms: float, before=lambda: None) -> tuple[dict, dict]:
    """The ms of one synchronized call of each of ``fns``, one a round (and the error of any that
    failed its warm-up, left out), timed in rounds that call each once,
    in an order that rotates from round to round, so that a slow spell of a busy machine falls on
    every side alike. About ``rep_ms`` per side, at least 7 rounds, after two warm-up calls each."""
    def call(fn) -> float:
        before()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - start) * 1e3

    estimate, errors = {}, {}
    for name, fn in fns.items():
        try:
            call(fn)
            estimate[name] = max(call(fn), 1e-3)
        except Exception as exc:  # noqa: BLE001 - e.g. the naive grid out of memory: reported
            errors[name] = _error(exc)
    names = list(estimate)
    if not names:
        return {}, errors
    rounds = max(7, min(1000, int(rep_ms / max(estimate.values()))))
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(call(fns[name]))
    return times, errors


def _median_of(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def speedup_interval(base: list[float], fused: list[float]) -> tuple[float, float, float]:
    """``(median, low, high)`` of the ratios ``base / fused`` of the rounds (each round times
    both sides back to back), ``low``-``high`` the order statistics that hold the median with
    about 95% confidence (distribution-free: ranks ``n/2 ∓ 0.98·√n``)."""
    ratios = sorted(b / f for b, f in zip(base, fused))
    n = len(ratios)
    half = 0.98 * n**0.5
    lo, hi = max(0, int(n / 2 - half)), min(n - 1, int(math.ceil(n / 2 + half)))
    return ratios[n // 2], ratios[lo], ratios[hi]


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
    if dtype != torch.float32:
        row.update(naive_fp32_ms=None, speedup_fp32=None)
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

    sides = {"fused_ms": maxsim, "naive_ms": naive_maxsim}
    if dtype != torch.float32:
        # The naive formula on fp32 copies (the copies timed too): the precision the fused op's
        # similarities have, where the naive formula in a 16-bit dtype rounds them to it.
        sides["naive_fp32_ms"] = lambda Q, D: naive_maxsim(Q.float(), D.float())
    steps = {}
    for key, fn in sides.items():
        if backward:
            def step(fn=fn):
                fn(Q, D).backward(grad)
        else:
            def step(fn=fn):
                with torch.no_grad():
                    fn(Q, D)
        steps[key] = step
    times, errors = _interleaved_times(steps, sync, rep_ms, reset)
    row.update({key: _median_of(t) for key, t in times.items()})
    if errors:
        row["error"] = "; ".join(f"{key[:-3]}: {err}" for key, err in errors.items())
    for base, key in (("naive_ms", "speedup"), ("naive_fp32_ms", "speedup_fp32")):
        if "fused_ms" in times and base in times:
            row[key], *row[key + "_interval"] = speedup_interval(times[base], times["fused_ms"])
    return row


def _cell(value, fmt: str, width: int) -> str:
    return format(value, fmt) if value is not None else f"{'-':>{width}}"


def run_bench(args: argparse.Namespace) -> int:
    """Prints the table; 0 when every shape passed parity and was timed, 1 otherwise, 2 on bad
    arguments. ``args.device``: a device this machine has (the command line checks it)."""
    device = torch.device(args.device)
    try:
        shapes = _parse_shapes(args.shapes, GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)
    except ValueError as exc:
        print(f"fusedmaxsim bench: error: {exc}", file=sys.stderr)
        return 2
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    fp32_too = dtype != torch.float32
    mode = "forward + backward" if args.backward else "forward"
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    fused = "fusedmaxsim.maxsim"
    if device.type == "cpu" and settings.backend() != "triton":
        fused += (", on a CPU its PyTorch path: similarities in fp32 (float64 for float64; "
                  "for bf16 inference a bf16 product, each token's maximum rounded to bf16), "
                  "in blocks that bound their memory")
    baseline = f"naive PyTorch in {dtype_name}"
    grads = " (scores; gradients in the Frobenius norm)" if args.backward else ""
    header = (f"{'shape':<20}{'Nq x Nd, Lq x Ld, d':<26}{'fused ms':>10}{'naive ms':>10}"
              f"{'speedup':>9}" + (f"{'fp32 ms':>10}{'speedup':>9}" if fp32_too else "")
              + f"{'error':>9}  parity")
    if not args.json:
        print(f"fusedmaxsim bench on {device} ({where}): {mode}, {dtype_name} inputs, no masks")
        print(f"fused:    {fused}")
        print(f"baseline: {baseline}: einsum over the [Nq, Nd, Lq, Ld] grid, amax, sum "
              "(naive ms; speedup = naive ms / fused ms)")
        if fp32_too:
            print(f"          and the same on float32 copies of the {dtype_name} inputs, the "
                  "copies timed too (fp32 ms), as precise as the fused similarities")
        print("time:     median wall ms of one synchronized call, after a warm-up, the sides "
              "timed in alternation")
        print("speedup:  median of the rounds' ratios; x: faster, ~: level (its 95% interval "
              "holds 1, a tie within the noise), <: slower")
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
            cells = (_cell(row["fused_ms"], ">10.3f", 10) + _cell(row["naive_ms"], ">10.3f", 10)
                     + _speedup_cell(row, "speedup"))
            if fp32_too:
                cells += (_cell(row["naive_fp32_ms"], ">10.3f", 10)
                          + _speedup_cell(row, "speedup_fp32"))
            err = _cell(max(errs) if errs else None, ">9.1e", 9)
            note = f"  ({row['error']})" if row["error"] else ""
            print(f"{name:<20}{f'{nq} x {nd}, {lq} x {ld}, {dim}':<26}{cells}{err}"
                  f"  {'ok' if row['parity'] else 'FAIL'}{note}", flush=True)
    failed = sum(not r["parity"] for r in rows)
    timed = sum(r["speedup"] is not None for r in rows)
    summary = {"baseline": baseline, "timed": timed, **_verdicts(rows, "speedup", ""),
               "median_speedup": _median(rows, "speedup"), "parity_failed": failed}
    if fp32_too:
        summary.update(baseline_fp32="naive PyTorch on float32 copies",
                       **_verdicts(rows, "speedup_fp32", "_fp32"),
                       median_speedup_fp32=_median(rows, "speedup_fp32"))
    if args.json:
        print(json.dumps({"device": str(device), "dtype": dtype_name, "mode": mode, **summary,
                          "rows": rows}, indent=1))
    else:
        print(f"\nagainst {baseline}: {_verdict_text(summary, '', timed)}"
              f"{_median_text(summary['median_speedup'])}")
        if fp32_too:
            print(f"against naive PyTorch on float32 copies: "
                  f"{_verdict_text(summary, '_fp32', timed)}"
                  f"{_median_text(summary['median_speedup_fp32'])}")
        print(f"parity failed on {failed} of {len(rows)}"
              + (" (no speedup reported there)" if failed else ""))
    return 1 if failed or timed < len(rows) else 0


def _verdict(row: dict, key: str) -> str | None:
    """``"faster"``, ``"level"`` or ``"slower"``: where the speedup's 95% interval lies against 1
    (a median on either side of 1 with an interval that holds it is a tie within the noise)."""
    if row.get(key) is None:
        return None
    lo, hi = row[key + "_interval"]
    return "faster" if lo > 1 else "slower" if hi < 1 else "level"


def _verdicts(rows: list[dict], key: str, suffix: str) -> dict:
    found = [_verdict(r, key) for r in rows]
    return {word + suffix: found.count(word) for word in ("slower", "level", "faster")}


def _verdict_text(summary: dict, suffix: str, timed: int) -> str:
    return (f"fused slower on {summary['slower' + suffix]} of {timed} timed shapes, level "
            f"(within the noise) on {summary['level' + suffix]}, faster on "
            f"{summary['faster' + suffix]}")


def _speedup_cell(row: dict, key: str) -> str:
    """The median speedup and its verdict: ``x`` faster, ``~`` level, ``<`` slower."""
    mark = {"faster": "x", "level": "~", "slower": "<", None: ""}[_verdict(row, key)]
    return _cell(row.get(key), ">8.2f", 9) + mark


def _median(rows: list[dict], key: str) -> float | None:
    values = sorted(r[key] for r in rows if r.get(key) is not None)
    return values[len(values) // 2] if values else None


def _median_text(value: float | None) -> str:
    return "" if value is None else f" (median speedup {value:.2f}x)"
