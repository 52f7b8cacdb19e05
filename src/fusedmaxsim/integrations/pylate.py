"""PyLate on fusedmaxsim: drop-in replacements for PyLate's ColBERT scoring functions.

Two ways in:

* explicitly: ``losses.Contrastive(model, score_metric=ColBERTScores())``,
  ``losses.CachedContrastive(model, score_metric=ColBERTScores())``,
  ``losses.Distillation(model, score_metric=colbert_kd_scores)``, or call the functions yourself;
* ``patch()`` once: PyLate's ``colbert_scores``, ``colbert_scores_pairwise``, ``colbert_kd_scores``
  and ``ColBERTScores`` (and with them its three losses, evaluators and ``rank.rerank``) run on
  fusedmaxsim with no other change. ``unpatch()`` puts everything back. Both are idempotent.

Mask semantics. PyLate's torch path *multiplies* the similarities by the masks, so a masked
document token still takes part in the max with similarity 0: when every valid similarity of a
query token is negative, PyLate scores that token 0, where fusedmaxsim's exclusion (-inf) would
score the largest negative similarity. The adapters default to ``mask_semantics="host"``, which
reproduces PyLate exactly by zero-filling the masked tokens, ``maxsim(Q * q_mask, D * d_mask)``:
a zeroed token has similarity exactly 0, so this is PyLate's formula, gradients included (a masked
token gets gradient 0 either way). ``mask_semantics="exclude"`` passes the masks to fusedmaxsim
instead: masked tokens never win, nothing is copied, and scores differ from PyLate's only in the
case above.

Results are cast to the dtype PyLate's torch path returns (the promotion of the embedding and mask
dtypes); fusedmaxsim accumulates in fp32 before that single rounding.

An explicit ``backend=`` other than ``"auto"`` (or ``PYLATE_SCORES_BACKEND`` set to one), and
``FUSEDMAXSIM_DISABLE=1``, hand the call to PyLate's own code, read at every call.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Sequence
from types import ModuleType

import torch
from torch import Tensor

from ..api import maxsim, maxsim_pairs
from . import disabled, host_dtype, swap_references

__all__ = [
    "MASK_SEMANTICS",
    "ColBERTScores",
    "colbert_kd_scores",
    "colbert_scores",
    "colbert_scores_pairwise",
    "is_patched",
    "patch",
    "unpatch",
]

MASK_SEMANTICS = ("host", "exclude")

# PyLate >= 1.5 defines the scorers in scores/colbert.py; 1.4 and older in scores/scores.py.
_SCORES_MODULES = ("pylate.scores.colbert", "pylate.scores.scores")
_FUNCTIONS = ("colbert_scores", "colbert_scores_pairwise", "colbert_kd_scores")
_CALL = "ColBERTScores.__call__"

_lock = threading.Lock()
_originals: dict[str, object] = {}  # PyLate's own objects while patched, else empty


# --------------------------------------------------------------------------------------------
# The drop-in functions
# --------------------------------------------------------------------------------------------


def colbert_scores(
    queries_embeddings,
    documents_embeddings,
    queries_mask: Tensor | None = None,
    documents_mask: Tensor | None = None,
    backend: str | None = None,
    *,
    mask_semantics: str = "host",
) -> Tensor:
    """``pylate.scores.colbert_scores``: every query against every document, ``[Nq, B]``.

    Args:
        queries_embeddings: ``[Nq, Lq, d]`` (tensor, ndarray or list of equal-shape tensors).
        documents_embeddings: ``[B, Ld, d]``.
        queries_mask: ``[Nq, Lq]``, bool or float 0/1.
        documents_mask: ``[B, Ld]``, bool or float 0/1; holes are fine (PyLate's skiplist).
        backend: ``None`` / ``"auto"`` runs fusedmaxsim; any other value is PyLate's.
        mask_semantics: ``"host"`` (PyLate's multiply-by-mask, exact) or ``"exclude"``.
    """
    return _masked_scores(
        "colbert_scores", 3, queries_embeddings, documents_embeddings, queries_mask,
        documents_mask, backend, mask_semantics,
    )


def colbert_kd_scores(
    queries_embeddings,
    documents_embeddings,
    queries_mask: Tensor | None = None,
    documents_mask: Tensor | None = None,
    backend: str | None = None,
    *,
    mask_semantics: str = "host",
) -> Tensor:
    """``pylate.scores.colbert_kd_scores``: each query against its own K candidates, ``[Nq, K]``.

    ``documents_embeddings`` is ``[Nq, K, Ld, d]`` and ``documents_mask`` ``[Nq, K, Ld]``; this is
    what ``losses.Distillation`` and ``ColBERTDistillationEvaluator`` pass.
    """
    return _masked_scores(
        "colbert_kd_scores", 4, queries_embeddings, documents_embeddings, queries_mask,
        documents_mask, backend, mask_semantics,
    )


def _masked_scores(name, doc_dims, queries, documents, q_mask, d_mask, backend, mask_semantics):
    """PyLate's ``name`` (``colbert_scores`` or ``colbert_kd_scores``): its own code when the
    backend or ``FUSEDMAXSIM_DISABLE`` asks for it, else fused."""
    if _use_host(backend):
        return _host(name)(queries, documents, q_mask, d_mask, backend=backend)
    Q, D = _as_tensor(queries), _as_tensor(documents)
    _expect_dims(name, Q, 3, D, doc_dims)
    return _scores(Q, D, _as_tensor(q_mask), _as_tensor(d_mask), mask_semantics)


def colbert_scores_pairwise(
    queries_embeddings, documents_embeddings, backend: str | None = None
) -> Tensor:
    """``pylate.scores.colbert_scores_pairwise``: the score of each ``(query[b], document[b])``.

    Takes padded tensors ``[B, Lq, d]`` and ``[B, Ld, d]`` (every token scores, padding included,
    as in PyLate), or lists of per-example ``[L_b, d]`` tensors or arrays of different lengths, as
    PyLate's evaluators pass them straight from ``model.encode``. Lists are padded and masked, so
    each pair scores exactly its own tokens, like PyLate's per-pair loop, in one fused call.
    """
    if _use_host(backend):
        return _host("colbert_scores_pairwise")(
            queries_embeddings, documents_embeddings, backend=backend
        )
    if isinstance(queries_embeddings, Tensor) and isinstance(documents_embeddings, Tensor):
        Q, D = queries_embeddings, documents_embeddings
        _expect_dims("colbert_scores_pairwise", Q, 3, D, 3)
        return maxsim_pairs(Q, D).to(host_dtype(Q, D))
    queries = [_as_tensor(q) for q in queries_embeddings]
    documents = [_as_tensor(d) for d in documents_embeddings]
    n = min(len(queries), len(documents))  # PyLate zips the two sequences
    if n == 0:
        raise ValueError("colbert_scores_pairwise needs at least one (query, document) pair")
    Q, q_mask = _pad(queries[:n])
    D, d_mask = _pad(documents[:n])
    return maxsim_pairs(Q, D, q_mask, d_mask).to(host_dtype(*queries[:n], *documents[:n]))


class ColBERTScores:
    """``pylate.scores.ColBERTScores`` in one fused call instead of one call per document slot.

    Takes queries ``[Nq, Lq, d]`` and the stack ``[B, N, Ld, d]`` of each query's positive and
    negatives (masks ``[B, N, Ld]``) and returns ``[Nq, B * N]`` with PyLate's query-major columns:
    column ``b * N + k`` is slot ``k`` of group ``b``. Flattening the stack to ``[B * N, Ld, d]``
    (a view for the contiguous stacks the losses build) gives exactly that column order, so the
    whole matrix is one ``fusedmaxsim.maxsim`` call.
    """

    def __init__(self, mask_semantics: str = "host") -> None:
        _check_semantics(mask_semantics)
        self.mask_semantics = mask_semantics

    def __call__(
        self,
        queries_embeddings,
        documents_embeddings,
        queries_mask: Tensor | None = None,
        documents_mask: Tensor | None = None,
        backend: str | None = None,
    ) -> Tensor:
        return _stacked_scores(
            self, queries_embeddings, documents_embeddings, queries_mask, documents_mask, backend
        )

    def __repr__(self) -> str:
        return (
            f"fusedmaxsim.integrations.pylate.ColBERTScores(mask_semantics={self.mask_semantics!r})"
        )


def _stacked_scores(
    self,
    queries_embeddings,
    documents_embeddings,
    queries_mask=None,
    documents_mask=None,
    backend=None,
) -> Tensor:
    """The body of ``ColBERTScores.__call__``, also installed on PyLate's class by ``patch()``."""
    if _use_host(backend):
        host_class = _scores_module().ColBERTScores
        instance = self if isinstance(self, host_class) else host_class()
        call = _originals.get(_CALL, host_class.__call__)
        return call(
            instance,
            queries_embeddings,
            documents_embeddings,
            queries_mask,
            documents_mask,
            backend=backend,
        )
    Q, D = _as_tensor(queries_embeddings), _as_tensor(documents_embeddings)
    _expect_dims("ColBERTScores", Q, 3, D, 4)
    B, N, Ld, d = D.shape
    d_mask = _as_tensor(documents_mask)
    flat_mask = None if d_mask is None else d_mask.reshape(B * N, Ld)
    semantics = getattr(self, "mask_semantics", "host")
    return _scores(Q, D.reshape(B * N, Ld, d), _as_tensor(queries_mask), flat_mask, semantics)


# --------------------------------------------------------------------------------------------
# patch() / unpatch()
# --------------------------------------------------------------------------------------------


def patch() -> None:
    """Route PyLate's scoring, and so its three losses, through fusedmaxsim.

    Replaces the three scoring functions wherever a loaded PyLate module holds them (the defining
    module, ``pylate.scores``, the losses, evaluators and ``rank`` that imported them by name, and
    default arguments such as ``Distillation(score_metric=colbert_kd_scores)``), and installs the
    single-call ``ColBERTScores.__call__`` on PyLate's class, which reaches loss objects built
    before the patch too. Modules PyLate imports later pick the replacements up from
    ``pylate.scores``. A loss or model built before ``patch()`` that stored a scoring *function*
    (``Distillation``, ``ColBERT.similarity``) keeps PyLate's: patch first, then build.
    """
    with _lock:
        if _originals:
            return
        module = _scores_module()
        importlib.import_module("pylate.scores")
        saved: dict[str, object] = {name: getattr(module, name) for name in _FUNCTIONS}
        if hasattr(module, "ColBERTScores"):
            saved[_CALL] = module.ColBERTScores.__dict__["__call__"]
        ours = _replacements()
        swap_references("pylate", {id(saved[n]): (saved[n], ours[n]) for n in _FUNCTIONS})
        if _CALL in saved:
            module.ColBERTScores.__call__ = _stacked_scores
        _originals.update(saved)


def unpatch() -> None:
    """Undo :func:`patch`: every reference it replaced points at PyLate's own object again."""
    with _lock:
        if not _originals:
            return
        ours = _replacements()
        swap_references("pylate", {id(ours[n]): (ours[n], _originals[n]) for n in _FUNCTIONS})
        if _CALL in _originals:
            _scores_module().ColBERTScores.__call__ = _originals[_CALL]
        _originals.clear()


def is_patched() -> bool:
    """Whether :func:`patch` is in effect."""
    return bool(_originals)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _replacements() -> dict[str, object]:
    return {
        "colbert_scores": colbert_scores,
        "colbert_scores_pairwise": colbert_scores_pairwise,
        "colbert_kd_scores": colbert_kd_scores,
    }


def _scores_module() -> ModuleType:
    for name in _SCORES_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if not _is_part_of(error.name, name):
                raise  # PyLate is there but one of its own dependencies is missing
            continue
        if all(hasattr(module, f) for f in _FUNCTIONS):
            return module
    raise ImportError(
        "fusedmaxsim.integrations.pylate needs PyLate with pylate.scores.colbert_scores, "
        "colbert_scores_pairwise and colbert_kd_scores (pip install pylate)"
    )


def _is_part_of(missing: str | None, module: str) -> bool:
    """Whether ``missing`` is ``module`` or one of its parent packages."""
    return missing is not None and (module == missing or module.startswith(missing + "."))


def _host(name: str):
    """PyLate's own function, also while it is patched out."""
    original = _originals.get(name)
    return original if original is not None else getattr(_scores_module(), name)


def _use_host(backend: str | None) -> bool:
    if disabled():
        return True
    chosen = backend if backend is not None else os.environ.get("PYLATE_SCORES_BACKEND")
    return chosen is not None and str(chosen).lower() != "auto"


def _check_semantics(mask_semantics: str) -> None:
    if mask_semantics not in MASK_SEMANTICS:
        raise ValueError(f"mask_semantics must be one of {MASK_SEMANTICS}, got {mask_semantics!r}")


def _scores(
    Q: Tensor, D: Tensor, q_mask: Tensor | None, d_mask: Tensor | None, semantics: str
) -> Tensor:
    _check_semantics(semantics)
    dtype = host_dtype(Q, D, q_mask, d_mask)
    if semantics == "host":
        out = maxsim(_zero_fill(Q, q_mask), _zero_fill(D, d_mask))
    else:
        out = maxsim(Q, D, q_mask, d_mask)
    return out.to(dtype)


def _zero_fill(x: Tensor, mask: Tensor | None) -> Tensor:
    """``x`` with masked tokens set to 0: ``<q, 0> = 0`` is PyLate's ``similarity * mask``."""
    return x if mask is None else x * mask.unsqueeze(-1).to(x.dtype)


def _expect_dims(what: str, Q: Tensor, q_dims: int, D: Tensor, d_dims: int) -> None:
    if Q.dim() != q_dims or D.dim() != d_dims:
        raise ValueError(
            f"{what} expects {q_dims}-D queries and {d_dims}-D documents, "
            f"got {tuple(Q.shape)} and {tuple(D.shape)}"
        )


def _as_tensor(x):
    """PyLate's ``convert_to_tensor``: tensors as they are, arrays and lists stacked."""
    if x is None or isinstance(x, Tensor):
        return x
    if isinstance(x, (list, tuple)):
        if not x:
            return torch.tensor([], dtype=torch.float32)
        if isinstance(x[0], Tensor):
            return torch.stack(list(x))
        if isinstance(x[0], (list, tuple)):
            return torch.tensor(x, dtype=torch.float32)
        import numpy as np

        return torch.from_numpy(np.array(x, dtype=np.float32))
    return torch.as_tensor(x)


def _pad(seqs: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Right-pad ``[L_b, d]`` tensors to ``[B, max L, d]`` plus the bool mask of real tokens."""
    lengths = torch.tensor([s.shape[0] for s in seqs], device=seqs[0].device)
    padded = torch.nn.utils.rnn.pad_sequence(list(seqs), batch_first=True)
    mask = torch.arange(padded.shape[1], device=padded.device) < lengths.unsqueeze(1)
    return padded, mask
