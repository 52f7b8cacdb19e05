"""What every launcher shares: the cached launch path, constants, allocation and argument helpers.

Nothing here decides anything: the launchers in ``forward`` and ``backward`` execute the plans of
``fusedmaxsim._plan`` with these helpers.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
from torch import Tensor

from .. import settings

__all__ = [
    "Constants", "as_bytes", "cdiv", "constants", "doc_strides", "empty", "fwd_meta",
    "gather_meta", "grads_without_launch", "launcher", "no_argmax", "owned_tile_meta",
    "smooth_scales", "take",
]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def smooth_scales(tau: float) -> tuple[float, float]:
    """``(log2(e) / tau, tau · ln 2)``: similarities into log2 units, and log2-sum-exp2 back."""
    return math.log2(math.e) / tau, tau * math.log(2.0)


def empty(shape, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``torch.empty``, poisoned under ``FUSEDMAXSIM_POISON_OUTPUTS=1`` so tests catch unwritten
    outputs."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if settings.POISON_OUTPUTS:
        out.fill_(float("nan") if dtype.is_floating_point else -7)
    return out


def zeros(shape, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``torch.zeros``, its bytes zeroed through an int32 view where their count allows: 16-bit
    zeros filled at 3.3-3.4 TB/s on the H200, the same bytes as int32 at 4.5-4.7 (probe
    ``zero_fill``, NOTES §71)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if out.numel() * out.element_size() % 4:
        return out.zero_()
    out.view(-1).view(torch.int32).zero_()
    return out


_NO_ARGMAX: dict = {}


def no_argmax(device: torch.device, dtype: torch.dtype) -> Tensor:
    """A shared empty tensor: the argmax result when none is saved (no allocation per call)."""
    found = _NO_ARGMAX.get((device, dtype))
    if found is None:
        found = _NO_ARGMAX[device, dtype] = torch.empty((0,), dtype=dtype, device=device)
    return found


def take(t: Tensor | None, rows: slice | None) -> Tensor | None:
    return t if rows is None or t is None else t[rows]


class _CachedLauncher:
    """Launch a ``@triton.jit`` kernel through Triton once per specialization, then directly.

    Triton's own launch path re-derives the specialization of every argument on every call, about
    25 µs for our 20-argument kernels: more than the GPU time of a small MaxSim. The first call of
    each specialization goes through Triton (which compiles and returns the compiled kernel); later
    calls with the same key call the compiled kernel's launcher exactly as Triton does. The key
    holds what Triton specializes on: dtypes, 16-byte alignment of pointers, integers equal to 1,
    divisible by 16 or beyond 32 bits, the constexprs and the launch options. It is computed by a
    function generated for the kernel's argument types (a loop over ~40 arguments cost ~15 µs a
    launch on the host). ``FUSEDMAXSIM_TRITON_FAST_LAUNCH=0`` turns the shortcut off.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        params = getattr(kernel, "params", None)
        self.enabled = (
            params is not None
            and not settings.INTERPRETER
            and settings.TRITON_FAST_LAUNCH
        )
        if self.enabled:
            from triton import knobs

            self.runtime = knobs.runtime
            self.unspecialized = frozenset(i for i, p in enumerate(params) if p.do_not_specialize)
            self.constexpr_names = tuple(p.name for p in params if p.is_constexpr)
        self.compiled: dict = {}
        self.key_functions: dict = {}

    def _key_function(self, types: tuple):
        """``args -> key`` for arguments of these types, as straight-line code."""
        parts = []
        for i, kind in enumerate(types):
            a = f"a[{i}]"
            if issubclass(kind, Tensor):
                parts.append(f"{a}.dtype, {a}.data_ptr() % 16 == 0")
            elif dataclasses.is_dataclass(kind) and "block_shape" in {
                field.name for field in dataclasses.fields(kind)
            }:
                # A TMA descriptor (the Gluon forward's): Triton specializes on its dtype, block
                # shape and shared layout; the launcher derives the layout from the other two.
                parts.append(f"{a}.base.dtype, tuple({a}.block_shape)")
            elif i in self.unspecialized:
                parts.append(f"-2147483648 <= {a} < 2147483648")
            else:
                parts.append(f"{a} == 1, {a} % 16 == 0, -2147483648 <= {a} < 2147483648")
        namespace: dict = {}
        exec(f"def key(a):\n    return ({', '.join(parts)},)\n", namespace)  # noqa: S102
        return namespace["key"]

    def _key(self, args) -> tuple:
        types = tuple(map(type, args))
        key_function = self.key_functions.get(types)
        if key_function is None:
            key_function = self.key_functions[types] = self._key_function(types)
        return types, key_function(args)

    def __call__(self, grid, args: tuple, constants: "Constants") -> None:
        if not self.enabled:
            self.kernel[grid](*args, **constants.kwargs)
            return
        device = args[0].device.index
        key = (device, constants, self._key(args))
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, **constants.kwargs)
            if compiled is not None and hasattr(compiled, "run"):
                self.compiled[key] = compiled
            return
        bound = (*args, *constants.values_for(self.constexpr_names))
        stream = torch._C._cuda_getCurrentRawStream(device)
        grid = (*grid, 1, 1)
        enter_hook = self.runtime.launch_enter_hook
        # Triton's launch_metadata is None without an enter hook; only a hook needs it built.
        metadata = None if enter_hook is None else compiled.launch_metadata(grid, stream, *bound)
        compiled.run(
            grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
            metadata, enter_hook, self.runtime.launch_exit_hook, *bound,
        )


class Constants:
    """A kernel's constexprs and launch options, hashed once (built through :func:`constants`):
    a launch's cache key holds this object, whose hash is computed here, not its items, whose
    tuple would be hashed again on every launch (2.5 µs a launch for the Gluon forward's
    layouts on a CPU like CI's)."""

    def __init__(self, items: tuple):
        self.key = items
        self.kwargs = dict(items)
        self._hash = hash(items)
        self._values: dict = {}

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, Constants) and self.key == other.key)

    def values_for(self, names: tuple) -> tuple:
        found = self._values.get(names)
        if found is None:
            found = self._values[names] = tuple(self.kwargs[name] for name in names)
        return found


@functools.lru_cache(maxsize=4096)
def _constants(items: tuple) -> Constants:
    return Constants(items)


def constants(**kwargs) -> Constants:
    return _constants(tuple(kwargs.items()))


_launchers: dict = {}


def launcher(kernel) -> _CachedLauncher:
    """The cached launcher of ``kernel`` (one per kernel)."""
    found = _launchers.get(kernel)
    if found is None:
        found = _launchers[kernel] = _CachedLauncher(kernel)
    return found


def dot_precision(dtype: torch.dtype, fp32_precision: str) -> str:
    return fp32_precision if dtype == torch.float32 else "tf32"


def upcast(dtype: torch.dtype) -> bool:
    return settings.INTERPRETER and dtype == torch.bfloat16


def doc_strides(t: Tensor | None, per_query_docs: bool) -> tuple[int, ...]:
    """Strides of a document-side tensor as (group, column, token[, dim]); group stride 0 = shared."""
    if t is None:
        return (0, 0, 0)
    return tuple(t.stride()) if per_query_docs else (0, *t.stride())


def as_bytes(mask: Tensor | None) -> Tensor | None:
    """A contiguous byte view of a bool mask (copied only when strided: 1 byte per token)."""
    return None if mask is None else mask.contiguous().view(torch.uint8)


def fwd_meta(
    cfg, dtype: torch.dtype, dim: int, *, has_q_mask: bool, has_d_mask: bool, normalize: bool,
    save_argmax: bool, fp32_precision: str,
) -> dict:
    """The constexprs and launch options every forward built on ``_doc_max`` shares."""
    return dict(
        HAS_Q_MASK=has_q_mask,
        HAS_D_MASK=has_d_mask,
        NORMALIZE=normalize,
        SAVE_ARGMAX=save_argmax,
        LQ_TILE=cfg.lq_tile,
        QUERIES_PER_BLOCK=cfg.queries_per_block,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        EVEN_K=dim == cfg.block_k,
        DOT_PRECISION=dot_precision(dtype, fp32_precision),
        UPCAST=upcast(dtype),
        QUERY_IN_REGISTERS=cfg.query_in_registers,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **({} if cfg.max_registers is None else {"maxnreg": cfg.max_registers}),
    )


def gather_meta(cfg, *, normalize: bool, grad_q: bool, atomic_q: bool, scatter_d: bool) -> dict:
    """The constexprs and launch options of the gather backwards (dense and packed)."""
    return dict(
        NORMALIZE=normalize,
        COMPUTE_GRAD_Q=grad_q,
        ATOMIC_GRAD_Q=atomic_q,
        SCATTER_GRAD_D=scatter_d,
        BLOCK_S=cfg.block_s,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def owned_tile_meta(
    cfg, dtype: torch.dtype, fp32_precision: str, stages: int | None = None
) -> dict:
    """The constexprs and launch options of the kernels that own ``grad_D`` token tiles and build
    them with products (the document-owned backwards, dense and packed, and the smooth max's);
    ``stages`` replaces the configuration's pipeline stages (the row scans' ``_DD_SCAN_STAGES``)."""
    return dict(
        BLOCK_T=cfg.block_t,
        BLOCK_K=cfg.block_k,
        DOT_PRECISION=dot_precision(dtype, fp32_precision),
        UPCAST=upcast(dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages if stages is None else stages,
    )


def grads_without_launch(
    Q: Tensor, D: Tensor, need_grad_q: bool, need_grad_d: bool, fp32_out: bool
) -> tuple[Tensor, Tensor] | None:
    """The gradients when no kernel has to run, else None: empty tensors for those not asked for
    when neither is, zeros when the problem is empty (a zero-sized axis)."""
    if not (need_grad_q or need_grad_d):
        return Q.new_empty((0,)), Q.new_empty((0,))
    if Q.numel() and D.numel():
        return None
    empty = Q.new_empty((0,))
    gq = torch.zeros(Q.shape, dtype=torch.float32 if fp32_out else Q.dtype, device=Q.device)
    gd = torch.zeros(D.shape, dtype=torch.float32 if fp32_out else D.dtype, device=D.device)
    return gq if need_grad_q else empty, gd if need_grad_d else empty
