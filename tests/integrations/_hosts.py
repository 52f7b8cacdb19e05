"""Loading the host libraries in the test environment.

colpali-engine's package ``__init__`` imports its whole model zoo, and the image processors of
those models import torchvision. PyPI ships torchvision built for CUDA only, which does not load
against a CPU build of torch, so on a CPU-only machine the scoring and loss modules under test
are imported without the zoo: the package is registered as a bare namespace whose submodules
import normally. Where torchvision works, colpali-engine is imported as it is.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import fusedmaxsim

COLPALI_MODULES = (
    "colpali_engine.utils.maxsim",
    "colpali_engine.loss.late_interaction_losses",
    "colpali_engine.utils.processing_utils",
)


STEERING = ("FUSEDMAXSIM_DISABLE", "PYLATE_SCORES_BACKEND", "COLPALI_SCORES_BACKEND")


def child_env(**extra: str) -> dict[str, str]:
    """Environment for a child Python: this fusedmaxsim and these helpers importable from any
    working directory, none of the variables that steer the hosts' scoring set."""
    paths = [str(Path(__file__).parent), str(Path(fusedmaxsim.__file__).parents[1])]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    env = {k: v for k, v in os.environ.items() if k not in STEERING}
    env.update(PYTHONPATH=os.pathsep.join(paths), **extra)
    return env


def torchvision_works() -> bool:
    """Checked in a child process: a torchvision that fails to load leaves half-imported modules."""
    if importlib.util.find_spec("torchvision") is None:
        return False
    probe = subprocess.run(
        [sys.executable, "-c", "import torchvision"], check=False, capture_output=True
    )
    return probe.returncode == 0


def import_colpali() -> bool:
    """Import colpali-engine's scoring, loss and processing modules; False if not installed."""
    spec = importlib.util.find_spec("colpali_engine")
    if spec is None:
        return False
    if "colpali_engine" not in sys.modules and not torchvision_works():
        shell = types.ModuleType("colpali_engine")
        shell.__path__ = list(spec.submodule_search_locations)
        shell.__spec__ = spec
        shell.__file__ = spec.origin
        sys.modules["colpali_engine"] = shell
    for name in COLPALI_MODULES:
        importlib.import_module(name)
    return True


class CallCounter:
    """Counts the calls into fusedmaxsim an integration module makes, by wrapping its globals."""

    NAMES = ("maxsim", "maxsim_pairs")

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module
        self.calls: list[tuple[str, tuple]] = []
        self._saved = {name: getattr(module, name) for name in self.NAMES}

    def __enter__(self) -> CallCounter:  # noqa: PYI034 - not subclassed
        for name, fn in self._saved.items():
            setattr(self.module, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(self.module, name, fn)

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.calls.append((name, args))
            return fn(*args, **kwargs)

        return counted

    def count(self, name: str | None = None) -> int:
        return sum(1 for n, _ in self.calls if name is None or n == name)
