"""The backward: its kernels alone through the launcher (the gather kernel's grad_Q, the
winner index, the document-owned grad_D) under forced tiles, stages and strategies, and whole
training steps, with gradients checked against each other or float64 before the timing, GPU ms
of ``do_bench`` or of CUDA-graph replays in interleaved rounds, and peak memory. Every variant is
a plan made under ``fusedmaxsim.forced_plan`` (``bwd_tiles``, ``gather_step``, ``winner_index``,
``index_tiles`` and the ``MEASURED`` constants ``SCATTER_BUFFER_MAX_BYTES``, ``DD_SCAN_STAGES``,
``INDEX_SCAN``).

Backs benchmarks/NOTES.md sections 11 and 18 (``kd``), 12 (``smooth``), 14, 18 and 47
(``memory``), 16 (``stages``), 25 and 26 (``winner_index``), 44 (``gather_steps``), 45
(``dd_rows``, ``dd_steps``, ``ragged_dd``, ``large_cross``), 47 (``backward_parts``,
``backward_once``) and 51 (``mid_strategies``).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from triton.testing import do_bench

# Besides the public API, the package's private modules: the backward launcher's winner index
# and document-owned grad_D.
from fusedmaxsim import forced_plan, maxsim, maxsim_varlen, score_pairs_packed
from fusedmaxsim._launch.backward import _launch_dd, _winner_index, _winner_index_buffers
from fusedmaxsim.planning import BwdConfig
from fusedmaxsim.reference import maxsim_ref
from fusedmaxsim.testing import relative_error, relative_error_fro

from .common import (
    backward_call,
    bench,
    bf16,
    captured,
    forward_call,
    host_us_a_call,
    provider_step,
    replay_rounds,
    step_peak_and_ms,
    suite_case,
    warm_gpu,
)


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
    forward = forward_call(Q, D, save_argmax=True)
    print("fwd plan", forward.plan.kernel, forward.plan.tiles)
    print(f"fwd no argmax   {bench(forward_call(Q, D)):.4f}")
    print(f"fwd with argmax {bench(forward):.4f}")
    _, argmax = forward()
    print("bwd tiles", backward_call(g, Q, D, argmax).plan.tiles)
    for strategy in ("lowmem", "unified"):
        for need_q, need_d in ((True, False), (False, True), (True, True)):
            ms = bench(backward_call(g, Q, D, argmax, need_q=need_q, need_d=need_d,
                                     strategy=strategy))
            print(f"bwd {strategy:7s} grad_Q={need_q!s:5s} grad_D={need_d!s:5s} {ms:.4f}")
    for cfg in (BwdConfig(16, 32, 16, 128, 4, 1), BwdConfig(32, 64, 32, 128, 4, 2), BwdConfig(32, 128, 32, 128, 4, 2),
                BwdConfig(32, 64, 32, 128, 8, 2), BwdConfig(32, 256, 32, 128, 8, 2)):
        try:
            ms = bench(backward_call(g, Q, D, argmax, need_q=False, strategy="lowmem",
                                     bwd_tiles=cfg))
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


def memory() -> None:
    """train_colpali (128 x 128 tokens against 128 x 1024, bf16): peak memory above the inputs
    and time of a step, by backward strategy; "unified, one buffer" lifts the chunking."""
    Q = torch.randn(128, 128, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    D = torch.randn(128, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(128, 128, device="cuda")
    for name, strategy, forced in (("unified", "unified", {}),
                                   ("unified, one buffer", "unified",
                                    {"SCATTER_BUFFER_MAX_BYTES": 1 << 40}),
                                   ("lowmem", "lowmem", {})):
        with forced_plan(**forced):
            peak, ms = step_peak_and_ms(Q, D, g, strategy)
        print(f"{name:20s} peak {peak:6.1f} MiB  step {ms:.4f} ms")
    grads = {s: torch.autograd.grad(maxsim(Q, D, backward=s), (Q, D), g) for s in ("unified", "lowmem")}
    print("unified (chunks) against lowmem: grad_Q %.1e, grad_D %.1e" % tuple(
        relative_error(a, b) for a, b in zip(grads["unified"], grads["lowmem"])))


def gather_stages() -> None:
    """The unified backward (gather kernel only) with 1 and 2 pipeline stages."""
    for name, nq, lq, nd, ld in (("train_colbert", 128, 32, 128, 300), ("train_colpali", 128, 128, 128, 1024)):
        Q = torch.randn(nq, lq, 128, device="cuda", dtype=torch.bfloat16)
        D = torch.randn(nd, ld, 128, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(nq, nd, device="cuda")
        _, argmax = forward_call(Q, D, save_argmax=True)()
        base = backward_call(g, Q, D, argmax, strategy="unified").plan.tiles
        row = name
        for stages in (1, 2):
            ms = bench(backward_call(g, Q, D, argmax, strategy="unified",
                                     bwd_tiles=dataclasses.replace(base, num_stages=stages)))
            row += f" | stages {stages}: {ms:.4f} ms"
        print(row)


def winner_index() -> None:
    """The document-owned grad_D through the winner index (benchmarks/NOTES.md section 25) against
    the unified backward: GPU ms of each backward and of its parts, the indexed grad_D's tiles,
    agreement with unified's gradients (same argmax), bitwise reproducibility, and whole steps
    with their peak memory above the inputs. The index alone runs under a plan with
    ``winner_index=True`` forced (the small shapes' own plans have none), its variants under
    ``INDEX_SCAN`` forced (the pipeline stages of the index kernels, also varied in the records
    of sections 25 and 26, are no longer a parameter: they run at one)."""
    shapes = (("train_small_batch", 32, 32, 32, 180), ("train_colbert", 128, 32, 128, 300),
              ("train_colpali", 128, 128, 128, 1024), ("colpali 256 x 256", 256, 128, 256, 1024),
              ("colbert 512 x 512", 512, 32, 512, 300))
    for name, nq, lq, nd, ld in shapes:
        Q = torch.randn(nq, lq, 128, device="cuda", dtype=torch.bfloat16)
        D = torch.randn(nd, ld, 128, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(nq, nd, device="cuda")
        _, argmax = forward_call(Q, D, save_argmax=True)()

        def bwd(strategy, need_q=True, need_d=True, **forced):
            return backward_call(g, Q, D, argmax, need_q=need_q, need_d=need_d,
                                 strategy=strategy, **forced)

        unified, lowmem = bwd("unified")(), bwd("lowmem")()
        errors = [relative_error(a.float(), b.float()) for a, b in zip(lowmem, unified)]
        same = all(torch.equal(a, b) for a, b in zip(lowmem, bwd("lowmem")()))
        print(f"-- {name}: lowmem against unified grad_Q {errors[0]:.1e} grad_D {errors[1]:.1e}, "
              f"lowmem bitwise repeatable: {same}", flush=True)
        row = "   backward ms:"
        for label, fn in (("unified", bwd("unified")), ("lowmem", bwd("lowmem")),
                          ("unified grad_Q", bwd("unified", need_d=False)),
                          ("lowmem grad_Q", bwd("lowmem", need_d=False)),
                          ("unified grad_D", bwd("unified", need_q=False)),
                          ("lowmem grad_D", bwd("lowmem", need_q=False))):
            row += f" {label} {bench(fn):.4f} |"
        index_plan = bwd("lowmem", need_q=False, winner_index=True).plan
        base = index_plan.tiles
        buffers = _winner_index_buffers(Q, nd, -(-ld // base.block_t), index_plan.index_row_dtype)
        index_ms = bench(lambda: _winner_index(index_plan, argmax, 0, nd, buffers))
        row += f" index alone {index_ms:.4f}"
        print(row, flush=True)
        row = "   indexed grad_D tiles (block_t, block_r):"
        for block_t in (16, 32, 64):
            for block_r in (32, 64, 128):
                cfg = dataclasses.replace(base, block_t=block_t, block_r=block_r)
                ms = bench(bwd("lowmem", need_q=False, bwd_tiles=cfg))
                row += f" {block_t}x{block_r} {ms:.4f}"
        row_index = "   index variants (scan entries):"
        for scan in (1024, 4096, 256):
            plan = bwd("lowmem", need_q=False, winner_index=True, INDEX_SCAN=scan,
                       index_tiles=index_plan.index_tiles).plan
            row_index += f" {scan} {bench(lambda: _winner_index(plan, argmax, 0, nd, buffers)):.4f}"
        print(row_index, flush=True)
        for warps, stages in ((4, 1), (4, 3), (8, 2)):
            cfg = dataclasses.replace(base, num_warps=warps, num_stages=stages)
            row += f" | {warps}w{stages}s {bench(bwd('lowmem', need_q=False, bwd_tiles=cfg)):.4f}"
        print(row, flush=True)
        Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
        for strategy in ("unified", "lowmem"):
            peak, ms = step_peak_and_ms(Qg, Dg, g, strategy)
            print(f"   step {strategy:8s} {ms:.4f} ms, peak {peak:6.1f} MiB above the inputs", flush=True)
        del Q, D, Qg, Dg, argmax, buffers, unified, lowmem
        torch.cuda.empty_cache()


def _backward_inputs(q_shape, d_shape, dtype=torch.bfloat16) -> tuple:
    """Random 16-bit ``Q`` and ``D`` of these shapes (4-D ``D``: per-query candidates), an fp32
    ``grad_scores``, the forward's argmax, and the backward's tiles as the planner picks them:
    ``(Q, D, g, argmax, cfg)``, for the probes that time one backward kernel alone."""
    Q = torch.randn(*q_shape, device="cuda", dtype=dtype)
    D = torch.randn(*d_shape, device="cuda", dtype=dtype)
    g = torch.randn(q_shape[0], d_shape[-3], device="cuda")
    with torch.no_grad():
        _, argmax = forward_call(Q, D, save_argmax=True)()
    cfg = backward_call(g, Q, D, argmax, strategy="lowmem").plan.tiles
    return Q, D, g, argmax, cfg


def gather_steps() -> None:
    """The gather kernel's columns a step (benchmarks/NOTES.md section 44) on grids of few
    programs: an fp32 grad_Q alone through the backward launcher (lowmem: the gather kernel
    only) with 1-8 columns a step under 4 or 8 warps (``forced_plan(gather_step=...)``), each
    variant's grad_Q against one column a step's (bit for bit or not) and against float64, GPU
    ms of CUDA-graph replays in three interleaved rounds; then the whole training step's GPU time (forward and both gradients,
    replayed) at the suite's small training shapes under one column a step and under the
    library's pick, in interleaved rounds."""
    warm_gpu()
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
            run = backward_call(g, Q, D, argmax, need_d=False, strategy="lowmem",
                                fp32_out=True,  # fp32 grad_Q: orders compared
                                gather_step=(cols, warps))

            def call(run=run):
                return run()[0]

            try:
                outputs[(cols, warps)] = call()
                graphs[(cols, warps)] = captured(call)
            except Exception as exc:  # noqa: BLE001
                print(f"   {cols} x {warps}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        Q64 = Q.double().requires_grad_()
        (maxsim_ref(Q64, D.double()) * g.double()).sum().backward()
        reference = outputs[(1, 4)]
        programs = q_shape[0] * -(-q_shape[1] // base.block_s)
        picked = backward_call(g, Q, D, argmax, need_d=False, strategy="lowmem").plan.gather_step
        row = f"-- {label}: {programs} programs, the library picks {picked} (columns, warps)"
        for key, out in outputs.items():
            apart = relative_error(out, reference)
            row += (f"\n   {key[0]} cols x {key[1]} warps: {relative_error(out, Q64.grad):.0e} from "
                    f"float64" + (" (bit for bit with 1 x 4)" if torch.equal(out, reference) else
                                  f", {apart:.0e} from 1 x 4") + ("" if apart < 1e-5 else " PARITY FAILED"))
        row += replay_rounds(graphs, lambda key: f"{key[0]} x {key[1]} ")
        print(row, flush=True)
        del Q, D, argmax, graphs, outputs
        torch.cuda.empty_cache()

    # One column a step: the rule before section 44.
    _small_training_steps(lambda: forced_plan(gather_step=(1, None)), "one column", "library")


def _small_training_steps(before, before_label: str, after_label: str = "this tree") -> None:
    """Whole steps (forward and both gradients, CUDA-graph replays in three interleaved rounds)
    at the suite's small training shapes, captured inside the context ``before()`` against this
    tree's."""
    for name in ("train_small_batch", "train_kd", "train_kd_colpali", "train_colbert"):
        case = suite_case(name, "training")
        step = provider_step(case, "fusedmaxsim")

        def training(step=step, case=case):
            case.reset_grads()
            step()

        try:
            with before():
                old = captured(training)
            new = captured(training)
            print(f"-- {name}: whole step, GPU ms"
                  + replay_rounds({before_label: old, after_label: new}, lambda key: f"{key:10s}"),
                  flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"-- {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        case.reset_grads()
        del case
        torch.cuda.empty_cache()


def _scan_stages(stages: int):
    """A context in which the document-owned grad_D's row-scanning programs run at ``stages``
    (``forced_plan(DD_SCAN_STAGES=...)``)."""
    return forced_plan(DD_SCAN_STAGES=stages)


def dd_rows() -> None:
    """The document-owned grad_D's pipeline stages (benchmarks/NOTES.md section 45): grad_D alone
    through the backward launcher (lowmem, no grad_Q) with the scanning programs at the
    planner's one stage, at two (``8040645``'s) and at three, and under 8 warps and 256 rows
    under 8 warps; each bit for bit with two stages or not and against float64, GPU ms of
    CUDA-graph replays in three interleaved rounds (whole steps: ``dd_steps``). Record
    ``2026-12-01_e422d44`` is this probe at ``e422d44``, whose kernel also loaded a row's query
    tokens beside its argmax (not kept), against a copy of ``8040645``'s."""
    warm_gpu()
    shapes = (  # label, Q, D (4-D: per-query candidates)
        ("train_small_batch (cross, every row scanned)", (32, 32, 128), (32, 180, 128)),
        ("64 queries x 32 documents of 300 (cross, every row scanned)", (64, 32, 128), (32, 300, 128)),
        ("train_kd (candidates, rows loaded once)", (64, 32, 128), (64, 32, 300, 128)),
        ("train_kd_colpali (candidates, rows loaded once)", (32, 32, 128), (32, 16, 1030, 128)),
        ("train_colpali's shape (cross, winner index)", (128, 128, 128), (128, 1024, 128)),
    )
    for label, q_shape, d_shape in shapes:
        Q, D, g, argmax, base = _backward_inputs(q_shape, d_shape)
        variants = {  # the decisions forced_plan forces for each
            "2 stages (8040645)": {"DD_SCAN_STAGES": 2, "bwd_tiles": base},
            "this tree": {"bwd_tiles": base},
            "3 stages": {"DD_SCAN_STAGES": 3, "bwd_tiles": base},
            "8 warps": {"bwd_tiles": dataclasses.replace(base, num_warps=8)},
            "256 rows, 8 warps": {"bwd_tiles": dataclasses.replace(base, block_r=256, num_warps=8)},
        }
        outputs, graphs = {}, {}
        for name, forced in variants.items():
            run = backward_call(g, Q, D, argmax, need_q=False, strategy="lowmem", fp32_out=True,
                                **forced)

            def call(run=run):
                return run()[1]

            try:
                outputs[name] = call()
                graphs[name] = captured(call)
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
        row += replay_rounds(graphs, lambda name: f"{name:18s}")
        print(row, flush=True)
        del Q, D, D64, argmax, graphs, outputs
        torch.cuda.empty_cache()


def dd_steps() -> None:
    """Whole training steps (forward and both gradients, CUDA-graph replays in three interleaved
    rounds) with the document-owned grad_D's scanning programs at two stages (``8040645``) and at
    the launcher's one (benchmarks/NOTES.md section 45): the suite's small training shapes, then
    two large cross products under lowmem against unified."""
    warm_gpu()
    _small_training_steps(lambda: _scan_stages(2), "2 stages")

    # The large cross products, where ``auto`` takes unified (atomics) and lowmem reads its rows
    # through the winner index (section 25: lowmem 2-3% slower there, before section 44).
    for label, q_shape, d_shape in (("train_colpali", (128, 128, 128), (128, 1024, 128)),
                                    ("512 x 512 ColBERT", (512, 32, 128), (512, 300, 128))):
        Q, D = bf16(*q_shape).requires_grad_(), bf16(*d_shape).requires_grad_()
        g = torch.randn(q_shape[0], d_shape[0], device="cuda")

        def training(strategy, Q=Q, D=D, g=g):
            Q.grad = D.grad = None
            maxsim(Q, D, backward=strategy).backward(g)

        graphs = {}
        try:
            with _scan_stages(2):
                graphs["lowmem, 2 stages"] = captured(lambda: training("lowmem"))
            graphs["lowmem, this tree"] = captured(lambda: training("lowmem"))
            graphs["unified"] = captured(lambda: training("unified"))
            print(f"-- {label}: whole step, GPU ms"
                  + replay_rounds(graphs, lambda key: f"{key:17s}"), flush=True)
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
    warm_gpu()
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
    Q = bf16(sum(lq), 128).requires_grad_()
    D = bf16(sum(ld), 128).requires_grad_()
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
                graphs[name] = captured(training)
        same = torch.equal(grads["2 stages"], grads["this tree"])
        print(f"-- {label}: whole step, GPU ms; grad_D "
              + ("bit for bit with 2 stages" if same else "DIFFERS from 2 stages")
              + replay_rounds(graphs, lambda key: f"{key:10s}"), flush=True)
    except Exception as exc:  # noqa: BLE001
        print(f"-- {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)


def large_cross() -> None:
    """``auto``'s backward for in-batch (cross-product) training above the host-bound size
    (benchmarks/NOTES.md section 45): lowmem (grad_Q gathered, grad_D document-owned through the
    winner index) against unified (fp32 atomics) at five shapes from 2^34 to 2^40 multiply-adds:
    each step's peak memory above the inputs and do_bench median (eager, host included), then
    GPU ms of CUDA-graph replays in three interleaved rounds, and the gradients' distance."""
    warm_gpu()
    shapes = (
        ("train_colbert", (128, 32, 128), (128, 300, 128)),
        ("256 x 256 ColBERT", (256, 32, 128), (256, 300, 128)),
        ("train_colpali", (128, 128, 128), (128, 1024, 128)),
        ("512 x 512 ColBERT", (512, 32, 128), (512, 300, 128)),
        ("256 x 256 ColPali", (256, 128, 128), (256, 1024, 128)),
    )
    for label, q_shape, d_shape in shapes:
        Q, D = bf16(*q_shape).requires_grad_(), bf16(*d_shape).requires_grad_()
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

                graphs[strategy] = captured(training)
            row += "".join(f"\n   grad_{name} lowmem against unified: {relative_error(a, b):.0e}"
                           for name, a, b in zip("QD", grads["lowmem"], grads["unified"]))
            row += replay_rounds(graphs, lambda key: f"{key:8s}")
        except Exception as exc:  # noqa: BLE001
            row += f"\n   {type(exc).__name__}: {str(exc)[:200]}"
        print(row, flush=True)
        del Q, D, graphs, grads
        torch.cuda.empty_cache()


def backward_parts() -> None:
    """Where the lowmem backward of the large cross products goes (benchmarks/NOTES.md section
    47): GPU ms of CUDA-graph replays of the argmax forward, grad_Q alone, the winner index
    alone (both launches, all columns), the indexed grad_D given the index, and the whole
    backward, three interleaved rounds each."""
    warm_gpu()
    for shape in (("train_colpali", 128, 128, 128, 1024), ("colbert 512 x 512", 512, 32, 512, 300)):
        _backward_parts_of(*shape)
        torch.cuda.empty_cache()


def _backward_parts_of(name: str, nq: int, lq: int, nd: int, ld: int) -> None:
    Q, D, g, argmax, cfg = _backward_inputs((nq, lq, 128), (nd, ld, 128))
    n_tiles = -(-ld // cfg.block_t)
    # The index of every column in one chunk, under a plan that has one (winner_index forced).
    index_plan = backward_call(g, Q, D, argmax, need_q=False, strategy="lowmem",
                               winner_index=True).plan
    buffers = _winner_index_buffers(Q, nd, n_tiles, index_plan.index_row_dtype)
    grad_d = torch.empty_like(D)
    _winner_index(index_plan, argmax, 0, nd, buffers)
    fp32_precision = "tf32"

    def bwd(need_q=True, need_d=True):
        return backward_call(g, Q, D, argmax, need_q=need_q, need_d=need_d, strategy="lowmem")

    parts = {
        "forward with argmax": forward_call(Q, D, save_argmax=True),
        "grad_Q alone": bwd(need_d=False),
        "index alone": lambda: _winner_index(index_plan, argmax, 0, nd, buffers),
        "indexed grad_D alone": lambda: _launch_dd(
            index_plan, g, Q, None, argmax, grad_d, False, fp32_precision, 0, nd, *buffers),
        "grad_D with its index": bwd(need_q=False),
        "whole backward": bwd(),
    }
    graphs = {label: captured(fn) for label, fn in parts.items()}
    print(f"-- {name} (index of {nd} columns in one chunk; the library chunks it by "
          f"{index_plan.index_cols}):"
          + replay_rounds(graphs, lambda label: f"{label:22s}"), flush=True)


def backward_once() -> None:
    """One lowmem backward at train_colpali's shape after one warm-up, for a kernel profiler
    (``ncu -k regex:'_tile_|_maxsim_bwd' python3 benchmarks/probes backward_once``)."""
    Q, D = bf16(128, 128, 128), bf16(128, 1024, 128)
    g = torch.randn(128, 128, device="cuda")
    _, argmax = forward_call(Q, D, save_argmax=True)()
    backward = backward_call(g, Q, D, argmax, strategy="lowmem")
    for _ in range(2):
        backward()
    torch.cuda.synchronize()


def mid_strategies() -> None:
    """The two backward strategies of cross products between ``HOST_BOUND_MACS`` and
    ``LOWMEM_CROSS_MACS``, where ``auto`` takes unified (benchmarks/NOTES.md section 51): for
    each shape, both strategies' gradients against float64 (Frobenius), GPU ms of CUDA-graph
    replays of the whole step, the eager step (do_bench: the host included) and the host's µs
    to issue one step (100 steps back to back, then one synchronize), three interleaved rounds."""
    warm_gpu()
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
        graphs[f"{strategy:8s} step replays"] = captured(step)
    row += replay_rounds(graphs, lambda key: key)
    for _ in range(3):
        for strategy, step in steps.items():
            row += (f"\n   {strategy:8s} eager step (do_bench) {bench(step):.4f}, issue "
                    f"{host_us_a_call(step):.1f} us")
    print(row, flush=True)
