"""Loading the host libraries in the test environment, and running child Pythons there.

The hosts are imported exactly as a user imports them, in the environment docs/integrations.md
describes (requirements-integrations.txt installed with --no-deps): ``import colpali_engine``
loads the package with its whole model zoo, which works without torchvision under the pinned
transformers.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
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


def import_colpali() -> bool:
    """Import colpali-engine and its scoring, loss and processing modules; False if not installed."""
    if importlib.util.find_spec("colpali_engine") is None:
        return False
    importlib.import_module("colpali_engine")
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
