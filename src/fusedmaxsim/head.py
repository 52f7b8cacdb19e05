"""The fused projection head: MaxSim straight from the documents' hidden states.

Late-interaction models end in a small projection: each token's hidden state (``d_model``
384-1024) goes through an ``nn.Linear`` to ``d`` = 96-128, is L2-normalized, then scored by
MaxSim. :func:`maxsim_from_hidden` computes exactly
``maxsim(Q, F.normalize(F.linear(H_d, W, b)))`` (``normalize=False``: without the normalize)
without the caller writing the projected documents: where the planner finds it cheaper, the
Triton kernel projects each document tile on chip and never writes the projection at all;
elsewhere the projection is written once (``d / d_model`` of the hidden states' bytes) and
scored by the dense kernels. The backward works from the saved argmax: only the (document,
token) rows that won a max receive gradient, and their projection is recomputed, not saved: on
the Triton backend by one program a document's (query, query token) entries where those are
fewer than its tokens, by token tiles where the queries meet most of them; by a PyTorch closed
form on the PyTorch path. ``docs/design.md`` ("Fused projection head") says which route runs
where.

Semantics are ``maxsim``'s (``fusedmaxsim.api``): masks, ties (lowest token wins), empty
documents, NaN, fp32 scores accumulated in fp32. The projection is rounded to ``H_d``'s dtype as
``F.linear``'s output is (fp32 accumulation), and each projected token normalized in fp32 from
those rounded values. ``Q`` is taken as given (already projected, and normalized if the model
does so). Gradients reach ``Q``, ``H_d``, ``W`` and ``b``, each only when needed, in its own
dtype; the backward is deterministic.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._autograd import scores_hidden
from ._problem import check_backward, check_bool, check_hidden

__all__ = ["ProjectionHead", "maxsim_from_hidden"]


def maxsim_from_hidden(
    Q: Tensor,
    H_d: Tensor,
    W: Tensor,
    b: Tensor | None = None,
    q_mask: Tensor | None = None,
    d_mask: Tensor | None = None,
    *,
    normalize: bool = True,
    backward: str | None = None,
) -> Tensor:
    """MaxSim scores of ``Q`` against documents given as hidden states, projected inside.

    Args:
        Q (torch.Tensor): projected query tokens, ``[Nq, Lq, d]`` or ``[Lq, d]``.
        H_d (torch.Tensor): the documents' hidden states: ``[Nd, Ld, d_model]`` (every query
            against every document, output ``[Nq, Nd]``) or ``[Nq, K, Ld, d_model]`` (each query
            against its own K candidates, output ``[Nq, K]``).
        W (torch.Tensor): the projection's weight ``[d, d_model]`` (``nn.Linear``'s), H_d's dtype.
        b (torch.Tensor, optional): its bias ``[d]``, H_d's dtype.
        q_mask (torch.Tensor, optional): ``[Nq, Lq]`` (or ``[Lq]``), nonzero = valid.
        d_mask (torch.Tensor, optional): H_d's token axes (``[Nd, Ld]`` or ``[Nq, K, Ld]``).
        normalize (bool): L2-normalize the projected document tokens (the model's
            ``F.normalize``). Default: ``True``. ``Q`` is never normalized here.
        backward (str, optional): accepted as ``maxsim``'s (``"auto"``/``None``, ``"unified"``,
            ``"lowmem"``); the head's backward is deterministic whichever (the plan's
            ``hidden_bwd_kernel`` decides how it runs).

    Returns:
        torch.Tensor: float32 scores (float64 for float64 inputs); a 2-D Q drops the query axis.

    Examples::

        >>> Q = torch.randn(2, 32, 128)
        >>> H = torch.randn(10, 300, 768)
        >>> head = torch.nn.Linear(768, 128)
        >>> maxsim_from_hidden(Q, H, head.weight, head.bias).shape
        torch.Size([2, 10])
    """
    x = check_hidden(Q, H_d, W, b, q_mask, d_mask)
    normalize = check_bool("normalize", normalize)
    check_backward(backward)
    Q = x.Q
    if Q.dtype != x.H.dtype:  # as maxsim promotes Q and the projection to their common dtype
        Q = Q.to(torch.promote_types(Q.dtype, x.H.dtype))
    scores = scores_hidden(Q, x.H, x.W, x.b, x.q_mask, x.d_mask, normalize)
    return scores.squeeze(0) if x.squeeze_q else scores


class ProjectionHead(torch.nn.Module):
    """A late-interaction projection head (``nn.Linear(d_model, d)``, then the normalize) that
    scores documents straight from their hidden states: ``head(Q, H_d)`` is
    ``maxsim_from_hidden(Q, H_d, head.weight, head.bias, ...)``, and ``head.project(H)`` the
    projected (normalized) tokens, for the query side or for an index.

    Args:
        d_model (int): the hidden states' width.
        d (int): the projected width.
        bias (bool): with a bias. Default: ``True``.
        normalize (bool): L2-normalize the projected document tokens. Default: ``True``.
        device, dtype: as ``nn.Linear``'s.

    Examples::

        >>> head = ProjectionHead.from_linear(torch.nn.Linear(768, 128))
        >>> Q = head.project(torch.randn(2, 32, 768))
        >>> head(Q, torch.randn(10, 300, 768)).shape
        torch.Size([2, 10])
    """

    def __init__(self, d_model: int, d: int, bias: bool = True, normalize: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.normalize = check_bool("normalize", normalize)
        linear = torch.nn.Linear(d_model, d, bias=check_bool("bias", bias), device=device,
                                 dtype=dtype)
        self.weight = linear.weight
        self.bias = linear.bias

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, normalize: bool = True) -> ProjectionHead:
        """A head holding ``linear``'s own parameters (shared, not copied)."""
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        head = cls.__new__(cls)
        torch.nn.Module.__init__(head)
        head.normalize = check_bool("normalize", normalize)
        head.weight = linear.weight
        head.bias = linear.bias
        return head

    def project(self, H: Tensor) -> Tensor:
        """``F.normalize(F.linear(H, weight, bias))`` (without the normalize when off)."""
        out = torch.nn.functional.linear(H, self.weight, self.bias)
        return torch.nn.functional.normalize(out, dim=-1) if self.normalize else out

    def forward(self, Q: Tensor, H_d: Tensor, q_mask: Tensor | None = None,
                d_mask: Tensor | None = None) -> Tensor:
        return maxsim_from_hidden(Q, H_d, self.weight, self.bias, q_mask, d_mask,
                                  normalize=self.normalize)

    def extra_repr(self) -> str:
        d, d_model = self.weight.shape
        return f"d_model={d_model}, d={d}, bias={self.bias is not None}, normalize={self.normalize}"
