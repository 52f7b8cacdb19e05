"""``fusedmaxsim bench`` on a CPU: it runs, prints its table, and gates speedups on parity.

Tiny shapes and a millisecond of timing: the numbers mean nothing here, the table and the gate
do.
"""

import json
import re

import fusedmaxsim
from fusedmaxsim.cli import main

TINY = ["--device", "cpu", "--shapes", "2x3x4x16x8,1x5x3x7x16", "--rep-ms", "1"]


def test_bench_prints_the_table_with_its_baseline_and_parity(capsys):
    assert main(["bench", *TINY]) == 0
    out = capsys.readouterr().out
    assert "baseline: naive PyTorch in float32" in out
    assert "fused ms" in out and "naive ms" in out and "speedup" in out
    rows = [line for line in out.splitlines() if line.startswith(("2x3x4x16x8", "1x5x3x7x16"))]
    assert len(rows) == 2 and all(line.endswith("ok") for line in rows)
    assert "parity failed on 0 of 2" in out
    assert "the sides timed in alternation" in out
    summary = [line for line in out.splitlines() if line.startswith("against ")]
    assert len(summary) == 1
    assert summary[0].startswith("against naive PyTorch in float32: fused slower on ")
    assert re.search(r" of 2 timed shapes, level \(within the noise\) on \d, faster on \d "
                     r"\(median speedup ", summary[0])
    assert "speedup:  median of the rounds' ratios; x: faster, ~: level" in out
    assert "fp32 ms" not in out  # float32 inputs: the one baseline


def test_bench_training_step_checks_gradients(capsys):
    assert main(["bench", *TINY, "--backward", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["mode"] == "forward + backward" and result["dtype"] == "float32"
    for row in result["rows"]:
        assert row["parity"] is True and row["grad_err"] < 1e-5
        assert row["fused_ms"] > 0 and row["naive_ms"] > 0 and row["speedup"] > 0


def test_bench_refuses_a_speedup_when_fused_disagrees(monkeypatch, capsys):
    real = fusedmaxsim.maxsim
    monkeypatch.setattr(fusedmaxsim, "maxsim", lambda Q, D: real(Q, D) * 1.1)
    assert main(["bench", *TINY]) == 1
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("2x3x4x16x8", "1x5x3x7x16"))]
    assert len(rows) == 2
    for line in rows:
        assert "FAIL" in line and "not timed" in line
        assert not re.search(r"\d\.\d\dx", line)  # no speedup
    assert "parity failed on 2 of 2 (no speedup reported there)" in out


def test_bench_refuses_an_unknown_shape(capsys):
    assert main(["bench", "--device", "cpu", "--shapes", "nope"]) == 2
    assert "unknown shape 'nope'" in capsys.readouterr().err


def test_bench_names_both_baselines_for_16_bit_inputs(capsys):
    """bf16 inputs: the naive formula in bf16 (similarities rounded to bf16) and on fp32 copies
    (as precise as the fused similarities), each with its own count of shapes where fused loses."""
    assert main(["bench", *TINY, "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "baseline: naive PyTorch in bfloat16: einsum over the [Nq, Nd, Lq, Ld] grid" in out
    assert "and the same on float32 copies of the bfloat16 inputs, the copies timed too" in out
    header = next(line for line in out.splitlines() if line.startswith("shape "))
    assert "naive ms  speedup   fp32 ms  speedup" in header
    rows = [line for line in out.splitlines() if line.startswith(("2x3x4x16x8", "1x5x3x7x16"))]
    assert len(rows) == 2
    assert all(len(re.findall(r"\d\.\d\d[x~<]", line)) == 2 and line.endswith("ok") for line in rows)
    summary = [line for line in out.splitlines() if line.startswith("against ")]
    assert [line.split(":")[0] for line in summary] == [
        "against naive PyTorch in bfloat16", "against naive PyTorch on float32 copies"]
    assert all(re.search(r"fused slower on \d of 2 timed shapes, level \(within the noise\) on "
                         r"\d, faster on \d \(median speedup ", line) for line in summary)


def test_bench_json_counts_the_shapes_where_fused_loses(capsys):
    assert main(["bench", *TINY, "--dtype", "float16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["baseline"] == "naive PyTorch in float16"
    assert result["baseline_fp32"] == "naive PyTorch on float32 copies"
    assert result["timed"] == 2 and result["parity_failed"] == 0
    for suffix, speedup in (("", "speedup"), ("_fp32", "speedup_fp32")):
        intervals = [row[speedup + "_interval"] for row in result["rows"]]
        assert all(lo <= row[speedup] <= hi for row, (lo, hi) in zip(result["rows"], intervals))
        assert result["slower" + suffix] == sum(hi < 1 for _, hi in intervals)
        assert result["faster" + suffix] == sum(lo > 1 for lo, _ in intervals)
        assert result["level" + suffix] == sum(lo <= 1 <= hi for lo, hi in intervals)
    for row in result["rows"]:
        assert row["naive_fp32_ms"] > 0


def test_speedup_interval_is_the_median_and_its_order_statistics():
    """The rounds' ratios base / fused: their median and the ranks n/2 ∓ 0.98·√n around it."""
    from fusedmaxsim._bench import speedup_interval

    fused = [1.0] * 100
    base = [0.5 + i / 100 for i in range(100)]  # ratios 0.50 .. 1.49, shuffled order irrelevant
    med, lo, hi = speedup_interval(base[::-1], fused)
    assert med == base[50] and lo == base[40] and hi == base[60]
    assert speedup_interval([2.0] * 7, [1.0] * 7) == (2.0, 2.0, 2.0)
