import os, sys, time
sys.path.insert(0, "src")
import torch, triton
import torch.nn.functional as F
import fusedmaxsim as fm
from fusedmaxsim import _launch, _configs
from fusedmaxsim._configs import FwdConfig, BwdConfig, forced_configs
from fusedmaxsim.reference import maxsim_ref
from fusedmaxsim.testing import relative_error
from triton.testing import do_bench
dev = "cuda"
B = lambda f: do_bench(f, warmup=10, rep=40)
unit = lambda *s: F.normalize(torch.randn(*s, device=dev), dim=-1).bfloat16()
def wall(f, n=300):
    for _ in range(20): f()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): f()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e6
# fast launch parity + overhead
Q = unit(32, 32, 128); D = unit(32, 180, 128)
for rep in range(2):
    out = fm.maxsim(Q, D)
    print("fast-launch parity", relative_error(out, maxsim_ref(Q.double(), D.double())))
with torch.no_grad():
    print("maxsim no_grad us", wall(lambda: fm.maxsim(Q, D)))
    print("launcher us", wall(lambda: _launch.maxsim_fwd(Q, D, None, None, None, None, False, "tf32")))
    _launch._launchers.clear(); os.environ["FUSEDMAXSIM_TRITON_FAST_LAUNCH"] = "0"
    print("launcher us (no fast launch)", wall(lambda: _launch.maxsim_fwd(Q, D, None, None, None, None, False, "tf32")))
    del os.environ["FUSEDMAXSIM_TRITON_FAST_LAUNCH"]; _launch._launchers.clear()
    print("naive us", wall(lambda: torch.einsum("ash,bth->abst", Q, D).amax(-1).sum(-1)))
Qg = Q.clone().requires_grad_(); Dg = D.clone().requires_grad_(); g = torch.randn(32, 32, device=dev)
print("train small fwd+bwd us", wall(lambda: torch.autograd.grad(fm.maxsim(Qg, Dg), (Qg, Dg), g), 100))
Q1 = unit(1, 32, 128); D1 = unit(1000, 300, 128)
with torch.no_grad():
    print("rerank_colbert maxsim do_bench ms", B(lambda: fm.maxsim(Q1, D1)), "wall us", wall(lambda: fm.maxsim(Q1, D1)))
print("== fwd sweep (lq_tile, qpb, block_n, warps, stages)")
shapes = {"rerank_colbert": (1, 1000, 32, 300, False), "rerank_colpali": (1, 1000, 128, 1024, False), "rerank_1030": (1, 1000, 1030, 1030, False),
          "longquery": (4, 64, 2048, 1024, False), "train_colpali_fwd": (128, 128, 128, 1024, True), "batch_colbert": (256, 256, 32, 300, False), "small_batch": (32, 32, 32, 180, False)}
for name, (Nq, Nd, Lq, Ld, am) in shapes.items():
    Q = unit(Nq, Lq, 128); D = unit(Nd, Ld, 128)
    base = _configs.fwd_config(Lq=Lq, dim=128, Nq=Nq, per_query_docs=False, elem_bytes=2)
    vs = [base]
    for bn, w, st in [(64, 4, 4), (64, 4, 2), (32, 4, 4), (128, 8, 3), (64, 8, 3)]:
        vs.append(FwdConfig(base.lq_tile, base.queries_per_block, bn, 128, w, st))
    if base.lq_tile == 128:
        vs.append(FwdConfig(64, 1, 64, 128, 4, 3)); vs.append(FwdConfig(64, 1, 64, 128, 4, 4))
    if base.queries_per_block > 1:
        vs.append(FwdConfig(base.lq_tile, max(1, base.queries_per_block // 2), 64, 128, 4, 3))
    row = []
    for cfg in vs:
        try:
            with forced_configs(cfg):
                f = lambda: _launch.maxsim_fwd(Q, D, None, None, None, None, am, "tf32")
                f(); row.append(f"({cfg.lq_tile},{cfg.queries_per_block},{cfg.block_n},{cfg.num_warps},{cfg.num_stages}):{B(f):.4f}")
        except Exception as e:
            row.append(f"ERR {str(e)[:40]}")
    print(name, " ".join(row), flush=True)
