"""Test set-up: on a machine without CUDA the Triton kernels run under the interpreter.

``TRITON_INTERPRET`` must be set before any kernel is decorated, so it is set here, before the
package is imported. Outputs of the Triton launchers are poisoned with NaN (and -7 for integer
buffers) so that an element the kernels forget to write fails the comparison.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("FUSEDMAXSIM_POISON_OUTPUTS", "1")

import pytest  # noqa: E402

import fusedmaxsim  # noqa: E402,F401

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _cpu_suite_semantics_on_a_gpu(request):
    """On a machine with CUDA, the tests written for the interpreter (those not marked ``gpu``)
    run on the GPU as they do on CPU: tensors they create without a device land on CUDA, and
    fp32 is exact (the interpreter's products are IEEE fp32; the GPU default is TF32)."""
    if not ON_GPU or "gpu" in request.keywords:
        yield
        return
    from fusedmaxsim import settings

    with torch.device("cuda"), settings.use_fp32_precision("ieee"):
        yield


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(params=["triton", "torch"])
def backend(request):
    """Run a test on both implementations: the Triton kernels (interpreted on CPU) and PyTorch."""
    from fusedmaxsim import settings

    with settings.use_backend(request.param):
        yield request.param
