"""The suite: every (shape, mode, provider), gated, then timed in interleaved rounds.

For each (shape, mode) the inputs are built once; each provider is built, run once and checked
against the oracle (:func:`gate_one`); those that pass are timed in :data:`TIMING_ROUNDS`
rounds, each in another provider order, then their wall time, peak memory, TFLOP/s and share of
the floor are added (:func:`time_gated`). :func:`run_suite` returns the ``suite`` section of a
record (one row of :data:`RECORD_KEYS` per item) with its summary, and hands every finished
(shape, mode) to ``on_update`` so a run cut short keeps what it measured.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict

import torch

from .parity import Reference, check_parity, reference_outputs
from .providers import Provider, provider_unavailable
from .records import environment
from .report import fmt_ms
from .shapes import MODE_LABELS, Case, Shape, make_case
from .targets import TARGET_VS_PEER, summarize
from .timing import (
    TIMING_ROUNDS,
    Timer,
    floor_ms,
    make_step,
    measure_ceilings,
    peak_mib,
    quantiles_ms,
    round_orders,
    run_once,
    sync_fn,
    wall_us_per_call,
)
from .util import Progress, describe_error, json_safe, release_memory

RECORD_KEYS = (
    "shape", "mode", "provider", "role", "status", "error",
    "score_rel_err", "grad_q_rel_err", "grad_d_rel_err", "grad_q_fro_err", "grad_d_fro_err",
    "score_tol", "grad_tol", "parity_ok",
    "warmup_call_s", "ms", "p20_ms", "p80_ms", "round_ms", "wall_us", "wall_iters",
    "tflops", "floor_ms", "pct_floor", "peak_mib",
)


def new_record(shape: Shape, mode: str, provider: Provider) -> dict:
    record = dict.fromkeys(RECORD_KEYS)
    record.update(shape=shape.name, mode=mode, provider=provider.key, role=provider.role)
    return record


class SuiteContext:
    """What every item of a suite run shares: device, timer, budgets, the current reference."""

    def __init__(self, device, timer, ceilings, *, budget_s=None, compile_budget_s=None):
        self.device = device
        self.timer = timer
        self.sync = sync_fn(device)
        self.ceilings = ceilings
        self.deadline = None if budget_s is None else time.monotonic() + budget_s
        self.compile_budget_s = compile_budget_s
        self.compile_spent_s = 0.0
        self.unavailable: dict = {}
        self._case = None
        self._reference = None

    def skip_reason(self, provider: Provider) -> str | None:
        if provider.key not in self.unavailable:
            self.unavailable[provider.key] = provider_unavailable(provider, self.device)
        if self.unavailable[provider.key]:
            return self.unavailable[provider.key]
        if self.deadline is not None and time.monotonic() > self.deadline:
            return "time budget spent"
        if (provider.key == "compile_fp32" and self.compile_budget_s is not None
                and self.compile_spent_s >= self.compile_budget_s):
            return f"compile budget ({self.compile_budget_s:.0f} s) spent"
        return None

    def reference(self, case: Case) -> Reference:
        """The oracle for ``case``, computed once and shared by its providers."""
        if self._case is not case:
            self._case = case
            try:
                self._reference = reference_outputs(case)
            except Exception as exc:  # noqa: BLE001 - recorded on every provider of the case
                self._reference = RuntimeError(f"reference failed: {describe_error(exc)}")
        if isinstance(self._reference, Exception):
            raise self._reference
        return self._reference

    def forget_case(self) -> None:
        self._case = self._reference = None


def gate_one(provider: Provider, case: Case, ctx: SuiteContext) -> tuple:
    """Build, run once and check one provider on one case: ``(record, step)``, with ``step``
    None when the provider is skipped or fails (the record says why). Never raises."""
    record = new_record(case.shape, case.mode, provider)
    reason = ctx.skip_reason(provider)
    if reason:
        record.update(status="skipped", error=reason)
        return record, None
    try:
        score = provider.build(case)
        out, grads, seconds = run_once(score, case, ctx.sync)
        record["warmup_call_s"] = seconds
        if provider.key == "compile_fp32":
            ctx.compile_spent_s += seconds
        parity = check_parity(out, grads, ctx.reference(case), case)
        problems = parity.pop("parity_problems")
        record.update(parity)
        if problems and provider.role != "baseline":
            record.update(status="failed", error=f"parity: {problems}")
            return record, None
        return record, make_step(score, case)
    except Exception as exc:  # noqa: BLE001 - one crash must not lose the rest of the suite
        record.update(status="failed", error=describe_error(exc))
        return record, None
    finally:
        case.reset_grads()


def time_gated(gated: list, case: Case, ctx: SuiteContext) -> None:
    """Time every provider that passed its gate, in :data:`TIMING_ROUNDS` interleaved rounds
    (:func:`round_orders`), then its wall time per call and its peak memory; fills the records."""
    grad_to_none = [case.Q, case.D] if case.training else None
    rounds = {i: [] for i, (_, step) in enumerate(gated) if step is not None}  # calls per round
    rep_ms = ctx.timer.rep_ms / TIMING_ROUNDS
    for order in round_orders(len(gated)):
        for i in order:
            if i not in rounds:
                continue
            record, step = gated[i]
            try:
                rounds[i].append(ctx.timer.samples(step, grad_to_none, rep_ms))
            except Exception as exc:  # noqa: BLE001 - recorded; the other providers go on
                record.update(status="failed", error=describe_error(exc))
                del rounds[i]
            finally:
                case.reset_grads()
    for i, calls in rounds.items():
        record, step = gated[i]
        try:
            med, p20, p80 = quantiles_ms([t for times in calls for t in times])
            record.update(ms=med, p20_ms=p20, p80_ms=p80,
                          round_ms=[quantiles_ms(times)[0] for times in calls])
            record["wall_us"], record["wall_iters"] = wall_us_per_call(
                step, case, ctx.sync, med, ctx.timer.rep_ms)
            record["peak_mib"] = peak_mib(step, case, ctx.device)
            record["tflops"] = case.shape.flops / (med * 1e-3) / 1e12
            floor = floor_ms(case.shape, case.mode, ctx.ceilings)
            if floor is not None:
                record.update(floor_ms=floor, pct_floor=100.0 * floor / med)
            record["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - one crash must not lose the rest of the suite
            record.update(status="failed", error=describe_error(exc))
        finally:
            case.reset_grads()


def modes_for(shape: Shape, modes: Sequence[str] | None) -> list:
    """The shape's own (anchored) mode, unless modes were asked for explicitly."""
    return [shape.mode] if not modes else list(modes)


def shape_info(shape: Shape) -> dict:
    info = asdict(shape)
    info.update(description=shape.describe(), flops=shape.flops, input_bytes=shape.input_bytes)
    if shape.anchor is not None:
        best = shape.anchor.best_peer_ms
        info.update(anchor_best_peer_ms=best, anchor_target_ms=best / TARGET_VS_PEER)
    return info


def run_suite(shapes, modes, providers, device, *, warmup_ms=25.0, rep_ms=100.0,
              budget_s=None, compile_budget_s=None, progress=None, on_update=None) -> dict:
    """Gates and times every (shape, mode, provider); returns the ``suite`` section.

    ``on_update(suite)`` is called after each (shape, mode), so a run that is cut short still
    leaves every finished row on disk.
    """
    device = torch.device(device)
    timer = Timer(device, warmup_ms, rep_ms)
    items = [(s, m) for s in shapes for m in modes_for(s, modes)]
    suite = {
        "env": environment(device),
        "settings": {"timer": timer.name, "warmup_ms": warmup_ms, "rep_ms": rep_ms,
                     "rounds": TIMING_ROUNDS,
                     "quantiles": [0.5, 0.2, 0.8], "budget_s": budget_s,
                     "compile_budget_s": compile_budget_s},
        "ceilings": None,
        "shapes": [shape_info(s) for s in dict.fromkeys(s for s, _ in items)],
        "records": [],
        "summary": [],
        "geomean": {},
    }
    try:
        suite["ceilings"] = measure_ceilings(device, timer)
    except Exception as exc:  # noqa: BLE001 - without ceilings the times still stand
        suite["ceilings_error"] = describe_error(exc)
    ctx = SuiteContext(device, timer, suite["ceilings"], budget_s=budget_s,
                       compile_budget_s=compile_budget_s)
    progress = progress or Progress(len(items) * len(providers), enabled=False)
    for shape, mode in items:
        try:
            case = make_case(shape, mode, device)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: record it, go on
            case, error = None, f"inputs: {describe_error(exc)}"
        gated = []
        for provider in providers:
            if case is None:
                record = new_record(shape, mode, provider)
                record.update(status="failed", error=error)
                gated.append((record, None))
            else:
                gated.append(gate_one(provider, case, ctx))
        if case is not None:
            time_gated(gated, case, ctx)
        for provider, (record, _) in zip(providers, gated):
            progress.start(f"{shape.name} {MODE_LABELS[mode]} {provider.key}")
            suite["records"].append(json_safe(record))
            progress.done(_result_text(record))
        ctx.forget_case()
        case = None
        release_memory(device)
        suite["summary"], suite["geomean"] = summarize(suite["records"])
        if on_update is not None:
            on_update(suite)
    progress.close()
    return suite


def _result_text(record: dict) -> str:
    if record["status"] == "ok":
        return f"{fmt_ms(record['ms'])} ms"
    return f"{record['status']} ({record['error']})"
