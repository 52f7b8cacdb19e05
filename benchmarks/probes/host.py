"""The host's side of a call: first calls in fresh processes, the issue time of launches and
steps for every provider, CUDA-graph replays that take the host out, what the suite's timed
interval and L2 flush hold, and the least a call of the suite's form costs.

Backs benchmarks/NOTES.md sections 16 (``cold``, ``cold_profile``), 18 (``steps``, ``host``), 21
(``launch``), 24, 32 and 39 (``graph_times``), 41 (``flush_writeback``), 44 (``step_timeline``)
and 52 (``host_floor``).
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import os
import pstats
import subprocess
import sys
import tempfile
import time

import torch
from harness.providers import PROVIDERS_BY_KEY, provider_unavailable
from harness.timing import make_step, wall_us_per_call
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

# Besides the public API, the package's private modules: the autograd layer's plan-and-launch, a
# part of the backward launcher.
from fusedmaxsim import maxsim
from fusedmaxsim._autograd import run_backward, run_forward
from fusedmaxsim._launch.backward import _drain_chunk
from fusedmaxsim.planning import MEASURED

from . import SRC
from .common import (
    captured,
    forward_plan,
    hopper_kernel_off,
    provider_step,
    suite_case,
    triton_launch_path,
    wall_us,
    warm_gpu,
)


def training_steps() -> None:
    """Where a training step's time goes, for the suite's training shapes and every installed
    provider: do_bench's median (the suite's timer), the host's time to issue one step (N steps
    issued back to back before one synchronize, divided by N: the GPU never waits for the
    host less than this), the wall time per step, and the GPU's kernel time per step (profiler).
    Ours also lists its kernels."""
    names = ("train_colbert", "train_colbert_masked", "train_colpali", "train_small_batch",
             "train_kd", "train_kd_colpali")
    for name in names:
        case = suite_case(name, "training")
        for key in ("fusedmaxsim", "lik", "flash"):
            step = provider_step(case, key)
            if step is None:
                continue
            for _ in range(5):
                case.reset_grads()
                step()
            torch.cuda.synchronize()
            ms = do_bench(lambda: (case.reset_grads(), step()), warmup=25, rep=100)
            n = 50
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(n):
                case.reset_grads()
                step()
            issued = (time.perf_counter() - start) / n * 1e3
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / n * 1e3
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    case.reset_grads()
                    step()
                torch.cuda.synchronize()
            kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
            gpu = sum(e.device_time_total for e in kernels) / 20 / 1e3
            print(f"{name:22s} {key:12s} do_bench {ms:.3f}  issue {issued:.3f}  wall {wall:.3f}  "
                  f"gpu {gpu:.3f} ms/step", flush=True)
            if key == "fusedmaxsim":
                for e in sorted(kernels, key=lambda e: -e.device_time_total)[:8]:
                    print(f"    {e.count / 20:5.1f}x {e.device_time_total / e.count / 1e3:.4f} ms  "
                          f"{e.key[:70]}")
        case.reset_grads()
        del case
        torch.cuda.empty_cache()


def host_costs() -> None:
    """The host's side of the training rows: the issue time of single launches (N calls back to
    back, no synchronize; the launchers through ``run_forward`` / ``run_backward``, which look
    their plan up first, as every call does), the CUDA runtime calls of one step (profiler, CPU
    side: a synchronize, an allocation or a copy shows here), and a cProfile of ours, for shapes whose
    host times differ (train_colbert with and without its document mask, the two kd shapes)."""
    x = torch.zeros(256, device="cuda")
    Q = torch.randn(32, 32, 128, device="cuda", dtype=torch.bfloat16)
    D = torch.randn(32, 180, 128, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(32, 32, device="cuda")
    p, o, _ = forward_plan(Q, D)
    p_train = p._replace(save_argmax=True)
    _, argmax = run_forward(p_train, o, Q, D, None, None, None, None)
    buf = torch.zeros(4, 180, 128, device="cuda")
    out = torch.empty(32, 180, 128, device="cuda", dtype=torch.bfloat16)
    for label, fn in (
        ("x.zero_() (one torch kernel)", lambda: x.zero_()),
        ("torch.empty 32x180x128 bf16", lambda: torch.empty(32, 180, 128, device="cuda")),
        ("run_forward, no argmax", lambda: run_forward(p, o, Q, D, None, None, None, None)),
        ("_launch.backward._drain_chunk",
         lambda: _drain_chunk(buf, out, 0, 4, MEASURED["DRAIN_BLOCK"])),
        ("run_backward lowmem (2 kernels)",
         lambda: run_backward(p_train, o, "lowmem", g, Q, D, argmax, None, None, None, True,
                              True)),
    ):
        print(f"  issue {wall_us(fn, issue_only=True):7.1f} us  {label}", flush=True)

    for name in ("train_colbert", "train_colbert_masked", "train_kd", "train_kd_colpali", "train_colpali"):
        case = suite_case(name, "training")
        step = provider_step(case, "fusedmaxsim")
        for _ in range(5):
            case.reset_grads()
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                case.reset_grads()
                step()
            torch.cuda.synchronize()
        print(f"== {name}: CUDA runtime calls per step (CPU side)")
        for e in sorted(prof.key_averages(), key=lambda e: -e.cpu_time_total):
            if e.key.startswith("cu") and e.count >= 20:
                print(f"    {e.count / 20:5.1f}x {e.cpu_time_total / 20:8.1f} us  {e.key[:60]}")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            case.reset_grads()
            step()
        torch.cuda.synchronize()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
        body = text.getvalue()
        print(body[body.find("ncalls"):][:2600], flush=True)
        del case
        torch.cuda.empty_cache()


_COLD_CHILD = """
import sys, time, torch
sys.path.insert(0, sys.argv[1])
from fusedmaxsim import maxsim
Q = torch.randn(128, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
D = torch.randn(128, 300, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(128, 128, device="cuda")
x = torch.randn(8, device="cuda", requires_grad=True)
torch.cuda.synchronize()
def timed(label, fn):
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    print(f"  {label:34s} {time.perf_counter() - start:.3f} s")
    return result
timed("first autograd backward, (2x).sum()", lambda: (x * 2).sum().backward())
if sys.argv[2] == "split":
    with torch.no_grad():
        timed("forward, no grad", lambda: maxsim(Q, D))
    out = timed("forward saving the argmax", lambda: maxsim(Q, D))
    timed("backward", lambda: out.backward(g))
else:
    timed("forward + backward", lambda: maxsim(Q, D).backward(g))
timed("second forward + backward", lambda: maxsim(Q, D).backward(g))
"""


def cold() -> None:
    """First calls at train_colbert's shape in fresh processes with empty Triton caches."""
    for how in ("split", "step"):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TRITON_CACHE_DIR=cache)
            print(how)
            run = subprocess.run([sys.executable, "-c", _COLD_CHILD, str(SRC), how], env=env,
                                 capture_output=True, text=True, timeout=120)
            print(run.stdout + run.stderr[-2000:])


_COLD_PROFILE = """
import cProfile, pstats, sys, torch
sys.path.insert(0, sys.argv[1])
from fusedmaxsim import maxsim
Q = torch.randn(128, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
D = torch.randn(128, 300, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(128, 128, device="cuda")
(Q.sum() * 2).backward()
torch.cuda.synchronize()
profile = cProfile.Profile()
profile.enable()
maxsim(Q, D).backward(g)
torch.cuda.synchronize()
profile.disable()
pstats.Stats(profile).sort_stats("cumulative").print_stats(28)
"""


def cold_profile() -> None:
    """Where the first forward + backward's seconds go (cProfile, cumulative, fresh cache)."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        run = subprocess.run([sys.executable, "-c", _COLD_PROFILE, str(SRC)], env=env,
                             capture_output=True, text=True, timeout=120)
        print(run.stdout[-9000:] + run.stderr[-2000:])


def launch_paths() -> None:
    """The host's side of the smallest rows, every provider in one process: issue time (calls
    back to back, no synchronize), wall time and do_bench for ours with the cached launch, ours
    through Triton's own launch path (as under FUSEDMAXSIM_TRITON_FAST_LAUNCH=0: every cached
    launcher's shortcut off), and the peers."""
    for name, mode in (("rerank_colbert", "inference"), ("small_batch", "inference"),
                       ("train_small_batch", "training"), ("train_colbert", "training")):
        case = suite_case(name, mode)
        print(f"-- {name}")
        for key in ("fusedmaxsim", "fusedmaxsim-triton-launch", "lik", "flash", "naive"):
            provider = PROVIDERS_BY_KEY.get(key.split("-")[0])
            if provider_unavailable(provider, torch.device("cuda")):
                continue
            step = make_step(provider.build(case), case)
            grads = [case.Q, case.D] if case.training else None

            def call():
                if grads:
                    case.reset_grads()
                step()
            with triton_launch_path() if key.endswith("launch") else contextlib.nullcontext():
                issue = wall_us(call, issue_only=True)
                wall = wall_us(call)
                ms = do_bench(step, warmup=25, rep=100, grad_to_none=grads)
            print(f"  {key:26s} issue {issue:6.1f} us  wall {wall:6.1f} us  do_bench {ms:.4f} ms",
                  flush=True)
        del case


def graph_times() -> None:
    """The small inference rows' GPU time without the host: each provider's call captured in a
    CUDA graph and replayed (do_bench on the replay, L2 cleared as in the suite), next to
    do_bench of the eager call and the host's issue time; separates a slower kernel from a
    longer launch path."""
    for name in ("rerank_colbert", "small_batch", "rerank_colpali"):
        case = suite_case(name, "inference")
        print(f"-- {name}")
        steps = {}
        for key in ("fusedmaxsim", "fusedmaxsim, general path", "fusedmaxsim, Triton forward",
                    "lik", "flash", "naive"):
            provider = PROVIDERS_BY_KEY.get(key.split(",")[0])
            if provider_unavailable(provider, torch.device("cuda")):
                continue
            if key.endswith("general path"):  # section 39 (one path since the planner)
                def general(case=case):
                    return maxsim(case.Q, case.D, backward="auto",
                                  normalize=case.shape.normalize)

                step = make_step(general, case)
            else:
                step = make_step(provider.build(case), case)
            steps[key] = _without_gluon(step) if key.endswith("Triton forward") else step
        # Issue times in three rounds, each in another provider order, the least of each kept:
        # a provider timed first in a process or a shape ran slower on some hosts (record
        # 2026-12-01_21622d8: the same path 90 and 55 µs).
        issues = {key: [] for key in steps}
        for round_ in range(3):
            keys = list(steps)
            for key in keys[round_:] + keys[:round_]:
                issues[key].append(wall_us(steps[key], issue_only=True))
        for key, step in steps.items():
            eager = do_bench(step, warmup=25, rep=100)
            issue = min(issues[key])
            try:
                replay = f"{do_bench(captured(step).replay, warmup=25, rep=100):.4f} ms"
            except Exception as exc:  # noqa: BLE001
                replay = f"not capturable ({type(exc).__name__})"
            rounds = " / ".join(f"{v:.1f}" for v in issues[key])
            print(f"  {key:28s} eager {eager:.4f} ms  graph replay {replay}  issue {issue:6.1f} us"
                  f" ({rounds})", flush=True)


def _without_gluon(fn):
    """``fn`` with the Gluon forward off in the settings while it runs (the Triton forward's
    call; its plans cached as usual)."""
    def call():
        with hopper_kernel_off():
            return fn()

    return call


def flush_writeback() -> None:
    """What the suite's L2 flush costs the call timed after it (benchmarks/NOTES.md section 41):
    do_bench zeroes a 256 MB buffer before each call, which leaves the L2 cache full of dirty
    lines that the next call's reads must write back to DRAM first. Each provider's call,
    captured in a CUDA graph, timed after that flush ("dirty") and after the same flush
    followed by a read of another 256 MiB ("clean": the write-backs done before the clock
    starts, the L2 left holding clean lines of neither input), with CUDA events around the
    replay as do_bench does; beside them a read of D's bytes alone (``torch.amax``) and a
    one-element add (the launch's and the events' own cost). Medians of 300 calls, µs, in three
    rounds."""
    cache = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    other = torch.empty(64 << 20, dtype=torch.float32, device="cuda").fill_(1.0)

    def median_us(replay, clean: bool, n: int = 300) -> float:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            cache.zero_()
            if clean:
                other.amax()
            starts[i].record()
            replay()
            ends[i].record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
        return times[n // 2]

    warm_gpu()
    for name in ("rerank_colbert", "small_batch", "rerank_colpali", "longdoc",
                 "rerank_colpali_norm"):
        case = suite_case(name, "inference")
        tiny = torch.zeros(1, device="cuda")
        steps = {"one-element add": lambda tiny=tiny: tiny.add_(1), "torch.amax(D)": case.D.amax}
        for key in ("fusedmaxsim", "lik", "flash"):
            step = provider_step(case, key)
            if step is not None:
                steps[key] = step
        graphs = {}
        for key, step in steps.items():
            try:
                graphs[key] = captured(step)
            except Exception as exc:  # noqa: BLE001
                print(f"   {key}: not capturable ({type(exc).__name__})", flush=True)
        mib = case.D.numel() * case.D.element_size() / 2**20
        print(f"-- {name} (D {mib:.0f} MiB)", flush=True)
        for key, graph in graphs.items():
            dirty = [median_us(graph.replay, False) for _ in range(3)]
            clean = [median_us(graph.replay, True) for _ in range(3)]
            print(f"   {key:14s} dirty " + " ".join(f"{v:6.1f}" for v in dirty)
                  + "   clean " + " ".join(f"{v:6.1f}" for v in clean), flush=True)
        del case, graphs
        torch.cuda.empty_cache()


def step_timeline() -> None:
    """What the suite's median of a host-bound training step times (benchmarks/NOTES.md section
    44): do_bench's loop (grads cleared, the 256 MB L2 flush, an event, the step, an event) with
    the host's clock read at each event's record, so each call gives the events' interval and the
    host's span between the two records; the same loop without the flush. Medians of 200 calls,
    µs."""
    cache = torch.empty(256 << 20, dtype=torch.int8, device="cuda")

    def loop(case, step, flush: bool, n: int = 200) -> tuple:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        spans = []
        for i in range(n):
            case.reset_grads()
            if flush:
                cache.zero_()
            starts[i].record()
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            ends[i].record()
            spans.append((t1 - t0) * 1e6)
        torch.cuda.synchronize()
        events = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
        return events[n // 2], sorted(spans)[n // 2]

    warm_gpu()
    for name in ("train_small_batch", "train_kd", "train_colbert"):
        case = suite_case(name, "training")
        print(f"-- {name}", flush=True)
        steps = {}
        for key in ("fusedmaxsim", "lik", "flash", "naive"):
            step = provider_step(case, key)
            if step is None:
                continue
            steps[key] = step
            for _ in range(20):
                case.reset_grads()
                steps[key]()
        torch.cuda.synchronize()
        for rnd in range(2):
            for key, step in steps.items():
                ev_f, host_f = loop(case, step, True)
                ev_n, host_n = loop(case, step, False)
                print(f"   round {rnd} {key:12s} flushed: events {ev_f:6.1f} host span {host_f:6.1f}"
                      f"   unflushed: events {ev_n:6.1f} host span {host_n:6.1f}", flush=True)
        case.reset_grads()
        del case, steps
        torch.cuda.empty_cache()


class _NoKernels(torch.autograd.Function):
    """A scoring op that does nothing but allocate its outputs: the scores in its forward, the
    two gradients in its backward. No kernel runs; what a call costs is the host's."""

    @staticmethod
    def forward(ctx, Q, D):
        ctx.shapes = (Q.shape, D.shape, Q.dtype, Q.device)
        return torch.empty(Q.shape[0], D.shape[0], device=Q.device)

    @staticmethod
    def backward(ctx, grad):
        q_shape, d_shape, dtype, device = ctx.shapes
        return (torch.empty(q_shape, dtype=dtype, device=device),
                torch.empty(d_shape, dtype=dtype, device=device))


def host_floor() -> None:
    """The wall µs a call of the suite (N calls back to back, one synchronize, as its `wall
    µs/call`) at its smallest shapes, small_batch and train_small_batch (32 x 32 queries and
    documents, 32 x 180 tokens, bf16): fusedmaxsim, naive PyTorch, and the least a call of that
    form costs this host: ``_NoKernels``, an op that launches nothing, called as the suite calls
    ours (under ``no_grad``; in training, the gradients reset, the call, ``backward(g)``), and one
    torch kernel alone (``x.zero_()``). Three interleaved rounds; the least and the median."""
    rows = {}
    for mode, name in (("inference", "small_batch"), ("training", "train_small_batch")):
        case = suite_case(name, mode)
        x = torch.zeros(256, device="cuda")
        calls = {
            "fusedmaxsim": provider_step(case, "fusedmaxsim"),
            "naive PyTorch": provider_step(case, "naive"),
            "no kernels (autograd.Function)": make_step(
                lambda case=case: _NoKernels.apply(case.Q, case.D), case),
        }
        if mode == "inference":
            calls["one torch kernel (x.zero_())"] = x.zero_
        for label in calls:
            rows[(name, label)] = []
        for _ in range(3):
            for label, step in calls.items():
                us, _ = wall_us_per_call(step, case, torch.cuda.synchronize, 0.01, 5.0)
                rows[(name, label)].append(us)
        del case
    print("  shape              call                              least    median  (wall us/call)")
    for (name, label), values in rows.items():
        values.sort()
        print(f"  {name:18s} {label:32s} {values[0]:7.1f}  {values[1]:7.1f}", flush=True)


def cpu_orientation():
    """The PyTorch path's two layouts of the cross product's similarities on this CPU (design.md
    "PyTorch path"): inference of one query of R tokens against ~24,000 document tokens, R
    and the document length swept, each side forced through the plan and timed in alternation
    (wall median of one call, 24 rounds), in fp32 and in bf16 (the bf16 product). Prints
    time(query-major) / time(document-major): above 1, document-major is faster. Run with
    ``CUDA_VISIBLE_DEVICES=`` on a GPU machine."""
    import statistics

    import fusedmaxsim

    torch.manual_seed(0)

    def ratio(Q, D, rounds=24):
        times = {False: [], True: []}
        with torch.no_grad():
            for r in range(rounds):
                for doc_major in ((False, True) if r % 2 else (True, False)):
                    with fusedmaxsim.forced_plan(doc_major=doc_major):
                        start = time.perf_counter()
                        fusedmaxsim.maxsim(Q, D)
                        times[doc_major].append(time.perf_counter() - start)
        return statistics.median(times[False]) / statistics.median(times[True])

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          "time(query-major) / time(document-major)")
    for dtype in (torch.float32, torch.bfloat16):
        for Ld in (128, 300, 1024):
            row = []
            for R in (8, 16, 24, 32, 40, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 512):
                Q = torch.randn(1, R, 128, dtype=dtype)
                D = torch.randn(max(1, 24000 // Ld), Ld, 128, dtype=dtype)
                row.append(f"{R}:{ratio(Q, D):.2f}")
            print(f"{str(dtype)[6:]:8s} Ld={Ld:5d}  " + " ".join(row), flush=True)
