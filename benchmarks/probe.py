"""Kernel-level probes behind benchmarks/NOTES.md sections 10-12: the normalize-from-tiles
forward under forced tile configurations, the forward/backward split of the per-query candidate
training shape, and the smooth max against colpali-engine's einsum + logsumexp. GPU times by
``triton.testing.do_bench`` (median, ms).

    PYTHONPATH=src python3 benchmarks/probe.py [normalize] [kd] [smooth]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from fusedmaxsim import _launch, maxsim  # noqa: E402
from fusedmaxsim._configs import BwdConfig, FwdConfig, bwd_config, forced_configs, fwd_config  # noqa: E402
from fusedmaxsim.reference import maxsim_ref  # noqa: E402
from fusedmaxsim.testing import relative_error  # noqa: E402


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
    """train_kd_colpali: 32 queries of 32 tokens, 16 candidates of 1030 tokens each, bf16."""
    Q = torch.randn(32, 32, 128, device="cuda", dtype=torch.bfloat16)
    D = torch.randn(32, 16, 1030, 128, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(32, 16, device="cuda")
    print("fwd config", fwd_config(Lq=32, dim=128, Nq=32, per_query_docs=True, elem_bytes=2))
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


if __name__ == "__main__":
    wanted = set(sys.argv[1:]) or {"normalize", "kd", "smooth"}
    if "normalize" in wanted:
        normalize_sweep()
    if "kd" in wanted:
        kd_split()
    if "smooth" in wanted:
        smooth_vs_naive()
