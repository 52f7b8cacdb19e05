"""The command-line tool: help texts, one-line errors, the NumPy-free import, ``check``'s messages
and ``check --triton``.

Most tests call ``fusedmaxsim.cli.main``; those about the process as a whole (the import's
warnings, a re-run under the Triton interpreter) start ``python -m fusedmaxsim``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from fusedmaxsim.cli import build_parser, main

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
COMMANDS = ("info", "check", "bench", "explain")
TINY_BENCH = ["--shapes", "2x3x4x16x8", "--rep-ms", "1"]


def _run(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fusedmaxsim", *args], capture_output=True,
                          text=True, env=env, timeout=timeout, check=False)


def _env_without_numpy(tmp_path) -> dict:
    """The environment of a process where ``import numpy`` fails as it does when NumPy is not
    installed (and, as there, without the Triton interpreter, which needs NumPy)."""
    fake = tmp_path / "numpy"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named \'numpy\'", name="numpy")\n')
    path = [str(tmp_path), os.environ.get("PYTHONPATH", "")]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


# ---------------------------------------------------------------------------------------- NumPy
def test_the_fake_numpy_is_what_torch_warns_about(tmp_path):
    """The set-up of the next test: with NumPy hidden so, a bare ``import torch`` warns."""
    env = _env_without_numpy(tmp_path)
    done = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert done.returncode == 0
    assert "Failed to initialize NumPy" in done.stderr


@pytest.mark.parametrize("args", [
    ("--help",), ("--version",), ("info",), ("info", "--help"), ("check", "--help"),
    ("bench", "--help"), ("explain", "--help"), ("explain", "--nq", "2", "--nd", "3"),
    ("bench", "--device", "cpu", *TINY_BENCH),
])
def test_no_numpy_warning_without_numpy(tmp_path, args):
    done = _run(*args, env=_env_without_numpy(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "NumPy" not in done.stderr and "numpy" not in done.stderr.lower(), done.stderr
    assert done.stdout


def test_import_without_numpy_keeps_the_warning_filters(tmp_path):
    """The warning is silenced for fusedmaxsim's own import of torch only."""
    code = ("import warnings; n = len(warnings.filters); import fusedmaxsim; "
            "assert len(warnings.filters) == n, warnings.filters; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env_without_numpy(tmp_path), timeout=300, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    assert "NumPy" not in done.stderr


def test_check_triton_without_numpy_says_why_in_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("on a CUDA machine --triton runs the compiled kernels")
    done = _run("check", "--triton", "--device", "cpu", env=_env_without_numpy(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        ("fusedmaxsim check: error: --triton on a CPU runs the Triton interpreter, which needs "
         "NumPy (pip install numpy)")]


# ----------------------------------------------------------------------------------------- help
def _subparsers() -> dict:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


@pytest.mark.parametrize("command", (None, *COMMANDS))
def test_help_is_plain_text(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"] if command is None else [command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fusedmaxsim")
    for markup in ("``", ":func:", ":class:", ":data:", ":meth:", "`"):
        assert markup not in out, f"{markup!r} in the help of {command}"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_has_a_help_text(command):
    sub = _subparsers()[command]
    assert sub.description, f"{command} has no description"
    for action in sub._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 10, f"{command} {action.option_strings}"


def test_check_help_describes_its_options(capsys):
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # as wrapped at any terminal width
    assert "--device DEVICE torch device: cpu, cuda, cuda:1" in out
    assert "--json print the cases and their errors as JSON" in out
    assert "--triton check the Triton kernels: on a CPU under the Triton interpreter" in out
    assert "--all with --triton on a CPU: every case, not a subset" in out


# ------------------------------------------------------------------------------------- devices
@NO_CUDA
@pytest.mark.parametrize("command", COMMANDS)
def test_an_unavailable_device_is_one_line(command, capsys):
    assert main([command, "--device", "cuda"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"fusedmaxsim {command}: error: device 'cuda' is not available here: "
        + ("this PyTorch was built without CUDA" if torch.version.cuda is None
           else "no CUDA device is visible")
        + f" (torch {torch.__version__}); use --device cpu"]


@NO_CUDA
def test_an_unavailable_device_exits_without_a_traceback():
    done = _run("check", "--device", "cuda:1")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("fusedmaxsim check: error: device 'cuda:1' is not available")
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_device_is_one_line(command, capsys):
    assert main([command, "--device", "nonsense"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        (f"fusedmaxsim {command}: error: unknown device 'nonsense': a torch device such as "
         "cpu, cuda or cuda:1")]


def test_all_goes_with_triton(capsys):
    assert main(["check", "--all", "--device", "cpu"]) == 2
    assert "--all goes with --triton" in capsys.readouterr().err


# ------------------------------------------------------------------------------ check on a CPU
@pytest.fixture
def float32_matmul_precision():
    saved = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(saved)


def _info_precision(capsys) -> str:
    assert main(["info", "--device", "cpu", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["settings"]["FUSEDMAXSIM_FP32_PRECISION"]


@pytest.mark.parametrize("torch_precision", ["highest", "high"])
def test_check_names_its_precision_and_the_one_info_reports(torch_precision, capsys,
                                                            float32_matmul_precision):
    """check runs fp32 in IEEE whatever the setting, and says so next to the precision in force,
    which it reports exactly as info does."""
    float32_matmul_precision(torch_precision)
    in_force = _info_precision(capsys)
    assert in_force.startswith("ieee" if torch_precision == "highest" else "tf32")
    main(["check", "--device", "cpu", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["fp32"].startswith("fp32 rows run in exact fp32 (ieee), whatever the setting")
    assert result["fp32"].endswith(f"as fusedmaxsim info prints it: {in_force}")
    assert {row["fp32"] for row in result["rows"]} == {"ieee", "-"}


def test_check_on_cpu_says_it_tests_the_pytorch_path_only(capsys):
    if torch.cuda.is_available():
        pytest.skip("on a CUDA machine check runs the Triton kernels")
    assert main(["check", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert ("checks:   the PyTorch path only; the Triton kernels run on CUDA devices, or here "
            "under the Triton interpreter: fusedmaxsim check --triton") in out
    assert "fp32:     fp32 rows run in exact fp32 (ieee)" in out
    assert "58 passed, 0 failed (" in out
    plaid = [line.split() for line in out.splitlines() if line.split()[:1] in (["residual"],
                                                                               ["approx"])]
    assert len(plaid) == 6 and all(row[-1] == "PASS" for row in plaid)
    head = [line.split() for line in out.splitlines() if line.split()[:1] == ["hidden"]]
    assert len(head) == 4 and all(row[-1] == "PASS" for row in head)


def test_check_triton_reruns_under_the_interpreter():
    """Started without TRITON_INTERPRET, check --triton runs a subset of the cases on the Triton
    kernels in a new process under the interpreter."""
    if torch.cuda.is_available():
        pytest.skip("on a CUDA machine --triton runs the compiled kernels")
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "FUSEDMAXSIM_BACKEND")}
    done = _run("check", "--triton", "--device", "cpu", env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert ("checks:   the Triton kernels under the Triton interpreter, 15 of 58 cases (the "
            "interpreter is slow; --all runs every case, a few minutes)") in out
    rows = [line.split() for line in out.splitlines() if line.endswith("PASS")]
    assert len(rows) == 15 and all(row[5] == "triton" for row in rows)
    assert [row[0] for row in rows[12:]] == ["residual", "approx", "hidden"]
    rows = rows[:12]
    # Each layout with each backward strategy; each dtype with each strategy and normalization.
    assert {(row[0], row[3]) for row in rows} == {
        (layout, strategy) for layout in ("cross", "candidates", "pairs", "single")
        for strategy in ("unified", "lowmem", "smooth")}
    assert len({(row[1], row[3], row[4]) for row in rows}) == 12
    assert "15 passed, 0 failed (" in out
