"""What a call costs the host: GPU kernel time, wall time and do_bench, side by side, per provider.

On the small rows where host time decides (HOST_ROWS, each in its own mode), every provider runs
in one process on the same inputs: the harness's fusedmaxsim, LIK, flash-maxsim and naive, and
fusedmaxsim under torch.compile(mode="reduce-overhead") (CUDA graphs; on training rows the whole
step, forward and backward; a few warm-up calls; a compile error is recorded in the row). The
harness's float64 parity check comes first: ours and the peers are not timed when they fail,
naive is (as in the suite); none that fails gets a ratio. Interleaved rounds
(harness.timing.round_orders: host noise hits each alike) give do_bench's median ms
(perf_counter on a CPU) and the wall time per synchronous call (harness.timing.wall_us_per_call,
median over rounds); then torch.profiler (CUDA activity) over N calls gives the device time
(kernels, memsets, copies) per call; none on a CPU. A row adds rounds until its share of
--budget-s is spent (one round always runs). Ratios: fusedmaxsim wall / fastest peer's wall and
/ naive's wall; compiled wall / its GPU time. host_bench.json and .md (harness.records'
environment and git sha) go to --out (default benchmarks/results/<device>/<date>_<sha>/).

    python3 benchmarks/bench_host.py --device cuda --out $OUT
    python3 benchmarks/bench_host.py --device cpu --rounds 1 --no-compile --out /tmp/host-cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

try:
    import fusedmaxsim
except ImportError:  # a source checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import fusedmaxsim

from harness.cli import select_shapes
from harness.parity import check_parity, reference_outputs
from harness.providers import PEER_KEYS, PROVIDER_ALIASES, PROVIDERS_BY_KEY, provider_unavailable
from harness.records import device_slug, environment
from harness.report import _header_lines, _table, fmt_ms
from harness.shapes import MODE_LABELS, make_case
from harness.timing import Timer, make_step, quantiles_ms, round_orders, run_once, sync_fn
from harness.timing import wall_us_per_call as wall_us
from harness.util import describe_error, json_safe, release_memory

SCHEMA = "fusedmaxsim.host_bench/1"
STEM = "host_bench"
HOST_ROWS = ("small_batch,rerank_colbert,train_small_batch,train_colbert,train_colbert_masked,"
             "train_kd,train_kd_colpali")
COMPILED = "fusedmaxsim_compiled"


def compiled_call(case, warmup: int):
    """fusedmaxsim's step (training: forward and backward) under reduce-overhead, warmed up."""
    torch._dynamo.reset()

    def body(Q, D, q_mask, d_mask, grad_out, normalize=case.shape.normalize):
        out = fusedmaxsim.maxsim(Q, D, q_mask, d_mask, normalize=normalize)
        if grad_out is not None:
            out.backward(grad_out)
        return out

    fn = torch.compile(body, mode="reduce-overhead")

    def call():
        torch.compiler.cudagraph_mark_step_begin()
        with torch.set_grad_enabled(case.training):
            return fn(case.Q, case.D, case.q_mask, case.d_mask, case.grad_out)

    for _ in range(warmup):
        case.reset_grads()
        call()
    return call


def gate(key: str, case, ref, sync, args, device) -> tuple:
    """Build, warm up and check one provider: ``(record, step)``, step None unless it is timed."""
    compiled = key == COMPILED
    provider = PROVIDERS_BY_KEY["fusedmaxsim" if compiled else key]
    rec = {"provider": key, "label": "fusedmaxsim compiled" if compiled else provider.label,
           "role": provider.role, "status": None, "error": None}
    reason = "--no-compile" if compiled and args.no_compile else provider_unavailable(provider,
                                                                                     device)
    if reason:
        rec.update(status="skipped", error=reason)
        return rec, None
    try:
        start = time.perf_counter()
        if compiled:
            counters.clear()
            step = compiled_call(case, args.compile_warmup)
            case.reset_grads()
            out = step()
            sync()
            grads = (case.Q.grad, case.D.grad) if case.training else None
            rec["graph_breaks"] = sum(counters["graph_break"].values())
            rec["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
        else:
            score = provider.build(case)
            out, grads, _ = run_once(score, case, sync)
            step = make_step(score, case)
        rec["first_calls_s"] = time.perf_counter() - start
        parity = check_parity(out.detach(), grads, ref, case)
    except Exception as exc:  # noqa: BLE001 - recorded (a compile error included); the rest go on
        rec.update(status="failed", error=describe_error(exc))
        return rec, None
    finally:
        case.reset_grads()
    problems = parity.pop("parity_problems")
    rec.update(parity)
    if problems:  # a baseline is timed anyway, as in the suite, but gets no ratio
        rec.update(error=f"parity: {problems}",
                   status="failed" if provider.role != "baseline" else "timed")
    return rec, (None if problems and provider.role != "baseline" else step)


def gpu_us(step, case, calls: int, device) -> float | None:
    """Device time per call: the profiler's CUDA events over ``calls`` calls, summed, / calls."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            case.reset_grads()
            step()
        torch.cuda.synchronize(device)
    case.reset_grads()
    total = sum(e.device_time_total for e in prof.events() if e.device_type == DeviceType.CUDA)
    return total / calls


def measure_row(shape, keys, args, device, timer, left: float, deadline: float) -> dict:
    """One row: gate every provider, time those that pass in rounds until deadline, profile."""
    row = {"shape": shape.name, "mode": MODE_LABELS[shape.mode], "description": shape.describe(),
           "rounds": 0, "error": None, "providers": [], "ratios": {}}
    began = time.monotonic()
    if left <= 0:
        return {**row, "error": "time budget spent"}
    try:
        case = make_case(shape, shape.mode, device)
        ref = reference_outputs(case)
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory: recorded, the next row goes on
        row["error"] = describe_error(exc)
        return row
    sync = sync_fn(device)
    entries = []
    for key in keys:
        rec, step = gate(key, case, ref, sync, args, device)
        row["providers"].append(rec)
        if step is not None:
            entries.append((rec, step, [], []))  # record, step, do_bench samples, wall per round
    grad_to_none = [case.Q, case.D] if case.training else None
    for r, order in enumerate(round_orders(len(entries), args.rounds)):
        if r and time.monotonic() > deadline:
            break
        for rec, step, samples, walls in (entries[i] for i in order):
            if rec["status"] == "failed":  # it failed in an earlier round
                continue
            try:
                times = timer.samples(step, grad_to_none, args.rep_ms)
                case.reset_grads()
                wall, rec["wall_iters"] = wall_us(step, case, sync, quantiles_ms(times)[0],
                                                  args.wall_ms)
                samples.append(times)
                walls.append(wall)
            except Exception as exc:  # noqa: BLE001 - recorded; the other providers go on
                rec.update(status="failed", error=describe_error(exc))
            finally:
                case.reset_grads()
        row["rounds"] = r + 1
    for rec, step, samples, walls in (e for e in entries if e[0]["status"] != "failed"):
        rec["do_bench_ms"] = quantiles_ms([t for times in samples for t in times])[0]
        rec["do_bench_round_ms"] = [quantiles_ms(times)[0] for times in samples]
        rec["wall_us"], rec["wall_round_us"] = statistics.median(walls), walls
        try:
            rec["gpu_us"] = gpu_us(step, case, args.profile_calls, device)
        except Exception as exc:  # noqa: BLE001 - the other two measures still stand
            rec["gpu_error"] = describe_error(exc)
        rec["status"] = rec["status"] or "ok"
    row.update(spent_s=time.monotonic() - began, ratios=ratios(row["providers"]))
    del case, ref, entries
    release_memory(device)
    return row


def ratios(records: list) -> dict:
    """The run's own ratios, from providers that were timed and passed the parity gate."""
    by = {p["provider"]: p for p in records if p.get("wall_us") is not None and p.get("parity_ok")}
    out, ours, peers = {}, by.get("fusedmaxsim"), [by[k] for k in PEER_KEYS if k in by]
    if ours and peers:
        best = min(peers, key=lambda p: p["wall_us"])
        out.update(ours_over_best_peer_wall=ours["wall_us"] / best["wall_us"],
                   best_peer=best["provider"])
    if ours and "naive" in by:
        out["ours_over_naive_wall"] = ours["wall_us"] / by["naive"]["wall_us"]
    comp = by.get(COMPILED)
    if comp and comp.get("gpu_us"):
        out["compiled_wall_over_gpu"] = comp["wall_us"] / comp["gpu_us"]
    return out


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def render(record: dict) -> str:
    note = (f"Timer: {record['settings']['timer']}. Wall: median of the rounds; a wall ratio "
            "below 1: fusedmaxsim is faster. GPU: profiler device time per call.")
    lines = ["# Host cost of a call", "", *_header_lines(record["env"]), "", note, ""]
    ratio_rows, rows = [], []
    for row in record["rows"]:
        q = row["ratios"]
        peer = f" ({q['best_peer']})" if "best_peer" in q else ""
        ratio_rows.append([row["shape"], row["mode"], _fmt(q.get("ours_over_best_peer_wall"), ".2f")
                           + peer, _fmt(q.get("ours_over_naive_wall"), ".2f"),
                           _fmt(q.get("compiled_wall_over_gpu"), ".2f"), row["rounds"]])
        if row["error"]:
            rows.append([row["shape"], row["mode"], "–", f"not run: {row['error']}", "", "", ""])
        for p in row["providers"]:
            status = p["status"] + (f": {p['error']}" if p.get("error") else "")
            rows.append([row["shape"], row["mode"], p["label"], status.replace("|", "/"),
                         _fmt(p.get("gpu_us"), ".1f"), _fmt(p.get("wall_us"), ".1f"),
                         fmt_ms(p.get("do_bench_ms"))])
    lines += _table(["row", "mode", "fusedmaxsim / fastest peer", "fusedmaxsim / naive",
                     "compiled wall / its GPU", "rounds"], ratio_rows)
    lines += ["", *_table(["row", "mode", "provider", "status", "GPU µs/call", "wall µs/call",
                           "do_bench ms"], rows)]
    return "\n".join(lines) + "\n"


OPTIONS = (  # flag, type, default, help
    ("--shapes", str, None, f"shape names, or all, quick (default: {HOST_ROWS}; CPU: quick)"),
    ("--providers", str, f"fusedmaxsim,lik,flash,naive,{COMPILED}",
     f"comma list of the harness's providers and {COMPILED}"),
    ("--device", str, None, "default: cuda when available, else cpu"),
    ("--out", Path, None, "default: benchmarks/results/<device>/<date>_<sha>/"),
    ("--budget-s", float, 150.0, "the whole run; each row gets an equal share of what is left"),
    ("--rounds", int, 10, "most interleaved rounds a row"),
    ("--rep-ms", float, 30.0, "do_bench rep per round"),
    ("--warmup-ms", float, 10.0, "do_bench warmup"),
    ("--wall-ms", float, 30.0, "about this long of back-to-back calls per wall measurement"),
    ("--profile-calls", int, 50, "calls under the profiler"),
    ("--compile-warmup", int, 5, "compiled calls before the gate"),
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for flag, kind, default, text in OPTIONS:
        parser.add_argument(flag, type=kind, default=default, help=text)
    parser.add_argument("--no-compile", action="store_true", help=f"skip {COMPILED}")
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("CUDA is not available")
        shapes = select_shapes(args.shapes or (HOST_ROWS if device.type == "cuda" else "quick"),
                               device)
        keys = [PROVIDER_ALIASES.get(k, k) for k in map(str.strip, args.providers.split(",")) if k]
        unknown = [k for k in keys if k not in PROVIDERS_BY_KEY and k != COMPILED]
        if unknown or args.rounds < 1:
            raise ValueError(f"unknown providers {unknown}" if unknown else "--rounds must be >= 1")
    except ValueError as exc:
        print(f"bench_host: {exc}", file=sys.stderr)
        return 2
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    deadline = time.monotonic() + args.budget_s
    env = environment(device)
    out = args.out or (Path(__file__).resolve().parent / "results" / device_slug(device)
                       / f"{env['date'][:10]}_{(env.get('git_sha') or 'nosha')[:7]}")
    timer = Timer(device, args.warmup_ms, args.rep_ms)
    settings = {**{k: v for k, v in vars(args).items() if k != "out"}, "timer": timer.name}
    record = {"schema": SCHEMA, "env": env, "settings": settings, "rows": []}
    out.mkdir(parents=True, exist_ok=True)
    for n, shape in enumerate(shapes):
        left = deadline - time.monotonic()
        record["rows"].append(measure_row(shape, keys, args, device, timer, left,
                                          time.monotonic() + left / (len(shapes) - n)))
        spent = args.budget_s - (deadline - time.monotonic())
        print(f"bench_host: {shape.name} done, {spent:.0f} s in", file=sys.stderr, flush=True)
        text = json.dumps(json_safe(record), indent=1, allow_nan=False)  # after every row
        (out / f"{STEM}.json").write_text(text + "\n")
        (out / f"{STEM}.md").write_text(render(record))
    print(f"bench_host: wrote {out / STEM}.json and .md", file=sys.stderr)
    print(render(record), end="")
    return int(any(p["provider"] == "fusedmaxsim" and p["status"] == "failed"
                   for row in record["rows"] for p in row["providers"]))


if __name__ == "__main__":
    sys.exit(main())
