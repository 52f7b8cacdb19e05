import os, sys, time, cProfile, pstats, io
sys.path.insert(0, "src")
import torch, triton
import torch.nn.functional as F
import fusedmaxsim as fm
from fusedmaxsim import _launch, _configs
from fusedmaxsim._configs import FwdConfig, BwdConfig, forced_configs
from triton.testing import do_bench
dev = "cuda"
B = lambda f: do_bench(f, warmup=10, rep=40)
unit = lambda *s: F.normalize(torch.randn(*s, device=dev), dim=-1).bfloat16()
def wall(f, n=300):
    for _ in range(20): f()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): f()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e6
Q = unit(32, 32, 128); D = unit(32, 180, 128)
with torch.no_grad():
    print("maxsim no_grad us", wall(lambda: fm.maxsim(Q, D)))
    print("launcher us", wall(lambda: _launch.maxsim_fwd(Q, D, None, None, None, None, False, "tf32")))
    pr = cProfile.Profile(); pr.enable()
    for _ in range(2000): _launch.maxsim_fwd(Q, D, None, None, None, None, False, "tf32")
    pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18); print(s.getvalue()[-4500:])
import triton.language as tl
@triton.jit
def _tiny(X, n):
    tl.store(X + tl.arange(0, 16), tl.zeros([16], tl.float32))
x = torch.empty(16, device=dev)
print("tiny kernel launch us", wall(lambda: _tiny[(1,)](x, 1)))
print("== lowmem dd variants (ms, grad_D only)")
for name, (Nq, Nd, Lq, Ld, cand) in {"train_colbert": (128, 128, 32, 300, False), "train_colpali": (128, 128, 128, 1024, False),
                                      "train_kd": (64, 32, 32, 300, True), "train_small": (32, 32, 32, 180, False)}.items():
    Q = unit(Nq, Lq, 128); D = unit(Nq, Nd, Ld, 128) if cand else unit(Nd, Ld, 128)
    sc, am = _launch.maxsim_fwd(Q, D, None, None, None, None, True, "tf32")
    g = torch.randn_like(sc)
    row = []
    tu = B(lambda: _launch.maxsim_bwd(g, Q, D, am, None, None, False, True, "unified", False, "tf32"))
    for v in [(64, 128, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2), (64, 128, 8, 3), (128, 128, 8, 2), (64, 32, 4, 2), (32, 128, 4, 2)]:
        cfg = BwdConfig(32, v[0], v[1], 128, v[2], v[3])
        try:
            with forced_configs(bwd=cfg):
                f = lambda: _launch.maxsim_bwd(g, Q, D, am, None, None, False, True, "lowmem", False, "tf32")
                f(); row.append(f"{v}:{B(f):.4f}")
        except Exception as e:
            row.append(f"{v}:ERR {str(e)[:50]}")
    tq = B(lambda: _launch.maxsim_bwd(g, Q, D, am, None, None, True, False, "lowmem", False, "tf32"))
    print(name, f"unified-gd {tu:.4f} lowmem-gq {tq:.4f} |", " ".join(row), flush=True)
print("== fwd with defaults now")
for name, (Nq, Nd, Lq, Ld, am) in {"rerank_colbert": (1, 1000, 32, 300, False), "batch_colbert": (256, 256, 32, 300, False), "train_colpali_fwd": (128, 128, 128, 1024, True), "rerank_1030": (1, 1000, 1030, 1030, False)}.items():
    Q = unit(Nq, Lq, 128); D = unit(Nd, Ld, 128)
    print(name, _configs.fwd_config(Lq=Lq, dim=128, Nq=Nq, per_query_docs=False, elem_bytes=2), B(lambda: _launch.maxsim_fwd(Q, D, None, None, None, None, am, "tf32")))
