"""The MaxSim implementations under test.

Each :class:`Provider` builds, for a :class:`~harness.shapes.Case`, a zero-argument callable
that scores the case's tensors: fusedmaxsim (``ours``), late-interaction-kernels and
flash-maxsim (``peer``, imported only when used), and the baselines (naive PyTorch in the input
dtype and in fp32, and ``torch.compile`` of the fp32 one). :data:`PROVIDERS_BY_KEY` is the
registry the command line and the probes pick from; :func:`provider_unavailable` says why one
cannot run here (not importable, needs CUDA), so it is skipped rather than failed.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .shapes import Case
from .util import describe_error


@dataclass(frozen=True)
class Provider:
    """A MaxSim implementation under test.

    ``build(case)`` returns a zero-argument callable that scores the case's current tensors.
    ``role`` is ``"ours"``, ``"peer"`` or ``"baseline"``: baselines are timed even when they
    fail the parity gate, ours and peers are not. ``module`` is the import the provider needs;
    when it is missing the provider is skipped, not failed.
    """

    key: str
    label: str
    role: str
    build: Callable[[Case], Callable[[], torch.Tensor]]
    module: str | None = None
    needs_cuda: bool = False


def naive_maxsim(Q, D, q_mask=None, d_mask=None, normalize=False) -> torch.Tensor:
    """PyLate-style MaxSim, in the input dtype: the grid every fused kernel avoids.

    ``einsum('ash,bth->abst')`` builds the full ``[Nq, Nd, Lq, Ld]`` similarity grid, masked
    document tokens are filled with -inf before ``amax(-1)``, masked query tokens are zeroed,
    and ``sum(-1)`` adds up the query tokens. The per-query candidate layout uses
    ``'ash,abth->abst'``.
    """
    if normalize:
        Q = F.normalize(Q, dim=-1)
        D = F.normalize(D, dim=-1)
    if D.dim() == 3:
        sim = torch.einsum("ash,bth->abst", Q, D)
        doc_valid = None if d_mask is None else d_mask[None, :, None, :]
    else:
        sim = torch.einsum("ash,abth->abst", Q, D)
        doc_valid = None if d_mask is None else d_mask[:, :, None, :]
    if doc_valid is not None:
        sim = sim.masked_fill(~doc_valid, float("-inf"))
    best = sim.amax(-1)
    if q_mask is not None:
        best = best.masked_fill(~q_mask[:, None, :], 0.0)
    return best.sum(-1).float()


def naive_maxsim_fp32(Q, D, q_mask=None, d_mask=None, normalize=False) -> torch.Tensor:
    """The naive path after upcasting to fp32: accurate, and the usual "safe" choice."""
    return naive_maxsim(Q.float(), D.float(), q_mask, d_mask, normalize)


def _build_fusedmaxsim(case: Case):
    import fusedmaxsim

    return lambda: fusedmaxsim.maxsim(case.Q, case.D, case.q_mask, case.d_mask,
                                      normalize=case.shape.normalize)


def _build_fusedmaxsim_tf32(case: Case):
    """fusedmaxsim with PyTorch's fp32 matmul precision at ``"high"`` for the call: TF32 for fp32
    inputs, as a user who opts in gets it (the default follows PyTorch's ``"highest"``)."""
    import fusedmaxsim

    def run():
        saved = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")
        try:
            return fusedmaxsim.maxsim(case.Q, case.D, case.q_mask, case.d_mask,
                                      normalize=case.shape.normalize)
        finally:
            torch.set_float32_matmul_precision(saved)

    return run


def _build_fusedmaxsim_ieee(case: Case):
    """fusedmaxsim with the explicit ``ieee`` setting: exact fp32 products on the FMA units."""
    import fusedmaxsim

    def run():
        with fusedmaxsim.settings.use_fp32_precision("ieee"):
            return fusedmaxsim.maxsim(case.Q, case.D, case.q_mask, case.d_mask,
                                      normalize=case.shape.normalize)

    return run


def _build_lik(case: Case):
    # LIK checks the norm of the first call's inputs with a host sync; the check is advice for
    # users, not part of the op, so it stays off while timing.
    os.environ.setdefault("LIK_SUPPRESS_NORM_WARN", "1")
    import late_interaction_kernels as lik

    return lambda: lik.maxsim(case.Q, case.D, case.q_mask, case.d_mask,
                              normalize=case.shape.normalize)


def _build_flash(case: Case):
    """flash-maxsim takes prefix lengths instead of masks and has no fused normalize.

    It gets the case's lengths, and where the shape normalizes, the normalization runs inside
    the timed call, as it would for a user of that library.
    """
    import flash_maxsim

    shared_docs = case.shape.layout == "cross"
    if case.training:
        op = flash_maxsim.flash_maxsim_batched_train
    else:
        op = flash_maxsim.flash_maxsim_batched

    def run():
        Q, D = case.Q, case.D
        if case.shape.normalize:
            Q = F.normalize(Q, dim=-1)
            D = F.normalize(D, dim=-1)
        return op(Q, D, shared_docs=shared_docs, doc_lengths=case.doc_lengths,
                  query_lengths=case.query_lengths)

    return run


def _build_naive(case: Case):
    return lambda: naive_maxsim(case.Q, case.D, case.q_mask, case.d_mask, case.shape.normalize)


def _build_naive_fp32(case: Case):
    return lambda: naive_maxsim_fp32(case.Q, case.D, case.q_mask, case.d_mask,
                                     case.shape.normalize)


def _build_compile_fp32(case: Case):
    # A fresh Dynamo cache per case: every shape compiles statically, and the recompile limit
    # can never silently drop a later shape back to eager.
    torch._dynamo.reset()
    compiled = torch.compile(naive_maxsim_fp32, dynamic=False)
    return lambda: compiled(case.Q, case.D, case.q_mask, case.d_mask, case.shape.normalize)


PROVIDERS: tuple = (
    Provider("fusedmaxsim", "fusedmaxsim", "ours", _build_fusedmaxsim),
    # Variants of ours, timed beside the default; a baseline, so a TF32 result outside the fp32
    # parity bounds is still timed (and its error recorded).
    Provider("fusedmaxsim_tf32", "fusedmaxsim tf32", "baseline", _build_fusedmaxsim_tf32),
    Provider("fusedmaxsim_ieee", "fusedmaxsim ieee", "baseline", _build_fusedmaxsim_ieee),
    Provider("lik", "LIK", "peer", _build_lik, module="late_interaction_kernels", needs_cuda=True),
    Provider("flash", "flash", "peer", _build_flash, module="flash_maxsim", needs_cuda=True),
    Provider("naive", "naive", "baseline", _build_naive),
    Provider("naive_fp32", "naive fp32", "baseline", _build_naive_fp32),
    Provider("compile_fp32", "compile fp32", "baseline", _build_compile_fp32),
)
PROVIDERS_BY_KEY = {p.key: p for p in PROVIDERS}
PROVIDER_ALIASES = {"late_interaction_kernels": "lik", "late-interaction-kernels": "lik",
                     "flash_maxsim": "flash", "flash-maxsim": "flash", "ours": "fusedmaxsim"}
PEER_KEYS = tuple(p.key for p in PROVIDERS if p.role == "peer")


def provider_unavailable(provider: Provider, device: torch.device) -> str | None:
    """Why ``provider`` cannot run here, or None when it can."""
    if provider.needs_cuda and device.type != "cuda":
        return "needs CUDA"
    if provider.module is not None:
        try:
            importlib.import_module(provider.module)
        except Exception as exc:  # noqa: BLE001 - a broken install must not stop the others
            return f"not importable: {describe_error(exc)}"
    return None
