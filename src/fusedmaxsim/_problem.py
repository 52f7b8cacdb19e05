"""What a call asks for: the :class:`Problem` and :class:`Options` values, and every argument check.

The front doors (``api.py``, ``retrieval.py``) check their arguments here, bring them to one of
the layouts below, and describe the call as a :class:`Problem`: a hashable value of plain facts
(layout, sizes, dtype, device, which masks exist, normalization, reduction, whether the argmax
is saved). :class:`Options` holds the settings that decide how it runs, resolved once per call
from :mod:`fusedmaxsim.settings`. The planner (``_plan``) turns the two into launch plans.

Layouts
-------
* ``cross``: ``Q [Nq, Lq, d]`` against every document of ``D [Nd, Ld, d]``: ``Ncols = Nd``.
* ``candidates``: ``Q [Nq, Lq, d]`` against its own ``D [Nq, K, Ld, d]``: ``Ncols = K``
  (``maxsim_pairs``' diagonal pairs are candidates with ``K = 1``).
* ``packed``: packed queries against a range of packed documents (``RaggedLayout``), ``Lq`` and
  ``Ld`` the promised maxima; ``Ncols`` the documents of the range.
* ``pairs``: a pair list over packed sequences; ``Ncols`` the number of pairs.
* ``residual``: ``Q [Nq, Lq, d]`` against every document of a PLAID (ColBERTv2) index, each token
  stored as a centroid id and ``nbits``-bit residual codes (:class:`ResidualDocs`): ``Ncols = Nd``;
  ``Ld`` a bound on the documents' lengths.
* ``residual candidates``: the same, each query against its own candidate documents of the index
  (``ResidualDocs.doc_ids [Nq, C]``, the search's rerank): ``Ncols = C``.
* ``approx`` / ``approx candidates``: PLAID's approximate score, query-centroid scores gathered
  by the documents' centroid ids (every document, or each query's candidates); no gradient.

Every error names the argument and the shapes, and is raised before anything is launched.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import operator
from typing import NamedTuple

import torch
from torch import Tensor

from . import settings

CROSS, CANDIDATES, PACKED, PAIRS, RESIDUAL = "cross", "candidates", "packed", "pairs", "residual"
RESIDUAL_CANDIDATES = "residual candidates"
RESIDUAL_LAYOUTS = (RESIDUAL, RESIDUAL_CANDIDATES)
# Documents given as hidden states, projected (F.linear) inside: every document, or per query.
HIDDEN, HIDDEN_CANDIDATES = "hidden", "hidden candidates"
HIDDEN_LAYOUTS = (HIDDEN, HIDDEN_CANDIDATES)


class Problem(NamedTuple):
    """What is computed (hashable: the planner's cache key, with :class:`Options`)."""

    layout: str  # CROSS, CANDIDATES, PACKED, PAIRS, a residual or an approx layout
    Nq: int  # queries
    Ncols: int  # columns of the scores: documents, candidates or pairs
    Lq: int  # query tokens (packed: the longest)
    Ld: int  # document tokens (packed: the longest)
    dim: int
    dtype: torch.dtype
    device: torch.device
    has_q_mask: bool
    has_d_mask: bool
    normalize: bool  # L2-normalized tokens
    norm_from_tiles: bool  # ... their norms computed from the tiles on chip (inference)
    tau: float  # 0: the max; > 0: the smooth max's temperature
    save_argmax: bool  # a gradient will be needed
    tma_ready: bool  # D contiguous and 16-byte aligned (the Gluon forward's TMA)
    d_model: int = 0  # hidden layouts: the hidden states' width (0 elsewhere)
    has_bias: bool = False  # hidden layouts: the projection has a bias
    nbits: int = 0  # residual layouts: bits a residual code (0 elsewhere)

    def describe(self) -> str:
        reduction = f"smoothmax(tau={self.tau})" if self.tau else "max"
        norm = ("normalized, norms from the tiles" if self.norm_from_tiles
                else "normalized" if self.normalize else "not normalized")
        masks = [name for name, has in (("q_mask", self.has_q_mask), ("d_mask", self.has_d_mask))
                 if has]
        return (f"{self.layout}: Nq={self.Nq} Ncols={self.Ncols} Lq={self.Lq} Ld={self.Ld} "
                f"d={self.dim} {str(self.dtype).removeprefix('torch.')} on {self.device}; "
                f"{reduction}, {norm}, masks: {', '.join(masks) or 'none'}; "
                f"{'saves the argmax' if self.save_argmax else 'inference'}")


class Options(NamedTuple):
    """How it may run: resolved once per call from the settings (hashable)."""

    backend: str  # "triton" or "torch" (resolved from "auto" for the inputs' device)
    fp32_precision: str  # "tf32", "tf32x3" or "ieee" ("torch" while compiling: the op resolves it)
    exact_ties: bool
    autotune: bool
    hopper_kernel: bool
    torch_block_bytes: int  # the PyTorch path's bound on similarities held at a time

    def describe(self) -> str:
        return (f"backend={self.backend} fp32_precision={self.fp32_precision} "
                f"exact_ties={self.exact_ties} autotune={self.autotune} "
                f"hopper_kernel={self.hopper_kernel} torch_block_bytes={self.torch_block_bytes}")


def options_for(t: Tensor, backend: str | None = None, fp32_precision: str | None = None) -> Options:
    """The settings in force for inputs like ``t`` (``backend`` and ``fp32_precision`` where the
    caller resolved them already)."""
    precision, exact_ties, autotune, hopper_kernel, block_bytes = settings.snapshot()
    if fp32_precision is not None:
        precision = fp32_precision
    if backend is None:
        backend = select_backend(t)
    if precision == "torch" and backend == "triton" and not torch.compiler.is_compiling():
        # Resolved at every call: PyTorch's setting can change at any time. A compiled front door
        # passes "torch" on to the registered op, which resolves it when it runs (reading
        # PyTorch's setting inside a trace would break the graph). The PyTorch path's products
        # follow PyTorch's setting by themselves.
        precision = settings.torch_fp32_precision()
    return Options(backend, precision, exact_ties, autotune, hopper_kernel, block_bytes)


def dense_problem(Q: Tensor, D: Tensor, q_mask, d_mask, *, normalize: bool = False,
                  norm_from_tiles: bool = False, tau: float = 0.0,
                  save_argmax: bool = False) -> Problem:
    """The :class:`Problem` of ``Q [Nq, Lq, d]`` against ``D [Nd, Ld, d]`` or ``[Nq, K, Ld, d]``."""
    d_shape = D.shape
    Nq, Lq, dim = Q.shape
    return Problem(
        CANDIDATES if len(d_shape) == 4 else CROSS, Nq, d_shape[-3], Lq, d_shape[-2], dim,
        Q.dtype, Q.device, q_mask is not None, d_mask is not None, normalize or norm_from_tiles,
        norm_from_tiles, tau, save_argmax, _tma_ready(D),
    )


def _tma_ready(D: Tensor) -> bool:
    """Whether the Gluon forward's TMA can read ``D`` as it is: a contiguous 16-bit CUDA cross
    product, 16-byte aligned (not decided while tracing: the op decides when it runs)."""
    if not (D.is_cuda and D.dim() == 3 and D.element_size() == 2 and D.is_contiguous()
            and not torch.compiler.is_compiling()):
        return False
    try:
        return D.data_ptr() % 16 == 0
    except RuntimeError:  # a fake tensor (an op's autograd traced by torch.compile): no address
        return False


def residual_problem(docs: ResidualDocs, Q: Tensor, q_mask, *, normalize: bool,
                     save_argmax: bool) -> Problem:
    """The :class:`Problem` of ``Q [Nq, Lq, d]`` against the compressed documents ``docs``: the
    documents' dtype is the centroids', promoted with the queries' (the similarities are fp32, or
    float64 for float64); ``Ld`` the bound on their lengths."""
    Nq, Lq, dim = Q.shape
    return Problem(
        RESIDUAL if docs.doc_ids is None else RESIDUAL_CANDIDATES, Nq, docs.n_cols, Lq,
        docs.codes.shape[0] if docs.max_len is None else docs.max_len, dim, torch.promote_types(Q.dtype, docs.centroids.dtype),
        Q.device, q_mask is not None, True, normalize, False, 0.0, save_argmax, False,
        nbits=docs.nbits,
    )


def packed_problem(layout: RaggedLayout, Q: Tensor, q_mask, d_mask, *,
                   normalize: bool = False, save_argmax: bool = False) -> Problem:
    """The :class:`Problem` of packed tokens ``Q [ΣLq, d]`` scored as ``layout`` says."""
    pairs = layout.pair_q is not None
    return Problem(
        PAIRS if pairs else PACKED, layout.n_queries, layout.n_pairs if pairs else layout.n_cols,
        layout.max_q, layout.max_d, Q.shape[1], Q.dtype, Q.device, q_mask is not None,
        d_mask is not None, normalize, False, 0.0, save_argmax, False,
    )


class DenseInputs(NamedTuple):
    """``Q [Nq, Lq, d]``; ``D [Nd, Ld, d]`` (cross product) or ``[Nq, K, Ld, d]`` (candidates)."""

    Q: Tensor
    D: Tensor
    q_mask: Tensor | None  # bool [Nq, Lq]
    d_mask: Tensor | None  # bool, D's token axes
    squeeze_q: bool
    squeeze_d: bool


def _to_device(t: Tensor, device: torch.device) -> Tensor:
    """A host index tensor on the tokens' device, copied without synchronizing the host."""
    if t.device == device:
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# ------------------------------------------------------------------------------------------------
# Dense arguments
# ------------------------------------------------------------------------------------------------

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BACKWARD_STRATEGIES = ("auto", "unified", "lowmem")


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _check_float(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype} with shape {_shape(t)}"
        )
    return t


# The token axes of a dense tensor, by its number of dimensions, as masks spell them.
Q_AXES = {2: "[Lq]", 3: "[Nq, Lq]"}
D_AXES = {2: "[Ld]", 3: "[Nd, Ld]", 4: "[Nq, K, Ld]"}


def _check_mask(
    name: str, mask: object, expected: tuple[int, ...], owner: str, device,
    axes: str = "the token axes", dims: str | None = None,
) -> Tensor | None:
    """A mask of shape ``expected`` on ``device``, as bool. ``dims`` names its axes (``"[Nq, Lq]"``)
    in the message of a wrong shape."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.is_complex():
        raise TypeError(f"{name} must be bool or real-valued (nonzero = valid), got {mask.dtype}")
    if mask.device != device:
        raise ValueError(
            f"{name} is on {mask.device} but {owner} is on {device}: {name} must be on the same "
            f"device as {owner}"
        )
    if _shape(mask) != expected:
        if dims is None:
            raise ValueError(
                f"{name} must have shape {expected} ({axes} of {owner}), got {_shape(mask)}"
            )
        raise ValueError(
            f"{name} must be {dims} = {expected} ({axes} of {owner}), got {_shape(mask)}"
        )
    return mask if mask.dtype == torch.bool else mask != 0


def check_bool(name: str, value: object) -> bool:
    """A boolean option: Python ``True`` or ``False`` only (no 0/1, strings, NumPy or tensor
    booleans), so that ``normalize="no"`` cannot pass as true."""
    if value is True or value is False:
        return value
    raise TypeError(f"{name} must be True or False (a Python bool), got {value!r}")


REDUCTIONS = ("max", "smoothmax")


def check_reduction(reduction: object, tau: object) -> float:
    """``reduction=`` and ``tau=`` as the ``tau`` the kernels take: 0.0 for the max."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction= must be one of {REDUCTIONS}, got {reduction!r}")
    if reduction == "max":
        return 0.0
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0:
        raise ValueError(f"tau= must be a finite number > 0 for reduction='smoothmax', got {tau!r}")
    return float(tau)


def check_backward(backward: object) -> str:
    value = "auto" if backward is None else backward
    if value not in BACKWARD_STRATEGIES:
        raise ValueError(f"backward= must be one of {BACKWARD_STRATEGIES} or None, got {backward!r}")
    return value


def check_same_space(Q: Tensor, D: Tensor, q_name: str = "Q", d_name: str = "D") -> None:
    """Query and document tokens must share the embedding dim and the device."""
    if Q.shape[-1] != D.shape[-1]:
        raise ValueError(
            f"{q_name} and {d_name} must share the embedding dim d, got {q_name} {_shape(Q)} "
            f"and {d_name} {_shape(D)}"
        )
    if Q.device != D.device:
        raise ValueError(
            f"{q_name} is on {Q.device} but {d_name} is on {D.device}: {q_name} and {d_name} must "
            "be on the same device"
        )


def promote_pair(Q: Tensor, D: Tensor) -> tuple[Tensor, Tensor]:
    """Two token tensors in their common dtype (each copied only when its dtype changes)."""
    if Q.dtype == D.dtype:
        return Q, D
    common = torch.promote_types(Q.dtype, D.dtype)
    return Q.to(common), D.to(common)


def canonical(Q: object, D: object, q_mask: object, d_mask: object) -> DenseInputs:
    """Check ``maxsim``'s arguments and bring them to the 3-D / 4-D form."""
    Q = _check_float("Q", Q)
    D = _check_float("D", D)
    if Q.dim() not in (2, 3):
        raise ValueError(f"Q must be [Lq, d] or [Nq, Lq, d], got shape {_shape(Q)}")
    if D.dim() not in (2, 3, 4):
        raise ValueError(f"D must be [Ld, d], [Nd, Ld, d] or [Nq, K, Ld, d], got shape {_shape(D)}")
    check_same_space(Q, D)
    if D.dim() == 4:
        if Q.dim() != 3:
            raise ValueError(
                f"the per-query candidate layout (D [Nq, K, Ld, d] = {_shape(D)}) needs Q to be "
                f"[Nq, Lq, d], got Q {_shape(Q)}"
            )
        if D.shape[0] != Q.shape[0]:
            raise ValueError(
                "the per-query candidate layout (D [Nq, K, Ld, d]) needs D.shape[0] == Q.shape[0] "
                f"(K candidates for each of the Nq queries), got D {_shape(D)} and Q {_shape(Q)}"
            )
    if q_mask is not None:
        q_mask = _check_mask("q_mask", q_mask, _shape(Q)[:-1], "Q", Q.device, dims=Q_AXES[Q.dim()])
    if d_mask is not None:
        d_mask = _check_mask("d_mask", d_mask, _shape(D)[:-1], "D", D.device, dims=D_AXES[D.dim()])
    Q, D = promote_pair(Q, D)
    squeeze_q, squeeze_d = Q.dim() == 2, D.dim() == 2
    if squeeze_q:
        Q = Q.unsqueeze(0)
        q_mask = None if q_mask is None else q_mask.unsqueeze(0)
    if squeeze_d:
        D = D.unsqueeze(0)
        d_mask = None if d_mask is None else d_mask.unsqueeze(0)
    return DenseInputs(Q, D, q_mask, d_mask, squeeze_q, squeeze_d)


def canonical_pairs(Q: object, D: object, q_mask: object, d_mask: object) -> DenseInputs:
    """``maxsim_pairs``: ``Q [B, Lq, d]`` and ``D [B, Ld, d]`` become the candidate layout, K = 1."""
    Q = _check_float("Q", Q)
    D = _check_float("D", D)
    if Q.dim() != 3 or D.dim() != 3:
        raise ValueError(
            "maxsim_pairs needs both Q and D to be [B, L, d] (Q [B, Lq, d], D [B, Ld, d]), got "
            f"Q {_shape(Q)}, D {_shape(D)}"
        )
    if Q.shape[0] != D.shape[0]:
        raise ValueError(
            "maxsim_pairs needs as many queries as documents (Q.shape[0] == D.shape[0]), got "
            f"Q {_shape(Q)}, D {_shape(D)}"
        )
    d_mask = _check_mask("d_mask", d_mask, _shape(D)[:-1], "D", D.device, dims="[B, Ld]")
    return canonical(Q, D.unsqueeze(1), q_mask, None if d_mask is None else d_mask.unsqueeze(1))


# Looked up once at import: the lookup cannot run inside a torch.compile trace.
_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return _TRITON_AVAILABLE


def select_backend(t: Tensor) -> str:
    """``"triton"`` or ``"torch"`` for this tensor under the current setting."""
    wanted = settings.backend()
    if wanted == "torch" or t.dtype == torch.float64:
        return "torch"  # exact float64 stays on the PyTorch path, on every device
    if wanted == "auto":
        return "triton" if t.is_cuda and triton_available() else "torch"
    if triton_available() and (t.is_cuda or (t.device.type == "cpu" and settings.INTERPRETER)):
        return "triton"
    why = "Triton is not installed" if not triton_available() else (
        f"tensors are on {t.device}; Triton kernels need CUDA tensors "
        "(or CPU tensors with TRITON_INTERPRET=1)"
    )
    raise RuntimeError(f"FUSEDMAXSIM_BACKEND=triton cannot run here: {why}")

# ------------------------------------------------------------------------------------------------
# Packed layouts: offsets, maxima and pair lists
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RaggedLayout:
    """Which (query, document) pairs are scored, and where each sequence's tokens lie.

    ``pair_q`` / ``pair_d`` name the pairs of a pair list; without them every query meets the
    documents ``[col_lo, col_hi)``. ``max_q`` / ``max_d`` are the promised maximum lengths.
    """

    cu_q: Tensor
    cu_d: Tensor
    rows_q: int
    rows_d: int
    max_q: int
    max_d: int
    pair_q: Tensor | None = None
    pair_d: Tensor | None = None
    col_lo: int = 0
    col_hi: int | None = None  # None: the last document

    @property
    def n_queries(self) -> int:
        return self.cu_q.numel() - 1

    @property
    def n_docs(self) -> int:
        return self.cu_d.numel() - 1

    @property
    def n_cols(self) -> int:
        return (self.n_docs if self.col_hi is None else self.col_hi) - self.col_lo

    @property
    def n_pairs(self) -> int:
        return 0 if self.pair_q is None else self.pair_q.numel()

    def columns(self, lo: int, hi: int) -> RaggedLayout:
        """The cross product restricted to the documents ``[lo, hi)``."""
        return dataclasses.replace(self, col_lo=lo, col_hi=hi)


_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_index(name: str, t: object, device: torch.device, what: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor ({what}), got {type(t).__name__}")
    dtype = t.dtype
    if dtype not in _INDEX_DTYPES:
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor (int32 or int64), got {dtype}")
        t = t.long()
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D ({what}), got shape {_shape(t)}")
    where = t.device
    if where != device and where.type != "cpu":
        raise ValueError(f"{name} is on {where} but the tokens are on {device}")
    return t


def _check_offsets(name: str, cu: object, device: torch.device) -> Tensor:
    cu = _check_index(name, cu, device, "offsets [N + 1]")
    if cu.numel() == 0:
        raise ValueError(f"{name} must hold N + 1 offsets starting at 0, got an empty tensor")
    return cu


def check_int(name: str, value: object, *, optional: bool, low: int, bound: str) -> int | None:
    """An integer argument (no bool, no float), at least ``low`` (else ``{name} must be
    {bound}``); None passes where ``optional``."""
    if value is None and optional:
        return None
    kind = "an int or None" if optional else "an int"
    if isinstance(value, bool):
        raise TypeError(f"{name} must be {kind}, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}") from None
    if value < low:
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def _check_max_seqlen(name: str, value: object) -> int | None:
    return check_int(name, value, optional=True, low=0, bound=">= 0")


def _check_validate(validate: object) -> bool | None:
    if validate is None or validate is True or validate is False:
        return validate
    raise TypeError(f"validate must be True, False or None, got {validate!r}")


def _offset_facts(cu: Tensor) -> Tensor:
    """``[first, last, shortest, longest]`` of a 1-D offsets tensor, on its device, as int64."""
    cu = cu.long()
    if cu.numel() == 1:
        return torch.stack([cu[0], cu[0], cu.new_zeros(()), cu.new_zeros(())])
    lengths = cu[1:] - cu[:-1]
    return torch.stack([cu[0], cu[-1], lengths.min(), lengths.max()])


def _index_facts(idx: Tensor) -> Tensor:
    """``[lowest, highest]`` of an index tensor (``[0, -1]`` when empty: nothing to refuse)."""
    idx = idx.long()
    if idx.numel() == 0:
        return torch.tensor([0, -1], device=idx.device)
    return torch.stack([idx.min(), idx.max()])


def _check_offset_values(name, facts, rows, tokens, max_len, max_name) -> None:
    first, last, shortest, longest = facts
    if first != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {first}")
    if shortest < 0:
        raise ValueError(
            f"{name} must be non-decreasing (every length >= 0); it holds a length of {shortest}"
        )
    if last != rows:
        raise ValueError(
            f"{name} must end at the number of packed rows, {tokens}.shape[0] = {rows}; "
            f"got {name}[-1] = {last}"
        )
    if max_len is not None and longest > max_len:
        raise ValueError(
            f"{max_name}={max_len} is below the longest sequence in {name} ({longest} tokens)"
        )


def _check_pair_values(name: str, facts, count: int, cu_name: str) -> None:
    low, high = facts
    if low < 0 or high >= count:
        raise ValueError(
            f"{name} must index the {count} sequences of {cu_name} (0 <= index < {count}), "
            f"got indices in [{low}, {high}]"
        )


def build_layout(
    Q: Tensor,
    D: Tensor,
    cu_seqlens_q: object,
    cu_seqlens_d: object,
    max_seqlen_q: object,
    max_seqlen_d: object,
    pair_q_idx: object = None,
    pair_d_idx: object = None,
    *,
    validate: object = None,
    q_name: str = "Q_packed",
    d_name: str = "D_packed",
) -> RaggedLayout:
    """Check offsets, maxima and pair indices (values: see the module docstring) and move them
    to the tokens' device. At most one host synchronization, and none when the maxima are given
    for offsets on the GPU without ``validate=True``."""
    validate = _check_validate(validate)
    device = Q.device
    cu_q = _check_offsets("cu_seqlens_q", cu_seqlens_q, device)
    cu_d = _check_offsets("cu_seqlens_d", cu_seqlens_d, device)
    max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_d = _check_max_seqlen("max_seqlen_d", max_seqlen_d)
    pairs = pair_q_idx is not None or pair_d_idx is not None
    if pairs:
        if pair_q_idx is None or pair_d_idx is None:
            raise ValueError("pair_q_idx and pair_d_idx go together; got only one of them")
        pair_q = _check_index("pair_q_idx", pair_q_idx, device, "query index of each pair [P]")
        pair_d = _check_index("pair_d_idx", pair_d_idx, device, "document index of each pair [P]")
        if pair_q.shape != pair_d.shape:
            raise ValueError(
                f"pair_q_idx and pair_d_idx must have the same length, got {_shape(pair_q)} "
                f"and {_shape(pair_d)}"
            )
    rows_q, rows_d = Q.shape[0], D.shape[0]
    tensors = [cu_q, cu_d, pair_q, pair_d] if pairs else [cu_q, cu_d]
    needs_max = [max_q is None, max_d is None, False, False]
    remote = [n for n, t in enumerate(tensors) if t.device.type != "cpu"]
    sync = validate is True or any(needs_max[n] for n in remote)
    local = [
        n for n, t in enumerate(tensors)
        if t.device.type == "cpu" and (validate is not False or needs_max[n])
    ]
    facts: dict[int, list[int]] = {}
    if (sync and remote) or local:  # the fast path (GPU offsets, maxima given) skips all this
        summarize = [_offset_facts, _offset_facts, _index_facts, _index_facts]
        if sync and remote:
            summaries = [summarize[n](tensors[n]) for n in remote]
            values = torch.cat(summaries).tolist()  # the one host synchronization
            for n, summary in zip(remote, summaries):
                facts[n], values = values[: summary.numel()], values[summary.numel() :]
        for n in local:
            facts[n] = summarize[n](tensors[n]).tolist()
        if validate is not False:
            checks = [
                lambda f: _check_offset_values(
                    "cu_seqlens_q", f, rows_q, q_name, max_q, "max_seqlen_q"),
                lambda f: _check_offset_values(
                    "cu_seqlens_d", f, rows_d, d_name, max_d, "max_seqlen_d"),
                lambda f: _check_pair_values(
                    "pair_q_idx", f, cu_q.numel() - 1, "cu_seqlens_q"),
                lambda f: _check_pair_values(
                    "pair_d_idx", f, cu_d.numel() - 1, "cu_seqlens_d"),
            ]
            for n in sorted(facts):
                checks[n](facts[n])
    max_q = max(0, facts[0][3]) if max_q is None else max_q
    max_d = max(0, facts[1][3]) if max_d is None else max_d
    return RaggedLayout(
        cu_q=_to_device(cu_q, device),
        cu_d=_to_device(cu_d, device),
        rows_q=rows_q,
        rows_d=rows_d,
        max_q=max_q,
        max_d=max_d,
        pair_q=_to_device(pair_q, device) if pairs else None,
        pair_d=_to_device(pair_d, device) if pairs else None,
    )


def _check_tokens(Q: object, D: object, q_name: str, d_name: str) -> tuple[Tensor, Tensor]:
    Q = _check_float(q_name, Q)
    D = _check_float(d_name, D)
    for name, t, what in ((q_name, Q, "ΣLq"), (d_name, D, "ΣLd")):
        if t.dim() != 2:
            raise ValueError(
                f"{name} must be 2-D [{what}, d] (tokens packed back to back), got shape "
                f"{_shape(t)}; padded batches go to fusedmaxsim.maxsim or maxsim_padded"
            )
    check_same_space(Q, D, q_name, d_name)
    return promote_pair(Q, D)


def _check_packed_mask(name: str, mask: object, rows: int, owner: str, device) -> Tensor | None:
    return _check_mask(name, mask, (rows,), owner, device, axes="one entry per packed row")


# ------------------------------------------------------------------------------------------------
# Lists and padded candidates
# ------------------------------------------------------------------------------------------------

def _sequence_list(name: str, seqs: object) -> list[Tensor]:
    if isinstance(seqs, Tensor):
        if seqs.dim() != 3:
            raise ValueError(
                f"{name} must be a list of [L, d] tensors or one [N, L, d] tensor, got shape "
                f"{_shape(seqs)}"
            )
        return list(seqs.unbind(0))
    if not isinstance(seqs, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(seqs).__name__}")
    for n, t in enumerate(seqs):
        _check_float(f"{name}[{n}]", t)
        if t.dim() != 2:
            raise ValueError(f"{name}[{n}] must be 2-D [L, d], got shape {_shape(t)}")
    return list(seqs)


def _pack_list(name: str, seqs: list[Tensor], dim: int, dtype, device):
    """The sequences back to back, their offsets (on the host: known without a sync) and the
    longest length."""
    for n, t in enumerate(seqs):
        if t.shape[1] != dim:
            raise ValueError(
                f"every sequence must have the embedding dim d = {dim}; {name}[{n}] has {_shape(t)}"
            )
        if t.device != device:
            raise ValueError(f"every sequence must be on {device}; {name}[{n}] is on {t.device}")
    lengths = [t.shape[0] for t in seqs]
    offsets = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    if seqs:
        packed = torch.cat([t.to(dtype) for t in seqs])
    else:
        packed = torch.empty((0, dim), dtype=dtype, device=device)
    return packed, offsets, max(lengths, default=0)


def _check_lengths(name: str, lengths: object, shape: tuple[int, ...], device) -> Tensor:
    if not isinstance(lengths, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(lengths).__name__}")
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {lengths.dtype}")
    if _shape(lengths) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {_shape(lengths)}")
    if lengths.device.type != "cpu" and lengths.device != device:
        raise ValueError(f"{name} is on {lengths.device} but the tokens are on {device}")
    return lengths


def _check_padded(queries: object, documents: object):
    Q = _check_float("queries", queries)
    D = _check_float("documents", documents)
    if Q.dim() != 3:
        raise ValueError(f"queries must be [B, Lq, d], got shape {_shape(Q)}")
    if D.dim() != 4:
        raise ValueError(
            f"documents must be [B, C, Ld, d] (C candidates per query), got shape {_shape(D)}"
        )
    if D.shape[0] != Q.shape[0]:
        raise ValueError(
            f"queries and documents must share the batch size B, got {_shape(Q)} and {_shape(D)}"
        )
    check_same_space(Q, D, "queries", "documents")
    return Q, D


def _check_length_range(name: str, low: int, high: int, extent: int) -> None:
    if low < 0 or high > extent:
        raise ValueError(
            f"{name} must lie in [0, {extent}] (the padded extent), got values in [{low}, {high}]"
        )


def _length_range_errors(name: str, lengths: Tensor, extent: int) -> None:
    if lengths.numel():
        _check_length_range(name, *torch.stack([lengths.min(), lengths.max()]).tolist(), extent)


def dense_as_packed(Q: Tensor, q_mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """A dense ``[N, L, d]`` batch as packed rows with offsets ``0, L, 2L, …`` (a view when the
    strides allow), and its mask flattened."""
    n, length, dim = Q.shape
    cu = torch.arange(n + 1, device=Q.device, dtype=torch.int64) * length
    return Q.reshape(n * length, dim), cu, None if q_mask is None else q_mask.reshape(-1)


# ------------------------------------------------------------------------------------------------
# Residual (PLAID) arguments
# ------------------------------------------------------------------------------------------------

NBITS = (1, 2, 4, 8)
BIT_ORDERS = ("big", "little")


_CODE_TABLES: dict = {}


def code_table(nbits: int, bit_order: str, device: torch.device) -> Tensor:
    """``[256, 8 // nbits]`` int32: the ``nbits``-bit codes one residual byte holds, in dimension
    order. The codes form a bit stream, each code least significant bit first, packed into bytes
    most significant bit first (``"big"``: ColBERT's and fast-plaid's ``np.packbits``) or least
    significant bit first (``"little"``)."""
    key = (nbits, bit_order, device)
    table = _CODE_TABLES.get(key)
    if table is None:
        byte = torch.arange(256, dtype=torch.int32)
        slots = []
        for slot in range(8 // nbits):
            code = torch.zeros(256, dtype=torch.int32)
            for bit in range(nbits):
                pos = slot * nbits + bit  # the position in the byte's part of the stream
                code |= ((byte >> (7 - pos if bit_order == "big" else pos)) & 1) << bit
            slots.append(code)
        table = _CODE_TABLES[key] = torch.stack(slots, 1).to(device)
    return table


def weight_table(bucket_weights: Tensor, nbits: int, bit_order: str) -> Tensor:
    """``[256, 8 // nbits]`` in the weights' dtype and device: the bucket weights of the codes
    one residual byte holds, in dimension order (``bucket_weights[code_table(...)]``), which the
    residual kernel gathers a byte at a time."""
    return bucket_weights[code_table(nbits, bit_order, bucket_weights.device)].contiguous()


class ResidualDocs(NamedTuple):
    """Documents of a PLAID (ColBERTv2) index, compressed and packed: token ``t`` of document
    ``j`` is row ``starts[j] + t`` of ``codes`` / ``residuals``, ``centroids[code] +
    bucket_weights[b]`` per dimension, ``b`` that dimension's ``nbits``-bit code in the residual
    row (``fusedmaxsim.plaid.decompress_residuals``). Padded documents ``[Nd, Ld]`` are the
    packed rows with ``starts = j · Ld``. The columns of the scores are the documents, or, with
    ``doc_ids [Nq, C]``, each query's own candidates (an id < 0: no candidate, scored -inf).
    Index tensors are on the tokens' device; ``checked``: whether the lengths, offsets and codes
    were found in range (otherwise a document out of range scores NaN, never read out of
    bounds)."""

    codes: Tensor  # [T] integers in [0, n_centroids)
    residuals: Tensor  # [T, ceil(d · nbits / 8)] uint8
    starts: Tensor  # [Nd] int64: each document's first row
    lengths: Tensor  # [Nd] integers in [0, max_len], starts + lengths <= T
    max_len: int | None  # a bound on the lengths (padded extent, longest document), or unknown
    doc_ids: Tensor | None  # [Nq, C] int64: per-query candidate documents, or every document
    centroids: Tensor  # [n_centroids, d] float
    bucket_weights: Tensor  # [2 ** nbits] float
    nbits: int
    bit_order: str  # "big" (fast-plaid, ColBERT) or "little"
    checked: bool
    weight_table: Tensor | None = None  # weight_table(...) where the caller keeps it (an index)

    @property
    def n_cols(self) -> int:
        return self.starts.shape[0] if self.doc_ids is None else self.doc_ids.shape[1]


def _packed_offset_errors(name: str, first: int, last: int, shortest: int, T: int,
                          what: str) -> None:
    """Offsets into ``T`` packed rows of codes that may leave rows after the last document."""
    if first != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {first}")
    if shortest < 0:
        raise ValueError(f"{name} must be non-decreasing (every length >= 0); it holds a length "
                         f"of {shortest}")
    if last > T:
        raise ValueError(f"{name} must end within the {T} {what} of codes, got {name}[-1] = {last}")


def _check_residual_codec(Q: Tensor, centroids: object, bucket_weights: object, nbits: object,
                          bit_order: object, residuals: object, rows: tuple[int, ...],
                          rows_name: str) -> tuple[Tensor, Tensor]:
    """The codec's arguments and the residuals' shape ``[*rows, ceil(d · nbits / 8)]``."""
    if isinstance(nbits, bool) or nbits not in NBITS:
        raise ValueError(f"nbits must be one of {NBITS}, got {nbits!r}")
    if bit_order not in BIT_ORDERS:
        raise ValueError(f"bit_order must be one of {BIT_ORDERS}, got {bit_order!r}")
    centroids = _check_float("centroids", centroids)
    if centroids.dim() != 2 or centroids.shape[1] != Q.shape[-1]:
        raise ValueError(
            f"centroids must be [n_centroids, d] with Q's d = {Q.shape[-1]}, got "
            f"{_shape(centroids)}")
    bucket_weights = _check_float("bucket_weights", bucket_weights)
    if _shape(bucket_weights) != (1 << nbits,):
        raise ValueError(
            f"bucket_weights must be [2 ** nbits] = ({1 << nbits},) for nbits={nbits}, got "
            f"{_shape(bucket_weights)}")
    if not isinstance(residuals, Tensor) or residuals.dtype != torch.uint8:
        raise TypeError(f"residuals must be a torch.uint8 tensor, got "
                        f"{getattr(residuals, 'dtype', type(residuals).__name__)}")
    packed_dim = -(-Q.shape[-1] * nbits // 8)
    if _shape(residuals) != (*rows, packed_dim):
        raise ValueError(
            f"residuals must be {rows_name[:-1]}, ceil(d * nbits / 8)] = {(*rows, packed_dim)} "
            f"for codes {rows}, d = {Q.shape[-1]} and nbits = {nbits}, got {_shape(residuals)}")
    return centroids, bucket_weights


def _check_codes(codes: object, dims: int, what: str) -> Tensor:
    if not isinstance(codes, Tensor) or codes.dtype.is_floating_point or codes.dtype.is_complex \
            or codes.dtype == torch.bool:
        raise TypeError(f"codes must be an integer torch.Tensor, got "
                        f"{getattr(codes, 'dtype', type(codes).__name__)}")
    if codes.dim() != dims:
        raise ValueError(f"codes must be {what} (a centroid id per token), got {_shape(codes)}")
    return codes


def _check_residual_query(Q: object, q_mask: object) -> tuple[Tensor, Tensor | None, bool]:
    Q = _check_float("Q", Q)
    if Q.dim() not in (2, 3):
        raise ValueError(f"Q must be [Lq, d] or [Nq, Lq, d], got shape {_shape(Q)}")
    squeeze_q = Q.dim() == 2
    if squeeze_q:
        Q = Q.unsqueeze(0)
    if q_mask is not None:
        q_mask = _check_mask("q_mask", q_mask, _shape(Q)[:-1], "Q", Q.device, dims="[Nq, Lq]")
    return Q, q_mask, squeeze_q


def _same_device(Q: Tensor, **tensors: Tensor) -> None:
    for name, t in tensors.items():
        if t.device != Q.device:
            raise ValueError(f"{name} is on {t.device} but Q is on {Q.device}: every tensor must "
                             "be on the same device")


def _check_code_range(codes: Tensor, n_centroids: int) -> None:
    if codes.numel():
        lo, hi = torch.stack([codes.min(), codes.max()]).tolist()
        if lo < 0 or hi >= n_centroids:
            raise ValueError(
                f"codes must be centroid ids in [0, {n_centroids}) (the rows of centroids), got "
                f"values in [{lo}, {hi}]")


def _checks_ranges(validate: bool | None, *tensors: Tensor) -> bool:
    """``validate=None``: check tensors that all live on the CPU (no synchronization), and
    nothing while ``torch.compile`` traces (a value read would break the graph)."""
    return validate is True or (validate is None and not torch.compiler.is_compiling()
                                and all(t.device.type == "cpu" for t in tensors))


def check_residual(Q: object, codes: object, residuals: object, doc_lengths: object,
                   centroids: object, bucket_weights: object, nbits: object, bit_order: object,
                   q_mask: object, validate: bool | None) -> tuple[Tensor, Tensor | None,
                                                                    ResidualDocs, bool]:
    """Check ``maxsim_residual``'s arguments: ``(Q [Nq, Lq, d], q_mask, docs, squeeze_q)``.
    Shapes, dtypes and devices always; the ranges of the lengths and codes where they are on the
    CPU (unless ``validate=False``) or with ``validate=True`` (one synchronization)."""
    Q, q_mask, squeeze_q = _check_residual_query(Q, q_mask)
    codes = _check_codes(codes, 2, "[Nd, Ld]")
    centroids, bucket_weights = _check_residual_codec(
        Q, centroids, bucket_weights, nbits, bit_order, residuals, _shape(codes),
        "[Nd, Ld]")
    _same_device(Q, codes=codes, residuals=residuals, centroids=centroids,
                 bucket_weights=bucket_weights)
    Nd, Ld = codes.shape
    lengths = _check_lengths("doc_lengths", doc_lengths, (Nd,), Q.device)
    validate = _check_validate(validate)
    checked = _checks_ranges(validate, Q, lengths)
    if checked:
        _length_range_errors("doc_lengths", lengths, Ld)
        _check_code_range(codes, centroids.shape[0])
    starts = torch.arange(Nd, device=Q.device, dtype=torch.int64) * Ld
    docs = ResidualDocs(codes.reshape(Nd * Ld), residuals.reshape(Nd * Ld, residuals.shape[-1]),
                        starts, _to_device(lengths, Q.device), Ld, None, centroids,
                        bucket_weights, nbits, bit_order, checked)
    return Q, q_mask, docs, squeeze_q


def check_residual_varlen(Q: object, codes: object, residuals: object, cu_seqlens_d: object,
                          centroids: object, bucket_weights: object, nbits: object,
                          bit_order: object, q_mask: object, max_seqlen_d: object,
                          validate: bool | None, need_max_len: bool) -> tuple[
                              Tensor, Tensor | None, ResidualDocs, bool]:
    """Check ``maxsim_residual_varlen``'s arguments (packed documents: ``codes [T]``,
    ``residuals [T, packed_dim]``, document ``j`` the rows ``[cu_seqlens_d[j],
    cu_seqlens_d[j + 1])``; rows past ``cu_seqlens_d[-1]`` are ignored). The offsets' and codes'
    values as :func:`check_residual` checks the lengths'. The longest document is read from the
    offsets where they are on the CPU, or on another device than CUDA, or with ``need_max_len``
    (one synchronization on a GPU); otherwise it stays unknown (the kernel bounds each document by
    the rows)."""
    Q, q_mask, squeeze_q = _check_residual_query(Q, q_mask)
    codes = _check_codes(codes, 1, "[T]")
    centroids, bucket_weights = _check_residual_codec(
        Q, centroids, bucket_weights, nbits, bit_order, residuals, _shape(codes),
        "[T]")
    _same_device(Q, codes=codes, residuals=residuals, centroids=centroids,
                 bucket_weights=bucket_weights)
    cu = _check_offsets("cu_seqlens_d", cu_seqlens_d, Q.device)
    max_len = _check_max_seqlen("max_seqlen_d", max_seqlen_d)
    validate = _check_validate(validate)
    checked = _checks_ranges(validate, Q, cu)
    T = codes.shape[0]
    if checked or (max_len is None and not torch.compiler.is_compiling()
                   and (cu.device.type == "cpu" or Q.device.type != "cuda" or need_max_len)):
        first, last, shortest, longest = _offset_facts(cu).tolist()
        if checked:
            _packed_offset_errors("cu_seqlens_d", first, last, shortest, T, "rows")
            if max_len is not None and longest > max_len:
                raise ValueError(f"max_seqlen_d={max_len} is below the longest document in "
                                 f"cu_seqlens_d ({longest} tokens)")
            _check_code_range(codes[:last], centroids.shape[0])
        if max_len is None:
            max_len = max(0, longest)
    cu = _to_device(cu, Q.device).long()
    docs = ResidualDocs(codes, residuals, cu[:-1], cu[1:] - cu[:-1], max_len, None, centroids,
                        bucket_weights, nbits, bit_order, checked)
    return Q, q_mask, docs, squeeze_q


# ------------------------------------------------------------------------------------------------
# PLAID approximate scores (fusedmaxsim.plaid.plaid_approx_score): the IVF pruning score
# ------------------------------------------------------------------------------------------------
# Three layouts, the Problem's other fields unused (``Ld`` and ``dim`` are 0: each document's length
# is read as the kernel runs, and the centroids' count enters no decision):
# * ``approx``: every query's centroid scores ``cs [Nq, n_centroids, Lq]`` against every document
#   of a packed list of centroid ids: ``Ncols = Nd``;
# * ``approx candidates``: each query against its own candidate documents ``doc_ids [Nq, C]``
#   (an id < 0: no candidate, scored -inf): ``Ncols = C``;
# * ``approx hits``: each query against the documents its row of ``hits [Nq, Nd]`` marks (the
#   others scored -inf): ``Ncols = Nd``.

APPROX, APPROX_CANDIDATES = "approx", "approx candidates"
# Each query against its candidates among all documents, marked in hits [Nq, Nd] (the search's).
APPROX_HITS = "approx hits"


def approx_problem(cs: Tensor, n_cols: int, candidates: bool, hits: bool = False) -> Problem:
    """The :class:`Problem` of the centroid scores ``cs [Nq, n_centroids, Lq]`` against ``n_cols``
    documents (or each query's ``n_cols`` candidates; ``hits``: the documents each query's row
    of a bitmap marks)."""
    Nq, _, Lq = cs.shape
    layout = APPROX_HITS if hits else APPROX_CANDIDATES if candidates else APPROX
    return Problem(layout, Nq, n_cols, Lq, 0, 0, cs.dtype,
                   cs.device, False, False, False, False, 0.0, False, False)


# The PLAID search's probe (``ivf probe``): each query's probed cells ``[Nq, P]`` against the
# inverted lists of ``Nd`` documents, a bitmap ``[Nq, Nd]`` out: ``Ncols = Nd``, ``Lq = P`` (cells
# a query), ``Ld`` the longest list; ``dtype`` the cells'.
PROBE = "ivf probe"


def probe_problem(cells: Tensor, n_docs: int, longest_list: int) -> Problem:
    """The :class:`Problem` of the probe of ``cells [Nq, P]`` in inverted lists of ``n_docs``
    documents, the longest ``longest_list`` long."""
    Nq, P = cells.shape
    return Problem(PROBE, Nq, n_docs, P, longest_list, 0, cells.dtype, cells.device, False,
                   False, False, False, 0.0, False, False)


def _approx_int(name: str, t: object, dims: int, what: str, device: torch.device) -> Tensor:
    """An integer tensor of ``dims`` dimensions on ``device`` (``what`` names its axes)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {what}, got shape {_shape(t)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but query_centroid_scores is on {device}: "
                         "every tensor must be on the same device")
    return t


def _approx_scores_arg(cs: object, dims: tuple[int, ...]) -> Tensor:
    cs = _check_float("query_centroid_scores", cs)
    if cs.dim() not in dims:
        what = " or ".join({2: "[n_centroids, Lq]", 3: "[Nq, n_centroids, Lq]"}[d] for d in dims)
        raise ValueError(f"query_centroid_scores must be {what}, got shape {_shape(cs)}")
    return cs


def check_approx_internal(cs: object, codes: object, starts: object, lengths: object,
                          doc_ids: object) -> None:
    """Shapes, dtypes and devices of ``_autograd.approx_scores``' arguments (no values: nothing
    synchronizes; an id or a range out of bounds scores NaN, never a read out of bounds)."""
    cs = _approx_scores_arg(cs, (3,))
    device = cs.device
    _approx_int("codes", codes, 1, "[T] centroid ids", device)
    starts = _approx_int("starts", starts, 1, "[Nd] first token of each document", device)
    lengths = _approx_int("lengths", lengths, 1, "[Nd] tokens of each document", device)
    if lengths.shape != starts.shape:
        raise ValueError(f"starts and lengths must have the same length [Nd], got "
                         f"{_shape(starts)} and {_shape(lengths)}")
    if doc_ids is not None:
        doc_ids = _approx_int("doc_ids", doc_ids, 2, "[Nq, C] candidate documents", device)
        if doc_ids.shape[0] != cs.shape[0]:
            raise ValueError(f"doc_ids must be [Nq, C] with Nq = {cs.shape[0]} (the queries of "
                             f"query_centroid_scores), got {_shape(doc_ids)}")


class ApproxDocs(NamedTuple):
    """``plaid_approx_score``'s documents as ``approx_scores`` takes them: document ``j`` is the
    ids ``codes[starts[j] : starts[j] + lengths[j]]``, or with ``padded_len`` (padded documents,
    ``starts`` None) ``codes[j · padded_len : j · padded_len + lengths[j]]``, a length outside
    ``[0, padded_len]`` scoring NaN."""

    codes: Tensor  # [T] integers
    starts: Tensor | None  # [Nd] int64, or None (padded)
    lengths: Tensor  # [Nd] integers
    padded_len: int | None = None


_NO_ID = (torch.iinfo(torch.int64).max, torch.iinfo(torch.int64).min)


def _approx_id_range(ids: Tensor, tokens: Tensor) -> Tensor:
    """``[lowest, highest]`` (int64, on their device) of the ids where ``tokens`` (a bool tensor
    broadcasting against them) is True; ``_NO_ID`` when there is none."""
    ids = ids.long()
    if ids.numel() == 0:
        return torch.tensor(_NO_ID, device=ids.device)
    return torch.stack([torch.where(tokens, ids, _NO_ID[0]).amin(),
                        torch.where(tokens, ids, _NO_ID[1]).amax()])


def _approx_id_errors(low: int, high: int, n_centroids: int) -> None:
    if (low, high) != _NO_ID and (low < 0 or high >= n_centroids):
        raise ValueError(
            f"codes must be centroid ids in [0, {n_centroids}) (the rows of "
            f"query_centroid_scores) in every document's tokens, got values in [{low}, {high}]")


def check_approx(cs: object, codes: object, doc_lengths: object, cu_seqlens: object,
                 validate: object) -> tuple[Tensor, ApproxDocs, bool]:
    """Check ``plaid_approx_score``'s arguments: ``(cs [Nq, n_centroids, Lq], docs, squeeze_q)``.

    Padded documents (``codes [B, max_Ld]``, ``doc_lengths [B]``) become the flattened ids with
    ``starts = j · max_Ld``; packed ones (``codes [T]``, ``cu_seqlens [B + 1]``) ``starts =
    cu_seqlens[:-1]``, ``lengths`` their differences. Shapes, dtypes and devices always; the
    values (lengths in ``[0, max_Ld]``, offsets from 0, non-decreasing and within ``T``, every
    document token's id in ``[0, n_centroids)``) where the index tensors are on the CPU (unless
    ``validate=False``) or with ``validate=True`` (one synchronization). Unchecked, a padded
    length outside ``[0, max_Ld]`` makes its document score NaN (``ApproxDocs.padded_len``: the
    padded layout costs no tensor of offsets)."""
    cs = _approx_scores_arg(cs, (2, 3))
    device = cs.device
    squeeze_q = cs.dim() == 2
    if squeeze_q:
        cs = cs.unsqueeze(0)
    n_centroids = cs.shape[1]
    validate = _check_validate(validate)
    packed = cu_seqlens is not None
    if packed and doc_lengths is not None:
        raise ValueError("pass doc_lengths with padded codes [B, max_Ld], or cu_seqlens= with "
                         "packed codes [T], not both")
    if not isinstance(codes, Tensor):
        raise TypeError(f"codes must be a torch.Tensor of centroid ids, got "
                        f"{type(codes).__name__}")
    if packed:
        codes = _approx_int("codes", codes, 1, "1-D [T] (packed documents, with cu_seqlens=)",
                            device)
        cu = _check_offsets("cu_seqlens", cu_seqlens, device)
        checked = _checks_ranges(validate, cs, cu)
        T = codes.shape[0]
        if checked:  # one synchronization: ids past the last document belong to none
            cu_here = _to_device(cu, device)
            past = torch.arange(T, device=device) < cu_here[-1]
            facts = torch.cat([_offset_facts(cu_here), _approx_id_range(codes, past)]).tolist()
            (first, last, shortest, _), (low, high) = facts[:4], facts[4:]
            _packed_offset_errors("cu_seqlens", first, last, shortest, T, "ids")
            _approx_id_errors(low, high, n_centroids)
        cu = _to_device(cu, device).long()
        return cs, ApproxDocs(codes, cu[:-1], cu[1:] - cu[:-1]), squeeze_q
    if doc_lengths is None:
        raise ValueError("plaid_approx_score needs doc_lengths [B] with padded codes [B, max_Ld] "
                         "(or cu_seqlens= [B + 1] with packed codes [T])")
    codes = _approx_int("codes", codes, 2, "[B, max_Ld] (padded documents, with doc_lengths; "
                        "packed codes [T] take cu_seqlens=)", device)
    B, Ld = codes.shape
    lengths = _check_lengths("doc_lengths", doc_lengths, (B,), device)
    if lengths.dtype not in (torch.int32, torch.int64):
        lengths = lengths.long()
    checked = _checks_ranges(validate, cs, lengths)
    lengths = _to_device(lengths, device)
    if checked and B:  # one synchronization
        inside = torch.arange(Ld, device=device) < lengths[:, None]
        facts = torch.cat([torch.stack([lengths.min(), lengths.max()]).long(),
                           _approx_id_range(codes, inside)]).tolist()
        _check_length_range("doc_lengths", facts[0], facts[1], Ld)
        _approx_id_errors(facts[2], facts[3], n_centroids)
    return cs, ApproxDocs(codes.reshape(B * Ld), None, lengths, Ld), squeeze_q


def padded_starts(lengths: Tensor, padded_len: int) -> tuple[Tensor, Tensor]:
    """Padded documents as packed ones: ``(starts = j · padded_len, lengths)``, a length outside
    ``[0, padded_len]`` passed on as -1 (its document then scores NaN, never reading its
    neighbour's ids)."""
    starts = torch.arange(lengths.shape[0], device=lengths.device, dtype=torch.int64)
    starts = starts * padded_len
    return starts, torch.where((lengths < 0) | (lengths > padded_len), -1, lengths)


# ------------------------------------------------------------------------------------------------
# Hidden-state documents: maxsim_from_hidden
# ------------------------------------------------------------------------------------------------


class HiddenInputs(NamedTuple):
    """``maxsim_from_hidden``'s checked arguments: ``Q [Nq, Lq, d]``; ``H [Nd, Ld, d_model]`` or
    ``[Nq, K, Ld, d_model]``; ``W [d, d_model]``; ``b [d]`` or None; bool masks or None."""

    Q: Tensor
    H: Tensor
    W: Tensor
    b: Tensor | None
    q_mask: Tensor | None
    d_mask: Tensor | None
    squeeze_q: bool


def check_hidden(Q: object, H: object, W: object, b: object, q_mask: object,
                 d_mask: object) -> HiddenInputs:
    """Check ``maxsim_from_hidden``'s arguments (the shapes of ``maxsim(Q, F.linear(H, W, b))``)
    and bring ``Q`` and its mask to the 3-D form."""
    Q = _check_float("Q", Q)
    H = _check_float("H_d", H)
    W = _check_float("W", W)
    if Q.dim() not in (2, 3):
        raise ValueError(f"Q must be [Lq, d] or [Nq, Lq, d], got shape {_shape(Q)}")
    if H.dim() not in (3, 4):
        raise ValueError(
            f"H_d must be [Nd, Ld, d_model] or [Nq, K, Ld, d_model], got shape {_shape(H)}")
    if W.dim() != 2:
        raise ValueError(f"W must be [d, d_model] (nn.Linear's weight), got shape {_shape(W)}")
    if W.shape[1] != H.shape[-1]:
        raise ValueError(
            f"W [d, d_model] must have H_d's d_model = {H.shape[-1]} columns, got W {_shape(W)} "
            f"and H_d {_shape(H)}")
    if W.shape[0] != Q.shape[-1]:
        raise ValueError(
            f"W [d, d_model] must project to Q's embedding dim d = {Q.shape[-1]}, got W "
            f"{_shape(W)} and Q {_shape(Q)}")
    if b is not None:
        b = _check_float("b", b)
        if _shape(b) != (W.shape[0],):
            raise ValueError(f"b must be [d] = ({W.shape[0]},), got shape {_shape(b)}")
    for name, t in (("H_d", H), ("W", W), ("b", b)):
        if t is not None and t.device != Q.device:
            raise ValueError(
                f"{name} is on {t.device} but Q is on {Q.device}: every tensor must be on the "
                "same device")
    for name, t in (("W", W), ("b", b)):
        if t is not None and t.dtype != H.dtype:
            raise TypeError(
                f"{name} must have H_d's dtype {H.dtype} (as F.linear requires outside "
                f"autocast; nothing is cast here, under autocast either), got {t.dtype}")
    if H.dim() == 4:
        if Q.dim() != 3 or H.shape[0] != Q.shape[0]:
            raise ValueError(
                "the per-query candidate layout (H_d [Nq, K, Ld, d_model]) needs Q [Nq, Lq, d] "
                f"with the same Nq, got H_d {_shape(H)} and Q {_shape(Q)}")
    if q_mask is not None:
        q_mask = _check_mask("q_mask", q_mask, _shape(Q)[:-1], "Q", Q.device, dims=Q_AXES[Q.dim()])
    if d_mask is not None:
        d_mask = _check_mask("d_mask", d_mask, _shape(H)[:-1], "H_d", H.device,
                             dims=D_AXES[H.dim()])
    squeeze_q = Q.dim() == 2
    if squeeze_q:
        Q = Q.unsqueeze(0)
        q_mask = None if q_mask is None else q_mask.unsqueeze(0)
    return HiddenInputs(Q, H, W, b, q_mask, d_mask, squeeze_q)


def hidden_problem(Q: Tensor, H: Tensor, W: Tensor, b: Tensor | None, q_mask, d_mask, *,
                   normalize: bool, save_argmax: bool) -> Problem:
    """The :class:`Problem` of ``Q [Nq, Lq, d]`` against the projection of hidden states ``H``
    (``[Nd, Ld, d_model]`` or ``[Nq, K, Ld, d_model]``); ``dtype``: the inputs' common dtype,
    that of the similarities (F.linear's output in H's dtype, promoted with Q's)."""
    Nq, Lq, dim = Q.shape
    return Problem(
        HIDDEN_CANDIDATES if H.dim() == 4 else HIDDEN, Nq, H.shape[-3], Lq, H.shape[-2], dim,
        torch.promote_types(Q.dtype, H.dtype), Q.device, q_mask is not None, d_mask is not None,
        normalize, normalize, 0.0, save_argmax, False, H.shape[-1], b is not None,
    )
