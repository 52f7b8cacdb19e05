"""fusedmaxsim info | check | bench | explain: the command-line tool (also python -m fusedmaxsim)."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

from . import __version__, settings
from ._problem import select_backend, triton_available
from .testing import TOLERANCES, relative_error

LAYOUTS = ("cross", "candidates", "pairs", "single")


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------------------------------- info
def info_report(device: str) -> dict:
    report = {
        "fusedmaxsim": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": None,
        "device": device,
        "cuda_available": torch.cuda.is_available(),
        "settings": dict(settings.effective()),
        "layouts": {},
    }
    if triton_available():
        import triton

        report["triton"] = triton.__version__
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        report["gpu"] = {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
        }
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        probe = torch.empty(0, device=device, dtype=dtype)
        try:
            chosen = select_backend(probe)
        except RuntimeError as exc:
            chosen = f"error: {exc}"
        name = str(dtype).replace("torch.", "")
        # Every layout shares one kernel family, so the choice depends on device and dtype only.
        report["layouts"][name] = {layout: chosen for layout in LAYOUTS}
    return report


def _print_info(report: dict) -> None:
    width = 16
    for key in ("fusedmaxsim", "python", "torch", "triton", "device"):
        print(f"{key:<{width}}{report[key] or 'not installed'}")
    gpu = report.get("gpu")
    if gpu:
        print(f"{'gpu':<{width}}{gpu['name']} (capability {gpu['capability']}, "
              f"{gpu['multiprocessors']} SMs, {gpu['memory_gib']} GiB)")
    print("\nsettings in force (docs: README, Settings)")
    for key, value in report["settings"].items():
        print(f"  {key:<32}{value}")
    print(f"\n{'dtype':<10}" + "".join(f"{layout:<12}" for layout in LAYOUTS))
    for dtype, row in report["layouts"].items():
        print(f"{dtype:<10}" + "".join(f"{row[layout]:<12}" for layout in LAYOUTS))


# --------------------------------------------------------------------------------------- check
def _check_case(layout, dtype, strategy, normalize, device, fp32_precision):
    from . import maxsim, maxsim_pairs
    from .reference import maxsim_pairs_ref, maxsim_ref

    Nq, Lq, Ld, dim = 3, 37, 53, 96
    shapes = {
        "cross": ((Nq, Lq, dim), (5, Ld, dim)),
        "candidates": ((Nq, Lq, dim), (Nq, 4, Ld, dim)),
        "pairs": ((Nq, Lq, dim), (Nq, Ld, dim)),
        "single": ((Lq, dim), (Ld, dim)),
    }[layout]
    Q = torch.randn(shapes[0], device=device).to(dtype).requires_grad_()
    D = torch.randn(shapes[1], device=device).to(dtype).requires_grad_()
    q_mask = torch.rand(shapes[0][:-1], device=device) > 0.2
    d_mask = torch.rand(shapes[1][:-1], device=device) > 0.2
    Q64 = Q.detach().double().requires_grad_()
    D64 = D.detach().double().requires_grad_()
    fn, ref_fn = (maxsim_pairs, maxsim_pairs_ref) if layout == "pairs" else (maxsim, maxsim_ref)
    # "smooth": the smooth max (its backward has one strategy of its own)
    reduction = {"reduction": "smoothmax", "tau": 0.5} if strategy == "smooth" else {}
    backward = None if strategy == "smooth" else strategy
    with settings.use_fp32_precision(fp32_precision):
        out = fn(Q, D, q_mask, d_mask, normalize=normalize, backward=backward, **reduction)
        grad = torch.randn_like(out)
        gq, gd = torch.autograd.grad(out, (Q, D), grad)
    ref = ref_fn(Q64, D64, q_mask, d_mask, normalize=normalize, **reduction)
    rq, rd = torch.autograd.grad(ref, (Q64, D64), grad.double())
    return relative_error(out, ref), relative_error(gq, rq), relative_error(gd, rd)


_HEADER = (
    f"{'layout':<11}{'dtype':<10}{'fp32':<6}{'backward':<9}{'norm':<6}{'backend':<8}"
    f"{'scores':>10}{'grad_Q':>10}{'grad_D':>10}{'tol':>9}  result"
)


def _format_row(row: dict) -> str:
    grads = [f"{row[k]:>10.1e}" if row[k] is not None else f"{'-':>10}" for k in ("grad_Q", "grad_D")]
    return (
        f"{row['layout']:<11}{row['dtype']:<10}{row['fp32']:<6}{row['backward']:<9}"
        f"{str(row['normalize']):<6}{row['backend']:<8}{row['scores']:>10.1e}{''.join(grads)}"
        f"{row['tol'][0]:>9.0e}  {'PASS' if row['ok'] else 'FAIL'}"
        + (f"  {row['error']}" if row["error"] else "")
    )


def run_check(device: str, as_json: bool = False) -> int:
    """Every layout, forward and backward, against the float64 reference; 1 if anything fails.

    The ``backward`` column is the max's backward strategy, or ``smooth`` for the smooth max
    (``reduction="smoothmax"``, tau 0.5)."""
    torch.manual_seed(0)
    on_gpu = device.startswith("cuda")
    # fp16 on the GPU is covered by the test suite; every extra dtype here is another set of
    # kernels to compile, and this command should finish in about a minute on a fresh machine.
    dtypes = [torch.bfloat16, torch.float32] if on_gpu else [torch.float32, torch.float16]
    rows = []
    if not as_json:
        print(f"fusedmaxsim check on {device}: max|out - ref| / max|ref| against float64\n", flush=True)
        print(_HEADER)
        print("-" * len(_HEADER), flush=True)
    for layout in LAYOUTS:
        for dtype in dtypes:
            for strategy in ("unified", "lowmem", "smooth"):
                for normalize in (False, True):
                    # TF32 moves similarities by ~1e-3, enough to change the winner of a near-tie,
                    # so gradients are checked in exact fp32; the forward is checked in TF32 too.
                    precisions = ["ieee", "tf32"] if dtype == torch.float32 and on_gpu else ["ieee"]
                    for precision in precisions:
                        backend = select_backend(torch.empty(0, device=device, dtype=dtype))
                        try:
                            errs = _check_case(layout, dtype, strategy, normalize, device, precision)
                            error = None
                        except Exception as exc:  # reported, never hidden
                            errs, error = (float("inf"),) * 3, f"{type(exc).__name__}: {exc}"
                        score_tol, grad_tol = TOLERANCES[dtype]
                        grads_checked = precision == "ieee" or dtype != torch.float32
                        ok = errs[0] <= score_tol and (not grads_checked or max(errs[1:]) <= grad_tol)
                        row = {
                            "layout": layout, "dtype": str(dtype).replace("torch.", ""),
                            "fp32": precision if dtype == torch.float32 else "-",
                            "backward": strategy, "normalize": normalize, "backend": backend,
                            "scores": errs[0], "grad_Q": errs[1] if grads_checked else None,
                            "grad_D": errs[2] if grads_checked else None,
                            "tol": (score_tol, grad_tol), "ok": ok, "error": error,
                        }
                        rows.append(row)
                        if not as_json:
                            print(_format_row(row), flush=True)
    failed = sum(not row["ok"] for row in rows)
    if as_json:
        print(json.dumps({"device": device, "rows": rows, "passed": len(rows) - failed, "failed": failed}, indent=1))
    else:
        print(f"\n{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fusedmaxsim", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fusedmaxsim {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="versions, device, and which backend each layout uses")
    p_info.add_argument("--device", default=_default_device())
    p_info.add_argument("--json", action="store_true")
    p_check = sub.add_parser("check", help="self-test of every layout against the float64 reference")
    p_check.add_argument("--device", default=_default_device())
    p_check.add_argument("--json", action="store_true")
    p_bench = sub.add_parser(
        "bench", help="time the fused op against naive PyTorch on this device, parity first",
        description="Times fusedmaxsim.maxsim against naive PyTorch (einsum + amax + sum) on a "
                    "few shapes, after checking that both give the same scores.")
    from ._bench import add_bench_arguments

    add_bench_arguments(p_bench)
    p_explain = sub.add_parser(
        "explain", help="the plan fusedmaxsim.maxsim runs for a shape: kernel, tiles, strategy",
        description="Prints the plan of fusedmaxsim.maxsim for queries [Nq, Lq, d] against "
                    "documents [Nd, Ld, d] (or per-query candidates [Nq, K, Ld, d] with "
                    "--candidates K): the kernel, its tiles and splits and, with --training, the "
                    "backward's strategy and chunking, each with its reason. Nothing is launched.")
    p_explain.add_argument("--nq", type=int, default=32, help="queries (default 32)")
    p_explain.add_argument("--lq", type=int, default=32, help="query tokens (default 32)")
    p_explain.add_argument("--nd", type=int, default=1000, help="documents (default 1000)")
    p_explain.add_argument("--ld", type=int, default=300, help="document tokens (default 300)")
    p_explain.add_argument("--dim", type=int, default=128, help="embedding dim d (default 128)")
    p_explain.add_argument("--candidates", type=int, default=None, metavar="K",
                           help="score each query against its own K candidates instead")
    p_explain.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES),
                           help="input dtype (default bf16)")
    p_explain.add_argument("--device", default=_default_device())
    p_explain.add_argument("--training", action="store_true",
                           help="a call that saves the argmax for a backward")
    p_explain.add_argument("--normalize", action="store_true", help="L2-normalize the tokens")
    p_explain.add_argument("--masks", action="store_true", help="with query and document masks")
    p_explain.add_argument("--backward", default=None, choices=("auto", "unified", "lowmem"),
                           help="the backward strategy (default auto)")
    return parser


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
           "fp64": torch.float64}


def _explain(args) -> int:
    from .planning import explain

    try:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {args.device} is not available here (no CUDA device)")
        dtype = _DTYPES[args.dtype]
        Q = torch.empty(args.nq, args.lq, args.dim, dtype=dtype, device=device)
        d_shape = (args.nd, args.ld) if args.candidates is None else (args.nq, args.candidates,
                                                                       args.ld)
        D = torch.empty(*d_shape, args.dim, dtype=dtype, device=device)
        q_mask = torch.ones(Q.shape[:-1], dtype=torch.bool, device=device) if args.masks else None
        d_mask = torch.ones(D.shape[:-1], dtype=torch.bool, device=device) if args.masks else None
        print(explain(Q, D, q_mask, d_mask, normalize=args.normalize, backward=args.backward,
                      training=args.training))
    except (RuntimeError, ValueError) as exc:
        print(f"fusedmaxsim explain: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "info":
        report = info_report(args.device)
        if args.json:
            print(json.dumps(report, indent=1))
        else:
            _print_info(report)
        return 0
    if args.command == "check":
        start = time.perf_counter()
        code = run_check(args.device, args.json)
        if not args.json:
            print(f"({time.perf_counter() - start:.1f} s)")
        return code
    if args.command == "explain":
        return _explain(args)
    from ._bench import run_bench

    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
