"""The Triton forward: forced tiles, query chunks and register caps, document masks, and the
norms from the tiles; each variant checked against the default path (scores within 1e-6, the same
argmax) or float64 before it is timed, GPU ms by ``do_bench``.

Backs benchmarks/NOTES.md sections 10 (normalize from the tiles: ``normalize``), 13 (padded
document masks: ``masked``), 15 (small-query reranking tiles: ``rerank``, ``small``), 20 (tile
variants with registers and spills: ``fwd_tiles``), 21 (query chunk height: ``chunks``), 22 (the
query tile in registers: ``query_registers``), 23 (256-row query blocks: ``wide_rows``) and 29
(chunks split over programs, register caps: ``chunk_splits``, ``occupancy``).
"""

from __future__ import annotations

import dataclasses

import torch
from triton.testing import do_bench

# Besides the public API, the package's private modules: the launchers' runtime and kernels, the
# planner's default tiles.
from fusedmaxsim import maxsim
from fusedmaxsim._launch import runtime
from fusedmaxsim._launch.forward import inverse_norms
from fusedmaxsim._plan import fwd_heuristic
from fusedmaxsim.kernels.forward import _maxsim_fwd_kernel
from fusedmaxsim.planning import FwdConfig
from fusedmaxsim.reference import maxsim_ref
from fusedmaxsim.testing import relative_error

from .common import bench, bf16, forward_call, forward_plan


def normalize_sweep() -> None:
    """rerank_colpali_norm: 1 query of 128 tokens against 1000 pages of 1024, bf16. The tile
    variants run the forward launcher under a plan made once with ``fwd_tiles`` forced (a call
    through ``maxsim`` would plan anew on every call while forcing); the launcher under the
    library's own plan is their reference."""
    Q = torch.randn(1, 128, 128, device="cuda", dtype=torch.bfloat16)
    D = torch.randn(1000, 1024, 128, device="cuda", dtype=torch.bfloat16) * 3
    ref = maxsim_ref(Q.double(), D.double(), normalize=True)
    default = fwd_heuristic(128, 128, 1, False, 2)
    print("default", default)
    with torch.no_grad():
        print(f"no normalize            {bench(lambda: maxsim(Q, D)):.4f}")
        print(f"normalize, from tiles   {bench(lambda: maxsim(Q, D, normalize=True)):.4f}")
        q_inv = inverse_norms(Q, 1e-12)
        d_inv = inverse_norms(D, 1e-12)
        print(f"inverse norms of D      {bench(lambda: inverse_norms(D, 1e-12)):.4f}")
        print(f"fwd with given norms    "
              f"{bench(forward_call(Q, D, q_inv=q_inv, d_inv=d_inv)):.4f}")
        planned = forward_call(Q, D, norm_from_tiles=True)
        print(f"from tiles, launcher    {bench(planned):.4f} ({planned.plan.kernel}, "
              f"{planned.plan.tiles})")
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    cfg = FwdConfig(128, 1, block_n, 128, warps, stages)
                    run = forward_call(Q, D, norm_from_tiles=True, fwd_tiles=cfg)
                    try:
                        err = relative_error(run()[0], ref)
                        ms = bench(run)
                        print(f"  tiles bn={block_n:3d} w={warps} s={stages}: {ms:.4f} ms  err {err:.1e}")
                    except Exception as exc:  # noqa: BLE001
                        print(f"  tiles bn={block_n:3d} w={warps} s={stages}: {type(exc).__name__}")


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
    """Forward tiles of two reranking shapes (1 query against 1000 documents, bf16, no_grad):
    the forward launcher under the library's plan, then under plans made once with ``fwd_tiles``
    forced."""
    sweeps = {
        (32, 300): ((32, 64, 128), (2, 4), (2, 3, 4, 5)),
        (128, 1024): ((64, 128), (4, 8), (2, 3, 4)),
    }
    for (lq, ld), (block_ns, warp_counts, stage_counts) in sweeps.items():
        Q = torch.randn(1, lq, 128, device="cuda", dtype=torch.bfloat16)
        D = torch.randn(1000, ld, 128, device="cuda", dtype=torch.bfloat16)
        ref = maxsim_ref(Q.double(), D.double())
        default = fwd_heuristic(lq, 128, 1, False, 2)
        planned = forward_call(Q, D)
        with torch.no_grad():
            print(f"Lq={lq} Ld={ld} default {default}: {bench(planned):.4f} (as planned: "
                  f"{planned.plan.kernel}, {planned.plan.tiles})")
            results = []
            for block_n in block_ns:
                for warps in warp_counts:
                    for stages in stage_counts:
                        cfg = dataclasses.replace(default, block_n=block_n, num_warps=warps,
                                                  num_stages=stages)
                        run = forward_call(Q, D, fwd_tiles=cfg)
                        try:
                            err = relative_error(run()[0], ref)
                            ms = bench(run)
                        except Exception as exc:  # noqa: BLE001
                            print(f"  bn={block_n} w={warps} s={stages}: {type(exc).__name__}")
                            continue
                        results.append((ms, block_n, warps, stages, err))
            for ms, block_n, warps, stages, err in sorted(results)[:6]:
                print(f"  bn={block_n:3d} w={warps} s={stages}: {ms:.4f} ms  err {err:.1e}")


def small_tiles() -> None:
    """The forward of one 32-token query per program, the default tiles against the former
    (64-token tiles, 4 warps, 3 stages): reranking and per-query candidates, bf16, no_grad; the
    forward launcher under the library's plan and under one made once with ``fwd_tiles``
    forced."""
    old = FwdConfig(32, 1, 64, 128, 4, 3)
    for name, q_shape, d_shape in (("rerank_colbert", (1, 32, 128), (1000, 300, 128)),
                                   ("kd 64x32", (64, 32, 128), (64, 32, 300, 128)),
                                   ("kd_colpali 32x16", (32, 32, 128), (32, 16, 1030, 128))):
        Q = torch.randn(q_shape, device="cuda", dtype=torch.bfloat16)
        D = torch.randn(d_shape, device="cuda", dtype=torch.bfloat16)
        planned = forward_call(Q, D)
        with torch.no_grad():
            new_ms = bench(planned)
            old_ms = bench(forward_call(Q, D, fwd_tiles=old))
        print(f"{name:18s} default {new_ms:.4f} ms ({planned.plan.kernel}), former tiles "
              f"{old_ms:.4f} ms")


def _forward_shapes():
    """Forward-bound rows of the suite, and small grids of long documents:
    (name, Q, D, d_mask, save_argmax, normalize), bf16."""
    lengths = torch.randint(30, 301, (256,), device="cuda")
    padded = torch.arange(300, device="cuda") < lengths[:, None]
    return (
        ("train_colpali fwd", bf16(128, 128, 128), bf16(128, 1024, 128), None, True, False),
        ("train_colbert fwd", bf16(128, 32, 128), bf16(128, 300, 128), None, True, False),
        ("batch_colbert", bf16(256, 32, 128), bf16(256, 300, 128), None, False, False),
        ("batch_colbert_masked", bf16(256, 32, 128), bf16(256, 300, 128), padded, False, False),
        ("rerank_colpali_1030", bf16(1, 1030, 128), bf16(1000, 1030, 128), None, False, False),
        ("rerank_colpali", bf16(1, 128, 128), bf16(1000, 1024, 128), None, False, False),
        ("rerank_colpali_norm", bf16(1, 128, 128), bf16(1000, 1024, 128), None, False, True),
        ("longquery", bf16(4, 2048, 128), bf16(64, 1024, 128), None, False, False),
        ("longdoc", bf16(16, 32, 128), bf16(32, 8192, 128), None, False, False),
        ("kd_colpali fwd", bf16(32, 32, 128), bf16(32, 16, 1030, 128), None, True, False),
        ("small grid: 1x32 vs 100x8192", bf16(1, 32, 128), bf16(100, 8192, 128), None, False, False),
        ("small grid: 1x128 vs 64x4096", bf16(1, 128, 128), bf16(64, 4096, 128), None, False, False),
        ("small grid: 8x32 vs 64x2048", bf16(8, 32, 128), bf16(64, 2048, 128), None, False, False),
        ("small grid: 4x128 vs 32x4096 train", bf16(4, 128, 128), bf16(32, 4096, 128), None, True, False),
        ("mid grid: 16x32 vs 256x2048", bf16(16, 32, 128), bf16(256, 2048, 128), None, False, False),
    )


def forward_tiles(variants=None, chosen: bool = False) -> None:
    """Forward tiles against the default on the forward-bound rows (GPU time, ms), each checked
    first: scores within 1e-6 of the default's, the same argmax; the default against float64 on
    a slice of the queries. ``chosen``: the reference is the tiles the library's plan picks on
    this GPU (its measured variants included), not the heuristic's default. Each variant runs
    the Triton forward's launcher under ``forced_plan(fwd_tiles=...)``."""
    variants = variants or _tile_variants
    compiled = runtime.launcher(_maxsim_fwd_kernel).compiled
    for name, Q, D, d_mask, save_argmax, normalize in _forward_shapes():
        per_query_docs = D.dim() == 4
        Nq, Lq = Q.shape[0], Q.shape[1]
        if chosen:
            base = forward_plan(Q, D, None, d_mask, normalize=normalize, norm_from_tiles=normalize,
                                save_argmax=save_argmax)[2].tiles
        else:
            base = fwd_heuristic(Lq, 128, Nq, per_query_docs, 2)

        def launch(cfg):
            return forward_call(Q, D, None, d_mask, save_argmax=save_argmax,
                                norm_from_tiles=normalize, fwd_tiles=cfg)

        want_scores, want_arg = launch(base)()
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
            known = set(compiled)
            run = launch(cfg)
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


def query_registers() -> None:
    """The query tile in registers for the Hopper products (benchmarks/NOTES.md section 22),
    against the tiles the library chooses; checked and timed as ``forward_tiles`` does."""
    forward_tiles(_query_register_variants, chosen=True)


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


def query_chunks() -> None:
    """Query chunk height for queries just past a multiple of 128 rows (1030 tokens: nine
    128-row chunks hold 1152 rows, 12% of them padding; seventeen 64-row chunks hold 1088)."""
    Q = torch.randn(1, 1030, 128, device="cuda", dtype=torch.bfloat16)
    D = torch.randn(1000, 1030, 128, device="cuda", dtype=torch.bfloat16)
    base = fwd_heuristic(1030, 128, 1, False, 2)
    want = forward_call(Q, D, fwd_tiles=base)()[0]
    print(f"default {base}")
    for lq_tile, block_n, warps, stages in ((128, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 4),
                                            (64, 128, 4, 3), (64, 64, 8, 3), (64, 32, 4, 4)):
        cfg = dataclasses.replace(base, lq_tile=lq_tile, block_n=block_n, num_warps=warps,
                                  num_stages=stages)
        run = forward_call(Q, D, fwd_tiles=cfg)
        try:
            err = relative_error(run()[0], want)
            ms = bench(run)
        except Exception as exc:  # noqa: BLE001
            print(f"  rows {lq_tile} bn {block_n} w {warps} s {stages}: {type(exc).__name__}")
            continue
        print(f"  rows {lq_tile} bn {block_n} w {warps} s {stages}: {ms:.4f} ms  (vs default {err:.0e})",
              flush=True)


def chunk_splits_ab() -> None:
    """Query chunks split over neighbouring programs (benchmarks/NOTES.md section 29) against one
    program walking every chunk of its (document, query block): GPU ms of the forward (the partial
    scores' sum included), scores and argmax compared. The forward is the one the library plans
    (Gluon or Triton), its chunk splits forced both ways (``forced_plan(splits=...)``), whatever
    the plan would choose."""
    shapes = (
        ("rerank_colpali_1030", bf16(1, 1030, 128), bf16(1000, 1030, 128), False),
        ("longquery", bf16(4, 2048, 128), bf16(64, 1024, 128), False),
        ("1 x 512 against 1000 x 1024", bf16(1, 512, 128), bf16(1000, 1024, 128), False),
        ("1 x 1030 against 16 x 1030", bf16(1, 1030, 128), bf16(16, 1030, 128), False),
        ("training fwd 16 x 1030 against 64 x 1030", bf16(16, 1030, 128), bf16(64, 1030, 128), True),
        ("kd fwd 8 x 300 against 8 x 32 x 1030", bf16(8, 300, 128), bf16(8, 32, 1030, 128), True),
    )
    props = torch.cuda.get_device_properties(0)
    print(f"  L2 {props.L2_cache_size / 2**20:.0f} MiB, {props.multi_processor_count} SMs", flush=True)
    for name, Q, D, save_argmax in shapes:
        cfg = forward_plan(Q, D, save_argmax=save_argmax)[2].tiles
        splits = -(-Q.shape[1] // cfg.lq_tile)  # every chunk its own program
        split = forward_call(Q, D, save_argmax=save_argmax, splits=splits)
        one = forward_call(Q, D, save_argmax=save_argmax, splits=1)
        split_scores, split_arg = split()
        split_ms = bench(split)
        one_scores, one_arg = one()
        one_ms = bench(one)
        err = relative_error(split_scores, one_scores)
        same = bool(torch.equal(split_arg, one_arg))
        verdict = "" if err < 1e-6 and same else "  PARITY FAILED"
        print(f"  {name}: {splits} splits {split_ms:.4f} ms, one program {one_ms:.4f} ms "
              f"({split.plan.kernel}; scores {err:.0e} apart, argmax same {same}){verdict}",
              flush=True)
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
