"""The command line of ``benchmarks/bench_maxsim.py``: its options and the run they ask for.

:func:`add_bench_arguments` declares the options (shapes, modes, providers, peers, device,
output folder, sections, timing and budgets); :func:`run_bench` picks the shapes, modes and
providers, runs the suite and the sections asked for while saving the record after every
finished item, and prints the markdown (or the JSON record). Exit status 0 on success, 1 if
fusedmaxsim failed on some suite item, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

from .coldstart import COLD_START_CASES, run_cold_start
from .memory import MEMORY_BATCHES, MEMORY_PROVIDERS, run_memory_table
from .providers import PEER_KEYS, PROVIDER_ALIASES, PROVIDERS_BY_KEY
from .records import RECORD_STEM, environment, load_record_file, new_record_file, write_outputs
from .report import render_markdown, write_plot
from .shapes import MODE_ALIASES, QUICK_SHAPES, SHAPES, SHAPES_BY_NAME
from .suite import modes_for, run_suite
from .util import Progress, json_safe


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``benchmarks/bench_maxsim.py``."""
    parser.add_argument(
        "--shapes", default=None,
        help="comma-separated shape names, or 'all' (the sixteen anchor shapes), 'quick' (small "
             "shapes for a CPU), 'none' (run only the sections below). Default: all on CUDA, "
             "quick on CPU.")
    parser.add_argument(
        "--modes", default="native",
        help="'native' (each shape in the mode its anchors were measured in), or a comma list "
             "of inference, training: every shape in each of them. Default: native.")
    parser.add_argument(
        "--providers", default=None,
        help=f"comma list from {', '.join(PROVIDERS_BY_KEY)}. Default: fusedmaxsim and the "
             "naive baselines (compile_fp32 on CUDA only), plus the peers with --peers.")
    parser.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                        help="run every selected shape in this dtype instead of its own (the "
                             "anchors, measured in the shapes' own dtypes, are then left out)")
    parser.add_argument("--peers", action="store_true",
                        help="also time late-interaction-kernels and flash-maxsim when importable")
    parser.add_argument("--device", default=None,
                        help="torch device; default: cuda when available, else cpu")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help=f"write {RECORD_STEM}.json and .md (and .png with --plot) into DIR")
    parser.add_argument("--append", action="store_true",
                        help="keep the sections of the record already in --out that this run "
                             "does not measure")
    parser.add_argument("--json", action="store_true",
                        help="print the JSON record on stdout instead of the markdown")
    parser.add_argument("--plot", action="store_true", help="also draw a PNG (needs matplotlib)")
    parser.add_argument("--memory-table", action="store_true",
                        help="op-level memory of ColPali in-batch training (CUDA only)")
    parser.add_argument("--memory-batches", default=",".join(map(str, MEMORY_BATCHES)),
                        help="batch sizes of the memory table")
    parser.add_argument("--cold-start", action="store_true",
                        help="first-call seconds in fresh processes with an empty Triton cache")
    parser.add_argument("--cold-timeout-s", type=float, default=60.0,
                        help="limit for each cold-start process")
    parser.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warmup")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="do_bench rep")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no new suite item after this many seconds; the rest are "
                             "recorded as skipped")
    parser.add_argument("--compile-budget-s", type=float, default=90.0,
                        help="total seconds torch.compile may spend compiling before the "
                             "remaining compile_fp32 items are skipped")
    return parser


def select_shapes(spec: str | None, device: torch.device) -> list:
    spec = spec or ("all" if device.type == "cuda" else "quick")
    shapes = []
    for name in filter(None, (s.strip() for s in spec.split(","))):
        if name == "none":
            continue
        elif name == "all":
            shapes += SHAPES
        elif name == "quick":
            shapes += QUICK_SHAPES
        elif name in SHAPES_BY_NAME:
            shapes.append(SHAPES_BY_NAME[name])
        else:
            raise ValueError(f"unknown shape {name!r}; known: all, quick, none, "
                             + ", ".join(SHAPES_BY_NAME))
    return list(dict.fromkeys(shapes))


def parse_modes(spec: str) -> list | None:
    if spec in (None, "", "native"):
        return None
    modes = []
    for name in filter(None, (s.strip() for s in spec.split(","))):
        if name not in MODE_ALIASES:
            raise ValueError(f"unknown mode {name!r}; known: native, inference, training")
        modes.append(MODE_ALIASES[name])
    return list(dict.fromkeys(modes))


def select_providers(spec: str | None, peers: bool, device: torch.device) -> list:
    if spec:
        keys = []
        for name in filter(None, (s.strip() for s in spec.split(","))):
            key = PROVIDER_ALIASES.get(name, name)
            if key not in PROVIDERS_BY_KEY:
                known = ", ".join(PROVIDERS_BY_KEY)
                raise ValueError(f"unknown provider {name!r}; known: {known}")
            keys.append(key)
    else:
        keys = ["fusedmaxsim", *(PEER_KEYS if peers else ()), "naive", "naive_fp32"]
        if device.type == "cuda":
            keys.append("compile_fp32")
    return [PROVIDERS_BY_KEY[k] for k in dict.fromkeys(keys)]


def run_bench(args: argparse.Namespace) -> int:
    """Runs what ``args`` asks for and prints the markdown (or, with ``--json``, the record).

    Returns 0 on success, 1 if fusedmaxsim failed on some suite item, 2 on bad arguments.
    """
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("CUDA is not available")
        shapes = select_shapes(args.shapes, device)
        if args.dtype is not None:
            shapes = [dataclasses.replace(s, dtype=args.dtype, anchor=None)
                      if s.dtype != args.dtype else s for s in shapes]
        modes = parse_modes(args.modes)
        providers = select_providers(args.providers, args.peers, device)
        batches = [int(b) for b in str(args.memory_batches).split(",") if b.strip()]
    except ValueError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    os.environ.setdefault("LIK_SUPPRESS_NORM_WARN", "1")

    env = environment(device)
    previous = load_record_file(args.out) if args.append and args.out is not None else None
    record = previous or new_record_file(env)
    record["env"] = env

    def saver(name):
        """Stores a (partial) section and rewrites the files, so an interrupted run keeps it."""
        def save(section):
            record[name] = section
            if args.out is not None:
                write_outputs(record, args.out, plot=False)
        return save

    saver("env")(env)  # without --append, this replaces any stale record right away
    if shapes:
        total = sum(len(modes_for(s, modes)) for s in shapes) * len(providers)
        saver("suite")(run_suite(
            shapes, modes, providers, device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
            budget_s=args.budget_s, compile_budget_s=args.compile_budget_s,
            progress=Progress(total), on_update=saver("suite")))
    if args.memory_table:
        selected = {p.key for p in providers}
        mem_providers = [PROVIDERS_BY_KEY[k] for k in MEMORY_PROVIDERS if k in selected]
        saver("memory_table")(run_memory_table(
            mem_providers, device, batches, progress=Progress(len(batches) * len(mem_providers)),
            on_update=saver("memory_table")))
    if args.cold_start:
        n_cases = len(COLD_START_CASES["cuda" if device.type == "cuda" else "cpu"])
        n_contenders = sum(p.role != "baseline" for p in providers)
        saver("cold_start")(run_cold_start(
            providers, device, args.cold_timeout_s, progress=Progress(n_cases * n_contenders),
            on_update=saver("cold_start")))

    _emit(record, args)
    suite = record.get("suite") if shapes else None
    ours_failed = bool(suite) and any(r["role"] == "ours" and r["status"] == "failed"
                                      for r in suite["records"])
    return 1 if ours_failed else 0


def _emit(record: dict, args: argparse.Namespace) -> None:
    """Final files (with the plot when asked) and the report on stdout."""
    written = []
    if args.out is not None:
        written = write_outputs(record, args.out, plot=args.plot)
    elif args.plot:
        png = write_plot(record, Path(f"{RECORD_STEM}.png"))
        written = [png] if png else []
    for path in written:
        print(f"bench: wrote {path}", file=sys.stderr)
    if args.json:
        print(json.dumps(json_safe(record), indent=1, allow_nan=False))
    else:
        print(render_markdown(record), end="")
