"""Host launchers of the Triton kernels: the only place that computes strides and grids.

Inputs arrive validated (see ``_validate``): ``Q [Nq, Lq, d]``; ``D [Nd, Ld, d]`` for the cross
product or ``[Nq, K, Ld, d]`` for per-query candidates, in the same dtype as ``Q``; masks are bool
with the token axes of their tensor; inverse norms are fp32 with the token axes. Any strides are
accepted (no copies). Empty problems return without a launch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings

import torch
from torch import Tensor

from . import _configs, _kernels_hopper, settings
from ._kernels import (
    _drain_chunk_kernel,
    _inverse_norm_kernel,
    _maxsim_bwd_dd_kernel,
    _maxsim_bwd_gather_kernel,
    _maxsim_fwd_kernel,
)
from ._kernels_index import _tile_counts_kernel, _tile_rows_kernel

__all__ = ["maxsim_fwd", "maxsim_bwd", "grads_without_launch", "inverse_norms", "launcher"]

_MAX_GRID_Y = 65535


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def smooth_scales(tau: float) -> tuple[float, float]:
    """``(log2(e) / tau, tau · ln 2)``: similarities into log2 units, and log2-sum-exp2 back."""
    return math.log2(math.e) / tau, tau * math.log(2.0)


# Read once: the test suite sets it before importing the package.
_POISON = os.environ.get("FUSEDMAXSIM_POISON_OUTPUTS") == "1"


def _empty(shape, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``torch.empty``, poisoned when ``FUSEDMAXSIM_POISON_OUTPUTS=1`` so tests catch unwritten outputs."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if _POISON:
        out.fill_(float("nan") if dtype.is_floating_point else -7)
    return out


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
            and not _configs.INTERPRETER
            and os.environ.get("FUSEDMAXSIM_TRITON_FAST_LAUNCH", "1") != "0"
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


_NO_ARGMAX: dict = {}


def _no_argmax(device: torch.device, dtype: torch.dtype) -> Tensor:
    """A shared empty tensor: the argmax result when none is saved (no allocation per call)."""
    found = _NO_ARGMAX.get((device, dtype))
    if found is None:
        found = _NO_ARGMAX[device, dtype] = torch.empty((0,), dtype=dtype, device=device)
    return found


def _dot_precision(dtype: torch.dtype, fp32_precision: str) -> str:
    return fp32_precision if dtype == torch.float32 else "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    return _configs.INTERPRETER and dtype == torch.bfloat16


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return _num_sms(_device_index(device))


@functools.lru_cache(maxsize=None)
def _hopper_index(device_index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index)[0] == 9


def _measured_tiles(device: torch.device) -> bool:
    """Whether the forward's measured tile variants apply: NVIDIA Hopper (sm_90), where they were
    measured; elsewhere the default tiles stay."""
    return device.type == "cuda" and _hopper_index(_device_index(device))


def _doc_strides(t: Tensor | None, per_query_docs: bool) -> tuple[int, ...]:
    """Strides of a document-side tensor as (group, column, token[, dim]); group stride 0 = shared."""
    if t is None:
        return (0, 0, 0)
    return tuple(t.stride()) if per_query_docs else (0, *t.stride())


def _as_bytes(mask: Tensor | None) -> Tensor | None:
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
        DOT_PRECISION=_dot_precision(dtype, fp32_precision),
        UPCAST=_upcast(dtype),
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
        DOT_PRECISION=_dot_precision(dtype, fp32_precision),
        UPCAST=_upcast(dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages if stages is None else stages,
    )


@functools.lru_cache(maxsize=1024)
def _fwd_constants(
    cfg, dtype, dim, per_query_docs, norm_from_tiles, smooth, has_q_mask, has_d_mask, normalize,
    save_argmax, fp32_precision,
) -> Constants:
    return constants(
        PER_QUERY_DOCS=per_query_docs,
        NORM_FROM_TILES=norm_from_tiles,
        SMOOTH=smooth,
        **fwd_meta(
            cfg, dtype, dim, has_q_mask=has_q_mask, has_d_mask=has_d_mask, normalize=normalize,
            save_argmax=save_argmax, fp32_precision=fp32_precision,
        ),
    )


# The chunk splits' partial scores stay within this many bytes (fewer splits beyond it).
_SPLIT_PARTIALS_MAX_BYTES = 64 << 20


def chunk_splits(Lq: int, lq_tile: int, Nq: int, Ncols: int, per_query_docs: bool) -> int:
    """How many programs share the query chunks of one (document, query block): on the cross
    product, every chunk its own program where the partial scores fit in
    ``_SPLIT_PARTIALS_MAX_BYTES`` (benchmarks/NOTES.md section 29: one program walking the nine
    chunks of a 1030-token query read each document from DRAM nine times; split, 20% faster);
    one for a single chunk, and for per-query candidates, measured 7% slower split."""
    chunks = _cdiv(Lq, lq_tile)
    if chunks <= 1 or per_query_docs:
        return 1
    fit = _SPLIT_PARTIALS_MAX_BYTES // (4 * Nq * Ncols)
    return max(1, min(chunks, fit, (2**31 - 1) // Ncols))


def _take(t: Tensor | None, rows: slice | None) -> Tensor | None:
    return t if rows is None or t is None else t[rows]


def _launch_query_slices(launch_slice, scores: Tensor, qpb: int, splits: int) -> None:
    """``launch_slice(rows, out, stride_out_split)`` over the query batch, shared by the Triton and
    Gluon forwards. Grid axis 1 holds at most 65535 blocks: larger batches go in slices of
    queries (``rows``; None in the common case, which launches the tensors as they are, with no
    slicing on the host). With several chunk splits ``out`` is a buffer of partial scores, one
    slice a split, added into ``scores`` after the launches."""
    Nq, Ncols = scores.shape
    out = scores if splits == 1 else _empty((splits, Nq, Ncols), torch.float32, scores.device)
    stride_out_split = out.stride(0) if splits > 1 else 0
    step = _MAX_GRID_Y * qpb
    if Nq <= step:
        launch_slice(None, out, stride_out_split)
    else:
        for q0 in range(0, Nq, step):
            rows = slice(q0, min(Nq, q0 + step))
            launch_slice(rows, out[rows] if splits == 1 else out[:, rows], stride_out_split)
    if splits > 1:
        torch.sum(out, 0, out=scores)


def _launch_fwd(
    cfg, Q, D, qm, dm, q_inv, d_inv, scores, argmax, save_argmax, fp32_precision, norm_from_tiles,
    tau,
) -> None:
    """One forward launch (several for huge query batches) with tiles ``cfg``; with several
    chunk splits, their partial scores are added into ``scores`` after it."""
    d_shape = D.shape
    per_query_docs = len(d_shape) == 4
    Nq, Lq, dim = Q.shape
    Ncols, Ld = d_shape[-3], d_shape[-2]
    qpb = cfg.queries_per_block
    smooth_scale, smooth_unscale = smooth_scales(tau) if tau else (1.0, 1.0)
    consts = _fwd_constants(
        cfg, Q.dtype, dim, per_query_docs, norm_from_tiles, bool(tau), qm is not None,
        dm is not None, norm_from_tiles or q_inv is not None, save_argmax, fp32_precision,
    )
    kernel = launcher(_maxsim_fwd_kernel)
    splits = chunk_splits(Lq, cfg.lq_tile, Nq, Ncols, per_query_docs)

    def launch_slice(rows, out, stride_out_split):
        doc_rows = rows if per_query_docs else None  # per-query candidates: their documents too
        q, d = _take(Q, rows), _take(D, doc_rows)
        q_m, d_m = _take(qm, rows), _take(dm, doc_rows)
        q_i, d_i = _take(q_inv, rows), _take(d_inv, doc_rows)
        kernel(
            (Ncols * splits, _cdiv(q.shape[0], qpb)),
            (
                q, d, q if q_m is None else q_m, d if d_m is None else d_m,
                q if q_i is None else q_i, d if d_i is None else d_i, out,
                _take(argmax, rows) if save_argmax else argmax,
                q.shape[0], Ncols, Lq, Ld, splits, stride_out_split, dim, *q.stride(),
                *_doc_strides(d, per_query_docs), smooth_scale, smooth_unscale,
            ),
            consts,
        )

    _launch_query_slices(launch_slice, scores, qpb, splits)


# The Gluon forward (``_kernels_hopper``, NOTES.md sections 30-34): its (document tile, stages,
# warps, register cap or None) for the plain and the normalizing variant, the fastest of the 32-
# and 64-token tiles, 3 to 6 stages and 4 or 8 warps measured; and the least work (multiply-adds)
# for which each is taken. It saves 11-17% of the GPU time of the plain forward (CUDA-graph
# replays, records 2026-12-01_24087c6 and 4e3362d: rerank_colbert's 2^30 multiply-adds 0.036 →
# 0.032 ms, rerank_colpali's 2^34 0.086 → 0.077) and 7-23% of the normalizing one. A call
# through it costs the host what a call through the Triton kernel does (67.2 against 68.7 µs
# at rerank_colbert's shape, record 4e3362d).
_HOPPER_TILES = (64, 4, 4, None)
# Several short queries packed into a block: 3 stages (batch_colbert 0.355 against 0.373 ms at
# 4, in two runs).
_HOPPER_PACKED_TILES = (64, 3, 4, None)
_HOPPER_NORM_TILES = (64, 4, 4, None)
# Normalized short queries (packed, or one padded), on grids of more programs than SMs: 32-token
# tiles at 168 registers a thread, three programs an SM (rerank_colbert normalized 0.0398 →
# 0.0348 ms, batch_colbert normalized 0.714 → 0.655; 100 programs: 0.0122 → 0.0127, so not
# there; record 2026-12-01_49eb00a).
_HOPPER_SHORT_NORM_TILES = (32, 4, 4, 168)
# Grids of 128-row blocks with at most one program an SM (long documents, few candidates): two
# warp groups a program, splitting the rows (longdoc 0.0745 → 0.0572 ms, 4 × 32 query tokens
# against 64 documents of 4096 0.0466 → 0.0341; record 2026-12-01_49eb00a). With more programs
# they lose (256: 0.103 → 0.119).
_HOPPER_FEW_PROGRAMS_TILES = (64, 6, 8, None)
# One short query a block, padded to 64 rows (rerank_colbert: 0.0330 ms against 0.0379-0.0398
# at 64-token tiles, record 2026-12-01_126203e).
_HOPPER_SHORT_TILES = (32, 6, 4, None)


# d = 64 ran slower than the Triton kernel (0.133 against 0.117 ms at 64 x 32 against 512 x 300);
# the kernel itself takes 64 (tested), the dispatch does not.
_HOPPER_DIMS = (128,)
HOPPER_MIN_MACS = 1 << 30
HOPPER_KERNEL = os.environ.get("FUSEDMAXSIM_HOPPER_KERNEL", "1") != "0"


def _hopper_kernel_failed(exc: Exception) -> None:
    """The Gluon forward could not be built or launched (Gluon is experimental, and its API
    moves between Triton releases): say so once, and run the Triton kernel from now on."""
    global HOPPER_KERNEL
    HOPPER_KERNEL = False
    warnings.warn(
        f"fusedmaxsim: the Hopper (Gluon) forward failed ({type(exc).__name__}: {exc}); the "
        "Triton kernel serves every forward of this process instead",
        RuntimeWarning,
        stacklevel=3,
    )


def hopper_forward_applies(cfg, Q: Tensor, D: Tensor) -> bool:
    """Whether ``_kernels_hopper`` can run this inference forward (the argmax, masks, precomputed
    norms and the smooth max are the caller's to exclude): an NVIDIA Hopper GPU with Gluon, the
    cross product of 16-bit inputs with ``dim`` equal to the tile's (128), 64 or 128 rows a
    block (fewer padded to 64, :func:`hopper_block`), documents contiguous and 16-byte aligned
    for TMA, and rows that fit its int32 coordinates."""
    if not (_kernels_hopper.AVAILABLE and _measured_tiles(Q.device)):
        return False
    dim = Q.shape[-1]
    return (
        D.dim() == 3 and Q.dtype in (torch.bfloat16, torch.float16) and D.dtype == Q.dtype
        and dim == cfg.block_k and dim in _HOPPER_DIMS and D.is_contiguous()
        and D.data_ptr() % 16 == 0
        and D.shape[0] * D.shape[1] < 2**31 and _block_rows(hopper_block(cfg)) in (64, 128)
    )


def hopper_argmax_applies(tiles: tuple, Ld: int) -> bool:
    """Whether the Gluon forward, on the call's ``tiles`` (:func:`hopper_call_tiles`), can save
    the argmax: ties need not be exact (``settings.exact_ties``: its coded max decides near-ties
    by tile, NOTES.md section 46) and a pass's document tiles fit the codes the running max
    carries in its low bits (``_kernels_hopper.TILE_CODES``)."""
    return not settings.exact_ties() and _cdiv(Ld, tiles[0]) <= _kernels_hopper.TILE_CODES.value


def _block_rows(cfg) -> int:
    return cfg.lq_tile * cfg.queries_per_block


@functools.lru_cache(maxsize=256)
def hopper_block(cfg):
    """``cfg`` with at least 64 query rows a block, the least a warp-group product takes: a
    block of fewer (one short query) is padded with empty query slots."""
    if _block_rows(cfg) >= 64:
        return cfg
    return dataclasses.replace(cfg, queries_per_block=64 // cfg.lq_tile)


def hopper_tiles(
    cfg, normalize: bool, programs: int, sm_count: int
) -> tuple[int, int, int, int | None]:
    """The Gluon forward's (document tile, stages, warps, register cap) for a block of ``cfg``
    (before :func:`hopper_block` pads it) on a grid of ``programs`` (documents × chunk splits ×
    query blocks): few programs' (a 128-row block), the normalized short queries', the
    normalizing variant's, a short query's, packed short queries', or a long query's."""
    few_programs = programs <= sm_count
    if few_programs and _block_rows(cfg) == 128:
        return _HOPPER_FEW_PROGRAMS_TILES
    short_queries = cfg.queries_per_block > 1 or _block_rows(cfg) < 64
    if normalize and short_queries and not few_programs:
        return _HOPPER_SHORT_NORM_TILES
    if normalize:
        return _HOPPER_NORM_TILES
    if _block_rows(cfg) < 64:
        return _HOPPER_SHORT_TILES
    return _HOPPER_PACKED_TILES if cfg.queries_per_block > 1 else _HOPPER_TILES


def hopper_call_tiles(
    cfg, normalize: bool, Nq: int, Lq: int, Ncols: int, Ld: int, sm_count: int
) -> tuple[tuple[int, int, int, int | None], int, int, int]:
    """This call's Gluon tiles (:func:`hopper_tiles` on its grid), with what the grid is built
    from: the queries a block once padded (:func:`hopper_block`), the chunk splits and the
    documents a program (:func:`hopper_docs_per_program`)."""
    qpb = hopper_block(cfg).queries_per_block
    splits = chunk_splits(Lq, cfg.lq_tile, Nq, Ncols, False)
    blocks = _cdiv(Nq, qpb)
    tiles = hopper_tiles(cfg, normalize, Ncols * splits * blocks, sm_count)
    docs = hopper_docs_per_program(tiles, Lq, cfg.lq_tile, Ld, Ncols, blocks, sm_count,
                                   normalize)
    return tiles, qpb, splits, docs


@functools.lru_cache(maxsize=None)
def hopper_layouts(
    torch_dtype: torch.dtype, block_m: int, block_n: int, block_k: int, warps: int = 4
):
    """(query tile in shared memory, document tile in shared memory, the products' registers,
    the query chunk's load, a document tile's load from shared memory): the Gluon forward's
    layouts, built once per shape. With 8 warps, two warp groups split the rows of a product."""
    from triton.experimental.gluon import language as gl

    dtype = gl.bfloat16 if torch_dtype == torch.bfloat16 else gl.float16
    k_threads = block_k // 8  # 16-byte loads along the head dimension
    return (
        gl.NVMMASharedLayout.get_default_for([block_m, block_k], dtype),
        gl.NVMMASharedLayout.get_default_for([block_n, block_k], dtype),
        gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, block_n, 16]
        ),
        gl.BlockedLayout([1, 8], [32 // k_threads, k_threads], [warps, 1], [1, 0]),
        # A token's squares summed mostly in one thread: four threads a token.
        gl.BlockedLayout([1, block_k // 4], [8, 4], [warps, 1], [1, 0]),
    )


# Several documents a program (NOTES.md sections 38 and 41, records 2026-12-01_d40cf09 and
# 15f6248, GPU ms at one document a program → the count this rule picks): batch_colbert
# 0.354-0.368 → 0.308 (16), its normalized one 0.658-0.664 → 0.572 (8), rerank_colpali_norm
# 0.108-0.109 → 0.096-0.097 (4), rerank_colbert 0.0325 → 0.0308 (4). A program streams at most
# _HOPPER_PASS_TILES tiles and the grid keeps at least one program an SM (at 3000 documents of
# 1024, 16 documents a program, 188 programs, were 20% slower than one; the rules below keep
# one there). Within that, the count depends on what bounds the forward:
# - The plain forward of short documents: the most documents a program (64 × 32 query tokens
#   against 1000 documents of 300: 0.364-0.371 ms at 8, 0.343-0.349 at 16, 80 tiles a program;
#   a 32-token query against 2000 documents of 300: 0.0557 at 4, 0.0495 at 8, also 80 tiles).
# - The plain forward of documents of _HOPPER_LONG_DOC_TILES tiles or more streams at the
#   memory's rate with one document a program (grouped four at a time, rerank_colpali, 3000
#   documents and train_colpali's shape were 0.5-4% slower), except on a grid of more than one
#   wave of programs and at most two, which it brings into one (one 128-token query against 300,
#   350 or 400 documents of 1024: 0.0384 → 0.0353 ms, 0.0392 → 0.0376, 0.0410 → 0.0401 at two;
#   450 and 500: 0.2% faster; records f6e9916 and 15f6248). On longer grids a thin last wave
#   cost more than grouping saved as often as not (530 documents: 0.0508 → 0.0486 at four; 560:
#   0.0550 → 0.0570).
# - The normalizing forward's programs are bound by their own work: waves of programs take
#   turns, each as long as its documents plus a start (_HOPPER_PROGRAM_START documents' worth),
#   and the count with the fewest such document-times wins (1 query of 32 tokens against 300,
#   1000, 3000 documents of 300: 1, 2, 2 documents a program, 0.0187, 0.0331, 0.0802 ms, where
#   doubling while the grid kept a program an SM took 2, 4, 4: 0.0213, 0.0353, 0.0910).
_HOPPER_MAX_DOCS = 16
_HOPPER_PASS_TILES = 128
_HOPPER_LONG_DOC_TILES = 16
_HOPPER_PROGRAM_START = 0.3
# Programs an SM of the tile sets whose grids the rule counts in waves, from their registers and
# shared memory under triton 3.6-3.9 (record 9bdebaf; offline record aa6d350): the 128-row
# block's 64-token tiles, plain or normalizing, 246-255 registers and 98-100 KB (two); a padded
# short query's 32-token tiles 76-103 registers and 66 KB (three); the normalized short queries'
# 32-token tiles 96-122 registers and 50 KB with one padded query (four). With four queries a
# block those take 168 registers (the cap) and 67 KB, three an SM, but are counted as four:
# batch_colbert normalized (41 waves at one document a program) then takes 8 documents a
# program, 0.5% faster than the 4 that three would pick (record 15f6248). Others, the 128-row
# block's included: _HOPPER_PROGRAMS_PER_SM_DEFAULT.
_HOPPER_PROGRAMS_PER_SM = {_HOPPER_SHORT_TILES: 3, _HOPPER_SHORT_NORM_TILES: 4}
_HOPPER_PROGRAMS_PER_SM_DEFAULT = 2
# The tests and probes force a count (where it applies) here.
HOPPER_DOCS_PER_PROGRAM: int | None = None


def hopper_docs_per_program(
    tiles: tuple, Lq: int, lq_tile: int, Ld: int, Ncols: int, blocks: int, sm_count: int,
    normalize: bool,
) -> int:
    """How many documents a program of the Gluon forward streams one after the other, its ring
    of tiles running on from one to the next and its query chunk loaded once: several only for
    one query chunk and documents of at least as many tiles as the ring has slots; how many
    depends on what bounds the forward (the measurements above)."""
    block_n, stages = tiles[0], tiles[1]
    tiles_per_doc = _cdiv(Ld, block_n)
    if Lq > lq_tile or tiles_per_doc < stages:
        return 1
    if HOPPER_DOCS_PER_PROGRAM is not None:
        return HOPPER_DOCS_PER_PROGRAM
    # The candidates double from one while a program streams at most _HOPPER_PASS_TILES tiles
    # and the grid keeps a program an SM; the loop runs on every launch, so it stays plain.
    most = 1
    while (most * 2 <= _HOPPER_MAX_DOCS and most * 2 * tiles_per_doc <= _HOPPER_PASS_TILES
           and _cdiv(Ncols, most * 2) * blocks >= sm_count):
        most *= 2
    if not normalize and tiles_per_doc < _HOPPER_LONG_DOC_TILES:
        return most
    slots = _HOPPER_PROGRAMS_PER_SM.get(tiles, _HOPPER_PROGRAMS_PER_SM_DEFAULT) * sm_count
    if not normalize and _cdiv(Ncols * blocks, slots) != 2:
        return 1  # grouping long documents pays only to bring two waves into one
    best, best_cost, docs = 1, None, 1
    while docs <= most:
        waves = _cdiv(_cdiv(Ncols, docs) * blocks, slots)
        cost = waves * (docs + _HOPPER_PROGRAM_START) if normalize else waves
        if best_cost is None or cost < best_cost:
            best, best_cost = docs, cost
        docs *= 2
    return best


def hopper_constexprs(
    torch_dtype: torch.dtype, lq_tile: int, queries_per_block: int, block_n: int, stages: int,
    dim: int, warps: int, normalize: bool, tiles_first: bool = False, docs_per_program: int = 1,
    save_argmax: bool = False,
) -> dict:
    """The Gluon forward's constexprs and ``num_warps`` for these tiles (the launcher's and the
    offline compile's, ``benchmarks/compile_hopper.py``)."""
    q_layout, _, mma_layout, q_load_layout, tile_load_layout = hopper_layouts(
        torch_dtype, lq_tile * queries_per_block, block_n, dim, warps)
    return dict(
        LQ_TILE=lq_tile, QUERIES_PER_BLOCK=queries_per_block, BLOCK_N=block_n, BLOCK_K=dim,
        NUM_STAGES=stages, NORMALIZE=normalize, SAVE_ARGMAX=save_argmax, TILES_FIRST=tiles_first,
        DOCS_PER_PROGRAM=docs_per_program, Q_SMEM_LAYOUT=q_layout,
        MMA_LAYOUT=mma_layout, Q_LOAD_LAYOUT=q_load_layout, TILE_LOAD_LAYOUT=tile_load_layout,
        num_warps=warps,
    )


def _tensor_descriptor(template, base: Tensor, shape: list, strides: list):
    """``template`` (a Gluon ``TensorDescriptor``) for another base tensor, shape and strides,
    without its constructor's checks, about 4 µs of host time a launch: the caller has made
    the same checks (:func:`hopper_forward_applies`)."""
    desc = object.__new__(type(template))
    desc.__dict__.update(template.__dict__, base=base, shape=shape, strides=strides)
    return desc


@functools.lru_cache(maxsize=None)
def _descriptor_template(torch_dtype: torch.dtype, block_n: int, dim: int, layout):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    example = torch.empty(block_n, dim, dtype=torch_dtype)
    desc = TensorDescriptor(example, [block_n, dim], [dim, 1], [block_n, dim], layout)
    return desc if hasattr(desc, "__dict__") and not hasattr(desc, "__slots__") else None


@functools.lru_cache(maxsize=None)
def _l2_bytes(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).L2_cache_size


def documents_beyond_l2(D: Tensor) -> bool:
    """Whether the documents outgrow the GPU's L2 cache, so that their tiles come from DRAM:
    there the Gluon forward requests a pass's first tiles before loading its query chunk
    (reranking 1000 documents: 3-12% faster), and not where they stay in L2 (batch_colbert's
    20 MB: 2% slower; benchmarks/NOTES.md section 33)."""
    return D.numel() * D.element_size() > _l2_bytes(_device_index(D.device))


@functools.lru_cache(maxsize=None)
def _hopper_plan(
    torch_dtype: torch.dtype, lq_tile: int, queries_per_block: int, dim: int, normalize: bool,
    tiles: tuple[int, int, int, int | None], tiles_first: bool = False, docs_per_program: int = 1,
    save_argmax: bool = False,
):
    """What a Gluon launch needs besides its tensors, built once per tile set and looked up by
    plain values (hashing the layouts' dataclasses on every launch cost microseconds of host
    time): the document tile's rows, the constants, the descriptor's template (None where it
    cannot serve) and its shared layout."""
    block_n, stages, warps, max_registers = tiles
    d_layout = hopper_layouts(torch_dtype, lq_tile * queries_per_block, block_n, dim, warps)[1]
    cap = {} if max_registers is None else {"maxnreg": max_registers}
    consts = constants(**hopper_constexprs(
        torch_dtype, lq_tile, queries_per_block, block_n, stages, dim, warps, normalize,
        tiles_first, docs_per_program, save_argmax), **cap)
    return block_n, consts, _descriptor_template(torch_dtype, block_n, dim, d_layout), d_layout


def launch_fwd_hopper(
    cfg, Q: Tensor, D: Tensor, scores: Tensor, normalize: bool = False,
    argmax: Tensor | None = None, call_tiles: tuple | None = None,
) -> None:
    """The forward through ``_kernels_hopper`` (the caller checked
    :func:`hopper_forward_applies`, and with ``argmax`` :func:`hopper_argmax_applies`), query
    chunks split over programs as in :func:`_launch_fwd`; with ``normalize``, of normalized
    tokens with their norms computed from the tiles; a block of fewer than 64 query rows padded
    to 64 (:func:`hopper_block`); with ``argmax``, each row's winning token written there.
    ``call_tiles``: :func:`hopper_call_tiles` of this call, where the caller has it already."""
    Nq, Lq, dim = Q.shape
    Ncols, Ld = D.shape[0], D.shape[1]
    if Q.stride(-1) != 1:
        Q = Q.contiguous()
    tiles, qpb, splits, docs = call_tiles or hopper_call_tiles(
        cfg, normalize, Nq, Lq, Ncols, Ld, _sm_count(Q.device))
    save_argmax = argmax is not None
    if not save_argmax:
        argmax = _no_argmax(Q.device, torch.int16)
    block_n, consts, template, d_layout = _hopper_plan(
        Q.dtype, cfg.lq_tile, qpb, dim, normalize, tiles, documents_beyond_l2(D), docs,
        save_argmax)
    if template is None:  # a Triton release whose descriptor is not a plain dataclass
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        documents = D.view(Ncols * Ld, dim)
        d_desc = TensorDescriptor(documents, [Ncols * Ld, dim], [dim, 1], [block_n, dim], d_layout)
    else:  # the base is read for its address and dtype only: the contiguous D serves as it is
        d_desc = _tensor_descriptor(template, D, [Ncols * Ld, dim], [dim, 1])
    kernel = launcher(_kernels_hopper._maxsim_fwd_overlap_kernel)

    def launch_slice(rows, out, stride_out_split):
        q = _take(Q, rows)
        kernel(
            (_cdiv(Ncols, docs) * splits, _cdiv(q.shape[0], qpb)),
            (q, d_desc, out, argmax if rows is None or not save_argmax else argmax[rows],
             q.shape[0], Ncols, Lq, Ld, splits, stride_out_split, q.stride(0), q.stride(1)),
            consts,
        )

    _launch_query_slices(launch_slice, scores, qpb, splits)


def maxsim_fwd(
    Q: Tensor,
    D: Tensor,
    q_mask: Tensor | None,
    d_mask: Tensor | None,
    q_inv: Tensor | None,
    d_inv: Tensor | None,
    save_argmax: bool,
    fp32_precision: str,
    norm_from_tiles: bool = False,
    tau: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Scores and argmax. ``norm_from_tiles``: normalize with norms computed from the tiles on
    chip (``q_inv``, ``d_inv`` None): no pass over the inputs before the kernel, for inference,
    where no backward needs the inverse norms afterwards. ``tau > 0``: the smooth max
    ``tau · logsumexp(s / tau)`` instead of the max, and in place of the argmax the fp32
    log2-sum-exp2 of each row (``+inf`` where the row adds nothing), which its backward reads."""
    d_shape = D.shape
    per_query_docs = len(d_shape) == 4
    Nq, Lq, dim = Q.shape
    Ncols, Ld = d_shape[-3], d_shape[-2]
    device = Q.device
    scores = _empty((Nq, Ncols), torch.float32, device)
    saved_dtype = torch.float32 if tau else _configs.argmax_dtype(Ld)
    argmax = (
        _empty((Nq, Ncols, Lq), saved_dtype, device)
        if save_argmax
        else _no_argmax(device, saved_dtype)
    )
    if not (Nq and Ncols):
        return scores, argmax
    if Lq == 0 or Ld == 0:
        scores.zero_()
        argmax.fill_(float("inf") if tau else -1)
        return scores, argmax

    cfg = _configs.fwd_config(
        Lq=Lq, dim=dim, Nq=Nq, per_query_docs=per_query_docs, elem_bytes=Q.element_size(),
        # The smooth max keeps the default tiles: its variants were not measured.
        save_argmax=save_argmax, norm_from_tiles=norm_from_tiles,
        n_cols=Ncols if not tau and _measured_tiles(device) else None, sm_count=_sm_count(device),
    )
    qm = None if q_mask is None else _as_bytes(q_mask)
    dm = None if d_mask is None else _as_bytes(d_mask)
    if q_inv is not None:
        q_inv = q_inv.contiguous()
    if d_inv is not None:
        d_inv = d_inv.contiguous()
    # The Gluon forward's variants: scores, scores of normalized tokens with their norms from
    # the tiles, and scores with the argmax where a pass's tiles fit the codes; not masks,
    # precomputed norms or the smooth max.
    hopper_variant = not (qm is not None or dm is not None or q_inv is not None or tau)
    if (
        HOPPER_KERNEL and hopper_variant and not _configs.is_forced()
        and Nq * Lq * Ncols * Ld * dim >= HOPPER_MIN_MACS
        # Grids of at most one program an SM included: there the Gluon forward's 8-warp tiles
        # beat the Triton kernel's (longdoc 0.0567 against 0.0661 ms, record
        # 2026-12-01_acb15e4).
        and hopper_forward_applies(cfg, Q, D)
    ):
        call_tiles = hopper_call_tiles(cfg, norm_from_tiles, Nq, Lq, Ncols, Ld, _sm_count(device))
        if not save_argmax or hopper_argmax_applies(call_tiles[0], Ld):
            try:
                launch_fwd_hopper(cfg, Q, D, scores, norm_from_tiles,
                                  argmax if save_argmax else None, call_tiles)
                return scores, argmax
            except Exception as exc:  # noqa: BLE001 (Gluon is experimental: any failure to build)
                _hopper_kernel_failed(exc)
    operands = (
        Q, D, qm, dm, q_inv, d_inv, scores, argmax, save_argmax, fp32_precision, norm_from_tiles, tau
    )
    if device.type == "cuda" and not _configs.is_forced() and settings.autotune():
        from triton.testing import do_bench

        key = (
            "fwd", cfg, Q.dtype, Q.device, per_query_docs, qm is not None, dm is not None,
            q_inv is not None, norm_from_tiles, save_argmax, fp32_precision, bool(tau),
        )
        cfg = _configs.tuned(
            key,
            _configs.fwd_candidates(cfg),
            lambda c: do_bench(lambda: _launch_fwd(c, *operands), warmup=5, rep=20),
        )
    _launch_fwd(cfg, *operands)
    return scores, argmax


# The unified backward's fp32 grad_D buffer: one buffer for all of grad_D up to this size; beyond
# it, column chunks of at most a fifth of grad_D's own bytes (at least one column): about ten
# chunks of two launches each, and a peak of grad_D, grad_Q and argmax plus 20% of grad_D.
_SCATTER_BUFFER_MAX_BYTES = 32 << 20
_SCATTER_BUFFER_SHARE = 5
_DRAIN_BLOCK = 4096


def _scatter_chunk_cols(D: Tensor, d_dtype: torch.dtype) -> int:
    """Columns per chunk of the fp32 atomic buffer of grad_D."""
    Ncols = D.shape[-3]
    if d_dtype == torch.float32 or D.numel() * 4 <= _SCATTER_BUFFER_MAX_BYTES:
        return Ncols  # the buffer is the output, or small
    column_bytes = D.numel() // Ncols * 4
    budget = D.numel() * D.element_size() // _SCATTER_BUFFER_SHARE
    return max(1, min(Ncols, budget // column_bytes))


def _scatter_buffer(D: Tensor, n_cols: int) -> Tensor:
    shape = list(D.shape)
    shape[-3] = n_cols
    return torch.zeros(shape, dtype=torch.float32, device=D.device)


def _drain_chunk(buffer: Tensor, grad_d: Tensor, c0: int, n_cols: int) -> None:
    """Columns ``[c0, c0 + n_cols)`` of ``grad_d`` from the buffer's first ``n_cols``, which are
    then zero again (``grad_d`` and ``buffer`` contiguous, columns on axis -3)."""
    groups = buffer.numel() // (buffer.shape[-3] * buffer.shape[-2] * buffer.shape[-1])
    n_elems = n_cols * buffer.shape[-2] * buffer.shape[-1]
    out = grad_d.narrow(-3, c0, n_cols)
    launcher(_drain_chunk_kernel)(
        (_cdiv(n_elems, _DRAIN_BLOCK) * groups,),
        (buffer, out, n_elems, buffer.stride(0) if groups > 1 else 0,
         grad_d.stride(0) if groups > 1 else 0),
        constants(BLOCK=_DRAIN_BLOCK, num_warps=4, num_stages=1),
    )


def _splits(cfg, Q: Tensor, n_cols: int) -> int:
    """Column splits that give the gather grid about four programs per SM."""
    programs = Q.shape[0] * _cdiv(Q.shape[1], cfg.block_s)
    target = 4 * _sm_count(Q.device)
    if programs >= target:
        return 1
    return max(1, min(n_cols, _cdiv(target, programs), _MAX_GRID_Y))


def _dd_tiles_per_program(cfg, Q: Tensor, documents: int, Ld: int, rows_in_one_block: bool) -> int:
    """Token tiles per program of the document-owned grad_D: one, unless the program's rows are
    loaded once for all its tiles; then as many as keep about four programs per SM."""
    tiles = _cdiv(Ld, cfg.block_t)
    if not rows_in_one_block or tiles <= 1:
        return 1
    splits = _cdiv(4 * _sm_count(Q.device), documents)
    return _cdiv(tiles, min(tiles, splits))


# Where a gather grid is small, a program loads several columns at once, under more warps (columns,
# warps): of 1-8 columns at 4 or 8 warps on the H200 (benchmarks/NOTES.md section 44), eight at 8
# warps were the fastest on grids of 4-256 programs (53-77% less time than one column at 4 warps)
# and four at 8 warps at 512 (30% less; eight: 24%). 48-52 registers at four, 100 at eight, no
# local memory (sm_90, triton 3.6-3.9; benchmarks/results/offline/2026-12-01_4144326).
_GATHER_FEW_PROGRAMS_STEP = (8, 8)  # below two programs an SM
_GATHER_SMALL_GRID_STEP = (4, 8)  # below four


def gather_step(programs: int, device: torch.device, scatters: bool) -> tuple[int, int | None]:
    """``(columns a step, warps)`` of the gather kernel (None: the configuration's warps). A
    column's two loads wait on each other; with fewer than four programs an SM too few warps run
    to cover that wait, so several columns' loads go out together. Otherwise, and in a gather
    that also scatters grad_D (not measured with more), one column a step, as before."""
    if scatters:
        return 1, None
    sms = _sm_count(device)
    if programs < 2 * sms:
        return _GATHER_FEW_PROGRAMS_STEP
    if programs < 4 * sms:
        return _GATHER_SMALL_GRID_STEP
    return 1, None


def _launch_gather(
    cfg, grad_scores, Q, D, argmax, q_inv, d_inv, per_query_docs, col_base, n_cols, splits,
    grad_q, grad_d_buffer,
) -> None:
    """The gather kernel over columns ``[col_base, col_base + n_cols)``: ``grad_q`` (None: not
    computed; fp32 and added atomically when ``splits > 1``) and the scatter of ``g · Q`` rows
    into ``grad_d_buffer`` (None: none), whose column 0 is ``col_base``."""
    Nq, Lq, dim = Q.shape
    Ncols, Ld = D.shape[-3], D.shape[-2]
    normalize = q_inv is not None
    cols_per_split = _cdiv(n_cols, splits)
    splits = _cdiv(n_cols, cols_per_split)
    row_programs = Nq * _cdiv(Lq, cfg.block_s)
    launcher(_maxsim_bwd_gather_kernel)(
        (row_programs, splits),
        (
            grad_scores, Q, D,
            Q if q_inv is None else q_inv, D if d_inv is None else d_inv,
            argmax,
            Q if grad_q is None else grad_q,
            D if grad_d_buffer is None else grad_d_buffer,
            Nq, Ncols, Lq, Ld, dim, col_base, col_base + n_cols, cols_per_split,
            *grad_scores.stride(),
            *Q.stride(),
            *_doc_strides(D, per_query_docs),
            *(q_inv.stride() if normalize else (0, 0)),
            *(_doc_strides(d_inv, per_query_docs) if normalize else (0, 0, 0)),
            *(grad_q.stride() if grad_q is not None else (0, 0, 0)),
            *(_doc_strides(grad_d_buffer, per_query_docs) if grad_d_buffer is not None else (0, 0, 0, 0)),
        ),
        _gather_constants(
            cfg, per_query_docs, normalize, grad_q is not None,
            grad_q is not None and splits > 1, grad_d_buffer is not None,
            gather_step(row_programs * splits, Q.device, grad_d_buffer is not None),
        ),
    )


@functools.lru_cache(maxsize=1024)
def _gather_constants(cfg, per_query_docs, normalize, grad_q, atomic_q, scatter_d, step) -> Constants:
    cols_per_step, warps = step
    meta = gather_meta(cfg, normalize=normalize, grad_q=grad_q, atomic_q=atomic_q, scatter_d=scatter_d)
    if warps is not None:
        meta["num_warps"] = warps
    return constants(PER_QUERY_DOCS=per_query_docs, COLS_PER_STEP=cols_per_step, **meta)


# A document-owned grad_D program that scans rows (the cross product's, with or without the
# winner index, and per-query candidates longer than a product's rows) runs its loop unpipelined:
# one stage took 5-26% less time than two or three on the H200 (benchmarks/NOTES.md section 45).
# Offline (sm_90, triton 3.6-3.9), the full scan spills 8-80 B a thread at two stages and nothing
# at one. A program that loads its rows once has no such loop and keeps the configuration's stages.
_DD_SCAN_STAGES = 1


@functools.lru_cache(maxsize=1024)
def _dd_constants(
    cfg, per_query_docs, rows_in_one_block, winner_index, normalize, dtype, fp32_precision,
    scan_stages,
) -> Constants:
    return constants(
        PER_QUERY_DOCS=per_query_docs,
        ROWS_IN_ONE_BLOCK=rows_in_one_block,
        WINNER_INDEX=winner_index,
        INDEX_SCAN=_INDEX_SCAN,
        NORMALIZE=normalize,
        BLOCK_R=cfg.block_r,
        **owned_tile_meta(cfg, dtype, fp32_precision, None if rows_in_one_block else scan_stages),
    )


def _launch_dd(
    cfg, grad_scores, Q, q_inv, argmax, grad_d, per_query_docs, fp32_precision, col_base, n_cols,
    rows, counts,
) -> None:
    """The document-owned grad_D over columns ``[col_base, col_base + n_cols)``: through the
    winner index ``rows``/``counts`` of those columns (cross product), or, without one (None),
    every column at once, each token tile scanning all of its group's rows."""
    Nq, Lq, dim = Q.shape
    Ncols, Ld = grad_d.shape[-3], grad_d.shape[-2]
    normalize = q_inv is not None
    groups = Nq if per_query_docs else 1
    winner_index = rows is not None
    rows_in_one_block = per_query_docs and Lq <= cfg.block_r
    tiles_per_program = _dd_tiles_per_program(cfg, Q, groups * n_cols, Ld, rows_in_one_block)
    launcher(_maxsim_bwd_dd_kernel)(
        (groups * n_cols, _cdiv(_cdiv(Ld, cfg.block_t), tiles_per_program)),
        (
            grad_scores, Q, Q if q_inv is None else q_inv, argmax, grad_d,
            argmax if rows is None else rows, argmax if counts is None else counts,
            Nq, Ncols, Lq, Ld, dim, tiles_per_program, col_base,
            *grad_scores.stride(),
            *Q.stride(),
            *(q_inv.stride() if normalize else (0, 0)),
            *_doc_strides(grad_d, per_query_docs),
        ),
        _dd_constants(
            cfg, per_query_docs, rows_in_one_block, winner_index, normalize, Q.dtype,
            fp32_precision, _DD_SCAN_STAGES,
        ),
    )


# The winner index (``_kernels_index``): argmax entries a program scans per step, and at most
# this many query tokens of each query in a step.
_INDEX_SCAN = 16 if _configs.INTERPRETER else 1024
_INDEX_SCAN_TOKENS = 4 if _configs.INTERPRETER else 128
# Token tiles a winner-index program counts and places in one scan of its column (at most four:
# the 16-bit fields of an int64).
_INDEX_TILES = 4
# The index's share of memory: at most a fifth of grad_D's own bytes (at least one column), as
# for the unified backward's buffer.
_INDEX_SHARE = 5


# Below this many multiply-adds (Nq·Ncols·Lq·Ld·d) the scan of every row costs a few µs of GPU
# time, less than the host's two more launches of the index (benchmarks/NOTES.md section 25).
INDEX_MIN_MACS = 1 << 32


def _uses_winner_index(cfg, per_query_docs: bool, Nq: int, Ncols: int, Lq: int, Ld: int, dim: int) -> bool:
    """The cross product's document-owned grad_D reads its rows through the winner index when a
    column has more than one token tile (with one tile, every row belongs to it anyway) and the
    problem is large enough for the GPU's time to matter."""
    return not per_query_docs and Ld > cfg.block_t and Nq * Ncols * Lq * Ld * dim > INDEX_MIN_MACS


def _index_row_dtype(Nq: int, Lq: int) -> torch.dtype:
    """The winner index's row numbers: int16 where every (query, query token) row fits, which
    halves the index (one column chunk instead of two at train_colpali's shape)."""
    return torch.int16 if Nq * Lq <= 1 << 15 else torch.int32


def _winner_index_cols(Q: Tensor, Ncols: int, n_tiles: int, grad_d: Tensor) -> int:
    """Columns per chunk of the winner index (its rows and int32 tile counts), the chunks as
    even as their count allows: a small last chunk leaves most of the GPU idle."""
    rows = Q.shape[0] * Q.shape[1]
    column_bytes = _index_row_dtype(*Q.shape[:2]).itemsize * rows + 4 * n_tiles
    budget = grad_d.numel() * grad_d.element_size() // _INDEX_SHARE
    most = max(1, min(Ncols, budget // column_bytes))
    return _cdiv(Ncols, _cdiv(Ncols, most))


def _winner_index_buffers(Q: Tensor, n_cols: int, n_tiles: int) -> tuple[Tensor, Tensor]:
    """Rows and tile counts of ``n_cols`` columns (unwritten)."""
    return (
        _empty((n_cols, Q.shape[0] * Q.shape[1]), _index_row_dtype(*Q.shape[:2]), Q.device),
        _empty((n_cols, n_tiles), torch.int32, Q.device),
    )


def _winner_index(argmax: Tensor, col_base: int, n_cols: int, block_t: int, buffers) -> tuple[Tensor, Tensor]:
    """The winner index of columns ``[col_base, col_base + n_cols)`` for ``block_t``-token tiles,
    in ``buffers``: two launches."""
    rows, counts = buffers
    Nq, Ncols, Lq = argmax.shape
    n_tiles = counts.shape[1]
    scan_tokens = min(_configs._pow2(Lq), _INDEX_SCAN_TOKENS)
    tiles = _index_tiles(n_tiles, Nq, Lq, scan_tokens)
    grid = (n_cols, _cdiv(n_tiles, tiles))
    args = (Nq, Ncols, Lq, n_tiles, col_base)
    meta = _index_constants(block_t, scan_tokens, tiles=tiles)
    launcher(_tile_counts_kernel)(grid, (argmax, counts, *args), meta)
    launcher(_tile_rows_kernel)(grid, (argmax, counts, rows, *args), meta)
    return rows, counts


def _index_tiles(n_tiles: int, Nq: int, Lq: int, scan_tokens: int, scan: int = _INDEX_SCAN) -> int:
    """Token tiles a program of the winner index takes in one scan of its column: up to
    ``_INDEX_TILES`` (four 16-bit fields of an int64), one where a column takes ``2^16`` steps
    or more (a field's count per entry slot would overflow)."""
    steps = _cdiv(Lq, scan_tokens) * _cdiv(Nq, max(1, scan // scan_tokens))
    if steps >= 1 << 16:
        return 1
    return min(_INDEX_TILES, _configs._pow2(n_tiles))


@functools.lru_cache(maxsize=64)
def _index_constants(block_t: int, scan_tokens: int, scan: int = _INDEX_SCAN, num_stages: int = 1,
                     tiles: int = 1) -> Constants:
    return constants(
        BLOCK_T=block_t, SCAN=scan, SCAN_Q=max(1, scan // scan_tokens), SCAN_S=scan_tokens,
        TILES=tiles, num_warps=4, num_stages=num_stages,
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


def maxsim_bwd(
    grad_scores: Tensor,
    Q: Tensor,
    D: Tensor,
    argmax: Tensor,
    q_inv: Tensor | None,
    d_inv: Tensor | None,
    need_grad_q: bool,
    need_grad_d: bool,
    strategy: str,
    fp32_out: bool,
    fp32_precision: str,
) -> tuple[Tensor, Tensor]:
    """Gradients of the scores with respect to Q and D (the normalized ones when normalizing).

    ``strategy`` is ``"unified"`` (one gather kernel; fp32 atomics scatter ``grad_D``) or
    ``"lowmem"`` (row-owned ``grad_Q`` and document-owned ``grad_D``; no atomics, bitwise
    reproducible, written directly in the output dtype). With ``fp32_out`` the gradients are fp32.
    """
    trivial = grads_without_launch(Q, D, need_grad_q, need_grad_d, fp32_out)
    if trivial is not None:
        return trivial
    per_query_docs = D.dim() == 4
    Nq, Lq, dim = Q.shape
    Ncols, Ld = D.shape[-3], D.shape[-2]
    q_dtype = torch.float32 if fp32_out else Q.dtype
    d_dtype = torch.float32 if fp32_out else D.dtype

    cfg = _configs.bwd_config(
        Lq=Lq, dim=dim, elem_bytes=Q.element_size(), per_query_docs=per_query_docs
    )
    scatter_d = strategy == "unified" and need_grad_d
    chunk_cols = _scatter_chunk_cols(D, d_dtype) if scatter_d else Ncols
    gather = functools.partial(
        _launch_gather, cfg, grad_scores, Q, D, argmax, q_inv, d_inv, per_query_docs
    )

    # One fp32 buffer for all of grad_D: one launch gathers grad_Q (when asked for) and scatters
    # grad_D, and grad_D is that buffer cast.
    one_buffer = scatter_d and chunk_cols == Ncols
    grad_q = grad_d = None
    if need_grad_q or one_buffer:
        # Splitting the documents over programs needs an fp32 grad_Q buffer (atomics, a zero fill
        # and a cast): where grad_Q is computed, worth it only when the grid would otherwise
        # leave the GPU idle on real work.
        split = strategy == "unified" and (not need_grad_q or Nq * Ncols * Lq >= 1 << 20)
        splits = _splits(cfg, Q, Ncols) if split else 1
        atomic_q = need_grad_q and splits > 1
        if need_grad_q:
            grad_q = (
                torch.zeros(Q.shape, dtype=torch.float32, device=Q.device)
                if atomic_q
                else _empty(Q.shape, q_dtype, Q.device)
            )
        buffer = _scatter_buffer(D, Ncols) if one_buffer else None
        gather(0, Ncols, splits, grad_q, buffer)
        if atomic_q and grad_q.dtype != q_dtype:
            grad_q = grad_q.to(q_dtype)
        if one_buffer:
            return _or_empty(grad_q, Q), buffer.to(d_dtype)

    if scatter_d:
        # Column chunks through an fp32 buffer of `chunk_cols` columns, each drained into grad_D
        # when complete (cast, and the buffer cleared for the next chunk, in one launch): the
        # buffer stays a fraction of grad_D however large D is.
        buffer = _scatter_buffer(D, chunk_cols)
        grad_d = _empty(D.shape, d_dtype, D.device)
        for c0 in range(0, Ncols, chunk_cols):
            n = min(chunk_cols, Ncols - c0)
            gather(c0, n, _splits(cfg, Q, n), None, buffer)
            _drain_chunk(buffer, grad_d, c0, n)
    elif need_grad_d:
        grad_d = _empty(D.shape, d_dtype, D.device)
        dd = functools.partial(
            _launch_dd, cfg, grad_scores, Q, q_inv, argmax, grad_d, per_query_docs, fp32_precision
        )
        if _uses_winner_index(cfg, per_query_docs, Nq, Ncols, Lq, Ld, dim):
            n_tiles = _cdiv(Ld, cfg.block_t)
            index_cols = _winner_index_cols(Q, Ncols, n_tiles, grad_d)
            index = _winner_index_buffers(Q, index_cols, n_tiles)
            for c0 in range(0, Ncols, index_cols):
                n = min(index_cols, Ncols - c0)
                dd(c0, n, *_winner_index(argmax, c0, n, cfg.block_t, index))
        else:
            dd(0, Ncols, None, None)
    return _or_empty(grad_q, Q), _or_empty(grad_d, Q)


def _or_empty(grad: Tensor | None, like: Tensor) -> Tensor:
    """A gradient nobody asked for is an empty tensor (the registered op returns tensors only)."""
    return like.new_empty((0,)) if grad is None else grad


def inverse_norms(x: Tensor, eps: float) -> Tensor:
    """``1 / max(‖x[..., :]‖, eps)`` in fp32, shape ``x.shape[:-1]``, one read of ``x``."""
    rows = x.reshape(-1, x.shape[-1]) if x.numel() else x.new_empty((0, x.shape[-1]))
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        block_k = _configs.block_k_for(rows.shape[1])
        block_rows = max(1, min(64, 8192 // block_k))
        launcher(_inverse_norm_kernel)(
            (_cdiv(rows.shape[0], block_rows),),
            (rows, out, rows.shape[0], rows.shape[1], *rows.stride()),
            constants(EPS=eps, BLOCK_ROWS=block_rows, BLOCK_K=block_k, num_warps=4, num_stages=1),
        )
    return out.view(x.shape[:-1])
