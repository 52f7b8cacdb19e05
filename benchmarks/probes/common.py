"""Helpers the probes share: random inputs, GPU and host timers, CUDA-graph capture and
interleaved replay rounds, the benchmark suite's cases and provider calls, and calls of the
library's launchers under the plans its planner makes (``fusedmaxsim.forced_plan`` forcing any
decision while a plan is made). Backs no NOTES section of its own.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
from harness.providers import PROVIDERS_BY_KEY, provider_unavailable
from harness.shapes import SHAPES_BY_NAME, make_case
from harness.timing import make_step
from profile_host import wall_us  # noqa: F401  (re-exported: µs a call, or to issue one)
from triton.testing import do_bench

from fusedmaxsim import forced_plan, maxsim, settings

# The package's private modules: the planner's inputs and the launchers that execute its plans.
from fusedmaxsim._launch import runtime
from fusedmaxsim._launch.backward import backward_dense
from fusedmaxsim._launch.forward import _launch_gluon, forward_dense
from fusedmaxsim._plan import plan_backward, plan_forward
from fusedmaxsim._problem import dense_problem, options_for


def bf16(*shape) -> torch.Tensor:
    """A random bf16 tensor of this shape on the GPU."""
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def bench(fn) -> float:
    """GPU ms of ``fn`` (``do_bench``'s median)."""
    return do_bench(fn, warmup=10, rep=50)


def step_peak_and_ms(Q, D, g, strategy: str) -> tuple[float, float]:
    """A training step's peak memory above what was allocated before it (MiB), and its time."""
    def step():
        maxsim(Q, D, backward=strategy).backward(g)

    step()
    Q.grad = D.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    Q.grad = D.grad = None
    return peak, do_bench(step, warmup=10, rep=50, grad_to_none=[Q, D])


def captured(step) -> torch.cuda.CUDAGraph:
    """``step`` run once (compiling what it needs), then captured in a CUDA graph."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def warm_gpu() -> None:
    """Two hundred 8192 x 8192 bf16 products, so that the GPU's clocks are up before a timing."""
    warm = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(200):
        warm @ warm


def replay_rounds(graphs: dict, label) -> str:
    """GPU ms of each captured graph's replays in three interleaved rounds: a line each,
    ``label(name)`` first."""
    times = {name: [] for name in graphs}
    for _ in range(3):
        for name, graph in graphs.items():
            times[name].append(bench(graph.replay))
    return "".join(f"\n   {label(name)} " + " ".join(f"{v:.4f}" for v in values)
                   for name, values in times.items())


def host_us_a_call(call, calls: int = 100) -> float:
    """The host's time to issue one call (the best of five runs of ``calls`` calls issued back
    to back, each run synchronized before it starts)."""
    best = math.inf
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return best


def suite_case(name: str, mode: str):
    """The benchmark suite's case of shape ``name`` in ``mode`` (inference or training), on the
    GPU."""
    return make_case(SHAPES_BY_NAME[name], mode, "cuda")


def provider_step(case, key: str):
    """The suite's call of provider ``key`` on ``case``, or None where that provider cannot run
    here."""
    provider = PROVIDERS_BY_KEY[key]
    if provider_unavailable(provider, torch.device("cuda")):
        return None
    return make_step(provider.build(case), case)


# ------------------------------------------------------------------------------------------------
# The library's switches, and its launchers under a plan
# ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def hopper_kernel_off():
    """The Gluon forward off inside the block (``settings.set_hopper_kernel(False)``): every
    forward plans the Triton kernel, plans cached as usual; the setting in force before comes
    back after."""
    before = settings.hopper_kernel()
    settings.set_hopper_kernel(False)
    try:
        yield
    finally:
        settings.set_hopper_kernel(None)
        if settings.hopper_kernel() != before:
            settings.set_hopper_kernel(before)


def _library_kernels() -> list:
    """Every Triton (and Gluon) kernel of the package, imported."""
    from triton.runtime.jit import KernelInterface

    from fusedmaxsim.kernels import backward, forward, hopper_forward, smooth, winner_index

    return [kernel for module in (forward, backward, winner_index, smooth, hopper_forward)
            for name, kernel in vars(module).items()
            if name.endswith("_kernel") and isinstance(kernel, KernelInterface)]


@contextlib.contextmanager
def triton_launch_path():
    """Every kernel of the package launched through Triton's own launch path inside the block,
    as under ``FUSEDMAXSIM_TRITON_FAST_LAUNCH=0`` (which is read at import): each kernel's cached
    launcher (``fusedmaxsim._launch.runtime.launcher``) with its shortcut off."""
    launchers = [runtime.launcher(kernel) for kernel in _library_kernels()]
    saved = [found.enabled for found in launchers]
    for found in launchers:
        found.enabled = False
    try:
        yield
    finally:
        for found, enabled in zip(launchers, saved):
            found.enabled = enabled


class Launch:
    """A launcher's call on fixed inputs under a plan made once (``launch()`` runs it, with no
    planning on the way): ``problem``, ``options`` and ``plan`` say what it runs."""

    def __init__(self, run, problem, options, plan):
        self.run, self.problem, self.options, self.plan = run, problem, options, plan

    def __call__(self):
        return self.run()


def forward_plan(Q, D, q_mask=None, d_mask=None, *, normalize: bool = False,
                 norm_from_tiles: bool = False, tau: float = 0.0, save_argmax: bool = False,
                 **forced) -> tuple:
    """``(problem, options, plan)``: the forward the library plans for these inputs, with
    ``forced_plan(**forced)`` in force while it is planned."""
    p = dense_problem(Q, D, q_mask, d_mask, normalize=normalize, norm_from_tiles=norm_from_tiles,
                      tau=tau, save_argmax=save_argmax)
    o = options_for(Q)
    with forced_plan(**forced):
        return p, o, plan_forward(p, o)


def forward_call(Q, D, q_mask=None, d_mask=None, q_inv=None, d_inv=None, *,
                 save_argmax: bool = False, norm_from_tiles: bool = False, tau: float = 0.0,
                 **forced) -> Launch:
    """The forward launcher (``forward_dense``) on these inputs: ``launch()`` returns the scores
    and the argmax (a shared empty tensor unless ``save_argmax``). Normalized with ``q_inv`` and
    ``d_inv`` given, or with ``norm_from_tiles``. A Gluon plan that fails to launch falls back to
    the Triton kernel there, as in the library; :func:`gluon_call` raises instead."""
    p, o, plan = forward_plan(Q, D, q_mask, d_mask, normalize=q_inv is not None or norm_from_tiles,
                              norm_from_tiles=norm_from_tiles, tau=tau, save_argmax=save_argmax,
                              **forced)

    def run():
        return forward_dense(plan, p, o.fp32_precision, Q, D, q_mask, d_mask, q_inv, d_inv)

    return Launch(run, p, o, plan)


class NotGluon(Exception):
    """The plan of a call is not the Gluon forward; the message says why."""


def gluon_call(Q, D, scores, *, normalize: bool = False, argmax=None, **forced) -> Launch:
    """The Gluon forward of these inputs (normalizing with the norms from the tiles; with
    ``argmax``, saving it there) into ``scores``, as planned under
    ``forced_plan(HOPPER_MIN_MACS=0, **forced)`` (every size, as the probes always took it);
    :class:`NotGluon` where that plan is not the Gluon forward. It launches the plan's Gluon
    kernel itself (``_launch.forward._launch_gluon``, which ``forward_dense`` calls), so a
    failure raises rather than falling back to the Triton kernel, and writes the outputs given
    (NaN-poisoned by the probes that check them)."""
    p, o, plan = forward_plan(Q, D, normalize=normalize, norm_from_tiles=normalize,
                              save_argmax=argmax is not None,
                              **{"HOPPER_MIN_MACS": 0, **forced})
    if plan.kernel != "gluon":
        raise NotGluon(f"the plan is the {plan.kernel} forward: {plan.reasons[-1]}")

    def run():
        _launch_gluon(plan, p, Q, D, scores, argmax)

    return Launch(run, p, o, plan)


def backward_call(g, Q, D, argmax, q_inv=None, d_inv=None, *, need_q: bool = True,
                  need_d: bool = True, strategy: str = "auto", fp32_out: bool = False,
                  **forced) -> Launch:
    """The dense backward launcher (``backward_dense``) on these inputs: ``launch()`` returns
    ``(grad_Q, grad_D)`` (an empty tensor for one not needed; fp32 with ``fp32_out``), under
    the plan the library makes for ``strategy`` (``"auto"``, ``"unified"`` or ``"lowmem"``)
    with ``forced_plan(**forced)`` in force while it is planned."""
    p = dense_problem(Q, D, None, None, normalize=q_inv is not None, save_argmax=True)
    o = options_for(Q)
    with forced_plan(**forced):
        plan = plan_backward(p, o, need_q, need_d, strategy)

    def run():
        return backward_dense(plan, o.fp32_precision, g, Q, D, argmax, q_inv, d_inv, need_q,
                              need_d, fp32_out)

    return Launch(run, p, o, plan)
