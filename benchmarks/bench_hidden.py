"""The fused projection head against late-interaction-kernels and the unfused chain.

``maxsim_from_hidden(Q, H_d, W, b)`` = ``maxsim(Q, F.normalize(F.linear(H_d, W, b)))``, bf16
inputs (queries normalized, ``W`` scaled by ``1/√d_model``, a small bias), providers:

* ``fusedmaxsim``: ``fusedmaxsim.maxsim_from_hidden``, the route the plan picks;
* ``fused`` and ``unfused``: the same call with the route forced (``forced_plan(hidden_route=)``);
* ``closed form``, ``tiles backward`` and ``entries backward`` (training only): the plan's
  forward with the backward's PyTorch closed form, its token tile kernels or its entries kernel
  forced (``forced_plan(hidden_bwd_kernel="torch" | "tiles" | "entries")``), against the
  plan's choice;
* ``chain``: our unfused chain, ``F.linear`` → ``F.normalize`` → ``fusedmaxsim.maxsim``;
* ``lik``: late-interaction-kernels 0.4.5 ``fused_head.maxsim_from_hidden`` where importable.

Sections: ``train`` (forward + ``scores.sum().backward()`` to Q, H_d, W and b: the shapes of
late-interaction-kernels' ``bench_fused_head_train.py``, LateOn d_model 768 → 128 and
LateOn-Code-edge 384 → 96, Lq 32) and ``infer`` (forward under ``no_grad``: one query against
1000 documents of 300 tokens, d_model 768, and the train shapes' forwards).

Every provider passes a parity gate first, against the float64 chain on the same inputs (the
projection rounded to bf16 as F.linear's output, gradients straight through the rounding):
scores at most 2e-2 relative (max norm), each gradient at most 0.25 (Frobenius); one that fails
is recorded with its error and not timed. The gradients' gate is loose because the chain and
late-interaction-kernels round the normalized projection to bf16 (``F.normalize``'s output), which
moves near-tie winners, each moving a whole gradient row: they land 0.01-0.2 off float64 where
fusedmaxsim, whose similarities come from the unrounded normalized tokens, lands near 2e-3; a
wrong gradient (a missing Jacobian, a wrong row) would land far above the gate. Every error is
recorded.
Times: ``triton.testing.do_bench`` medians (ms), the providers in interleaved rounds, each round
in another order, the median of the rounds.
Peak memory: ``torch.cuda.max_memory_allocated`` during one step, less what was allocated before
it (the inputs), in MiB.

    PYTHONPATH=src python benchmarks/bench_hidden.py --out DIR
    PYTHONPATH=src python benchmarks/bench_hidden.py --quick --device cpu --out DIR   # smoke run

Writes ``hidden_bench.json`` and ``hidden_bench.md`` into ``--out`` (rewritten after each case).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.records import environment  # noqa: E402
from harness.timing import median_call_ms  # noqa: E402

from fusedmaxsim import forced_plan, maxsim, maxsim_from_hidden  # noqa: E402
from fusedmaxsim.reference import maxsim_ref  # noqa: E402
from fusedmaxsim.testing import relative_error, relative_error_fro  # noqa: E402

TOL = 2e-2
GRAD_TOL = 0.25
# (label, Nq, Nd, Lq, Ld, d_model, d): late-interaction-kernels' bench_fused_head_train.py.
TRAIN = [
    ("lateon-B4-Ld300", 4, 16, 32, 300, 768, 128),
    ("lateon-B8-Ld1k", 8, 32, 32, 1024, 768, 128),
    ("lateon-code-Nd128-Ld1k", 4, 128, 32, 1024, 768, 128),
    ("lateon-code-Nd256-Ld1k", 2, 256, 32, 1024, 768, 128),
    ("lateon-code-Nd512-Ld2k", 1, 512, 32, 2048, 768, 128),
    ("lateon-code-Nd1024-Ld2k", 1, 1024, 32, 2048, 768, 128),
    ("lateon-code-edge-Nd256-Ld4k", 2, 256, 32, 4096, 384, 96),
]
INFER = [("rerank-1x1000-Ld300", 1, 1000, 32, 300, 768, 128)] + TRAIN
QUICK = [("quick", 2, 3, 5, 9, 40, 24)]


def _lik():
    try:
        from late_interaction_kernels.fused_head import maxsim_from_hidden as lik
    except Exception:  # noqa: BLE001 - not installed, or not importable here
        return None
    return lik


def _providers(device, train):
    def ours(Q, H, W, b):
        return maxsim_from_hidden(Q, H, W, b)

    def closed_form(Q, H, W, b):
        return maxsim_from_hidden(Q, H, W, b)

    closed_form.step_decisions = {"hidden_bwd_kernel": "torch"}  # forward and backward

    def forced(route):
        def fn(Q, H, W, b):
            with forced_plan(hidden_route=route):
                return maxsim_from_hidden(Q, H, W, b)
        return fn

    def chain(Q, H, W, b):
        return maxsim(Q, F.normalize(F.linear(H, W, b), dim=-1))

    def backward(kernel):
        def fn(Q, H, W, b):
            return maxsim_from_hidden(Q, H, W, b)

        fn.step_decisions = {"hidden_bwd_kernel": kernel}
        return fn

    found = {"fusedmaxsim": ours, "unfused": forced("unfused"), "chain": chain}
    if train:
        found["closed form"] = closed_form
        found["tiles backward"] = backward("tiles")
        found["entries backward"] = backward("entries")
    if device.type == "cuda":
        found["fused"] = forced("fused")
    lik = _lik()
    if lik is not None and device.type == "cuda":
        found["lik"] = lambda Q, H, W, b: lik(Q, H, W, b=b, normalize=True)
    return found


def _inputs(case, device, dtype):
    _, Nq, Nd, Lq, Ld, d_model, d = case
    gen = torch.Generator(device=device).manual_seed(0)
    H = torch.randn(Nd, Ld, d_model, device=device, generator=gen).to(dtype)
    W = (torch.randn(d, d_model, device=device, generator=gen) / d_model**0.5).to(dtype)
    b = (torch.randn(d, device=device, generator=gen) * 0.01).to(dtype)
    Q = F.normalize(torch.randn(Nq, Lq, d, device=device, generator=gen), dim=-1).to(dtype)
    return Q, H, W, b


def _reference(Q, H, W, b, train):
    leaves = [t.detach().double().requires_grad_(train) for t in (Q, H, W, b)]
    P = F.linear(leaves[1], leaves[2], leaves[3])
    P = P + (P.to(H.dtype).double() - P).detach()
    scores = maxsim_ref(leaves[0], F.normalize(P, dim=-1))
    if not train:
        return scores.detach(), None
    scores.sum().backward()
    return scores.detach(), [t.grad for t in leaves]


def _peak_mib(step, device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def run_case(case, device, rounds, train, dtype):
    Q, H, W, b = _inputs(case, device, dtype)
    ref, ref_grads = _reference(Q, H, W, b, train)
    leaves = [t.detach().requires_grad_(train) for t in (Q, H, W, b)]
    label, Nq, Nd, Lq, Ld, d_model, d = case
    row = {"case": dict(label=label, Nq=Nq, Nd=Nd, Lq=Lq, Ld=Ld, d_model=d_model, d=d),
           "mode": "forward + backward" if train else "forward", "providers": {}}
    timed = {}
    for name, fn in _providers(device, train).items():
        entry = row["providers"][name] = {}

        def step(fn=fn):
            if train:
                for t in leaves:
                    t.grad = None
                with forced_plan(**getattr(fn, "step_decisions", {})):
                    fn(*leaves).sum().backward()
            else:
                with torch.no_grad():
                    fn(*leaves)

        try:
            for t in leaves:
                t.grad = None
            if train:
                with forced_plan(**getattr(fn, "step_decisions", {})):
                    out = fn(*leaves)
                    out.sum().backward()
                grads = [t.grad for t in leaves]
            else:
                with torch.no_grad():
                    out = fn(*leaves)
            errs = {"scores": relative_error(out, ref)}
            if train:
                errs.update({f"grad_{n}": relative_error_fro(g, r) if g is not None else float("inf")
                             for n, g, r in zip("QHWb", grads, ref_grads)})
            entry["errors"] = errs
            worst_grad = max((e for k, e in errs.items() if k != "scores"), default=0.0)
            if not (errs["scores"] <= TOL and worst_grad <= GRAD_TOL):
                entry["failed"] = (f"parity: scores {errs['scores']:.2e} (at most {TOL:.0e}), "
                                   f"gradients {worst_grad:.2e} (at most {GRAD_TOL})")
                continue
            entry["peak_mib"] = _peak_mib(step, device)
            timed[name] = step
        except Exception as exc:  # noqa: BLE001 - recorded, never hidden
            entry["failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    names = list(timed)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(median_call_ms(timed[name], device, warmup=10, rep=60))
    for name, ms in times.items():
        row["providers"][name]["ms"] = statistics.median(ms)
    ours = row["providers"]["fusedmaxsim"].get("ms")
    for other in ("lik", "chain", "unfused", "fused", "closed form", "tiles backward",
                  "entries backward"):
        theirs = row["providers"].get(other, {}).get("ms")
        row[f"speedup_vs_{other}"] = theirs / ours if ours and theirs else None
    del Q, H, W, b, leaves, ref, ref_grads
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _cell(p, name, key="ms", fmt=".3f"):
    v = p.get(name, {}).get(key)
    if v is None:
        return "failed" if "failed" in p.get(name, {}) else "–"
    return format(v, fmt)


def _x(row, name):
    v = row.get(f"speedup_vs_{name}")
    return f"{v:.2f}" if v else "–"


def _markdown(record) -> str:
    env = record["environment"]
    lines = ["# The fused projection head", "",
             (f"- device: {env.get('gpu') or env.get('cpu')}; torch {env.get('torch')}, "
              f"triton {env.get('triton')}; late-interaction-kernels "
              f"{env.get('late_interaction_kernels')}; git {env.get('git_sha')}"),
             "- bf16 inputs, normalize=True, bias; ms = median of interleaved do_bench rounds; "
             "MiB = peak allocated during one step beyond the inputs",
             f"- parity against the float64 chain before timing: scores at most {TOL:.0e} "
             f"(max norm), gradients at most {GRAD_TOL} (Frobenius; bench_hidden.py says why)"]
    for section, title in (("train", "Training step (forward + backward)"),
                           ("infer", "Inference (forward)")):
        rows = record[section]
        if not rows:
            continue
        lines += ["", f"## {title}", "",
                  ("| shape | Nq × Nd, Ld, d_model→d | fusedmaxsim (route) | fused | unfused | "
                   "closed form | tiles backward | entries backward | chain | LIK | × LIK | "
                   "× chain | MiB ours / chain / LIK |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in rows:
            c, p = row["case"], row["providers"]
            route = p["fusedmaxsim"].get("route", "")
            lines.append(
                f"| {c['label']} | {c['Nq']} × {c['Nd']}, {c['Ld']}, {c['d_model']}→{c['d']} | "
                f"{_cell(p, 'fusedmaxsim')}{f' ({route})' if route else ''} | "
                f"{_cell(p, 'fused')} | {_cell(p, 'unfused')} | {_cell(p, 'closed form')} | "
                f"{_cell(p, 'tiles backward')} | {_cell(p, 'entries backward')} | "
                f"{_cell(p, 'chain')} | "
                f"{_cell(p, 'lik')} | {_x(row, 'lik')} | {_x(row, 'chain')} | "
                f"{_cell(p, 'fusedmaxsim', 'peak_mib', '.0f')} / "
                f"{_cell(p, 'chain', 'peak_mib', '.0f')} / {_cell(p, 'lik', 'peak_mib', '.0f')} |")
        lines += ["", "Errors against float64 (and failures):", ""]
        for row in rows:
            parts = []
            for name, v in row["providers"].items():
                errs = v.get("errors", {})
                text = ", ".join(f"{k} {e:.1e}" for k, e in errs.items())
                parts.append(f"{name}: {text}" + (f" ({v['failed']})" if "failed" in v else ""))
            lines.append(f"- {row['case']['label']}: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sections", default="train,infer")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"environment": environment(device), "train": [], "infer": []}
    from fusedmaxsim.planning import recording

    for section in args.sections.split(","):
        for case in QUICK if args.quick else (TRAIN if section == "train" else INFER):
            row = run_case(case, device, args.rounds, section == "train", dtype)
            Q, H, W, b = _inputs(case, device, dtype)
            with torch.no_grad(), recording() as plans:
                maxsim_from_hidden(Q, H, W, b)
            routes = [plan.hidden_route for _, plan in plans if getattr(plan, "hidden_route", "")]
            if section == "train":  # and the backward's
                leaves = [t.detach().requires_grad_() for t in (Q, H, W, b)]
                with recording() as plans:
                    maxsim_from_hidden(*leaves).sum().backward()
                routes += [{"torch": "closed form"}.get(plan.kernel, f"{plan.kernel} backward")
                           for _, plan in plans if getattr(plan, "hidden_cols", 0)][:1]
            row["providers"]["fusedmaxsim"]["route"] = ", ".join(r for r in routes if r) or None
            record[section].append(row)
            (out / "hidden_bench.json").write_text(json.dumps(record, indent=1, default=str))
            (out / "hidden_bench.md").write_text(_markdown(record))
            print(f"hidden bench: {section} {case[0]} done", flush=True)
    print(_markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
