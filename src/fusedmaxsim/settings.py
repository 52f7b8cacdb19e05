"""Global settings, each with an environment variable, a setter and a scoped context manager.

| variable | values | effect |
|---|---|---|
| ``FUSEDMAXSIM_BACKEND`` | ``auto`` (default), ``triton``, ``torch`` | which implementation runs |
| ``FUSEDMAXSIM_FP32_PRECISION`` | ``torch`` (default), ``tf32``, ``tf32x3``, ``ieee`` | fp32 inputs on the GPU: TF32 tensor cores, three TF32 products (fp32-grade scores, 2-3× faster than ``ieee``) or exact fp32 on the FMA units; ``torch`` follows PyTorch's matmul precision: ``tf32`` or ``ieee`` |
| ``FUSEDMAXSIM_TORCH_BLOCK_MB`` | integer, default 256 | the PyTorch path's bound on similarities held at a time |
| ``FUSEDMAXSIM_AUTOTUNE`` | ``1`` | time a few tile configurations on the first call of each forward shape class (CUDA) |
| ``FUSEDMAXSIM_EXACT_TIES`` | ``1`` | the training forward decides every tie and near-tie of the max exactly, on Hopper GPUs too |
| ``FUSEDMAXSIM_DISABLE`` | ``1`` | patched PyLate / colpali-engine entry points fall through to the host's code |
| ``FUSEDMAXSIM_HOPPER_KERNEL`` | ``1`` (default), ``0`` | the Gluon forward on Hopper GPUs; ``0`` runs the Triton kernel everywhere |
| ``FUSEDMAXSIM_TRITON_FAST_LAUNCH`` | ``1`` (default), ``0`` | launch compiled kernels directly; ``0`` goes through Triton's own launch path (read at import) |
| ``FUSEDMAXSIM_POISON_OUTPUTS`` | ``1`` | fill every output with NaN (or -7) before the kernels write it, so tests catch unwritten elements (read at import) |
| ``TRITON_INTERPRET`` | ``1`` | Triton kernels run on CPU tensors (slow; for tests) |

This module is the one reader of these variables. ``FUSEDMAXSIM_DISABLE`` is read at every call
(:func:`integrations_disabled`); ``TRITON_INTERPRET``, ``FUSEDMAXSIM_TRITON_FAST_LAUNCH`` and
``FUSEDMAXSIM_POISON_OUTPUTS`` when fusedmaxsim is imported; the others when fusedmaxsim is imported
and again by :func:`reload`; change
a setting at run time with its setter or context manager, which take precedence. Reading the
environment once keeps it off the per-call path, where small calls cost microseconds.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


def _triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. at import: so does fusedmaxsim.
INTERPRETER = _triton_interpret()

__all__ = [
    "effective",
    "hopper_kernel",
    "integrations_disabled",
    "set_hopper_kernel",
    "reload",
    "autotune",
    "set_autotune",
    "exact_ties",
    "set_exact_ties",
    "use_exact_ties",
    "backend",
    "fp32_precision",
    "fp32_precision_setting",
    "torch_fp32_precision",
    "torch_matmul_setting",
    "torch_block_bytes",
    "set_backend",
    "set_fp32_precision",
    "set_torch_block_bytes",
    "use_backend",
    "use_fp32_precision",
]

BACKENDS = ("auto", "triton", "torch")
FP32_PRECISIONS = ("torch", "tf32", "tf32x3", "ieee")

_overrides: dict[str, object] = {}
_environment: dict[str, str] = {}
# The choices and flags as last resolved and checked, cleared on every change (a call reads
# several of them).
_resolved: dict[str, object] = {}


def reload() -> None:
    """Read the ``FUSEDMAXSIM_*`` environment variables again."""
    _environment.clear()
    _environment.update({k: v for k, v in os.environ.items() if k.startswith("FUSEDMAXSIM_")})
    _changed()


def _changed() -> None:
    """A setting changed: forget what was resolved, and resolve the values every call reads at
    once (outside any ``torch.compile`` trace, so that a compiled call finds them there and guards
    on their values; a bad value raises at the first call instead)."""
    _resolved.clear()
    try:
        snapshot()
    except ValueError:
        _resolved.clear()


def _remember(name: str, value: object) -> None:
    """Keep a resolved value until the next change; not while ``torch.compile`` traces (its
    guards on this cache would fail on the frame that wrote it), where it is resolved again."""
    import torch

    if not torch.compiler.is_compiling():
        _resolved[name] = value


def _choice(name: str, env: str, default: str, allowed: tuple[str, ...]) -> str:
    value = _resolved.get(name)
    if value is not None:
        return value
    value = _overrides.get(name)
    if value is None:
        value = _environment.get(env, default).strip().lower() or default
    if value not in allowed:
        raise ValueError(f"{env} (or {name}) must be one of {allowed}, got {value!r}")
    _remember(name, value)
    return value


def backend() -> str:
    """``auto``, ``triton`` or ``torch``; ``auto`` runs Triton on CUDA tensors, PyTorch elsewhere."""
    return _choice("backend", "FUSEDMAXSIM_BACKEND", "auto", BACKENDS)


def fp32_precision_setting() -> str:
    """``torch`` (default), ``tf32``, ``tf32x3`` or ``ieee``: the setting as given, before
    ``torch`` is resolved (see :func:`fp32_precision`)."""
    return _choice("fp32_precision", "FUSEDMAXSIM_FP32_PRECISION", "torch", FP32_PRECISIONS)


def torch_fp32_precision() -> str:
    """``tf32`` where PyTorch lets fp32 matmuls use TF32, else ``ieee``: what PyTorch's own fp32
    matmul does. ``torch.get_float32_matmul_precision()`` ``"high"`` or ``"medium"`` allows TF32,
    its default ``"highest"`` does not; where a program set the per-backend API instead
    (``torch.backends.cuda.matmul.fp32_precision``, which makes the first getter raise), that
    setting decides. Read at every call (a fraction of a microsecond), so a change of PyTorch's
    setting takes effect at once."""
    import torch

    try:
        return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    except RuntimeError:
        return "tf32" if torch.backends.cuda.matmul.fp32_precision == "tf32" else "ieee"


def fp32_precision() -> str:
    """``tf32``, ``tf32x3`` or ``ieee``: how fp32 inputs are multiplied on the GPU now. An
    explicit setting (``FUSEDMAXSIM_FP32_PRECISION``, :func:`set_fp32_precision`,
    :func:`use_fp32_precision`) wins; by default (``torch``) fp32 follows PyTorch, as its own fp32
    matmul does: TF32 only after ``torch.set_float32_matmul_precision("high")`` (or
    ``"medium"``), exact IEEE fp32 otherwise. ``tf32x3`` (each product as three TF32 products on
    the tensor cores) is never chosen for you: its scores were within 4e-7 of float64 on the
    suite's fp32 rows (IEEE's within 2e-7) at a half to a third of IEEE's time, but a near-tie of the max can fall otherwise than in
    PyTorch's fp32 (design.md, fp32)."""
    value = fp32_precision_setting()
    return torch_fp32_precision() if value == "torch" else value


def torch_block_bytes() -> int:
    """Bound on the similarity block of the PyTorch path, in bytes (default 256 MiB)."""
    value = _overrides.get("torch_block_bytes")
    if value is None:
        mb = _environment.get("FUSEDMAXSIM_TORCH_BLOCK_MB", "256")
        try:
            value = int(float(mb) * 2**20)
        except ValueError:
            raise ValueError(f"FUSEDMAXSIM_TORCH_BLOCK_MB must be a number, got {mb!r}") from None
    if value <= 0:
        raise ValueError(f"the PyTorch path's block budget must be positive, got {value} bytes")
    return int(value)


def _flag(name: str, env: str) -> bool:
    value = _resolved.get(name)
    if value is not None:
        return value
    value = _overrides.get(name)
    if value is None:
        value = _environment.get(env, "0").strip().lower() in ("1", "true", "yes")
    value = bool(value)
    _remember(name, value)
    return value


def _set_flag(name: str, value: bool | None) -> None:
    if value is None:
        _overrides.pop(name, None)
    else:
        _overrides[name] = bool(value)
    _changed()


def autotune() -> bool:
    """Whether the forward times candidate tiles on its first call per shape class (off by default:
    the analytical choice compiles one kernel; a sweep compiles several and costs seconds)."""
    return _flag("autotune", "FUSEDMAXSIM_AUTOTUNE")


def set_autotune(value: bool | None) -> None:
    """Turn the autotuning on or off; ``None`` returns to ``FUSEDMAXSIM_AUTOTUNE``."""
    _set_flag("autotune", value)


def exact_ties() -> bool:
    """Whether the training forward must decide the max's ties and near-ties exactly (the lowest
    token among equal similarities, the larger of two that differ in their last bits). Off by
    default: on Hopper GPUs the Gluon training forward then decides among similarities within 16
    units in the last place of each other by their tile (README, Semantics), 12-15% faster."""
    return _flag("exact_ties", "FUSEDMAXSIM_EXACT_TIES")


def set_exact_ties(value: bool | None) -> None:
    """Exact ties on or off; ``None`` returns to ``FUSEDMAXSIM_EXACT_TIES``."""
    _set_flag("exact_ties", value)


def _set(name: str, value: object, check) -> None:
    _resolved.clear()
    if value is None:
        _overrides.pop(name, None)
        _changed()
        return
    _overrides[name] = value
    try:
        check()
    except ValueError:
        _overrides.pop(name, None)
        raise
    finally:
        _changed()


def set_backend(value: str | None) -> None:
    """Force ``auto``, ``triton`` or ``torch``; ``None`` returns to ``FUSEDMAXSIM_BACKEND``."""
    _set("backend", None if value is None else str(value).lower(), backend)


def set_fp32_precision(value: str | None) -> None:
    """``tf32``, ``tf32x3`` or ``ieee`` for fp32 inputs, or ``torch`` to follow PyTorch's matmul
    precision; ``None`` returns to ``FUSEDMAXSIM_FP32_PRECISION``."""
    _set("fp32_precision", None if value is None else str(value).lower(), fp32_precision_setting)


def set_torch_block_bytes(value: int | None) -> None:
    """Bound (bytes) on the PyTorch path's similarity block; ``None`` returns to the default."""
    _set("torch_block_bytes", value, torch_block_bytes)


@contextlib.contextmanager
def _scoped(name: str, setter, value) -> Iterator[None]:
    saved = _overrides.get(name)
    setter(value)
    try:
        yield
    finally:
        _overrides.pop(name, None)
        if saved is not None:
            _overrides[name] = saved
        _changed()


def use_backend(value: str) -> contextlib.AbstractContextManager[None]:
    """``with use_backend("torch"): ...``"""
    return _scoped("backend", set_backend, value)


def use_fp32_precision(value: str) -> contextlib.AbstractContextManager[None]:
    """``with use_fp32_precision("ieee"): ...`` computes fp32 inputs in exact fp32."""
    return _scoped("fp32_precision", set_fp32_precision, value)


def use_exact_ties(value: bool = True) -> contextlib.AbstractContextManager[None]:
    """``with use_exact_ties(): ...`` decides every tie and near-tie of the max exactly."""
    return _scoped("exact_ties", set_exact_ties, value)


def hopper_kernel() -> bool:
    """Whether the Gluon forward may run on Hopper GPUs (``FUSEDMAXSIM_HOPPER_KERNEL``, on by
    default). It turns itself off for the process if the Gluon kernel fails to build or launch."""
    value = _resolved.get("hopper_kernel")
    if value is None:
        value = _overrides.get("hopper_kernel")
        if value is None:
            value = _environment.get("FUSEDMAXSIM_HOPPER_KERNEL", "1").strip() != "0"
        value = bool(value)
        _remember("hopper_kernel", value)
    return value


def set_hopper_kernel(value: bool | None) -> None:
    """The Gluon forward on or off; ``None`` returns to ``FUSEDMAXSIM_HOPPER_KERNEL``."""
    _set_flag("hopper_kernel", value)


def integrations_disabled() -> bool:
    """``FUSEDMAXSIM_DISABLE=1``: the patched PyLate / colpali-engine entry points fall through to
    the host library's own code (read at every call, so it can be flipped at run time)."""
    return os.environ.get("FUSEDMAXSIM_DISABLE", "0").strip().lower() in ("1", "true", "yes", "on")


# Read once, at import: the launcher and the output allocator consult them on every launch.
TRITON_FAST_LAUNCH = os.environ.get("FUSEDMAXSIM_TRITON_FAST_LAUNCH", "1").strip() != "0"
POISON_OUTPUTS = os.environ.get("FUSEDMAXSIM_POISON_OUTPUTS", "0").strip() == "1"


def snapshot() -> tuple[str, bool, bool, bool, int]:
    """``(fp32_precision, exact_ties, autotune, hopper_kernel, torch_block_bytes)`` as in force
    now, resolved once and kept until a setting changes (every call reads them). The precision is
    the setting as given: ``torch`` is resolved per call (``_problem.options_for``), since PyTorch's
    own setting can change without fusedmaxsim knowing."""
    found = _resolved.get("snapshot")
    if found is None:
        found = (fp32_precision_setting(), exact_ties(), autotune(), hopper_kernel(), torch_block_bytes())
        _remember("snapshot", found)
    return found


def torch_matmul_setting() -> str:
    """PyTorch's fp32 matmul setting in words, as :func:`torch_fp32_precision` reads it (for
    ``fusedmaxsim info`` and the benchmark records; not read per call)."""
    import torch

    try:
        return f"get_float32_matmul_precision() is {torch.get_float32_matmul_precision()!r}"
    except RuntimeError:
        return f"backends.cuda.matmul.fp32_precision is {torch.backends.cuda.matmul.fp32_precision!r}"


def _describe_fp32_precision() -> str:
    value = fp32_precision_setting()
    if value != "torch":
        return value
    return f"{torch_fp32_precision()} (follows PyTorch: {torch_matmul_setting()})"


def effective() -> list[tuple[str, str]]:
    """Every setting's variable and its value in force now (``fusedmaxsim info`` prints them)."""
    return [
        ("FUSEDMAXSIM_BACKEND", backend()),
        ("FUSEDMAXSIM_FP32_PRECISION", _describe_fp32_precision()),
        ("FUSEDMAXSIM_TORCH_BLOCK_MB", f"{torch_block_bytes() / 2**20:g}"),
        ("FUSEDMAXSIM_AUTOTUNE", str(int(autotune()))),
        ("FUSEDMAXSIM_EXACT_TIES", str(int(exact_ties()))),
        ("FUSEDMAXSIM_HOPPER_KERNEL", str(int(hopper_kernel()))),
        ("FUSEDMAXSIM_DISABLE", str(int(integrations_disabled()))),
        ("FUSEDMAXSIM_TRITON_FAST_LAUNCH", str(int(TRITON_FAST_LAUNCH))),
        ("FUSEDMAXSIM_POISON_OUTPUTS", str(int(POISON_OUTPUTS))),
        ("TRITON_INTERPRET", str(int(INTERPRETER))),
    ]


reload()
