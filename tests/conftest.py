"""Test set-up: on a machine without CUDA the Triton kernels run under the interpreter.

``TRITON_INTERPRET`` must be set before any kernel is decorated, so it is set here, before the
package is imported. Outputs of the Triton launchers are poisoned with NaN (and -7 for integer
buffers) so that an element the kernels forget to write fails the comparison. ``torch.compile``
caches into a directory of this run's own: a compiled graph cached by an earlier build of the
package would call its registered ops with their old schemas (the cache's key does not cover
them).
"""

import atexit
import os
import shutil
import tempfile

if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _inductor_cache = tempfile.mkdtemp(prefix="fusedmaxsim-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _inductor_cache
    atexit.register(shutil.rmtree, _inductor_cache, ignore_errors=True)

import torch  # noqa: E402

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
def _exact_fp32_for_the_interpreter_tests_on_a_gpu(request):
    """On a machine with CUDA, the tests written for the interpreter (those not marked ``gpu``)
    keep the fp32 they were written for: the interpreter's products are exact IEEE fp32, the
    GPU's default is TF32. Tests of the settings themselves keep the default."""
    uses_kernels = "device" in request.fixturenames or "backend" in request.fixturenames
    if not ON_GPU or "gpu" in request.keywords or not uses_kernels:
        yield
        return
    from fusedmaxsim import settings

    with settings.use_fp32_precision("ieee"):
        yield


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(params=["triton", "torch"])
def backend(request):
    """Run a test on both implementations: the Triton kernels (interpreted on CPU) and PyTorch."""
    from fusedmaxsim import settings

    if request.param == "triton" and ON_GPU and "device" not in request.fixturenames:
        # Tests without the device fixture make CPU tensors, which Triton runs only interpreted,
        # on machines without CUDA (CI runs them there; test_gpu*.py cover the GPU).
        pytest.skip("Triton on CPU tensors runs under the interpreter, on machines without CUDA")
    with settings.use_backend(request.param):
        yield request.param
