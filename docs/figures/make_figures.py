"""Draw the figures of docs/how-it-works.md into this folder.

Run it from the repository root (it needs matplotlib and numpy only; paths are taken from this
file's place, so any working directory does):

    python docs/figures/make_figures.py

The pictures of the algorithm (grid.png, tiles.png, backward.png) draw small random examples
from a fixed seed. The measured ones (memory.png, speed.png) read a committed benchmark record,
RECORD below, and nothing else, so every figure can be drawn again from the repository alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch, Rectangle

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RECORD = "2026-12-02_85a058e"
RECORD_JSON = ROOT / "benchmarks" / "results" / "h200" / RECORD / "maxsim_bench.json"

OURS = "#d62728"
COLORS = {"fusedmaxsim": OURS, "lik": "#1f77b4", "flash": "#2ca02c", "naive": "#7f7f7f"}
LABELS = {
    "fusedmaxsim": "fusedmaxsim",
    "lik": "late-interaction-kernels 0.4.5",
    "flash": "flash-maxsim 0.3.0",
    "naive": "naive PyTorch (einsum, max, sum)",
}
CMAP = "Blues"

plt.rcParams.update({"font.size": 11, "axes.titlesize": 12, "savefig.dpi": 130})


def save(fig, name: str) -> None:
    fig.savefig(HERE / name, bbox_inches="tight", facecolor="white")
    plt.close(fig)
    print("wrote", (HERE / name).relative_to(ROOT))


def example(lq: int, ld: int, seed: int) -> np.ndarray:
    """Similarities of one query (lq tokens) against one document (ld tokens), unit-norm tokens."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((lq, 16))
    d = rng.standard_normal((ld, 16))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    return q @ d.T


def figure_grid() -> None:
    """(a) The [Nq, Nd, Lq, Ld] grid the naive path writes, and the scores it reduces to."""
    nq, nd, lq, ld = 3, 4, 5, 8
    fig = plt.figure(figsize=(12, 5.2))
    left = fig.add_axes([0.02, 0.05, 0.56, 0.80])
    right = fig.add_axes([0.74, 0.26, 0.24, 0.42])
    left.set_xlim(0, nd * (ld + 2))
    left.set_ylim(nq * (lq + 2), -0.6)
    left.axis("off")
    scores = np.zeros((nq, nd))
    for i in range(nq):
        for j in range(nd):
            s = example(lq, ld, seed=100 + 10 * i + j)
            scores[i, j] = s.max(axis=1).sum()
            x0, y0 = j * (ld + 2) + 1, i * (lq + 2) + 1
            left.imshow(s, cmap=CMAP, vmin=-1, vmax=1, extent=(x0, x0 + ld, y0 + lq, y0),
                        interpolation="nearest")
            left.add_patch(Rectangle((x0, y0), ld, lq, fill=False, lw=1.0, ec="black"))
            rows = np.arange(lq)
            left.plot(x0 + s.argmax(axis=1) + 0.5, y0 + rows + 0.5, "o", ms=4, mfc=OURS,
                      mec="white", mew=0.6)
    for j in range(nd):
        left.text(j * (ld + 2) + 1 + ld / 2, 0.6, f"document {j}", ha="center", va="bottom")
    for i in range(nq):
        left.text(0.75, i * (lq + 2) + 1 + lq / 2, f"query {i}", ha="right", va="center",
                  rotation=90)
    left.set_title("naive: the similarity grid [Nq, Nd, Lq, Ld], written to memory\n"
                   "one block ⟨Q[i, s], D[j, t]⟩ per (query i, document j): rows are query"
                   " tokens s, columns document tokens t;\nred dot: the max of each row",
                   loc="left", pad=14)
    right.imshow(scores, cmap="Oranges", vmin=scores.min() - 0.5, vmax=scores.max() + 0.5,
                 interpolation="nearest")
    for i in range(nq):
        for j in range(nd):
            right.text(j, i, f"{scores[i, j]:.1f}", ha="center", va="center", fontsize=10)
    right.set_xticks(range(nd), [f"doc {j}" for j in range(nd)])
    right.set_yticks(range(nq), [f"query {i}" for i in range(nq)])
    right.set_title("scores [Nq, Nd]\nΣ over rows of each row's max")
    fig.add_artist(FancyArrowPatch((0.595, 0.47), (0.655, 0.47), transform=fig.transFigure,
                                   arrowstyle="-|>", mutation_scale=22, lw=2, color="black"))
    fig.text(0.625, 0.51, "max over t,\nsum over s", ha="center", va="bottom", fontsize=10)
    nbytes = 128 * 128 * 128 * 1024 * 2
    fig.text(0.66, 0.12,
             "fusedmaxsim writes only the scores.\n"
             f"The grid of ColPali training at batch 128\n(128 × 128 × 128 × 1024 in bf16) "
             f"is {nbytes / 2**30:.0f} GiB.", ha="left", va="top", fontsize=10)
    save(fig, "grid.png")


def figure_tiles() -> None:
    """(b) Document tiles streaming past a query block held on chip, running max and argmax."""
    lq, ld, tile = 6, 24, 8
    s = example(lq, ld, seed=45)
    ntiles = ld // tile
    fig, axes = plt.subplots(2, ntiles, figsize=(13, 6.4),
                             gridspec_kw={"height_ratios": [1.0, 1.0], "hspace": 0.55,
                                          "wspace": 0.35})
    run_max = np.full(lq, -np.inf)
    run_arg = np.zeros(lq, dtype=int)
    for k in range(ntiles):
        cols = slice(k * tile, (k + 1) * tile)
        block = s[:, cols]
        ax = axes[0, k]
        ax.imshow(block, cmap=CMAP, vmin=-1, vmax=1, interpolation="nearest", aspect="auto",
                  extent=(k * tile - 0.5, (k + 1) * tile - 0.5, lq - 0.5, -0.5))
        better = block.max(axis=1) > run_max
        best = block.argmax(axis=1) + k * tile
        for r in range(lq):
            ax.plot(best[r], r, "o", ms=6, mfc=OURS if better[r] else "none",
                    mec=OURS, mew=1.2)
        ax.set_xticks(range(k * tile, (k + 1) * tile, 2))
        ax.set_yticks(range(lq), [f"s={r}" for r in range(lq)] if k == 0 else [])
        ax.set_xlabel("document token t")
        ax.set_title(f"step {k + 1}: tile {k} (tokens {k * tile}-{(k + 1) * tile - 1})\n"
                     "filled dot: beats the running max", fontsize=10.5)
        run_arg = np.where(better, best, run_arg)
        run_max = np.where(better, block.max(axis=1), run_max)
        ax = axes[1, k]
        colors = [OURS if b else "#9ecae1" for b in better]
        ax.barh(range(lq), run_max, color=colors, height=0.7)
        for r in range(lq):
            ax.text(run_max[r] + 0.03, r, f"t={run_arg[r]}", va="center", fontsize=9)
        ax.set_xlim(min(0.0, s.max(axis=1).min() - 0.1), 1.25)
        ax.invert_yaxis()
        ax.set_yticks(range(lq), [f"s={r}" for r in range(lq)] if k == 0 else [])
        ax.set_xlabel("running max (registers)")
        ax.set_title("running max and argmax\nred: updated by this tile", fontsize=11)
    fig.suptitle("One query block stays on chip; the document streams past it one tile at a time."
                 " A tile's similarities never leave the chip.\nTop: a tile's similarities, with"
                 " each row's max (a dot). Bottom: the running max of each query token s and its"
                 " token t, the only state kept.\nAt the end, score = Σ_s max.", y=1.06,
                 fontsize=11.5)
    save(fig, "tiles.png")


def figure_backward() -> None:
    """(c) The backward: each query token's gradient goes through its saved argmax."""
    lq, ld = 6, 24
    s = example(lq, ld, seed=45)  # the example of tiles.png
    arg = s.argmax(axis=1)
    fig, ax = plt.subplots(figsize=(12, 4.6))
    ax.set_xlim(-3.2, ld + 0.5)
    ax.set_ylim(-1.8, 4.6)
    ax.axis("off")
    qx = np.linspace(2, ld - 3, lq)
    chosen = set(arg.tolist())
    for t in range(ld):
        on = t in chosen
        ax.add_patch(Rectangle((t, 0), 0.8, 0.8, fc=OURS if on else "#e0e0e0",
                               ec="black", lw=0.6))
        ax.text(t + 0.4, -0.15, str(t), ha="center", va="top", fontsize=8)
        if on:
            senders = ",".join(str(r) for r in range(lq) if arg[r] == t)
            ax.text(t + 0.4, -0.6, f"s={senders}", ha="center", va="top", fontsize=8.5,
                    color=OURS)
    for r in range(lq):
        ax.add_patch(Rectangle((qx[r] - 0.4, 3.2), 0.8, 0.8, fc="#6baed6", ec="black", lw=0.6))
        ax.text(qx[r], 4.1, f"s={r}", ha="center", va="bottom", fontsize=10)
        ax.add_patch(FancyArrowPatch((qx[r], 3.15), (arg[r] + 0.4, 0.85), arrowstyle="-|>",
                                     mutation_scale=14, lw=1.4, color=OURS))
    ax.text(-3.1, 3.6, "query\ntokens", ha="left", va="center", fontsize=10)
    ax.text(-3.1, 0.4, "document\ntokens", ha="left", va="center", fontsize=10)
    ax.text(ld / 2, -1.25,
            "grad_Q[s] = g · D[A[s]]        "
            "grad_D[t] = g · (sum of Q[s] over the s with A[s] = t)"
            "        grey tokens won no max: zero gradient",
            ha="center", va="top", fontsize=10.5)
    ax.set_title("Backward: the forward saved A[s], the winning document token of each query "
                 "token s (the final argmax of the tiles figure).\n"
                 "Each query token's gradient goes to that "
                 "one token only; no similarity is computed again.", loc="left")
    save(fig, "backward.png")


def load_record() -> dict:
    with open(RECORD_JSON) as f:
        return json.load(f)


def figure_memory(record: dict) -> None:
    """(d) Memory of one training step by batch size, from the record's memory table."""
    table = record["memory_table"]
    rows = [r for r in table["rows"] if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    for provider in ("naive", "lik", "flash", "fusedmaxsim"):
        pts = sorted((r["batch"], r["total_mib"]) for r in rows if r["provider"] == provider)
        if not pts:
            continue
        x, y = zip(*pts)
        ours = provider == "fusedmaxsim"
        ax.plot(x, y, "o-", color=COLORS[provider], label=LABELS[provider],
                lw=2.6 if ours else 1.6, zorder=3 if ours else 2)
        if provider in ("naive", "fusedmaxsim"):
            for b, m in pts:
                ax.annotate(f"{m:,.0f} MiB" if m >= 10 else f"{m:.1f} MiB", (b, m),
                            textcoords="offset points", xytext=(0, -15 if ours else 8),
                            ha="center", fontsize=9, color=COLORS[provider])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    batches = sorted({r["batch"] for r in rows})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_ylim(1, 4e5)
    ax.set_xlabel("batch B (queries = documents = B)")
    ax.set_ylabel("MiB for one forward + backward (log scale)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper left", fontsize=9.5)
    ax.set_title(f"ColPali in-batch training, Lq = {table['lq']}, Ld = {table['ld']}, "
                 f"{table['dtype']}, one H200\nmemory held and peaked beyond the inputs "
                 f"(record {RECORD})", fontsize=11)
    save(fig, "memory.png")


def figure_speed(record: dict) -> None:
    """(e) Time of one call by shape, every provider, from the record's suite."""
    suite = record["suite"]
    shapes = suite["shapes"]
    ms = {(r["shape"], r["provider"]): r["ms"] for r in suite["records"]
          if r["status"] == "ok" and r.get("ms") is not None}
    markers = {"fusedmaxsim": "o", "lik": "s", "flash": "^", "naive": "D"}
    fig, ax = plt.subplots(figsize=(10, 8.5))
    for i, shape in enumerate(shapes):
        values = [ms[(shape["name"], p)] for p in markers if (shape["name"], p) in ms]
        if values:
            ax.plot([min(values), max(values)], [i, i], color="#d9d9d9", lw=1.5, zorder=1)
    for provider, marker in reversed(markers.items()):
        shift = {"lik": -0.16, "flash": 0.16}.get(provider, 0.0)  # keep close markers apart
        pts = [(ms[(sh["name"], provider)], i + shift) for i, sh in enumerate(shapes)
               if (sh["name"], provider) in ms]
        x, y = zip(*pts)
        ours = provider == "fusedmaxsim"
        ax.scatter(x, y, marker=marker, s=80 if ours else 42, color=COLORS[provider],
                   label=LABELS[provider], zorder=3 if ours else 2,
                   edgecolors="white", linewidths=0.6)
    for i, shape in enumerate(shapes):
        value = ms.get((shape["name"], "fusedmaxsim"))
        if value is not None:
            ax.annotate(f"{value:.3f}", (value, i), textcoords="offset points", xytext=(0, 8),
                        ha="center", fontsize=8, color=OURS)

    def label(sh: dict) -> str:
        mode = "fwd" if sh["mode"] == "inference" else "fwd+bwd"
        return f"{sh['name']}  ({mode})\n{sh['description']}"

    ax.set_yticks(range(len(shapes)), [label(sh) for sh in shapes], fontsize=9)
    ax.set_ylim(len(shapes) - 0.4, -0.7)
    ax.set_xscale("log")
    ax.set_xlabel("ms per call, median (log scale; left is faster)")
    ax.grid(True, axis="x", which="both", alpha=0.25)
    handles, names = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], names[::-1], loc="lower right", fontsize=9.5, framealpha=0.95)
    geo = suite["geomean"]
    ax.set_title(f"The 16 benchmark shapes on one H200, d = 128, bf16 unless named "
                 f"(record {RECORD})\ngeometric mean: {geo['speedup_vs_peer']:.2f}× the fastest "
                 f"other library, {geo['speedup_vs_naive']:.2f}× naive PyTorch", fontsize=11)
    save(fig, "speed.png")


def main() -> None:
    figure_grid()
    figure_tiles()
    figure_backward()
    record = load_record()
    figure_memory(record)
    figure_speed(record)


if __name__ == "__main__":
    main()
