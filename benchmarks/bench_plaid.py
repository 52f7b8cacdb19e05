"""PLAID scoring against late-interaction-kernels: fusedmaxsim.plaid.maxsim_residual and
plaid_approx_score.

Random PLAID documents (centroid ids, 2- or 4-bit residual codes in LIK's little-endian bit
order, fp16 centroids, fp32 bucket weights, lengths 50-100% of ``Ld``) scored by one to 32
queries of 32 tokens, d = 128, normalized, inference:

* ``fusedmaxsim``: the Triton forward, each document tile decompressed on chip;
* ``fusedmaxsim torch``: the same call on the PyTorch path (blocks decompressed, then scored);
* ``lik``: late-interaction-kernels 0.4.5 ``plaid.maxsim_residual`` where it is importable;
* ``fusedmaxsim varlen`` and ``lik varlen``: the same documents packed back to back (the on-disk
  layout), ``maxsim_residual_varlen`` of each (LIK's given ``max_seqlen_d``);
* ``naive``: decompress every document (``decompress_residuals``), normalize, einsum, max, sum,
  in chunks of documents.

The approximate score (``--sections approx``; IVF pruning, ``plaid_approx_score``): the
centroid scores ``centroids @ Qᵀ`` of one to 32 queries of 32 tokens against 4096 normalized
centroids (fp16, as PLAID engines write them), 5,000-25,000 documents of 200-512 tokens:

* ``fusedmaxsim``: the Triton gather kernel on the fp16 scores; ``fusedmaxsim fp32`` on the same
  scores in fp32 (late-interaction-kernels' input); ``fusedmaxsim torch``: the PyTorch path;
* ``lik``: late-interaction-kernels' ``plaid.plaid_approx_score`` (fp32 scores, one query a
  call: called once per query) where it is importable;
* ``naive``: gather, mask, max, sum in PyTorch, in chunks of documents.

Every provider passes a parity gate first: its scores against a float64-accumulated reference
of the same decompressed tokens, relative max-norm error at most 5e-3 (the approximate scores:
against ``reference.plaid_approx_score_ref``, at most 1e-5, their maxima being exact); one that
fails is recorded with its error and not timed. Times: ``triton.testing.do_bench`` medians (ms),
providers in interleaved rounds, each round in another order, the median of the rounds.

    PYTHONPATH=src python benchmarks/bench_plaid.py --out DIR                     # both sections
    PYTHONPATH=src python benchmarks/bench_plaid.py --sections approx --out DIR
    PYTHONPATH=src python benchmarks/bench_plaid.py --quick --device cpu --out DIR   # smoke run

Writes ``plaid_bench.json`` and ``plaid_bench.md`` into ``--out`` (rewritten after every case;
the residual rows under ``rows``, the approximate scores' under ``approx_rows``).
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

from fusedmaxsim import forced_plan  # noqa: E402
from fusedmaxsim.plaid import (  # noqa: E402
    decompress_residuals,
    maxsim_residual,
    maxsim_residual_varlen,
    plaid_approx_score,
)
from fusedmaxsim.reference import plaid_approx_score_ref  # noqa: E402

TOL = 5e-3
# (documents, tokens a document, queries, nbits): late-interaction-kernels' table's range.
CASES = [(5000, 200, 1, 2), (5000, 200, 32, 2), (5000, 512, 1, 4), (5000, 512, 32, 4),
         (25000, 200, 1, 2), (25000, 200, 32, 4)]
QUICK = [(40, 30, 2, 2), (40, 30, 2, 4)]
APPROX_TOL = 1e-5
# (documents, tokens a document, queries): late-interaction-kernels' range, 4096 centroids, Lq 32.
APPROX_CASES = [(5000, 200, 1), (5000, 200, 32), (5000, 512, 1), (5000, 512, 32),
                (25000, 200, 1), (25000, 200, 32), (25000, 512, 1), (25000, 512, 32)]
APPROX_QUICK = [(40, 30, 1), (40, 30, 3)]
SECTIONS = ("residual", "approx")


def _index(Nd, Ld, nbits, device, n_centroids=4096, dim=128):
    gen = torch.Generator(device=device).manual_seed(0)
    codes = torch.randint(0, n_centroids, (Nd, Ld), device=device, generator=gen)
    residuals = torch.randint(0, 256, (Nd, Ld, dim * nbits // 8), device=device,
                              dtype=torch.uint8, generator=gen)
    centroids = F.normalize(torch.randn(n_centroids, dim, device=device, generator=gen), dim=-1)
    weights = torch.linspace(-0.05, 0.05, 1 << nbits, device=device)
    lengths = torch.randint(Ld // 2, Ld + 1, (Nd,), device=device, generator=gen)
    return codes, residuals, lengths, centroids.half(), weights


def _naive(Q, index, nbits, chunk=1000):
    codes, residuals, lengths, centroids, weights = index
    parts = []
    for j in range(0, codes.shape[0], chunk):
        D = decompress_residuals(codes[j:j + chunk], residuals[j:j + chunk], centroids, weights,
                                 nbits, bit_order="little")
        D = F.normalize(D.float(), dim=-1).to(Q.dtype)
        sim = torch.einsum("qsd,ntd->qnst", F.normalize(Q.float(), dim=-1).to(Q.dtype), D)
        valid = torch.arange(codes.shape[1], device=Q.device) < lengths[j:j + chunk, None]
        sim = sim.masked_fill(~valid[None, :, None, :], float("-inf"))
        best = sim.amax(-1).float()
        parts.append(torch.where(best == float("-inf"), 0.0, best).sum(-1))
    return torch.cat(parts, 1)


def _reference(Q, index, nbits, chunk=500):
    codes, residuals, lengths, centroids, weights = index
    parts = []
    for j in range(0, codes.shape[0], chunk):
        D = decompress_residuals(codes[j:j + chunk], residuals[j:j + chunk], centroids, weights,
                                 nbits, bit_order="little").double()
        sim = torch.einsum("qsd,ntd->qnst", F.normalize(Q.double(), dim=-1),
                           F.normalize(D, dim=-1))
        valid = torch.arange(codes.shape[1], device=Q.device) < lengths[j:j + chunk, None]
        best = sim.masked_fill(~valid[None, :, None, :], float("-inf")).amax(-1)
        parts.append(torch.where(best == float("-inf"), 0.0, best).sum(-1))
    return torch.cat(parts, 1)


def _packed(codes, residuals, lengths):
    """The padded documents back to back (the on-disk layout) and their offsets."""
    valid = torch.arange(codes.shape[1], device=codes.device) < lengths[:, None]
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    return codes[valid], residuals[valid], cu


def _providers(index, nbits):
    codes, residuals, lengths, centroids, weights = index
    flat_codes, flat_residuals, cu = _packed(codes, residuals, lengths)
    max_len = codes.shape[1]

    def ours(Q):
        return maxsim_residual(Q, codes, residuals, lengths, centroids, weights, nbits,
                               bit_order="little")

    def ours_varlen(Q):
        return maxsim_residual_varlen(Q, flat_codes, flat_residuals, cu, centroids, weights,
                                      nbits, bit_order="little")

    def ours_torch(Q):
        with forced_plan(kernel="torch"):
            return ours(Q)

    found = {"fusedmaxsim": ours, "fusedmaxsim torch": ours_torch,
             "fusedmaxsim varlen": ours_varlen, "naive": lambda Q: _naive(Q, index, nbits)}
    try:
        from late_interaction_kernels.plaid import maxsim_residual as lik_residual
        from late_interaction_kernels.plaid import maxsim_residual_varlen as lik_varlen

        found["lik"] = lambda Q: lik_residual(Q, codes, residuals, lengths, centroids, weights,
                                              nbits, normalize=True)
        # max_seqlen_d given, as a caller that knows it would (omitted, LIK synchronizes).
        found["lik varlen"] = lambda Q: lik_varlen(Q, flat_codes, flat_residuals, cu, centroids,
                                                   weights, nbits, max_seqlen_d=max_len,
                                                   normalize=True)
    except ImportError:
        pass
    return found


def _interleaved(row, timed, rounds, device):
    """Each provider's median over ``rounds`` interleaved rounds, each round in another order,
    into ``row``, and the speedup against late-interaction-kernels."""
    names = list(timed)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(median_call_ms(timed[name], device))
    for name, ms in times.items():
        row["providers"][name]["ms"] = statistics.median(ms)
    for ours, lik, key in (("fusedmaxsim", "lik", "speedup_vs_lik"),
                           ("fusedmaxsim varlen", "lik varlen", "varlen_speedup_vs_lik")):
        ours_ms = row["providers"].get(ours, {}).get("ms")
        lik_ms = row["providers"].get(lik, {}).get("ms")
        row[key] = lik_ms / ours_ms if ours_ms and lik_ms else None


def run_case(case, device, rounds, providers=None):
    Nd, Ld, Nq, nbits = case
    index = _index(Nd, Ld, nbits, device)
    gen = torch.Generator(device=device).manual_seed(1)
    Q = torch.randn(Nq, 32, 128, device=device, generator=gen).half()
    ref = _reference(Q, index, nbits)
    row = {"case": dict(Nd=Nd, Ld=Ld, Nq=Nq, Lq=32, d=128, nbits=nbits), "providers": {}}
    timed = {}
    with torch.no_grad():
        for name, fn in _providers(index, nbits).items():
            if providers is not None and name not in providers:
                continue
            entry = row["providers"][name] = {}
            try:
                out = fn(Q)
                err = ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                entry["error"] = err
                if not err <= TOL:
                    entry["failed"] = f"parity: {err:.2e} > {TOL:.0e}"
                    continue
                timed[name] = lambda fn=fn: fn(Q)
            except Exception as exc:  # noqa: BLE001 - recorded, never hidden
                entry["failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        _interleaved(row, timed, rounds, device)
    return row


def _approx_inputs(Nd, Ld, Nq, device, n_centroids=4096, dim=128):
    """Centroid scores ``[Nq, n_centroids, 32]`` fp16 (normalized centroids against normalized
    query tokens, as an engine computes them), padded ids ``[Nd, Ld]`` (int64), lengths 50-100%
    of ``Ld``."""
    codes, _, lengths, centroids, _ = _index(Nd, Ld, 2, device, n_centroids, dim)
    gen = torch.Generator(device=device).manual_seed(1)
    Q = F.normalize(torch.randn(Nq, 32, dim, device=device, generator=gen), dim=-1).half()
    cs = torch.einsum("kd,qsd->qks", centroids.float(), Q.float()).half()
    return cs, codes, lengths


def _approx_naive(cs, codes, lengths, chunk=1000):
    parts = []
    for j in range(0, codes.shape[0], chunk):
        vals = cs[:, codes[j:j + chunk]].float()  # [Nq, n, Ld, Lq]
        valid = torch.arange(codes.shape[1], device=cs.device) < lengths[j:j + chunk, None]
        best = vals.masked_fill(~valid[None, :, :, None], float("-inf")).amax(2)
        parts.append(torch.where(best == float("-inf"), 0.0, best).sum(-1))
    return torch.cat(parts, 1)


def _approx_providers(cs, codes, lengths):
    cs32 = cs.float()

    def ours_torch(c):
        with forced_plan(kernel="torch"):
            return plaid_approx_score(c, codes, lengths)

    found = {"fusedmaxsim": lambda: plaid_approx_score(cs, codes, lengths),
             "fusedmaxsim fp32": lambda: plaid_approx_score(cs32, codes, lengths),
             "fusedmaxsim torch": lambda: ours_torch(cs),
             "naive": lambda: _approx_naive(cs, codes, lengths)}
    try:
        from late_interaction_kernels.plaid import plaid_approx_score as lik_approx

        # One query a call (its signature), on its documented input: fp32 scores.
        found["lik"] = lambda: torch.stack([lik_approx(cs32[q], codes, lengths)
                                            for q in range(cs32.shape[0])])
    except ImportError:
        pass
    return found


def run_approx_case(case, device, rounds, providers=None):
    Nd, Ld, Nq = case
    cs, codes, lengths = _approx_inputs(Nd, Ld, Nq, device)
    ref = plaid_approx_score_ref(cs, codes, lengths)
    row = {"case": {"Nd": Nd, "Ld": Ld, "Nq": Nq, "Lq": 32, "n_centroids": cs.shape[1]},
           "providers": {}}
    timed = {}
    with torch.no_grad():
        for name, fn in _approx_providers(cs, codes, lengths).items():
            if providers is not None and name not in providers:
                continue
            entry = row["providers"][name] = {}
            try:
                out = fn()
                err = ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                entry["error"] = err
                if not err <= APPROX_TOL:
                    entry["failed"] = f"parity: {err:.2e} > {APPROX_TOL:.0e}"
                    continue
                timed[name] = fn
            except Exception as exc:  # noqa: BLE001 - recorded, never hidden
                entry["failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        _interleaved(row, timed, rounds, device)
    return row


def _cell(providers, name):
    e = providers.get(name)
    if e is None:
        return "–"
    return f"{e['ms']:.3f}" if "ms" in e else f"✗ {e.get('failed', '')[:40]}"


def _approx_markdown(rows) -> list[str]:
    lines = ["", "## Approximate score (plaid_approx_score)", "",
             (f"- 4096 centroids, Lq = 32, scores fp16 (`fusedmaxsim fp32`, LIK: the same in "
              f"fp32), int64 ids, lengths 50-100% of Ld; parity against float64 at "
              f"{APPROX_TOL:.0e}; LIK called once per query"), "",
             ("| Nd × Ld | Nq | fusedmaxsim | fusedmaxsim fp32 | fusedmaxsim torch | LIK | naive "
              "| × LIK |"),
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        c, p = row["case"], row["providers"]
        x = f"{row['speedup_vs_lik']:.2f}" if row["speedup_vs_lik"] else "–"
        lines.append(f"| {c['Nd']} × {c['Ld']} | {c['Nq']} | {_cell(p, 'fusedmaxsim')} | "
                     f"{_cell(p, 'fusedmaxsim fp32')} | {_cell(p, 'fusedmaxsim torch')} | "
                     f"{_cell(p, 'lik')} | {_cell(p, 'naive')} | {x} |")
    lines += ["", "Errors (relative, max norm, against float64):", ""]
    for row in rows:
        errs = ", ".join(f"{k} {v['error']:.1e}" for k, v in row["providers"].items()
                         if "error" in v)
        lines.append(f"- {row['case']}: {errs}")
    return lines


def _markdown(record) -> str:
    env = record["environment"]
    lines = ["# PLAID scoring", "",
             (f"- device: {env.get('gpu') or env.get('cpu')}; torch {env.get('torch')}, "
              f"triton {env.get('triton')}; git {env.get('git_sha')}"),
             "- ms = median of interleaved do_bench rounds (CPU: of timed calls)"]
    if record["rows"]:
        lines += ["", "## Residual scoring (maxsim_residual)", "",
                  (f"- d = 128, Lq = 32, fp16 queries and centroids, normalized, inference; "
                   f"parity against float64 at {TOL:.0e}"), "",
                  ("| Nd × Ld | Nq | nbits | fusedmaxsim | fusedmaxsim torch | LIK | naive | × LIK "
                   "| varlen: fusedmaxsim | LIK | × LIK |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in record["rows"]:
        c, p = row["case"], row["providers"]
        x = f"{row['speedup_vs_lik']:.2f}" if row["speedup_vs_lik"] else "–"
        xv = row.get("varlen_speedup_vs_lik")
        lines.append(f"| {c['Nd']} × {c['Ld']} | {c['Nq']} | {c['nbits']} | "
                     f"{_cell(p, 'fusedmaxsim')} | {_cell(p, 'fusedmaxsim torch')} | "
                     f"{_cell(p, 'lik')} | {_cell(p, 'naive')} | {x} | "
                     f"{_cell(p, 'fusedmaxsim varlen')} | {_cell(p, 'lik varlen')} | "
                     f"{f'{xv:.2f}' if xv else '–'} |")
    if record["rows"]:
        lines += ["", "Errors (relative, max norm, against float64):", ""]
    for row in record["rows"]:
        errs = ", ".join(f"{k} {v['error']:.1e}" for k, v in row["providers"].items()
                         if "error" in v)
        lines.append(f"- {row['case']}: {errs}")
    if record.get("approx_rows"):
        lines += _approx_markdown(record["approx_rows"])
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--providers", default="",
                        help="comma-separated providers to run (default: every one)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, of {', '.join(SECTIONS)} (default: both)")
    args = parser.parse_args(argv)
    sections = [name for name in args.sections.split(",") if name]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    providers = [name for name in args.providers.split(",") if name] or None
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"environment": environment(device), "rows": [], "approx_rows": []}

    def write(case):
        (out / "plaid_bench.json").write_text(json.dumps(record, indent=1, default=str))
        (out / "plaid_bench.md").write_text(_markdown(record))
        print(f"plaid bench: {case} done", flush=True)

    if "residual" in sections:
        for case in QUICK if args.quick else CASES:
            record["rows"].append(run_case(case, device, args.rounds, providers))
            write(case)
    if "approx" in sections:
        for case in APPROX_QUICK if args.quick else APPROX_CASES:
            record["approx_rows"].append(run_approx_case(case, device, args.rounds, providers))
            write(("approx", *case))
    print(_markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
