"""Kernel-level probes behind benchmarks/NOTES.md sections 10-12: the normalize-from-tiles
forward under forced tile configurations, the forward/backward split of the per-query candidate
training shape, the smooth max against colpali-engine's einsum + logsumexp; and behind sections
13-16: padded document masks, the forward tiles of small-query reranking, the unified backward's
memory, and the first calls' split; behind sections 18-21: the training rows' host and GPU
time, the forward's tile variants (registers, spills, parity, time), the host's side of a launch
for every provider, and the query chunk height; behind sections 22-23: the query tile in
registers, the small rows' GPU time alone, 256-row query blocks; behind section 25: the
document-owned grad_D through the winner index; behind sections 30-35: the Gluon forward, its
argmax and normalize variants, and its tiles; behind section 36, 64-row query chunks for
one 128-token query; behind section 38, several documents a program; behind section 41, the
documents a program of grids a few waves long, and what the suite's L2 flush costs the call
timed after it; behind sections 42 and 46, the argmax forward in Gluon; behind section 44,
where a host-bound training step's timed interval goes, and the gather kernel's columns a step;
behind section 45, the document-owned grad_D's stages and ``auto``'s backward for large cross
products; behind section 47, where the large lowmem backward goes, and its winner index and
grad_D against the kernels before; behind section 48, the indexed grad_D's query rows loaded
beside the argmax, against the kernel before and under other tiles; behind section 51, lowmem
against unified between 2^32 and 2^36 multiply-adds; behind section 52, what the host alone costs
a call at the suite's smallest shapes.
GPU times by ``triton.testing.do_bench`` (median, ms).

    PYTHONPATH=src python3 benchmarks/probe.py [normalize] [kd] [smooth] [masked] [rerank] [memory] [cold]
        [small] [stages] [cold_profile] [steps] [host] [fwd_tiles] [launch] [chunks]
        [query_registers] [graph_times] [wide_rows] [winner_index] [chunk_splits] [occupancy]
        [hopper_forward] [hopper_host] [hopper_variants] [short_query] [norms_ahead]
        [three_programs] [few_programs] [norms_handoff] [half_blocks]
        [doc_passes] [doc_waves] [flush_writeback] [step_timeline] [gather_steps]
        [dd_rows] [dd_steps] [large_cross] [ragged_dd] [hopper_argmax] [backward_parts]
        [backward_once] [grad_d_ab] [dd_variants] [mid_strategies] [host_floor]
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from fusedmaxsim import _launch, maxsim, settings  # noqa: E402
from fusedmaxsim._kernels import _maxsim_fwd_kernel  # noqa: E402
from fusedmaxsim._configs import BwdConfig, FwdConfig, bwd_config, forced_configs, fwd_config  # noqa: E402
from fusedmaxsim.reference import maxsim_ref  # noqa: E402
from fusedmaxsim.testing import relative_error, relative_error_fro  # noqa: E402


def _bf16(*shape) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def bench(fn) -> float:
    return do_bench(fn, warmup=10, rep=50)


def normalize_sweep() -> None:
    """rerank_colpali_norm: 1 query of 128 tokens against 1000 pages of 1024, bf16."""
    Q = torch.randn(1, 128, 128, device="cuda", dtype=torch.bfloat16)
    D = torch.randn(1000, 1024, 128, device="cuda", dtype=torch.bfloat16) * 3
    ref = maxsim_ref(Q.double(), D.double(), normalize=True)
    default = fwd_config(Lq=128, dim=128, Nq=1, per_query_docs=False, elem_bytes=2)
    print("default", default)
    with torch.no_grad():
        print(f"no normalize            {bench(lambda: maxsim(Q, D)):.4f}")
        print(f"normalize, from tiles   {bench(lambda: maxsim(Q, D, normalize=True)):.4f}")
        q_inv = _launch.inverse_norms(Q, 1e-12)
        d_inv = _launch.inverse_norms(D, 1e-12)
        print(f"inverse norms of D      {bench(lambda: _launch.inverse_norms(D, 1e-12)):.4f}")
        print(f"fwd with given norms    "
              f"{bench(lambda: _launch.maxsim_fwd(Q, D, None, None, q_inv, d_inv, False, 'tf32')):.4f}")
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    cfg = FwdConfig(128, 1, block_n, 128, warps, stages)
                    with forced_configs(fwd=cfg):
                        try:
                            out = maxsim(Q, D, normalize=True)
                            err = relative_error(out, ref)
                            ms = bench(lambda: maxsim(Q, D, normalize=True))
                            print(f"  tiles bn={block_n:3d} w={warps} s={stages}: {ms:.4f} ms  err {err:.1e}")
                        except Exception as exc:  # noqa: BLE001
                            print(f"  tiles bn={block_n:3d} w={warps} s={stages}: {type(exc).__name__}")


def kd_split() -> None:
    """train_kd_colpali (32 queries of 32 tokens, 16 candidates of 1030 tokens each) and train_kd
    (64 queries, 32 candidates of 300), bf16: the forward and the backward's kernels apart."""
    for nq, k, ld in ((32, 16, 1030), (64, 32, 300)):
        print(f"-- {nq} queries x {k} candidates of {ld} tokens")
        _kd_split(nq, k, ld)


def _kd_split(nq: int, k: int, ld: int) -> None:
    Q = torch.randn(nq, 32, 128, device="cuda", dtype=torch.bfloat16)
    D = torch.randn(nq, k, ld, 128, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(nq, k, device="cuda")
    print("fwd config", fwd_config(Lq=32, dim=128, Nq=nq, per_query_docs=True, elem_bytes=2))
    print("bwd config", bwd_config(Lq=32, dim=128, elem_bytes=2, per_query_docs=True))
    print(f"fwd no argmax   {bench(lambda: _launch.maxsim_fwd(Q, D, None, None, None, None, False, 'tf32')):.4f}")
    print(f"fwd with argmax {bench(lambda: _launch.maxsim_fwd(Q, D, None, None, None, None, True, 'tf32')):.4f}")
    _, argmax = _launch.maxsim_fwd(Q, D, None, None, None, None, True, "tf32")
    for strategy in ("lowmem", "unified"):
        for need_q, need_d in ((True, False), (False, True), (True, True)):
            ms = bench(lambda: _launch.maxsim_bwd(g, Q, D, argmax, None, None, need_q, need_d, strategy, False, "tf32"))
            print(f"bwd {strategy:7s} grad_Q={need_q!s:5s} grad_D={need_d!s:5s} {ms:.4f}")
    for cfg in (BwdConfig(16, 32, 16, 128, 4, 1), BwdConfig(32, 64, 32, 128, 4, 2), BwdConfig(32, 128, 32, 128, 4, 2),
                BwdConfig(32, 64, 32, 128, 8, 2), BwdConfig(32, 256, 32, 128, 8, 2)):
        with forced_configs(bwd=cfg):
            try:
                ms = bench(lambda: _launch.maxsim_bwd(g, Q, D, argmax, None, None, False, True, "lowmem", False, "tf32"))
                print(f"  lowmem grad_D {cfg}: {ms:.4f}")
            except Exception as exc:  # noqa: BLE001
                print(f"  lowmem grad_D {cfg}: {type(exc).__name__} {exc}")
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    print(f"step auto (ms)  {do_bench(lambda: maxsim(Qg, Dg).backward(g), warmup=10, rep=50, grad_to_none=[Qg, Dg]):.4f}")


def smooth_vs_naive() -> None:
    """In-batch ColPali training with use_smooth_max (tau 0.1): B queries of 128 tokens against
    B pages of 1024, unit bf16 tokens; colpali-engine's formula is einsum + logsumexp."""
    import torch.nn.functional as F

    def naive(Q, D):
        sim = torch.einsum("bnd,csd->bcns", Q, D)
        return (0.1 * torch.logsumexp(sim / 0.1, dim=3)).sum(dim=2)

    for B in (16, 32, 64):
        Q = F.normalize(torch.randn(B, 128, 128, device="cuda"), dim=-1).bfloat16().requires_grad_()
        D = F.normalize(torch.randn(B, 1024, 128, device="cuda"), dim=-1).bfloat16().requires_grad_()
        g = torch.randn(B, B, device="cuda")
        Q64, D64 = Q.detach().double().requires_grad_(), D.detach().double().requires_grad_()
        ref = naive(Q64, D64)
        rq, rd = torch.autograd.grad(ref, (Q64, D64), g.double())
        row = f"B={B:3d}"
        for name, fn in (("fused", lambda q, d: maxsim(q, d, reduction="smoothmax", tau=0.1)),
                         ("naive", naive)):
            out = fn(Q, D)
            gq, gd = torch.autograd.grad(out, (Q, D), g)
            errs = [relative_error(out, ref), relative_error(gq, rq), relative_error(gd, rd)]
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn(Q, D).backward(g)
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            ms = do_bench(lambda: fn(Q, D).backward(g), warmup=10, rep=50, grad_to_none=[Q, D])
            row += (f" | {name} {ms:.3f} ms, peak {peak:.0f} MiB, err "
                    + "/".join(f"{e:.1e}" for e in errs))
        print(row)


def masked() -> None:
    """batch_colbert(_masked) and train_colbert(_masked): 256 (128) queries of 32 tokens against
    as many documents of 300, bf16; masks: none, padding (lengths between 30 and 300, as the
    suite draws them), the same lengths with holes inside."""
    for n, train in ((256, False), (128, True)):
        Q = torch.randn(n, 32, 128, device="cuda", dtype=torch.bfloat16)
        D = torch.randn(n, 300, 128, device="cuda", dtype=torch.bfloat16)
        lengths = torch.randint(30, 301, (n,), device="cuda")
        padded = torch.arange(300, device="cuda") < lengths[:, None]
        holes = padded & (torch.rand(n, 300, device="cuda") > 0.1)
        g = torch.randn(n, n, device="cuda")
        for name, mask in (("none", None), ("padded", padded), ("holes", holes)):
            ref = maxsim_ref(Q.double(), D.double(), d_mask=mask)
            err = relative_error(maxsim(Q, D, d_mask=mask), ref)
            if train:
                Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
                ms = do_bench(lambda: maxsim(Qg, Dg, d_mask=mask).backward(g), warmup=10, rep=50,
                              grad_to_none=[Qg, Dg])
            else:
                with torch.no_grad():
                    ms = bench(lambda: maxsim(Q, D, d_mask=mask))
            print(f"{'train' if train else 'batch'} {n} mask={name:6s} {ms:.4f} ms  err {err:.1e}")


def rerank_tiles() -> None:
    """Forward tiles of two reranking shapes (1 query against 1000 documents, bf16, no_grad)."""
    sweeps = {
        (32, 300): ((32, 64, 128), (2, 4), (2, 3, 4, 5)),
        (128, 1024): ((64, 128), (4, 8), (2, 3, 4)),
    }
    for (lq, ld), (block_ns, warp_counts, stage_counts) in sweeps.items():
        Q = torch.randn(1, lq, 128, device="cuda", dtype=torch.bfloat16)
        D = torch.randn(1000, ld, 128, device="cuda", dtype=torch.bfloat16)
        ref = maxsim_ref(Q.double(), D.double())
        default = fwd_config(Lq=lq, dim=128, Nq=1, per_query_docs=False, elem_bytes=2)
        with torch.no_grad():
            print(f"Lq={lq} Ld={ld} default {default}: {bench(lambda: maxsim(Q, D)):.4f}")
            results = []
            for block_n in block_ns:
                for warps in warp_counts:
                    for stages in stage_counts:
                        cfg = dataclasses.replace(default, block_n=block_n, num_warps=warps,
                                                  num_stages=stages)
                        with forced_configs(fwd=cfg):
                            try:
                                err = relative_error(maxsim(Q, D), ref)
                                ms = bench(lambda: maxsim(Q, D))
                            except Exception as exc:  # noqa: BLE001
                                print(f"  bn={block_n} w={warps} s={stages}: {type(exc).__name__}")
                                continue
                        results.append((ms, block_n, warps, stages, err))
            for ms, block_n, warps, stages, err in sorted(results)[:6]:
                print(f"  bn={block_n:3d} w={warps} s={stages}: {ms:.4f} ms  err {err:.1e}")


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


def memory() -> None:
    """train_colpali (128 x 128 tokens against 128 x 1024, bf16): peak memory above the inputs
    and time of a step, by backward strategy; "unified, one buffer" lifts the chunking."""
    Q = torch.randn(128, 128, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    D = torch.randn(128, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(128, 128, device="cuda")
    saved = _launch._SCATTER_BUFFER_MAX_BYTES
    for name, strategy, limit in (("unified", "unified", saved), ("unified, one buffer", "unified", 1 << 40),
                                  ("lowmem", "lowmem", saved)):
        _launch._SCATTER_BUFFER_MAX_BYTES = limit
        peak, ms = step_peak_and_ms(Q, D, g, strategy)
        print(f"{name:20s} peak {peak:6.1f} MiB  step {ms:.4f} ms")
    _launch._SCATTER_BUFFER_MAX_BYTES = saved
    grads = {s: torch.autograd.grad(maxsim(Q, D, backward=s), (Q, D), g) for s in ("unified", "lowmem")}
    print("unified (chunks) against lowmem: grad_Q %.1e, grad_D %.1e" % tuple(
        relative_error(a, b) for a, b in zip(grads["unified"], grads["lowmem"])))


def training_steps() -> None:
    """Where a training step's time goes, for the suite's training shapes and every installed
    provider: do_bench's median (the suite's timer), the host's time to issue one step (N steps
    issued back to back before one synchronize, divided by N: the GPU never waits for the
    host less than this), the wall time per step, and the GPU's kernel time per step (profiler).
    Ours also lists its kernels."""
    import time

    from torch.profiler import ProfilerActivity, profile

    from fusedmaxsim import benchmarking as bm

    names = ("train_colbert", "train_colbert_masked", "train_colpali", "train_small_batch",
             "train_kd", "train_kd_colpali")
    for name in names:
        shape = bm.SHAPES_BY_NAME[name]
        case = bm.make_case(shape, "training", "cuda")
        for key in ("fusedmaxsim", "lik", "flash"):
            provider = bm.PROVIDERS_BY_KEY[key]
            if bm.provider_unavailable(provider, torch.device("cuda")):
                continue
            step = bm.make_step(provider.build(case), case)
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
    back, no synchronize), the CUDA runtime calls of one step (profiler, CPU side: a
    synchronize, an allocation or a copy shows here), and a cProfile of ours, for shapes whose
    host times differ (train_colbert with and without its document mask, the two kd shapes)."""
    import cProfile
    import io
    import pstats

    from profile_host import wall_us
    from torch.profiler import ProfilerActivity, profile

    from fusedmaxsim import benchmarking as bm

    x = torch.zeros(256, device="cuda")
    Q = torch.randn(32, 32, 128, device="cuda", dtype=torch.bfloat16)
    D = torch.randn(32, 180, 128, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(32, 32, device="cuda")
    _, argmax = _launch.maxsim_fwd(Q, D, None, None, None, None, True, "tf32")
    buf = torch.zeros(4, 180, 128, device="cuda")
    out = torch.empty(32, 180, 128, device="cuda", dtype=torch.bfloat16)
    for label, fn in (
        ("x.zero_() (one torch kernel)", lambda: x.zero_()),
        ("torch.empty 32x180x128 bf16", lambda: torch.empty(32, 180, 128, device="cuda")),
        ("_launch.maxsim_fwd, no argmax", lambda: _launch.maxsim_fwd(Q, D, None, None, None, None, False, "tf32")),
        ("_launch._drain_chunk", lambda: _launch._drain_chunk(buf, out, 0, 4)),
        ("_launch.maxsim_bwd lowmem (2 kernels)",
         lambda: _launch.maxsim_bwd(g, Q, D, argmax, None, None, True, True, "lowmem", False, "tf32")),
    ):
        print(f"  issue {wall_us(fn, issue_only=True):7.1f} us  {label}", flush=True)

    for name in ("train_colbert", "train_colbert_masked", "train_kd", "train_kd_colpali", "train_colpali"):
        case = bm.make_case(bm.SHAPES_BY_NAME[name], "training", "cuda")
        step = bm.make_step(bm.PROVIDERS_BY_KEY["fusedmaxsim"].build(case), case)
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
    src = str(Path(__file__).resolve().parents[1] / "src")
    for how in ("split", "step"):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TRITON_CACHE_DIR=cache)
            print(how)
            run = subprocess.run([sys.executable, "-c", _COLD_CHILD, src, how], env=env,
                                 capture_output=True, text=True, timeout=120)
            print(run.stdout + run.stderr[-2000:])


def small_tiles() -> None:
    """The forward of one 32-token query per program, the default tiles against the former
    (64-token tiles, 4 warps, 3 stages): reranking and per-query candidates, bf16, no_grad."""
    old = FwdConfig(32, 1, 64, 128, 4, 3)
    for name, q_shape, d_shape in (("rerank_colbert", (1, 32, 128), (1000, 300, 128)),
                                   ("kd 64x32", (64, 32, 128), (64, 32, 300, 128)),
                                   ("kd_colpali 32x16", (32, 32, 128), (32, 16, 1030, 128))):
        Q = torch.randn(q_shape, device="cuda", dtype=torch.bfloat16)
        D = torch.randn(d_shape, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            new_ms = bench(lambda: maxsim(Q, D))
            with forced_configs(fwd=old):
                old_ms = bench(lambda: maxsim(Q, D))
        print(f"{name:18s} default {new_ms:.4f} ms, former tiles {old_ms:.4f} ms")


def gather_stages() -> None:
    """The unified backward (gather kernel only) with 1 and 2 pipeline stages."""
    for name, nq, lq, nd, ld in (("train_colbert", 128, 32, 128, 300), ("train_colpali", 128, 128, 128, 1024)):
        Q = torch.randn(nq, lq, 128, device="cuda", dtype=torch.bfloat16)
        D = torch.randn(nd, ld, 128, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(nq, nd, device="cuda")
        _, argmax = _launch.maxsim_fwd(Q, D, None, None, None, None, True, "tf32")
        base = bwd_config(Lq=lq, dim=128, elem_bytes=2)
        row = name
        for stages in (1, 2):
            with forced_configs(bwd=dataclasses.replace(base, num_stages=stages)):
                ms = bench(lambda: _launch.maxsim_bwd(g, Q, D, argmax, None, None, True, True, "unified", False, "tf32"))
            row += f" | stages {stages}: {ms:.4f} ms"
        print(row)


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
    src = str(Path(__file__).resolve().parents[1] / "src")
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        run = subprocess.run([sys.executable, "-c", _COLD_PROFILE, src], env=env,
                             capture_output=True, text=True, timeout=120)
        print(run.stdout[-9000:] + run.stderr[-2000:])


def _forward_shapes():
    """Forward-bound rows of the suite, and small grids of long documents:
    (name, Q, D, d_mask, save_argmax, normalize), bf16."""
    lengths = torch.randint(30, 301, (256,), device="cuda")
    padded = torch.arange(300, device="cuda") < lengths[:, None]
    return (
        ("train_colpali fwd", _bf16(128, 128, 128), _bf16(128, 1024, 128), None, True, False),
        ("train_colbert fwd", _bf16(128, 32, 128), _bf16(128, 300, 128), None, True, False),
        ("batch_colbert", _bf16(256, 32, 128), _bf16(256, 300, 128), None, False, False),
        ("batch_colbert_masked", _bf16(256, 32, 128), _bf16(256, 300, 128), padded, False, False),
        ("rerank_colpali_1030", _bf16(1, 1030, 128), _bf16(1000, 1030, 128), None, False, False),
        ("rerank_colpali", _bf16(1, 128, 128), _bf16(1000, 1024, 128), None, False, False),
        ("rerank_colpali_norm", _bf16(1, 128, 128), _bf16(1000, 1024, 128), None, False, True),
        ("longquery", _bf16(4, 2048, 128), _bf16(64, 1024, 128), None, False, False),
        ("longdoc", _bf16(16, 32, 128), _bf16(32, 8192, 128), None, False, False),
        ("kd_colpali fwd", _bf16(32, 32, 128), _bf16(32, 16, 1030, 128), None, True, False),
        ("small grid: 1x32 vs 100x8192", _bf16(1, 32, 128), _bf16(100, 8192, 128), None, False, False),
        ("small grid: 1x128 vs 64x4096", _bf16(1, 128, 128), _bf16(64, 4096, 128), None, False, False),
        ("small grid: 8x32 vs 64x2048", _bf16(8, 32, 128), _bf16(64, 2048, 128), None, False, False),
        ("small grid: 4x128 vs 32x4096 train", _bf16(4, 128, 128), _bf16(32, 4096, 128), None, True, False),
        ("mid grid: 16x32 vs 256x2048", _bf16(16, 32, 128), _bf16(256, 2048, 128), None, False, False),
    )


def _doubled_rows(base: FwdConfig, Nq: int, Lq: int, per_query_docs: bool) -> FwdConfig | None:
    """``base`` with 256 rows a block instead of 128 (a longer query chunk, or twice the packed
    queries), or None where the shape has no second 128 rows to give."""
    if base.lq_tile * base.queries_per_block != 128:
        return None
    if base.lq_tile == 128 and Lq >= 256:
        return dataclasses.replace(base, lq_tile=256)
    if not per_query_docs and Nq >= 2 * base.queries_per_block:
        return dataclasses.replace(base, queries_per_block=2 * base.queries_per_block)
    return None


def _tile_variants(base: FwdConfig, Nq: int, Lq: int, per_query_docs: bool) -> list:
    """The default tiles, and variants that keep the slot accumulators out of local memory:
    32-token document tiles (4 or 8 warps, 8 warps capped at 128 registers so that two programs
    share an SM), and 256-row query blocks (two warp groups sharing each document tile)."""
    variants = [base]
    for block_n, warps, stages, regs in ((32, 4, 3, None), (32, 4, 4, None), (32, 8, 3, 128),
                                         (32, 8, 4, 128), (64, 8, 3, None), (64, 8, 4, None),
                                         (64, 8, 2, 128), (32, 8, 3, None)):
        variants.append(dataclasses.replace(base, block_n=block_n, num_warps=warps,
                                            num_stages=stages, max_registers=regs))
    doubled = _doubled_rows(base, Nq, Lq, per_query_docs)
    if doubled is not None:
        for stages in (3, 4):
            variants.append(dataclasses.replace(doubled, block_n=32, num_warps=8,
                                                num_stages=stages, max_registers=None))
    return variants


def _query_register_variants(chosen: FwdConfig, Nq: int, Lq: int, per_query_docs: bool) -> list:
    """The tiles the library chooses, and the query tile in registers under those tiles and
    under the spill-free 8- and 4-warp tiles (registers per ``benchmarks/compile_report.py``)."""
    variants = [chosen, dataclasses.replace(chosen, query_in_registers=True)]
    for block_n, warps, stages, regs in ((64, 8, 3, None), (64, 8, 4, None), (32, 8, 4, None),
                                         (32, 8, 4, 128), (32, 4, 3, None)):
        variants.append(dataclasses.replace(chosen, block_n=block_n, num_warps=warps,
                                            num_stages=stages, max_registers=regs,
                                            query_in_registers=True))
    return list(dict.fromkeys(variants))


def _wide_row_variants(chosen: FwdConfig, Nq: int, Lq: int, per_query_docs: bool) -> list:
    """The tiles the library chooses, and 256-row blocks (each document tile shared by twice the
    rows) with 32-token tiles and the query tile in registers, at 8 and 16 warps."""
    variants = [chosen]
    doubled = _doubled_rows(chosen, Nq, Lq, per_query_docs)
    if doubled is not None:
        for warps, stages in ((8, 3), (8, 4), (16, 3), (16, 4)):
            variants.append(dataclasses.replace(doubled, block_n=32, num_warps=warps,
                                                num_stages=stages, max_registers=None,
                                                query_in_registers=True))
    return variants


def wide_rows() -> None:
    """256-row query blocks with the query tile in registers (benchmarks/NOTES.md section 23),
    against the tiles the library chooses; checked and timed as ``forward_tiles`` does."""
    forward_tiles(_wide_row_variants, chosen=True)


def query_registers() -> None:
    """The query tile in registers for the Hopper products (benchmarks/NOTES.md section 22),
    against the tiles the library chooses; checked and timed as ``forward_tiles`` does."""
    forward_tiles(_query_register_variants, chosen=True)


def forward_tiles(variants=None, chosen: bool = False) -> None:
    """Forward tiles against the default on the forward-bound rows (GPU time, ms), each checked
    first: scores within 1e-6 of the default's, the same argmax; the default against float64 on
    a slice of the queries. ``chosen``: the reference is the tiles the library picks on this GPU
    (its measured variants included), not the heuristic's default."""
    variants = variants or _tile_variants
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    for name, Q, D, d_mask, save_argmax, normalize in _forward_shapes():
        per_query_docs = D.dim() == 4
        Nq, Lq = Q.shape[0], Q.shape[1]
        extra = {}
        if chosen:
            extra = {"save_argmax": save_argmax, "norm_from_tiles": normalize,
                     "n_cols": D.shape[-3], "sm_count": sm_count}
        base = fwd_config(Lq=Lq, dim=128, Nq=Nq, per_query_docs=per_query_docs, elem_bytes=2,
                          **extra)

        def run():
            return _launch.maxsim_fwd(Q, D, None, d_mask, None, None, save_argmax, "tf32",
                                      norm_from_tiles=normalize)

        with forced_configs(fwd=base):
            want_scores, want_arg = run()
        n = min(Nq, 4)
        ref = maxsim_ref(Q[:n].double(), (D[:n] if per_query_docs else D[:64]).double(),
                         d_mask=None if d_mask is None else d_mask[:64], normalize=normalize)
        got = want_scores[:n] if per_query_docs else want_scores[:n, :64]
        programs = D.shape[-3] * -(-Nq // base.queries_per_block)
        print(f"-- {name}: {programs} programs, default {base}, error against float64 "
              f"{relative_error(got, ref):.1e}")
        for cfg in variants(base, Nq, Lq, per_query_docs):
            label = (f"rows {cfg.lq_tile}x{cfg.queries_per_block} bn {cfg.block_n} w {cfg.num_warps} "
                     f"s {cfg.num_stages} regs {cfg.max_registers} q-in-regs {cfg.query_in_registers:d}")
            compiled = _launch.launcher(_maxsim_fwd_kernel).compiled
            known = set(compiled)
            with forced_configs(fwd=cfg):
                try:
                    scores, arg = run()
                    run()  # the second call goes through the cache, which now holds the kernel
                    err = relative_error(scores, want_scores)
                    same_arg = bool(torch.equal(arg, want_arg))
                    ms = bench(run)
                except Exception as exc:  # noqa: BLE001
                    print(f"  {label}: {type(exc).__name__}: {str(exc)[:80]}")
                    continue
            for key in set(compiled) - known:
                kernel = compiled[key]
                label += f" [{kernel.n_regs} registers, {kernel.n_spills} B spilled]"
            verdict = "" if err < 1e-6 and same_arg else "  PARITY FAILED"
            print(f"  {label}: {ms:.4f} ms  (vs default {err:.0e}, argmax same {same_arg}){verdict}",
                  flush=True)


def launch_paths() -> None:
    """The host's side of the smallest rows, every provider in one process: issue time (calls
    back to back, no synchronize), wall time and do_bench for ours with the cached launch, ours
    through Triton's own launch path (FUSEDMAXSIM_TRITON_FAST_LAUNCH=0), and the peers."""
    from profile_host import wall_us

    from fusedmaxsim import benchmarking as bm

    def ours_with_triton_launch(build):
        def built(case):
            os.environ["FUSEDMAXSIM_TRITON_FAST_LAUNCH"] = "0"
            _launch._launchers.clear()
            return build(case)
        return built

    for name, mode in (("rerank_colbert", "inference"), ("small_batch", "inference"),
                       ("train_small_batch", "training"), ("train_colbert", "training")):
        case = bm.make_case(bm.SHAPES_BY_NAME[name], mode, "cuda")
        print(f"-- {name}")
        for key in ("fusedmaxsim", "fusedmaxsim-triton-launch", "lik", "flash", "naive"):
            provider = bm.PROVIDERS_BY_KEY.get(key.split("-")[0])
            if bm.provider_unavailable(provider, torch.device("cuda")):
                continue
            build = ours_with_triton_launch(provider.build) if key.endswith("launch") else provider.build
            step = bm.make_step(build(case), case)
            grads = [case.Q, case.D] if case.training else None

            def call():
                if grads:
                    case.reset_grads()
                step()
            issue = wall_us(call, issue_only=True)
            wall = wall_us(call)
            ms = do_bench(step, warmup=25, rep=100, grad_to_none=grads)
            print(f"  {key:26s} issue {issue:6.1f} us  wall {wall:6.1f} us  do_bench {ms:.4f} ms",
                  flush=True)
            os.environ.pop("FUSEDMAXSIM_TRITON_FAST_LAUNCH", None)
            _launch._launchers.clear()
        del case


def query_chunks() -> None:
    """Query chunk height for queries just past a multiple of 128 rows (1030 tokens: nine
    128-row chunks hold 1152 rows, 12% of them padding; seventeen 64-row chunks hold 1088)."""
    Q = torch.randn(1, 1030, 128, device="cuda", dtype=torch.bfloat16)
    D = torch.randn(1000, 1030, 128, device="cuda", dtype=torch.bfloat16)
    base = fwd_config(Lq=1030, dim=128, Nq=1, per_query_docs=False, elem_bytes=2)

    def run():
        return _launch.maxsim_fwd(Q, D, None, None, None, None, False, "tf32")

    with forced_configs(fwd=base):
        want = run()[0]
    print(f"default {base}")
    for lq_tile, block_n, warps, stages in ((128, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 4),
                                            (64, 128, 4, 3), (64, 64, 8, 3), (64, 32, 4, 4)):
        cfg = dataclasses.replace(base, lq_tile=lq_tile, block_n=block_n, num_warps=warps,
                                  num_stages=stages)
        with forced_configs(fwd=cfg):
            try:
                err = relative_error(run()[0], want)
                ms = bench(run)
            except Exception as exc:  # noqa: BLE001
                print(f"  rows {lq_tile} bn {block_n} w {warps} s {stages}: {type(exc).__name__}")
                continue
        print(f"  rows {lq_tile} bn {block_n} w {warps} s {stages}: {ms:.4f} ms  (vs default {err:.0e})",
              flush=True)


def graph_times() -> None:
    """The small inference rows' GPU time without the host: each provider's call captured in a
    CUDA graph and replayed (do_bench on the replay, L2 cleared as in the suite), next to
    do_bench of the eager call and the host's issue time; separates a slower kernel from a
    longer launch path."""
    from profile_host import wall_us

    from fusedmaxsim import benchmarking as bm

    for name in ("rerank_colbert", "small_batch", "rerank_colpali"):
        case = bm.make_case(bm.SHAPES_BY_NAME[name], "inference", "cuda")
        print(f"-- {name}")
        steps = {}
        for key in ("fusedmaxsim", "fusedmaxsim, general path", "fusedmaxsim, Triton forward",
                    "lik", "flash", "naive"):
            provider = bm.PROVIDERS_BY_KEY.get(key.split(",")[0])
            if bm.provider_unavailable(provider, torch.device("cuda")):
                continue
            if key.endswith("general path"):  # section 39: maxsim's layers, without the shortcut
                def general(case=case):
                    return maxsim(case.Q, case.D, backward="auto",
                                  normalize=case.shape.normalize)

                step = bm.make_step(general, case)
            else:
                step = bm.make_step(provider.build(case), case)
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
                replay = f"{do_bench(_captured(step).replay, warmup=25, rep=100):.4f} ms"
            except Exception as exc:  # noqa: BLE001
                replay = f"not capturable ({type(exc).__name__})"
            rounds = " / ".join(f"{v:.1f}" for v in issues[key])
            print(f"  {key:28s} eager {eager:.4f} ms  graph replay {replay}  issue {issue:6.1f} us"
                  f" ({rounds})", flush=True)


def _captured(step) -> torch.cuda.CUDAGraph:
    """``step`` run once (compiling what it needs), then captured in a CUDA graph."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def _without_gluon(fn):
    """``fn`` with the Gluon forward off while it runs (the Triton forward's call)."""
    def call():
        saved = _launch.HOPPER_KERNEL
        _launch.HOPPER_KERNEL = False
        try:
            return fn()
        finally:
            _launch.HOPPER_KERNEL = saved

    return call



def winner_index() -> None:
    """The document-owned grad_D through the winner index (benchmarks/NOTES.md section 25) against
    the unified backward: GPU ms of each backward and of its parts, the indexed grad_D's tiles,
    agreement with unified's gradients (same argmax), bitwise reproducibility, and whole steps
    with their peak memory above the inputs."""
    shapes = (("train_small_batch", 32, 32, 32, 180), ("train_colbert", 128, 32, 128, 300),
              ("train_colpali", 128, 128, 128, 1024), ("colpali 256 x 256", 256, 128, 256, 1024),
              ("colbert 512 x 512", 512, 32, 512, 300))
    for name, nq, lq, nd, ld in shapes:
        Q = torch.randn(nq, lq, 128, device="cuda", dtype=torch.bfloat16)
        D = torch.randn(nd, ld, 128, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(nq, nd, device="cuda")
        _, argmax = _launch.maxsim_fwd(Q, D, None, None, None, None, True, "tf32")

        def bwd(strategy, need_q=True, need_d=True):
            return _launch.maxsim_bwd(g, Q, D, argmax, None, None, need_q, need_d, strategy, False, "tf32")

        unified, lowmem = bwd("unified"), bwd("lowmem")
        errors = [relative_error(a.float(), b.float()) for a, b in zip(lowmem, unified)]
        same = all(torch.equal(a, b) for a, b in zip(lowmem, bwd("lowmem")))
        print(f"-- {name}: lowmem against unified grad_Q {errors[0]:.1e} grad_D {errors[1]:.1e}, "
              f"lowmem bitwise repeatable: {same}", flush=True)
        row = "   backward ms:"
        for label, fn in (("unified", lambda: bwd("unified")), ("lowmem", lambda: bwd("lowmem")),
                          ("unified grad_Q", lambda: bwd("unified", need_d=False)),
                          ("lowmem grad_Q", lambda: bwd("lowmem", need_d=False)),
                          ("unified grad_D", lambda: bwd("unified", need_q=False)),
                          ("lowmem grad_D", lambda: bwd("lowmem", need_q=False))):
            row += f" {label} {bench(fn):.4f} |"
        base = bwd_config(Lq=lq, dim=128, elem_bytes=2)
        buffers = _launch._winner_index_buffers(Q, nd, -(-ld // base.block_t))
        row += f" index alone {bench(lambda: _launch._winner_index(argmax, 0, nd, base.block_t, buffers)):.4f}"
        print(row, flush=True)
        row = "   indexed grad_D tiles (block_t, block_r):"
        for block_t in (16, 32, 64):
            for block_r in (32, 64, 128):
                with forced_configs(bwd=dataclasses.replace(base, block_t=block_t, block_r=block_r)):
                    row += f" {block_t}x{block_r} {bench(lambda: bwd('lowmem', need_q=False)):.4f}"
        saved = _launch._index_constants
        row_index = "   index variants (scan entries, stages):"
        for scan, stages in ((1024, 1), (1024, 2), (1024, 3), (4096, 1), (4096, 3), (256, 2)):
            _launch._index_constants = lambda bt, st, scan=scan, stages=stages, tiles=1: saved(bt, st, scan, stages, tiles)
            row_index += f" {scan}/{stages} {bench(lambda: _launch._winner_index(argmax, 0, nd, base.block_t, buffers)):.4f}"
        _launch._index_constants = saved
        print(row_index, flush=True)
        for warps, stages in ((4, 1), (4, 3), (8, 2)):
            with forced_configs(bwd=dataclasses.replace(base, num_warps=warps, num_stages=stages)):
                row += f" | {warps}w{stages}s {bench(lambda: bwd('lowmem', need_q=False)):.4f}"
        print(row, flush=True)
        Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
        for strategy in ("unified", "lowmem"):
            peak, ms = step_peak_and_ms(Qg, Dg, g, strategy)
            print(f"   step {strategy:8s} {ms:.4f} ms, peak {peak:6.1f} MiB above the inputs", flush=True)
        del Q, D, Qg, Dg, argmax, buffers, unified, lowmem
        torch.cuda.empty_cache()

def chunk_splits_ab() -> None:
    """Query chunks split over neighbouring programs (benchmarks/NOTES.md section 29) against one
    program walking every chunk of its (document, query block): GPU ms of the forward (the partial
    scores' sum included), scores and argmax compared."""
    shapes = (
        ("rerank_colpali_1030", _bf16(1, 1030, 128), _bf16(1000, 1030, 128), False),
        ("longquery", _bf16(4, 2048, 128), _bf16(64, 1024, 128), False),
        ("1 x 512 against 1000 x 1024", _bf16(1, 512, 128), _bf16(1000, 1024, 128), False),
        ("1 x 1030 against 16 x 1030", _bf16(1, 1030, 128), _bf16(16, 1030, 128), False),
        ("training fwd 16 x 1030 against 64 x 1030", _bf16(16, 1030, 128), _bf16(64, 1030, 128), True),
        ("kd fwd 8 x 300 against 8 x 32 x 1030", _bf16(8, 300, 128), _bf16(8, 32, 1030, 128), True),
    )
    props = torch.cuda.get_device_properties(0)
    print(f"  L2 {props.L2_cache_size / 2**20:.0f} MiB, {props.multi_processor_count} SMs", flush=True)
    policy = _launch.chunk_splits  # forced both ways here, whatever it would choose
    for name, Q, D, save_argmax in shapes:
        def run():
            return _launch.maxsim_fwd(Q, D, None, None, None, None, save_argmax, "tf32")

        cfg = fwd_config(Lq=Q.shape[1], dim=128, Nq=Q.shape[0], per_query_docs=D.dim() == 4,
                         elem_bytes=2)
        splits = -(-Q.shape[1] // cfg.lq_tile)  # every chunk its own program
        try:
            _launch.chunk_splits = lambda *args, s=splits: s
            split_scores, split_arg = run()
            split_ms = bench(run)
            _launch.chunk_splits = lambda *args: 1
            one_scores, one_arg = run()
            one_ms = bench(run)
        finally:
            _launch.chunk_splits = policy
        err = relative_error(split_scores, one_scores)
        same = bool(torch.equal(split_arg, one_arg))
        verdict = "" if err < 1e-6 and same else "  PARITY FAILED"
        print(f"  {name}: {splits} splits {split_ms:.4f} ms, one program {one_ms:.4f} ms "
              f"(scores {err:.0e} apart, argmax same {same}){verdict}", flush=True)
        del Q, D
        torch.cuda.empty_cache()


def _occupancy_variants(chosen: FwdConfig, Nq: int, Lq: int, per_query_docs: bool) -> list:
    """The tiles the library chooses, and the same 4-warp tiles capped at 168 and 128 registers
    (three and four programs an SM where shared memory allows), with and without the query tile
    in registers (benchmarks/NOTES.md section 29: two warps a scheduler, none eligible 55-75% of
    cycles)."""
    variants = [chosen]
    if chosen.num_warps != 4:
        return variants
    for regs in (168, 128):
        for in_registers in (chosen.query_in_registers, not chosen.query_in_registers):
            variants.append(dataclasses.replace(chosen, max_registers=regs,
                                                query_in_registers=in_registers))
    return list(dict.fromkeys(variants))


def occupancy() -> None:
    """More programs an SM through a register cap (benchmarks/NOTES.md section 29), against the
    tiles the library chooses; checked and timed as ``forward_tiles`` does."""
    forward_tiles(_occupancy_variants, chosen=True)


def _on_triton(fn):
    """``fn()``'s result and GPU ms with the Gluon forward turned off (the Triton kernel's)."""
    saved = _launch.HOPPER_KERNEL
    _launch.HOPPER_KERNEL = False
    try:
        return fn(), bench(fn)
    finally:
        _launch.HOPPER_KERNEL = saved


def hopper_forward() -> None:
    """The Gluon forward (``_kernels_hopper``: each tile's product overlapping the previous
    tile's max; benchmarks/NOTES.md section 30) against the Triton forward: scores compared,
    GPU ms of each (the Gluon one under two stage counts), and what ``maxsim`` runs."""
    shapes = (
        ("batch_colbert", _bf16(256, 32, 128), _bf16(256, 300, 128)),
        ("rerank_colpali", _bf16(1, 128, 128), _bf16(1000, 1024, 128)),
        ("rerank_colpali_1030", _bf16(1, 1030, 128), _bf16(1000, 1030, 128)),
        ("longquery", _bf16(4, 2048, 128), _bf16(64, 1024, 128)),
        ("train_colpali's shape, no_grad", _bf16(128, 128, 128), _bf16(128, 1024, 128)),
        ("train_colbert's shape, no_grad", _bf16(128, 32, 128), _bf16(128, 300, 128)),
        ("d = 64: 64 x 32 against 512 x 300", _bf16(64, 32, 64), _bf16(512, 300, 64)),
    )
    saved = _launch._HOPPER_TILES, _launch._HOPPER_PACKED_TILES
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    for name, Q, D in shapes:
        Nq, Lq, dim = Q.shape
        cfg = fwd_config(Lq=Lq, dim=dim, Nq=Nq, per_query_docs=False, elem_bytes=2,
                         n_cols=D.shape[0], sm_count=sm_count)
        if not _launch.hopper_forward_applies(cfg, Q, D):
            print(f"-- {name}: the Gluon forward does not apply ({cfg})", flush=True)
            continue

        def library():
            with torch.no_grad():
                return maxsim(Q, D)

        want, triton_ms = _on_triton(library)
        row = f"-- {name}: Triton {triton_ms:.4f} ms"
        for stages in (4, 3):
            _launch._HOPPER_TILES = _launch._HOPPER_PACKED_TILES = (64, stages, 4, None)
            scores = torch.full_like(want, float("nan"))
            try:
                _launch.launch_fwd_hopper(cfg, Q, D, scores)
                err = relative_error(scores, want)
                ms = bench(lambda: _launch.launch_fwd_hopper(cfg, Q, D, scores))
            except Exception as exc:  # noqa: BLE001
                row += f" | Gluon {stages} stages: {type(exc).__name__}: {str(exc)[:200]}"
                continue
            finally:
                _launch._HOPPER_TILES, _launch._HOPPER_PACKED_TILES = saved
            row += f" | Gluon {stages} stages {ms:.4f} ms ({err:.0e} from Triton's)"
            row += "" if err < 1e-5 else " PARITY FAILED"
        got = library()
        row += f" | maxsim {bench(library):.4f} ms ({relative_error(got, want):.0e})"
        print(row, flush=True)
        del Q, D
        torch.cuda.empty_cache()


def hopper_host() -> None:
    """The host's side of the Gluon forward at rerank_colpali's shape (benchmarks/NOTES.md
    section 30): issue time of calls back to back (no synchronize), µs, for its parts."""
    from profile_host import wall_us
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    Q = torch.randn(1, 128, 128, device="cuda", dtype=torch.bfloat16)
    D = torch.randn(1000, 1024, 128, device="cuda", dtype=torch.bfloat16)
    scores = torch.empty(1, 1000, device="cuda")
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = fwd_config(Lq=128, dim=128, Nq=1, per_query_docs=False, elem_bytes=2, n_cols=1000,
                     sm_count=sm_count)
    layouts = _launch.hopper_layouts(Q.dtype, 128, _launch._HOPPER_TILES[0], 128)
    flat = D.view(-1, 128)

    def library():
        with torch.no_grad():
            maxsim(Q, D)

    def triton_library():
        _launch.HOPPER_KERNEL = False
        try:
            library()
        finally:
            _launch.HOPPER_KERNEL = True

    rows = (
        ("maxsim, Gluon forward", library),
        ("maxsim, Triton forward", triton_library),
        ("launch_fwd_hopper alone", lambda: _launch.launch_fwd_hopper(cfg, Q, D, scores)),
        ("_launch.maxsim_fwd, Triton", lambda: _launch._launch_fwd(
            cfg, Q, D, None, None, None, None, scores, scores, False, "tf32", False, 0.0)),
        ("TensorDescriptor(...) alone", lambda: TensorDescriptor(
            flat, list(flat.shape), list(flat.stride()), [_launch._HOPPER_TILES[0], 128], layouts[1])),
        ("hopper_forward_applies alone", lambda: _launch.hopper_forward_applies(cfg, Q, D)),
    )
    for label, fn in rows:
        print(f"  {label:32s} issue {wall_us(fn, 400, issue_only=True):7.1f} us", flush=True)
    _hopper_host_parts(Q, D, cfg, library, triton_library)


def _hopper_host_parts(Q, D, cfg, library, triton_library) -> None:
    """Where the Gluon launch's host time goes (benchmarks/NOTES.md section 32): Triton's
    expansion of the TMA descriptor alone, the launch with that expansion memoized (a probe-only
    patch of Triton's driver module), and a cProfile of each forward's calls."""
    import cProfile
    import pstats

    from profile_host import wall_us
    from triton.backends.nvidia import driver as nvidia_driver

    scores = torch.empty(1, D.shape[0], device="cuda")
    kernel = _launch.launcher(_launch._kernels_hopper._maxsim_fwd_overlap_kernel)
    _launch.launch_fwd_hopper(cfg, Q, D, scores)
    compiled = next(iter(kernel.compiled.values()))
    meta = getattr(compiled.metadata, "tensordesc_meta", None)
    print(f"  tensordesc_meta: {meta}", flush=True)
    expand = nvidia_driver.make_tensordesc_arg
    arity = expand.__code__.co_argcount
    captured = []

    def capture(arg, *rest):
        captured.append(arg)
        return expand(arg, *rest)

    nvidia_driver.make_tensordesc_arg = capture
    try:
        _launch.launch_fwd_hopper(cfg, Q, D, scores)
    finally:
        nvidia_driver.make_tensordesc_arg = expand
    desc = captured[0]
    extra = (None,) * (arity - 2)
    print(f"  make_tensordesc_arg alone        issue "
          f"{wall_us(lambda: expand(desc, meta[0] if meta else None, *extra), 400, issue_only=True):7.1f} us",
          flush=True)
    memo: dict = {}

    def memoized(arg, *rest):
        key = (arg.base.data_ptr(), tuple(arg.shape), tuple(arg.strides), tuple(arg.block_shape))
        found = memo.get(key)
        if found is None:
            found = memo[key] = expand(arg, *rest)
        return found

    nvidia_driver.make_tensordesc_arg = memoized
    try:
        got = torch.full_like(scores, float("nan"))
        _launch.launch_fwd_hopper(cfg, Q, D, got)
        _launch.launch_fwd_hopper(cfg, Q, D, scores)
        torch.cuda.synchronize()
        print(f"  (memoized launch: scores {relative_error(got, scores):.0e} apart)")
        for label, fn in (("launch_fwd_hopper, memoized", lambda: _launch.launch_fwd_hopper(cfg, Q, D, scores)),
                          ("maxsim, Gluon, memoized", library)):
            print(f"  {label:32s} issue {wall_us(fn, 400, issue_only=True):7.1f} us", flush=True)
    finally:
        nvidia_driver.make_tensordesc_arg = expand
    for label, fn in (("Gluon", library), ("Triton", triton_library)):
        profiler = cProfile.Profile()
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        profiler.enable()
        for _ in range(2000):
            fn()
        profiler.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(22)
        print(f"  -- cProfile, maxsim with the {label} forward, 2000 calls", flush=True)
        print("\n".join("    " + line for line in text.getvalue().splitlines()[6:]), flush=True)


def short_query() -> None:
    """rerank_colbert (one 32-token query against 1000 and 10000 documents of 300 tokens, bf16;
    benchmarks/NOTES.md section 32): the Triton kernel as dispatched (a 32-row tile, mma.sync),
    the same kernel with a 64-row block half empty (the Hopper warp-group product), and the
    Gluon forward with 64- and 128-row blocks; scores against float64, GPU ms each."""
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    saved = _launch._HOPPER_PACKED_TILES
    for n_docs in (1000, 10000):
        Q, D = _bf16(1, 32, 128), _bf16(n_docs, 300, 128)
        ref = maxsim_ref(Q.double(), D.double()).float()

        def forward():
            return _launch.maxsim_fwd(Q, D, None, None, None, None, False, "tf32")[0]

        base = fwd_config(Lq=32, dim=128, Nq=1, per_query_docs=False, elem_bytes=2, n_cols=n_docs,
                          sm_count=sm_count)
        print(f"-- 1 x 32 tokens against {n_docs} x 300: as dispatched ({base}) "
              f"{bench(forward):.4f} ms, {relative_error(forward(), ref):.0e} from float64", flush=True)
        for qpb, block_n, warps, stages in ((2, 64, 4, 3), (2, 64, 4, 4), (2, 128, 4, 3),
                                            (2, 64, 8, 3), (1, 64, 2, 4), (1, 128, 4, 3)):
            cfg = FwdConfig(32, qpb, block_n, 128, warps, stages)
            with forced_configs(fwd=cfg):
                try:
                    err = relative_error(forward(), ref)
                    ms = bench(forward)
                    print(f"   Triton {cfg.lq_tile * qpb}-row block, bn={block_n} w={warps} s={stages}: "
                          f"{ms:.4f} ms, {err:.0e}", flush=True)
                except Exception as exc:  # noqa: BLE001
                    print(f"   Triton {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        for qpb in (2, 4):
            cfg = dataclasses.replace(base, queries_per_block=qpb)
            if not _launch.hopper_forward_applies(cfg, Q, D):
                print(f"   Gluon {cfg}: does not apply", flush=True)
                continue
            for tiles in ((64, 3, 4, None), (64, 4, 4, None), (64, 6, 4, None), (32, 6, 4, None),
                          (128, 2, 4, None)):
                _launch._HOPPER_PACKED_TILES = tiles
                try:
                    scores = torch.full((1, n_docs), float("nan"), device="cuda")
                    _launch.launch_fwd_hopper(cfg, Q, D, scores)
                    err = relative_error(scores, ref)
                    ms = bench(lambda: _launch.launch_fwd_hopper(cfg, Q, D, scores))
                    print(f"   Gluon {32 * qpb}-row block, tiles {tiles}: {ms:.4f} ms, {err:.0e}",
                          flush=True)
                except Exception as exc:  # noqa: BLE001
                    print(f"   Gluon {qpb} {tiles}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                finally:
                    _launch._HOPPER_PACKED_TILES = saved
        del Q, D
        torch.cuda.empty_cache()


def hopper_variants() -> None:
    """The Gluon forward, plain and normalizing (benchmarks/NOTES.md section 31), against the
    Triton forward of the same call: scores compared, GPU ms of each under several document
    tiles, stages and warps, and what ``maxsim_fwd`` runs. (Record ``2026-12-01_6a7deb9`` has
    the argmax variant too, since dropped.)"""
    shapes = (
        ("batch_colbert", False, _bf16(256, 32, 128), _bf16(256, 300, 128)),
        ("rerank_colpali", False, _bf16(1, 128, 128), _bf16(1000, 1024, 128)),
        ("longquery", False, _bf16(4, 2048, 128), _bf16(64, 1024, 128)),
        ("train_colpali's shape, scores", False, _bf16(128, 128, 128), _bf16(128, 1024, 128)),
        ("rerank_colpali_norm", True, _bf16(1, 128, 128), _bf16(1000, 1024, 128)),
        ("rerank_colpali_1030, normalize", True, _bf16(1, 1030, 128), _bf16(1000, 1030, 128)),
        ("batch_colbert, normalize", True, _bf16(256, 32, 128), _bf16(256, 300, 128)),
        ("longquery, normalize", True, _bf16(4, 2048, 128), _bf16(64, 1024, 128)),
    )
    saved = _launch._HOPPER_TILES, _launch._HOPPER_NORM_TILES, _launch._HOPPER_PACKED_TILES
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    for name, normalize, Q, D in shapes:
        Nq, Lq, dim = Q.shape

        def forward():
            return _launch.maxsim_fwd(Q, D, None, None, None, None, False, "tf32", normalize)[0]

        cfg = fwd_config(Lq=Lq, dim=dim, Nq=Nq, per_query_docs=False, elem_bytes=2,
                         norm_from_tiles=normalize, n_cols=D.shape[0], sm_count=sm_count)
        if not _launch.hopper_forward_applies(cfg, Q, D):
            print(f"-- {name}: the Gluon forward does not apply ({cfg})", flush=True)
            continue
        want, triton_ms = _on_triton(forward)
        step_docs = max(1, (1 << 30) // (Nq * Lq * D.shape[1]))  # float64 grids of 8 GiB at most
        ref = torch.cat([maxsim_ref(Q.double(), D[j:j + step_docs].double(), normalize=normalize)
                         for j in range(0, D.shape[0], step_docs)], dim=1)
        row = f"-- {name}: Triton {triton_ms:.4f} ms ({relative_error(want, ref):.0e} from float64)"
        for tiles in ((64, 4, 4, None), (64, 3, 4, None), (64, 5, 4, None), (32, 6, 4, None)):
            block_n, stages, warps, _ = tiles
            scores = torch.full_like(want, float("nan"))
            _launch._HOPPER_TILES = _launch._HOPPER_NORM_TILES = tiles
            _launch._HOPPER_PACKED_TILES = tiles
            try:
                _launch.launch_fwd_hopper(cfg, Q, D, scores, normalize)
                err = relative_error(scores, want)
                ms = bench(lambda: _launch.launch_fwd_hopper(cfg, Q, D, scores, normalize))
            except Exception as exc:  # noqa: BLE001
                row += f"\n   Gluon {tiles}: {type(exc).__name__}: {str(exc)[:300]}"
                continue
            finally:
                (_launch._HOPPER_TILES, _launch._HOPPER_NORM_TILES,
                 _launch._HOPPER_PACKED_TILES) = saved
            row += (f"\n   Gluon {block_n}-token tiles, {stages} stages, {warps} warps: {ms:.4f} ms, "
                    f"scores {err:.0e} from Triton's")
            row += "" if err < 1e-5 else " PARITY FAILED"
        got = forward()
        row += f"\n   maxsim_fwd as dispatched {bench(forward):.4f} ms ({relative_error(got, want):.0e})"
        print(row, flush=True)


def _suite_shape(name: str, normalize: bool | None = None, label: str | None = None) -> tuple:
    """``(label, normalize, q_shape, d_shape)`` of the benchmark suite's shape ``name`` for the
    Gluon probes (normalized as the suite's shape is, unless ``normalize`` says otherwise;
    labelled by its name, with ", normalize" where the suite's is not)."""
    from fusedmaxsim import benchmarking as bm

    shape = bm.SHAPES_BY_NAME[name]
    normalize = shape.normalize if normalize is None else normalize
    if label is None:
        label = name + (", normalize" if normalize and not shape.normalize else "")
    return label, normalize, shape.q_shape, shape.d_shape


# The shapes of the A/Bs of this tree's Gluon forward against an older copy (norms_ahead,
# norms_handoff): the normalizing variant's, and the plain forward's as a control.
_KERNEL_AB_SHAPES = (
    _suite_shape("rerank_colpali_norm"),
    _suite_shape("rerank_colpali_1030", True),
    _suite_shape("longquery", True),
    _suite_shape("batch_colbert", True),
    _suite_shape("rerank_colbert", True),
    _suite_shape("longdoc", True),
    _suite_shape("rerank_colpali"),
    _suite_shape("batch_colbert"),
    _suite_shape("rerank_colbert"),
    _suite_shape("train_colpali", False, "train_colpali's shape, scores"),
)


def _module_copy(stem: str, make: str):
    """The module ``benchmarks/<stem>.py``, a copy of a package module at an earlier commit for
    an A/B in one process (not kept in the tree), or None after printing ``make``, the command
    that writes it. Registered by its name, so that another copy can import it."""
    copy = Path(__file__).with_name(f"{stem}.py")
    if not copy.exists():
        print(f"  {copy.name} is missing: {make}")
        return None
    spec = importlib.util.spec_from_file_location(stem, copy)
    module = sys.modules[stem] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kernel_copy(sha: str):
    """``_kernels_hopper`` as at ``sha`` (:func:`_module_copy`)."""
    return _module_copy(f"hopper_forward_{sha}", f"git show {sha}:src/fusedmaxsim/_kernels_hopper.py"
                        f" > benchmarks/hopper_forward_{sha}.py")


def norms_ahead() -> None:
    """The Gluon forward of this tree (each tile's norms read before its product is issued, in
    sums of eight; the ring's first tiles requested before the query chunk is loaded;
    benchmarks/NOTES.md section 33) against that of ``d5f293f``
    (``benchmarks/hopper_forward_d5f293f.py``, a copy kept for this comparison), both at the
    dispatched tiles, interleaved in three rounds; then this tree's normalizing forward under
    3 and 5 stages. The copy is not kept in the tree:
    ``git show d5f293f:src/fusedmaxsim/_kernels_hopper.py > benchmarks/hopper_forward_d5f293f.py``
    makes it."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    before = _kernel_copy("d5f293f")
    if before is None:
        return
    _warm_gpu()
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    for name, normalize, q_shape, d_shape in _KERNEL_AB_SHAPES:
        Q, D = _bf16(*q_shape), _bf16(*d_shape)
        Nq, Lq, dim = q_shape
        Ncols, Ld = d_shape[0], d_shape[1]
        cfg = fwd_config(Lq=Lq, dim=dim, Nq=Nq, per_query_docs=False, elem_bytes=2,
                         norm_from_tiles=normalize, n_cols=Ncols, sm_count=sm_count)
        tiles, qpb, splits, _ = _launch.hopper_call_tiles(cfg, normalize, Nq, Lq, Ncols, Ld,
                                                          sm_count)
        block_n, stages = tiles[:2]
        # The launcher's constants for these tiles (the register cap included).
        _, consts, _, layout = _launch._hopper_plan(Q.dtype, cfg.lq_tile, qpb, dim, normalize,
                                                    tiles)
        flat = D.view(Ncols * Ld, dim)
        desc = TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [block_n, dim], layout)
        out = torch.empty((splits, Nq, Ncols), device="cuda")

        old_kernel = _launch.launcher(before._maxsim_fwd_overlap_kernel)
        # d5f293f's kernel has no TILES_FIRST (it loads the query chunk first) and streams one
        # document a program.
        old_constants = _launch.constants(**{k: v for k, v in consts.kwargs.items()
                                             if k not in ("TILES_FIRST", "DOCS_PER_PROGRAM")})

        def old():
            # Through the same cached launcher as this tree's: the kernels, not the launch paths.
            old_kernel((Ncols * splits, -(-Nq // qpb)),
                       (Q, desc, out, Nq, Ncols, Lq, Ld, splits, out.stride(0), Q.stride(0),
                        Q.stride(1)), old_constants)
            return out.sum(0) if splits > 1 else out[0]

        scores = torch.empty(Nq, Ncols, device="cuda")

        def new():
            _launch.launch_fwd_hopper(cfg, Q, D, scores, normalize)
            return scores

        ref = maxsim_ref(Q.double(), D[:50].double(), normalize=normalize)
        got_old, got_new = old().clone(), new().clone()
        row = (f"-- {name} ({block_n}-token tiles, {stages} stages, {splits} splits; old/new "
               f"{relative_error(got_old, got_new):.0e} apart, new {relative_error(got_new[:, :50], ref):.0e} "
               f"from float64)")
        if relative_error(got_old, got_new) > 1e-5:
            row += " PARITY FAILED"
        times = {"d5f293f": [], "this tree": []}
        for _ in range(3):
            times["d5f293f"].append(bench(old))
            times["this tree"].append(bench(new))
        for label, values in times.items():
            row += f"\n   {label:10s} " + " ".join(f"{v:.4f}" for v in values)
        if normalize:
            saved = _launch._HOPPER_NORM_TILES
            for other in ((64, 3, 4, None), (64, 5, 4, None)):
                _launch._HOPPER_NORM_TILES = other
                try:
                    row += f"\n   this tree at {other}: {bench(new):.4f}"
                finally:
                    _launch._HOPPER_NORM_TILES = saved
        print(row, flush=True)


def _warm_gpu() -> None:
    warm = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(200):
        warm @ warm


def _gluon_case(normalize: bool, q_shape, d_shape, sm_count: int) -> tuple:
    """Random bf16 ``Q`` and ``D`` of these shapes, the forward's tiles for them as the launcher
    chooses them, and the Gluon forward's tiles for the call: ``(Q, D, cfg, tiles)``."""
    Q, D = _bf16(*q_shape), _bf16(*d_shape)
    Nq, Lq, dim = q_shape
    cfg = fwd_config(Lq=Lq, dim=dim, Nq=Nq, per_query_docs=False, elem_bytes=2,
                     norm_from_tiles=normalize, n_cols=D.shape[0], sm_count=sm_count)
    tiles = _launch.hopper_call_tiles(cfg, normalize, Nq, Lq, D.shape[0], D.shape[1],
                                      sm_count)[0]
    return Q, D, cfg, tiles


def _gluon_tile_rounds(shapes, variants, with_triton: bool = False) -> None:
    """For each ``(label, normalize, q_shape, d_shape)``: the Gluon forward under the dispatched
    tiles and under each of ``variants`` (every tile set of ``_launch`` replaced; a variant
    ``(rows, tiles)`` also takes query chunks of ``rows``, split over programs as the launcher
    splits them), each variant's scores against the dispatched ones (NaN-poisoned first), GPU ms
    of CUDA-graph replays (no host issue time, the chunks' sum included) in three interleaved
    rounds; ``with_triton``: the Triton kernel's forward of the same call too, under its own
    dispatched tiles."""
    names = ("_HOPPER_TILES", "_HOPPER_NORM_TILES", "_HOPPER_PACKED_TILES", "_HOPPER_SHORT_TILES",
             "_HOPPER_SHORT_NORM_TILES", "_HOPPER_FEW_PROGRAMS_TILES")
    saved = tuple(getattr(_launch, name) for name in names)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    for label, normalize, q_shape, d_shape in shapes:
        Q, D, cfg, dispatched = _gluon_case(normalize, q_shape, d_shape, sm_count)
        if not _launch.hopper_forward_applies(cfg, Q, D):
            print(f"-- {label}: the Gluon forward does not apply ({cfg})", flush=True)
            continue
        Nq = q_shape[0]
        scores = torch.empty(Nq, D.shape[0], device="cuda")

        def forward(variant):
            rows, tiles = variant if len(variant) == 2 else (cfg.lq_tile, variant)
            for name in names:
                setattr(_launch, name, tiles)
            try:
                _launch.launch_fwd_hopper(dataclasses.replace(cfg, lq_tile=rows), Q, D, scores,
                                          normalize)
            finally:
                for name, value in zip(names, saved):
                    setattr(_launch, name, value)

        forward(dispatched)
        want = scores.clone()
        ref = maxsim_ref(Q.double(), D[:50].double(), normalize=normalize)
        row = (f"-- {label} (dispatched {dispatched}, {relative_error(want[:, :50], ref):.0e} "
               f"from float64)")
        times: dict = {}
        for tiles in variants:
            scores.fill_(float("nan"))
            try:
                forward(tiles)
            except Exception as exc:  # noqa: BLE001
                row += f"\n   {tiles}: {type(exc).__name__}: {str(exc)[:200]}"
                continue
            err = relative_error(scores, want)
            if not (err < 1e-5):
                row += f"\n   {tiles}: PARITY FAILED ({err:.0e} from the dispatched tiles)"
                continue
            times[tiles] = []
        times = {dispatched: [], **times}
        # rerank_colbert's call issues slower than its GPU work runs: replays time the GPU alone.
        graphs = {}
        for tiles in times:
            graphs[tiles] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[tiles]):
                forward(tiles)
        if with_triton:
            def on_triton():
                return _launch.maxsim_fwd(Q, D, None, None, None, None, False, "tf32", normalize)[0]

            triton_scores, _ = _on_triton(on_triton)
            row += f"\n   Triton's scores {relative_error(triton_scores, want):.0e} from the dispatched"
            saved_kernel, _launch.HOPPER_KERNEL = _launch.HOPPER_KERNEL, False
            try:
                graphs["Triton"] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graphs["Triton"]):
                    on_triton()
            finally:
                _launch.HOPPER_KERNEL = saved_kernel
            times["Triton"] = []
        for _ in range(3):
            for tiles, values in times.items():
                values.append(bench(graphs[tiles].replay))
        for tiles, values in times.items():
            row += f"\n   {str(tiles):20s} " + " ".join(f"{v:.4f}" for v in values)
        print(row, flush=True)
        del Q, D, graphs
        torch.cuda.empty_cache()


def three_programs() -> None:
    """The Gluon forward with 32-token document tiles and at most 168 registers a thread, so that
    three 4-warp programs share an SM, and 8-warp programs capped at 128 registers, two an SM
    (benchmarks/NOTES.md section 34), against the dispatched tiles (two 4-warp programs an SM)."""
    _warm_gpu()
    shapes = (
        _suite_shape("rerank_colpali_norm"),
        _suite_shape("rerank_colpali"),
        _suite_shape("rerank_colpali_1030"),
        _suite_shape("rerank_colpali_1030", True),
        _suite_shape("rerank_colbert"),
        _suite_shape("rerank_colbert", True),
        _suite_shape("batch_colbert"),
        _suite_shape("batch_colbert", True),
        _suite_shape("longquery"),
        _suite_shape("longquery", True),
        _suite_shape("longdoc"),
        _suite_shape("train_colpali", False, "train_colpali's shape, scores"),
    )
    # (Record 2026-12-01_2e55496 also has (32, 5, 4, None), (32, 5, 4, 168), (32, 6, 4, 168) and
    # (32, 3, 4, 128).) Two 8-warp programs an SM: 128 registers at most.
    _gluon_tile_rounds(shapes, ((32, 4, 4, 168), (64, 4, 8, None), (64, 4, 8, 128),
                                (64, 3, 8, 128), (32, 6, 8, 128)))


def few_programs() -> None:
    """Grids of fewer programs than two an SM (long documents, or few candidates): 8-warp
    programs (two warp groups splitting the rows) against the dispatched tiles, and the Triton
    kernel's forward (benchmarks/NOTES.md section 34)."""
    _warm_gpu()
    shapes = (
        _suite_shape("longdoc", False, "longdoc: 16 x 32 against 32 x 8192"),
        _suite_shape("longdoc", True),
        ("16 x 32 against 64 x 8192", False, (16, 32, 128), (64, 8192, 128)),
        ("4 x 32 against 64 x 4096", False, (4, 32, 128), (64, 4096, 128)),
        ("8 x 128 against 16 x 8192", False, (8, 128, 128), (16, 8192, 128)),
        ("1 x 128 against 100 x 1024", False, (1, 128, 128), (100, 1024, 128)),
        ("1 x 128 against 100 x 1024, normalize", True, (1, 128, 128), (100, 1024, 128)),
        ("1 x 128 against 200 x 1024", False, (1, 128, 128), (200, 1024, 128)),
        ("1 x 128 against 300 x 1024", False, (1, 128, 128), (300, 1024, 128)),
        ("1 x 32 against 100 x 300", False, (1, 32, 128), (100, 300, 128)),
        ("1 x 32 against 100 x 300, normalize", True, (1, 32, 128), (100, 300, 128)),
        _suite_shape("batch_colbert", True),
        _suite_shape("rerank_colbert", True),
    )
    _gluon_tile_rounds(shapes, ((64, 4, 8, None), (64, 3, 8, None), (64, 6, 8, None),
                                (32, 6, 8, None), (32, 4, 4, 168)), with_triton=True)

def doc_passes() -> None:
    """Several documents a program of the Gluon forward, one pass each, the ring running on from
    one document to the next and the query chunk loaded once (``_launch.HOPPER_DOCS_PER_PROGRAM``),
    against one document a program, with the dispatched tiles (benchmarks/NOTES.md section 38):
    scores against one document a program's and float64, GPU ms of CUDA-graph replays in three
    interleaved rounds."""
    shapes = (
        _suite_shape("batch_colbert"),
        _suite_shape("batch_colbert", True),
        _suite_shape("rerank_colpali"),
        _suite_shape("rerank_colpali_norm"),
        _suite_shape("rerank_colbert"),
        _suite_shape("rerank_colbert", True),
        ("1 x 128 against 3000 x 1024", False, (1, 128, 128), (3000, 1024, 128)),
        ("1 x 128 against 300 x 1024", False, (1, 128, 128), (300, 1024, 128)),
        ("64 x 32 against 1000 x 300", False, (64, 32, 128), (1000, 300, 128)),
        _suite_shape("train_colpali", False, "train_colpali's shape, scores"),
        _suite_shape("train_colpali", True, "train_colpali's shape, normalize"),
    )
    _doc_count_rounds(shapes, (1, 2, 4, 8, 16))


def _doc_count_rounds(shapes, counts) -> None:
    """``_variant_rounds`` over forced counts of documents a program, one document a program the
    reference; each count where the launcher can take it; first, the count the rule picks for
    each shape."""
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    for label, normalize, (Nq, Lq, dim), (Ncols, Ld, _) in shapes:
        cfg = fwd_config(Lq=Lq, dim=dim, Nq=Nq, per_query_docs=False, elem_bytes=2,
                         norm_from_tiles=normalize, n_cols=Ncols, sm_count=sm_count)
        picked = _launch.hopper_call_tiles(cfg, normalize, Nq, Lq, Ncols, Ld, sm_count)[3]
        print(f"   the rule's count for {label}: {picked}", flush=True)

    def applies(docs, cfg, Q, D, normalize):  # the count the launcher takes, once forced
        return _launch.hopper_call_tiles(cfg, normalize, *Q.shape[:2], *D.shape[:2],
                                         sm_count)[3] == docs

    _variant_rounds(shapes, {docs: (lambda docs=docs: _swapped(
        _launch, "HOPPER_DOCS_PER_PROGRAM", docs)) for docs in counts},
        reference=1, applies=applies)


def doc_waves() -> None:
    """Documents a program where the grid is a few waves of programs (benchmarks/NOTES.md
    section 41): reranks of 150-3000 documents of 1024 tokens (one 128-token query, plain and
    normalizing) and of 300-3000 documents of 300 tokens (one 32-token query, plain and
    normalizing), each count against one document a program, with the count the rule picks;
    then the registers and shared memory of every variant compiled (what sets programs an SM).
    The first record (9bdebaf) ran the shapes before the rule; the later ones add shapes the
    rule was not fitted to."""
    shapes = [(f"1 x 128 against {n} x 1024", False, (1, 128, 128), (n, 1024, 128))
              for n in (150, 200, 264, 300, 350, 400, 450, 500, 530, 560, 600, 650,
                        700, 800, 1500)]
    shapes += [(f"1 x 128 against {n} x 1024, normalize", True, (1, 128, 128), (n, 1024, 128))
               for n in (300, 400, 530, 700, 2000)]
    shapes += [(f"1 x 32 against {n} x 300{tag}", normalize, (1, 32, 128), (n, 300, 128))
               for normalize, tag in ((False, ""), (True, ", normalize"))
               for n in (300, 500, 1000, 2000, 3000)]
    _doc_count_rounds(shapes, (1, 2, 4, 8))
    kernel = _launch.launcher(_launch._kernels_hopper._maxsim_fwd_overlap_kernel)
    wanted = ("QUERIES_PER_BLOCK", "BLOCK_N", "NUM_STAGES", "NORMALIZE", "DOCS_PER_PROGRAM",
              "num_warps", "maxnreg")
    for (_, consts, _), compiled in kernel.compiled.items():
        print("   " + " ".join(f"{name}={consts.kwargs.get(name)}" for name in wanted)
              + f": {compiled.n_regs} registers, {compiled.metadata.shared} B shared", flush=True)


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
    from fusedmaxsim import benchmarking as bm

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

    _warm_gpu()
    for name in ("rerank_colbert", "small_batch", "rerank_colpali", "longdoc",
                 "rerank_colpali_norm"):
        case = bm.make_case(bm.SHAPES_BY_NAME[name], "inference", "cuda")
        tiny = torch.zeros(1, device="cuda")
        steps = {"one-element add": lambda tiny=tiny: tiny.add_(1), "torch.amax(D)": case.D.amax}
        for key in ("fusedmaxsim", "lik", "flash"):
            provider = bm.PROVIDERS_BY_KEY[key]
            if bm.provider_unavailable(provider, torch.device("cuda")):
                continue
            steps[key] = bm.make_step(provider.build(case), case)
        graphs = {}
        for key, step in steps.items():
            try:
                graphs[key] = _captured(step)
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
    import time

    from fusedmaxsim import benchmarking as bm

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

    _warm_gpu()
    for name in ("train_small_batch", "train_kd", "train_colbert"):
        case = bm.make_case(bm.SHAPES_BY_NAME[name], "training", "cuda")
        print(f"-- {name}", flush=True)
        steps = {}
        for key in ("fusedmaxsim", "lik", "flash", "naive"):
            provider = bm.PROVIDERS_BY_KEY[key]
            if bm.provider_unavailable(provider, torch.device("cuda")):
                continue
            steps[key] = bm.make_step(provider.build(case), case)
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


def _backward_inputs(q_shape, d_shape, dtype=torch.bfloat16) -> tuple:
    """Random 16-bit ``Q`` and ``D`` of these shapes (4-D ``D``: per-query candidates), an fp32
    ``grad_scores``, the forward's argmax, and the backward's tiles as the launcher picks them:
    ``(Q, D, g, argmax, cfg)``, for the probes that time one backward kernel alone."""
    Q = torch.randn(*q_shape, device="cuda", dtype=dtype)
    D = torch.randn(*d_shape, device="cuda", dtype=dtype)
    g = torch.randn(q_shape[0], d_shape[-3], device="cuda")
    with torch.no_grad():
        _, argmax = _launch.maxsim_fwd(Q, D, None, None, None, None, True, "tf32")
    cfg = bwd_config(Lq=q_shape[1], dim=q_shape[2], elem_bytes=2, per_query_docs=len(d_shape) == 4)
    return Q, D, g, argmax, cfg


def gather_steps() -> None:
    """The gather kernel's columns a step (benchmarks/NOTES.md section 44) on grids of few
    programs: an fp32 grad_Q alone through ``_launch.maxsim_bwd`` (lowmem: the gather kernel
    only) with 1-8 columns a step under 4 or 8 warps, each variant's grad_Q against one column a
    step's (bit for bit or not) and against float64, GPU ms of CUDA-graph replays in three
    interleaved rounds; then the whole training step's GPU time (forward and both gradients,
    replayed) at the suite's small training shapes under one column a step and under the
    library's pick, in interleaved rounds."""
    _warm_gpu()
    shapes = (  # label, Q, D (4-D: per-query candidates)
        ("train_small_batch (32 programs)", (32, 32, 128), (32, 180, 128)),
        ("train_kd (64 programs)", (64, 32, 128), (64, 32, 300, 128)),
        ("train_kd_colpali (32 programs)", (32, 32, 128), (32, 16, 1030, 128)),
        ("128 queries x 32 documents of 300", (128, 32, 128), (32, 300, 128)),
        ("256 queries x 32 documents of 300", (256, 32, 128), (32, 300, 128)),
        ("512 queries x 32 documents of 300", (512, 32, 128), (32, 300, 128)),
        ("1 query of 128 x 1000 documents of 300", (1, 128, 128), (1000, 300, 128)),
    )
    variants = [(1, 4), (2, 4), (4, 4), (4, 8), (8, 8)]
    for label, q_shape, d_shape in shapes:
        Q, D, g, argmax, base = _backward_inputs(q_shape, d_shape)
        outputs, graphs = {}, {}
        for cols, warps in variants:
            def call(Q=Q, D=D, g=g, argmax=argmax):
                return _launch.maxsim_bwd(g, Q, D, argmax, None, None, True, False, "lowmem",
                                          True, "tf32")[0]  # fp32 grad_Q: orders compared

            with _swapped(_launch, "gather_step",
                          lambda programs, device, scatters, s=(cols, warps): s):
                try:
                    outputs[(cols, warps)] = call()
                    graphs[(cols, warps)] = _captured(call)
                except Exception as exc:  # noqa: BLE001
                    print(f"   {cols} x {warps}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        Q64 = Q.double().requires_grad_()
        (maxsim_ref(Q64, D.double()) * g.double()).sum().backward()
        reference = outputs[(1, 4)]
        programs = q_shape[0] * -(-q_shape[1] // base.block_s)
        picked = _launch.gather_step(programs, Q.device, False)
        row = f"-- {label}: {programs} programs, the library picks {picked} (columns, warps)"
        for key, out in outputs.items():
            apart = relative_error(out, reference)
            row += (f"\n   {key[0]} cols x {key[1]} warps: {relative_error(out, Q64.grad):.0e} from "
                    f"float64" + (" (bit for bit with 1 x 4)" if torch.equal(out, reference) else
                                  f", {apart:.0e} from 1 x 4") + ("" if apart < 1e-5 else " PARITY FAILED"))
        row += _replay_rounds(graphs, lambda key: f"{key[0]} x {key[1]} ")
        print(row, flush=True)
        del Q, D, argmax, graphs, outputs
        torch.cuda.empty_cache()

    def one_column(programs, device, scatters):  # the rule before section 44
        return 1, None

    _small_training_steps(lambda: _swapped(_launch, "gather_step", one_column), "one column",
                          "library")


def _small_training_steps(before, before_label: str, after_label: str = "this tree") -> None:
    """Whole steps (forward and both gradients, CUDA-graph replays in three interleaved rounds)
    at the suite's small training shapes, captured inside the context ``before()`` against this
    tree's."""
    from fusedmaxsim import benchmarking as bm

    for name in ("train_small_batch", "train_kd", "train_kd_colpali", "train_colbert"):
        case = bm.make_case(bm.SHAPES_BY_NAME[name], "training", "cuda")
        step = bm.make_step(bm.PROVIDERS_BY_KEY["fusedmaxsim"].build(case), case)

        def training(step=step, case=case):
            case.reset_grads()
            step()

        try:
            with before():
                old = _captured(training)
            new = _captured(training)
            print(f"-- {name}: whole step, GPU ms"
                  + _replay_rounds({before_label: old, after_label: new}, lambda key: f"{key:10s}"),
                  flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"-- {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        case.reset_grads()
        del case
        torch.cuda.empty_cache()


def _scan_stages(stages: int):
    """A context in which the document-owned grad_D's row-scanning programs run at ``stages``."""
    return _swapped(_launch, "_DD_SCAN_STAGES", stages)


def dd_rows() -> None:
    """The document-owned grad_D's pipeline stages (benchmarks/NOTES.md section 45): grad_D alone
    through ``_launch.maxsim_bwd`` (lowmem, no grad_Q) with the scanning programs at the
    launcher's one stage, at two (``8040645``'s) and at three, and under 8 warps and 256 rows
    under 8 warps; each bit for bit with two stages or not and against float64, GPU ms of
    CUDA-graph replays in three interleaved rounds (whole steps: ``dd_steps``). Record
    ``2026-12-01_e422d44`` is this probe at ``e422d44``, whose kernel also loaded a row's query
    tokens beside its argmax (not kept), against a copy of ``8040645``'s."""
    _warm_gpu()
    shapes = (  # label, Q, D (4-D: per-query candidates)
        ("train_small_batch (cross, every row scanned)", (32, 32, 128), (32, 180, 128)),
        ("64 queries x 32 documents of 300 (cross, every row scanned)", (64, 32, 128), (32, 300, 128)),
        ("train_kd (candidates, rows loaded once)", (64, 32, 128), (64, 32, 300, 128)),
        ("train_kd_colpali (candidates, rows loaded once)", (32, 32, 128), (32, 16, 1030, 128)),
        ("train_colpali's shape (cross, winner index)", (128, 128, 128), (128, 1024, 128)),
    )
    for label, q_shape, d_shape in shapes:
        Q, D, g, argmax, base = _backward_inputs(q_shape, d_shape)
        variants = {
            "2 stages (8040645)": (lambda: _scan_stages(2), base),
            "this tree": (contextlib.nullcontext, base),
            "3 stages": (lambda: _scan_stages(3), base),
            "8 warps": (contextlib.nullcontext, dataclasses.replace(base, num_warps=8)),
            "256 rows, 8 warps": (contextlib.nullcontext,
                                  dataclasses.replace(base, block_r=256, num_warps=8)),
        }
        outputs, graphs = {}, {}
        for name, (context, cfg) in variants.items():
            def call(Q=Q, D=D, g=g, argmax=argmax):
                return _launch.maxsim_bwd(g, Q, D, argmax, None, None, False, True, "lowmem",
                                          True, "tf32")[1]

            try:
                with context(), forced_configs(bwd=cfg):
                    outputs[name] = call()
                    graphs[name] = _captured(call)
            except Exception as exc:  # noqa: BLE001
                print(f"   {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        D64 = D.double().requires_grad_()
        (maxsim_ref(Q.double(), D64) * g.double()).sum().backward()
        reference = outputs["2 stages (8040645)"]
        row = f"-- {label}: {base}"
        for name, out in outputs.items():
            apart = relative_error(out, reference)
            row += (f"\n   {name}: {relative_error(out, D64.grad):.0e} from float64"
                    + (" (bit for bit with 2 stages)" if torch.equal(out, reference)
                       else f", {apart:.0e} from 2 stages") + ("" if apart < 1e-2 else " PARITY FAILED"))
        row += _replay_rounds(graphs, lambda name: f"{name:18s}")
        print(row, flush=True)
        del Q, D, D64, argmax, graphs, outputs
        torch.cuda.empty_cache()


def dd_steps() -> None:
    """Whole training steps (forward and both gradients, CUDA-graph replays in three interleaved
    rounds) with the document-owned grad_D's scanning programs at two stages (``8040645``) and at
    the launcher's one (benchmarks/NOTES.md section 45): the suite's small training shapes, then
    two large cross products under lowmem against unified."""
    _warm_gpu()
    _small_training_steps(lambda: _scan_stages(2), "2 stages")

    # The large cross products, where ``auto`` takes unified (atomics) and lowmem reads its rows
    # through the winner index (section 25: lowmem 2-3% slower there, before section 44).
    for label, q_shape, d_shape in (("train_colpali", (128, 128, 128), (128, 1024, 128)),
                                    ("512 x 512 ColBERT", (512, 32, 128), (512, 300, 128))):
        Q, D = _bf16(*q_shape).requires_grad_(), _bf16(*d_shape).requires_grad_()
        g = torch.randn(q_shape[0], d_shape[0], device="cuda")

        def training(strategy, Q=Q, D=D, g=g):
            Q.grad = D.grad = None
            maxsim(Q, D, backward=strategy).backward(g)

        graphs = {}
        try:
            with _scan_stages(2):
                graphs["lowmem, 2 stages"] = _captured(lambda: training("lowmem"))
            graphs["lowmem, this tree"] = _captured(lambda: training("lowmem"))
            graphs["unified"] = _captured(lambda: training("unified"))
            print(f"-- {label}: whole step, GPU ms"
                  + _replay_rounds(graphs, lambda key: f"{key:17s}"), flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"-- {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        del Q, D, graphs
        torch.cuda.empty_cache()


def ragged_dd() -> None:
    """The packed layouts' document-owned grad_D (lowmem) at one stage against two
    (benchmarks/NOTES.md section 45): whole training steps of ``maxsim_varlen`` (every query
    against every document) and ``score_pairs_packed`` (a pair list) under ``backward="lowmem"``,
    bf16, lengths drawn as a training batch's, CUDA-graph replays in three interleaved rounds,
    with each variant's grad_D bit for bit against two stages or not."""
    _warm_gpu()
    generator = torch.Generator().manual_seed(0)
    for label, n_q, n_d, q_len, d_len, n_pairs in (
        ("varlen 32 queries of 20-32 x 32 documents of 100-180", 32, 32, (20, 32), (100, 180), 0),
        ("varlen 128 queries of 20-32 x 128 documents of 150-300", 128, 128, (20, 32), (150, 300), 0),
        ("pairs: 2048 of 64 queries of 20-32 x 2048 documents of 150-300", 64, 2048, (20, 32),
         (150, 300), 2048),
    ):
        lq = torch.randint(q_len[0], q_len[1] + 1, (n_q,), generator=generator).tolist()
        ld = torch.randint(d_len[0], d_len[1] + 1, (n_d,), generator=generator).tolist()
        pq = torch.randint(0, n_q, (n_pairs,), generator=generator).cuda()
        _ragged_dd_rounds(label, lq, ld, pq, torch.arange(n_pairs, device="cuda") % n_d)
        torch.cuda.empty_cache()


def _ragged_dd_rounds(label: str, lq: list, ld: list, pq: torch.Tensor, pd: torch.Tensor) -> None:
    """One shape of ``ragged_dd``: queries and documents of lengths ``lq`` and ``ld``, scored
    against each other, or as the pairs ``(pq, pd)`` where there are any."""
    from fusedmaxsim.ragged import maxsim_varlen, score_pairs_packed

    Q = _bf16(sum(lq), 128).requires_grad_()
    D = _bf16(sum(ld), 128).requires_grad_()
    cu_q, cu_d = (torch.tensor([0, *lens], device="cuda").cumsum(0).to(torch.int32)
                  for lens in (lq, ld))

    def score():
        if pq.numel():
            return score_pairs_packed(Q, D, cu_q, cu_d, pq, pd, max_seqlen_q=max(lq),
                                      max_seqlen_d=max(ld), backward="lowmem")
        return maxsim_varlen(Q, D, cu_q, cu_d, max(lq), max(ld), backward="lowmem")

    g = torch.randn(score().shape, device="cuda")

    def training():
        Q.grad = D.grad = None
        score().backward(g)

    grads, graphs = {}, {}
    try:
        for name, context in (("2 stages", lambda: _scan_stages(2)),
                              ("this tree", contextlib.nullcontext)):
            with context():
                training()
                grads[name] = D.grad.clone()
                graphs[name] = _captured(training)
        same = torch.equal(grads["2 stages"], grads["this tree"])
        print(f"-- {label}: whole step, GPU ms; grad_D "
              + ("bit for bit with 2 stages" if same else "DIFFERS from 2 stages")
              + _replay_rounds(graphs, lambda key: f"{key:10s}"), flush=True)
    except Exception as exc:  # noqa: BLE001
        print(f"-- {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)

def large_cross() -> None:
    """``auto``'s backward for in-batch (cross-product) training above the host-bound size
    (benchmarks/NOTES.md section 45): lowmem (grad_Q gathered, grad_D document-owned through the
    winner index) against unified (fp32 atomics) at five shapes from 2^34 to 2^40 multiply-adds:
    each step's peak memory above the inputs and do_bench median (eager, host included), then
    GPU ms of CUDA-graph replays in three interleaved rounds, and the gradients' distance."""
    _warm_gpu()
    shapes = (
        ("train_colbert", (128, 32, 128), (128, 300, 128)),
        ("256 x 256 ColBERT", (256, 32, 128), (256, 300, 128)),
        ("train_colpali", (128, 128, 128), (128, 1024, 128)),
        ("512 x 512 ColBERT", (512, 32, 128), (512, 300, 128)),
        ("256 x 256 ColPali", (256, 128, 128), (256, 1024, 128)),
    )
    for label, q_shape, d_shape in shapes:
        Q, D = _bf16(*q_shape).requires_grad_(), _bf16(*d_shape).requires_grad_()
        g = torch.randn(q_shape[0], d_shape[0], device="cuda")
        macs = q_shape[0] * q_shape[1] * d_shape[0] * d_shape[1] * q_shape[2]
        row = f"-- {label} (2^{macs.bit_length() - 1} multiply-adds)"
        graphs, grads = {}, {}
        try:
            for strategy in ("lowmem", "unified"):
                peak, ms = step_peak_and_ms(Q, D, g, strategy)
                row += f"\n   {strategy:8s} peak {peak:6.1f} MiB above the inputs, eager {ms:.4f} ms"
                maxsim(Q, D, backward=strategy).backward(g)
                grads[strategy] = (Q.grad, D.grad)
                Q.grad = D.grad = None

                def training(strategy=strategy, Q=Q, D=D, g=g):
                    Q.grad = D.grad = None
                    maxsim(Q, D, backward=strategy).backward(g)

                graphs[strategy] = _captured(training)
            row += "".join(f"\n   grad_{name} lowmem against unified: {relative_error(a, b):.0e}"
                           for name, a, b in zip("QD", grads["lowmem"], grads["unified"]))
            row += _replay_rounds(graphs, lambda key: f"{key:8s}")
        except Exception as exc:  # noqa: BLE001
            row += f"\n   {type(exc).__name__}: {str(exc)[:200]}"
        print(row, flush=True)
        del Q, D, graphs, grads
        torch.cuda.empty_cache()

def half_blocks() -> None:
    """A single 128-token query as two 64-row chunks, each its own program (neighbours, so the
    second reads the document's tiles from L2), with tiles small enough for three or four
    programs an SM, against the dispatched 128-row block of two programs an SM
    (benchmarks/NOTES.md section 36): the memory-bound reranks, plain and normalizing."""
    _warm_gpu()
    shapes = []
    for normalize in (False, True):
        tag = ", normalize" if normalize else ""
        shapes += [
            (f"rerank_colpali{tag}", normalize, (1, 128, 128), (1000, 1024, 128)),
            (f"1 x 128 against 300 x 1024{tag}", normalize, (1, 128, 128), (300, 1024, 128)),
            (f"1 x 128 against 3000 x 1024{tag}", normalize, (1, 128, 128), (3000, 1024, 128)),
            (f"2 x 128 against 1000 x 1024{tag}", normalize, (2, 128, 128), (1000, 1024, 128)),
        ]
    _gluon_tile_rounds(shapes, (
        (64, (64, 4, 4, None)), (64, (64, 3, 4, 128)), (64, (32, 4, 4, 128)),
        (64, (32, 6, 4, None)), (64, (32, 5, 4, 128)),
    ))


def _replay_rounds(graphs: dict, label) -> str:
    """GPU ms of each captured graph's replays in three interleaved rounds: a line each,
    ``label(name)`` first."""
    times = {name: [] for name in graphs}
    for _ in range(3):
        for name, graph in graphs.items():
            times[name].append(bench(graph.replay))
    return "".join(f"\n   {label(name)} " + " ".join(f"{v:.4f}" for v in values)
                   for name, values in times.items())

def _variant_rounds(shapes, variants: dict, reference: str, applies=None) -> None:
    """For each ``(label, normalize, q_shape, d_shape)``: the Gluon forward through
    ``launch_fwd_hopper`` with the dispatched tiles under each of ``variants`` (name → a context
    manager setting what the variant changes; ``applies(name, cfg, Q, D, normalize)``, when
    given, skips a variant where it is False), each variant's NaN-poisoned scores against
    float64 and against ``reference``'s (bit for bit or not), GPU ms of CUDA-graph replays in
    three interleaved rounds."""
    _warm_gpu()
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    for label, normalize, q_shape, d_shape in shapes:
        Q, D, cfg, tiles = _gluon_case(normalize, q_shape, d_shape, sm_count)
        Nq = q_shape[0]
        outputs, graphs = {}, {}
        for name, variant in variants.items():
            try:
                with variant():
                    if applies is not None and not applies(name, cfg, Q, D, normalize):
                        continue
                    scores = torch.full((Nq, D.shape[0]), float("nan"), device="cuda")
                    _launch.launch_fwd_hopper(cfg, Q, D, scores, normalize)
                    outputs[name] = scores
                    graphs[name] = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graphs[name]):
                        _launch.launch_fwd_hopper(cfg, Q, D, scores, normalize)
            except Exception as exc:  # noqa: BLE001
                print(f"   {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        ref = maxsim_ref(Q.double(), D[:50].double(), normalize=normalize)
        row = f"-- {label} ({tiles})"
        for name, out in outputs.items():
            apart = relative_error(out, outputs[reference])
            row += (f"\n   {name}: {relative_error(out[:, :50], ref):.0e} from float64, "
                    f"{apart:.0e} from {reference}"
                    + (" (bit for bit)" if torch.equal(out, outputs[reference]) else "")
                    + ("" if apart < 1e-5 else " PARITY FAILED"))
        row += _replay_rounds(graphs, lambda name: f"{str(name):12s}")
        print(row, flush=True)
        del Q, D, graphs
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _swapped(owner, attribute: str, value):
    """``owner.attribute`` set to ``value`` inside the block."""
    saved = getattr(owner, attribute)
    setattr(owner, attribute, value)
    try:
        yield
    finally:
        setattr(owner, attribute, saved)


def norms_handoff() -> None:
    """The Gluon forward of this tree (a tile's inverse norms handed from ``_issue`` to
    ``_complete`` through shared memory, read after the CTA barrier the refill has anyway;
    benchmarks/NOTES.md section 35) against that of ``8570ab9`` (their move into the product's
    column layout by ``convert_layout`` before the product's issue), both through
    ``launch_fwd_hopper`` with the dispatched tiles: scores compared, GPU ms of CUDA-graph
    replays in three interleaved rounds. The old kernel's copy is not kept in the tree:
    ``git show 8570ab9:src/fusedmaxsim/_kernels_hopper.py > benchmarks/hopper_forward_8570ab9.py``
    makes it. (Since section 38 the launcher passes a constexpr that kernel lacks,
    ``DOCS_PER_PROGRAM``: the probe ran at ``2841c3c``.)"""
    before = _kernel_copy("8570ab9")
    if before is None:
        return
    kernel_module = _launch._kernels_hopper
    _variant_rounds(_KERNEL_AB_SHAPES, {
        "8570ab9": lambda: _swapped(kernel_module, "_maxsim_fwd_overlap_kernel",
                                    before._maxsim_fwd_overlap_kernel),
        "this tree": contextlib.nullcontext,
    }, reference="8570ab9")


def hopper_argmax() -> None:
    """The training forward (scores and argmax) through the Gluon kernel's coded running max
    (benchmarks/NOTES.md sections 42 and 46) against the Triton kernel's, in one process: GPU ms
    of CUDA-graph replays, the host's µs to issue one, and whole training steps (forward and
    backward, do_bench), scores
    against float64 and each other, the argmax's agreement (and, where they differ, how far
    apart the two tokens' similarities are in float64), the gradients against each other."""
    _warm_gpu()
    shapes = (("train_colpali", (128, 128, 128), (128, 1024, 128), torch.bfloat16),
              ("train_colpali_fp16", (128, 128, 128), (128, 1024, 128), torch.float16),
              ("colpali 256 x 256", (256, 128, 128), (256, 1024, 128), torch.bfloat16),
              ("train_colbert", (128, 32, 128), (128, 300, 128), torch.bfloat16),
              ("colbert 512 x 512", (512, 32, 128), (512, 300, 128), torch.bfloat16))
    for label, q_shape, d_shape, dtype in shapes:
        Q = torch.randn(q_shape, device="cuda", dtype=dtype)
        D = torch.randn(d_shape, device="cuda", dtype=dtype)
        g = torch.randn(q_shape[0], d_shape[0], device="cuda")
        outputs, graphs, steps, grads, host_us = {}, {}, {}, {}, {}
        for name, on in (("gluon", True), ("triton", False)):
            with settings.use_exact_ties(not on):
                def forward(Q=Q, D=D):
                    return _launch.maxsim_fwd(Q, D, None, None, None, None, True, "tf32")
                outputs[name] = forward()
                graphs[name] = _captured(forward)
                host_us[name] = _host_us_a_call(forward)
                Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()

                def step(Qg=Qg, Dg=Dg, g=g):
                    maxsim(Qg, Dg).backward(g)
                step()
                grads[name] = (Qg.grad.float(), Dg.grad.float())
                steps[name] = [do_bench(step, warmup=10, rep=50, grad_to_none=[Qg, Dg])
                               for _ in range(3)]
        (s_gl, a_gl), (s_tr, a_tr) = outputs["gluon"], outputs["triton"]
        ref = maxsim_ref(Q.double(), D[:16].double())
        differ = (a_gl != a_tr).nonzero()
        gap = 0.0
        for i, j, s_tok in differ[:2000].tolist():
            q = Q[i, s_tok].double()
            v_gl = (q * D[j, int(a_gl[i, j, s_tok])].double()).sum()
            v_tr = (q * D[j, int(a_tr[i, j, s_tok])].double()).sum()
            gap = max(gap, float((v_gl - v_tr).abs() / v_tr.abs().clamp_min(1e-30)))
        print(f"-- {label}: scores {relative_error(s_gl[:, :16], ref):.0e} (gluon) / "
              f"{relative_error(s_tr[:, :16], ref):.0e} (triton) from float64, "
              f"{relative_error(s_gl, s_tr):.0e} apart; argmax differs at {len(differ)} of "
              f"{a_gl.numel()} rows (float64 gap at most {gap:.1e}); gradients "
              f"{relative_error(grads['gluon'][0], grads['triton'][0]):.0e} / "
              f"{relative_error(grads['gluon'][1], grads['triton'][1]):.0e} apart", flush=True)
        rounds = {name: [] for name in graphs}
        for _ in range(3):
            for name, graph in graphs.items():
                rounds[name].append(bench(graph.replay))
        for name in graphs:
            print(f"   {name:7s} forward " + " ".join(f"{v:.4f}" for v in rounds[name])
                  + "   step " + " ".join(f"{v:.4f}" for v in steps[name])
                  + f"   host µs a forward {host_us[name]:.1f}", flush=True)


def _host_us_a_call(call, calls: int = 100) -> float:
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


def backward_parts() -> None:
    """Where the lowmem backward of the large cross products goes (benchmarks/NOTES.md section
    47): GPU ms of CUDA-graph replays of the argmax forward, grad_Q alone, the winner index
    alone (both launches, all columns), the indexed grad_D given the index, and the whole
    backward, three interleaved rounds each."""
    _warm_gpu()
    for shape in (("train_colpali", 128, 128, 128, 1024), ("colbert 512 x 512", 512, 32, 512, 300)):
        _backward_parts_of(*shape)
        torch.cuda.empty_cache()


def _backward_parts_of(name: str, nq: int, lq: int, nd: int, ld: int) -> None:
    Q, D, g, argmax, cfg = _backward_inputs((nq, lq, 128), (nd, ld, 128))
    n_tiles = -(-ld // cfg.block_t)
    buffers = _launch._winner_index_buffers(Q, nd, n_tiles)
    grad_d = torch.empty_like(D)
    _launch._winner_index(argmax, 0, nd, cfg.block_t, buffers)

    def bwd(need_q=True, need_d=True):
        return _launch.maxsim_bwd(g, Q, D, argmax, None, None, need_q, need_d, "lowmem", False,
                                  "tf32")

    parts = {
        "forward with argmax": lambda: _launch.maxsim_fwd(Q, D, None, None, None, None, True, "tf32"),
        "grad_Q alone": lambda: bwd(need_d=False),
        "index alone": lambda: _launch._winner_index(argmax, 0, nd, cfg.block_t, buffers),
        "indexed grad_D alone": lambda: _launch._launch_dd(
            cfg, g, Q, None, argmax, grad_d, False, "tf32", 0, nd, *buffers),
        "grad_D with its index": lambda: bwd(need_q=False),
        "whole backward": bwd,
    }
    graphs = {label: _captured(fn) for label, fn in parts.items()}
    print(f"-- {name} (index of {nd} columns in one chunk; the library chunks it by "
          f"{_launch._winner_index_cols(Q, nd, n_tiles, grad_d)}):"
          + _replay_rounds(graphs, lambda label: f"{label:22s}"), flush=True)


def backward_once() -> None:
    """One lowmem backward at train_colpali's shape after one warm-up, for a kernel profiler
    (``ncu -k regex:'_tile_|_maxsim_bwd' ... probe.py backward_once``)."""
    Q, D = _bf16(128, 128, 128), _bf16(128, 1024, 128)
    g = torch.randn(128, 128, device="cuda")
    _, argmax = _launch.maxsim_fwd(Q, D, None, None, None, None, True, "tf32")
    for _ in range(2):
        _launch.maxsim_bwd(g, Q, D, argmax, None, None, True, True, "lowmem", False, "tf32")
    torch.cuda.synchronize()


def _kernels_before(sha: str):
    """``(kernels, index kernels)``: ``_kernels`` and ``_kernels_index`` as at ``sha``
    (:func:`_module_copy`; the first imports the second), or None."""
    index_stem, kernels_stem = f"_kernels_index_{sha}", f"_kernels_{sha}"
    index = _module_copy(index_stem, f"git show {sha}:src/fusedmaxsim/_kernels_index.py"
                                     f" > benchmarks/{index_stem}.py")
    kernels = index and _module_copy(
        kernels_stem, f"git show {sha}:src/fusedmaxsim/_kernels.py | sed -e 's/^from \\._configs/"
        f"from fusedmaxsim._configs/' -e 's/^from \\._kernels_index/from {index_stem}/'"
        f" > benchmarks/{kernels_stem}.py")
    return None if kernels is None else (kernels, index)


@contextlib.contextmanager
def _grad_d_kernels_of(kernels, index_kernels):
    """The lowmem grad_D and the winner index as before section 47: these modules' kernels, one
    token tile a scan of the index (those kernels take no ``TILES``), int32 row numbers, and
    column chunks of the most columns the memory share allows."""
    saved_constants = _launch._index_constants

    def constants_before(block_t, scan_tokens, scan=_launch._INDEX_SCAN, num_stages=1, tiles=1):
        return _launch.constants(BLOCK_T=block_t, SCAN=scan, SCAN_Q=max(1, scan // scan_tokens),
                                 SCAN_S=scan_tokens, num_warps=4, num_stages=num_stages)

    def index_cols_before(Q, Ncols, n_tiles, grad_d):  # int32 rows, the last chunk what is left
        budget = grad_d.numel() * grad_d.element_size() // _launch._INDEX_SHARE
        return max(1, min(Ncols, budget // (4 * (Q.shape[0] * Q.shape[1] + n_tiles))))

    with contextlib.ExitStack() as stack:
        stack.enter_context(_swapped(_launch, "_index_row_dtype", lambda Nq, Lq: torch.int32))
        stack.enter_context(_swapped(_launch, "_winner_index_cols", index_cols_before))
        stack.enter_context(_swapped(_launch, "_maxsim_bwd_dd_kernel", kernels._maxsim_bwd_dd_kernel))
        stack.enter_context(_swapped(_launch, "_tile_counts_kernel", index_kernels._tile_counts_kernel))
        stack.enter_context(_swapped(_launch, "_tile_rows_kernel", index_kernels._tile_rows_kernel))
        stack.enter_context(_swapped(_launch, "_index_tiles", lambda *args, **kwargs: 1))
        stack.enter_context(_swapped(_launch, "_index_constants", constants_before))
        yield
    assert _launch._index_constants is saved_constants


def grad_d_ab() -> None:
    """The lowmem backward of large cross products with this tree's winner index (four token
    tiles a scan, int16 row numbers where they fit, even column chunks) and indexed grad_D (rows
    a block ahead, ``g`` in the one-hot) against those of ``310a2a3`` (benchmarks/NOTES.md
    section 47), in one process: the index bit for bit, grad_D against float64 and against the
    old one, bitwise repeatability, GPU ms of CUDA-graph replays (the index alone, grad_D with its
    index, the whole backward, the whole training step) in three interleaved rounds."""
    before = _kernels_before("310a2a3")
    if before is None:
        return
    _warm_gpu()
    variants = {"310a2a3": lambda: _grad_d_kernels_of(*before),
                "this tree": contextlib.nullcontext,
                "two tiles a scan": lambda: _swapped(_launch, "_INDEX_TILES", 2)}
    for shape in (("train_colpali", 128, 128, 128, 1024), ("colbert 512 x 512", 512, 32, 512, 300),
                  ("train_colbert", 128, 32, 128, 300), ("colpali 256 x 256", 256, 128, 256, 1024)):
        _grad_d_ab_of(variants, *shape)
        torch.cuda.empty_cache()


def _grad_d_ab_of(variants: dict, name: str, nq: int, lq: int, nd: int, ld: int) -> None:
    Q, D = _bf16(nq, lq, 128), _bf16(nd, ld, 128)
    g = torch.randn(nq, nd, device="cuda")
    _, argmax = _launch.maxsim_fwd(Q, D, None, None, None, None, True, "tf32")
    cfg = bwd_config(Lq=lq, dim=128, elem_bytes=2)
    n_tiles = -(-ld // cfg.block_t)
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()

    def bwd(need_q=True, need_d=True):
        return _launch.maxsim_bwd(g, Q, D, argmax, None, None, need_q, need_d, "lowmem", False,
                                  "tf32")

    def step():
        Qg.grad = Dg.grad = None
        maxsim(Qg, Dg, backward="lowmem").backward(g)

    # Each variant's index buffers stay alive with its graphs, which write them at every replay.
    indexes, grads, graphs, buffers = {}, {}, {}, {}
    for variant, context in variants.items():
        with context():
            buffers[variant] = _launch._winner_index_buffers(Q, nd, n_tiles)
            rows, counts = _launch._winner_index(argmax, 0, nd, cfg.block_t, buffers[variant])
            indexes[variant] = (rows.long(), counts.clone())
            chunk = _launch._winner_index_cols(Q, nd, n_tiles, torch.empty_like(D))
            grads[variant] = bwd(need_q=False)[1]
            repeatable = torch.equal(grads[variant], bwd(need_q=False)[1])
            for part, fn in (("index alone", lambda b=buffers[variant]: _launch._winner_index(
                                 argmax, 0, nd, cfg.block_t, b)),
                             ("grad_D with its index", lambda: bwd(need_q=False)),
                             ("whole backward", bwd), ("training step", step)):
                graphs[f"{variant:16s} {part}"] = _captured(fn)
        print(f"   {variant}: grad_D bitwise repeatable {repeatable}; index rows "
              f"{rows.dtype}, column chunks of {chunk}", flush=True)
    ref_d = _grad_d_reference(Q, D[:16], g[:, :16], argmax[:, :16])
    row = f"-- {name}:"
    for variant, (rows, counts) in indexes.items():
        same_counts = torch.equal(counts, indexes["310a2a3"][1])
        same_rows = all(torch.equal(rows[c, :int(counts[c].sum())],
                                    indexes["310a2a3"][0][c, :int(counts[c].sum())])
                        for c in range(nd))
        row += (f"\n   {variant}: index {'bit for bit' if same_counts and same_rows else 'DIFFERS'}"
                f" from 310a2a3's; grad_D {relative_error_fro(grads[variant][:16], ref_d):.1e}"
                f" from float64 (Frobenius), {relative_error_fro(grads[variant], grads['310a2a3']):.1e}"
                f" from 310a2a3's")
    print(row + _replay_rounds(graphs, lambda key: key), flush=True)


def _grad_d_reference(Q, D, g, argmax):
    """grad_D of the first documents in float64 from the argmax the kernels read (so that a
    near-tie decided otherwise in float64 does not count as an error of the backward)."""
    grad = torch.zeros(D.shape, dtype=torch.float64, device=D.device)
    won = argmax.long()  # [Nq, Nd, Lq]
    weighted = g.double()[:, :, None, None] * Q.double()[:, None, :, :]  # [Nq, Nd, Lq, d]
    for j in range(D.shape[0]):
        valid = won[:, j] >= 0
        grad[j].index_add_(0, won[:, j][valid], weighted[:, j][valid])
    return grad


# The indexed grad_D's variants of benchmarks/NOTES.md sections 48-49: (kernel, rows a product,
# warps, stages, register cap); None keeps what the launcher picks. Section 48's tiles are in
# the history (its record 2026-12-02_ed04ef4).
_DD_BASE = "a3bbf8d"
_DD_VARIANTS = {
    _DD_BASE: (_DD_BASE, None, None, None, None),
    "this tree": ("this tree", None, None, None, None),
}


@contextlib.contextmanager
def _dd_variant(kernels, block_r, warps, stages, max_registers):
    """The document-owned grad_D through ``kernels``' kernel, its constants replaced where a
    value is given (the launcher's choice elsewhere)."""
    chosen = _launch._dd_constants

    def replaced(*args):
        values = dict(chosen(*args).kwargs)
        for name, value in (("BLOCK_R", block_r), ("num_warps", warps), ("num_stages", stages),
                            ("maxnreg", max_registers)):
            if value is not None:
                values[name] = value
        return _launch.constants(**values)

    with _swapped(_launch, "_maxsim_bwd_dd_kernel", kernels._maxsim_bwd_dd_kernel), \
            _swapped(_launch, "_dd_constants", replaced):
        yield


def dd_variants() -> None:
    """The document-owned grad_D of this tree (fp16: ``g`` in the one-hot once divided by a
    power of two of its column's largest, benchmarks/NOTES.md section 49) against ``_DD_BASE``'s
    kernel, in one process: grad_D against float64 and against the base's (bit for bit or not),
    GPU ms of CUDA-graph replays of grad_D alone given its index (all columns in one chunk) and
    of the whole training step, three interleaved rounds."""
    before = _module_copy(f"_kernels_{_DD_BASE}", f"git show {_DD_BASE}:src/fusedmaxsim/_kernels.py"
                          f" | sed -e 's/^from \\._/from fusedmaxsim._/'"
                          f" > benchmarks/_kernels_{_DD_BASE}.py")
    if before is None:
        return
    from fusedmaxsim import _kernels

    kernels = {_DD_BASE: before, "this tree": _kernels}
    _warm_gpu()
    for shape in (("train_colpali fp16", 128, 128, 128, 1024, torch.float16),
                  ("train_colpali", 128, 128, 128, 1024, torch.bfloat16),
                  ("colbert 512 x 512 fp16", 512, 32, 512, 300, torch.float16),
                  ("colpali 256 x 256 fp16", 256, 128, 256, 1024, torch.float16),
                  ("train_colbert fp16", 128, 32, 128, 300, torch.float16)):
        _dd_variants_of(kernels, *shape)
        torch.cuda.empty_cache()


def _dd_variants_of(kernels: dict, name: str, nq: int, lq: int, nd: int, ld: int, dtype) -> None:
    Q, D, g, argmax, cfg = _backward_inputs((nq, lq, 128), (nd, ld, 128), dtype)
    n_tiles = -(-ld // cfg.block_t)
    buffers = _launch._winner_index_buffers(Q, nd, n_tiles)
    _launch._winner_index(argmax, 0, nd, cfg.block_t, buffers)
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()

    def step():
        Qg.grad = Dg.grad = None
        maxsim(Qg, Dg, backward="lowmem").backward(g)

    grads, graphs = {}, {}
    for variant, (source, *tiles) in _DD_VARIANTS.items():
        grad_d = torch.full_like(D, float("nan"))

        def alone(grad_d=grad_d):
            _launch._launch_dd(cfg, g, Q, None, argmax, grad_d, False, "tf32", 0, nd, *buffers)

        try:
            with _dd_variant(kernels[source], *tiles):
                alone()
                grads[variant] = grad_d
                graphs[f"{variant:22s} grad_D alone"] = _captured(alone)
                graphs[f"{variant:22s} training step"] = _captured(step)
        except Exception as exc:  # noqa: BLE001
            print(f"   {variant}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    ref_d = _grad_d_reference(Q, D[:16], g[:, :16], argmax[:, :16])
    row = f"-- {name}, {dtype}:"
    base = grads.get(_DD_BASE)
    for variant, grad in grads.items():
        row += (f"\n   {variant:22s} grad_D {relative_error_fro(grad[:16], ref_d):.1e} from float64"
                f" (Frobenius), all finite {bool(torch.isfinite(grad).all())}")
        if base is not None:
            row += (f" bit for bit with {_DD_BASE}" if torch.equal(grad, base)
                    else f", {relative_error_fro(grad, base):.1e} from {_DD_BASE}'s")
    print(row + _replay_rounds(graphs, lambda key: key), flush=True)


def mid_strategies() -> None:
    """The two backward strategies of cross products between ``HOST_BOUND_MACS`` and
    ``LOWMEM_CROSS_MACS``, where ``auto`` takes unified (benchmarks/NOTES.md section 51): for
    each shape, both strategies' gradients against float64 (Frobenius), GPU ms of CUDA-graph
    replays of the whole step, the eager step (do_bench: the host included) and the host's µs
    to issue one step (100 steps back to back, then one synchronize), three interleaved rounds."""
    _warm_gpu()
    for name, q_shape, d_shape, masked in (
            ("train_colbert", (128, 32, 128), (128, 300, 128), False),
            ("train_colbert_masked", (128, 32, 128), (128, 300, 128), True),
            ("192 x 192 ColBERT", (192, 32, 128), (192, 300, 128), False)):
        _mid_strategies_of(name, q_shape, d_shape, masked)
        torch.cuda.empty_cache()


def _mid_strategies_of(name: str, q_shape, d_shape, masked: bool) -> None:
    Q, D, g, _, _ = _backward_inputs(q_shape, d_shape)
    d_mask = (torch.rand(d_shape[:2], device="cuda") > 0.2) if masked else None
    Qd, Dd = Q.double().requires_grad_(), D.double().requires_grad_()
    maxsim_ref(Qd, Dd, d_mask=d_mask).backward(g.double())
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    steps, graphs, row = {}, {}, f"-- {name}"
    for strategy in ("unified", "lowmem"):
        def step(strategy=strategy):
            Qg.grad = Dg.grad = None
            maxsim(Qg, Dg, d_mask=d_mask, backward=strategy).backward(g)

        step()
        row += (f"\n   {strategy:8s} grad_Q {relative_error_fro(Qg.grad, Qd.grad):.1e}, grad_D "
                f"{relative_error_fro(Dg.grad, Dd.grad):.1e} from float64 (Frobenius)")
        steps[strategy] = step
        graphs[f"{strategy:8s} step replays"] = _captured(step)
    row += _replay_rounds(graphs, lambda key: key)
    for _ in range(3):
        for strategy, step in steps.items():
            row += (f"\n   {strategy:8s} eager step (do_bench) {bench(step):.4f}, issue "
                    f"{_host_us_a_call(step):.1f} us")
    print(row, flush=True)


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
    from fusedmaxsim import benchmarking as bm

    rows = {}
    for mode, name in (("inference", "small_batch"), ("training", "train_small_batch")):
        case = bm.make_case(bm.SHAPES_BY_NAME[name], mode, "cuda")
        x = torch.zeros(256, device="cuda")
        calls = {
            "fusedmaxsim": bm.make_step(bm.PROVIDERS_BY_KEY["fusedmaxsim"].build(case), case),
            "naive PyTorch": bm.make_step(bm.PROVIDERS_BY_KEY["naive"].build(case), case),
            "no kernels (autograd.Function)": bm.make_step(
                lambda case=case: _NoKernels.apply(case.Q, case.D), case),
        }
        if mode == "inference":
            calls["one torch kernel (x.zero_())"] = x.zero_
        for label in calls:
            rows[(name, label)] = []
        for _ in range(3):
            for label, step in calls.items():
                us, _ = bm.wall_us_per_call(step, case, torch.cuda.synchronize, 0.01, 5.0)
                rows[(name, label)].append(us)
        del case
    print("  shape              call                              least    median  (wall us/call)")
    for (name, label), values in rows.items():
        values.sort()
        print(f"  {name:18s} {label:32s} {values[0]:7.1f}  {values[1]:7.1f}", flush=True)


if __name__ == "__main__":
    wanted = set(sys.argv[1:]) or {"normalize", "kd", "smooth"}
    for name, probe in (("normalize", normalize_sweep), ("kd", kd_split), ("smooth", smooth_vs_naive),
                        ("masked", masked), ("rerank", rerank_tiles), ("memory", memory),
                        ("cold", cold), ("small", small_tiles), ("stages", gather_stages),
                        ("cold_profile", cold_profile), ("steps", training_steps), ("host", host_costs),
                        ("fwd_tiles", forward_tiles), ("launch", launch_paths),
                        ("chunks", query_chunks), ("query_registers", query_registers),
                        ("graph_times", graph_times), ("wide_rows", wide_rows),
                        ("winner_index", winner_index), ("chunk_splits", chunk_splits_ab),
                        ("occupancy", occupancy), ("hopper_forward", hopper_forward),
                        ("hopper_host", hopper_host), ("hopper_variants", hopper_variants),
                        ("short_query", short_query), ("norms_ahead", norms_ahead),
                        ("three_programs", three_programs), ("few_programs", few_programs),
                        ("norms_handoff", norms_handoff), ("half_blocks", half_blocks),
                        ("doc_passes", doc_passes), ("doc_waves", doc_waves),
                        ("flush_writeback", flush_writeback), ("step_timeline", step_timeline),
                        ("gather_steps", gather_steps), ("dd_rows", dd_rows),
                        ("dd_steps", dd_steps), ("large_cross", large_cross),
                        ("ragged_dd", ragged_dd), ("hopper_argmax", hopper_argmax), ("backward_parts", backward_parts),
                        ("backward_once", backward_once), ("grad_d_ab", grad_d_ab),
                        ("dd_variants", dd_variants), ("mid_strategies", mid_strategies),
                        ("host_floor", host_floor)):
        if name in wanted:
            print(f"== {name}", flush=True)
            probe()
            sys.stdout.flush()
