"""Benchmark harness: fusedmaxsim against its peers and naive PyTorch, in one process.

This module backs ``fusedmaxsim bench`` and ``benchmarks/bench_maxsim.py``. Every provider is
timed on the same inputs in the same process, so the numbers compare like with like.

* **Shapes.** ``all`` is the sixteen shapes whose peer numbers were recorded on an H200
  (their anchors travel with the records as the numbers to beat). ``quick`` is a set of small
  shapes that run in seconds on a CPU.
* **Parity gate.** Before a provider is timed on a (shape, mode), its scores and gradients are
  compared with the float64 oracle ``fusedmaxsim.reference.maxsim_ref`` on the same inputs
  (scores in the max norm, gradients in the Frobenius norm: see ``GRAD_TOL``). A
  fast but wrong kernel is recorded as failed and is never timed, so it can never win. The
  naive baselines are timed even when bf16 rounding puts them outside the tolerance: they are
  the yardstick, not contenders.
* **Metrics.** Median, p20 and p80 of one call (``triton.testing.do_bench`` on CUDA,
  ``time.perf_counter`` on CPU), TFLOP/s, the share of a roofline floor whose two ceilings
  are measured in the same run, wall time per call including host overhead, and peak memory
  above the inputs.
* **Sections.** ``--memory-table`` records op-level memory of ColPali in-batch training.
  ``--cold-start`` times a first call in a fresh process with an empty Triton cache.

Only torch is imported at module import. Triton, the peers and matplotlib are imported when
they are used, so the harness also runs on a machine that has none of them.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

SCHEMA = "fusedmaxsim.bench/1"
RECORD_STEM = "maxsim_bench"

MODES = ("inference", "training")
MODE_LABELS = {"inference": "fwd", "training": "fwd+bwd"}
_MODE_ALIASES = {"inference": "inference", "fwd": "inference", "training": "training",
                 "train": "training", "fwd+bwd": "training", "fwd_bwd": "training"}

# Targets of the performance issue, checked per shape for fusedmaxsim.
TARGET_VS_PEER = 1.2           # at least this much faster than the fastest passing peer
TARGET_PCT_FLOOR = 60.0        # share of the roofline floor ...
FLOOR_TARGET_MIN_MS = 0.050    # ... where the floor is at least this long
TINY_FLOOR_MS = 0.010          # below this floor a call is all overhead: hold it to a wall budget
TARGET_WALL_US = {"inference": 30.0, "training": 100.0}

# Parity tolerances against float64. Scores: max|out - ref| / max|ref|, by input dtype.
SCORE_TOL = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-2}
# Gradients: ‖out - ref‖ / ‖ref‖ (Frobenius), every dtype. A near-tie of the max decided otherwise
# than in float64 (two similarities within fp32 rounding of each other, or within the 16 units in
# the last place of the Gluon training forward's coded max) sends a whole query token's gradient
# to another document token, which the max norm reports as an error the size of a gradient row
# however few such tokens there are; the Frobenius norm weighs how many. 1e-2 (the bound of the
# GPU tests' large shapes) is about a hundred such decisions among train_colpali's two million,
# so a kernel that gets even a small share of its maxima wrong is still refused (NOTES.md section
# 46). The max-norm error is recorded beside it (`grad_q_rel_err`, `grad_d_rel_err`).
GRAD_TOL = 1e-2

# Largest float64 grid block the reference builds at once (elements): keeps the oracle of the
# biggest shapes within a few GiB while staying exact (see reference_outputs).
_REF_BLOCK_ELEMS = 1 << 26


# ---------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Anchor:
    """Peer numbers recorded on one H200 (torch 2.11, triton 3.6, 2026-11-30), in ms and MiB.

    They come from an earlier measurement, not from this run; records show them as the numbers to
    beat and never mix them into measured columns.
    """

    lik_ms: float
    flash_ms: float
    naive_ms: float
    naive_fp32_ms: float
    floor_ms: float
    lik_peak_mib: float
    flash_peak_mib: float

    @property
    def best_peer_ms(self) -> float:
        return min(self.lik_ms, self.flash_ms)


@dataclass(frozen=True)
class Shape:
    """One benchmark problem.

    ``layout`` is ``"cross"`` (D ``[Nd, Ld, d]``, scores ``[Nq, Nd]``) or ``"kd"`` (per-query
    candidates: D ``[Nq, K, Ld, d]``, scores ``[Nq, K]``); ``nd`` is Nd or K. ``mode`` is the mode
    the anchors were measured in. ``masked`` draws random document lengths between Ld/10 and Ld.
    """

    name: str
    layout: str
    nq: int
    nd: int
    lq: int
    ld: int
    mode: str
    masked: bool = False
    normalize: bool = False
    dtype: str = "bfloat16"
    d: int = 128
    anchor: Anchor | None = None

    @property
    def q_shape(self) -> tuple:
        return (self.nq, self.lq, self.d)

    @property
    def d_shape(self) -> tuple:
        if self.layout == "cross":
            return (self.nd, self.ld, self.d)
        return (self.nq, self.nd, self.ld, self.d)

    @property
    def out_shape(self) -> tuple:
        return (self.nq, self.nd)

    @property
    def flops(self) -> int:
        """Forward flops, ``2·Nq·Nd·Lq·Ld·d``; the backward adds no second matrix product."""
        return 2 * self.nq * self.nd * self.lq * self.ld * self.d

    @property
    def input_bytes(self) -> int:
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return (math.prod(self.q_shape) + math.prod(self.d_shape)) * itemsize

    def describe(self) -> str:
        extras = [x for x, on in (("masked", self.masked), ("normalize", self.normalize)) if on]
        if self.dtype != "bfloat16":
            extras.append(self.dtype)
        text = f"{self.layout} {self.nq}×{self.nd}, {self.lq}×{self.ld}"
        return " ".join([text, *extras])


def _anchored(name, layout, nq, nd, lq, ld, mode, numbers, **options) -> Shape:
    return Shape(name, layout, nq, nd, lq, ld, mode, anchor=Anchor(*numbers), **options)


_I, _T = "inference", "training"

# The sixteen anchor shapes. Numbers: LIK ms, flash ms, naive ms, naive fp32 ms, floor ms,
# LIK peak MiB, flash peak MiB.
SHAPES: tuple = (
    _anchored("rerank_colbert", "cross", 1, 1000, 32, 300, _I,
              (0.033, 0.034, 0.059, 0.238, 0.018, 0.0, 0.0)),
    _anchored("rerank_colpali", "cross", 1, 1000, 128, 1024, _I,
              (0.089, 0.098, 0.274, 1.436, 0.061, 0.0, 0.0)),
    _anchored("rerank_colpali_1030", "cross", 1, 1000, 1030, 1030, _I,
              (0.863, 0.678, 1.682, 9.292, 0.344, 0.3, 0.3)),
    _anchored("batch_colbert", "cross", 256, 256, 32, 300, _I,
              (0.934, 0.929, 1.488, 5.469, 0.204, 0.2, 0.3)),
    _anchored("batch_colbert_masked", "cross", 256, 256, 32, 300, _I,
              (0.973, 0.942, 5.200, 9.407, 0.204, 0.4, 0.3), masked=True),
    _anchored("longdoc", "cross", 16, 32, 32, 8192, _I,
              (0.172, 0.183, 0.281, 1.221, 0.043, 0.0, 0.0)),
    _anchored("longquery", "cross", 4, 64, 2048, 1024, _I,
              (0.263, 0.286, 0.839, 4.343, 0.174, 0.0, 0.0)),
    _anchored("small_batch", "cross", 32, 32, 32, 180, _I,
              (0.088, 0.033, 0.055, 0.078, 0.002, 0.0, 0.0)),
    _anchored("rerank_colpali_norm", "cross", 1, 1000, 128, 1024, _I,
              (0.124, 1.309, 1.484, 2.098, 0.061, 0.0, 1003.9), normalize=True),
    _anchored("train_colbert", "cross", 128, 128, 32, 300, _T,
              (0.507, 0.459, 2.904, 5.424, 0.051, 33.2, 31.2)),
    _anchored("train_colbert_masked", "cross", 128, 128, 32, 300, _T,
              (0.806, 0.689, 4.418, 7.129, 0.051, 33.3, 31.2), masked=True),
    _anchored("train_colpali", "cross", 128, 128, 128, 1024, _T,
              (2.276, 2.332, 36.299, 67.143, 0.696, 116.1, 108.1)),
    _anchored("train_colpali_fp16", "cross", 128, 128, 128, 1024, _T,
              (2.265, 2.322, 35.391, 67.173, 0.696, 116.1, 108.1), dtype="float16"),
    _anchored("train_small_batch", "cross", 32, 32, 32, 180, _T,
              (0.626, 0.576, 1.000, 0.844, 0.002, 5.1, 4.6)),
    _anchored("train_kd", "kd", 64, 32, 32, 300, _T,
              (0.716, 0.651, 0.919, 1.835, 0.073, 150.8, 450.8)),
    _anchored("train_kd_colpali", "kd", 32, 16, 32, 1030, _T,
              (0.871, 0.987, 0.783, 1.867, 0.063, 129.6, 387.6)),
)

# Small shapes that exercise every code path (masks, normalize, fp32, KD, training) in seconds
# on a CPU.
QUICK_SHAPES: tuple = (
    Shape("quick_rerank", "cross", 1, 64, 16, 48, _I, d=64),
    Shape("quick_batch_masked", "cross", 8, 16, 16, 48, _I, masked=True, d=64),
    Shape("quick_norm", "cross", 2, 16, 16, 48, _I, normalize=True, d=64),
    Shape("quick_fp32", "cross", 4, 8, 16, 48, _I, dtype="float32", d=64),
    Shape("quick_train", "cross", 8, 8, 16, 48, _T, d=64),
    Shape("quick_train_masked", "cross", 8, 8, 16, 48, _T, masked=True, d=64),
    Shape("quick_kd", "kd", 4, 8, 16, 48, _T, d=64),
)

SHAPES_BY_NAME = {s.name: s for s in SHAPES + QUICK_SHAPES}

# Op-level memory of ColPali in-batch training: Nq = Nd = B, Lq = 128, Ld = 1024, bf16.
MEMORY_BATCHES = (16, 32, 64, 128, 256)
MEMORY_PROVIDERS = ("naive", "lik", "flash", "fusedmaxsim")

# First-call latency cases: a rerank forward and a training step, per device type.
COLD_START_CASES = {
    "cuda": (("rerank_colbert", "inference"), ("train_colbert", "training")),
    "cpu": (("quick_rerank", "inference"), ("quick_train", "training")),
}


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


@dataclass
class Case:
    """The inputs of one (shape, mode), shared by every provider.

    ``doc_lengths`` and ``query_lengths`` are the int32 prefix lengths equivalent to the masks,
    for flash-maxsim, which takes lengths instead of masks; they are built once here so that
    no provider pays for the conversion inside its timing.
    """

    shape: Shape
    mode: str
    Q: torch.Tensor
    D: torch.Tensor
    q_mask: torch.Tensor | None
    d_mask: torch.Tensor | None
    doc_lengths: torch.Tensor | None
    query_lengths: torch.Tensor | None
    grad_out: torch.Tensor | None

    @property
    def training(self) -> bool:
        return self.mode == "training"

    def reset_grads(self) -> None:
        self.Q.grad = None
        self.D.grad = None


def _tokens(size, raw: bool, dtype, gen, device) -> torch.Tensor:
    """Random tokens: unit-norm as real embeddings are, raw Gaussian where the op normalizes."""
    x = torch.randn(size, generator=gen, device=device, dtype=torch.float32)
    if not raw:
        x = F.normalize(x, dim=-1)
    return x.to(dtype)


def make_case(shape: Shape, mode: str, device) -> Case:
    """Builds the inputs of one (shape, mode).

    The seed depends only on the shape name, so every provider, every run and the cold-start
    subprocesses see the same data.
    """
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(zlib.crc32(shape.name.encode()))
    dtype = getattr(torch, shape.dtype)
    Q = _tokens(shape.q_shape, shape.normalize, dtype, gen, device)
    D = _tokens(shape.d_shape, shape.normalize, dtype, gen, device)
    d_mask = doc_lengths = None
    if shape.masked:
        lengths = torch.randint(max(1, shape.ld // 10), shape.ld + 1, shape.d_shape[:-2],
                                generator=gen, device=device)
        d_mask = torch.arange(shape.ld, device=device) < lengths.unsqueeze(-1)
        doc_lengths = lengths.reshape(-1).to(torch.int32)
    grad_out = None
    if mode == "training":
        Q.requires_grad_(True)
        D.requires_grad_(True)
        grad_out = torch.randn(shape.out_shape, generator=gen, device=device, dtype=torch.float32)
    return Case(shape, mode, Q, D, None, d_mask, doc_lengths, None, grad_out)


# ---------------------------------------------------------------------------------------------
# Providers
# ---------------------------------------------------------------------------------------------


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
    Provider("lik", "LIK", "peer", _build_lik, module="late_interaction_kernels", needs_cuda=True),
    Provider("flash", "flash", "peer", _build_flash, module="flash_maxsim", needs_cuda=True),
    Provider("naive", "naive", "baseline", _build_naive),
    Provider("naive_fp32", "naive fp32", "baseline", _build_naive_fp32),
    Provider("compile_fp32", "compile fp32", "baseline", _build_compile_fp32),
)
PROVIDERS_BY_KEY = {p.key: p for p in PROVIDERS}
_PROVIDER_ALIASES = {"late_interaction_kernels": "lik", "late-interaction-kernels": "lik",
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
            return f"not importable: {_describe(exc)}"
    return None


# ---------------------------------------------------------------------------------------------
# Parity gate
# ---------------------------------------------------------------------------------------------


@dataclass
class Reference:
    scores: torch.Tensor
    grad_q: torch.Tensor | None
    grad_d: torch.Tensor | None


def _ref_blocks(shape: Shape) -> tuple:
    """Rows (queries) and columns (documents or candidates) per reference block."""
    per_pair = shape.lq * shape.ld
    cols = max(1, min(shape.nd, _REF_BLOCK_ELEMS // per_pair))
    rows = max(1, min(shape.nq, _REF_BLOCK_ELEMS // (cols * per_pair)))
    return rows, cols


def reference_outputs(case: Case) -> Reference:
    """Scores and gradients of the float64 oracle on exactly the providers' inputs.

    The oracle materialises the similarity grid, which in float64 would not fit for the largest
    shapes, so it runs on blocks of the output. Blocks are independent in the forward and their
    gradients add up in the backward, so the result is the same as one big call.
    """
    from fusedmaxsim.reference import maxsim_ref

    shape = case.shape
    Q = case.Q.detach().double().requires_grad_(case.training)
    D = case.D.detach().double().requires_grad_(case.training)
    scores = torch.empty(shape.out_shape, dtype=torch.float64, device=Q.device)
    rows, cols = _ref_blocks(shape)
    for i0 in range(0, shape.nq, rows):
        qi = slice(i0, i0 + rows)
        for j0 in range(0, shape.nd, cols):
            dj = slice(j0, j0 + cols)
            if shape.layout == "cross":
                D_blk = D[dj]
                dm = None if case.d_mask is None else case.d_mask[dj]
            else:
                D_blk = D[qi, dj]
                dm = None if case.d_mask is None else case.d_mask[qi, dj]
            qm = None if case.q_mask is None else case.q_mask[qi]
            block = maxsim_ref(Q[qi], D_blk, qm, dm, normalize=shape.normalize)
            if case.training:
                block.backward(case.grad_out[qi, dj].double())
            scores[qi, dj] = block.detach()
    return Reference(scores, Q.grad, D.grad)


def rel_err(x: torch.Tensor | None, ref: torch.Tensor) -> float:
    """``max|x - ref| / max|ref|``; infinite for a missing or non-finite result."""
    if x is None:
        return math.inf
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"output shape {tuple(x.shape)}, expected {tuple(ref.shape)}")
    diff = (x.detach().double() - ref).abs().max().item()
    if not math.isfinite(diff):
        return math.inf
    scale = ref.abs().max().item()
    return diff / scale if scale > 0 else diff


def fro_err(x: torch.Tensor | None, ref: torch.Tensor) -> float:
    """``‖x - ref‖ / ‖ref‖`` (:func:`fusedmaxsim.testing.relative_error_fro`); infinite for a
    missing or non-finite result."""
    from fusedmaxsim.testing import relative_error_fro

    if x is None:
        return math.inf
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"output shape {tuple(x.shape)}, expected {tuple(ref.shape)}")
    err = relative_error_fro(x, ref)
    return err if math.isfinite(err) else math.inf


def check_parity(out: torch.Tensor, grads, ref: Reference, case: Case) -> dict:
    """Relative errors against the oracle and whether they are within tolerance: scores in the
    max norm, gradients in the Frobenius norm (see :data:`GRAD_TOL`; their max-norm errors are
    recorded too)."""
    dtype = case.shape.dtype
    result = {"score_rel_err": rel_err(out, ref.scores), "score_tol": SCORE_TOL[dtype]}
    problems = []
    if not result["score_rel_err"] <= SCORE_TOL[dtype]:
        problems.append(f"score rel err {result['score_rel_err']:.2e} > {SCORE_TOL[dtype]:.0e}")
    if case.training:
        result["grad_tol"] = GRAD_TOL
        for name, got, want in (("grad_q", grads[0], ref.grad_q), ("grad_d", grads[1], ref.grad_d)):
            result[f"{name}_rel_err"] = rel_err(got, want)
            err = result[f"{name}_fro_err"] = fro_err(got, want)
            if got is None:
                problems.append(f"no {name}")
            elif not err <= GRAD_TOL:
                problems.append(f"{name} Frobenius rel err {err:.2e} > {GRAD_TOL:.0e}")
    result["parity_ok"] = not problems
    result["parity_problems"] = "; ".join(problems) or None
    return result


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def _sync_fn(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def run_once(score, case: Case, sync) -> tuple:
    """One call (forward, plus backward in training) with its output, gradients and seconds.

    The gate's call doubles as the warm-up, so autotune sweeps never land in the timings.
    """
    case.reset_grads()
    sync()
    start = time.perf_counter()
    if case.training:
        out = score()
        out.backward(case.grad_out)
    else:
        with torch.no_grad():
            out = score()
    sync()
    seconds = time.perf_counter() - start
    grads = (case.Q.grad, case.D.grad) if case.training else None
    case.reset_grads()
    return out.detach(), grads, seconds


def make_step(score, case: Case) -> Callable[[], None]:
    """What one timed call does: inference under ``no_grad``, or forward plus backward."""
    if case.training:
        def step():
            score().backward(case.grad_out)
    else:
        def step():
            with torch.no_grad():
                score()
    return step


class Timer:
    """Median, p20 and p80 of one call, in ms.

    CUDA uses ``triton.testing.do_bench`` (CUDA events, L2 flushed between calls). CPU has no
    events, so each call is bracketed with ``time.perf_counter`` after a timed warm-up.
    """

    def __init__(self, device: torch.device, warmup_ms: float, rep_ms: float):
        self.device = device
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms

    @property
    def name(self) -> str:
        if self.device.type == "cuda":
            return "triton.testing.do_bench"
        return "time.perf_counter"

    def __call__(self, fn, grad_to_none=None) -> tuple:
        return quantiles_ms(self.samples(fn, grad_to_none, self.rep_ms))

    def samples(self, fn, grad_to_none, rep_ms: float) -> list:
        """The time of each timed call (ms) over about ``rep_ms``, after the warm-up."""
        if self.device.type == "cuda":
            from triton.testing import do_bench

            return list(do_bench(fn, warmup=self.warmup_ms, rep=rep_ms,
                                 grad_to_none=grad_to_none, return_mode="all"))
        return self._cpu(fn, grad_to_none or (), rep_ms)

    def _cpu(self, fn, grad_to_none, rep_ms: float) -> list:
        def call() -> float:
            for x in grad_to_none:
                x.grad = None
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3

        estimate = max(call(), 1e-3)
        for _ in range(min(1000, int(self.warmup_ms / estimate))):
            call()
        n = max(5, min(1000, int(rep_ms / estimate)))
        return [call() for _ in range(n)]


def quantiles_ms(times) -> tuple:
    """(median, p20, p80) of per-call times."""
    times = torch.tensor(list(times), dtype=torch.float64)
    med, p20, p80 = torch.quantile(times, torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64))
    return med.item(), p20.item(), p80.item()


# The suite times each shape's providers in this many interleaved rounds, each in another order,
# and pools the calls: a host that speeds up or slows down during a shape (CPU clocks ramping
# after a long GPU phase, say) then weighs on every provider alike, not on whichever runs first.
TIMING_ROUNDS = 3


def round_orders(n: int, rounds: int = TIMING_ROUNDS) -> list:
    """Provider orders of the timing rounds: each round starts ``n / rounds`` further on, so no
    provider is always first."""
    step = max(1, -(-n // rounds))
    return [[(i + r * step) % n for i in range(n)] for r in range(rounds)]


def wall_us_per_call(step, case: Case, sync, ms: float, target_ms: float) -> tuple:
    """Wall time per call with host overhead: N calls back to back, one sync, divided by N.

    Kernel timers hide launch and Python overhead, which is what decides tiny shapes.
    """
    n = int(max(3, min(500, target_ms / max(ms, 1e-3))))
    step()
    sync()
    start = time.perf_counter()
    for _ in range(n):
        case.reset_grads()
        step()
    sync()
    case.reset_grads()
    return (time.perf_counter() - start) / n * 1e6, n


def peak_mib(step, case: Case, device: torch.device) -> float | None:
    """Allocator peak of one call above what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    case.reset_grads()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    case.reset_grads()
    return peak / 2**20


def measure_ceilings(device: torch.device, timer: Timer) -> dict:
    """Both roofline ceilings, measured in this run on this device.

    A large bf16 matrix product gives the arithmetic rate and a large device-to-device copy
    (read plus write bytes) the memory bandwidth, so the floor reflects this card, its clocks
    and its driver rather than a datasheet. A CPU gets smaller fp32 problems.
    """
    if device.type == "cuda":
        n, dtype, nbytes = 8192, torch.bfloat16, 1 << 30
    else:
        n, dtype, nbytes = 1024, torch.float32, 1 << 26
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm_ms = timer(lambda: torch.mm(a, b))[0]
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src))[0]
    return {
        "matmul_tflops": 2 * n**3 / (mm_ms * 1e-3) / 1e12,
        "matmul": f"{n}x{n}x{n} {str(dtype).removeprefix('torch.')}",
        "copy_gbps": 2 * nbytes / (copy_ms * 1e-3) / 1e9,
        "copy_bytes": nbytes,
    }


def floor_ms(shape: Shape, mode: str, ceilings: dict | None) -> float | None:
    """Roofline floor: the longer of the arithmetic at the matmul rate and the traffic at the
    copy bandwidth. Traffic is Q and D, plus their gradients in training."""
    if not ceilings:
        return None
    compute_s = shape.flops / (ceilings["matmul_tflops"] * 1e12)
    traffic = shape.input_bytes * (2 if mode == "training" else 1)
    memory_s = traffic / (ceilings["copy_gbps"] * 1e9)
    return max(compute_s, memory_s) * 1e3


# ---------------------------------------------------------------------------------------------
# The suite
# ---------------------------------------------------------------------------------------------

RECORD_KEYS = (
    "shape", "mode", "provider", "role", "status", "error",
    "score_rel_err", "grad_q_rel_err", "grad_d_rel_err", "grad_q_fro_err", "grad_d_fro_err",
    "score_tol", "grad_tol", "parity_ok",
    "warmup_call_s", "ms", "p20_ms", "p80_ms", "round_ms", "wall_us", "wall_iters",
    "tflops", "floor_ms", "pct_floor", "peak_mib",
)


def new_record(shape: Shape, mode: str, provider: Provider) -> dict:
    record = dict.fromkeys(RECORD_KEYS)
    record.update(shape=shape.name, mode=mode, provider=provider.key, role=provider.role)
    return record


class SuiteContext:
    """What every item of a suite run shares: device, timer, budgets, the current reference."""

    def __init__(self, device, timer, ceilings, *, budget_s=None, compile_budget_s=None):
        self.device = device
        self.timer = timer
        self.sync = _sync_fn(device)
        self.ceilings = ceilings
        self.deadline = None if budget_s is None else time.monotonic() + budget_s
        self.compile_budget_s = compile_budget_s
        self.compile_spent_s = 0.0
        self.unavailable: dict = {}
        self._case = None
        self._reference = None

    def skip_reason(self, provider: Provider) -> str | None:
        if provider.key not in self.unavailable:
            self.unavailable[provider.key] = provider_unavailable(provider, self.device)
        if self.unavailable[provider.key]:
            return self.unavailable[provider.key]
        if self.deadline is not None and time.monotonic() > self.deadline:
            return "time budget spent"
        if (provider.key == "compile_fp32" and self.compile_budget_s is not None
                and self.compile_spent_s >= self.compile_budget_s):
            return f"compile budget ({self.compile_budget_s:.0f} s) spent"
        return None

    def reference(self, case: Case) -> Reference:
        """The oracle for ``case``, computed once and shared by its providers."""
        if self._case is not case:
            self._case = case
            try:
                self._reference = reference_outputs(case)
            except Exception as exc:  # noqa: BLE001 - recorded on every provider of the case
                self._reference = RuntimeError(f"reference failed: {_describe(exc)}")
        if isinstance(self._reference, Exception):
            raise self._reference
        return self._reference

    def forget_case(self) -> None:
        self._case = self._reference = None


def gate_one(provider: Provider, case: Case, ctx: SuiteContext) -> tuple:
    """Build, run once and check one provider on one case: ``(record, step)``, with ``step``
    None when the provider is skipped or fails (the record says why). Never raises."""
    record = new_record(case.shape, case.mode, provider)
    reason = ctx.skip_reason(provider)
    if reason:
        record.update(status="skipped", error=reason)
        return record, None
    try:
        score = provider.build(case)
        out, grads, seconds = run_once(score, case, ctx.sync)
        record["warmup_call_s"] = seconds
        if provider.key == "compile_fp32":
            ctx.compile_spent_s += seconds
        parity = check_parity(out, grads, ctx.reference(case), case)
        problems = parity.pop("parity_problems")
        record.update(parity)
        if problems and provider.role != "baseline":
            record.update(status="failed", error=f"parity: {problems}")
            return record, None
        return record, make_step(score, case)
    except Exception as exc:  # noqa: BLE001 - one crash must not lose the rest of the suite
        record.update(status="failed", error=_describe(exc))
        return record, None
    finally:
        case.reset_grads()


def time_gated(gated: list, case: Case, ctx: SuiteContext) -> None:
    """Time every provider that passed its gate, in :data:`TIMING_ROUNDS` interleaved rounds
    (:func:`round_orders`), then its wall time per call and its peak memory; fills the records."""
    grad_to_none = [case.Q, case.D] if case.training else None
    rounds = {i: [] for i, (_, step) in enumerate(gated) if step is not None}  # calls per round
    rep_ms = ctx.timer.rep_ms / TIMING_ROUNDS
    for order in round_orders(len(gated)):
        for i in order:
            if i not in rounds:
                continue
            record, step = gated[i]
            try:
                rounds[i].append(ctx.timer.samples(step, grad_to_none, rep_ms))
            except Exception as exc:  # noqa: BLE001 - recorded; the other providers go on
                record.update(status="failed", error=_describe(exc))
                del rounds[i]
            finally:
                case.reset_grads()
    for i, calls in rounds.items():
        record, step = gated[i]
        try:
            med, p20, p80 = quantiles_ms([t for times in calls for t in times])
            record.update(ms=med, p20_ms=p20, p80_ms=p80,
                          round_ms=[quantiles_ms(times)[0] for times in calls])
            record["wall_us"], record["wall_iters"] = wall_us_per_call(
                step, case, ctx.sync, med, ctx.timer.rep_ms)
            record["peak_mib"] = peak_mib(step, case, ctx.device)
            record["tflops"] = case.shape.flops / (med * 1e-3) / 1e12
            floor = floor_ms(case.shape, case.mode, ctx.ceilings)
            if floor is not None:
                record.update(floor_ms=floor, pct_floor=100.0 * floor / med)
            record["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - one crash must not lose the rest of the suite
            record.update(status="failed", error=_describe(exc))
        finally:
            case.reset_grads()


def modes_for(shape: Shape, modes: Sequence[str] | None) -> list:
    """The shape's own (anchored) mode, unless modes were asked for explicitly."""
    return [shape.mode] if not modes else list(modes)


def shape_info(shape: Shape) -> dict:
    info = asdict(shape)
    info.update(description=shape.describe(), flops=shape.flops, input_bytes=shape.input_bytes)
    if shape.anchor is not None:
        best = shape.anchor.best_peer_ms
        info.update(anchor_best_peer_ms=best, anchor_target_ms=best / TARGET_VS_PEER)
    return info


def run_suite(shapes, modes, providers, device, *, warmup_ms=25.0, rep_ms=100.0,
              budget_s=None, compile_budget_s=None, progress=None, on_update=None) -> dict:
    """Gates and times every (shape, mode, provider); returns the ``suite`` section.

    ``on_update(suite)`` is called after each (shape, mode), so a run that is cut short still
    leaves every finished row on disk.
    """
    device = torch.device(device)
    timer = Timer(device, warmup_ms, rep_ms)
    items = [(s, m) for s in shapes for m in modes_for(s, modes)]
    suite = {
        "env": environment(device),
        "settings": {"timer": timer.name, "warmup_ms": warmup_ms, "rep_ms": rep_ms,
                     "rounds": TIMING_ROUNDS,
                     "quantiles": [0.5, 0.2, 0.8], "budget_s": budget_s,
                     "compile_budget_s": compile_budget_s},
        "ceilings": None,
        "shapes": [shape_info(s) for s in dict.fromkeys(s for s, _ in items)],
        "records": [],
        "summary": [],
        "geomean": {},
    }
    try:
        suite["ceilings"] = measure_ceilings(device, timer)
    except Exception as exc:  # noqa: BLE001 - without ceilings the times still stand
        suite["ceilings_error"] = _describe(exc)
    ctx = SuiteContext(device, timer, suite["ceilings"], budget_s=budget_s,
                       compile_budget_s=compile_budget_s)
    progress = progress or Progress(len(items) * len(providers), enabled=False)
    for shape, mode in items:
        try:
            case = make_case(shape, mode, device)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: record it, go on
            case, error = None, f"inputs: {_describe(exc)}"
        gated = []
        for provider in providers:
            if case is None:
                record = new_record(shape, mode, provider)
                record.update(status="failed", error=error)
                gated.append((record, None))
            else:
                gated.append(gate_one(provider, case, ctx))
        if case is not None:
            time_gated(gated, case, ctx)
        for provider, (record, _) in zip(providers, gated):
            progress.start(f"{shape.name} {MODE_LABELS[mode]} {provider.key}")
            suite["records"].append(_clean(record))
            progress.done(_result_text(record))
        ctx.forget_case()
        case = None
        _release_memory(device)
        suite["summary"], suite["geomean"] = summarize(suite["records"])
        if on_update is not None:
            on_update(suite)
    progress.close()
    return suite


# ---------------------------------------------------------------------------------------------
# Summary and targets
# ---------------------------------------------------------------------------------------------


def _target(value, target, applies, at_most=False) -> dict:
    """One target: met is None where it does not apply, False where the value is missing."""
    met = None
    if applies:
        met = value is not None and (value <= target if at_most else value >= target)
    return {"target": target, "value": value, "applies": applies, "met": met}


def summarize(records: list) -> tuple:
    """Per (shape, mode): fusedmaxsim against the fastest passing peer and naive, the targets,
    and the geometric means over the suite. Failed providers are left out of every ratio."""
    groups: dict = {}
    for record in records:
        groups.setdefault((record["shape"], record["mode"]), []).append(record)
    rows = []
    for (shape_name, mode), group in groups.items():
        rows.append(_summary_row(SHAPES_BY_NAME.get(shape_name), shape_name, mode, group))
    return rows, _geomeans(rows)


def _summary_row(shape, shape_name, mode, group) -> dict:
    by_key = {r["provider"]: r for r in group}
    ok = {k: r for k, r in by_key.items() if r["status"] == "ok"}
    ours = ok.get("fusedmaxsim")
    peers = [r for r in ok.values() if r["role"] == "peer"]
    best_peer = min(peers, key=lambda r: r["ms"]) if peers else None
    naive = ok.get("naive")
    naive_times = [ok[k]["ms"] for k in ("naive", "naive_fp32") if k in ok]
    floors = [r["floor_ms"] for r in group if r["floor_ms"] is not None]
    floor = floors[0] if floors else None
    ours_ms = ours["ms"] if ours else None

    def ratio(other_ms):
        return other_ms / ours_ms if ours_ms and other_ms else None

    row = {
        "shape": shape_name, "mode": mode, "floor_ms": floor,
        "fusedmaxsim_status": by_key.get("fusedmaxsim", {}).get("status"),
        "fusedmaxsim_ms": ours_ms,
        "fusedmaxsim_p20_ms": ours["p20_ms"] if ours else None,
        "fusedmaxsim_p80_ms": ours["p80_ms"] if ours else None,
        "best_peer": best_peer["provider"] if best_peer else None,
        "best_peer_ms": best_peer["ms"] if best_peer else None,
        "speedup_vs_peer": ratio(best_peer["ms"]) if best_peer else None,
        "speedup_vs_naive": ratio(naive["ms"]) if naive else None,
        "pct_floor": ours["pct_floor"] if ours else None,
        "tflops": ours["tflops"] if ours else None,
        "wall_us": ours["wall_us"] if ours else None,
        "peak_mib": {k: r["peak_mib"] for k, r in ok.items() if r["peak_mib"] is not None},
        "anchor_best_peer_ms": None,
        "anchor_target_ms": None,
    }
    if shape is not None and shape.anchor is not None and mode == shape.mode:
        row["anchor_best_peer_ms"] = shape.anchor.best_peer_ms
        row["anchor_target_ms"] = shape.anchor.best_peer_ms / TARGET_VS_PEER
    tiny = floor is not None and floor < TINY_FLOOR_MS
    row["targets"] = {
        "vs_peer": _target(row["speedup_vs_peer"], TARGET_VS_PEER, best_peer is not None),
        "pct_floor": _target(row["pct_floor"], TARGET_PCT_FLOOR,
                             floor is not None and floor >= FLOOR_TARGET_MIN_MS),
        "wall_us": _target(row["wall_us"], TARGET_WALL_US[mode], tiny, at_most=True),
        "not_slower_than_naive": _target(ratio(min(naive_times)) if naive_times else None,
                                         1.0, bool(naive_times)),
    }
    return _clean(row)


def _geomeans(rows) -> dict:
    result = {}
    for key in ("speedup_vs_peer", "speedup_vs_naive"):
        values = [r[key] for r in rows if r[key]]
        result[key] = math.exp(sum(map(math.log, values)) / len(values)) if values else None
        result[f"n_{key}"] = len(values)
    return result


# ---------------------------------------------------------------------------------------------
# Op-level memory table
# ---------------------------------------------------------------------------------------------


def memory_step(score, case: Case, warm: bool) -> tuple:
    """Memory held from forward to backward, and the backward's spike above it, in MiB.

    ``warm`` runs one step first so one-time allocations (autotune buffers) stay out of it.
    """
    device = case.Q.device
    if warm:
        score().backward(case.grad_out)
        case.reset_grads()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    out = score()
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device) - base
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out.backward(case.grad_out)
    torch.cuda.synchronize(device)
    spike = torch.cuda.max_memory_allocated(device) - before
    del out
    case.reset_grads()
    return held / 2**20, spike / 2**20


def run_memory_table(providers, device, batches=MEMORY_BATCHES, progress=None,
                     on_update=None) -> dict:
    """ColPali in-batch training (Nq = Nd = B, Lq = 128, Ld = 1024, bf16) for each batch B.

    ``on_update(section)`` is called after each row, so a run cut short keeps its rows.
    """
    device = torch.device(device)
    section = {"env": environment(device), "lq": 128, "ld": 1024, "dtype": "bfloat16",
               "batches": list(batches), "rows": []}
    if device.type != "cuda":
        section["skipped"] = "needs CUDA (allocator statistics)"
        return section
    progress = progress or Progress(len(batches) * len(providers), enabled=False)
    unavailable = {p.key: provider_unavailable(p, device) for p in providers}
    for batch in batches:
        shape = Shape(f"colpali_inbatch_{batch}", "cross", batch, batch, 128, 1024, _T)
        case = make_case(shape, "training", device)
        for provider in providers:
            progress.start(f"memory B={batch} {provider.key}")
            row = {"batch": batch, "provider": provider.key, "status": None, "error": None,
                   "held_mib": None, "spike_mib": None, "total_mib": None}
            if unavailable[provider.key]:
                row.update(status="skipped", error=unavailable[provider.key])
            else:
                try:
                    held, spike = memory_step(provider.build(case), case,
                                              warm=provider.role != "baseline")
                    row.update(status="ok", held_mib=held, spike_mib=spike,
                               total_mib=held + spike)
                except Exception as exc:  # noqa: BLE001 - e.g. out of memory: record it
                    row.update(status="failed", error=_describe(exc))
                    case.reset_grads()
            section["rows"].append(_clean(row))
            progress.done(row["status"] if row["status"] != "ok"
                          else f"{row['total_mib']:.0f} MiB")
            _release_memory(device)
            if on_update is not None:
                on_update(section)
        case = None
        _release_memory(device)
    progress.close()
    return section


# ---------------------------------------------------------------------------------------------
# Cold start
# ---------------------------------------------------------------------------------------------

_COLD_CHILD = ("import sys\n"
               "from fusedmaxsim.benchmarking import cold_start_child\n"
               "sys.exit(cold_start_child(sys.argv[1:]))\n")


def run_cold_start(providers, device, timeout_s=60.0, progress=None, on_update=None) -> dict:
    """First-call seconds of each contender in a fresh process with an empty Triton cache.

    Compilation and autotuning are what a serving process pays on its first request and what a
    warm benchmark never shows. Baselines compile nothing, so only contenders are measured.
    ``on_update(section)`` is called after each row, so a run cut short keeps its rows.
    """
    device = torch.device(device)
    cases = COLD_START_CASES["cuda" if device.type == "cuda" else "cpu"]
    contenders = [p for p in providers if p.role != "baseline"]
    section = {"env": environment(device), "timeout_s": timeout_s, "rows": []}
    progress = progress or Progress(len(cases) * len(contenders), enabled=False)
    for shape_name, mode in cases:
        for provider in contenders:
            progress.start(f"cold start {shape_name} {MODE_LABELS[mode]} {provider.key}")
            reason = provider_unavailable(provider, device)
            if reason:
                row = _cold_row(shape_name, mode, provider.key, status="skipped", error=reason)
            else:
                row = _cold_start_subprocess(provider.key, shape_name, mode, device, timeout_s)
            section["rows"].append(_clean(row))
            progress.done(row["status"] if row["status"] != "ok"
                          else f"{row['first_call_s']:.2f} s")
            if on_update is not None:
                on_update(section)
    progress.close()
    return section


def _cold_row(shape_name, mode, provider_key, **values) -> dict:
    row = {"shape": shape_name, "mode": mode, "provider": provider_key, "status": None,
           "error": None, "import_s": None, "torch_backward_s": None, "first_call_s": None,
           "second_call_s": None}
    row.update(values)
    return row


def _cold_start_subprocess(provider_key, shape_name, mode, device, timeout_s) -> dict:
    import fusedmaxsim

    row = _cold_row(shape_name, mode, provider_key)
    package_root = str(Path(fusedmaxsim.__file__).resolve().parent.parent)
    with tempfile.TemporaryDirectory(prefix="fusedmaxsim-cold-") as cache_dir:
        env = dict(os.environ, TRITON_CACHE_DIR=cache_dir, LIK_SUPPRESS_NORM_WARN="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-c", _COLD_CHILD, provider_key, shape_name, mode, str(device)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            row.update(status="failed", error=f"timed out after {timeout_s:.0f} s")
            return row
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        row.update(status="failed", error=f"exit {proc.returncode}: {tail[0][:300]}")
        return row
    row.update(json.loads(lines[-1]), status="ok")
    return row


def cold_start_child(argv) -> int:
    """Runs inside the fresh process of ``run_cold_start``: prints one JSON line.

    Imports and input creation happen before the clock starts; the first call's time is
    compilation, autotuning and the call itself. So does torch's own first ``backward(grad)``:
    on a tensor gradient it imports ``torch.fx.experimental.symbolic_shapes`` (and sympy), a
    one-time cost of torch that a trivial graph pays as well (1.5-4 s measured on the H200's
    host); it is timed on a two-element graph and reported as ``torch_backward_s``.
    """
    provider_key, shape_name, mode, device_name = argv
    device = torch.device(device_name)
    provider = PROVIDERS_BY_KEY[provider_key]
    sync = _sync_fn(device)
    start = time.perf_counter()
    if provider.module:
        importlib.import_module(provider.module)
    import_s = time.perf_counter() - start
    case = make_case(SHAPES_BY_NAME[shape_name], mode, device)
    torch_backward_s = None
    if case.training:
        x = torch.ones(2, device=device, requires_grad=True)
        sync()
        start = time.perf_counter()
        (x * 2).backward(torch.ones_like(x))
        sync()
        torch_backward_s = time.perf_counter() - start
    sync()
    score = provider.build(case)
    first = run_once(score, case, sync)[2]
    second = run_once(score, case, sync)[2]
    print(json.dumps({"import_s": import_s, "torch_backward_s": torch_backward_s,
                      "first_call_s": first, "second_call_s": second}))
    return 0


# ---------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _fusedmaxsim_version() -> str | None:
    try:
        import fusedmaxsim
    except ImportError:
        return None
    return getattr(fusedmaxsim, "__version__", None) or _dist_version("fusedmaxsim")


def _git(args, cwd) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def git_state() -> tuple:
    """``$FUSEDMAXSIM_GIT_SHA`` when set (a copy whose ``.git`` may not match its files), else
    (sha, dirty) of the checkout this module lives in.

    The checkout must be this project's (it has ``src/fusedmaxsim``), so an installed copy
    inside some other repository never reports that repository's commit.
    """
    if os.environ.get("FUSEDMAXSIM_GIT_SHA"):
        return os.environ["FUSEDMAXSIM_GIT_SHA"], None
    here = Path(__file__).resolve().parent
    top = _git(["rev-parse", "--show-toplevel"], here)
    if top and (Path(top) / "src" / "fusedmaxsim").is_dir():
        sha = _git(["rev-parse", "HEAD"], here)
        if sha:
            status = _git(["status", "--porcelain", "--untracked-files=no"], here)
            return sha, bool(status)
    return None, None


def _nvidia_driver() -> str | None:
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = proc.stdout.strip().splitlines()
    return lines[0].strip() if proc.returncode == 0 and lines else None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device) -> dict:
    """Everything a reader needs to trust or reproduce a record."""
    device = torch.device(device)
    sha, dirty = git_state()
    env = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _dist_version("triton"),
        "fusedmaxsim": _fusedmaxsim_version(),
        "git_sha": sha,
        "git_dirty": dirty,
        "late_interaction_kernels": _dist_version("late_interaction_kernels"),
        "flash_maxsim": _dist_version("flash_maxsim"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}", driver=_nvidia_driver(),
                   cuda=torch.version.cuda,
                   tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    else:
        env.update(gpu=None, cpu=_cpu_name(), threads=torch.get_num_threads())
    return env


def device_slug(device=None) -> str:
    """Short directory name for a device's results: ``h200`` for an NVIDIA H200, else ``cpu``."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        return "cpu"
    words = torch.cuda.get_device_name(device).lower().replace("nvidia", "").split()
    return words[0] if words else "gpu"


# ---------------------------------------------------------------------------------------------
# Output: JSON, markdown, PNG
# ---------------------------------------------------------------------------------------------


def _clean(value):
    """JSON-safe copy: non-finite floats become null, since they were not measured numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def new_record_file(env: dict) -> dict:
    return {"schema": SCHEMA, "env": env, "suite": None, "memory_table": None, "cold_start": None}


def load_record_file(out_dir: Path) -> dict | None:
    path = Path(out_dir) / f"{RECORD_STEM}.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if record.get("schema") == SCHEMA else None


def _write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file, so a run killed mid-write leaves the old file whole."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_outputs(record: dict, out_dir: Path, plot: bool = False) -> list:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{RECORD_STEM}.json", out_dir / f"{RECORD_STEM}.md"]
    _write_atomic(paths[0], json.dumps(_clean(record), indent=1, allow_nan=False) + "\n")
    _write_atomic(paths[1], render_markdown(record))
    if plot:
        png = write_plot(record, out_dir / f"{RECORD_STEM}.png")
        if png is not None:
            paths.append(png)
    return paths


def _ms(x) -> str:
    if x is None:
        return "–"
    return f"{x:.3f}" if x < 100 else f"{x:.1f}"


def _num(x, fmt="{:.1f}") -> str:
    return "–" if x is None else fmt.format(x)


def _err(x) -> str:
    return "–" if x is None else f"{x:.0e}"


def _table(header: list, rows: list) -> list:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def _header_lines(env: dict) -> list:
    if env.get("gpu"):
        device = (f"- GPU: {env['gpu']} ({env.get('gpu_memory_gib')} GiB, "
                  f"sm {env.get('capability')}), driver {env.get('driver') or 'unknown'}, "
                  f"CUDA {env.get('cuda')}")
    else:
        device = f"- device: CPU, {env.get('cpu')} ({env.get('threads')} threads)"
    peers = ", ".join(f"{name} {env[key]}" for key, name in
                      (("late_interaction_kernels", "late-interaction-kernels"),
                       ("flash_maxsim", "flash-maxsim")) if env.get(key))
    sha = env.get("git_sha") or "unknown"
    if env.get("git_dirty"):
        sha += " (with uncommitted changes)"
    return [
        device,
        (f"- torch {env.get('torch')}, triton {env.get('triton') or 'not installed'}, "
         f"fusedmaxsim {env.get('fusedmaxsim')}; peers: {peers or 'none'}"),
        f"- git: {sha}",
        f"- date: {env.get('date')}",
    ]


def render_markdown(record: dict) -> str:
    suite = record.get("suite")
    env = (suite or {}).get("env") or record.get("env") or {}
    lines = ["# MaxSim benchmark", "", *_header_lines(env), ""]
    if suite:
        lines += _suite_markdown(suite)
    if record.get("memory_table"):
        lines += _memory_markdown(record["memory_table"])
    if record.get("cold_start"):
        lines += _cold_markdown(record["cold_start"])
    return "\n".join(lines) + "\n"


def _providers_in(records) -> list:
    present = {r["provider"] for r in records}
    return [p for p in PROVIDERS if p.key in present]


def _cell(record: dict | None) -> str:
    if record is None:
        return "–"
    if record["status"] == "ok":
        mark = "" if record["parity_ok"] in (True, None) else " ≠"
        return _ms(record["ms"]) + mark
    return record["status"]


def _suite_markdown(suite: dict) -> list:
    settings, ceilings = suite["settings"], suite.get("ceilings")
    rounds = settings.get("rounds")
    timing = (f", in {rounds} interleaved rounds of rep / {rounds} each, each round in another "
              f"provider order, all calls pooled" if rounds else "")
    lines = [(f"Timer: {settings['timer']} (warmup {settings['warmup_ms']:g} ms, "
              f"rep {settings['rep_ms']:g} ms{timing}), median of one call in ms.")]
    if ceilings:
        lines.append(f"Ceilings measured in this run: {ceilings['matmul_tflops']:.3g} TFLOP/s "
                     f"({ceilings['matmul']} matmul), {ceilings['copy_gbps']:.4g} GB/s "
                     f"(device copy, read + write). Floor = max(flops / rate, bytes / bandwidth).")
    elif suite.get("ceilings_error"):
        lines.append(f"Ceilings not measured: {suite['ceilings_error']}")
    records = suite["records"]
    providers = _providers_in(records)
    by_item: dict = {}
    for r in records:
        by_item.setdefault((r["shape"], r["mode"]), {})[r["provider"]] = r
    shape_desc = {s["name"]: s["description"] for s in suite["shapes"]}

    lines += ["", "## Times (ms)", ""]
    rows = []
    for (shape, mode), recs in by_item.items():
        floor = next((r["floor_ms"] for r in recs.values() if r["floor_ms"] is not None), None)
        rows.append([shape, shape_desc.get(shape, ""), MODE_LABELS[mode], _ms(floor),
                     *[_cell(recs.get(p.key)) for p in providers]])
    lines += _table(["shape", "layout", "mode", "floor", *[p.label for p in providers]], rows)
    lines += ["", "≠: a baseline outside the parity tolerance (timed anyway; see accuracy)."]

    lines += ["", "## fusedmaxsim against the targets", ""]
    lines += _targets_table(suite["summary"])
    geo = suite.get("geomean") or {}
    lines += ["", (f"Geometric mean speedup: {_num(geo.get('speedup_vs_peer'), '{:.2f}×')} "
                   f"against the fastest passing peer ({geo.get('n_speedup_vs_peer', 0)} shapes), "
                   f"{_num(geo.get('speedup_vs_naive'), '{:.2f}×')} against naive "
                   f"({geo.get('n_speedup_vs_naive', 0)} shapes).")]

    lines += ["", ("## Accuracy (relative error against float64: scores / gradients, max norm "
                   "(Frobenius norm))"), ""]
    rows = []
    for (shape, mode), recs in by_item.items():
        cells = []
        for p in providers:
            r = recs.get(p.key)
            if r is None or r["score_rel_err"] is None:
                cells.append("–")
                continue
            grad = max(filter(None, [r["grad_q_rel_err"], r["grad_d_rel_err"]]), default=None)
            fro = max(filter(None, [r.get("grad_q_fro_err"), r.get("grad_d_fro_err")]),
                      default=None)
            text = _err(r["score_rel_err"]) + (f" / {_err(grad)} ({_err(fro)})"
                                               if mode == "training" else "")
            cells.append(text + ("" if r["parity_ok"] else " ✗"))
        rows.append([shape, MODE_LABELS[mode], *cells])
    lines += _table(["shape", "mode", *[p.label for p in providers]], rows)
    lines += ["", ("✗: outside the tolerance (scores in the max norm 2e-2 bf16 / 5e-3 fp16 / "
                   f"1e-2 fp32; gradients in the Frobenius norm {GRAD_TOL:.0e}; a near-tie of the "
                   "max decided otherwise than in float64 moves a whole gradient row, which the "
                   "max norm reports at that row's size).")]

    problems = [r for r in records if r["status"] in ("failed", "skipped") and r["error"]]
    if problems:
        lines += ["", "## Failed and skipped", ""]
        lines += [f"- {r['shape']} {MODE_LABELS[r['mode']]} {r['provider']}: {r['status']}, "
                  f"{r['error']}" for r in problems]
    return lines + [""]


def _targets_table(summary: list) -> list:
    header = ["shape", "mode", "fusedmaxsim ms [p20, p80]", "best peer ms",
              f"× best peer (≥ {TARGET_VS_PEER})", "× naive", f"% floor (≥ {TARGET_PCT_FLOOR:.0f})",
              "wall µs/call", "TFLOP/s", "peak MiB ours / LIK / flash",
              "anchor best peer → target ms", "targets"]
    rows = []
    for row in summary:
        ours = _ms(row["fusedmaxsim_ms"])
        if row["fusedmaxsim_ms"] is not None:
            ours += f" [{_ms(row['fusedmaxsim_p20_ms'])}, {_ms(row['fusedmaxsim_p80_ms'])}]"
        elif row["fusedmaxsim_status"]:
            ours = row["fusedmaxsim_status"]
        peer = "–"
        if row["best_peer"]:
            peer = f"{_ms(row['best_peer_ms'])} ({PROVIDERS_BY_KEY[row['best_peer']].label})"
        peaks = " / ".join(_num(row["peak_mib"].get(k)) for k in ("fusedmaxsim", "lik", "flash"))
        anchor = "–"
        if row["anchor_best_peer_ms"] is not None:
            anchor = f"{_ms(row['anchor_best_peer_ms'])} → {_ms(row['anchor_target_ms'])}"
        rows.append([row["shape"], MODE_LABELS[row["mode"]], ours, peer,
                     _num(row["speedup_vs_peer"], "{:.2f}"),
                     _num(row["speedup_vs_naive"], "{:.2f}"),
                     _num(row["pct_floor"], "{:.0f}"), _num(row["wall_us"]),
                     _num(row["tflops"], "{:.3g}"), peaks, anchor, _targets_text(row["targets"])])
    lines = _table(header, rows)
    lines += ["", (f"Targets: peer ≥ {TARGET_VS_PEER}× the fastest passing peer; floor ≥ "
                   f"{TARGET_PCT_FLOOR:.0f}% of the roofline floor where it is ≥ "
                   f"{FLOOR_TARGET_MIN_MS * 1e3:.0f} µs; wall ≤ "
                   f"{TARGET_WALL_US['inference']:.0f} µs fwd / "
                   f"{TARGET_WALL_US['training']:.0f} µs fwd+bwd per call where the floor is "
                   f"< {TINY_FLOOR_MS * 1e3:.0f} µs; naive: never slower than naive or naive "
                   "fp32. Anchor: the fastest peer as recorded on an H200 on 2026-11-30, not in "
                   "this run.")]
    return lines


def _targets_text(targets: dict) -> str:
    names = {"vs_peer": "peer", "pct_floor": "floor", "wall_us": "wall",
             "not_slower_than_naive": "naive"}
    parts = [f"{names[k]} {'✓' if t['met'] else '✗'}" for k, t in targets.items() if t["applies"]]
    return ", ".join(parts) or "–"


def _memory_markdown(section: dict) -> list:
    lines = ["## Op-level memory: ColPali in-batch training", "",
             (f"Nq = Nd = B, Lq = {section['lq']}, Ld = {section['ld']}, {section['dtype']}: "
              "memory held from forward to backward / the backward's spike above it / total, "
              "MiB. Fused providers run one step first, so autotune buffers are not counted."),
             ""]
    if section.get("skipped"):
        return lines + [f"Skipped: {section['skipped']}", ""]
    keys = list(dict.fromkeys(r["provider"] for r in section["rows"]))
    by = {(r["batch"], r["provider"]): r for r in section["rows"]}
    rows = []
    for batch in dict.fromkeys(r["batch"] for r in section["rows"]):
        cells = []
        for key in keys:
            r = by.get((batch, key))
            if r is None or r["status"] != "ok":
                cells.append("–" if r is None else r["status"])
            else:
                cells.append(f"{r['held_mib']:.0f} / {r['spike_mib']:.0f} / {r['total_mib']:.0f}")
        rows.append([batch, *cells])
    labels = [PROVIDERS_BY_KEY[k].label + " held / spike / total" for k in keys]
    lines += _table(["B", *labels], rows)
    errors = [r for r in section["rows"] if r["error"]]
    lines += [""] + [f"- B={r['batch']} {r['provider']}: {r['status']}, {r['error']}"
                     for r in errors]
    return lines + [""]


def _cold_markdown(section: dict) -> list:
    lines = ["## Cold start", "",
             ("First call in a fresh process with an empty TRITON_CACHE_DIR (compilation and "
              "autotuning included, imports excluded), seconds; the second call in brackets. "
              "Before a training call's clock starts, torch's own first `backward(grad)` runs on "
              "a two-element graph (it imports sympy once per process); its seconds are the last "
              "column."),
             ""]
    keys = list(dict.fromkeys(r["provider"] for r in section["rows"]))
    by = {(r["shape"], r["mode"], r["provider"]): r for r in section["rows"]}
    rows = []
    for shape, mode in dict.fromkeys((r["shape"], r["mode"]) for r in section["rows"]):
        cells = []
        for key in keys:
            r = by.get((shape, mode, key))
            if r is None or r["status"] != "ok":
                cells.append("–" if r is None else r["status"])
            else:
                cells.append(f"{r['first_call_s']:.2f} ({r['second_call_s']:.4f})")
        torch_s = [r.get("torch_backward_s") for r in section["rows"]
                   if (r["shape"], r["mode"]) == (shape, mode) and r.get("torch_backward_s")]
        cells.append(" / ".join(f"{t:.2f}" for t in torch_s) or "–")
        rows.append([shape, MODE_LABELS[mode], *cells])
    lines += _table(["shape", "mode", *[PROVIDERS_BY_KEY[k].label for k in keys],
                     "torch's first backward(grad), excluded"], rows)
    errors = [r for r in section["rows"] if r["error"]]
    lines += [""] + [f"- {r['shape']} {r['provider']}: {r['status']}, {r['error']}"
                     for r in errors]
    return lines + [""]


def write_plot(record: dict, path: Path) -> Path | None:
    """Speedup over naive per provider and share of the floor, one row per (shape, mode)."""
    suite = record.get("suite")
    if not suite or not suite["records"]:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed; no plot", file=sys.stderr)
        return None
    by_item: dict = {}
    for r in suite["records"]:
        if r["status"] == "ok":
            by_item.setdefault((r["shape"], r["mode"]), {})[r["provider"]] = r
    items = list(by_item)
    if not items:
        return None
    shown = [p for p in _providers_in(suite["records"]) if p.key != "naive"]
    has_floor = any(r.get("pct_floor") for recs in by_item.values() for r in recs.values())
    fig, axes = plt.subplots(1, 2 if has_floor else 1, figsize=(15 if has_floor else 9,
                             1.5 + 0.45 * len(items)), sharey=True, squeeze=False)
    labels = [f"{shape} {MODE_LABELS[mode]}" for shape, mode in items]
    height = 0.8 / max(1, len(shown))
    for k, provider in enumerate(shown):
        speedups, floors = [], []
        for item in items:
            recs = by_item[item]
            r, naive = recs.get(provider.key), recs.get("naive")
            speedups.append(naive["ms"] / r["ms"] if r and naive else 0.0)
            floors.append((r["pct_floor"] or 0.0) if r else 0.0)
        ys = [i + (k - (len(shown) - 1) / 2) * height for i in range(len(items))]
        axes[0][0].barh(ys, speedups, height=height, label=provider.label)
        if has_floor:
            axes[0][1].barh(ys, floors, height=height, label=provider.label)
    ax = axes[0][0]
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("speedup over naive (higher is better; missing bar: failed or not run)")
    ax.set_yticks(range(len(items)), labels)
    ax.invert_yaxis()
    ax.legend(loc="lower right", fontsize="small")
    if has_floor:
        axes[0][1].axvline(TARGET_PCT_FLOOR, color="black", linestyle="--", linewidth=0.8)
        axes[0][1].set_xlabel("% of the roofline floor (target: 60% where floor ≥ 50 µs)")
    env = suite.get("env") or {}
    device = env.get("gpu") or f"CPU ({env.get('cpu')})"
    fig.suptitle(f"MaxSim: {device}, torch {env.get('torch')}, "
                 f"git {(env.get('git_sha') or 'unknown')[:10]}, {env.get('date')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# Progress and small helpers
# ---------------------------------------------------------------------------------------------


class Progress:
    """A tiny progress bar on stderr.

    On a terminal it redraws one line; into a log file it writes one line per finished item,
    with its result, so the log doubles as a transcript.
    """

    def __init__(self, total: int, stream=None, width: int = 24, enabled: bool = True):
        self.total = max(1, total)
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.enabled = enabled
        self.count = 0
        self.label = ""
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def _bar(self) -> str:
        filled = self.width * self.count // self.total
        return f"[{'#' * filled}{'.' * (self.width - filled)}] {self.count}/{self.total}"

    def start(self, label: str) -> None:
        self.label = label
        if self.enabled and self.tty:
            self.stream.write(f"\r\033[K{self._bar()} {label}")
            self.stream.flush()

    def done(self, result: str = "") -> None:
        self.count += 1
        if not self.enabled:
            return
        if self.tty:
            self.stream.write(f"\r\033[K{self._bar()} {self.label}: {result}")
        else:
            self.stream.write(f"{self._bar()} {self.label}: {result}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _result_text(record: dict) -> str:
    if record["status"] == "ok":
        return f"{_ms(record['ms'])} ms"
    return f"{record['status']} ({record['error']})"


def _describe(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text[:300]


def _release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``fusedmaxsim bench`` (and of ``benchmarks/bench_maxsim.py``)."""
    parser.add_argument(
        "--shapes", default=None,
        help="comma-separated shape names, or 'all' (the sixteen anchor shapes), 'quick' (small "
             "shapes for a CPU), 'none' (run only the sections below). Default: all on CUDA, "
             "quick on CPU.")
    parser.add_argument(
        "--modes", default="native",
        help="'native' (each shape in the mode its anchors were measured in), or a comma list "
             "of inference, training: every shape in each of them. Default: native.")
    parser.add_argument(
        "--providers", default=None,
        help=f"comma list from {', '.join(PROVIDERS_BY_KEY)}. Default: fusedmaxsim and the "
             "naive baselines (compile_fp32 on CUDA only), plus the peers with --peers.")
    parser.add_argument("--peers", action="store_true",
                        help="also time late-interaction-kernels and flash-maxsim when importable")
    parser.add_argument("--device", default=None,
                        help="torch device; default: cuda when available, else cpu")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help=f"write {RECORD_STEM}.json and .md (and .png with --plot) into DIR")
    parser.add_argument("--append", action="store_true",
                        help="keep the sections of the record already in --out that this run "
                             "does not measure")
    parser.add_argument("--json", action="store_true",
                        help="print the JSON record on stdout instead of the markdown")
    parser.add_argument("--plot", action="store_true", help="also draw a PNG (needs matplotlib)")
    parser.add_argument("--memory-table", action="store_true",
                        help="op-level memory of ColPali in-batch training (CUDA only)")
    parser.add_argument("--memory-batches", default=",".join(map(str, MEMORY_BATCHES)),
                        help="batch sizes of the memory table")
    parser.add_argument("--cold-start", action="store_true",
                        help="first-call seconds in fresh processes with an empty Triton cache")
    parser.add_argument("--cold-timeout-s", type=float, default=60.0,
                        help="limit for each cold-start process")
    parser.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warmup")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="do_bench rep")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no new suite item after this many seconds; the rest are "
                             "recorded as skipped")
    parser.add_argument("--compile-budget-s", type=float, default=90.0,
                        help="total seconds torch.compile may spend compiling before the "
                             "remaining compile_fp32 items are skipped")
    return parser


def select_shapes(spec: str | None, device: torch.device) -> list:
    spec = spec or ("all" if device.type == "cuda" else "quick")
    shapes = []
    for name in filter(None, (s.strip() for s in spec.split(","))):
        if name == "none":
            continue
        elif name == "all":
            shapes += SHAPES
        elif name == "quick":
            shapes += QUICK_SHAPES
        elif name in SHAPES_BY_NAME:
            shapes.append(SHAPES_BY_NAME[name])
        else:
            raise ValueError(f"unknown shape {name!r}; known: all, quick, none, "
                             + ", ".join(SHAPES_BY_NAME))
    return list(dict.fromkeys(shapes))


def parse_modes(spec: str) -> list | None:
    if spec in (None, "", "native"):
        return None
    modes = []
    for name in filter(None, (s.strip() for s in spec.split(","))):
        if name not in _MODE_ALIASES:
            raise ValueError(f"unknown mode {name!r}; known: native, inference, training")
        modes.append(_MODE_ALIASES[name])
    return list(dict.fromkeys(modes))


def select_providers(spec: str | None, peers: bool, device: torch.device) -> list:
    if spec:
        keys = []
        for name in filter(None, (s.strip() for s in spec.split(","))):
            key = _PROVIDER_ALIASES.get(name, name)
            if key not in PROVIDERS_BY_KEY:
                known = ", ".join(PROVIDERS_BY_KEY)
                raise ValueError(f"unknown provider {name!r}; known: {known}")
            keys.append(key)
    else:
        keys = ["fusedmaxsim", *(PEER_KEYS if peers else ()), "naive", "naive_fp32"]
        if device.type == "cuda":
            keys.append("compile_fp32")
    return [PROVIDERS_BY_KEY[k] for k in dict.fromkeys(keys)]


def run_bench(args: argparse.Namespace) -> int:
    """Runs what ``args`` asks for and prints the markdown (or, with ``--json``, the record).

    Returns 0 on success, 1 if fusedmaxsim failed on some suite item, 2 on bad arguments.
    """
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("CUDA is not available")
        shapes = select_shapes(args.shapes, device)
        modes = parse_modes(args.modes)
        providers = select_providers(args.providers, args.peers, device)
        batches = [int(b) for b in str(args.memory_batches).split(",") if b.strip()]
    except ValueError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    os.environ.setdefault("LIK_SUPPRESS_NORM_WARN", "1")

    env = environment(device)
    previous = load_record_file(args.out) if args.append and args.out is not None else None
    record = previous or new_record_file(env)
    record["env"] = env

    def saver(name):
        """Stores a (partial) section and rewrites the files, so an interrupted run keeps it."""
        def save(section):
            record[name] = section
            if args.out is not None:
                write_outputs(record, args.out, plot=False)
        return save

    saver("env")(env)  # without --append, this replaces any stale record right away
    if shapes:
        total = sum(len(modes_for(s, modes)) for s in shapes) * len(providers)
        saver("suite")(run_suite(
            shapes, modes, providers, device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
            budget_s=args.budget_s, compile_budget_s=args.compile_budget_s,
            progress=Progress(total), on_update=saver("suite")))
    if args.memory_table:
        selected = {p.key for p in providers}
        mem_providers = [PROVIDERS_BY_KEY[k] for k in MEMORY_PROVIDERS if k in selected]
        saver("memory_table")(run_memory_table(
            mem_providers, device, batches, progress=Progress(len(batches) * len(mem_providers)),
            on_update=saver("memory_table")))
    if args.cold_start:
        n_cases = len(COLD_START_CASES["cuda" if device.type == "cuda" else "cpu"])
        n_contenders = sum(p.role != "baseline" for p in providers)
        saver("cold_start")(run_cold_start(
            providers, device, args.cold_timeout_s, progress=Progress(n_cases * n_contenders),
            on_update=saver("cold_start")))

    _emit(record, args)
    suite = record.get("suite") if shapes else None
    ours_failed = bool(suite) and any(r["role"] == "ours" and r["status"] == "failed"
                                      for r in suite["records"])
    return 1 if ours_failed else 0


def _emit(record: dict, args: argparse.Namespace) -> None:
    """Final files (with the plot when asked) and the report on stdout."""
    written = []
    if args.out is not None:
        written = write_outputs(record, args.out, plot=args.plot)
    elif args.plot:
        png = write_plot(record, Path(f"{RECORD_STEM}.png"))
        written = [png] if png else []
    for path in written:
        print(f"bench: wrote {path}", file=sys.stderr)
    if args.json:
        print(json.dumps(_clean(record), indent=1, allow_nan=False))
    else:
        print(render_markdown(record), end="")
