"""colpali-engine on fusedmaxsim: drop-in scoring and losses for ColPali-style models.

Two ways in:

* explicitly: the functions below, and the five late-interaction losses under their own names,
  built on first use as subclasses of colpali-engine's (``from fusedmaxsim.integrations.colpali
  import ColbertNegativeCELoss``);
* ``patch()`` once: ``maxsim_inbatch`` and ``maxsim_kd`` are replaced wherever colpali-engine
  holds them (the dispatcher module, the losses, ``processing_utils``),
  ``BaseVisualRetrieverProcessor.score_multi_vector`` (and so every ``Col*Processor.score``) and
  the ``forward`` of the two negative-document losses are swapped. ``unpatch()`` restores them.

Semantics. colpali-engine passes no masks: pad tokens are zero vectors that take part in the max
with similarity 0 (left padding across ranks included). fusedmaxsim is called without masks too,
so the scores are the host's exactly. The negative-document losses score their positives with
``fusedmaxsim.maxsim_pairs`` instead of a diagonal einsum over a ``[B, Lq, Ld]`` grid.

Gradients equal the host's on every token that is not an all-zero padding row. At ties the host's
``amax`` splits the gradient evenly while fusedmaxsim gives it to the lowest index; the only ties
that occur in practice are between zero rows (a padded query token has similarity 0 with every
document token), so only the gradient *into padding rows* differs, and ColVision models multiply
their output by the attention mask, which zeroes exactly those rows before they reach a weight.

``use_smooth_max=True`` (``tau · logsumexp(s / tau)`` instead of the max) is scored by the fused
smooth max (``maxsim(..., reduction="smoothmax", tau=loss.tau)``), with no masks either, so every
token, zero padding included, takes part in the log-sum-exp exactly as in the host's einsum; its
gradient reaches every token, padding rows included, as the host's does. ``FUSEDMAXSIM_DISABLE=1``, or
``COLPALI_SCORES_BACKEND`` set to anything but ``auto``, hands every call to colpali-engine.
"""

from __future__ import annotations

import importlib
import os
import threading
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from ..api import maxsim, maxsim_pairs
from . import disabled, host_dtype, swap_references

__all__ = [
    "is_patched",
    "maxsim_inbatch",
    "maxsim_kd",
    "patch",
    "score_multi_vector",
    "unpatch",
]
# Also importable, built on first access: ColbertLoss, ColbertPairwiseCELoss, ColbertSigmoidLoss,
# ColbertNegativeCELoss, ColbertPairwiseNegativeCELoss (see __getattr__ below).

_MAXSIM = "colpali_engine.utils.maxsim"
_LOSSES = "colpali_engine.loss.late_interaction_losses"
_PROCESSING = "colpali_engine.utils.processing_utils"
_INBATCH_LOSSES = ("ColbertLoss", "ColbertPairwiseCELoss", "ColbertSigmoidLoss")
# negative-document loss -> (attribute holding its in-batch loss, how many positives it scores)
_NEGATIVE_LOSSES = {
    "ColbertNegativeCELoss": ("inner_loss", "negatives"),
    "ColbertPairwiseNegativeCELoss": ("inner_pairwise", "queries"),
}
_DISPATCH = ("maxsim_inbatch", "maxsim_kd")
_SCORE = "score_multi_vector"
_INBATCH_SCORES = "_inbatch_scores"  # ColbertModule's, which scores the smooth max by einsum

_lock = threading.Lock()
_originals: dict[str, object] = {}  # colpali-engine's own objects while patched, else empty
_classes: dict[str, type] = {}


# --------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------


def maxsim_inbatch(query: Tensor, doc: Tensor) -> Tensor:
    """``colpali_engine.utils.maxsim.maxsim_inbatch``: ``[Bq, Lq, d] x [Bd, Ld, d] -> [Bq, Bd]``."""
    if _use_host():
        return _host(_DISPATCH[0])(query, doc)
    return _inbatch(query, doc)


def maxsim_kd(query: Tensor, doc: Tensor) -> Tensor:
    """``colpali_engine.utils.maxsim.maxsim_kd``: ``[B, Lq, d] x [B, N, Ld, d] -> [B, N]``."""
    if _use_host():
        return _host(_DISPATCH[1])(query, doc)
    return _kd(query, doc)


def score_multi_vector(qs, ps, batch_size: int = 128, device=None) -> Tensor:
    """``BaseVisualRetrieverProcessor.score_multi_vector``: ``[n_q, n_p]`` fp32 scores on the CPU.

    ``qs`` and ``ps`` are lists of ``[L_i, d]`` tensors of any lengths, or padded tensors. Each
    block of ``batch_size`` is zero-padded to its longest member exactly as colpali-engine does
    (the zero rows score 0 and take part in the max), so the scores follow the host's semantics
    exactly; one fused call per block pair replaces its einsum.
    """
    if _use_host():
        return _host_score_multi_vector()(qs, ps, batch_size=batch_size, device=device)
    device = device or _default_device()
    if len(qs) == 0:
        raise ValueError("No queries provided")
    if len(ps) == 0:
        raise ValueError("No passages provided")
    pad = torch.nn.utils.rnn.pad_sequence
    rows = []
    for i in range(0, len(qs), batch_size):
        q_block = pad(qs[i : i + batch_size], batch_first=True, padding_value=0).to(device)
        blocks = [
            _inbatch(
                q_block, pad(ps[j : j + batch_size], batch_first=True, padding_value=0).to(device)
            )
            for j in range(0, len(ps), batch_size)
        ]
        rows.append(torch.cat(blocks, dim=1).cpu())
    return torch.cat(rows, dim=0).to(torch.float32)


# --------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------


def negative_ce_forward(
    self, query_embeddings, doc_embeddings, neg_doc_embeddings, offset: int = 0
):
    """``ColbertNegativeCELoss.forward`` with fused positives (pairs) and negatives (candidates)."""
    return _negative_loss(
        self, "ColbertNegativeCELoss", query_embeddings, doc_embeddings, neg_doc_embeddings, offset
    )


def pairwise_negative_ce_forward(
    self, query_embeddings, doc_embeddings, neg_doc_embeddings, offset: int = 0
):
    """``ColbertPairwiseNegativeCELoss.forward`` with fused positives and negatives."""
    return _negative_loss(
        self,
        "ColbertPairwiseNegativeCELoss",
        query_embeddings,
        doc_embeddings,
        neg_doc_embeddings,
        offset,
    )


_NEGATIVE_FORWARDS = {
    "ColbertNegativeCELoss": negative_ce_forward,
    "ColbertPairwiseNegativeCELoss": pairwise_negative_ce_forward,
}


def _negative_loss(self, name, query, doc, neg, offset):
    """colpali-engine 0.3.18's negative-document losses, term for term, on fused scores."""
    if _use_host():
        return _host_forward(name)(self, query, doc, neg, offset)
    tau = _smooth_tau(self)
    inner, positives = _NEGATIVE_LOSSES[name]
    n_pos = neg.size(0) if positives == "negatives" else query.size(0)
    lengths = (query[:, :, 0] != 0).sum(dim=1)
    pos_scores = _pairs(query, doc[offset : offset + n_pos], tau)
    neg_scores = _kd(query, neg, tau)
    if self.normalize_scores:
        pos_scores = self._apply_normalization(pos_scores, lengths)
        neg_scores = self._apply_normalization(neg_scores, lengths)
    loss = F.softplus((neg_scores - pos_scores.unsqueeze(1)) / self.temperature).mean()
    if self.in_batch_term_weight > 0:
        loss_ib = getattr(self, inner)(query, doc, offset)
        loss = loss * (1 - self.in_batch_term_weight) + loss_ib * self.in_batch_term_weight
    return loss


def _inbatch_scores(self, query_embeddings, doc_embeddings):
    """``ColbertModule._inbatch_scores`` on the fused in-batch scores, max or smooth max."""
    if _use_host():
        return _host_inbatch_scores()(self, query_embeddings, doc_embeddings)
    scores = _inbatch(query_embeddings, doc_embeddings, _smooth_tau(self))
    if self.normalize_scores:
        lengths = (query_embeddings[:, :, 0] != 0).sum(dim=1)
        scores = self._apply_normalization(scores, lengths)
    return scores


def __getattr__(name: str):
    if name in _INBATCH_LOSSES or name in _NEGATIVE_LOSSES:
        return _loss_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _loss_class(name: str) -> type:
    """colpali-engine's loss ``name`` subclassed to score through fusedmaxsim (built once)."""
    with _lock:
        cls = _classes.get(name)
        if cls is not None:
            return cls
        base = getattr(_losses_module(), name)
        body = {
            "__module__": __name__,
            "__doc__": f"colpali-engine's ``{name}``, scored by fusedmaxsim (same arguments).",
        }
        if name in _NEGATIVE_LOSSES:
            body["forward"] = _NEGATIVE_FORWARDS[name]
            body["__init__"] = _fused_children_init(base)
        else:
            body["_inbatch_scores"] = _inbatch_scores
        cls = _classes[name] = type(name, (base,), body)
        return cls


def _fused_children_init(base: type):
    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        # The in-batch term lives in a child loss the host builds itself; give it the fused class
        # (same state, one overridden method) rather than rebuilding it from copied arguments.
        for child in self.children():
            kind = type(child).__name__
            if kind in _INBATCH_LOSSES and type(child) is getattr(_losses_module(), kind):
                child.__class__ = _loss_class(kind)

    return __init__


# --------------------------------------------------------------------------------------------
# patch() / unpatch()
# --------------------------------------------------------------------------------------------


def patch() -> None:
    """Route colpali-engine's late-interaction scoring and losses through fusedmaxsim.

    Needs colpali-engine with ``colpali_engine.utils.maxsim`` (the dispatcher its losses and
    processors call). Raises ``ImportError`` rather than patching part of it.
    """
    with _lock:
        if _originals:
            return
        dispatch, losses, processing = _host_modules()
        processor = processing.BaseVisualRetrieverProcessor
        saved: dict[str, object] = {name: getattr(dispatch, name) for name in _DISPATCH}
        saved[_SCORE] = processor.__dict__[_SCORE]
        for name in _NEGATIVE_LOSSES:
            saved[name] = getattr(losses, name).__dict__["forward"]
        saved[_INBATCH_SCORES] = losses.ColbertModule.__dict__[_INBATCH_SCORES]
        ours = _replacements()
        swap_references("colpali_engine", {id(saved[n]): (saved[n], ours[n]) for n in _DISPATCH})
        processor.score_multi_vector = staticmethod(score_multi_vector)
        for name, forward in _NEGATIVE_FORWARDS.items():
            getattr(losses, name).forward = forward
        losses.ColbertModule._inbatch_scores = _inbatch_scores
        _originals.update(saved)


def unpatch() -> None:
    """Undo :func:`patch`."""
    with _lock:
        if not _originals:
            return
        _, losses, processing = _host_modules()
        ours = _replacements()
        swap_references(
            "colpali_engine", {id(ours[n]): (ours[n], _originals[n]) for n in _DISPATCH}
        )
        processing.BaseVisualRetrieverProcessor.score_multi_vector = _originals[_SCORE]
        for name in _NEGATIVE_LOSSES:
            getattr(losses, name).forward = _originals[name]
        losses.ColbertModule._inbatch_scores = _originals[_INBATCH_SCORES]
        _originals.clear()


def is_patched() -> bool:
    """Whether :func:`patch` is in effect."""
    return bool(_originals)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _reduction(tau: float) -> dict:
    """``maxsim``'s keywords for the max (``tau == 0``) or the smooth max at ``tau``."""
    return {"reduction": "smoothmax", "tau": tau} if tau else {}


def _smooth_tau(loss) -> float:
    """The loss's smooth-max temperature, or 0.0 for the max."""
    return float(loss.tau) if loss.use_smooth_max else 0.0


def _inbatch(query: Tensor, doc: Tensor, tau: float = 0.0) -> Tensor:
    _expect_dims("maxsim_inbatch", query, doc, 3)
    return maxsim(query, doc, **_reduction(tau)).to(host_dtype(query, doc))


def _kd(query: Tensor, doc: Tensor, tau: float = 0.0) -> Tensor:
    _expect_dims("maxsim_kd", query, doc, 4)
    return maxsim(query, doc, **_reduction(tau)).to(host_dtype(query, doc))


def _pairs(query: Tensor, doc: Tensor, tau: float = 0.0) -> Tensor:
    return maxsim_pairs(query, doc, **_reduction(tau)).to(host_dtype(query, doc))


def _expect_dims(what: str, query: Tensor, doc: Tensor, doc_dims: int) -> None:
    if query.dim() != 3 or doc.dim() != doc_dims:
        raise ValueError(
            f"{what} expects query [B, Lq, d] and a {doc_dims}-D doc, "
            f"got {tuple(query.shape)} and {tuple(doc.shape)}"
        )


def _use_host() -> bool:
    if disabled():
        return True
    chosen = os.environ.get("COLPALI_SCORES_BACKEND")
    return chosen is not None and chosen.lower() != "auto"


def _replacements() -> dict[str, object]:
    return {"maxsim_inbatch": maxsim_inbatch, "maxsim_kd": maxsim_kd}


def _host_modules() -> tuple[ModuleType, ModuleType, ModuleType]:
    try:
        return tuple(importlib.import_module(m) for m in (_MAXSIM, _LOSSES, _PROCESSING))
    except ModuleNotFoundError as error:
        if error.name is not None and (_MAXSIM + ".").startswith(error.name + "."):
            raise ImportError(
                "fusedmaxsim.integrations.colpali needs colpali-engine with "
                f"{_MAXSIM} (pip install 'colpali-engine>=0.3.17')"
            ) from error
        raise


def _losses_module() -> ModuleType:
    return importlib.import_module(_LOSSES)


def _host(name: str):
    original = _originals.get(name)
    return original if original is not None else getattr(importlib.import_module(_MAXSIM), name)


def _host_forward(name: str):
    original = _originals.get(name)
    return original if original is not None else getattr(_losses_module(), name).forward


def _host_inbatch_scores():
    original = _originals.get(_INBATCH_SCORES)
    return original if original is not None else _losses_module().ColbertModule._inbatch_scores


def _host_score_multi_vector():
    original = _originals.get(_SCORE)
    if original is not None:
        return original.__func__
    return importlib.import_module(_PROCESSING).BaseVisualRetrieverProcessor.score_multi_vector


def _default_device() -> str:
    """colpali-engine's ``get_torch_device("auto")``."""
    if torch.cuda.is_available():
        return "cuda:0"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"
