"""The planner: every launch decision of every layout, made once per problem into a frozen plan.

A front door describes the call as a :class:`~fusedmaxsim._problem.Problem` (what is asked:
layout, sizes, dtype, masks, normalization, reduction, whether the argmax is saved) and resolves
:class:`~fusedmaxsim._problem.Options` from :mod:`fusedmaxsim.settings`. :func:`plan_forward`
and :func:`plan_backward` turn them into a :class:`ForwardPlan` / :class:`BackwardPlan`: which
kernel runs (Triton, Gluon or PyTorch), its tiles, the grid's splits, the backward strategy,
the chunking of its buffers, the winner index. Plans are cached on ``(problem, options)``, so a
repeated shape costs a dictionary lookup. The launchers (``_launch``) execute a plan and decide
nothing.

This is the only module with measured constants and branches on shapes. Each constant names the
topic of ``docs/design.md`` that gives its measurement. :func:`forced_plan` forces any decision
(or constant) inside a ``with`` block, for tests and probes; :func:`explain` shows the plan of a
call with the reason for each choice.

Nothing here imports Triton: the PyTorch path plans without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

import torch

from . import settings
from ._problem import (
    APPROX_CANDIDATES, APPROX_HITS, CANDIDATES, CROSS, HIDDEN_CANDIDATES, HIDDEN_LAYOUTS,
    PAIRS, PACKED, RESIDUAL, RESIDUAL_CANDIDATES, RESIDUAL_LAYOUTS, Options, Problem,
)

__all__ = [
    "BackwardPlan", "BwdConfig", "ForwardPlan", "FwdConfig", "HopperTiles", "MEASURED",
    "argmax_dtype", "explain_plans", "forced_plan", "plan_backward", "plan_blocks", "plan_forward",
    "plan_hidden_backward",
    "recording",
]

INTERPRETER = settings.INTERPRETER
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis


# ------------------------------------------------------------------------------------------------
# Measured constants (docs/design.md, "Measured constants", gives each one's measurement)
# ------------------------------------------------------------------------------------------------

MEASURED: dict[str, object] = dict(
    # Backward strategy ("auto"): below HOST_BOUND_MACS multiply-adds (Nq·Ncols·Lq·Ld·d) a
    # training call is bound by the host, where lowmem's fewer allocations win; from
    # LOWMEM_CROSS_MACS up, a 16-bit cross product is bound by the GPU, where lowmem (through the
    # winner index) is as fast and reproducible. design.md "Backward strategies".
    HOST_BOUND_MACS=1 << 32,
    LOWMEM_CROSS_MACS=1 << 36,
    # Forward: the chunk splits' partial scores stay within this many bytes. design.md "Forward".
    SPLIT_PARTIALS_MAX_BYTES=64 << 20,
    # Gluon (Hopper) forward: the least work it takes, the dims it serves. design.md "Hopper".
    HOPPER_MIN_MACS=1 << 30,
    HOPPER_DIMS=(128,),
    # Gluon tile sets (document tile, stages, warps, register cap or None). design.md "Hopper".
    HOPPER_TILES=(64, 4, 4, None),
    HOPPER_PACKED_TILES=(64, 3, 4, None),
    HOPPER_NORM_TILES=(64, 4, 4, None),
    HOPPER_SHORT_NORM_TILES=(32, 4, 4, 168),
    HOPPER_FEW_PROGRAMS_TILES=(64, 6, 8, None),
    HOPPER_SHORT_TILES=(32, 6, 4, None),
    # Gluon documents a program. design.md "Hopper: documents a program".
    HOPPER_MAX_DOCS=16,
    HOPPER_PASS_TILES=128,
    HOPPER_LONG_DOC_TILES=16,
    HOPPER_PROGRAM_START=0.3,
    HOPPER_PROGRAMS_PER_SM_DEFAULT=2,
    # The unified backward's fp32 grad_D buffer: whole up to this size, else column chunks of at
    # most a fifth of grad_D's bytes. design.md "Backward strategies".
    SCATTER_BUFFER_MAX_BYTES=32 << 20,
    SCATTER_BUFFER_SHARE=5,
    DRAIN_BLOCK=4096,
    # Gather: (columns a step, warps) below two and four programs an SM. design.md "Backward".
    GATHER_FEW_PROGRAMS_STEP=(8, 8),
    GATHER_SMALL_GRID_STEP=(4, 8),
    # Document-owned grad_D programs that scan rows run unpipelined. design.md "Backward".
    DD_SCAN_STAGES=1,
    # Winner index. design.md "Winner index".
    INDEX_MIN_MACS=1 << 32,
    INDEX_SCAN=16 if INTERPRETER else 1024,
    INDEX_SCAN_TOKENS=4 if INTERPRETER else 128,
    INDEX_TILES=4,
    INDEX_SHARE=5,
    # PyTorch path on a CPU: the cross product's similarities document-major (the document
    # tokens as the product's rows) for query rows (Nq·Lq) in these ranges, where x86 MKL's fp32
    # product ran faster that way round. design.md "PyTorch path".
    TORCH_DOC_MAJOR_ROWS=((32, 32), (192, 256)),
    # ... and for the bf16 product (bf16 inference on a CPU), for query rows that are a multiple
    # of this, where oneDNN's AMX product ran 1.14-1.95× faster that way round (64-512 rows) and
    # 1.2-2.2× slower at 8-56 rows (96, 160, 224: 0.86-1.23). design.md "PyTorch path".
    TORCH_BF16_DOC_MAJOR_ROW_MULTIPLE=64,
    # The fused projection head: fused (each document tile projected on chip) while every
    # document tile is projected at most this many times (query blocks × query chunks) and the
    # hidden states hold at most this many bytes, or beyond that where each tile is projected
    # once and the document tiles pad its tokens by at most HIDDEN_FUSED_MAX_PADDING (the fused
    # kernel projects the padding too); else the documents are projected once into memory.
    # bf16 on the H200 (NOTES §72, record b9d31a1): unpadded, fused took 0.86-0.94x the
    # unfused route's time at 0.8-3.2 GB (inference; 0.79-0.95x a training step), and 0.84x at
    # 403 MB; at 461 MB of 300-token documents (28% padding) 1.22x. The fused kernel's tiles
    # (document tile, d_model a split-K step, warps, stages): the best of 18 at three shapes
    # summed, and at three of five alone (under the interpreter 16 and 16, so that the tests'
    # short documents and narrow hidden states take full tiles and whole steps too). design.md
    # "Fused projection head".
    HIDDEN_FUSED_MAX_PASSES=2,
    HIDDEN_FUSED_MAX_BYTES=400 << 20,
    HIDDEN_FUSED_MAX_PADDING=1 / 8,
    HIDDEN_TILES=(16, 16, 4, 1) if INTERPRETER else (128, 64, 8, 4),
    # Shorter tiles (same fields) for documents that HIDDEN_TILES' pad by more than
    # HIDDEN_FUSED_MAX_PADDING and these pad less (300-token documents: 28% and 7%); None: none.
    # NOTES §80, §83 (probe hidden_route_short): 1 x 1000 inference 0.185 -> 0.162 ms at 180
    # tokens, 0.262 -> 0.235 at 300, 0.343 -> 0.306 at 448; 8 warps slower.
    HIDDEN_SHORT_TILES=None if INTERPRETER else (64, 64, 4, 4),
    # The head's Triton backwards (design.md "Fused projection head"; NOTES §70, §71): the
    # entries kernel (each (query, query token) entry's winning row projected) where a
    # document's query tokens are fewer than its tokens / HIDDEN_BWD_ENTRY_SHARE, else the token
    # tile kernels (every token tile that holds a winner projected). HIDDEN_ENTRY_TILES: the
    # entries kernel's (entries a program at most, warps, stages).
    # Their buffers (grad_P, and for grad_Q P with its inverse norms or g · P̂) hold at most
    # 1 / HIDDEN_BWD_BUFFER_SHARE of the hidden states' bytes, and at least
    # HIDDEN_BWD_MIN_BUFFER_BYTES (one chunk of columns at small sizes, where each chunk's
    # launches cost more than the memory); grad_W's fp32 partials at most
    # 1 / HIDDEN_WEIGHT_PARTIAL_SHARE, about HIDDEN_WEIGHT_WAVES programs an SM. Tiles: the rows
    # kernel's (token tile, warps, stages), the weight kernel's (buffer rows a step, d_model
    # columns a program, warps, stages).
    HIDDEN_BWD_ENTRY_SHARE=1,
    HIDDEN_ENTRY_TILES=(16, 4, 1) if INTERPRETER else (64, 8, 2),
    HIDDEN_BWD_BUFFER_SHARE=8,
    HIDDEN_BWD_MIN_BUFFER_BYTES=24 << 20,
    HIDDEN_WEIGHT_PARTIAL_SHARE=4,
    HIDDEN_WEIGHT_WAVES=2,
    HIDDEN_BWD_TILES=(16, 4, 1) if INTERPRETER else (64, 8, 2),
    HIDDEN_WEIGHT_TILES=(16, 16, 4, 1) if INTERPRETER else (64, 128, 8, 2),
    # PLAID residual documents (design.md "PLAID"; NOTES §63, §66): the kernel's tiles (d <=
    # 128: document tile, warps, stages, register cap) on the cross product and on per-query
    # candidates, and the query rows a block on the cross product (16-bit; half for fp32).
    # Cross product: 32-token tiles 1.1-1.4x faster than 16 or 64; 256 rows 1.4-1.7x faster
    # than 128. Candidates (one query a block): 16-token tiles capped at 128 registers (4
    # programs an SM, not 2) 1.25x faster than 32 uncapped. Pipelined (2-3 stages), the
    # gathered loads ran 2.5-4x slower.
    RESIDUAL_TILES=(32, 4, 1, None),
    RESIDUAL_CANDIDATE_TILES=(16, 4, 1, 128),
    RESIDUAL_ROWS=256,
)
# Programs an SM of the Gluon tile sets whose grids are counted in waves (design.md "Hopper").
_HOPPER_PROGRAMS_PER_SM = {MEASURED["HOPPER_SHORT_TILES"]: 3,
                           MEASURED["HOPPER_SHORT_NORM_TILES"]: 4}


# ------------------------------------------------------------------------------------------------
# Forcing: tests and probes steer any decision here, never through private names
# ------------------------------------------------------------------------------------------------

_forced: dict[str, object] = {}

# The decisions forced_plan takes besides the MEASURED constants.
FORCIBLE = frozenset({
    "kernel",             # forward: "triton", "gluon" or "torch" (backend and availability permitting)
    "fwd_tiles",          # forward: a FwdConfig
    "bwd_tiles",          # backward: a BwdConfig
    "splits",             # forward: chunk splits
    "max_grid_y",         # queries blocks a launch (forward), columns split (backward)
    "hopper_tiles",       # Gluon (document tile, stages, warps, register cap)
    "docs_per_program",   # Gluon documents a program (where several can apply)
    "tiles_first",        # Gluon: request a pass's first tiles before the query chunk
    "descriptor_template",  # Gluon: False builds each TMA descriptor through its constructor
    "strategy",           # backward: "unified" or "lowmem" (in place of "auto")
    "scatter_chunk_cols",  # unified backward: columns a chunk of the fp32 grad_D buffer
    "gather_step",        # (columns a step, warps or None) of the gather kernel
    "winner_index",       # lowmem cross product: through the winner index or not
    "index_cols",         # winner index: columns a chunk
    "index_tiles",        # winner index: token tiles a scan
    "index_row_dtype",    # winner index: torch.int16 or torch.int32 row numbers
    "sm_count",           # the device's SM count as the planner sees it
    "l2_bytes",           # the device's L2 bytes as the planner sees it
    "doc_major",          # PyTorch path: the cross product's similarities document-major
    "bf16_product",       # PyTorch path: bf16 inputs multiplied in bf16 (inference)
    "hidden_route",       # fused projection head: "fused" or "unfused"
    "hidden_by_entry",    # projection head backward: winners one row an entry, or every row
    "hidden_bwd_kernel",  # projection head backward: "entries", "tiles" or "torch" (closed form)
})


@contextlib.contextmanager
def forced_plan(**decisions) -> Iterator[None]:
    """Force decisions of every plan made inside the block (nested blocks add to each other).

    Keys are the names in :data:`FORCIBLE` or of :data:`MEASURED`; a forced decision replaces
    the planner's choice wherever that decision is made, and the cache is bypassed meanwhile.
    ``with forced_plan(kernel="triton", fwd_tiles=FwdConfig(...), strategy="lowmem"): ...``
    """
    unknown = set(decisions) - FORCIBLE - set(MEASURED)
    if unknown:
        raise ValueError(f"forced_plan: unknown decisions {sorted(unknown)}; "
                         f"known: {sorted(FORCIBLE | set(MEASURED))}")
    saved = dict(_forced)
    _forced.update(decisions)
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)


_recording: list | None = None


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """``with recording() as plans:`` collects ``(problem, plan)`` for every forward and backward
    planned inside the block, cached or not, in order: which kernel ran, with which tiles and
    strategy."""
    global _recording
    saved, plans = _recording, []
    _recording = plans
    try:
        yield plans
    finally:
        _recording = saved


def _measured(name: str):
    return _forced.get(name, MEASURED[name])


# ------------------------------------------------------------------------------------------------
# Tiles
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    lq_tile: int  # query rows per chunk, a power of two >= 16
    queries_per_block: int  # short queries packed into one tile (cross product only)
    block_n: int  # document tokens per streamed tile
    block_k: int  # embedding dim, padded to a power of two
    num_warps: int
    num_stages: int
    # ptxas's register cap per thread (None: its own choice); two 8-warp programs fit on one SM
    # at 128 registers.
    max_registers: int | None = None
    # Hopper products read the query tile from registers instead of shared memory (16-bit
    # inputs, at least 64 rows a block).
    query_in_registers: bool = False


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    block_s: int  # query tokens per program (gather) or per step (owned grad_D)
    block_t: int  # document tokens per program (owned grad_D)
    block_r: int  # (query, token) rows per one-hot product (owned grad_D)
    block_k: int
    num_warps: int
    num_stages: int


def pow2(n: int) -> int:
    """The next power of two >= max(n, 1), without triton.next_power_of_2's per-call cost."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def argmax_dtype(Ld: int) -> torch.dtype:
    """The saved argmax's dtype: int16 while every token index and the ``-1`` of "no valid token"
    fit (half the bytes of int32 to keep until the backward and to read back there), else int32."""
    return torch.int16 if Ld <= torch.iinfo(torch.int16).max else torch.int32


def block_k_for(dim: int) -> int:
    return max(16, pow2(dim))


@functools.lru_cache(maxsize=1024)
def fwd_heuristic(Lq: int, dim: int, Nq: int, per_query_docs: bool, elem_bytes: int,
                  interp: bool = INTERPRETER) -> FwdConfig:
    """The forward's default tiles for a query-length bucket (design.md "Forward")."""
    Lq, Nq = pow2(Lq), pow2(Nq)
    block_k = block_k_for(dim)
    # Rows of the Q tile kept on chip: 128 fills a Hopper tensor-core tile at d <= 128;
    # larger d keeps the Q tile near 32 KiB of shared memory.
    max_rows = 32 if interp else max(16, min(128, (32768 // elem_bytes) // block_k))
    lq_tile = min(max(16, Lq), max_rows)
    queries_per_block = 1
    if not per_query_docs and lq_tile < max_rows:
        queries_per_block = min(max_rows // lq_tile, Nq)
    if interp:
        return FwdConfig(lq_tile, queries_per_block, 32, block_k, 4, 1)
    block_n = 64 if block_k <= 128 else (32 if block_k <= 256 else 16)
    num_warps = 4  # 8 warps were 10-25% slower at every shape (design.md "Forward")
    # Packed short queries: 2 stages measured 5-20% faster (design.md "Forward").
    num_stages = 2 if queries_per_block > 1 or block_k > 128 else 3
    return FwdConfig(lq_tile, queries_per_block, block_n, block_k, num_warps, num_stages)


@functools.lru_cache(maxsize=1024)
def fwd_variant(cfg: FwdConfig, *, few_programs: bool, save_argmax: bool, norm_from_tiles: bool,
                per_query_docs: bool, elem_bytes: int) -> FwdConfig:
    """Measured departures from the default tiles (16-bit inputs, d <= 128, on the H200;
    design.md "Forward: tile variants"):

    * at most one program per SM (a few long documents): two warp groups a program, 64-token
      tiles, 4 stages, 1.1-2x faster there.
    * the forward that saves the argmax (cross product), and inference on packed short queries:
      32-token tiles, 4 warps, with the query tile in registers: the default tiles spill with
      the argmax, and 32-token tiles read from shared memory are bound by its bandwidth unless
      the query tile comes from registers. 4-7% faster than the tiles before.
    * the forward that normalizes from the tiles: 8 warps of 32-token tiles capped at 128
      registers (two programs per SM), 11% faster; the query tile in registers spills.
    The query in registers needs at least 64 rows a block (a Hopper warp-group product).
    """
    if elem_bytes != 2 or cfg.block_k > 128:
        return cfg
    if few_programs:
        return dataclasses.replace(cfg, block_n=64, num_warps=8, num_stages=4, max_registers=None)
    if norm_from_tiles:
        return dataclasses.replace(cfg, block_n=32, num_warps=8, num_stages=4, max_registers=128)
    rows = cfg.lq_tile * cfg.queries_per_block
    if not per_query_docs and rows >= 64 and (save_argmax or cfg.queries_per_block > 1):
        return dataclasses.replace(cfg, block_n=32, num_warps=4, num_stages=3, max_registers=None,
                                   query_in_registers=True)
    if save_argmax and not per_query_docs:
        return dataclasses.replace(cfg, block_n=32, num_warps=8, num_stages=4, max_registers=128)
    return cfg


def fwd_candidates(base: FwdConfig) -> list[FwdConfig]:
    """The forward tiles an autotuning run times: the analytical choice and its neighbours."""
    variants = [base]
    for block_n, warps, stages in ((64, 4, 2), (64, 4, 3), (64, 4, 4), (32, 4, 4), (64, 8, 3),
                                   (128, 8, 3)):
        if base.block_k > 128 and block_n > 32:
            continue
        variants.append(dataclasses.replace(base, block_n=block_n, num_warps=warps,
                                            num_stages=stages, max_registers=None,
                                            query_in_registers=False))
    if base.queries_per_block > 1:
        variants.append(dataclasses.replace(base, queries_per_block=base.queries_per_block // 2))
    unique: list[FwdConfig] = []
    for cfg in variants:
        if cfg not in unique:
            unique.append(cfg)
    return unique


@functools.lru_cache(maxsize=1024)
def bwd_heuristic(Lq: int, dim: int, elem_bytes: int, per_query_docs: bool,
                  interp: bool = INTERPRETER) -> BwdConfig:
    """The backward's tiles: 32-token gather blocks; one-hot products over 128 flattened rows
    when many queries share a document, over the query itself otherwise (design.md
    "Backward")."""
    Lq = pow2(Lq)
    block_k = block_k_for(dim)
    if interp:
        return BwdConfig(16, 32, 16, block_k, 4, 1)
    block_s = min(32, max(16, Lq))
    block_t = 64 if block_k <= 128 else (32 if block_k <= 256 else 16)
    block_r = 128 if block_k <= 128 else 64
    if per_query_docs:
        block_r = min(64, max(16, Lq))
    return BwdConfig(block_s, block_t, block_r, block_k, 4, 2)


@functools.lru_cache(maxsize=256)
def smooth_bwd_heuristic(Lq: int, dim: int, interp: bool = INTERPRETER) -> BwdConfig:
    """Tiles of the smooth-max backward (``block_r`` unused): each program recomputes
    ``[block_s, block_t]`` similarity tiles, so both stay at tensor-core sizes."""
    block_k = block_k_for(dim)
    if interp:
        return BwdConfig(16, 16, 16, block_k, 4, 1)
    block_s = min(64, max(16, pow2(Lq)))
    block_t = 64 if block_k <= 128 else 32
    return BwdConfig(block_s, block_t, 0, block_k, 4, 2)


# ------------------------------------------------------------------------------------------------
# Device facts (cached; none is read on the PyTorch path)
# ------------------------------------------------------------------------------------------------


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _cuda_facts(device_index: int) -> tuple[int, bool, int]:
    props = torch.cuda.get_device_properties(device_index)
    hopper = torch.version.hip is None and torch.cuda.get_device_capability(device_index)[0] == 9
    return props.multi_processor_count, hopper, props.L2_cache_size


def sm_count(device: torch.device) -> int:
    forced = _forced.get("sm_count")
    if forced is not None:
        return forced
    return _cuda_facts(_device_index(device))[0] if device.type == "cuda" else 4


def measured_tiles(device: torch.device) -> bool:
    """Whether the measured tile variants and the Gluon forward apply: NVIDIA Hopper (sm_90),
    where they were measured; elsewhere the default tiles stay."""
    return device.type == "cuda" and _cuda_facts(_device_index(device))[1]


def l2_bytes(device: torch.device) -> int:
    forced = _forced.get("l2_bytes")
    if forced is not None:
        return forced
    return _cuda_facts(_device_index(device))[2] if device.type == "cuda" else 0


# ------------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HopperTiles:
    """The Gluon forward's launch: tile set, queries a block (padded to 64 rows), documents a
    program, and whether a pass's first tiles are requested before its query chunk."""

    tiles: tuple  # (document tile, stages, warps, register cap or None)
    queries_per_block: int
    docs_per_program: int
    tiles_first: bool
    descriptor_template: bool = True


@dataclasses.dataclass(frozen=True)
class ForwardPlan:
    """How a forward runs. ``kernel``: ``"torch"`` (the blocked PyTorch path), ``"triton"``
    (the dense or packed Triton kernel), ``"gluon"`` (the Hopper forward, dense cross product);
    ``tiles``: the Triton tiles (the Gluon forward's query chunking too); ``splits``: programs
    sharing one (document, query block)'s query chunks; ``max_grid_y``: query blocks a launch;
    ``autotune``: time :func:`fwd_candidates` on the first call; ``reasons``: why, in words."""

    kernel: str
    tiles: FwdConfig | None = None
    splits: int = 1
    max_grid_y: int = MAX_GRID_Y
    hopper: HopperTiles | None = None
    autotune: bool = False
    blocks: tuple[int, int, int] = (1, 1, 1)  # PyTorch path: queries, columns, query tokens a block
    doc_major: bool = False  # PyTorch path: the similarities [Nd, Ld, Nq, Lq] (design.md)
    bf16_product: bool = False  # PyTorch path: bf16 similarities, each max rounded (design.md)
    # Hidden layouts: "fused" (each document tile projected on chip) or "unfused" (the documents
    # projected once into memory, then the dense plan); the fused kernel's d_model step.
    hidden_route: str = ""
    hidden_block: int = 0
    reasons: tuple[str, ...] = ()


def chunk_splits(Lq: int, lq_tile: int, Nq: int, Ncols: int, per_query_docs: bool) -> int:
    """How many programs share the query chunks of one (document, query block): on the cross
    product, every chunk its own program where the partial scores fit in
    ``SPLIT_PARTIALS_MAX_BYTES`` (one program walking the nine chunks of a 1030-token query read
    each document from DRAM nine times; split, 20% faster); one for a single chunk, and for
    per-query candidates, measured 7% slower split (design.md "Forward: chunk splits")."""
    chunks = cdiv(Lq, lq_tile)
    if chunks <= 1 or per_query_docs or not (Nq and Ncols):
        return 1
    fit = _measured("SPLIT_PARTIALS_MAX_BYTES") // (4 * Nq * Ncols)
    return max(1, min(chunks, fit, (2**31 - 1) // Ncols))


def few_programs(Nq: int, queries_per_block: int, n_cols: int, sms: int) -> bool:
    """Whether the forward's grid holds at most one program an SM (a few long documents)."""
    return n_cols * cdiv(Nq, queries_per_block) <= sms


def _block_rows(cfg: FwdConfig) -> int:
    return cfg.lq_tile * cfg.queries_per_block


def hopper_block(cfg: FwdConfig) -> FwdConfig:
    """``cfg`` with at least 64 query rows a block, the least a warp-group product takes: a
    block of fewer (one short query) is padded with empty query slots."""
    if _block_rows(cfg) >= 64:
        return cfg
    return dataclasses.replace(cfg, queries_per_block=64 // cfg.lq_tile)


def hopper_tiles(cfg: FwdConfig, normalize: bool, programs: int, sms: int) -> tuple:
    """The Gluon forward's tile set for a block of ``cfg`` (before :func:`hopper_block` pads
    it) on a grid of ``programs``: few programs' (a 128-row block), the normalized short
    queries', the normalizing variant's, a short query's, packed short queries', or a long
    query's (design.md "Hopper: tile sets")."""
    few = programs <= sms
    if few and _block_rows(cfg) == 128:
        return _measured("HOPPER_FEW_PROGRAMS_TILES")
    short_queries = cfg.queries_per_block > 1 or _block_rows(cfg) < 64
    if normalize and short_queries and not few:
        return _measured("HOPPER_SHORT_NORM_TILES")
    if normalize:
        return _measured("HOPPER_NORM_TILES")
    if _block_rows(cfg) < 64:
        return _measured("HOPPER_SHORT_TILES")
    return _measured("HOPPER_PACKED_TILES" if cfg.queries_per_block > 1 else "HOPPER_TILES")


def hopper_docs_per_program(tiles: tuple, Lq: int, lq_tile: int, Ld: int, Ncols: int,
                            blocks: int, sms: int, normalize: bool) -> int:
    """How many documents a program of the Gluon forward streams one after the other, its ring
    of tiles running on from one to the next and its query chunk loaded once: several only for
    one query chunk and documents of at least as many tiles as the ring has slots; how many
    depends on what bounds the forward (design.md "Hopper: documents a program")."""
    block_n, stages = tiles[0], tiles[1]
    tiles_per_doc = cdiv(Ld, block_n)
    if Lq > lq_tile or tiles_per_doc < stages:
        return 1
    forced = _forced.get("docs_per_program")
    if forced is not None:
        return forced
    max_docs, pass_tiles = _measured("HOPPER_MAX_DOCS"), _measured("HOPPER_PASS_TILES")
    # The candidates double from one while a program streams at most HOPPER_PASS_TILES tiles
    # and the grid keeps a program an SM.
    most = 1
    while (most * 2 <= max_docs and most * 2 * tiles_per_doc <= pass_tiles
           and cdiv(Ncols, most * 2) * blocks >= sms):
        most *= 2
    if not normalize and tiles_per_doc < _measured("HOPPER_LONG_DOC_TILES"):
        return most
    per_sm = _HOPPER_PROGRAMS_PER_SM.get(tiles, _measured("HOPPER_PROGRAMS_PER_SM_DEFAULT"))
    slots = per_sm * sms
    if not normalize and cdiv(Ncols * blocks, slots) != 2:
        return 1  # grouping long documents pays only to bring two waves into one
    start = _measured("HOPPER_PROGRAM_START")
    best, best_cost, docs = 1, None, 1
    while docs <= most:
        waves = cdiv(cdiv(Ncols, docs) * blocks, slots)
        cost = waves * (docs + start) if normalize else waves
        if best_cost is None or cost < best_cost:
            best, best_cost = docs, cost
        docs *= 2
    return best


def _hopper_available() -> bool:
    from .kernels import hopper_forward

    return hopper_forward.AVAILABLE


def _hopper_code_limit() -> int:
    from .kernels import hopper_forward

    return hopper_forward.TILE_CODES.value


def _gluon_refusal(p: Problem, o: Options, cfg: FwdConfig) -> str | None:
    """Why the Gluon forward cannot or should not run this problem (None: it runs it)."""
    if not o.hopper_kernel:
        return "the Hopper kernel is off (FUSEDMAXSIM_HOPPER_KERNEL=0, or it failed earlier)"
    if p.layout != CROSS:
        return "the Gluon forward serves the dense cross product only"
    if p.has_q_mask or p.has_d_mask or (p.normalize and not p.norm_from_tiles) or p.tau:
        return "masks, precomputed norms and the smooth max run on the Triton kernel"
    if p.dtype not in (torch.bfloat16, torch.float16):
        return "the Gluon forward takes 16-bit inputs"
    if p.dim != cfg.block_k or p.dim not in _measured("HOPPER_DIMS"):
        return f"d = {p.dim}: the Gluon forward is measured faster at d in {_measured('HOPPER_DIMS')}"
    if p.Nq * p.Lq * p.Ncols * p.Ld * p.dim < _measured("HOPPER_MIN_MACS"):
        return "below HOPPER_MIN_MACS multiply-adds, where its start costs more than it saves"
    if not measured_tiles(p.device):
        return "not an NVIDIA Hopper GPU"
    if not p.tma_ready or p.Ncols * p.Ld >= 2**31:
        return "the documents must be contiguous, 16-byte aligned and within int32 rows (TMA)"
    if _block_rows(hopper_block(cfg)) not in (64, 128):
        return "the query block is not 64 or 128 rows"
    if not _hopper_available():
        return "Gluon is not available in this Triton"
    return None


def plan_blocks(
    Nq: int, Ncols: int, Lq: int, Ld: int, dim: int, per_query_docs: bool, budget_elems: int
) -> tuple[int, int, int]:
    """Queries, columns and query tokens per block so that the block's temporaries fit the budget.

    The temporaries are the similarity block ``bq·bc·ls·Ld`` plus the document block copied to the
    compute dtype (``bc·Ld·d``, or ``bq·bc·Ld·d`` for per-query candidates).
    """
    budget = max(1, budget_elems)
    doc = Ld * dim
    rows = Lq
    if Lq * Ld + doc > budget:
        rows = max(1, (budget - doc) // max(Ld, 1))
        return 1, 1, min(rows, Lq)
    per_pair = max(1, Lq * Ld + doc)  # empty problems too (the plan is made before the launch)
    bc = max(1, min(Ncols, budget // per_pair))
    if per_query_docs:
        bq = max(1, min(Nq, budget // (bc * per_pair)))
    else:
        bq = max(1, min(Nq, (budget - bc * doc) // max(bc * Lq * Ld, 1)))
    return bq, bc, rows


def _plan_torch_forward(p: Problem, o: Options) -> ForwardPlan:
    """The PyTorch path: the blocks that keep the similarities within ``o.torch_block_bytes``,
    and the orientation of the cross product's similarities. On a CPU, MKL's fp32 product
    ``[Nq·Lq, d] × [d, Nd·Ld]`` ran 1.39-1.48× faster the other way round (the document tokens
    as its rows) for 32 query rows (one ColBERT query), 1.08-1.22× for 192-256, and as fast or
    slower elsewhere (design.md "PyTorch path")."""
    elem_bytes = 8 if p.dtype == torch.float64 else 4  # the compute dtype's
    # A residual block's documents are decompressed first: a bucket index, a centroid row and
    # their sum a value, about three document copies.
    residual = p.layout in RESIDUAL_LAYOUTS
    doc_dim = 3 * p.dim if residual else p.dim
    blocks = plan_blocks(p.Nq, p.Ncols, p.Lq, p.Ld, doc_dim,
                         p.layout in (CANDIDATES, RESIDUAL_CANDIDATES),
                         o.torch_block_bytes // elem_bytes)
    reasons = ["backend: the PyTorch path" + (
                   ", each block of documents decompressed first" if residual else ""),
               f"blocks: {blocks[0]} queries × {blocks[1]} columns × {blocks[2]} query tokens"]
    bf16_product = _forced.get("bf16_product")
    if bf16_product is not None:
        reasons.append("product: forced")
    else:
        # On a CPU the bf16 product runs on the bf16 matrix units (AMX, AVX-512 BF16), far
        # faster than the fp32 one, and PyTorch's CPU product has no bf16-in, fp32-out form:
        # inference takes it and rounds each token's maximum to bf16 (design.md "PyTorch path"). A
        # gradient needs fp32 similarities: rounded ones would tie and move the argmax.
        bf16_product = (p.device.type == "cpu" and p.dtype == torch.bfloat16
                        and not p.save_argmax and not p.tau)
        if bf16_product:
            reasons.append("product: in bf16 (inference on a CPU), each token's maximum "
                           "similarity rounded to bf16 before the fp32 sum")
    bf16_product = bool(bf16_product) and p.layout in (CROSS, CANDIDATES)
    doc_major = _forced.get("doc_major")
    rows = p.Nq * p.Lq
    if doc_major is not None:
        reasons.append("orientation: forced")
    elif bf16_product:
        multiple = _measured("TORCH_BF16_DOC_MAJOR_ROW_MULTIPLE")
        doc_major = rows % multiple == 0
        reasons.append(f"orientation: {'document' if doc_major else 'query'}-major similarities "
                       f"({rows} query rows; document-major for the bf16 product on a "
                       f"multiple of {multiple})")
    else:
        ranges = _measured("TORCH_DOC_MAJOR_ROWS")
        doc_major = p.device.type == "cpu" and any(lo <= rows <= hi for lo, hi in ranges)
        reasons.append(f"orientation: {'document' if doc_major else 'query'}-major similarities "
                       f"({rows} query rows; document-major on a CPU for "
                       f"{', '.join(f'{lo}-{hi}' for lo, hi in ranges)})")
    return ForwardPlan("torch", blocks=blocks,
                       doc_major=bool(doc_major) and p.layout in (CROSS, RESIDUAL),
                       bf16_product=bf16_product,
                       reasons=tuple(reasons))


def _plan_residual_forward(p: Problem, o: Options) -> ForwardPlan:
    """PLAID documents on the Triton path: the dense cross product's mapping, the documents
    decompressed tile by tile in the kernel, with tiles of their own (``RESIDUAL_TILES``,
    ``RESIDUAL_CANDIDATE_TILES``, ``RESIDUAL_ROWS``; design.md "PLAID"). The plan keeps the
    PyTorch path's blocks too, for the backward (``grad_Q``), which decompresses a block of
    documents at a time."""
    blocks = _plan_torch_forward(p, o).blocks
    if _forced.get("kernel") == "torch":
        return ForwardPlan("torch", blocks=blocks,
                           reasons=("kernel: forced", "residual layout: the PyTorch path"))
    cfg = _forced.get("fwd_tiles")
    if cfg is None:
        cfg = fwd_heuristic(max(p.Lq, 1), p.dim, max(p.Nq, 1), p.layout == RESIDUAL_CANDIDATES,
                            p.dtype.itemsize)
        if not INTERPRETER and cfg.block_k <= 128:
            block_n, warps, stages, regs = _measured(
                "RESIDUAL_CANDIDATE_TILES" if p.layout == RESIDUAL_CANDIDATES else
                "RESIDUAL_TILES")
            qpb = cfg.queries_per_block
            if p.layout == RESIDUAL:
                rows = _measured("RESIDUAL_ROWS") * 2 // p.dtype.itemsize  # 16-bit rows
                qpb = max(1, min(rows // cfg.lq_tile, pow2(max(p.Nq, 1))))
            cfg = dataclasses.replace(
                cfg, queries_per_block=qpb, block_n=block_n, num_warps=warps, num_stages=stages,
                max_registers=regs)
    return ForwardPlan("triton", cfg, blocks=blocks, reasons=(
        "residual layout: the Triton forward, each document tile decompressed on chip",
        f"tiles: {cfg}"))


def _padding(length: int, block: int) -> float:
    """The share of ``length`` tokens that tiles of ``block`` tokens add as padding."""
    return (cdiv(length, block) * block - length) / max(length, 1)


def _plan_hidden_forward(p: Problem, o: Options) -> ForwardPlan:
    """Hidden-state documents: "fused" (the Triton kernel projects each document tile on chip,
    ``F.linear``'s product in a split-K loop over d_model, and never writes the projection) or
    "unfused" (``F.linear`` once into memory, then the dense plan). The fused kernel projects
    each document tile once per query block and query chunk; the projection is d_model / (rows
    of a block) times the MaxSim product's work, so fused pays only while each tile is projected
    at most ``HIDDEN_FUSED_MAX_PASSES`` times (design.md "Fused projection head")."""
    candidates = p.layout == HIDDEN_CANDIDATES
    cfg = _forced.get("fwd_tiles")
    forced_tiles = cfg is not None
    tiles, short = _measured("HIDDEN_TILES"), _measured("HIDDEN_SHORT_TILES")
    most_padding = _measured("HIDDEN_FUSED_MAX_PADDING")
    padded, why_tiles = _padding(p.Ld, tiles[0]), "HIDDEN_TILES"
    if short is not None and padded > most_padding and _padding(p.Ld, short[0]) < padded:
        # The fused kernel projects the padding too.
        tiles, why_tiles = short, f"HIDDEN_SHORT_TILES (HIDDEN_TILES' pad by {padded:.0%})"
    block_n, hidden_block, warps, stages = tiles
    if cfg is None:
        # The projection's fp32 accumulator [BLOCK_N, d] lives beside the running max: at 4
        # warps the tiles spill for sm_90 and ran 1.3-2.2x slower (NOTES §61).
        cfg = dataclasses.replace(fwd_heuristic(
            max(p.Lq, 1), p.dim, max(p.Nq, 1), candidates, p.dtype.itemsize),
            block_n=block_n, num_warps=warps, num_stages=stages)
    passes = cdiv(max(p.Lq, 1), cfg.lq_tile) * (
        1 if candidates else cdiv(max(p.Nq, 1), cfg.queries_per_block))
    route = _forced.get("hidden_route")
    if route is not None:
        reasons = ["route: forced"]
    elif o.backend == "torch":
        route, reasons = "unfused", ["route: the PyTorch path projects the documents once"]
    else:
        cap, most = _measured("HIDDEN_FUSED_MAX_PASSES"), _measured("HIDDEN_FUSED_MAX_BYTES")
        hidden_bytes = p.Ncols * p.Ld * p.d_model * p.dtype.itemsize * (
            p.Nq if candidates else 1)
        padding = _padding(p.Ld, cfg.block_n)
        route = "fused" if passes <= cap and (
            hidden_bytes <= most or (passes == 1 and padding <= most_padding)) else "unfused"
        reasons = [f"route: {route} (each document tile projected {passes} times fused, "
                   f"{hidden_bytes / 2**20:.0f} MiB of hidden states, tiles padded by "
                   f"{padding:.0%}; fused up to {cap} times and {most / 2**20:.0f} MiB, beyond "
                   f"that once with at most {most_padding:.0%} padding)"]
    if route not in ("fused", "unfused"):
        raise ValueError(f"hidden_route must be 'fused' or 'unfused', got {route!r}")
    if route == "fused" and o.backend == "torch":
        raise ValueError("hidden_route='fused' needs the Triton backend")
    return ForwardPlan("triton" if route == "fused" else "torch", cfg, hidden_route=route,
                       hidden_block=hidden_block, reasons=tuple(reasons) + (
                           f"tiles: {'forced' if forced_tiles else why_tiles}, {cfg}",))


def _plan_forward(p: Problem, o: Options) -> ForwardPlan:
    if p.layout in HIDDEN_LAYOUTS:
        return _plan_hidden_forward(p, o)
    if o.backend == "torch":
        return _plan_torch_forward(p, o)
    if p.layout in RESIDUAL_LAYOUTS:
        return _plan_residual_forward(p, o)
    forced_kernel = _forced.get("kernel")
    packed = p.layout in (PACKED, PAIRS)
    per_query_docs = p.layout in (CANDIDATES, PAIRS)
    elem_bytes = p.dtype.itemsize
    Nq, Lq = max(p.Nq, 1), max(p.Lq, 1)
    sms = sm_count(p.device)
    reasons = []
    cfg = _forced.get("fwd_tiles")
    if cfg is not None:
        reasons.append("tiles: forced")
    else:
        cfg = fwd_heuristic(Lq, p.dim, Nq, per_query_docs, elem_bytes)
        reasons.append("tiles: the default for this query-length bucket")
        # The measured variants (Hopper, dense, not the smooth max: its were not measured).
        if not INTERPRETER and not packed and not p.tau and measured_tiles(p.device):
            varied = fwd_variant(
                cfg, few_programs=few_programs(p.Nq, cfg.queries_per_block, p.Ncols, sms),
                save_argmax=p.save_argmax, norm_from_tiles=p.norm_from_tiles,
                per_query_docs=per_query_docs, elem_bytes=elem_bytes)
            if varied != cfg:
                cfg = varied
                reasons.append("tiles: a measured Hopper variant")
    if p.layout == PAIRS and cfg.queries_per_block != 1:
        cfg = dataclasses.replace(cfg, queries_per_block=1)
    max_grid_y = _forced.get("max_grid_y", MAX_GRID_Y)
    if packed:
        return ForwardPlan("triton", cfg, 1, max_grid_y,
                           reasons=(*reasons, "kernel: the packed Triton kernel"))

    splits = _forced.get("splits")
    if splits is None:
        splits = chunk_splits(Lq, cfg.lq_tile, p.Nq, p.Ncols, per_query_docs)
    reasons.append(f"splits: {splits} program(s) share a (document, query block)'s chunks")
    if forced_kernel == "gluon":
        refusal = None
    elif forced_kernel == "triton" or _forced.get("fwd_tiles") is not None:
        refusal = "forced"
    else:
        refusal = _gluon_refusal(p, o, cfg)
    hopper = None
    if refusal is None:
        hopper = _plan_hopper(p, o, cfg, sms)
        if isinstance(hopper, str):
            refusal, hopper = hopper, None
    if hopper is not None:
        reasons.append("kernel: the Gluon (Hopper) forward")
        return ForwardPlan("gluon", cfg, hopper[1], max_grid_y, hopper[0],
                           reasons=tuple(reasons))
    reasons.append(f"kernel: Triton ({refusal})")
    autotune = o.autotune and p.device.type == "cuda" and not _forced
    return ForwardPlan("triton", cfg, splits, max_grid_y, autotune=autotune,
                       reasons=tuple(reasons))


def _plan_hopper(p: Problem, o: Options, cfg: FwdConfig, sms: int):
    """(HopperTiles, splits), or why the argmax cannot be saved by the Gluon forward."""
    qpb = hopper_block(cfg).queries_per_block
    splits = _forced.get("splits")
    if splits is None:
        splits = chunk_splits(p.Lq, cfg.lq_tile, p.Nq, p.Ncols, False)
    blocks = cdiv(p.Nq, qpb)
    tiles = _forced.get("hopper_tiles")
    if tiles is None:
        tiles = hopper_tiles(cfg, p.norm_from_tiles, p.Ncols * splits * blocks, sms)
    if p.save_argmax and (o.exact_ties or cdiv(p.Ld, tiles[0]) > _hopper_code_limit()):
        # Its coded max decides near-ties by tile; a pass's tiles must fit the codes.
        return "the argmax needs exact ties or more tile codes than the Gluon forward carries"
    docs = hopper_docs_per_program(tiles, p.Lq, cfg.lq_tile, p.Ld, p.Ncols, blocks, sms,
                                   p.norm_from_tiles)
    tiles_first = _forced.get("tiles_first")
    if tiles_first is None:
        # Documents beyond L2 come from DRAM: request a pass's first tiles before its query
        # chunk there, not where they stay in L2 (design.md "Hopper").
        tiles_first = p.Ncols * p.Ld * p.dim * p.dtype.itemsize > l2_bytes(p.device)
    template = _forced.get("descriptor_template", True)
    return HopperTiles(tiles, qpb, docs, tiles_first, template), splits


_forward_plans: dict = {}


def forced_key() -> str:
    """The decisions forced now, as a key for what caches work planned under them (a CUDA
    graph captures the plans of its calls)."""
    return repr(sorted(_forced.items()))


def _cached(cache: dict, key, p: Problem, make, *args):
    """``make(*args)``: a plan, cached under ``key`` (at most 4096 kept; none while decisions are
    forced), and recorded for ``recording()``."""
    if _forced:
        plan = make(*args)
    else:
        plan = cache.get(key)
        if plan is None:
            if len(cache) >= 4096:
                cache.clear()
            plan = cache[key] = make(*args)
    if _recording is not None:
        _recording.append((p, plan))
    return plan


def plan_forward(p: Problem, o: Options) -> ForwardPlan:
    """The forward's plan for ``p`` under ``o`` (cached; not while decisions are forced)."""
    return _cached(_forward_plans, (p, o), p, _plan_forward, p, o)


# ------------------------------------------------------------------------------------------------
# Backward
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """How a backward runs. ``kernel``: ``"torch"``, ``"triton"`` or ``"smooth"`` (the smooth
    max's recomputing kernel); the projection head's: ``"entries"``, ``"tiles"`` or
    ``"torch"`` (``plan_hidden_backward``). ``strategy``: ``"unified"`` (gather + fp32 atomics
    for grad_D) or ``"lowmem"`` (row-owned grad_Q, document-owned grad_D). The rest says how
    the Triton backward is split and chunked; see :func:`plan_backward`."""

    kernel: str
    strategy: str
    tiles: BwdConfig | None = None
    # The gather (grad_Q, and in "unified" the scatter of grad_D):
    gather_splits: int = 1  # column splits of the first gather
    split_cap: int = 1  # column splits of each chunk's gather, at most its columns
    gather_step: tuple = (1, None)  # (columns a step, warps or None) of the first gather
    atomic_q: bool = False  # grad_Q accumulated in fp32 with atomics (splits > 1)
    # The unified grad_D: columns a chunk of the fp32 buffer (all columns: one buffer).
    scatter_chunk_cols: int = 0
    drain_block: int = 4096
    # The document-owned grad_D (lowmem):
    winner_index: bool = False
    index_cols: int = 0
    index_tiles: int = 1
    index_scan: int = 1024
    index_scan_tokens: int = 128
    index_row_dtype: torch.dtype = torch.int32
    rows_in_one_block: bool = False
    dd_tiles_per_program: int = 1
    dd_scan_stages: int = 1
    block_r: int = 0  # the packed layouts' one-hot rows
    # The projection head: columns a chunk; the closed form (PyTorch) recomputes a chunk's
    # winners one row an entry or every row; the Triton rows kernel's d_model a step, the
    # weight kernel's tiles (buffer rows a step, d_model columns a program, warps, stages) and
    # its groups.
    hidden_cols: int = 0
    hidden_by_entry: bool = False
    hidden_block: int = 0
    weight_tiles: tuple = ()
    weight_groups: int = 0
    reasons: tuple[str, ...] = ()


def refuse_nondeterministic(strategy: str) -> None:
    """``backward="unified"`` under ``torch.use_deterministic_algorithms(True)``: raise (or warn
    in warn-only mode), as PyTorch does for its own nondeterministic operations."""
    if strategy != "unified" or not torch.are_deterministic_algorithms_enabled():
        return
    message = (
        "backward='unified' uses fp32 atomics and is not deterministic, but "
        "torch.use_deterministic_algorithms(True) is set; use backward='lowmem' or 'auto'"
    )
    if torch.is_deterministic_algorithms_warn_only_enabled():
        import warnings

        warnings.warn(message, stacklevel=5)
    else:
        raise RuntimeError(message)


def resolve_strategy(p: Problem, strategy: str, deterministic: bool) -> tuple[str, str]:
    """The backward strategy for ``auto`` and why (design.md "Backward strategies").

    Dense layouts, measured on the H200: per-query candidates share no document, and there the
    document-owned products win; small problems go by host time; 16-bit cross products from
    ``LOWMEM_CROSS_MACS`` up are bound by the GPU, where lowmem is as fast and reproducible;
    in between, unified's atomic scatter. Packed layouts: unified (its split gather keeps the
    GPU busy when few queries own many pairs)."""
    forced = _forced.get("strategy")
    if forced is not None:
        return forced, "strategy: forced"
    if strategy != "auto":
        return strategy, f"strategy: {strategy} as asked"
    if deterministic:
        return "lowmem", "strategy: lowmem, deterministic algorithms are on"
    if p.layout in (PACKED, PAIRS):
        return "unified", "strategy: unified, the packed layouts' split gather"
    macs = p.Nq * p.Ncols * p.Lq * p.Ld * p.dim
    if p.layout == CANDIDATES:
        return "lowmem", "strategy: lowmem, per-query candidates share no document"
    if macs <= _measured("HOST_BOUND_MACS"):
        return "lowmem", "strategy: lowmem, at most HOST_BOUND_MACS (host-bound)"
    if p.dtype.itemsize == 2 and macs >= _measured("LOWMEM_CROSS_MACS"):
        return "lowmem", "strategy: lowmem, a 16-bit cross product from LOWMEM_CROSS_MACS up"
    return "unified", "strategy: unified, between the host- and GPU-bound sizes"


def gather_step(programs: int, sms: int, scatters: bool) -> tuple[int, int | None]:
    """``(columns a step, warps)`` of the gather kernel (None: the tiles' warps). A column's two
    loads wait on each other; with fewer than four programs an SM too few warps run to cover
    that wait, so several columns' loads go out together. A gather that also scatters grad_D
    takes one column a step (design.md "Backward: gather")."""
    forced = _forced.get("gather_step")
    if forced is not None:
        return forced
    if scatters:
        return 1, None
    if programs < 2 * sms:
        return _measured("GATHER_FEW_PROGRAMS_STEP")
    if programs < 4 * sms:
        return _measured("GATHER_SMALL_GRID_STEP")
    return 1, None


def column_splits(row_programs: int, n_cols: int, sms: int, max_grid_y: int) -> int:
    """Column splits that give a gather grid of ``row_programs`` about four programs an SM."""
    target = 4 * sms
    if row_programs >= target or not (row_programs and n_cols):
        return 1
    return max(1, min(n_cols, cdiv(target, row_programs), max_grid_y))


def scatter_chunk_cols(Ncols: int, numel: int, elem_bytes: int, fp32_grad: bool) -> int:
    """Columns a chunk of the unified backward's fp32 grad_D buffer: all of them while the
    buffer is the output (fp32 gradients) or small; else at most ``1 / SCATTER_BUFFER_SHARE`` of
    grad_D's own bytes a chunk (design.md "Backward strategies")."""
    forced = _forced.get("scatter_chunk_cols")
    if forced is not None:
        return min(forced, Ncols)
    if fp32_grad or numel * 4 <= _measured("SCATTER_BUFFER_MAX_BYTES"):
        return Ncols
    column_bytes = numel // Ncols * 4
    budget = numel * elem_bytes // _measured("SCATTER_BUFFER_SHARE")
    return max(1, min(Ncols, budget // column_bytes))


def index_row_dtype(Nq: int, Lq: int) -> torch.dtype:
    """The winner index's row numbers: int16 where every (query, query token) row fits, which
    halves the index."""
    forced = _forced.get("index_row_dtype")
    if forced is not None:
        return forced
    return torch.int16 if Nq * Lq <= 1 << 15 else torch.int32


def winner_index_cols(Nq: int, Lq: int, Ncols: int, n_tiles: int, grad_d_bytes: int,
                      row_dtype: torch.dtype) -> int:
    """Columns a chunk of the winner index (its rows and int32 tile counts), at most
    ``1 / INDEX_SHARE`` of grad_D's bytes, the chunks as even as their count allows."""
    forced = _forced.get("index_cols")
    if forced is not None:
        return min(forced, Ncols)
    column_bytes = row_dtype.itemsize * Nq * Lq + 4 * n_tiles
    budget = grad_d_bytes // _measured("INDEX_SHARE")
    most = max(1, min(Ncols, budget // column_bytes))
    return cdiv(Ncols, cdiv(Ncols, most))


def index_tiles(n_tiles: int, Nq: int, Lq: int, scan_tokens: int, scan: int) -> int:
    """Token tiles a winner-index program takes in one scan of its column: up to
    ``INDEX_TILES`` (four 16-bit fields of an int64), one where a column takes ``2^16`` steps
    or more (a field's count per entry slot would overflow)."""
    forced = _forced.get("index_tiles")
    if forced is not None:
        return forced
    steps = cdiv(Lq, scan_tokens) * cdiv(Nq, max(1, scan // scan_tokens))
    if steps >= 1 << 16:
        return 1
    return min(_measured("INDEX_TILES"), pow2(n_tiles))


def dd_tiles_per_program(Ld: int, block_t: int, documents: int, sms: int,
                         rows_in_one_block: bool) -> int:
    """Token tiles a program of the document-owned grad_D: one, unless its rows are loaded
    once for all its tiles; then as many as keep about four programs an SM."""
    tiles = cdiv(Ld, block_t)
    if not rows_in_one_block or tiles <= 1 or not documents:
        return 1
    return cdiv(tiles, min(tiles, cdiv(4 * sms, documents)))


def _plan_backward(p: Problem, o: Options, need_q: bool, need_d: bool, strategy: str,
                   deterministic: bool, tiles: BwdConfig | None = None) -> BackwardPlan:
    strategy, why = resolve_strategy(p, strategy, deterministic)
    reasons = [why]
    if o.backend == "torch" or p.layout in RESIDUAL_LAYOUTS:
        return BackwardPlan("torch", strategy, reasons=(*reasons, "kernel: the PyTorch path"))
    per_query_docs = p.layout in (CANDIDATES, PAIRS)
    Lq = max(p.Lq, 1)
    if p.tau:
        tiles = _forced.get("bwd_tiles") or smooth_bwd_heuristic(Lq, p.dim)
        return BackwardPlan("smooth", strategy, tiles,
                            reasons=(*reasons, "kernel: the smooth max's recomputing backward"))
    tiles = _forced.get("bwd_tiles") or tiles or bwd_heuristic(Lq, p.dim, p.dtype.itemsize,
                                                                per_query_docs)
    sms = sm_count(p.device)
    max_grid_y = _forced.get("max_grid_y", MAX_GRID_Y)
    unified = strategy == "unified"
    scan_stages = _measured("DD_SCAN_STAGES")
    if p.layout in (PACKED, PAIRS):
        n_sblocks = cdiv(Lq, tiles.block_s)
        splits = 1
        if unified and p.Nq > 0:
            programs = p.Nq * n_sblocks
            per_query = p.Ncols if p.layout == PACKED else cdiv(p.Ncols, p.Nq)
            if programs < 4 * sms:
                splits = max(1, min(per_query, cdiv(4 * sms, programs), max_grid_y))
        block_r = tiles.block_r
        if p.layout == PAIRS:
            block_r = min(tiles.block_r, max(16, pow2(Lq)))  # the pair's own query is all rows
        reasons.append(f"gather: {splits} split(s) over the pairs")
        if unified and need_d:
            reasons.append("grad_D: one fp32 buffer of all of grad_D (the packed gather kernel "
                           "takes no column range, so it is not chunked as the dense one is)")
        elif need_d:
            reasons.append("grad_D: document-owned, every token tile scanning its rows (the "
                           "packed kernel has no winner index and no fp16 g scaling yet)")
        return BackwardPlan(
            "triton", strategy, tiles, gather_splits=splits, atomic_q=splits > 1,
            dd_scan_stages=scan_stages, block_r=block_r, reasons=tuple(reasons))

    Nq, Ncols, Ld, dim = p.Nq, p.Ncols, p.Ld, p.dim
    d_numel = (Nq if per_query_docs else 1) * Ncols * Ld * dim
    scatter_d = unified and need_d
    fp32_grad = p.normalize or p.dtype == torch.float32
    chunk_cols = scatter_chunk_cols(Ncols, d_numel, p.dtype.itemsize, fp32_grad) if scatter_d \
        else Ncols
    one_buffer = scatter_d and chunk_cols == Ncols
    row_programs = Nq * cdiv(Lq, tiles.block_s)
    split_cap = column_splits(row_programs, Ncols, sms, max_grid_y)
    splits = 1
    if need_q or one_buffer:
        # Splitting the documents over programs needs an fp32 grad_Q buffer (atomics, a zero
        # fill and a cast): where grad_Q is computed, worth it only when the grid would
        # otherwise leave the GPU idle on real work.
        if unified and (not need_q or Nq * Ncols * Lq >= 1 << 20):
            splits = split_cap
        reasons.append(f"gather: {splits} column split(s)")
    if one_buffer:
        reasons.append("grad_D: one fp32 buffer, cast at the end")
    elif scatter_d:
        reasons.append(f"grad_D: fp32 buffer chunks of {chunk_cols} column(s)")
    step = gather_step(row_programs * cdiv(Ncols, max(1, cdiv(Ncols, splits))), sms, one_buffer)
    plan = dict(
        gather_splits=splits, split_cap=split_cap, gather_step=step,
        atomic_q=need_q and splits > 1, scatter_chunk_cols=chunk_cols,
        drain_block=_measured("DRAIN_BLOCK"), dd_scan_stages=scan_stages,
        index_scan=_measured("INDEX_SCAN"),
    )
    if need_d and not unified:
        rows_in_one_block = per_query_docs and Lq <= tiles.block_r
        groups = Nq if per_query_docs else 1
        plan["rows_in_one_block"] = rows_in_one_block
        index = _forced.get("winner_index")
        if index is None:
            index = (not per_query_docs and Ld > tiles.block_t
                     and Nq * Ncols * Lq * Ld * dim > _measured("INDEX_MIN_MACS"))
        if index:
            n_tiles = cdiv(Ld, tiles.block_t)
            row_dtype = index_row_dtype(Nq, Lq)
            scan = plan["index_scan"]
            scan_tokens = min(pow2(Lq), _measured("INDEX_SCAN_TOKENS"))
            plan.update(
                winner_index=True, index_row_dtype=row_dtype, index_scan_tokens=scan_tokens,
                index_cols=winner_index_cols(Nq, Lq, Ncols, n_tiles,
                                             d_numel * p.dtype.itemsize, row_dtype),
                index_tiles=index_tiles(n_tiles, Nq, Lq, scan_tokens, scan),
            )
            reasons.append(f"grad_D: document-owned through the winner index, "
                           f"{plan['index_cols']} column(s) a chunk")
        else:
            plan["dd_tiles_per_program"] = dd_tiles_per_program(
                Ld, tiles.block_t, groups * Ncols, sms, rows_in_one_block)
            reasons.append("grad_D: document-owned, every token tile scanning its rows")
    return BackwardPlan("triton", strategy, tiles, reasons=tuple(reasons), **plan)


_backward_plans: dict = {}


def plan_backward(p: Problem, o: Options, need_q: bool, need_d: bool,
                  strategy: str) -> BackwardPlan:
    """The backward's plan (cached; not while decisions are forced). ``strategy`` is the
    caller's ``backward=`` (``"auto"``, ``"unified"`` or ``"lowmem"``); ``unified`` under
    deterministic algorithms is refused here, on every call."""
    refuse_nondeterministic(strategy)
    deterministic = torch.are_deterministic_algorithms_enabled()
    return _cached(_backward_plans, (p, o, need_q, need_d, strategy, deterministic), p,
                   _plan_backward, p, o, need_q, need_d, strategy, deterministic)


def _plan_hidden_backward(p: Problem, o: Options, need_q: bool, mixed: bool) -> BackwardPlan:
    kernel = _forced.get("hidden_bwd_kernel")
    forced = kernel is not None
    # A document's (query, query token) entries (per-query candidates: a document meets its own
    # query only) against its tokens.
    entries = (1 if p.layout == HIDDEN_CANDIDATES else p.Nq) * p.Lq
    if not forced:
        kernel = ("torch" if (o.backend == "torch" or p.dtype == torch.float64 or mixed)
                  else "entries" if entries * _measured("HIDDEN_BWD_ENTRY_SHARE") < p.Ld
                  else "tiles")
    if kernel not in ("entries", "tiles", "torch"):
        raise ValueError(f"hidden_bwd_kernel must be 'entries', 'tiles' or 'torch', got "
                         f"{kernel!r}")
    if kernel == "torch":
        if forced:
            why = "forced"
        elif mixed:
            why = "Q and H_d of different dtypes"
        else:
            why = f"backend {o.backend}, {p.dtype}"
        return _plan_hidden_closed_form(p, o.torch_block_bytes, why)
    if o.backend != "triton" or p.dtype == torch.float64 or mixed:
        raise ValueError(f"hidden_bwd_kernel={kernel!r} needs the Triton backend, fp16, bf16 "
                         "or fp32 inputs, and Q and H_d of one dtype")
    per_query = p.layout == HIDDEN_CANDIDATES
    why = "forced" if forced else (
        f"{entries} query tokens a document "
        f"{'<' if kernel == 'entries' else '>='} its {p.Ld} / HIDDEN_BWD_ENTRY_SHARE")
    groups = p.Nq if per_query else 1
    if kernel == "entries":
        # One program a document's block of entries; the buffers hold an entry's token and
        # grad_P, and for grad_Q its g · P̂ in fp32.
        # Wider rows than 128 hold proportionally fewer entries (the fp32 sums of a block's
        # rows stay within the registers of d = 128).
        block_e, warps, stages = _measured("HIDDEN_ENTRY_TILES")
        block_k = block_k_for(p.dim)
        block_e = max(16, block_e * 128 // max(block_k, 128))
        tiles = BwdConfig(0, min(block_e, max(16, pow2(entries))), 0, block_k, warps, stages)
        base = BackwardPlan("entries", "lowmem", tiles)
        col_rows = entries
        column_bytes = groups * entries * (4 + p.dim * (p.dtype.itemsize + (4 if need_q else 0)))
        reasons = [f"projection head: one program a block of {tiles.block_t} of a document's "
                   f"entries ({why})"]
    else:
        dense = p._replace(layout=CANDIDATES if per_query else CROSS, d_model=0, has_bias=False,
                           normalize=False, norm_from_tiles=False)
        # The rows kernel projects a token tile and writes its grad_H rows: the document-owned
        # backward's tiles with the head's token tile, warps and pipeline stages.
        block_t, warps, stages = _measured("HIDDEN_BWD_TILES")
        tiles = dataclasses.replace(
            bwd_heuristic(max(p.Lq, 1), p.dim, p.dtype.itemsize, per_query), block_t=block_t,
            num_warps=warps, num_stages=stages)
        base = dataclasses.replace(_plan_backward(dense, o, need_q, True, "lowmem", True, tiles),
                                   kernel="tiles")
        col_rows = p.Ld
        # A column's row buffers: token and grad_P, and for grad_Q the projection and its
        # inverse norms.
        column_bytes = groups * p.Ld * (4 + p.dim * p.dtype.itemsize * (2 if need_q else 1)
                                        + (4 if need_q and p.normalize else 0))
        reasons = [f"projection head: token tiles that hold a winner projected ({why})",
                   *base.reasons[1:]]
    hidden_bytes = groups * p.Ncols * p.Ld * p.d_model * p.dtype.itemsize
    budget = max(hidden_bytes // _measured("HIDDEN_BWD_BUFFER_SHARE"),
                 _measured("HIDDEN_BWD_MIN_BUFFER_BYTES"))
    cols = max(1, min(max(p.Ncols, 1), budget // max(1, column_bytes)))
    if base.winner_index:
        cols = min(cols, base.index_cols)
    cols = cdiv(max(p.Ncols, 1), cdiv(max(p.Ncols, 1), cols))  # chunks as even as they go
    weight_tiles = _measured("HIDDEN_WEIGHT_TILES")
    block_t, block_c = weight_tiles[:2]
    row_tiles = cdiv(groups * cols * col_rows, block_t)
    partial_bytes = p.dim * p.d_model * 4
    weight_groups = max(1, min(
        row_tiles,
        cdiv(_measured("HIDDEN_WEIGHT_WAVES") * sm_count(p.device), cdiv(p.d_model, block_c)),
        hidden_bytes // _measured("HIDDEN_WEIGHT_PARTIAL_SHARE") // partial_bytes))
    reasons.append(f"{cols} column(s) a chunk of buffers, grad_W in {weight_groups} fp32 "
                   f"partial(s)")
    return dataclasses.replace(
        base, index_cols=cols, hidden_cols=cols, hidden_block=_measured("HIDDEN_TILES")[1],
        weight_tiles=weight_tiles, weight_groups=weight_groups, reasons=tuple(reasons))


def _plan_hidden_closed_form(p: Problem, block_bytes: int, why: str) -> BackwardPlan:
    per_query = p.layout == HIDDEN_CANDIDATES
    # A column's entries (query, query token) and rows (document tokens; Nq documents of
    # per-query candidates).
    entries_col, rows_col = p.Nq * p.Lq, (p.Nq if per_query else 1) * p.Ld
    by_entry = _forced.get("hidden_by_entry")
    forced = by_entry is not None
    if not forced:
        by_entry = entries_col < rows_col
    # Bytes a recomputed row holds: H's row in its dtype and in fp32, and a few fp32 rows of d.
    per_row = p.d_model * (p.dtype.itemsize + 4) + 16 * p.dim
    rows = entries_col if by_entry else rows_col
    cols = max(1, min(max(p.Ncols, 1), block_bytes // max(1, rows * per_row)))
    how = "forced" if forced else (
        f"{entries_col} entries {'<' if by_entry else '>='} {rows_col} rows a column")
    return BackwardPlan("torch", "lowmem", hidden_cols=cols, hidden_by_entry=bool(by_entry),
                        reasons=(f"projection head: the PyTorch closed form ({why}), "
                                 f"{'winners one row an entry' if by_entry else 'every row'} "
                                 f"({how}), {cols} columns a chunk within {block_bytes} bytes",))


def plan_hidden_backward(p: Problem, o: Options, need_q: bool, mixed: bool) -> BackwardPlan:
    """The projection head's backward. Where the backend is Triton and Q and H_d share a 16-bit
    or fp32 dtype, the Triton kernels (``_launch.backward.backward_hidden``): ``"entries"``
    (one program a block of a document's (query, query token) entries) where a document's
    query tokens are fewer than its tokens / ``HIDDEN_BWD_ENTRY_SHARE``, else ``"tiles"`` (the
    document-owned backward's plan for the projected documents with the head's tiles); both
    with columns a chunk within the buffers' budget and grad_W's partials. Otherwise the
    PyTorch closed form (``_torch_path.hidden_bwd_torch``: a chunk of documents with fewer
    (query, token) entries than document rows recomputes each entry's winner, otherwise every
    row; chunks within ``o.torch_block_bytes``). Cached; design.md "Fused projection head"."""
    return _cached(_backward_plans, ("hidden", p, o, need_q, mixed), p, _plan_hidden_backward,
                   p, o, need_q, mixed)


def explain_plans(p: Problem, o: Options, strategy: str = "auto") -> str:
    """The forward's and (where the argmax is saved) the backward's plan, in words."""
    fwd = plan_forward(p, o)
    lines = [f"problem: {p.describe()}", f"options: {o.describe()}",
             f"forward: {fwd.kernel}"]
    if fwd.tiles is not None:
        lines.append(f"  tiles: {fwd.tiles}")
    if fwd.hopper is not None:
        lines.append(f"  gluon: {fwd.hopper}")
    lines += [f"  - {r}" for r in fwd.reasons]
    if p.save_argmax:
        bwd = plan_backward(p, o, True, True, strategy)
        lines.append(f"backward: {bwd.kernel}, {bwd.strategy}")
        if bwd.tiles is not None:
            lines.append(f"  tiles: {bwd.tiles}")
        lines += [f"  - {r}" for r in bwd.reasons]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# PLAID approximate scores (plaid_approx_score): tiles of the gather kernel, or the PyTorch path
# ------------------------------------------------------------------------------------------------

# Measured only in part (APPROX_TILE_ELEMS, by `python3 benchmarks/probes approx_tiles`; the
# interpreter's are small so that tests cross tiles and query chunks; warps and stages were
# within noise of the best at two of three one-query shapes). A program's [tokens, queries ·
# query tokens] tile of gathered centroid scores holds about APPROX_TILE_ELEMS values; its
# columns are at most APPROX_MAX_COLUMNS (queries sharing a program, each padded to its chunk of
# at most APPROX_MAX_LQ_TILE query tokens); its tokens between APPROX_BLOCK_T's bounds.
MEASURED.update({
    # 2048: 64 tokens a step at one query, 1.19-1.23x faster than 128 at two of three shapes
    # (NOTES §65); 32 queries keep the lower bound's 16 tokens (64 ran 1.5x slower there).
    "APPROX_TILE_ELEMS": 256 if INTERPRETER else 2048,
    "APPROX_MAX_COLUMNS": 32 if INTERPRETER else 256,
    "APPROX_MAX_LQ_TILE": 16 if INTERPRETER else 128,
    "APPROX_BLOCK_T": (8, 128) if INTERPRETER else (16, 128),
    # Hits (the search's candidates): programs an SM in all, and documents whose hits a program
    # ranks at a time (`python3 benchmarks/probes approx_hits`, NOTES §67): against 32, 64 ran
    # 4-21% faster at all four shapes (100k clustered and 1M random documents, 1 and 32
    # queries: a program's share of the hits varies, and smaller shares even the tail out);
    # 256-512 gained 5-8% more at three of them, with 4-8x the programs at small corpora. 64 and
    # 128 documents a step within 1.5% of each other, 16-32 up to 10% slower.
    "APPROX_HIT_WAVES": 64,
    "APPROX_HIT_BLOCK": 8 if INTERPRETER else 128,
})
# approx_tiles: an ApproxTiles; approx_launch_queries: queries a launch of the approx kernel;
# approx_slot_programs: programs a query of hits.
FORCIBLE = FORCIBLE | {"approx_tiles", "approx_launch_queries", "approx_slot_programs"}

MAX_PROGRAMS = 2**31 - 1  # CUDA's limit on a grid's first axis


@dataclasses.dataclass(frozen=True)
class ApproxTiles:
    """The approx kernel's tiles: ``lq_tile`` query tokens a chunk (a power of two; longer
    queries are walked in chunks by a run-time loop), ``queries_per_block`` queries a program
    (1 for per-query candidates), ``block_t`` document tokens a step."""

    lq_tile: int
    queries_per_block: int
    block_t: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class ApproxPlan:
    """How ``plaid_approx_score`` runs. ``kernel``: ``"triton"`` (``kernels.approx``) or
    ``"torch"`` (``_torch_path.approx_scores_torch``); ``tiles``: the kernel's;
    ``launch_queries``: queries a launch (its 1-D grid stays within CUDA's limit);
    ``torch_block_elems``: the PyTorch path's bound on the centroid scores gathered at a time;
    ``slot_programs``: programs a query of hits (each walks its share of the corpus, in steps of
    ``hit_block`` documents)."""

    kernel: str
    tiles: ApproxTiles | None = None
    launch_queries: int = 1
    torch_block_elems: int = 0
    slot_programs: int = 0
    hit_block: int = 0
    reasons: tuple[str, ...] = ()


def approx_tiles(Lq: int, Nq: int, candidates: bool, interp: bool = INTERPRETER) -> ApproxTiles:
    """The approx kernel's tiles for a query-length bucket (measured in part; see MEASURED): the
    whole query a chunk up to ``APPROX_MAX_LQ_TILE`` tokens, as many queries a program as
    ``APPROX_MAX_COLUMNS`` allows (the cross product: a document's ids are then read once for
    them all), tokens filling ``APPROX_TILE_ELEMS``."""
    lq_tile = min(max(4, pow2(Lq)), _measured("APPROX_MAX_LQ_TILE"))
    qpb = 1
    if not candidates:
        qpb = min(pow2(max(Nq, 1)), max(1, _measured("APPROX_MAX_COLUMNS") // lq_tile))
    low, high = _measured("APPROX_BLOCK_T")
    block_t = min(high, max(low, _measured("APPROX_TILE_ELEMS") // (qpb * lq_tile)))
    return ApproxTiles(lq_tile, qpb, block_t, 4, 1 if interp else 2)


def _plan_approx(p: Problem, o: Options) -> ApproxPlan:
    # The PyTorch path's gathered scores, in the compute dtype.
    budget = max(1, o.torch_block_bytes // (8 if p.dtype == torch.float64 else 4))
    forced = _forced.get("kernel")
    if o.backend == "torch" or forced == "torch":
        why = "kernel: forced" if o.backend != "torch" else "backend: the PyTorch path"
        return ApproxPlan("torch", torch_block_elems=budget, reasons=(
            why, f"blocks of documents of at most {budget} gathered centroid scores"))
    candidates = p.layout in (APPROX_CANDIDATES, APPROX_HITS)
    tiles = _forced.get("approx_tiles")
    reasons = ["kernel: the Triton gather kernel (kernels.approx)"]
    if tiles is None:
        # The tiles depend on the query-length bucket and (cross product) on Nq up to a block.
        tiles = approx_tiles(max(p.Lq, 1), p.Nq, candidates)
        reasons.append(f"tiles: for Lq={p.Lq}, "
                       f"{'per-query candidates' if candidates else f'Nq={p.Nq}'}")
    else:
        reasons.append("tiles: forced")
    slots = hit_block = 0
    if p.layout == APPROX_HITS:
        # About APPROX_HIT_WAVES programs an SM in all, however wide the corpus: a program of
        # no hit is not free (NOTES §59: 1.8 ns each).
        slots = _forced.get("approx_slot_programs") or max(1, min(
            max(p.Ncols, 1),
            _measured("APPROX_HIT_WAVES") * sm_count(p.device) // max(p.Nq, 1)))
        hit_block = _measured("APPROX_HIT_BLOCK")
        reasons.append(f"{slots} programs a query, each a {slots}-th of the corpus in steps of "
                       f"{hit_block} documents")
    launch = _forced.get("approx_launch_queries")
    if launch is None:
        # Programs: the queries' candidates (or slot programs), or the documents for each block
        # of queries.
        launch = MAX_PROGRAMS // max(1, slots or p.Ncols)
        if not candidates:
            launch *= tiles.queries_per_block
    launch = max(1, launch)
    reasons.append(f"{launch} queries a launch (1-D grid of at most {MAX_PROGRAMS} programs)")
    return ApproxPlan("triton", tiles, launch, budget, slots, hit_block, tuple(reasons))


_approx_plans: dict = {}


def plan_approx(p: Problem, o: Options) -> ApproxPlan:
    """The plan of a PLAID approximate score (``p.layout`` ``approx`` or ``approx candidates``),
    cached on ``(p, o)`` (not while decisions are forced); ``recording()`` collects it."""
    return _cached(_approx_plans, (p, o), p, _plan_approx, p, o)


__all__ += ["ApproxPlan", "ApproxTiles", "approx_tiles", "plan_approx"]


# ------------------------------------------------------------------------------------------------
# PLAID search: the probe (the candidate documents of the probed cells, as a bitmap)
# ------------------------------------------------------------------------------------------------

MEASURED.update({
    # Not measured: a memory bound. The PyTorch path gathers the probed inverted lists of a
    # block of queries at a time, [queries, probed cells, longest list] ids (int64), at most
    # this many.
    "PROBE_GATHER_IDS": 1 << 24,
    # Not measured: list entries a program of the Triton probe reads a step (lists hold about
    # 100-1000 documents on the search bench's corpora).
    "PROBE_BLOCK": 16 if INTERPRETER else 256,
})


@dataclasses.dataclass(frozen=True)
class ProbePlan:
    """How the search's probe runs: ``kernel`` ``"triton"`` (``kernels.probe``: a program a
    probed cell, ``block`` list entries a step, ``launch_queries`` queries a launch, its warps
    and stages) or ``"torch"`` (``_torch_path.probe_torch``: ``launch_queries`` queries' lists
    gathered at a time)."""

    kernel: str
    launch_queries: int
    block: int = 0
    num_warps: int = 4
    num_stages: int = 1
    reasons: tuple[str, ...] = ()


def _plan_probe(p: Problem, o: Options) -> ProbePlan:
    cells, longest = p.Lq, p.Ld
    if o.backend == "torch" or _forced.get("kernel") == "torch":
        why = "kernel: forced" if o.backend != "torch" else "backend: the PyTorch path"
        launch = max(1, _measured("PROBE_GATHER_IDS") // max(1, cells * longest))
        return ProbePlan("torch", launch, reasons=(
            why, f"{launch} queries' lists gathered at a time ({cells} cells of at most "
            f"{longest} documents a query; PROBE_GATHER_IDS)"))
    block = _measured("PROBE_BLOCK")
    launch = max(1, MAX_PROGRAMS // max(1, cells))
    return ProbePlan("triton", launch, block, 4, 1, (
        "kernel: the Triton probe (kernels.probe), a program a probed cell",
        f"{block} list entries a step (PROBE_BLOCK)",
        f"{launch} queries a launch (1-D grid of at most {MAX_PROGRAMS} programs)"))


_probe_plans: dict = {}


def plan_probe(p: Problem, o: Options) -> ProbePlan:
    """The plan of the search's probe (``p.layout`` ``ivf probe``), cached on ``(p, o)`` (not
    while decisions are forced); ``recording()`` collects it."""
    return _cached(_probe_plans, (p, o), p, _plan_probe, p, o)


__all__ += ["ProbePlan", "plan_probe"]

