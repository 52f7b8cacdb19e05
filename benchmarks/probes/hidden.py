"""Probes of the fused projection head (``maxsim_from_hidden``; design.md "Fused projection
head"): the fused forward's tiles, and where a training step's time goes."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from fusedmaxsim import forced_plan, maxsim_from_hidden
from fusedmaxsim._plan import MEASURED, plan_forward
from fusedmaxsim._problem import hidden_problem, options_for
from fusedmaxsim.testing import relative_error, relative_error_fro

SHAPES = {  # name: (Nq, Nd, Lq, Ld, d_model, d)
    "rerank-1x1000-Ld300": (1, 1000, 32, 300, 768, 128),
    "lateon-code-Nd256-Ld1k": (2, 256, 32, 1024, 768, 128),
    "lateon-code-Nd1024-Ld2k": (1, 1024, 32, 2048, 768, 128),
}
# Shapes timed at the best tiles of the sweep only.
MORE_SHAPES = {
    "lateon-code-Nd512-Ld2k": (1, 512, 32, 2048, 768, 128),
    "lateon-code-edge-Nd256-Ld4k": (2, 256, 32, 4096, 384, 96),
}


def _inputs(Nq, Nd, Lq, Ld, d_model, d, grad=False):
    H = torch.randn(Nd, Ld, d_model, device="cuda", dtype=torch.bfloat16)
    W = (torch.randn(d, d_model, device="cuda") / d_model**0.5).bfloat16()
    b = (torch.randn(d, device="cuda") * 0.01).bfloat16()
    Q = F.normalize(torch.randn(Nq, Lq, d, device="cuda"), dim=-1).bfloat16()
    return [t.requires_grad_(grad) for t in (Q, H, W, b)]


def _interleaved_medians(calls: dict, rounds: int = 3) -> dict:
    """Each call's ms (``do_bench``), the median of ``rounds`` rounds, each round over every
    call, each starting one call further on."""
    times = {key: [] for key in calls}
    keys = list(calls)
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            times[key].append(do_bench(calls[key]))
    return {key: sorted(found)[len(found) // 2] for key, found in times.items()}


def _fused_ms(Q, H, W, b, tiles):
    """The fused forward's ms at these tiles, or the exception's name."""
    try:
        with torch.no_grad(), forced_plan(hidden_route="fused", HIDDEN_TILES=tiles):
            return do_bench(lambda: maxsim_from_hidden(Q, H, W, b))
    except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: reported
        return type(exc).__name__


def hidden_tiles():
    """Fused inference forward (ms) by document tile, split-K step, warps and stages, beside
    ``F.linear`` alone, the unfused route and late-interaction-kernels' fused head where it is
    installed (its autotuned pick printed with ``TRITON_PRINT_AUTOTUNING=1``)."""
    try:
        from late_interaction_kernels.fused_head import maxsim_from_hidden as lik_head
    except ImportError:
        lik_head = None
    grid = [(block_n, hb, warps, stages) for (block_n, warps), hb, stages
            in itertools.product(((64, 4), (64, 8), (128, 8)), (32, 64), (2, 3, 4))]
    totals = {}
    for name, shape in {**SHAPES, **MORE_SHAPES}.items():
        Q, H, W, b = _inputs(*shape)
        p = hidden_problem(Q, H, W, b, None, None, normalize=True, save_argmax=False)
        base = plan_forward(p, options_for(Q)).tiles
        with torch.no_grad():
            linear = do_bench(lambda: F.linear(H, W, b))
            with forced_plan(hidden_route="unfused"):
                unfused = do_bench(lambda: maxsim_from_hidden(Q, H, W, b))
            lik = (do_bench(lambda: lik_head(Q, H, W, b=b, normalize=True)) if lik_head
                   else float("nan"))
        print(f"{name}: F.linear {linear:.3f}, unfused {unfused:.3f}, LIK fused {lik:.3f}; "
              f"plan {base}", flush=True)
        if name in SHAPES:
            configs = grid
        else:  # the ten best over the sweep's shapes, by their summed ratio to the best
            configs = sorted(totals, key=totals.get)[:10]
        rows = []
        for tiles in configs:
            ms = _fused_ms(Q, H, W, b, tiles)
            if isinstance(ms, str):
                print(f"  {tiles}: {ms}", flush=True)
                totals[tiles] = float("inf")
                continue
            rows.append((ms, tiles))
        rows.sort()
        if name in SHAPES:
            for ms, tiles in rows:
                totals[tiles] = totals.get(tiles, 0.0) + ms / rows[0][0]
        for ms, tiles in rows[:12] + rows[-2:]:
            print(f"  {tiles}: {ms:.3f}", flush=True)
        del Q, H, W, b
        torch.cuda.empty_cache()
    print("best over the sweep's shapes (summed ratio to each shape's best):")
    for tiles in sorted(totals, key=totals.get)[:10]:
        print(f"  {tiles}: {totals[tiles]:.2f}")


def hidden_caps():
    """The fused forward (inference, ms) at small tiles on 4 warps under register caps that let
    three or four programs share an SM (``FwdConfig.max_registers``, forced through
    ``fwd_tiles``), beside the plan's tiles, the unfused route and LIK's fused head; each
    configuration's scores checked against the plan's tiles first (NOTES section 76)."""
    import dataclasses

    try:
        from late_interaction_kernels.fused_head import maxsim_from_hidden as lik_head
    except ImportError:
        lik_head = None
    configs = [(tiles, cap) for tiles in ((64, 64, 4, 4), (64, 32, 4, 3), (32, 64, 4, 2),
                                          (32, 32, 4, 3)) for cap in (None, 168, 128)]
    for name, shape in {**SHAPES, **MORE_SHAPES}.items():
        Q, H, W, b = _inputs(*shape)
        p = hidden_problem(Q, H, W, b, None, None, normalize=True, save_argmax=False)
        base = plan_forward(p, options_for(Q)).tiles

        def fused(tiles, cap):
            cfg = dataclasses.replace(base, block_n=tiles[0], num_warps=tiles[2],
                                      num_stages=tiles[3], max_registers=cap)
            with torch.no_grad(), forced_plan(hidden_route="fused", HIDDEN_TILES=tiles,
                                              fwd_tiles=cfg):
                return maxsim_from_hidden(Q, H, W, b)

        plan_tiles = MEASURED["HIDDEN_TILES"]
        ref = fused(plan_tiles, None)
        with torch.no_grad():
            with forced_plan(hidden_route="unfused"):
                unfused = do_bench(lambda: maxsim_from_hidden(Q, H, W, b))
            lik = (do_bench(lambda: lik_head(Q, H, W, b=b, normalize=True)) if lik_head
                   else float("nan"))
        rows = [(do_bench(lambda: fused(plan_tiles, None)), f"plan's {plan_tiles}")]
        for tiles, cap in configs:
            label = f"{tiles} cap {cap}"
            try:
                err = relative_error(fused(tiles, cap), ref)
            except Exception as exc:  # noqa: BLE001 - e.g. out of resources: reported
                print(f"  {label}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
                continue
            if not err <= 1e-3:  # the same products in the same order: equal but for near-ties
                print(f"  {label}: scores {err:.1e} off the plan's tiles: not timed", flush=True)
                continue
            rows.append((do_bench(lambda t=tiles, c=cap: fused(t, c)), label))
        print(f"{name}: unfused {unfused:.3f}, LIK fused {lik:.3f}", flush=True)
        for ms, label in sorted(rows):
            print(f"  {label}: {ms:.3f}", flush=True)
        del Q, H, W, b
        torch.cuda.empty_cache()


def hidden_step_profile():
    """A training step (forward, ``scores.sum().backward()``) of each route at a small and a
    large shape: wall ms of the forward alone and of the whole step, and the step's kernels and
    PyTorch calls by time (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    for name, shape in (("lateon-B4-Ld300", (4, 16, 32, 300, 768, 128)),
                        ("lateon-code-Nd1024-Ld2k", SHAPES["lateon-code-Nd1024-Ld2k"])):
        leaves = _inputs(*shape, grad=True)
        for route in ("fused", "unfused"):
            def fwd():
                with forced_plan(hidden_route=route):
                    return maxsim_from_hidden(*leaves)

            def step():
                for t in leaves:
                    t.grad = None
                fwd().sum().backward()

            print(f"{name} {route}: forward {do_bench(fwd):.3f} ms, step {do_bench(step):.3f} ms",
                  flush=True)
            step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                            max_name_column_width=60), flush=True)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8,
                                            max_name_column_width=60), flush=True)
        del leaves
        torch.cuda.empty_cache()


def head_backward():
    """The head's backwards alone (``torch.autograd.grad`` of a saved forward, ms): the closed
    form, the token tile kernels, the entries kernel by its tiles (entries a program at most,
    warps, stages); then the plan's kernels by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    do_bench(lambda: a @ a)  # the clocks up before the first timing
    del a
    shapes = {"lateon-B4-Ld300": (4, 16, 32, 300, 768, 128),
              "lateon-B8-Ld1k": (8, 32, 32, 1024, 768, 128),
              "lateon-code-Nd256-Ld1k": SHAPES["lateon-code-Nd256-Ld1k"],
              "lateon-code-Nd1024-Ld2k": SHAPES["lateon-code-Nd1024-Ld2k"],
              "lateon-code-edge-Nd256-Ld4k": (2, 256, 32, 4096, 384, 96),
              "inbatch-32x32-Ld300": (32, 32, 32, 300, 768, 128)}
    for name, shape in shapes.items():
        leaves = _inputs(*shape, grad=True)
        scores = maxsim_from_hidden(*leaves)
        g = torch.randn_like(scores)

        def backward(**decisions):
            with forced_plan(**decisions):
                return torch.autograd.grad(scores, leaves, g, retain_graph=True)

        rows = [(do_bench(lambda: backward(hidden_bwd_kernel="torch")), "closed form"),
                (do_bench(lambda: backward(hidden_bwd_kernel="tiles")), "tiles")]
        for tiles in itertools.product((16, 32, 64, 128), (4, 8), (1, 2)):
            label = f"entries {tiles}"
            try:
                ms = do_bench(lambda: backward(hidden_bwd_kernel="entries",
                                               HIDDEN_ENTRY_TILES=tiles))
            except Exception as exc:  # noqa: BLE001 - e.g. out of resources: reported
                print(f"  {label}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
                continue
            rows.append((ms, label))
        rows.sort()
        print(f"{name}: plan's backward {do_bench(lambda: backward()):.3f} ms", flush=True)
        for ms, label in rows[:6] + rows[-2:] + [r for r in rows if "entries" not in r[1]]:
            print(f"  {label}: {ms:.3f}", flush=True)
        backward()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                backward()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8,
                                        max_name_column_width=50), flush=True)
        del leaves, scores
        torch.cuda.empty_cache()


def head_host():
    """Where a training step's host time goes at two host-bound shapes: wall ms of the step
    and of its forward, then ``cProfile`` of 200 steps (the functions by own time)."""
    import cProfile
    import pstats

    for name, shape in (("lateon-B4-Ld300", (4, 16, 32, 300, 768, 128)),
                        ("lateon-code-Nd256-Ld1k", SHAPES["lateon-code-Nd256-Ld1k"])):
        leaves = _inputs(*shape, grad=True)

        def step():
            for t in leaves:
                t.grad = None
            maxsim_from_hidden(*leaves).sum().backward()

        fwd = do_bench(lambda: maxsim_from_hidden(*leaves))
        print(f"{name}: step {do_bench(step):.3f} ms, forward {fwd:.3f} ms", flush=True)
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            step()
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(28)
        del leaves
        torch.cuda.empty_cache()


def zero_fill():
    """``grad_H``'s zeros (bf16, the long-document shapes' sizes): ``torch.zeros`` against the
    same bytes zeroed through a 4- or 8-byte view (wider stores a thread), ms and TB/s."""
    for name, (Nq, Nd, Lq, Ld, d_model, d) in SHAPES.items():
        shape = (Nd, Ld, d_model)
        numel = Nd * Ld * d_model
        ways = {"torch.zeros": lambda: torch.zeros(shape, dtype=torch.bfloat16, device="cuda"),
                "int32 view": lambda: torch.empty(shape, dtype=torch.bfloat16, device="cuda")
                .view(torch.int32).zero_(),
                "int64 view": lambda: torch.empty(shape, dtype=torch.bfloat16, device="cuda")
                .view(torch.int64).zero_()}
        for way, fn in ways.items():
            ms = do_bench(fn)
            print(f"{name} ({numel * 2 / 1e9:.2f} GB) {way}: {ms:.3f} ms, "
                  f"{numel * 2 / ms / 1e9:.2f} TB/s", flush=True)


def _compiled_stats(label, compiled):
    """One line on a compiled kernel: registers, spills, shared memory and its PTX's products
    and copies (``wgmma``: Hopper's warp-group products; ``mma.sync``: the older ones)."""
    ptx = compiled.asm.get("ptx", "")
    counts = {k: ptx.count(k) for k in ("wgmma.mma_async", "mma.sync", "cp.async.cg",
                                        "cp.async.bulk", "ld.global", "bar.sync")}
    meta = compiled.metadata
    print(f"  {label}: warps {meta.num_warps}, stages {meta.num_stages}, shared {meta.shared}, "
          f"regs {compiled.n_regs}, spills {compiled.n_spills}; {counts}", flush=True)


def hidden_compiled():
    """The fused forward's compiled kernels beside LIK's (its autotuned pick) at 1 × 1000 ×
    300: registers, spills, shared memory, and which products and copies their PTX holds."""
    from fusedmaxsim._launch.runtime import launcher
    from fusedmaxsim.kernels.forward import _maxsim_hidden_fwd_kernel

    Q, H, W, b = _inputs(*SHAPES["rerank-1x1000-Ld300"])
    with torch.no_grad():
        for tiles in ((128, 64, 8, 4), (64, 64, 4, 4)):
            print(f"ours {tiles}: {_fused_ms(Q, H, W, b, tiles)}", flush=True)
        for key, compiled in launcher(_maxsim_hidden_fwd_kernel).compiled.items():
            _compiled_stats(f"ours {key[1].kwargs.get('BLOCK_N')}/"
                            f"{key[1].kwargs.get('HIDDEN_BLOCK')}", compiled)
        try:
            from late_interaction_kernels import fused_head
        except ImportError:
            return
        ms = do_bench(lambda: fused_head.maxsim_from_hidden(Q, H, W, b=b, normalize=True))
        print(f"LIK: {ms:.3f}", flush=True)
        fn = fused_head._fused_head_fwd_kernel.fn
        for caches in getattr(fn, "device_caches", {}).values():
            for compiled in caches[0].values():
                _compiled_stats("LIK", compiled)


# The candidates for HIDDEN_SHORT_TILES (NOTES section 80): 64-token tiles on 4 warps (two
# programs an SM) and on 8.
SHORT_TILES = ((64, 64, 4, 4), (64, 64, 8, 4))


def hidden_route_short():
    """Short documents, where the plan's 128-token tiles pad a document and the route rule's
    padding line falls (NOTES sections 78, 80). Inference at 1 x 1000 x 180-512 tokens: fused at
    the long tiles (``HIDDEN_TILES``) and at each candidate of ``SHORT_TILES``, the unfused
    route and late-interaction-kernels' fused head where it is installed, ms in five interleaved
    rounds (median), with the route and tiles the plan takes with the first candidate on; then
    training steps at two 300-token shapes, long tiles against each candidate."""
    try:
        from late_interaction_kernels.fused_head import maxsim_from_hidden as lik_head
    except ImportError:
        lik_head = None
    long = dict(HIDDEN_SHORT_TILES=None)
    shorts = {f"short {t[2]} warps": dict(HIDDEN_SHORT_TILES=t) for t in SHORT_TILES}
    for Ld in (180, 256, 300, 384, 448, 512):
        Q, H, W, b = _inputs(1, 1000, 32, Ld, 768, 128)
        p = hidden_problem(Q, H, W, b, None, None, normalize=True, save_argmax=False)
        with forced_plan(HIDDEN_SHORT_TILES=SHORT_TILES[0]):
            plan = plan_forward(p, options_for(Q))

        def call(route, tiles):
            with torch.no_grad(), forced_plan(hidden_route=route, **tiles):
                return maxsim_from_hidden(Q, H, W, b)

        ref = call("unfused", long)
        errs = [relative_error(call("fused", t), ref) for t in (long, *shorts.values())]
        if not max(errs) <= 1e-2:
            print(f"1x1000x{Ld}: fused and unfused scores disagree ({errs}); not timed",
                  flush=True)
            continue
        calls = {"fused": lambda: call("fused", long), "unfused": lambda: call("unfused", long)}
        calls.update({f"fused {k}": (lambda t=t: call("fused", t)) for k, t in shorts.items()})
        if lik_head is not None:
            calls["LIK"] = lambda: lik_head(Q, H, W, b=b, normalize=True)
        times = _interleaved_medians(calls, rounds=5)
        print(f"1x1000x{Ld} (plan with the short tiles: {plan.hidden_route}, "
              f"{plan.tiles.block_n}-token tiles): " + ", ".join(
                  f"{k} {v:.3f} ms" for k, v in times.items()), flush=True)
    for name, shape in (("lateon-B4-Ld300", (4, 16, 32, 300, 768, 128)),
                        ("rerank-1x1000-Ld300", (1, 1000, 32, 300, 768, 128))):
        leaves = _inputs(*shape, grad=True)

        def step(tiles):
            for t in leaves:
                t.grad = None
            with forced_plan(hidden_route="fused", **tiles):
                maxsim_from_hidden(*leaves).sum().backward()
            return [t.grad for t in leaves]

        base = step(long)
        errs = [relative_error_fro(x, y) for t in shorts.values() for x, y in zip(step(t), base)]
        if not max(errs) <= 1e-2:
            print(f"{name}: the short tiles' gradients off by {max(errs):.1e}; not timed",
                  flush=True)
            continue
        calls = {"long": lambda: step(long)}
        calls.update({k: (lambda t=t: step(t)) for k, t in shorts.items()})
        times = _interleaved_medians(calls, rounds=5)
        print(f"{name} step, fused: " + ", ".join(f"{k} {v:.3f} ms" for k, v in times.items()),
              flush=True)
