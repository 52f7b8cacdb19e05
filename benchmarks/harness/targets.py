"""The performance targets of the issue, and the per-shape summary that checks them.

fusedmaxsim is to be :data:`TARGET_VS_PEER` times faster than the fastest peer that passed the
gate, reach :data:`TARGET_PCT_FLOOR` percent of the roofline floor where that floor is long
enough to measure, stay within :data:`TARGET_WALL_US` of wall time per call where the floor is
tiny, and never be slower than naive PyTorch. :func:`summarize` turns a suite's records into
one row per (shape, mode) with these ratios and verdicts, and their geometric means.
"""

from __future__ import annotations

import math

from .shapes import SHAPES_BY_NAME
from .util import json_safe

# Targets of the performance issue, checked per shape for fusedmaxsim.
TARGET_VS_PEER = 1.2           # at least this much faster than the fastest passing peer
TARGET_PCT_FLOOR = 60.0        # share of the roofline floor ...
FLOOR_TARGET_MIN_MS = 0.050    # ... where the floor is at least this long
TINY_FLOOR_MS = 0.010          # below this floor a call is all overhead: hold it to a wall budget
TARGET_WALL_US = {"inference": 30.0, "training": 100.0}


def _target(value, target, applies, at_most=False) -> dict:
    """One target: met is None where it does not apply, False where the value is missing."""
    met = None
    if applies:
        met = value is not None and (value <= target if at_most else value >= target)
    return {"target": target, "value": value, "applies": applies, "met": met}


def summarize(records: list) -> tuple:
    """Per (shape, mode): fusedmaxsim against the fastest passing peer and naive, the targets,
    and the geometric means over the suite. Failed providers are left out of every ratio."""
    groups: dict = {}
    for record in records:
        groups.setdefault((record["shape"], record["mode"]), []).append(record)
    rows = []
    for (shape_name, mode), group in groups.items():
        rows.append(_summary_row(SHAPES_BY_NAME.get(shape_name), shape_name, mode, group))
    return rows, _geomeans(rows)


def _summary_row(shape, shape_name, mode, group) -> dict:
    by_key = {r["provider"]: r for r in group}
    ok = {k: r for k, r in by_key.items() if r["status"] == "ok"}
    ours = ok.get("fusedmaxsim")
    peers = [r for r in ok.values() if r["role"] == "peer"]
    best_peer = min(peers, key=lambda r: r["ms"]) if peers else None
    naive = ok.get("naive")
    naive_times = [ok[k]["ms"] for k in ("naive", "naive_fp32") if k in ok]
    floors = [r["floor_ms"] for r in group if r["floor_ms"] is not None]
    floor = floors[0] if floors else None
    ours_ms = ours["ms"] if ours else None

    def ratio(other_ms):
        return other_ms / ours_ms if ours_ms and other_ms else None

    row = {
        "shape": shape_name, "mode": mode, "floor_ms": floor,
        "fusedmaxsim_status": by_key.get("fusedmaxsim", {}).get("status"),
        "fusedmaxsim_ms": ours_ms,
        "fusedmaxsim_p20_ms": ours["p20_ms"] if ours else None,
        "fusedmaxsim_p80_ms": ours["p80_ms"] if ours else None,
        "best_peer": best_peer["provider"] if best_peer else None,
        "best_peer_ms": best_peer["ms"] if best_peer else None,
        "speedup_vs_peer": ratio(best_peer["ms"]) if best_peer else None,
        "speedup_vs_naive": ratio(naive["ms"]) if naive else None,
        "pct_floor": ours["pct_floor"] if ours else None,
        "tflops": ours["tflops"] if ours else None,
        "wall_us": ours["wall_us"] if ours else None,
        "peak_mib": {k: r["peak_mib"] for k, r in ok.items() if r["peak_mib"] is not None},
        "anchor_best_peer_ms": None,
        "anchor_target_ms": None,
    }
    if shape is not None and shape.anchor is not None and mode == shape.mode:
        row["anchor_best_peer_ms"] = shape.anchor.best_peer_ms
        row["anchor_target_ms"] = shape.anchor.best_peer_ms / TARGET_VS_PEER
    tiny = floor is not None and floor < TINY_FLOOR_MS
    row["targets"] = {
        "vs_peer": _target(row["speedup_vs_peer"], TARGET_VS_PEER, best_peer is not None),
        "pct_floor": _target(row["pct_floor"], TARGET_PCT_FLOOR,
                             floor is not None and floor >= FLOOR_TARGET_MIN_MS),
        "wall_us": _target(row["wall_us"], TARGET_WALL_US[mode], tiny, at_most=True),
        "not_slower_than_naive": _target(ratio(min(naive_times)) if naive_times else None,
                                         1.0, bool(naive_times)),
    }
    return json_safe(row)


def _geomeans(rows) -> dict:
    result = {}
    for key in ("speedup_vs_peer", "speedup_vs_naive"):
        values = [r[key] for r in rows if r[key]]
        result[key] = math.exp(sum(map(math.log, values)) / len(values)) if values else None
        result[f"n_{key}"] = len(values)
    return result
