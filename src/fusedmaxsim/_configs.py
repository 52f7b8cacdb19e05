"""Launch configurations: one analytical choice per shape, never a sweep on the default path.

A configuration depends only on the query-length bucket, the embedding dim, the layout and the
device class, so a new ``Nq``, ``Nd`` or ``Ld`` (or a query length in the same bucket) reuses the
compiled kernel. Tests force other configurations with :func:`forced_configs` so that every tile
path runs under the single-configuration interpreter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterator

import torch
import triton

__all__ = [
    "FwdConfig", "BwdConfig", "argmax_dtype", "fwd_config", "bwd_config", "forced_configs",
    "is_interpreter",
]


def is_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. at import: so do we.
INTERPRETER = is_interpreter()


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


_forced_fwd: FwdConfig | None = None
_forced_bwd: BwdConfig | None = None


@contextlib.contextmanager
def forced_configs(fwd: FwdConfig | None = None, bwd: BwdConfig | None = None) -> Iterator[None]:
    """Use these configurations for every launch inside the block (tests, tuning)."""
    global _forced_fwd, _forced_bwd
    saved = _forced_fwd, _forced_bwd
    _forced_fwd, _forced_bwd = fwd, bwd
    try:
        yield
    finally:
        _forced_fwd, _forced_bwd = saved


def _pow2(n: int) -> int:
    """The next power of two >= max(n, 1), without triton.next_power_of_2's per-call cost."""
    return 1 << max(n - 1, 0).bit_length()


def is_forced() -> bool:
    return _forced_fwd is not None or _forced_bwd is not None


def argmax_dtype(Ld: int) -> torch.dtype:
    """The saved argmax's dtype: int16 while every token index and the ``-1`` of "no valid token"
    fit (half the bytes of int32 to keep until the backward and to read back there), else int32."""
    return torch.int16 if Ld <= torch.iinfo(torch.int16).max else torch.int32


def block_k_for(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


def fwd_config(
    *, Lq: int, dim: int, Nq: int, per_query_docs: bool, elem_bytes: int,
    save_argmax: bool = False, norm_from_tiles: bool = False, n_cols: int | None = None,
    sm_count: int = 0,
) -> FwdConfig:
    """The forward's tiles. With ``n_cols`` (the grid's document columns) and ``sm_count``, the
    dense forward's measured variants apply (:func:`fwd_variant`); the launcher passes them on
    Hopper GPUs only, where they were measured."""
    if _forced_fwd is not None:
        return _forced_fwd
    cfg = _fwd_heuristic(_pow2(Lq), dim, _pow2(Nq), per_query_docs, elem_bytes, INTERPRETER)
    if n_cols is None or INTERPRETER:
        return cfg
    return fwd_variant(
        cfg, few_programs=few_programs(Nq, cfg.queries_per_block, n_cols, sm_count),
        save_argmax=save_argmax,
        norm_from_tiles=norm_from_tiles, per_query_docs=per_query_docs, elem_bytes=elem_bytes,
    )


def few_programs(Nq: int, queries_per_block: int, n_cols: int, sm_count: int) -> bool:
    """Whether the forward's grid holds at most one program an SM (a few long documents), where
    the measured tiles and kernels differ (NOTES.md sections 20 and 30)."""
    return n_cols * -(-Nq // queries_per_block) <= sm_count


@functools.lru_cache(maxsize=1024)
def fwd_variant(
    cfg: FwdConfig, *, few_programs: bool, save_argmax: bool, norm_from_tiles: bool,
    per_query_docs: bool, elem_bytes: int,
) -> FwdConfig:
    """Measured departures from the default tiles (16-bit inputs, d <= 128, on the H200;
    benchmarks/NOTES.md sections 20 and 22):

    * at most one program per SM (a few long documents): two warp groups a program, 64-token
      tiles, 4 stages, 1.1-2x faster there. This is the one case where ``Nq`` and the number of
      documents choose the compiled kernel: crossing the line compiles a second one, once.
    * the forward that saves the argmax (cross product), and inference on packed short queries:
      32-token tiles, 4 warps, with the query tile in registers (section 22): the default tiles
      spill with the argmax (the similarity, slot-max and slot-argmax tiles alone take 192
      registers a thread), and 32-token tiles read from shared memory are bound by its bandwidth
      unless the query tile comes from registers. 4-7% faster than the tiles before.
    * the forward that normalizes from the tiles: 8 warps of 32-token tiles capped at 128
      registers (two programs per SM), which do not spill there, 11% faster; the query tile in
      registers spills.
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


@functools.lru_cache(maxsize=1024)
def _fwd_heuristic(
    Lq: int, dim: int, Nq: int, per_query_docs: bool, elem_bytes: int, interp: bool
) -> FwdConfig:
    block_k = block_k_for(dim)
    # Rows of the Q tile kept on chip: 128 fills a Hopper tensor-core tile at d <= 128;
    # larger d keeps the Q tile near 32 KiB of shared memory.
    max_rows = 32 if interp else max(16, min(128, (32768 // elem_bytes) // block_k))
    lq_tile = min(max(16, triton.next_power_of_2(max(Lq, 1))), max_rows)
    queries_per_block = 1
    if not per_query_docs and lq_tile < max_rows:
        queries_per_block = min(max_rows // lq_tile, triton.next_power_of_2(max(Nq, 1)))
    if interp:
        return FwdConfig(lq_tile, queries_per_block, 32, block_k, 4, 1)
    block_n = 64 if block_k <= 128 else (32 if block_k <= 256 else 16)
    num_warps = 4  # measured on the H200: 8 warps were 10-25% slower at every shape (NOTES.md)
    # Packed short queries: 2 stages measured 5-20% faster (NOTES.md).
    num_stages = 2 if queries_per_block > 1 or block_k > 128 else 3
    return FwdConfig(lq_tile, queries_per_block, block_n, block_k, num_warps, num_stages)


def bwd_config(*, Lq: int, dim: int, elem_bytes: int, per_query_docs: bool = False) -> BwdConfig:
    if _forced_bwd is not None:
        return _forced_bwd
    return _bwd_heuristic(_pow2(Lq), dim, elem_bytes, per_query_docs)


@functools.lru_cache(maxsize=1024)
def _bwd_heuristic(Lq: int, dim: int, elem_bytes: int, per_query_docs: bool) -> BwdConfig:
    block_k = block_k_for(dim)
    if INTERPRETER:
        return BwdConfig(16, 32, 16, block_k, 4, 1)
    # Measured on the H200 (benchmarks/NOTES.md): 32-token gather blocks; one-hot products over
    # 128 flattened rows when many queries share a document, over the query itself otherwise.
    block_s = min(32, max(16, triton.next_power_of_2(max(Lq, 1))))
    block_t = 64 if block_k <= 128 else (32 if block_k <= 256 else 16)
    block_r = 128 if block_k <= 128 else 64
    if per_query_docs:
        block_r = min(64, max(16, triton.next_power_of_2(max(Lq, 1))))
    return BwdConfig(block_s, block_t, block_r, block_k, 4, 2)


def fwd_candidates(base: FwdConfig) -> list[FwdConfig]:
    """The forward tiles an autotuning run times: the analytical choice and its neighbours."""
    variants = [base]
    for block_n, warps, stages in ((64, 4, 2), (64, 4, 3), (64, 4, 4), (32, 4, 4), (64, 8, 3), (128, 8, 3)):
        if base.block_k > 128 and block_n > 32:
            continue
        variants.append(dataclasses.replace(base, block_n=block_n, num_warps=warps, num_stages=stages,
                                            max_registers=None, query_in_registers=False))
    if base.queries_per_block > 1:
        variants.append(dataclasses.replace(base, queries_per_block=base.queries_per_block // 2))
    unique: list[FwdConfig] = []
    for cfg in variants:
        if cfg not in unique:
            unique.append(cfg)
    return unique


_tuned: dict = {}


def tuned(key: tuple, candidates: list, time_ms) -> object:
    """The fastest of ``candidates`` by ``time_ms(candidate)``, measured once per ``key``.

    A candidate that fails (e.g. out of shared memory) is skipped; the first one is kept when all
    fail, so the caller's default still runs.
    """
    found = _tuned.get(key)
    if found is None:
        best, best_ms = candidates[0], float("inf")
        for cfg in candidates:
            try:
                ms = time_ms(cfg)
            except Exception:  # a configuration this device cannot run is simply not chosen
                continue
            if ms < best_ms:
                best, best_ms = cfg, ms
        found = _tuned[key] = best
    return found


@functools.lru_cache(maxsize=256)
def smooth_bwd_config(Lq: int, dim: int) -> BwdConfig:
    """Tiles of the smooth-max backward (``block_r`` unused): each program recomputes
    ``[block_s, block_t]`` similarity tiles, so both stay at tensor-core sizes."""
    block_k = block_k_for(dim)
    if INTERPRETER:
        return BwdConfig(16, 16, 16, block_k, 4, 1)
    block_s = min(64, max(16, triton.next_power_of_2(max(Lq, 1))))
    block_t = 64 if block_k <= 128 else 32
    return BwdConfig(block_s, block_t, 0, block_k, 4, 2)
