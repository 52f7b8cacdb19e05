"""Comparison helpers shared by the test suite, ``fusedmaxsim check`` and the benchmarks.

Errors are measured as ``max|out − ref| / max|ref|`` against a float64 reference: one number per
tensor that does not blow up on entries near zero, as the peers' test suites also measure.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["TOLERANCES", "relative_error", "relative_error_fro", "assert_close_to_reference"]

# (scores, gradients) bounds. GPU bf16/fp16 bounds are those the main peer's tests enforce;
# the fp32 bound allows TF32 (PyTorch's precision "high"). Gradients are written in the input
# dtype, hence their looser bound in half precision.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-3, 2e-3),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def relative_error(out: Tensor, ref: Tensor) -> float:
    """``max|out − ref| / max|ref|`` in float64; NaN anywhere (but where ref is NaN too) gives inf."""
    out64, ref64 = out.detach().double(), ref.detach().double()
    if out64.shape != ref64.shape:
        raise AssertionError(f"shape {tuple(out64.shape)} != reference shape {tuple(ref64.shape)}")
    if out64.numel() == 0:
        return 0.0
    both_nan = torch.isnan(out64) & torch.isnan(ref64)
    if (torch.isnan(out64) ^ torch.isnan(ref64)).any():
        return float("inf")
    diff = (out64 - ref64).masked_fill(both_nan, 0).abs().max().item()
    scale = ref64.masked_fill(both_nan, 0).abs().max().item()
    return diff / max(scale, 1e-30) if diff > 0 else 0.0


def relative_error_fro(out: Tensor, ref: Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` (Frobenius) in float64.

    On large problems a few near-ties in the max are decided differently in fp32 than in float64;
    each moves one gradient row entirely, which the max-norm error reports as a large error while
    the gradient as a whole is unchanged. This norm measures the whole.
    """
    out64, ref64 = out.detach().double(), ref.detach().double()
    return (torch.linalg.vector_norm(out64 - ref64) / torch.linalg.vector_norm(ref64).clamp_min(1e-30)).item()


def assert_close_to_reference(out: Tensor, ref: Tensor, tol: float, what: str = "output") -> None:
    """Raise with the worst coordinate when ``relative_error(out, ref) > tol``."""
    err = relative_error(out, ref)
    if err <= tol:
        return
    diff = (out.detach().double() - ref.detach().double()).abs()
    diff = torch.nan_to_num(diff, nan=float("inf"))
    worst = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.numel() else ()
    raise AssertionError(
        f"{what}: relative error {err:.3e} > {tol:.1e}; worst at {worst}: "
        f"got {out.detach().double()[worst].item() if worst or out.dim() == 0 else 'n/a'}, "
        f"expected {ref.detach().double()[worst].item() if worst or ref.dim() == 0 else 'n/a'}"
    )
