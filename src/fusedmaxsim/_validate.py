"""Argument checks and the canonical form that every layer below the public API works on.

Every error names the argument and the shapes, and is raised before anything is launched.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import torch
from torch import Tensor

from . import settings
from ._configs import INTERPRETER

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BACKWARD_STRATEGIES = ("auto", "unified", "lowmem")


@dataclasses.dataclass
class Problem:
    """``Q [Nq, Lq, d]``; ``D [Nd, Ld, d]`` (cross product) or ``[Nq, K, Ld, d]`` (candidates)."""

    Q: Tensor
    D: Tensor
    q_mask: Tensor | None  # bool [Nq, Lq]
    d_mask: Tensor | None  # bool, D's token axes
    squeeze_q: bool
    squeeze_d: bool


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _check_float(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype} with shape {_shape(t)}"
        )
    return t


def _check_mask(
    name: str, mask: object, expected: tuple[int, ...], owner: str, device,
    axes: str = "the token axes",
) -> Tensor | None:
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.is_complex():
        raise TypeError(f"{name} must be bool or real-valued (nonzero = valid), got {mask.dtype}")
    if mask.device != device:
        raise ValueError(f"{name} is on {mask.device} but {owner} is on {device}")
    if _shape(mask) != expected:
        raise ValueError(
            f"{name} must have shape {expected} ({axes} of {owner}), got {_shape(mask)}"
        )
    return mask if mask.dtype == torch.bool else mask != 0


REDUCTIONS = ("max", "smoothmax")


def check_reduction(reduction: object, tau: object) -> float:
    """``reduction=`` and ``tau=`` as the ``tau`` the kernels take: 0.0 for the max."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction= must be one of {REDUCTIONS}, got {reduction!r}")
    if reduction == "max":
        return 0.0
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0:
        raise ValueError(f"tau= must be a finite number > 0 for reduction='smoothmax', got {tau!r}")
    return float(tau)


def check_backward(backward: object) -> str:
    value = "auto" if backward is None else backward
    if value not in BACKWARD_STRATEGIES:
        raise ValueError(f"backward= must be one of {BACKWARD_STRATEGIES} or None, got {backward!r}")
    return value


def check_same_space(Q: Tensor, D: Tensor, q_name: str = "Q", d_name: str = "D") -> None:
    """Query and document tokens must share the embedding dim and the device."""
    if Q.shape[-1] != D.shape[-1]:
        raise ValueError(
            f"{q_name} and {d_name} must share the embedding dim d, got {q_name} {_shape(Q)} "
            f"and {d_name} {_shape(D)}"
        )
    if Q.device != D.device:
        raise ValueError(f"{q_name} is on {Q.device} but {d_name} is on {D.device}")


def promote_pair(Q: Tensor, D: Tensor) -> tuple[Tensor, Tensor]:
    """Two token tensors in their common dtype (each copied only when its dtype changes)."""
    if Q.dtype == D.dtype:
        return Q, D
    common = torch.promote_types(Q.dtype, D.dtype)
    return Q.to(common), D.to(common)


def canonical(Q: object, D: object, q_mask: object, d_mask: object) -> Problem:
    """Check ``maxsim``'s arguments and bring them to the 3-D / 4-D form."""
    Q = _check_float("Q", Q)
    D = _check_float("D", D)
    if Q.dim() not in (2, 3):
        raise ValueError(f"Q must be [Lq, d] or [Nq, Lq, d], got shape {_shape(Q)}")
    if D.dim() not in (2, 3, 4):
        raise ValueError(f"D must be [Ld, d], [Nd, Ld, d] or [Nq, K, Ld, d], got shape {_shape(D)}")
    check_same_space(Q, D)
    if D.dim() == 4:
        if Q.dim() != 3:
            raise ValueError(
                f"the per-query candidate layout (D [Nq, K, Ld, d] = {_shape(D)}) needs Q [Nq, Lq, d], "
                f"got Q {_shape(Q)}"
            )
        if D.shape[0] != Q.shape[0]:
            raise ValueError(
                f"the per-query candidate layout needs D.shape[0] == Nq: D {_shape(D)}, Q {_shape(Q)}"
            )
    if q_mask is not None:
        q_mask = _check_mask("q_mask", q_mask, _shape(Q)[:-1], "Q", Q.device)
    if d_mask is not None:
        d_mask = _check_mask("d_mask", d_mask, _shape(D)[:-1], "D", D.device)
    Q, D = promote_pair(Q, D)
    squeeze_q, squeeze_d = Q.dim() == 2, D.dim() == 2
    if squeeze_q:
        Q = Q.unsqueeze(0)
        q_mask = None if q_mask is None else q_mask.unsqueeze(0)
    if squeeze_d:
        D = D.unsqueeze(0)
        d_mask = None if d_mask is None else d_mask.unsqueeze(0)
    return Problem(Q, D, q_mask, d_mask, squeeze_q, squeeze_d)


def canonical_pairs(Q: object, D: object, q_mask: object, d_mask: object) -> Problem:
    """``maxsim_pairs``: ``Q [B, Lq, d]`` and ``D [B, Ld, d]`` become the candidate layout, K = 1."""
    Q = _check_float("Q", Q)
    D = _check_float("D", D)
    if Q.dim() != 3 or D.dim() != 3:
        raise ValueError(f"maxsim_pairs needs Q [B, Lq, d] and D [B, Ld, d], got Q {_shape(Q)}, D {_shape(D)}")
    if Q.shape[0] != D.shape[0]:
        raise ValueError(f"maxsim_pairs needs as many queries as documents, got Q {_shape(Q)}, D {_shape(D)}")
    d_mask = _check_mask("d_mask", d_mask, _shape(D)[:-1], "D", D.device)
    return canonical(Q, D.unsqueeze(1), q_mask, None if d_mask is None else d_mask.unsqueeze(1))


# Looked up once at import: the lookup cannot run inside a torch.compile trace.
_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return _TRITON_AVAILABLE


def select_backend(t: Tensor) -> str:
    """``"triton"`` or ``"torch"`` for this tensor under the current setting."""
    wanted = settings.backend()
    if t.dtype == torch.float64:
        return "torch"  # exact float64 stays on the PyTorch path, on every device
    runnable = triton_available() and (t.is_cuda or (t.device.type == "cpu" and INTERPRETER))
    if wanted == "torch":
        return "torch"
    if wanted == "triton":
        if not runnable:
            why = "Triton is not installed" if not triton_available() else (
                f"tensors are on {t.device}; Triton kernels need CUDA tensors "
                "(or CPU tensors with TRITON_INTERPRET=1)"
            )
            raise RuntimeError(f"FUSEDMAXSIM_BACKEND=triton cannot run here: {why}")
        return "triton"
    return "triton" if runnable and t.is_cuda else "torch"
