import os, sys, time, json
sys.path.insert(0, "src")
import torch, triton
import fusedmaxsim as fm
from fusedmaxsim.reference import maxsim_ref
from triton.testing import do_bench
torch.manual_seed(0)
dev = "cuda"
print(torch.__version__, triton.__version__, torch.cuda.get_device_name())

def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()

# parity
for dt in [torch.bfloat16, torch.float16, torch.float32]:
    for (Nq, Lq, Dshape, norm) in [(3, 7, (5, 13, 96), False), (4, 32, (6, 300, 128), True), (2, 1030, (3, 200, 128), False), (5, 33, (5, 4, 77, 64), False), (2, 128, (3, 2048, 128), False), (3, 7, (5,13,320), False)]:
        for strat in ["unified", "lowmem"]:
            Q = torch.randn(Nq, Lq, Dshape[-1], device=dev, dtype=dt, requires_grad=True)
            D = torch.randn(*Dshape, device=dev, dtype=dt, requires_grad=True)
            qm = torch.rand(Nq, Lq, device=dev) > 0.2
            dm = torch.rand(*Dshape[:-1], device=dev) > 0.2
            try:
                out = fm.maxsim(Q, D, qm, dm, normalize=norm, backward=strat)
                ref = maxsim_ref(Q.double(), D.double(), qm, dm, normalize=norm)
                g = torch.randn_like(out)
                gq, gd = torch.autograd.grad(out, (Q, D), g)
                rq, rd = torch.autograd.grad(ref, (Q, D), g.double())
                print(f"{str(dt):15s} Nq={Nq} Lq={Lq} D={Dshape} norm={norm} {strat:8s} fwd {rel(out, ref):.1e} gq {rel(gq, rq):.1e} gd {rel(gd, rd):.1e}")
            except Exception as e:
                print("FAIL", dt, Nq, Lq, Dshape, strat, repr(e)[:2000])

def naive(Q, D, dm=None):
    s = torch.einsum("ash,bth->abst", Q, D)
    if dm is not None:
        s = s.masked_fill(~dm[None, :, None, :], float("-inf"))
    return s.amax(-1).sum(-1)

shapes = [("rerank_colbert", 1, 1000, 32, 300, False), ("rerank_colpali", 1, 1000, 128, 1024, False), ("rerank_colpali_1030", 1, 1000, 1030, 1030, False),
          ("batch_colbert", 256, 256, 32, 300, False), ("longdoc", 16, 32, 32, 8192, False), ("longquery", 4, 64, 2048, 1024, False), ("small_batch", 32, 32, 32, 180, False),
          ("train_colbert", 128, 128, 32, 300, True), ("train_colpali", 128, 128, 128, 1024, True), ("train_small_batch", 32, 32, 32, 180, True)]
for name, Nq, Nd, Lq, Ld, train in shapes:
    Q = torch.nn.functional.normalize(torch.randn(Nq, Lq, 128, device=dev), dim=-1).bfloat16()
    D = torch.nn.functional.normalize(torch.randn(Nd, Ld, 128, device=dev), dim=-1).bfloat16()
    if train:
        Q.requires_grad_(); D.requires_grad_()
        g = torch.randn(Nq, Nd, device=dev)
        res = {}
        for strat in ["unified", "lowmem"]:
            f = lambda: torch.autograd.grad(fm.maxsim(Q, D, backward=strat), (Q, D), g)
            res[strat] = do_bench(f, warmup=25, rep=100)
        fn = lambda: torch.autograd.grad(naive(Q, D), (Q, D), g)
        try:
            res["naive"] = do_bench(fn, warmup=25, rep=100)
        except Exception as e:
            res["naive"] = str(e)[:50]
        ff = lambda: fm.maxsim(Q, D)
        res["fwd_only"] = do_bench(ff, warmup=25, rep=100)
    else:
        with torch.no_grad():
            res = {"fused": do_bench(lambda: fm.maxsim(Q, D), warmup=25, rep=100), "naive": do_bench(lambda: naive(Q, D), warmup=25, rep=100)}
    print(name, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()})
# host overhead
Q = torch.randn(32, 32, 128, device=dev).bfloat16(); D = torch.randn(32, 180, 128, device=dev).bfloat16()
with torch.no_grad():
    for _ in range(10): fm.maxsim(Q, D)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(200): fm.maxsim(Q, D)
    torch.cuda.synchronize(); print("wall per call us", (time.perf_counter() - t) / 200 * 1e6)
