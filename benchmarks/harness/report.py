"""The human-readable side of a record: markdown tables and the plot.

:func:`render_markdown` writes the header (device, versions, git sha, date), the times of every
provider, fusedmaxsim against the targets, the accuracy of every provider, the failed and
skipped items, and the memory-table and cold-start sections when present. :func:`write_plot`
draws the speedup over naive and the share of the floor per (shape, mode), when matplotlib is
installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .parity import GRAD_TOL
from .providers import PROVIDERS, PROVIDERS_BY_KEY
from .shapes import MODE_LABELS
from .targets import (
    FLOOR_TARGET_MIN_MS,
    TARGET_PCT_FLOOR,
    TARGET_VS_PEER,
    TARGET_WALL_US,
    TINY_FLOOR_MS,
)


def fmt_ms(x) -> str:
    if x is None:
        return "–"
    return f"{x:.3f}" if x < 100 else f"{x:.1f}"


def _num(x, fmt="{:.1f}") -> str:
    return "–" if x is None else fmt.format(x)


def _err(x) -> str:
    return "–" if x is None else f"{x:.0e}"


def _table(header: list, rows: list) -> list:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def _header_lines(env: dict) -> list:
    if env.get("gpu"):
        device = (f"- GPU: {env['gpu']} ({env.get('gpu_memory_gib')} GiB, "
                  f"sm {env.get('capability')}), driver {env.get('driver') or 'unknown'}, "
                  f"CUDA {env.get('cuda')}")
    else:
        device = f"- device: CPU, {env.get('cpu')} ({env.get('threads')} threads)"
    peers = ", ".join(f"{name} {env[key]}" for key, name in
                      (("late_interaction_kernels", "late-interaction-kernels"),
                       ("flash_maxsim", "flash-maxsim")) if env.get(key))
    sha = env.get("git_sha") or "unknown"
    if env.get("git_dirty"):
        sha += " (with uncommitted changes)"
    return [
        device,
        (f"- torch {env.get('torch')}, triton {env.get('triton') or 'not installed'}, "
         f"fusedmaxsim {env.get('fusedmaxsim')}; peers: {peers or 'none'}"),
        f"- git: {sha}",
        f"- date: {env.get('date')}",
    ]


def render_markdown(record: dict) -> str:
    suite = record.get("suite")
    env = (suite or {}).get("env") or record.get("env") or {}
    lines = ["# MaxSim benchmark", "", *_header_lines(env), ""]
    if suite:
        lines += _suite_markdown(suite)
    if record.get("memory_table"):
        lines += _memory_markdown(record["memory_table"])
    if record.get("cold_start"):
        lines += _cold_markdown(record["cold_start"])
    return "\n".join(lines) + "\n"


def _providers_in(records) -> list:
    present = {r["provider"] for r in records}
    return [p for p in PROVIDERS if p.key in present]


def _cell(record: dict | None) -> str:
    if record is None:
        return "–"
    if record["status"] == "ok":
        mark = "" if record["parity_ok"] in (True, None) else " ≠"
        return fmt_ms(record["ms"]) + mark
    return record["status"]


def _suite_markdown(suite: dict) -> list:
    settings, ceilings = suite["settings"], suite.get("ceilings")
    rounds = settings.get("rounds")
    timing = (f", in {rounds} interleaved rounds of rep / {rounds} each, each round in another "
              f"provider order, all calls pooled" if rounds else "")
    lines = [(f"Timer: {settings['timer']} (warmup {settings['warmup_ms']:g} ms, "
              f"rep {settings['rep_ms']:g} ms{timing}), median of one call in ms.")]
    if ceilings:
        lines.append(f"Ceilings measured in this run: {ceilings['matmul_tflops']:.3g} TFLOP/s "
                     f"({ceilings['matmul']} matmul), {ceilings['copy_gbps']:.4g} GB/s "
                     f"(device copy, read + write). Floor = max(flops / rate, bytes / bandwidth).")
    elif suite.get("ceilings_error"):
        lines.append(f"Ceilings not measured: {suite['ceilings_error']}")
    records = suite["records"]
    providers = _providers_in(records)
    by_item: dict = {}
    for r in records:
        by_item.setdefault((r["shape"], r["mode"]), {})[r["provider"]] = r
    shape_desc = {s["name"]: s["description"] for s in suite["shapes"]}

    lines += ["", "## Times (ms)", ""]
    rows = []
    for (shape, mode), recs in by_item.items():
        floor = next((r["floor_ms"] for r in recs.values() if r["floor_ms"] is not None), None)
        rows.append([shape, shape_desc.get(shape, ""), MODE_LABELS[mode], fmt_ms(floor),
                     *[_cell(recs.get(p.key)) for p in providers]])
    lines += _table(["shape", "layout", "mode", "floor", *[p.label for p in providers]], rows)
    lines += ["", "≠: a baseline outside the parity tolerance (timed anyway; see accuracy)."]

    lines += ["", "## fusedmaxsim against the targets", ""]
    lines += _targets_table(suite["summary"])
    geo = suite.get("geomean") or {}
    lines += ["", (f"Geometric mean speedup: {_num(geo.get('speedup_vs_peer'), '{:.2f}×')} "
                   f"against the fastest passing peer ({geo.get('n_speedup_vs_peer', 0)} shapes), "
                   f"{_num(geo.get('speedup_vs_naive'), '{:.2f}×')} against naive "
                   f"({geo.get('n_speedup_vs_naive', 0)} shapes).")]

    lines += ["", ("## Accuracy (relative error against float64: scores / gradients, max norm "
                   "(Frobenius norm))"), ""]
    rows = []
    for (shape, mode), recs in by_item.items():
        cells = []
        for p in providers:
            r = recs.get(p.key)
            if r is None or r["score_rel_err"] is None:
                cells.append("–")
                continue
            grad = max(filter(None, [r["grad_q_rel_err"], r["grad_d_rel_err"]]), default=None)
            fro = max(filter(None, [r.get("grad_q_fro_err"), r.get("grad_d_fro_err")]),
                      default=None)
            text = _err(r["score_rel_err"]) + (f" / {_err(grad)} ({_err(fro)})"
                                               if mode == "training" else "")
            cells.append(text + ("" if r["parity_ok"] else " ✗"))
        rows.append([shape, MODE_LABELS[mode], *cells])
    lines += _table(["shape", "mode", *[p.label for p in providers]], rows)
    lines += ["", ("✗: outside the tolerance (scores in the max norm 2e-2 bf16 / 5e-3 fp16 / "
                   f"1e-2 fp32; gradients in the Frobenius norm {GRAD_TOL:.0e}; a near-tie of the "
                   "max decided otherwise than in float64 moves a whole gradient row, which the "
                   "max norm reports at that row's size).")]

    problems = [r for r in records if r["status"] in ("failed", "skipped") and r["error"]]
    if problems:
        lines += ["", "## Failed and skipped", ""]
        lines += [f"- {r['shape']} {MODE_LABELS[r['mode']]} {r['provider']}: {r['status']}, "
                  f"{r['error']}" for r in problems]
    return lines + [""]


def _targets_table(summary: list) -> list:
    header = ["shape", "mode", "fusedmaxsim ms [p20, p80]", "best peer ms",
              f"× best peer (≥ {TARGET_VS_PEER})", "× naive", f"% floor (≥ {TARGET_PCT_FLOOR:.0f})",
              "wall µs/call", "TFLOP/s", "peak MiB ours / LIK / flash",
              "anchor best peer → target ms", "targets"]
    rows = []
    for row in summary:
        ours = fmt_ms(row["fusedmaxsim_ms"])
        if row["fusedmaxsim_ms"] is not None:
            ours += f" [{fmt_ms(row['fusedmaxsim_p20_ms'])}, {fmt_ms(row['fusedmaxsim_p80_ms'])}]"
        elif row["fusedmaxsim_status"]:
            ours = row["fusedmaxsim_status"]
        peer = "–"
        if row["best_peer"]:
            peer = f"{fmt_ms(row['best_peer_ms'])} ({PROVIDERS_BY_KEY[row['best_peer']].label})"
        peaks = " / ".join(_num(row["peak_mib"].get(k)) for k in ("fusedmaxsim", "lik", "flash"))
        anchor = "–"
        if row["anchor_best_peer_ms"] is not None:
            anchor = f"{fmt_ms(row['anchor_best_peer_ms'])} → {fmt_ms(row['anchor_target_ms'])}"
        rows.append([row["shape"], MODE_LABELS[row["mode"]], ours, peer,
                     _num(row["speedup_vs_peer"], "{:.2f}"),
                     _num(row["speedup_vs_naive"], "{:.2f}"),
                     _num(row["pct_floor"], "{:.0f}"), _num(row["wall_us"]),
                     _num(row["tflops"], "{:.3g}"), peaks, anchor, _targets_text(row["targets"])])
    lines = _table(header, rows)
    lines += ["", (f"Targets: peer ≥ {TARGET_VS_PEER}× the fastest passing peer; floor ≥ "
                   f"{TARGET_PCT_FLOOR:.0f}% of the roofline floor where it is ≥ "
                   f"{FLOOR_TARGET_MIN_MS * 1e3:.0f} µs; wall ≤ "
                   f"{TARGET_WALL_US['inference']:.0f} µs fwd / "
                   f"{TARGET_WALL_US['training']:.0f} µs fwd+bwd per call where the floor is "
                   f"< {TINY_FLOOR_MS * 1e3:.0f} µs; naive: never slower than naive or naive "
                   "fp32. Anchor: the fastest peer as recorded on an H200 on 2026-11-30, not in "
                   "this run.")]
    return lines


def _targets_text(targets: dict) -> str:
    names = {"vs_peer": "peer", "pct_floor": "floor", "wall_us": "wall",
             "not_slower_than_naive": "naive"}
    parts = [f"{names[k]} {'✓' if t['met'] else '✗'}" for k, t in targets.items() if t["applies"]]
    return ", ".join(parts) or "–"


def _memory_markdown(section: dict) -> list:
    lines = ["## Op-level memory: ColPali in-batch training", "",
             (f"Nq = Nd = B, Lq = {section['lq']}, Ld = {section['ld']}, {section['dtype']}: "
              "memory held from forward to backward / the backward's spike above it / total, "
              "MiB. Fused providers run one step first, so autotune buffers are not counted."),
             ""]
    if section.get("skipped"):
        return lines + [f"Skipped: {section['skipped']}", ""]
    keys = list(dict.fromkeys(r["provider"] for r in section["rows"]))
    by = {(r["batch"], r["provider"]): r for r in section["rows"]}
    rows = []
    for batch in dict.fromkeys(r["batch"] for r in section["rows"]):
        cells = []
        for key in keys:
            r = by.get((batch, key))
            if r is None or r["status"] != "ok":
                cells.append("–" if r is None else r["status"])
            else:
                cells.append(f"{r['held_mib']:.0f} / {r['spike_mib']:.0f} / {r['total_mib']:.0f}")
        rows.append([batch, *cells])
    labels = [PROVIDERS_BY_KEY[k].label + " held / spike / total" for k in keys]
    lines += _table(["B", *labels], rows)
    errors = [r for r in section["rows"] if r["error"]]
    lines += [""] + [f"- B={r['batch']} {r['provider']}: {r['status']}, {r['error']}"
                     for r in errors]
    return lines + [""]


def _cold_markdown(section: dict) -> list:
    lines = ["## Cold start", "",
             ("First call in a fresh process with an empty TRITON_CACHE_DIR (compilation and "
              "autotuning included, imports excluded), seconds; the second call in brackets. "
              "Before a training call's clock starts, torch's own first `backward(grad)` runs on "
              "a two-element graph (it imports sympy once per process); its seconds are the last "
              "column."),
             ""]
    keys = list(dict.fromkeys(r["provider"] for r in section["rows"]))
    by = {(r["shape"], r["mode"], r["provider"]): r for r in section["rows"]}
    rows = []
    for shape, mode in dict.fromkeys((r["shape"], r["mode"]) for r in section["rows"]):
        cells = []
        for key in keys:
            r = by.get((shape, mode, key))
            if r is None or r["status"] != "ok":
                cells.append("–" if r is None else r["status"])
            else:
                cells.append(f"{r['first_call_s']:.2f} ({r['second_call_s']:.4f})")
        torch_s = [r.get("torch_backward_s") for r in section["rows"]
                   if (r["shape"], r["mode"]) == (shape, mode) and r.get("torch_backward_s")]
        cells.append(" / ".join(f"{t:.2f}" for t in torch_s) or "–")
        rows.append([shape, MODE_LABELS[mode], *cells])
    lines += _table(["shape", "mode", *[PROVIDERS_BY_KEY[k].label for k in keys],
                     "torch's first backward(grad), excluded"], rows)
    errors = [r for r in section["rows"] if r["error"]]
    lines += [""] + [f"- {r['shape']} {r['provider']}: {r['status']}, {r['error']}"
                     for r in errors]
    return lines + [""]


def write_plot(record: dict, path: Path) -> Path | None:
    """Speedup over naive per provider and share of the floor, one row per (shape, mode)."""
    suite = record.get("suite")
    if not suite or not suite["records"]:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed; no plot", file=sys.stderr)
        return None
    by_item: dict = {}
    for r in suite["records"]:
        if r["status"] == "ok":
            by_item.setdefault((r["shape"], r["mode"]), {})[r["provider"]] = r
    items = list(by_item)
    if not items:
        return None
    shown = [p for p in _providers_in(suite["records"]) if p.key != "naive"]
    has_floor = any(r.get("pct_floor") for recs in by_item.values() for r in recs.values())
    fig, axes = plt.subplots(1, 2 if has_floor else 1, figsize=(15 if has_floor else 9,
                             1.5 + 0.45 * len(items)), sharey=True, squeeze=False)
    labels = [f"{shape} {MODE_LABELS[mode]}" for shape, mode in items]
    height = 0.8 / max(1, len(shown))
    for k, provider in enumerate(shown):
        speedups, floors = [], []
        for item in items:
            recs = by_item[item]
            r, naive = recs.get(provider.key), recs.get("naive")
            speedups.append(naive["ms"] / r["ms"] if r and naive else 0.0)
            floors.append((r["pct_floor"] or 0.0) if r else 0.0)
        ys = [i + (k - (len(shown) - 1) / 2) * height for i in range(len(items))]
        axes[0][0].barh(ys, speedups, height=height, label=provider.label)
        if has_floor:
            axes[0][1].barh(ys, floors, height=height, label=provider.label)
    ax = axes[0][0]
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("speedup over naive (higher is better; missing bar: failed or not run)")
    ax.set_yticks(range(len(items)), labels)
    ax.invert_yaxis()
    ax.legend(loc="lower right", fontsize="small")
    if has_floor:
        axes[0][1].axvline(TARGET_PCT_FLOOR, color="black", linestyle="--", linewidth=0.8)
        axes[0][1].set_xlabel("% of the roofline floor (target: 60% where floor ≥ 50 µs)")
    env = suite.get("env") or {}
    device = env.get("gpu") or f"CPU ({env.get('cpu')})"
    fig.suptitle(f"MaxSim: {device}, torch {env.get('torch')}, "
                 f"git {(env.get('git_sha') or 'unknown')[:10]}, {env.get('date')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
