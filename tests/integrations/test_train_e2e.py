"""``benchmarks/train_pylate_e2e.py --steps 3 --device cpu``: the end-to-end proof runs in CI.

It fine-tunes the packaged all-MiniLM-L6-v2 as a ColBERT model with PyLate twice, on PyLate's
torch scoring and on fusedmaxsim, from the same seed; in fp32 on the CPU the two loss curves
agree to rounding.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from _hosts import child_env

pytestmark = pytest.mark.integrations

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train_pylate_e2e.py"
# About 17 s on an idle 2-core machine (most of it importing PyLate and loading the model twice).
# Wall time is not asserted: CI shares its cores with the other test workers.


def test_three_cpu_steps_agree_with_pylate(tmp_path):
    pytest.importorskip("pylate.losses")
    env = child_env()
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "3", "--device", "cpu", "--out", str(tmp_path)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["steps"] == 3 and result["device"] == "cpu"
    for route in ("pylate_torch", "fusedmaxsim"):
        assert len(result["losses"][route]) == 3
    assert result["max_abs_delta"] < 1e-5, result["abs_delta"]
    assert result["mean_abs_delta"] <= result["max_abs_delta"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
