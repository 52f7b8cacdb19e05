"""The benchmark problems and their inputs.

The modes (``inference`` is ``fwd``, ``training`` is ``fwd+bwd``) and their aliases; the
sixteen anchor shapes (:data:`SHAPES`) whose peer numbers were recorded on an H200 and travel
with the records as the numbers to beat (:class:`Anchor`); the small :data:`QUICK_SHAPES` that
exercise every code path in seconds on a CPU; and :func:`make_case`, which builds the inputs of
one (shape, mode) from a seed that depends only on the shape's name, so every provider, every
run and the cold-start subprocesses see the same tensors (:class:`Case`).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

MODES = ("inference", "training")
MODE_LABELS = {"inference": "fwd", "training": "fwd+bwd"}
MODE_ALIASES = {"inference": "inference", "fwd": "inference", "training": "training",
                 "train": "training", "fwd+bwd": "training", "fwd_bwd": "training"}


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
