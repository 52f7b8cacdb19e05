import os, sys, time, itertools
sys.path.insert(0, "src")
import torch, triton
import torch.nn.functional as F
import fusedmaxsim as fm
from fusedmaxsim import _launch, _configs, _ops
from fusedmaxsim._configs import FwdConfig, BwdConfig, forced_configs
from fusedmaxsim.reference import maxsim_ref
from fusedmaxsim.testing import relative_error
from triton.testing import do_bench
torch.manual_seed(0)
dev = "cuda"
B = lambda f: do_bench(f, warmup=10, rep=40)

def unit(*s):
    return F.normalize(torch.randn(*s, device=dev), dim=-1).bfloat16()

print("== parity")
for (qs, ds, strat, norm) in [((4, 32, 128), (6, 300, 128), "unified", False), ((4, 32, 128), (6, 300, 128), "lowmem", True),
                              ((3, 37, 96), (3, 4, 53, 96), "lowmem", False), ((2, 130, 128), (5, 77, 128), "unified", False), ((2, 130, 128), (5, 77, 128), "lowmem", False)]:
    Q = torch.randn(*qs, device=dev).bfloat16().requires_grad_(); D = torch.randn(*ds, device=dev).bfloat16().requires_grad_()
    qm = torch.rand(qs[:-1], device=dev) > 0.2; dm = torch.rand(ds[:-1], device=dev) > 0.2
    out = fm.maxsim(Q, D, qm, dm, backward=strat, normalize=norm); ref = maxsim_ref(Q.double(), D.double(), qm, dm, normalize=norm)
    g = torch.randn_like(out); gq, gd = torch.autograd.grad(out, (Q, D), g)
    Q64 = Q.detach().double().requires_grad_(); D64 = D.detach().double().requires_grad_()
    rq, rd = torch.autograd.grad(maxsim_ref(Q64, D64, qm, dm, normalize=norm), (Q64, D64), g.double())
    print(qs, ds, strat, norm, f"{relative_error(out, ref):.1e} {relative_error(gq, rq):.1e} {relative_error(gd, rd):.1e}")

print("== host overhead (us per call, wall)")
def wall(f, n=300):
    for _ in range(20): f()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): f()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e6
Q = unit(32, 32, 128); D = unit(32, 180, 128)
with torch.no_grad():
    print("maxsim no_grad", wall(lambda: fm.maxsim(Q, D)))
    print("launcher direct", wall(lambda: _launch.maxsim_fwd(Q, D, None, None, None, None, False, "tf32")))
    print("torch.empty x2", wall(lambda: (torch.empty(32, 32, device=dev), torch.empty(0, device=dev, dtype=torch.int32))))
    print("naive einsum", wall(lambda: torch.einsum("ash,bth->abst", Q, D).amax(-1).sum(-1)))
Qg = Q.clone().requires_grad_(); Dg = D.clone().requires_grad_()
g = torch.randn(32, 32, device=dev)
print("train small fwd+bwd", wall(lambda: torch.autograd.grad(fm.maxsim(Qg, Dg), (Qg, Dg), g), 100))
print("train small fwd only (grad mode)", wall(lambda: fm.maxsim(Qg, Dg), 100))

print("== forward variants (ms)")
shapes = {"rerank_colbert": (1, 1000, 32, 300), "rerank_colpali": (1, 1000, 128, 1024), "rerank_1030": (1, 1000, 1030, 1030),
          "batch_colbert": (256, 256, 32, 300), "longdoc": (16, 32, 32, 8192), "longquery": (4, 64, 2048, 1024), "train_colpali_fwd": (128, 128, 128, 1024)}
variants = [None, (64, 8, 3), (128, 8, 3), (64, 4, 3), (64, 8, 4), (128, 8, 2), (32, 4, 3), (128, 4, 3)]
for name, (Nq, Nd, Lq, Ld) in shapes.items():
    Q = unit(Nq, Lq, 128); D = unit(Nd, Ld, 128)
    argm = name.startswith("train")
    base = _configs.fwd_config(Lq=Lq, dim=128, Nq=Nq, per_query_docs=False, elem_bytes=2)
    row = []
    for v in variants:
        cfg = base if v is None else FwdConfig(base.lq_tile, base.queries_per_block, v[0], 128, v[1], v[2])
        try:
            with forced_configs(cfg):
                f = lambda: _launch.maxsim_fwd(Q, D, None, None, None, None, argm, "tf32")
                f(); t = B(f)
            row.append(f"{v}:{t:.4f}")
        except Exception as e:
            row.append(f"{v}:ERR {str(e)[:60]}")
    print(name, base, "|", " ".join(row), flush=True)
# masked and normalize variants of default
Q = unit(256, 32, 128); D = unit(256, 300, 128); dm = torch.rand(256, 300, device=dev) > 0.5
with torch.no_grad():
    print("batch_colbert_masked", B(lambda: fm.maxsim(Q, D, d_mask=dm)))
Q = torch.randn(1, 128, 128, device=dev).bfloat16(); D = torch.randn(1000, 1024, 128, device=dev).bfloat16()
with torch.no_grad():
    print("rerank_colpali_norm", B(lambda: fm.maxsim(Q, D, normalize=True)))
# Lq=128 packing alternative for rerank: lq_tile 128 vs M=64
print("== backward variants (ms, bwd only)")
for name, (Nq, Nd, Lq, Ld, cand) in {"train_colbert": (128, 128, 32, 300, False), "train_colpali": (128, 128, 128, 1024, False),
                                      "train_kd": (64, 32, 32, 300, True), "train_kd_colpali": (32, 16, 32, 1030, True), "train_small": (32, 32, 32, 180, False)}.items():
    Q = unit(Nq, Lq, 128); D = unit(Nq, Nd, Ld, 128) if cand else unit(Nd, Ld, 128)
    sc, am = _launch.maxsim_fwd(Q, D, None, None, None, None, True, "tf32")
    g = torch.randn_like(sc)
    base = _configs.bwd_config(Lq=Lq, dim=128, elem_bytes=2)
    row = []
    for strat in ["unified", "lowmem"]:
        for v in [None, (16, 64, 64, 4, 2), (32, 64, 128, 4, 2), (64, 64, 128, 8, 3), (16, 128, 64, 4, 3), (32, 128, 128, 8, 2), (16, 64, 32, 2, 2), (64, 32, 64, 4, 1)]:
            cfg = base if v is None else BwdConfig(v[0], v[1], v[2], 128, v[3], v[4])
            try:
                with forced_configs(bwd=cfg):
                    f = lambda: _launch.maxsim_bwd(g, Q, D, am, None, None, True, True, strat, False, "tf32")
                    f(); t = B(f)
                row.append(f"{strat[0]}{v}:{t:.4f}")
            except Exception as e:
                row.append(f"{strat[0]}{v}:ERR {str(e)[:50]}")
    # only grad_Q and only grad_D timing for default lowmem
    tq = B(lambda: _launch.maxsim_bwd(g, Q, D, am, None, None, True, False, "lowmem", False, "tf32"))
    td = B(lambda: _launch.maxsim_bwd(g, Q, D, am, None, None, False, True, "lowmem", False, "tf32"))
    tdu = B(lambda: _launch.maxsim_bwd(g, Q, D, am, None, None, False, True, "unified", False, "tf32"))
    print(name, base, f"lowmem gq-only {tq:.4f} gd-only {td:.4f} unified gd-only {tdu:.4f} |", " ".join(row), flush=True)
