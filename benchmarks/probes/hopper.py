"""The Gluon forward (``kernels.hopper_forward``: each tile's product overlapping the previous
tile's max) against the Triton forward and under forced tiles, stages, warps, query chunks and
documents a program: scores checked against the dispatched path or float64 first, GPU ms of
``do_bench`` or of CUDA-graph replays in interleaved rounds; and the host's side of its launch.
Every variant is a plan made under ``fusedmaxsim.forced_plan`` (tile sets by their ``MEASURED``
names or ``hopper_tiles``, ``docs_per_program``, ``fwd_tiles``, ``kernel``); the Triton
forward of a call is ``kernel="triton"``, or the Gluon forward turned off in the settings.

Backs benchmarks/NOTES.md sections 30 (``hopper_forward``, ``hopper_host``), 31
(``hopper_variants``), 32 (``short_query``, ``hopper_host``), 34 (``three_programs``,
``few_programs``), 36 (``half_blocks``), 38 and 41 (``doc_passes``, ``doc_waves``), 42 and 46
(``hopper_argmax``).
"""

from __future__ import annotations

import cProfile
import dataclasses
import io
import pstats

import torch
from harness.shapes import SHAPES_BY_NAME
from triton.testing import do_bench

# Besides the public API, the package's private modules: the autograd layer's plan-and-launch,
# the launchers' runtime, the Gluon layouts, the planner.
from fusedmaxsim import forced_plan, maxsim, settings
from fusedmaxsim._autograd import run_forward
from fusedmaxsim._launch import runtime
from fusedmaxsim._launch.forward import gluon_layouts
from fusedmaxsim._plan import plan_forward
from fusedmaxsim.planning import MEASURED, FwdConfig
from fusedmaxsim.reference import maxsim_ref
from fusedmaxsim.testing import relative_error

from .common import (
    NotGluon,
    bench,
    bf16,
    captured,
    forward_call,
    forward_plan,
    gluon_call,
    hopper_kernel_off,
    host_us_a_call,
    replay_rounds,
    wall_us,
    warm_gpu,
)


def _on_triton(fn):
    """``fn()``'s result and GPU ms with the Gluon forward turned off in the settings (the Triton
    kernel's), for a call that plans as it runs (``maxsim``)."""
    with hopper_kernel_off():
        return fn(), bench(fn)


def _overlap_kernel():
    """The Gluon forward's kernel (defined where Gluon is available)."""
    from fusedmaxsim.kernels import hopper_forward

    return hopper_forward._maxsim_fwd_overlap_kernel


def _gluon_against(want, Q, D, *, normalize: bool = False, **forced) -> tuple[float, float]:
    """The Gluon forward under ``forced_plan(**forced)`` (:func:`gluon_call`) into NaN-poisoned
    scores: their error against ``want``, and its GPU ms."""
    scores = torch.full_like(want, float("nan"))
    run = gluon_call(Q, D, scores, normalize=normalize, **forced)
    run()
    return relative_error(scores, want), bench(run)


def hopper_forward() -> None:
    """The Gluon forward (``kernels.hopper_forward``: each tile's product overlapping the
    previous tile's max; benchmarks/NOTES.md section 30) against the Triton forward: scores
    compared, GPU ms of each (the Gluon one under two stage counts: ``HOPPER_TILES`` and
    ``HOPPER_PACKED_TILES`` forced), and what ``maxsim`` runs."""
    shapes = (
        ("batch_colbert", bf16(256, 32, 128), bf16(256, 300, 128)),
        ("rerank_colpali", bf16(1, 128, 128), bf16(1000, 1024, 128)),
        ("rerank_colpali_1030", bf16(1, 1030, 128), bf16(1000, 1030, 128)),
        ("longquery", bf16(4, 2048, 128), bf16(64, 1024, 128)),
        ("train_colpali's shape, no_grad", bf16(128, 128, 128), bf16(128, 1024, 128)),
        ("train_colbert's shape, no_grad", bf16(128, 32, 128), bf16(128, 300, 128)),
        ("d = 64: 64 x 32 against 512 x 300", bf16(64, 32, 64), bf16(512, 300, 64)),
    )
    for name, Q, D in shapes:
        try:
            gluon_call(Q, D, torch.empty(Q.shape[0], D.shape[0], device="cuda"))
        except NotGluon as exc:
            print(f"-- {name}: the Gluon forward does not apply ({exc})", flush=True)
            continue

        def library():
            with torch.no_grad():
                return maxsim(Q, D)

        want, triton_ms = _on_triton(library)
        row = f"-- {name}: Triton {triton_ms:.4f} ms"
        for stages in (4, 3):
            tiles = (64, stages, 4, None)
            try:
                err, ms = _gluon_against(want, Q, D, HOPPER_TILES=tiles, HOPPER_PACKED_TILES=tiles)
            except Exception as exc:  # noqa: BLE001
                row += f" | Gluon {stages} stages: {type(exc).__name__}: {str(exc)[:200]}"
                continue
            row += f" | Gluon {stages} stages {ms:.4f} ms ({err:.0e} from Triton's)"
            row += "" if err < 1e-5 else " PARITY FAILED"
        got = library()
        row += f" | maxsim {bench(library):.4f} ms ({relative_error(got, want):.0e})"
        print(row, flush=True)
        del Q, D
        torch.cuda.empty_cache()


def hopper_host() -> None:
    """The host's side of the Gluon forward at rerank_colpali's shape (benchmarks/NOTES.md
    section 30): issue time of calls back to back (no synchronize), µs, for its parts; the
    planner's part is a cached plan's lookup (``plan_forward``), and a plan made anew."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    Q = torch.randn(1, 128, 128, device="cuda", dtype=torch.bfloat16)
    D = torch.randn(1000, 1024, 128, device="cuda", dtype=torch.bfloat16)
    scores = torch.empty(1, 1000, device="cuda")
    try:
        gluon = gluon_call(Q, D, scores)
    except NotGluon as exc:
        print(f"  the Gluon forward does not apply ({exc})", flush=True)
        return
    p, o = gluon.problem, gluon.options
    block_n = gluon.plan.hopper.tiles[0]
    layouts = gluon_layouts(Q.dtype, 128, block_n, 128)
    flat = D.view(-1, 128)
    on_triton = forward_call(Q, D, kernel="triton")

    def library():
        with torch.no_grad():
            maxsim(Q, D)

    def triton_library():
        with hopper_kernel_off():
            library()

    rows = (
        ("maxsim, Gluon forward", library),
        ("maxsim, Triton forward", triton_library),
        ("the plan's Gluon launch alone", gluon),
        ("forward_dense, a Triton plan", on_triton),
        ("TensorDescriptor(...) alone", lambda: TensorDescriptor(
            flat, list(flat.shape), list(flat.stride()), [block_n, 128], layouts[1])),
        ("plan_forward alone, cached", lambda: plan_forward(p, o)),
    )
    for label, fn in rows:
        print(f"  {label:32s} issue {wall_us(fn, 400, issue_only=True):7.1f} us", flush=True)
    # Any forced decision bypasses the plans' cache: this one forces what the planner uses.
    with forced_plan(HOPPER_MIN_MACS=MEASURED["HOPPER_MIN_MACS"]):
        us = wall_us(lambda: plan_forward(p, o), 400, issue_only=True)
    print(f"  {'plan_forward alone, planned anew':32s} issue {us:7.1f} us", flush=True)
    _hopper_host_parts(Q, D, gluon, library, triton_library)


def _hopper_host_parts(Q, D, gluon, library, triton_library) -> None:
    """Where the Gluon launch's host time goes (benchmarks/NOTES.md section 32): Triton's
    expansion of the TMA descriptor alone, the launch with that expansion memoized (a probe-only
    patch of Triton's driver module), and a cProfile of each forward's calls."""
    from triton.backends.nvidia import driver as nvidia_driver

    scores = torch.empty(1, D.shape[0], device="cuda")
    launch = gluon_call(Q, D, scores)
    kernel = runtime.launcher(_overlap_kernel())
    launch()
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
        launch()
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
        gluon_call(Q, D, got)()
        launch()
        torch.cuda.synchronize()
        print(f"  (memoized launch: scores {relative_error(got, scores):.0e} apart)")
        for label, fn in (("Gluon launch, memoized", launch),
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


def hopper_variants() -> None:
    """The Gluon forward, plain and normalizing (benchmarks/NOTES.md section 31), against the
    Triton forward of the same call (``kernel="triton"``): scores compared, GPU ms of each under
    several document tiles, stages and warps (``HOPPER_TILES``, ``HOPPER_NORM_TILES`` and
    ``HOPPER_PACKED_TILES`` forced), and what the forward launcher runs as planned. (Record
    ``2026-12-01_6a7deb9`` has the argmax variant too, since dropped.)"""
    shapes = (
        ("batch_colbert", False, bf16(256, 32, 128), bf16(256, 300, 128)),
        ("rerank_colpali", False, bf16(1, 128, 128), bf16(1000, 1024, 128)),
        ("longquery", False, bf16(4, 2048, 128), bf16(64, 1024, 128)),
        ("train_colpali's shape, scores", False, bf16(128, 128, 128), bf16(128, 1024, 128)),
        ("rerank_colpali_norm", True, bf16(1, 128, 128), bf16(1000, 1024, 128)),
        ("rerank_colpali_1030, normalize", True, bf16(1, 1030, 128), bf16(1000, 1030, 128)),
        ("batch_colbert, normalize", True, bf16(256, 32, 128), bf16(256, 300, 128)),
        ("longquery, normalize", True, bf16(4, 2048, 128), bf16(64, 1024, 128)),
    )
    for name, normalize, Q, D in shapes:
        try:
            gluon_call(Q, D, torch.empty(Q.shape[0], D.shape[0], device="cuda"),
                       normalize=normalize)
        except NotGluon as exc:
            print(f"-- {name}: the Gluon forward does not apply ({exc})", flush=True)
            continue
        on_triton = forward_call(Q, D, norm_from_tiles=normalize, kernel="triton")
        want, triton_ms = on_triton()[0], bench(on_triton)
        # float64 grids of 8 GiB at most
        step_docs = max(1, (1 << 30) // (Q.shape[0] * Q.shape[1] * D.shape[1]))
        ref = torch.cat([maxsim_ref(Q.double(), D[j:j + step_docs].double(), normalize=normalize)
                         for j in range(0, D.shape[0], step_docs)], dim=1)
        row = f"-- {name}: Triton {triton_ms:.4f} ms ({relative_error(want, ref):.0e} from float64)"
        for tiles in ((64, 4, 4, None), (64, 3, 4, None), (64, 5, 4, None), (32, 6, 4, None)):
            block_n, stages, warps, _ = tiles
            try:
                err, ms = _gluon_against(want, Q, D, normalize=normalize, HOPPER_TILES=tiles,
                                         HOPPER_NORM_TILES=tiles, HOPPER_PACKED_TILES=tiles)
            except Exception as exc:  # noqa: BLE001
                row += f"\n   Gluon {tiles}: {type(exc).__name__}: {str(exc)[:300]}"
                continue
            row += (f"\n   Gluon {block_n}-token tiles, {stages} stages, {warps} warps: {ms:.4f} ms, "
                    f"scores {err:.0e} from Triton's")
            row += "" if err < 1e-5 else " PARITY FAILED"
        planned = forward_call(Q, D, norm_from_tiles=normalize)
        got = planned()[0]
        row += (f"\n   forward_dense as planned ({planned.plan.kernel}) {bench(planned):.4f} ms "
                f"({relative_error(got, want):.0e})")
        print(row, flush=True)


def short_query() -> None:
    """rerank_colbert (one 32-token query against 1000 and 10000 documents of 300 tokens, bf16;
    benchmarks/NOTES.md section 32): the forward as planned (the Gluon forward's padded block,
    or the Triton kernel's 32-row tile, mma.sync), the Triton kernel with a 64-row block half
    empty (the Hopper warp-group product; ``fwd_tiles`` forced), and the Gluon forward with 64-
    and 128-row blocks (``kernel="gluon"``, ``fwd_tiles`` and ``HOPPER_PACKED_TILES`` forced);
    scores against float64, GPU ms each."""
    for n_docs in (1000, 10000):
        Q, D = bf16(1, 32, 128), bf16(n_docs, 300, 128)
        ref = maxsim_ref(Q.double(), D.double()).float()
        planned = forward_call(Q, D)
        base = planned.plan.tiles
        print(f"-- 1 x 32 tokens against {n_docs} x 300: as planned ({planned.plan.kernel}, "
              f"{base}) {bench(planned):.4f} ms, {relative_error(planned()[0], ref):.0e} from float64",
              flush=True)
        for qpb, block_n, warps, stages in ((2, 64, 4, 3), (2, 64, 4, 4), (2, 128, 4, 3),
                                            (2, 64, 8, 3), (1, 64, 2, 4), (1, 128, 4, 3)):
            cfg = FwdConfig(32, qpb, block_n, 128, warps, stages)
            run = forward_call(Q, D, fwd_tiles=cfg)
            try:
                err = relative_error(run()[0], ref)
                ms = bench(run)
                print(f"   Triton {cfg.lq_tile * qpb}-row block, bn={block_n} w={warps} s={stages}: "
                      f"{ms:.4f} ms, {err:.0e}", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"   Triton {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        scores = torch.full((1, n_docs), float("nan"), device="cuda")
        try:
            gluon_call(Q, D, scores)
        except NotGluon as exc:
            print(f"   Gluon: does not apply ({exc})", flush=True)
            continue
        for qpb in (2, 4):
            cfg = dataclasses.replace(base, queries_per_block=qpb)
            for tiles in ((64, 3, 4, None), (64, 4, 4, None), (64, 6, 4, None), (32, 6, 4, None),
                          (128, 2, 4, None)):
                try:
                    scores = torch.full((1, n_docs), float("nan"), device="cuda")
                    run = gluon_call(Q, D, scores, kernel="gluon", fwd_tiles=cfg,
                                     HOPPER_PACKED_TILES=tiles)
                    run()
                    err = relative_error(scores, ref)
                    ms = bench(run)
                    print(f"   Gluon {32 * qpb}-row block, tiles {tiles}: {ms:.4f} ms, {err:.0e}",
                          flush=True)
                except Exception as exc:  # noqa: BLE001
                    print(f"   Gluon {qpb} {tiles}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        del Q, D
        torch.cuda.empty_cache()


def _suite_shape(name: str, normalize: bool | None = None, label: str | None = None) -> tuple:
    """``(label, normalize, q_shape, d_shape)`` of the benchmark suite's shape ``name`` for the
    Gluon probes (normalized as the suite's shape is, unless ``normalize`` says otherwise;
    labelled by its name, with ", normalize" where the suite's is not)."""
    shape = SHAPES_BY_NAME[name]
    normalize = shape.normalize if normalize is None else normalize
    if label is None:
        label = name + (", normalize" if normalize and not shape.normalize else "")
    return label, normalize, shape.q_shape, shape.d_shape


def _gluon_case(normalize: bool, q_shape, d_shape) -> tuple:
    """Random bf16 ``Q`` and ``D`` of these shapes, a scores tensor for them, and the Gluon
    forward's call as planned for them into it (:func:`gluon_call`; where the plan is not the
    Gluon forward, why, as a string): ``(Q, D, scores, call)``."""
    Q, D = bf16(*q_shape), bf16(*d_shape)
    scores = torch.empty(q_shape[0], d_shape[0], device="cuda")
    try:
        return Q, D, scores, gluon_call(Q, D, scores, normalize=normalize)
    except NotGluon as exc:
        return Q, D, scores, str(exc)


def _gluon_tile_rounds(shapes, variants, with_triton: bool = False) -> None:
    """For each ``(label, normalize, q_shape, d_shape)``: the Gluon forward under the dispatched
    tiles and under each of ``variants`` (``forced_plan(hopper_tiles=...)``: the tile set
    whatever the call would pick; a variant ``(rows, tiles)`` also takes query chunks of
    ``rows``, ``fwd_tiles`` forced, split over programs as planned), each variant's scores
    against the dispatched ones (NaN-poisoned first), GPU ms of CUDA-graph replays (no host
    issue time, the chunks' sum included) in three interleaved rounds; ``with_triton``: the
    Triton kernel's forward of the same call too (``kernel="triton"``), under its own planned
    tiles."""
    for label, normalize, q_shape, d_shape in shapes:
        Q, D, scores, planned = _gluon_case(normalize, q_shape, d_shape)
        if isinstance(planned, str):
            print(f"-- {label}: the Gluon forward does not apply ({planned})", flush=True)
            continue
        cfg, dispatched = planned.plan.tiles, planned.plan.hopper.tiles
        launches: dict = {}

        def forward(variant):
            run = launches.get(variant)
            if run is None:
                rows, tiles = variant if len(variant) == 2 else (cfg.lq_tile, variant)
                run = launches[variant] = gluon_call(
                    Q, D, scores, normalize=normalize, kernel="gluon",
                    fwd_tiles=dataclasses.replace(cfg, lq_tile=rows), hopper_tiles=tiles)
            run()

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
            on_triton = forward_call(Q, D, norm_from_tiles=normalize, kernel="triton")
            triton_scores = on_triton()[0]
            row += f"\n   Triton's scores {relative_error(triton_scores, want):.0e} from the dispatched"
            graphs["Triton"] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs["Triton"]):
                on_triton()
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
    warm_gpu()
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
    warm_gpu()
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


def half_blocks() -> None:
    """A single 128-token query as two 64-row chunks, each its own program (neighbours, so the
    second reads the document's tiles from L2), with tiles small enough for three or four
    programs an SM, against the dispatched 128-row block of two programs an SM
    (benchmarks/NOTES.md section 36): the memory-bound reranks, plain and normalizing."""
    warm_gpu()
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


def doc_passes() -> None:
    """Several documents a program of the Gluon forward, one pass each, the ring running on from
    one document to the next and the query chunk loaded once
    (``forced_plan(docs_per_program=...)``), against one document a program, with the dispatched
    tiles (benchmarks/NOTES.md section 38): scores against one document a program's and float64,
    GPU ms of CUDA-graph replays in three interleaved rounds."""
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
    """``_variant_rounds`` over forced counts of documents a program
    (``forced_plan(docs_per_program=...)``), one document a program the reference; each count
    where the plan takes it; first, the count the rule picks for each shape (its plan's)."""
    for label, normalize, q_shape, d_shape in shapes:
        Q = torch.empty(q_shape, device="cuda", dtype=torch.bfloat16)
        D = torch.empty(d_shape, device="cuda", dtype=torch.bfloat16)
        plan = forward_plan(Q, D, normalize=normalize, norm_from_tiles=normalize,
                            HOPPER_MIN_MACS=0)[2]
        picked = plan.hopper.docs_per_program if plan.kernel == "gluon" else plan.kernel
        print(f"   the rule's count for {label}: {picked}", flush=True)
        del Q, D

    def applies(docs, plan):  # the count the plan takes, once forced
        return plan.hopper.docs_per_program == docs

    _variant_rounds(shapes, {docs: {"docs_per_program": docs} for docs in counts},
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
    kernel = runtime.launcher(_overlap_kernel())
    wanted = ("QUERIES_PER_BLOCK", "BLOCK_N", "NUM_STAGES", "NORMALIZE", "DOCS_PER_PROGRAM",
              "num_warps", "maxnreg")
    for (_, consts, _), compiled in kernel.compiled.items():
        print("   " + " ".join(f"{name}={consts.kwargs.get(name)}" for name in wanted)
              + f": {compiled.n_regs} registers, {compiled.metadata.shared} B shared", flush=True)


def _variant_rounds(shapes, variants: dict, reference, applies=None) -> None:
    """For each ``(label, normalize, q_shape, d_shape)``: the Gluon forward with the dispatched
    tiles under each of ``variants`` (name → the decisions ``forced_plan`` forces for it;
    ``applies(name, plan)``, when given, skips a variant whose plan it is False for), each
    variant's NaN-poisoned scores against float64 and against ``reference``'s (bit for bit or
    not), GPU ms of CUDA-graph replays in three interleaved rounds."""
    warm_gpu()
    for label, normalize, q_shape, d_shape in shapes:
        Q, D, _, planned = _gluon_case(normalize, q_shape, d_shape)
        if isinstance(planned, str):
            print(f"-- {label}: the Gluon forward does not apply ({planned})", flush=True)
            continue
        Nq = q_shape[0]
        outputs, graphs = {}, {}
        for name, forced in variants.items():
            try:
                scores = torch.full((Nq, D.shape[0]), float("nan"), device="cuda")
                run = gluon_call(Q, D, scores, normalize=normalize, **forced)
                if applies is not None and not applies(name, run.plan):
                    continue
                run()
                outputs[name] = scores
                graphs[name] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graphs[name]):
                    run()
            except Exception as exc:  # noqa: BLE001
                print(f"   {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        ref = maxsim_ref(Q.double(), D[:50].double(), normalize=normalize)
        row = f"-- {label} ({planned.plan.hopper.tiles})"
        for name, out in outputs.items():
            apart = relative_error(out, outputs[reference])
            row += (f"\n   {name}: {relative_error(out[:, :50], ref):.0e} from float64, "
                    f"{apart:.0e} from {reference}"
                    + (" (bit for bit)" if torch.equal(out, outputs[reference]) else "")
                    + ("" if apart < 1e-5 else " PARITY FAILED"))
        row += replay_rounds(graphs, lambda name: f"{str(name):12s}")
        print(row, flush=True)
        del Q, D, graphs
        torch.cuda.empty_cache()


def hopper_argmax() -> None:
    """The training forward (scores and argmax) through the Gluon kernel's coded running max
    (benchmarks/NOTES.md sections 42 and 46) against the Triton kernel's, in one process: GPU ms
    of CUDA-graph replays, the host's µs to issue one, and whole training steps (forward and
    backward, do_bench), scores
    against float64 and each other, the argmax's agreement (and, where they differ, how far
    apart the two tokens' similarities are in float64), the gradients against each other."""
    warm_gpu()
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
                # The training forward as the library runs it: the plan (cached) and its launch.
                p, o, plan = forward_plan(Q, D, save_argmax=True)
                if plan.kernel != name:
                    print(f"   ({name}: the plan is the {plan.kernel} forward: {plan.reasons[-1]})",
                          flush=True)

                def forward(p=p, o=o, Q=Q, D=D):
                    return run_forward(p, o, Q, D, None, None, None, None)
                outputs[name] = forward()
                graphs[name] = captured(forward)
                host_us[name] = host_us_a_call(forward)
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
