"""Drop-in scoring for the libraries that train and serve late-interaction models.

* :mod:`fusedmaxsim.integrations.pylate` — PyLate's ``colbert_scores``,
  ``colbert_scores_pairwise``, ``colbert_kd_scores``, ``ColBERTScores`` and the losses on them.
* :mod:`fusedmaxsim.integrations.colpali` — colpali-engine's ``maxsim_inbatch``, ``maxsim_kd``,
  ``score_multi_vector`` and its late-interaction losses.

Each module offers two routes: callables you pass explicitly (``score_metric=`` and friends), and
``patch()`` / ``unpatch()`` that reroute the host library in place. The host libraries are
imported only when one of their functions is called or patched, so fusedmaxsim itself keeps
depending on torch and triton alone.

Every entry point reads ``FUSEDMAXSIM_DISABLE`` at call time: when it is set, the host's own code
runs instead, which is the quickest way to tell whether a difference comes from fusedmaxsim.
"""

from __future__ import annotations

import inspect
import sys
from functools import reduce

import torch

from .. import settings

__all__ = ["disabled"]

def disabled() -> bool:
    """True when ``FUSEDMAXSIM_DISABLE`` asks every integration to run the host's own code."""
    return settings.integrations_disabled()


def host_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """The dtype the hosts' einsum paths return: type promotion over embeddings and masks.

    fusedmaxsim accumulates in fp32 and returns fp32; the adapters cast to this dtype so a
    drop-in returns what the code it replaces returned (a bf16 einsum gives bf16 scores, a bool
    mask keeps the embedding dtype, a float32 mask promotes half embeddings to float32).
    """
    return reduce(torch.promote_types, (t.dtype for t in tensors if t is not None))


def swap_references(package: str, mapping: dict[int, tuple[object, object]]) -> None:
    """Replace ``old`` by ``new`` wherever a loaded module of ``package`` holds it.

    ``mapping`` is ``{id(old): (old, new)}``. The scan covers module globals (the names that
    ``from ..scores import colbert_scores`` bound at import time) and the default arguments of the
    functions and methods defined in those modules (``Distillation(score_metric=colbert_kd_scores)``
    binds its default when the class is defined). Patching only the defining module would miss
    both, which is how monkey-patches usually go wrong.
    """
    prefix = package + "."
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if namespace is None or not (name == package or name.startswith(prefix)):
            continue
        for attr, value in list(namespace.items()):
            hit = mapping.get(id(value))
            if hit is not None and hit[0] is value:
                setattr(module, attr, hit[1])
            elif inspect.isfunction(value) and value.__module__ == name:
                _swap_defaults(value, mapping)
            elif inspect.isclass(value) and value.__module__ == name:
                for member in vars(value).values():
                    _swap_defaults(inspect.unwrap(getattr(member, "__func__", member)), mapping)


def _swap_defaults(fn: object, mapping: dict[int, tuple[object, object]]) -> None:
    if not inspect.isfunction(fn):
        return
    if fn.__defaults__:
        fn.__defaults__ = tuple(_swapped(v, mapping) for v in fn.__defaults__)
    if fn.__kwdefaults__:
        fn.__kwdefaults__ = {k: _swapped(v, mapping) for k, v in fn.__kwdefaults__.items()}


def _swapped(value: object, mapping: dict[int, tuple[object, object]]) -> object:
    hit = mapping.get(id(value))
    return hit[1] if hit is not None and hit[0] is value else value
