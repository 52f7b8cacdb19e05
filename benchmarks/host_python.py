"""The Python side of a call, with every Triton launch replaced by a no-op: what the package's own
layers cost the host per call (the best of five timings), apart from the launch itself and the
GPU. Runs on a CPU under the Triton interpreter (so that CPU tensors take the Triton path: the
script sets ``TRITON_INTERPRET=1`` and ``FUSEDMAXSIM_BACKEND=triton`` unless they are set), for
the source tree given (a tree with the planner: ``fusedmaxsim._plan`` and ``fusedmaxsim._launch``).

    python benchmarks/host_python.py [SRC_DIR]

Rows for ``maxsim`` (32 × 32 queries and documents) and for the projection head
(``maxsim_from_hidden``: its forward and each backward's launcher, a training step).

The launches are stubbed in this script only: each kernel's cached launcher
(``fusedmaxsim._launch.runtime.launcher``) is made one whose call does nothing, so every layer
above it (the front door, the autograd layer, the planner's cached plan, the launcher's strides,
grids and allocations) runs as it does on a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

DEFAULT_SRC = Path(__file__).resolve().parents[1] / "src"


def per_call_us(fn, n: int) -> float:
    for _ in range(n // 20):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def _stub_launches() -> None:
    """Every kernel's cached launcher made a no-op (its class swapped for a subclass whose call
    returns at once): the launchers of ``fusedmaxsim._launch`` look theirs up through
    ``runtime.launcher(kernel)``, which returns these."""
    from triton.runtime.jit import KernelInterface

    from fusedmaxsim._launch import runtime
    from fusedmaxsim.kernels import backward, forward, head, hopper_forward, smooth, winner_index

    class NoLaunch(runtime._CachedLauncher):
        def __call__(self, grid, args, constants) -> None:
            pass

    for module in (forward, backward, head, winner_index, smooth, hopper_forward):
        for name, kernel in vars(module).items():
            if name.endswith("_kernel") and isinstance(kernel, KernelInterface):
                runtime.launcher(kernel).__class__ = NoLaunch


def _head_rows(maxsim_from_hidden, forward_hidden, backward_hidden, plan_forward,
               plan_hidden_backward, hidden_problem, o) -> tuple:
    """The projection head's rows: one query of 8 tokens against 4 documents of 32 hidden
    states (the fused forward; fewer entries than tokens: the entries backward), and the token
    tile backward's launcher at 2 queries of 32 tokens (as many entries as tokens)."""
    import torch

    def inputs(Nq, Lq):
        Q = torch.randn(Nq, Lq, 16, dtype=torch.bfloat16)
        H = torch.randn(4, 32, 32, dtype=torch.bfloat16)
        W = torch.randn(16, 32, dtype=torch.bfloat16)
        return Q, H, W, torch.randn(16, dtype=torch.bfloat16)

    Q, H, W, b = inputs(1, 8)
    leaves = [t.clone().requires_grad_() for t in (Q, H, W, b)]
    g = torch.randn(1, 4)
    p = hidden_problem(Q, H, W, b, None, None, normalize=True, save_argmax=True)
    plan = plan_forward(p, o)
    if plan.hidden_route != "fused":
        raise SystemExit(f"the head's rows expect the fused forward, the plan says {plan.reasons}")
    _, argmax = forward_hidden(plan, p, o.fp32_precision, Q, H, W, b, None, None)
    argmax.random_(0, 32)
    by_entry = plan_hidden_backward(p, o, True, False)
    Q2, _, _, _ = inputs(2, 32)
    p2 = hidden_problem(Q2, H, W, b, None, None, normalize=True, save_argmax=True)
    by_tile = plan_hidden_backward(p2, o, True, False)
    argmax2 = torch.randint(0, 32, (2, 4, 32), dtype=argmax.dtype)
    g2 = torch.randn(2, 4)
    if (by_entry.kernel, by_tile.kernel) != ("entries", "tiles"):
        raise SystemExit(f"the head's rows expect the entries and the tiles backward, the plans "
                         f"say {by_entry.kernel} and {by_tile.kernel}")
    needs = (True, True, True, True)

    def head_forward():
        with torch.no_grad():
            maxsim_from_hidden(Q, H, W, b)

    def head_step():
        for t in leaves:
            t.grad = None
        maxsim_from_hidden(*leaves).backward(g)

    return (
        ("head: no_grad forward, 1 x 4 (fused; maxsim_from_hidden)", head_forward, 5000),
        ("  its launcher alone (_launch.forward.forward_hidden)",
         lambda: forward_hidden(plan, p, o.fp32_precision, Q, H, W, b, None, None), 5000),
        ("head: backward's launcher, entries, all four gradients (backward_hidden)",
         lambda: backward_hidden(by_entry, o.fp32_precision, g, Q, H, W, b, argmax, True, needs),
         5000),
        ("  the same, grad_Q only",
         lambda: backward_hidden(by_entry, o.fp32_precision, g, Q, H, W, b, argmax, True,
                                 (True, False, False, False)), 5000),
        ("head: backward's launcher, token tiles, 2 x 4, all four gradients",
         lambda: backward_hidden(by_tile, o.fp32_precision, g2, Q2, H, W, b, argmax2, True,
                                 needs), 5000),
        ("head: training step (forward + backward to Q, H, W and b)", head_step, 2000),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", nargs="?", default=str(DEFAULT_SRC),
                        help="the source tree whose fusedmaxsim is timed (default: this one's)")
    args = parser.parse_args()
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("FUSEDMAXSIM_BACKEND", "triton")
    sys.path.insert(0, args.src)

    import torch

    from fusedmaxsim import maxsim, maxsim_from_hidden
    from fusedmaxsim._autograd import run_backward, run_forward
    from fusedmaxsim._launch import runtime
    from fusedmaxsim._launch.backward import backward_dense, backward_hidden
    from fusedmaxsim._launch.forward import forward_dense, forward_hidden, gluon_constexprs
    from fusedmaxsim._plan import (MEASURED, forced_plan, plan_backward, plan_forward,
                                   plan_hidden_backward)
    from fusedmaxsim._problem import dense_problem, hidden_problem, options_for
    from fusedmaxsim.kernels import hopper_forward

    _stub_launches()
    Q = torch.randn(32, 32, 128, dtype=torch.bfloat16)
    D = torch.randn(32, 180, 128, dtype=torch.bfloat16)
    g = torch.randn(32, 32)
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    x = torch.randn(32, 32, requires_grad=True)
    o = options_for(Q)
    if o.backend != "triton":
        raise SystemExit(f"CPU tensors take the {o.backend} path here: run with TRITON_INTERPRET=1 "
                         "and FUSEDMAXSIM_BACKEND=triton")
    p = dense_problem(Q, D, None, None)
    p_train = p._replace(save_argmax=True)
    plan = plan_forward(p, o)
    plan_bwd = plan_backward(p_train, o, True, True, "lowmem")
    _, argmax = run_forward(p_train, o, Q, D, None, None, None, None)

    def forward():
        with torch.no_grad():
            maxsim(Q, D)

    def step():
        Qg.grad = Dg.grad = None
        maxsim(Qg, Dg).backward(g)

    def trivial_graph():
        x.grad = None
        (x * 2).backward(g)

    def general_forward():  # backward= set: the same path since the planner
        with torch.no_grad():
            maxsim(Q, D, backward="auto")

    def planned_forward():
        with torch.no_grad():
            run_forward(p, o, Q, D, None, None, None, None)

    def launcher_forward():
        with torch.no_grad():
            forward_dense(plan, p, o.fp32_precision, Q, D, None, None, None, None)

    def planned_anew():  # any forced decision bypasses the plans' cache
        with forced_plan(HOPPER_MIN_MACS=MEASURED["HOPPER_MIN_MACS"]):
            plan_forward(p, o)

    rows = (
        ("no_grad forward, 32 x 32 queries and documents", forward, 5000),
        ("  the same with backward='auto' (one path since the planner)", general_forward, 5000),
        ("  its plan and launcher (_autograd.run_forward)", planned_forward, 5000),
        ("  its launcher alone (_launch.forward.forward_dense)", launcher_forward, 5000),
        ("  its cached plan's lookup (_plan.plan_forward)", lambda: plan_forward(p, o), 20000),
        ("  its plan made anew (inside forced_plan)", planned_anew, 5000),
        ("backward's plan and launcher, lowmem (2 launches; _autograd.run_backward)",
         lambda: run_backward(p_train, o, "lowmem", g, Q, D, argmax, None, None, None, True,
                              True), 5000),
        ("  its launcher alone (_launch.backward.backward_dense)",
         lambda: backward_dense(plan_bwd, o.fp32_precision, g, Q, D, argmax, None, None, True,
                                True, False), 5000),
        ("training step (forward + backward)", step, 2000),
        ("torch alone: (x * 2).backward(g)", trivial_graph, 2000),
    )
    rows += _head_rows(maxsim_from_hidden, forward_hidden, backward_hidden, plan_forward,
                       plan_hidden_backward, hidden_problem, o)
    if hopper_forward.AVAILABLE:  # the Gluon forward's launch key (NOTES.md section 33)
        items = tuple(gluon_constexprs(torch.bfloat16, 128, 1, 64, 4, 128, 4, False).items())
        consts = runtime.constants(**dict(items))
        rows += (("hash of the Gluon forward's constexprs as a tuple", lambda: hash(items), 100000),
                 ("hash of their Constants (the launch key's part)", lambda: hash(consts), 100000))
    print(f"torch {torch.__version__}, source {args.src}")
    for label, fn, n in rows:
        print(f"  {min(per_call_us(fn, n) for _ in range(5)):7.1f} us  {label}", flush=True)


if __name__ == "__main__":
    main()
