"""See and steer the planner: :func:`explain` says what runs for a call, :func:`recording` collects
the plans of the calls in a block, :func:`forced_plan` forces any decision (tests, probes, tuning).

Every call goes through one planner (``fusedmaxsim._plan``): it turns the call's problem (layout,
sizes, dtype, masks, normalization, reduction, whether a gradient is needed) and the settings
into a frozen plan: which kernel runs (Triton, the Hopper Gluon forward, or PyTorch), its tiles,
the grid's splits, the backward strategy and how its buffers are chunked. ``docs/design.md``
explains each choice and the measurement behind it.

Examples::

    >>> import torch, fusedmaxsim
    >>> print(fusedmaxsim.explain(torch.randn(4, 32, 128), torch.randn(10, 300, 128)))  # doctest: +ELLIPSIS
    problem: cross: Nq=4 Ncols=10 Lq=32 Ld=300 d=128 float32 on cpu; ...
    >>> from fusedmaxsim.planning import FwdConfig
    >>> with fusedmaxsim.forced_plan(strategy="lowmem"):
    ...     pass
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._plan import (
    FORCIBLE,
    MEASURED,
    BackwardPlan,
    BwdConfig,
    ForwardPlan,
    FwdConfig,
    explain_plans,
    forced_plan,
    recording,
)
from ._problem import canonical, check_backward, check_reduction, dense_problem, options_for

__all__ = [
    "FORCIBLE", "MEASURED", "BackwardPlan", "BwdConfig", "ForwardPlan", "FwdConfig", "explain",
    "forced_plan", "recording",
]


def explain(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None = None,
    d_mask: Tensor | None = None,
    *,
    normalize: bool = False,
    backward: str | None = None,
    reduction: str = "max",
    tau: float = 0.1,
    training: bool | None = None,
) -> str:
    """The plan :func:`fusedmaxsim.maxsim` would run for these arguments, in words: the kernel,
    its tiles and splits, and (for a training call) the backward's strategy and chunking, each
    with its reason. Nothing is launched; the inputs' values are not read.

    Args:
        Q, D, q_mask, d_mask, normalize, backward, reduction, tau: as for
            :func:`fusedmaxsim.maxsim`.
        training (bool, optional): plan a call that saves the argmax for a backward. Default:
            whether ``Q`` or ``D`` requires grad (under grad mode).

    Returns:
        str: one line for the problem, one for the options, then the forward's (and the
        backward's) plan.
    """
    x = canonical(Q, D, q_mask, d_mask)
    strategy = check_backward(backward)
    tau = check_reduction(reduction, tau)
    if training is None:
        training = torch.is_grad_enabled() and (x.Q.requires_grad or x.D.requires_grad)
    o = options_for(x.Q)
    normalize = bool(normalize) and not tau  # the smooth max normalizes its inputs first
    from_tiles = normalize and not training and o.backend == "triton"
    p = dense_problem(x.Q, x.D, x.q_mask, x.d_mask, normalize=normalize,
                      norm_from_tiles=from_tiles, tau=tau, save_argmax=bool(training))
    return explain_plans(p, o, strategy)
