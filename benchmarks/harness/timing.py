"""How one call is run and timed.

:func:`run_once` (the gate's call, which doubles as the warm-up) and :func:`make_step` (what
one timed call does: inference under ``no_grad``, or forward plus backward); :class:`Timer`
(``triton.testing.do_bench`` on CUDA, ``time.perf_counter`` on CPU) and the quantiles of its
samples; the interleaved timing rounds (:func:`round_orders`); wall time per call with host
overhead; allocator peak of one call; and the roofline: both ceilings measured in this run
(:func:`measure_ceilings`) and the floor of a shape (:func:`floor_ms`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .shapes import Case, Shape


def sync_fn(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def run_once(score, case: Case, sync) -> tuple:
    """One call (forward, plus backward in training) with its output, gradients and seconds.

    The gate's call doubles as the warm-up, so autotune sweeps never land in the timings.
    """
    case.reset_grads()
    sync()
    start = time.perf_counter()
    if case.training:
        out = score()
        out.backward(case.grad_out)
    else:
        with torch.no_grad():
            out = score()
    sync()
    seconds = time.perf_counter() - start
    grads = (case.Q.grad, case.D.grad) if case.training else None
    case.reset_grads()
    return out.detach(), grads, seconds


def make_step(score, case: Case) -> Callable[[], None]:
    """What one timed call does: inference under ``no_grad``, or forward plus backward."""
    if case.training:
        def step():
            score().backward(case.grad_out)
    else:
        def step():
            with torch.no_grad():
                score()
    return step


class Timer:
    """Median, p20 and p80 of one call, in ms.

    CUDA uses ``triton.testing.do_bench`` (CUDA events, L2 flushed between calls). CPU has no
    events, so each call is bracketed with ``time.perf_counter`` after a timed warm-up.
    """

    def __init__(self, device: torch.device, warmup_ms: float, rep_ms: float):
        self.device = device
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms

    @property
    def name(self) -> str:
        if self.device.type == "cuda":
            return "triton.testing.do_bench"
        return "time.perf_counter"

    def __call__(self, fn, grad_to_none=None) -> tuple:
        return quantiles_ms(self.samples(fn, grad_to_none, self.rep_ms))

    def samples(self, fn, grad_to_none, rep_ms: float) -> list:
        """The time of each timed call (ms) over about ``rep_ms``, after the warm-up."""
        if self.device.type == "cuda":
            from triton.testing import do_bench

            return list(do_bench(fn, warmup=self.warmup_ms, rep=rep_ms,
                                 grad_to_none=grad_to_none, return_mode="all"))
        return self._cpu(fn, grad_to_none or (), rep_ms)

    def _cpu(self, fn, grad_to_none, rep_ms: float) -> list:
        def call() -> float:
            for x in grad_to_none:
                x.grad = None
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3

        estimate = max(call(), 1e-3)
        for _ in range(min(1000, int(self.warmup_ms / estimate))):
            call()
        n = max(5, min(1000, int(rep_ms / estimate)))
        return [call() for _ in range(n)]


def quantiles_ms(times) -> tuple:
    """(median, p20, p80) of per-call times."""
    times = torch.tensor(list(times), dtype=torch.float64)
    med, p20, p80 = torch.quantile(times, torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64))
    return med.item(), p20.item(), p80.item()


# The suite times each shape's providers in this many interleaved rounds, each in another order,
# and pools the calls: a host that speeds up or slows down during a shape (CPU clocks ramping
# after a long GPU phase, say) then weighs on every provider alike, not on whichever runs first.
TIMING_ROUNDS = 3


def round_orders(n: int, rounds: int = TIMING_ROUNDS) -> list:
    """Provider orders of the timing rounds: each round starts ``n / rounds`` further on, so no
    provider is always first."""
    step = max(1, -(-n // rounds))
    return [[(i + r * step) % n for i in range(n)] for r in range(rounds)]


def wall_us_per_call(step, case: Case, sync, ms: float, target_ms: float) -> tuple:
    """Wall time per call with host overhead: N calls back to back, one sync, divided by N.

    Kernel timers hide launch and Python overhead, which is what decides tiny shapes.
    """
    n = int(max(3, min(500, target_ms / max(ms, 1e-3))))
    step()
    sync()
    start = time.perf_counter()
    for _ in range(n):
        case.reset_grads()
        step()
    sync()
    case.reset_grads()
    return (time.perf_counter() - start) / n * 1e6, n


def peak_mib(step, case: Case, device: torch.device) -> float | None:
    """Allocator peak of one call above what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    case.reset_grads()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    case.reset_grads()
    return peak / 2**20


def measure_ceilings(device: torch.device, timer: Timer) -> dict:
    """Both roofline ceilings, measured in this run on this device.

    A large bf16 matrix product gives the arithmetic rate and a large device-to-device copy
    (read plus write bytes) the memory bandwidth, so the floor reflects this card, its clocks
    and its driver rather than a datasheet. A CPU gets smaller fp32 problems.
    """
    if device.type == "cuda":
        n, dtype, nbytes = 8192, torch.bfloat16, 1 << 30
    else:
        n, dtype, nbytes = 1024, torch.float32, 1 << 26
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm_ms = timer(lambda: torch.mm(a, b))[0]
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src))[0]
    return {
        "matmul_tflops": 2 * n**3 / (mm_ms * 1e-3) / 1e12,
        "matmul": f"{n}x{n}x{n} {str(dtype).removeprefix('torch.')}",
        "copy_gbps": 2 * nbytes / (copy_ms * 1e-3) / 1e9,
        "copy_bytes": nbytes,
    }


def floor_ms(shape: Shape, mode: str, ceilings: dict | None) -> float | None:
    """Roofline floor: the longer of the arithmetic at the matmul rate and the traffic at the
    copy bandwidth. Traffic is Q and D, plus their gradients in training."""
    if not ceilings:
        return None
    compute_s = shape.flops / (ceilings["matmul_tflops"] * 1e12)
    traffic = shape.input_bytes * (2 if mode == "training" else 1)
    memory_s = traffic / (ceilings["copy_gbps"] * 1e9)
    return max(compute_s, memory_s) * 1e3


def median_call_ms(fn, device: torch.device, rounds: int = 3, warmup: int = 25,
                   rep: int = 100) -> float:
    """``fn``'s time in ms: ``triton.testing.do_bench``'s median on CUDA, the mean of ``rounds``
    calls elsewhere (a smoke run's figure)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=warmup, rep=rep)
    start = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - start) / rounds * 1e3

