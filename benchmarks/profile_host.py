"""Where the host time of a small MaxSim call goes, on a GPU: wall time per call of each layer
(N calls back to back, one synchronize), then a cProfile of the inference call and of the
training step.

    PYTHONPATH=src python3 benchmarks/profile_host.py

Shapes are those of the benchmark's small_batch / train_small_batch (32×32 queries and
documents, 32×180 tokens, d=128, bf16), where the GPU work is a few microseconds and the host
decides the time.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
# The package, and its autograd layer's plan-and-launch (the planner's cached plan, then the
# launcher):
import fusedmaxsim as fm  # noqa: E402
from fusedmaxsim._autograd import run_backward, run_forward  # noqa: E402
from fusedmaxsim._problem import dense_problem, options_for  # noqa: E402


def wall_us(fn, n: int = 400, *, issue_only: bool = False) -> float:
    """µs per call of ``n`` calls back to back and one synchronize; ``issue_only`` stops the clock
    before the synchronize: the host's own time to issue a call."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    end = issued if issue_only else time.perf_counter()
    return (end - start) / n * 1e6


def print_profile(label: str, call, n: int, lines: int) -> None:
    """A cProfile of ``n`` calls and one synchronize, the ``lines`` largest by own time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(lines)
    print(f"\n== cProfile, {label}\n" + out.getvalue())


def main() -> None:
    dev = "cuda"
    Q = torch.randn(32, 32, 128, device=dev, dtype=torch.bfloat16)
    D = torch.randn(32, 180, 128, device=dev, dtype=torch.bfloat16)
    g = torch.randn(32, 32, device=dev)
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    rows = {}
    rows["torch.empty 32x32 fp32"] = wall_us(lambda: torch.empty(32, 32, device=dev))
    rows["torch.zeros 32x180x128 fp32"] = wall_us(lambda: torch.zeros(32, 180, 128, device=dev))
    rows["tensor.to bf16 (32x180x128)"] = wall_us(lambda: g.to(torch.bfloat16))
    rows["naive einsum+amax+sum"] = wall_us(
        lambda: torch.einsum("ash,bth->abst", Q, D).amax(-1).sum(-1)
    )
    p, o = dense_problem(Q, D, None, None), options_for(Q)
    p_train = p._replace(save_argmax=True)
    with torch.no_grad():
        rows["maxsim no_grad"] = wall_us(lambda: fm.maxsim(Q, D))
        rows["run_forward"] = wall_us(lambda: run_forward(p, o, Q, D, None, None, None, None))
    scores, argmax = run_forward(p_train, o, Q, D, None, None, None, None)
    for strategy in ("unified", "lowmem"):
        rows[f"run_backward {strategy}"] = wall_us(
            lambda: run_backward(p_train, o, strategy, g, Q, D, argmax, None, None, None, True,
                                 True)
        )
        rows[f"forward with grad, {strategy}"] = wall_us(lambda: fm.maxsim(Qg, Dg, backward=strategy))
        rows[f"fwd+bwd backward(), {strategy}"] = wall_us(
            lambda: fm.maxsim(Qg, Dg, backward=strategy).backward(g)
        )
        rows[f"fwd+bwd autograd.grad, {strategy}"] = wall_us(
            lambda: torch.autograd.grad(fm.maxsim(Qg, Dg, backward=strategy), (Qg, Dg), g)
        )
    x = torch.ones(4, device=dev, requires_grad=True)
    rows["autograd floor: (x*2).sum().backward()"] = wall_us(lambda: (x * 2).sum().backward())
    for name, us in rows.items():
        print(f"{name:42s} {us:8.1f} us/call")

    with torch.no_grad():
        print_profile("2000 inference calls (no_grad)", lambda: fm.maxsim(Q, D), 2000, 16)
    for strategy in ("unified", "lowmem"):
        print_profile(f"300 training steps, {strategy}",
                      lambda: fm.maxsim(Qg, Dg, backward=strategy).backward(g), 300, 22)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        for _ in range(50):
            fm.maxsim(Qg, Dg).backward(g)
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
