"""The Python side of a call, with every Triton launch replaced by a no-op: what the package's own
layers cost the host per call (the best of five timings), apart from the launch itself and the GPU. Runs on a CPU under the
Triton interpreter (so that CPU tensors take the Triton path), for the source tree given.

    TRITON_INTERPRET=1 FUSEDMAXSIM_BACKEND=triton python benchmarks/host_python.py [SRC_DIR]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1] / "src"))

import torch

from fusedmaxsim import _launch, maxsim


class _NoLaunch:
    def __call__(self, grid, args, constants):
        pass


def per_call_us(fn, n: int) -> float:
    for _ in range(n // 20):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    _launch.launcher = lambda kernel: _NoLaunch()
    Q = torch.randn(32, 32, 128, dtype=torch.bfloat16)
    D = torch.randn(32, 180, 128, dtype=torch.bfloat16)
    g = torch.randn(32, 32)
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    x = torch.randn(32, 32, requires_grad=True)
    _, argmax = _launch.maxsim_fwd(Q, D, None, None, None, None, True, "tf32")

    def forward():
        with torch.no_grad():
            maxsim(Q, D)

    def step():
        Qg.grad = Dg.grad = None
        maxsim(Qg, Dg).backward(g)

    def trivial_graph():
        x.grad = None
        (x * 2).backward(g)

    import fusedmaxsim.api as api

    def general_forward():  # backward= set: the general path even on a GPU
        with torch.no_grad():
            maxsim(Q, D, backward="auto")

    def launcher_forward():
        with torch.no_grad():
            _launch.maxsim_fwd(Q, D, None, None, None, None, False, "tf32")

    rows = (
        ("no_grad forward, 32 x 32 queries and documents", forward, 5000),
        ("  the same through the general path (backward='auto')", general_forward, 5000),
        ("  its launcher alone (_launch.maxsim_fwd)", launcher_forward, 5000),
        ("backward launcher, lowmem (2 launches)",
         lambda: _launch.maxsim_bwd(g, Q, D, argmax, None, None, True, True, "lowmem", False, "tf32"), 5000),
        ("training step (forward + backward)", step, 2000),
        ("torch alone: (x * 2).backward(g)", trivial_graph, 2000),
    )
    if hasattr(api, "_plain_inference_applies"):  # section 39: what a GPU call's shortcut checks
        def shortcut_checks():
            with torch.no_grad():
                api._plain_inference_applies(Q, D)

        rows += (("the plain-inference shortcut's checks (a GPU call's, CUDA last)",
                  shortcut_checks, 20000),)
    if _launch._kernels_hopper.AVAILABLE:  # the Gluon forward's launch key (NOTES.md section 33)
        items = tuple(_launch.hopper_constexprs(
            torch.bfloat16, 128, 1, 64, 4, 128, 4, False).items())
        consts = _launch.constants(**dict(items))
        rows += (("hash of the Gluon forward's constexprs as a tuple", lambda: hash(items), 100000),
                 ("hash of their Constants (the launch key's part)", lambda: hash(consts), 100000))
    print(f"torch {torch.__version__}, source {sys.path[0]}")
    for label, fn, n in rows:
        print(f"  {min(per_call_us(fn, n) for _ in range(5)):7.1f} us  {label}", flush=True)


if __name__ == "__main__":
    main()
