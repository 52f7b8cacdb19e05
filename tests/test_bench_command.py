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
    assert "fused slower than naive on " in out and " of 2 timed shapes" in out


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
