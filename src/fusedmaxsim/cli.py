"""fusedmaxsim info | check | bench | explain: the command-line tool (also python -m fusedmaxsim)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

from . import __version__, settings
from ._problem import select_backend, triton_available
from .testing import TOLERANCES, relative_error

LAYOUTS = ("cross", "candidates", "pairs", "single")
# PLAID: maxsim_residual_varlen (packed compressed documents; grad_Q) and plaid_approx_score.
PLAID_LAYOUTS = ("residual", "approx")
# The fused projection head: maxsim_from_hidden (hidden-state documents; grad_D is the largest
# error of grad_H, grad_W and grad_b).
HEAD_LAYOUTS = ("hidden",)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class DeviceError(ValueError):
    """A device the command cannot use here: reported in one line, exit status 2."""


def resolve_device(name: str | None) -> torch.device:
    """``name`` (default: cuda when available, else cpu) as a device this machine has."""
    try:
        device = torch.device(name or _default_device())
    except (RuntimeError, ValueError):
        raise DeviceError(f"unknown device {name!r}: a torch device such as cpu, cuda or "
                          "cuda:1") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this PyTorch was built without CUDA" if torch.version.cuda is None
                   else "no CUDA device is visible")
            raise DeviceError(f"device {name!r} is not available here: {why} "
                              f"(torch {torch.__version__}); use --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DeviceError(f"device {name!r} is not available here: {count} CUDA device(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"device {name!r} is not available here (no MPS device)")
    elif device.type != "cpu":
        try:
            torch.empty(0, device=device)
        except Exception as exc:  # noqa: BLE001 - any backend's own refusal, in one line
            first = (str(exc).splitlines() or [""])[0].split(". ")[0][:160]
            raise DeviceError(f"device {name!r} is not available here: {first}") from None
    return device


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
        report["layouts"][name] = {layout: chosen
                                   for layout in LAYOUTS + PLAID_LAYOUTS + HEAD_LAYOUTS}
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
    every = LAYOUTS + PLAID_LAYOUTS + HEAD_LAYOUTS
    print(f"\n{'dtype':<10}" + "".join(f"{layout:<12}" for layout in every))
    for dtype, row in report["layouts"].items():
        print(f"{dtype:<10}" + "".join(f"{row[layout]:<12}" for layout in every))


# --------------------------------------------------------------------------------------- check
def _check_plaid(layout, dtype, normalize, device):
    """PLAID documents, packed as on disk (an empty one among them), 2-bit codes, a query mask:
    ``maxsim_residual_varlen``'s scores and grad_Q, or ``plaid_approx_score``'s scores."""
    from .plaid import maxsim_residual_varlen, plaid_approx_score
    from .reference import maxsim_residual_ref, plaid_approx_score_ref

    Nq, Lq, dim, n_centroids, nbits = 3, 37, 96, 29, 2
    lengths = torch.randint(1, 54, (5,))
    lengths[1] = 0
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    codes = torch.randint(0, n_centroids, (int(cu[-1]),))
    if layout == "approx":
        cs = torch.randn(Nq, n_centroids, Lq).to(dtype)
        out = plaid_approx_score(cs.to(device), codes.to(device), cu_seqlens=cu.to(device))
        return relative_error(out, plaid_approx_score_ref(cs, codes, cu_seqlens=cu)), None, None
    residuals = torch.randint(0, 256, (codes.shape[0], dim * nbits // 8), dtype=torch.uint8)
    centroids = torch.randn(n_centroids, dim).to(dtype)
    weights = torch.randn(1 << nbits) * 0.1
    rows = (cu[:-1, None] + torch.arange(int(lengths.max()))).clamp_max(codes.shape[0] - 1)
    q_mask = torch.rand(Nq, Lq) > 0.2
    Q = torch.randn(Nq, Lq, dim, device=device).to(dtype).requires_grad_()
    Q64 = Q.detach().cpu().double().requires_grad_()
    out = maxsim_residual_varlen(Q, *(t.to(device) for t in (codes, residuals, cu, centroids,
                                                              weights)), nbits,
                                 normalize=normalize, q_mask=q_mask.to(device))
    ref = maxsim_residual_ref(Q64, codes[rows], residuals[rows], lengths, centroids, weights,
                              nbits, normalize=normalize, q_mask=q_mask)
    grad = torch.randn_like(out)
    gq, = torch.autograd.grad(out, Q, grad)
    rq, = torch.autograd.grad(ref, Q64, grad.double().cpu())
    return relative_error(out.cpu(), ref), relative_error(gq.cpu(), rq), None


def _check_hidden(dtype, normalize, device):
    """Hidden-state documents with a bias and masks, both routes as the plan picks them:
    ``maxsim_from_hidden``'s scores, grad_Q, and the largest of grad_H, grad_W, grad_b."""
    import torch.nn.functional as F

    from .head import maxsim_from_hidden
    from .reference import maxsim_ref

    Nq, Lq, Nd, Ld, dim, d_model = 3, 37, 5, 131, 96, 200  # entries fewer than tokens
    inputs = [torch.randn(Nq, Lq, dim), torch.randn(Nd, Ld, d_model),
              torch.randn(dim, d_model) / d_model**0.5, torch.randn(dim) * 0.1]
    leaves = [t.to(device=device, dtype=dtype).requires_grad_() for t in inputs]
    refs = [t.detach().cpu().double().requires_grad_() for t in leaves]
    q_mask = torch.rand(Nq, Lq) > 0.2
    d_mask = torch.rand(Nd, Ld) > 0.2
    out = maxsim_from_hidden(*leaves, q_mask.to(device), d_mask.to(device), normalize=normalize)
    P = F.linear(refs[1], refs[2], refs[3])
    P = P + (P.to(dtype).double() - P).detach()  # rounded to the inputs' dtype, as F.linear's
    ref = maxsim_ref(refs[0], F.normalize(P, dim=-1) if normalize else P, q_mask, d_mask)
    grad = torch.randn_like(ref)
    grads = torch.autograd.grad(out, leaves, grad.to(device=device, dtype=out.dtype))
    ref_grads = torch.autograd.grad(ref, refs, grad)
    errs = [relative_error(g.cpu(), r) for g, r in zip(grads, ref_grads)]
    return relative_error(out.cpu(), ref), errs[0], max(errs[1:])


def _check_case(layout, dtype, strategy, normalize, device, fp32_precision):
    if layout in HEAD_LAYOUTS:
        with settings.use_fp32_precision(fp32_precision):
            return _check_hidden(dtype, normalize, device)
    if layout in PLAID_LAYOUTS:
        with settings.use_fp32_precision(fp32_precision):
            return _check_plaid(layout, dtype, normalize, device)
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
        f"{row['normalize']!s:<6}{row['backend']:<8}{row['scores']:>10.1e}{''.join(grads)}"
        f"{row['tol'][0]:>9.0e}  {'PASS' if row['ok'] else 'FAIL'}"
        + (f"  {row['error']}" if row["error"] else "")
    )


# The Triton interpreter takes seconds a case: on a CPU, ``check --triton`` runs fifteen cases
# (every --all): three per dense layout, so that each combination of dtype, backward strategy
# and normalization appears once, and one per PLAID layout and the projection head.
def _triton_subset(dtypes: list[torch.dtype]) -> list[tuple]:
    strategies = ("unified", "lowmem", "smooth")
    return [(LAYOUTS[i // 3], dtypes[i % 2], strategies[i % 3], (i // 2) % 2 == 1)
            for i in range(12)] + [("residual", dtypes[1], "-", True), ("approx", dtypes[0], "-",
                                                                         False),
                                   ("hidden", dtypes[0], "-", True)]


def _fp32_note(on_gpu: bool) -> str:
    """What the fp32 rows run in, and the precision in force outside the check, as ``info``
    prints it."""
    in_force = dict(settings.effective())["FUSEDMAXSIM_FP32_PRECISION"]
    rows = ("ieee rows check scores and gradients in exact fp32, tf32 rows the scores in TF32"
            if on_gpu else "fp32 rows run in exact fp32 (ieee)")
    return (f"{rows}, whatever the setting (TF32 can change the winner of a near-tie of the "
            f"max, which the gradient follows); in force outside this check, as fusedmaxsim "
            f"info prints it: {in_force}")


def run_check(device: str, as_json: bool = False, triton: bool = False,
              every_case: bool = False) -> int:
    """Every layout, forward and backward, against the float64 reference; 1 if anything fails.

    The backward column is the max's backward strategy, or smooth for the smooth max
    (reduction="smoothmax", tau 0.5). ``triton``: the Triton kernels (under the Triton
    interpreter on a CPU, where only a subset of the cases runs unless ``every_case``)."""
    start = time.perf_counter()
    torch.manual_seed(0)
    on_gpu = device.startswith("cuda")
    # fp16 on the GPU is covered by the test suite; every extra dtype here is another set of
    # kernels to compile, and this command should finish in about a minute on a fresh machine.
    dtypes = [torch.bfloat16, torch.float32] if on_gpu else [torch.float32, torch.float16]
    cases = [(layout, dtype, strategy, normalize) for layout in LAYOUTS for dtype in dtypes
             for strategy in ("unified", "lowmem", "smooth") for normalize in (False, True)]
    # PLAID: no backward strategy (grad_Q only, from the saved argmax); the approximate score
    # has no gradient and no normalization.
    cases += [("residual", dtype, "-", normalize) for dtype in dtypes for normalize in (False,
                                                                                       True)]
    cases += [("approx", dtype, "-", False) for dtype in dtypes]
    # The projection head: the plan's backward (its entries kernel at this shape on the GPU,
    # the closed form on the PyTorch path).
    cases += [("hidden", dtype, "-", normalize) for dtype in dtypes for normalize in (False, True)]
    interpreted = triton and not on_gpu
    if interpreted and not every_case:
        cases, total = _triton_subset(dtypes), len(cases)
        path = (f"the Triton kernels under the Triton interpreter, {len(cases)} of {total} cases "
                "(the interpreter is slow; --all runs every case, a few minutes)")
    elif interpreted:
        path = "the Triton kernels under the Triton interpreter, every case"
    else:
        try:
            backend = select_backend(torch.empty(0, device=device))
        except RuntimeError as exc:  # a forced backend that cannot run here: every row says so
            backend = f"none ({exc})"
        if backend == "triton":
            path = "the Triton kernels"
        elif on_gpu:
            path = f"the PyTorch path only (FUSEDMAXSIM_BACKEND={settings.backend()})"
        elif backend == "torch":
            path = ("the PyTorch path only; the Triton kernels run on CUDA devices, or here "
                    "under the Triton interpreter: fusedmaxsim check --triton")
        else:
            path = backend
    fp32 = _fp32_note(on_gpu)
    rows = []
    if not as_json:
        print(f"fusedmaxsim check on {device}: max|out - ref| / max|ref| against float64")
        print(f"checks:   {path}")
        print(f"fp32:     {fp32}\n", flush=True)
        print(_HEADER)
        print("-" * len(_HEADER), flush=True)
    for layout, dtype, strategy, normalize in cases:
        # TF32 moves similarities by ~1e-3, enough to change the winner of a near-tie, so
        # gradients are checked in exact fp32; the forward is checked in TF32 too.
        precisions = ["ieee", "tf32"] if (dtype == torch.float32 and on_gpu and layout not in
                                          PLAID_LAYOUTS + HEAD_LAYOUTS) else ["ieee"]
        for precision in precisions:
            backend = "-"
            try:
                backend = select_backend(torch.empty(0, device=device, dtype=dtype))
                errs = _check_case(layout, dtype, strategy, normalize, device, precision)
                error = None
            except Exception as exc:  # noqa: BLE001 - reported, never hidden
                errs, error = (float("inf"),) * 3, f"{type(exc).__name__}: {exc}"
            score_tol, grad_tol = TOLERANCES[dtype]
            grads_checked = precision == "ieee" or dtype != torch.float32
            grad_errs = [e for e in errs[1:] if e is not None]
            ok = errs[0] <= score_tol and (not grads_checked or max(grad_errs, default=0.0)
                                           <= grad_tol)
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
        print(json.dumps({"device": device, "checks": path, "fp32": fp32, "rows": rows,
                          "passed": len(rows) - failed, "failed": failed}, indent=1))
    else:
        print(f"\n{len(rows) - failed} passed, {failed} failed "
              f"({time.perf_counter() - start:.1f} s)")
    return 1 if failed else 0


def _check_triton_here(args) -> int:
    """``check --triton``: on a CUDA device in this process; on a CPU in a new one under the
    Triton interpreter, which must be on before the kernels are defined (at import)."""
    if not triton_available():
        raise DeviceError("--triton needs Triton, which is not installed here")
    if not args.device.startswith(("cuda", "cpu")):
        raise DeviceError(f"--triton runs on CUDA devices, or on the CPU under the Triton "
                          f"interpreter; not on {args.device}")
    if args.device == "cpu":
        try:
            import numpy  # noqa: F401
        except ImportError:
            raise DeviceError("--triton on a CPU runs the Triton interpreter, which needs NumPy "
                              "(pip install numpy)") from None
    if args.device.startswith("cuda") or settings.INTERPRETER:
        with settings.use_backend("triton"):
            return run_check(args.device, args.json, triton=True, every_case=args.all)
    command = [sys.executable, "-m", "fusedmaxsim", "check", "--triton", "--device", args.device]
    command += ["--json"] * args.json + ["--all"] * args.all
    env = {**os.environ, "TRITON_INTERPRET": "1", "FUSEDMAXSIM_BACKEND": "triton"}
    # Its output passes through this process's stdout, so that a caller capturing it sees it.
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) as child:
        for line in child.stdout:
            print(line, end="", flush=True)
    return child.returncode


# ---------------------------------------------------------------------------------------- main
_DEVICE_HELP = "torch device: cpu, cuda, cuda:1, ... (default: cuda when available, else cpu)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fusedmaxsim",
        description="Fused late-interaction (MaxSim) scoring: what runs here (info), a self-test "
                    "against float64 (check), timings against naive PyTorch (bench), the plan "
                    "for a shape (explain). Also runs as python -m fusedmaxsim.")
    parser.add_argument("--version", action="version", version=f"fusedmaxsim {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p_info = sub.add_parser(
        "info", help="versions, device, settings, and which backend each layout uses",
        description="Prints the versions of fusedmaxsim, Python, PyTorch and Triton, the device, "
                    "every setting in force (FUSEDMAXSIM_* variables) and, for each dtype, the "
                    "backend (Triton kernels or the PyTorch path) that each layout runs on.")
    p_info.add_argument("--device", default=None, help=_DEVICE_HELP)
    p_info.add_argument("--json", action="store_true", help="print the report as JSON")
    p_check = sub.add_parser(
        "check", help="self-test of every layout against the float64 reference",
        description="Scores every layout (cross product, per-query candidates, pairs, single), "
                    "forward and backward, with each backward strategy and with and without "
                    "normalization, and compares scores and gradients with the float64 "
                    "reference. Exits with 1 if any case is outside its tolerance. On a CPU it "
                    "checks the PyTorch path; --triton checks the Triton kernels instead.")
    p_check.add_argument("--device", default=None, help=_DEVICE_HELP)
    p_check.add_argument("--json", action="store_true",
                         help="print the cases and their errors as JSON")
    p_check.add_argument("--triton", action="store_true",
                         help="check the Triton kernels: on a CPU under the Triton interpreter "
                              "(TRITON_INTERPRET=1, in a new process), a subset of the cases")
    p_check.add_argument("--all", action="store_true",
                         help="with --triton on a CPU: every case, not a subset (a few minutes)")
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
    p_explain.add_argument("--device", default=None, help=_DEVICE_HELP)
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

    device = torch.device(args.device)
    dtype = _DTYPES[args.dtype]
    Q = torch.empty(args.nq, args.lq, args.dim, dtype=dtype, device=device)
    d_shape = (args.nd, args.ld) if args.candidates is None else (args.nq, args.candidates, args.ld)
    D = torch.empty(*d_shape, args.dim, dtype=dtype, device=device)
    q_mask = torch.ones(Q.shape[:-1], dtype=torch.bool, device=device) if args.masks else None
    d_mask = torch.ones(D.shape[:-1], dtype=torch.bool, device=device) if args.masks else None
    print(explain(Q, D, q_mask, d_mask, normalize=args.normalize, backward=args.backward,
                  training=args.training))
    return 0


def _run(args) -> int:
    args.device = str(resolve_device(args.device))
    if args.command == "info":
        report = info_report(args.device)
        if args.json:
            print(json.dumps(report, indent=1))
        else:
            _print_info(report)
        return 0
    if args.command == "check":
        if args.all and not args.triton:
            raise DeviceError("--all goes with --triton (the PyTorch path runs every case)")
        if args.triton:
            return _check_triton_here(args)
        return run_check(args.device, args.json)
    if args.command == "explain":
        try:
            return _explain(args)
        except RuntimeError as exc:  # e.g. a backend that cannot run this dtype here
            raise ValueError(str(exc)) from None
    from ._bench import run_bench

    return run_bench(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except ValueError as exc:
        # Bad arguments, an unavailable device, a bad setting: one line, no traceback.
        message = (str(exc).splitlines() or [type(exc).__name__])[0]
        print(f"fusedmaxsim {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
