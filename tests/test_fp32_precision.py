"""fp32 inputs follow PyTorch's matmul precision unless fusedmaxsim's own setting says otherwise.

PyTorch multiplies fp32 in full precision by default (``torch.get_float32_matmul_precision()`` is
``"highest"``) and uses TF32 only after ``torch.set_float32_matmul_precision("high")`` or
``"medium"``; fusedmaxsim's default (``FUSEDMAXSIM_FP32_PRECISION=torch``) does the same, resolved
at every call: ``tf32`` or ``ieee``; ``tf32x3`` is an explicit setting. The GPU suite checks the
numbers (tests/test_gpu.py); these tests check the
resolution, which is the same on every device.
"""

import os
import subprocess
import sys

import pytest
import torch

import fusedmaxsim
from fusedmaxsim import settings


@pytest.fixture
def torch_precision():
    """Sets PyTorch's fp32 matmul precision for one test and restores it."""
    saved = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(saved)


def _options_line(Q, D) -> str:
    """The options line of the plan the Triton kernels would run (the PyTorch path's products
    follow PyTorch's setting by themselves: its options keep ``torch``)."""
    with settings.use_backend("triton"):
        return next(line for line in fusedmaxsim.explain(Q, D).splitlines()
                    if "fp32_precision=" in line)


def test_default_follows_torch_at_every_call(torch_precision):
    assert settings.fp32_precision_setting() == "torch"
    Q, D = torch.randn(2, 5, 16), torch.randn(3, 7, 16)
    torch_precision("highest")
    assert settings.fp32_precision() == "ieee"
    assert "fp32_precision=ieee" in _options_line(Q, D)
    for value in ("high", "medium"):
        torch_precision(value)
        assert settings.fp32_precision() == "tf32"
        assert "fp32_precision=tf32" in _options_line(Q, D)
    torch_precision("highest")
    assert "fp32_precision=ieee" in _options_line(Q, D)
    assert "fp32_precision=torch" in fusedmaxsim.explain(Q, D)  # the PyTorch path


def test_an_explicit_setting_wins(torch_precision):
    torch_precision("highest")
    with settings.use_fp32_precision("tf32"):
        assert settings.fp32_precision() == "tf32"
    torch_precision("high")
    with settings.use_fp32_precision("ieee"):
        assert settings.fp32_precision() == "ieee"
        with settings.use_fp32_precision("torch"):
            assert settings.fp32_precision() == "tf32"
    assert settings.fp32_precision_setting() == "torch"


def test_bad_values_name_the_choices():
    with pytest.raises(ValueError, match=r"\('torch', 'tf32', 'tf32x3', 'ieee'\), got 'fp16'"):
        settings.set_fp32_precision("fp16")
    assert settings.fp32_precision_setting() == "torch"


def test_info_says_what_the_default_resolves_to(torch_precision):
    torch_precision("highest")
    value = dict(settings.effective())["FUSEDMAXSIM_FP32_PRECISION"]
    assert value.startswith("ieee (follows PyTorch") and "'highest'" in value
    with settings.use_fp32_precision("tf32"):
        assert dict(settings.effective())["FUSEDMAXSIM_FP32_PRECISION"] == "tf32"


def _run(code: str, **env) -> str:
    environment = {**os.environ, **env}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=environment, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_environment_variable_and_the_per_backend_api():
    """In fresh processes: the variable overrides PyTorch, and where a program uses PyTorch's
    per-backend API (which makes ``get_float32_matmul_precision`` raise), that setting decides."""
    code = "import fusedmaxsim; print(fusedmaxsim.settings.fp32_precision())"
    assert _run(code, FUSEDMAXSIM_FP32_PRECISION="tf32") == "tf32"
    assert _run(code, FUSEDMAXSIM_FP32_PRECISION="torch") == "ieee"
    assert _run(code, FUSEDMAXSIM_FP32_PRECISION="tf32x3") == "tf32x3"
    assert _run(code, FUSEDMAXSIM_FP32_PRECISION="ieee") == "ieee"
    per_backend = (
        "import torch, fusedmaxsim\n"
        "torch.set_float32_matmul_precision('highest')\n"
        "torch.backends.cuda.matmul.fp32_precision = '{}'\n"
        "print(fusedmaxsim.settings.fp32_precision())"
    )
    assert _run(per_backend.format("tf32")) == "tf32"
    assert _run(per_backend.format("ieee")) == "ieee"


def test_a_compiled_call_resolves_the_default_when_it_runs(torch_precision):
    """Under ``torch.compile(fullgraph=True)`` the front door passes the default on to the
    registered op, which resolves it at run time: no graph break, and the same scores as eager."""
    torch_precision("highest")
    Q = torch.randn(3, 6, 16, requires_grad=True)
    D = torch.randn(4, 9, 16, requires_grad=True)

    def step(Q, D):
        return fusedmaxsim.maxsim(Q, D).square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    loss = compiled(Q, D)
    grads = torch.autograd.grad(loss, (Q, D))
    eager = step(Q, D)
    eager_grads = torch.autograd.grad(eager, (Q, D))
    torch.testing.assert_close(loss, eager, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch_precision("high")
    torch.testing.assert_close(compiled(Q, D), eager, rtol=1e-6, atol=1e-6)
