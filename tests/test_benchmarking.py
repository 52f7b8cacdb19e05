"""The benchmark harness of ``benchmarks/harness/`` on a CPU: its gate, its records and its
command line.

Timings here are meaningless (tiny shapes, a few milliseconds of repetitions); what is checked
is the logic that decides what gets timed and what gets written. The harness is not part of the
package: it is imported from the repository's ``benchmarks`` folder, put on ``sys.path`` here.
"""

import argparse
import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fusedmaxsim.reference import maxsim_ref

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from harness.cli import add_bench_arguments, parse_modes, run_bench, select_providers, select_shapes
from harness.coldstart import cold_start_child
from harness.parity import GRAD_TOL, Reference, check_parity, ref_blocks, reference_outputs
from harness.providers import PROVIDERS_BY_KEY, Provider, naive_maxsim_fp32
from harness.records import SCHEMA
from harness.shapes import QUICK_SHAPES, SHAPES, SHAPES_BY_NAME, make_case
from harness.suite import RECORD_KEYS, run_suite
from harness.timing import TIMING_ROUNDS, floor_ms, round_orders
from harness.util import Progress

FAST = {"warmup_ms": 0.5, "rep_ms": 2.0}
CPU = torch.device("cpu")


def _provider(key, role, build):
    return Provider(key, key, role, build)


def _scaled_scores(case):
    """Right shape, wrong numbers: 10% too large."""
    return lambda: naive_maxsim_fp32(case.Q, case.D, case.q_mask, case.d_mask,
                                     case.shape.normalize) * 1.1


def _wrong_gradients(case):
    """Right scores, but every query token gets an extra gradient of 0.5."""
    def run():
        scores = naive_maxsim_fp32(case.Q, case.D, case.q_mask, case.d_mask)
        extra = case.Q.float().sum()
        return scores + 0.5 * (extra - extra.detach())
    return run


def _crashes(case):
    def run():
        raise RuntimeError("kernel exploded")
    return run


def _suite(shape_names, providers):
    shapes = [SHAPES_BY_NAME[n] for n in shape_names]
    return run_suite(shapes, None, providers, CPU, **FAST)


def _by_provider(suite):
    return {r["provider"]: r for r in suite["records"]}


def test_anchor_shapes_are_the_sixteen_with_their_floors():
    names = [s.name for s in SHAPES]
    assert len(names) == len(set(names)) == 16
    assert names[0] == "rerank_colbert" and names[-1] == "train_kd_colpali"
    ceilings = {"matmul_tflops": 790.0, "copy_gbps": 4300.0}  # the anchors' ceilings
    for shape in SHAPES:
        floor = floor_ms(shape, shape.mode, ceilings)
        assert floor == pytest.approx(shape.anchor.floor_ms, abs=1.5e-3), shape.name


@pytest.mark.parametrize("name", ["quick_batch_masked", "quick_kd", "quick_norm"])
def test_naive_baselines_compute_maxsim(name):
    case = make_case(SHAPES_BY_NAME[name], "inference", CPU)
    ref = maxsim_ref(case.Q.double(), case.D.double(), case.q_mask, case.d_mask,
                     normalize=case.shape.normalize)
    out = naive_maxsim_fp32(case.Q, case.D, case.q_mask, case.d_mask, case.shape.normalize)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_blocked_reference_equals_one_call():
    case = make_case(SHAPES_BY_NAME["quick_train_masked"], "training", CPU)
    whole = reference_outputs(case)
    block_elems = case.shape.lq * case.shape.ld * 3
    assert ref_blocks(case.shape) == (case.shape.nq, case.shape.nd)  # one block by default
    assert ref_blocks(case.shape, block_elems) == (1, 3)
    blocked = reference_outputs(case, block_elems)
    for got, want in [(blocked.scores, whole.scores), (blocked.grad_q, whole.grad_q),
                      (blocked.grad_d, whole.grad_d)]:
        torch.testing.assert_close(got, want)


def test_parity_gate_refuses_wrong_scores_and_never_times_them():
    providers = [PROVIDERS_BY_KEY["fusedmaxsim"], _provider("bad", "peer", _scaled_scores),
                 PROVIDERS_BY_KEY["naive"]]
    suite = _suite(["quick_batch_masked"], providers)
    bad = _by_provider(suite)["bad"]
    assert bad["status"] == "failed" and bad["error"].startswith("parity: score rel err")
    assert bad["parity_ok"] is False and bad["score_rel_err"] > 0.05
    assert bad["ms"] is None and bad["wall_us"] is None
    row = suite["summary"][0]
    assert row["best_peer"] is None and row["speedup_vs_peer"] is None
    assert row["targets"]["vs_peer"]["applies"] is False
    assert _by_provider(suite)["fusedmaxsim"]["status"] == "ok"


def test_parity_gate_checks_gradients_in_training():
    suite = _suite(["quick_train"], [_provider("bad_grad", "peer", _wrong_gradients)])
    record = suite["records"][0]
    assert record["score_rel_err"] < 1e-5
    assert record["status"] == "failed" and "grad_q Frobenius rel err" in record["error"]
    assert record["ms"] is None


def test_gradient_gate_weighs_how_many_rows_moved():
    """Gradients are gated in the Frobenius norm: one row of 65536 moved whole (as a near-tie of
    the max decided otherwise moves a query token's gradient) passes, though its max-norm error
    is recorded at the row's size; a thousandth of the rows moved is refused."""
    gen = torch.Generator().manual_seed(0)
    ref_grad = torch.randn(65536, 16, generator=gen, dtype=torch.float64)
    scores = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    ref = Reference(scores, ref_grad, ref_grad)
    case = SimpleNamespace(shape=SimpleNamespace(dtype="bfloat16"), training=True)

    def moved(rows: int) -> torch.Tensor:
        grad = ref_grad.clone()
        grad[:rows] = torch.randn(rows, 16, generator=gen, dtype=torch.float64)
        return grad.bfloat16()

    one = check_parity(scores.float(), (moved(1), moved(1)), ref, case)
    assert one["parity_ok"] and one["grad_q_fro_err"] < GRAD_TOL < one["grad_q_rel_err"]
    many = check_parity(scores.float(), (moved(66), moved(66)), ref, case)
    assert not many["parity_ok"] and "grad_q Frobenius rel err" in many["parity_problems"]


def test_a_crashing_provider_is_recorded_and_the_rest_still_run():
    providers = [_provider("boom", "peer", _crashes), PROVIDERS_BY_KEY["fusedmaxsim"]]
    records = _by_provider(_suite(["quick_rerank"], providers))
    assert records["boom"]["status"] == "failed"
    assert records["boom"]["error"] == "RuntimeError: kernel exploded"
    assert records["fusedmaxsim"]["status"] == "ok" and records["fusedmaxsim"]["ms"] > 0


def test_a_baseline_outside_the_tolerance_is_still_timed():
    suite = _suite(["quick_rerank"], [_provider("bad_naive", "baseline", _scaled_scores)])
    record = suite["records"][0]
    assert record["parity_ok"] is False
    assert record["status"] == "ok" and record["ms"] > 0


def test_record_schema_and_summary():
    providers = [PROVIDERS_BY_KEY[k] for k in ("fusedmaxsim", "lik", "naive", "naive_fp32")]
    suite = _suite(["quick_rerank", "quick_kd"], providers)
    json.dumps(suite, allow_nan=False)
    assert [(r["shape"], r["provider"]) for r in suite["records"]] == [
        (s, p.key) for s in ("quick_rerank", "quick_kd") for p in providers]
    for record in suite["records"]:
        assert tuple(record) == RECORD_KEYS
    records = _by_provider(suite)
    assert records["lik"]["status"] == "skipped" and records["lik"]["error"] == "needs CUDA"
    ours = [r for r in suite["records"] if r["provider"] == "fusedmaxsim"]
    for r in ours:
        assert r["status"] == "ok" and r["parity_ok"] is True
        assert r["p20_ms"] <= r["ms"] <= r["p80_ms"]
        assert r["tflops"] > 0 and r["floor_ms"] > 0 and r["pct_floor"] > 0
        assert r["peak_mib"] is None  # no allocator statistics on a CPU
    assert ours[1]["grad_q_rel_err"] is not None and ours[1]["grad_tol"] == 1e-2
    assert {s["name"] for s in suite["shapes"]} == {"quick_rerank", "quick_kd"}
    assert set(suite["ceilings"]) >= {"matmul_tflops", "copy_gbps"}
    for row in suite["summary"]:
        assert row["speedup_vs_naive"] == pytest.approx(
            next(r["ms"] for r in suite["records"]
                 if r["shape"] == row["shape"] and r["provider"] == "naive")
            / row["fusedmaxsim_ms"])
        assert set(row["targets"]) == {"vs_peer", "pct_floor", "wall_us", "not_slower_than_naive"}
    assert suite["geomean"]["n_speedup_vs_naive"] == 2


def _run_cli(argv):
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))


def test_quick_cpu_run_writes_json_and_markdown(tmp_path, capsys):
    argv = ["--device", "cpu", "--shapes", "quick_rerank,quick_train", "--out", str(tmp_path),
            "--warmup-ms", "0.5", "--rep-ms", "2"]
    assert _run_cli(argv + ["--peers"]) == 0
    record = json.loads((tmp_path / "maxsim_bench.json").read_text())
    assert record["schema"] == SCHEMA
    assert len(record["suite"]["records"]) == 2 * 5  # fusedmaxsim, LIK, flash, naive, naive fp32
    markdown = (tmp_path / "maxsim_bench.md").read_text()
    for header in ("- device: CPU", "- torch ", "triton", "fusedmaxsim ", "- git: ", "- date: "):
        assert header in markdown
    assert "| quick_train | cross 8×8, 16×48 | fwd+bwd |" in markdown
    assert capsys.readouterr().out == markdown

    # --append keeps the measured suite; --json prints the record.
    assert _run_cli(["--device", "cpu", "--shapes", "none", "--append", "--json",
                     "--out", str(tmp_path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["suite"]["records"] == record["suite"]["records"]


def test_bad_arguments_are_refused(capsys):
    assert _run_cli(["--device", "cpu", "--shapes", "no_such_shape"]) == 2
    assert "unknown shape" in capsys.readouterr().err
    assert _run_cli(["--device", "cpu", "--modes", "sideways"]) == 2


def test_selection_of_shapes_modes_and_providers():
    assert [s.name for s in select_shapes(None, CPU)] == [s.name for s in QUICK_SHAPES]
    assert len(select_shapes("all,rerank_colbert", CPU)) == 16
    assert select_shapes("none", CPU) == []
    assert parse_modes("native") is None
    assert parse_modes("fwd,fwd+bwd") == ["inference", "training"]
    keys = [p.key for p in select_providers(None, False, CPU)]
    assert keys == ["fusedmaxsim", "naive", "naive_fp32"]
    keys = [p.key for p in select_providers(None, True, torch.device("cuda"))]
    assert keys == ["fusedmaxsim", "lik", "flash", "naive", "naive_fp32", "compile_fp32"]
    keys = [p.key for p in select_providers("flash-maxsim,ours", False, CPU)]
    assert keys == ["flash", "fusedmaxsim"]


def test_progress_writes_one_line_per_item_into_a_log():
    stream = io.StringIO()
    progress = Progress(4, stream=stream, width=8)
    for i in range(2):
        progress.start(f"item{i}")
        progress.done("ok")
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines == ["[##......] 1/4 item0: ok", "[####....] 2/4 item1: ok"]


def test_cold_start_child_reports_its_first_call(capsys):
    assert cold_start_child(["fusedmaxsim", "quick_train", "training", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) == {"import_s", "torch_backward_s", "first_call_s", "second_call_s"}
    assert result["first_call_s"] > 0 and result["torch_backward_s"] > 0


@pytest.mark.parametrize("n", [1, 2, 3, 6, 7])
def test_timing_rounds_change_who_goes_first(n):
    """Each round is a permutation of the providers, and with at least as many providers as
    rounds no provider starts two rounds: whoever meets a host still speeding up is not always
    the same."""
    orders = round_orders(n)
    assert len(orders) == TIMING_ROUNDS
    assert all(sorted(order) == list(range(n)) for order in orders)
    firsts = [order[0] for order in orders]
    if n >= TIMING_ROUNDS:
        assert len(set(firsts)) == len(firsts)


def test_every_timed_record_pools_its_rounds():
    providers = [PROVIDERS_BY_KEY[k] for k in ("fusedmaxsim", "naive")]
    suite = _suite(["quick_rerank"], providers)
    for record in suite["records"]:
        assert record["status"] == "ok"
        assert len(record["round_ms"]) == TIMING_ROUNDS
        assert min(record["round_ms"]) <= record["ms"] * (1 + 1e-9)
        assert record["p20_ms"] <= record["ms"] <= record["p80_ms"]
