"""Registers, local memory (spills), instruction counts and the spills' place in the loops of
the Triton kernels, compiled offline for sm_90 (no GPU needed): the forward under the tile
variants of ``benchmarks/NOTES.md`` sections 20 and 22, the document-owned grad_D kernel, the
gather, the winner index, and the projection head's fused forward (sections 72 and 74). Prints a
markdown record with the Triton version and git sha.

    python benchmarks/compile_report.py > benchmarks/results/offline/<date>_<sha>/compile_report.md
    python benchmarks/compile_report.py head      (some sections: forward grad_d gather index head
                                                   head_caps head_backward)

Pointers are declared 16-byte aligned and the unit strides (every ``stride_*_dim``, and W's
``stride_w_in``) as the constant 1, as a launch on contiguous inputs specializes them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from fusedmaxsim._plan import MEASURED, bwd_heuristic
from fusedmaxsim.kernels.backward import _maxsim_bwd_dd_kernel, _maxsim_bwd_gather_kernel
from fusedmaxsim.kernels.forward import _maxsim_fwd_kernel, _maxsim_hidden_fwd_kernel
from fusedmaxsim.kernels.head import _hidden_bwd_entries_kernel, _hidden_bwd_weight_kernel
from fusedmaxsim.kernels.winner_index import _tile_counts_kernel, _tile_rows_kernel

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
ALIGNED_INTS = ("dim", "stride_q_seq", "stride_q_tok", "stride_d_grp", "stride_d_col", "stride_d_tok",
                "stride_gd_grp", "stride_gd_col", "stride_gd_tok", "d_model", "stride_h_grp",
                "stride_h_col", "stride_h_tok", "stride_w_out", "stride_gh_grp", "stride_gh_col",
                "stride_gh_tok")
# Strides of 1 in a launch on contiguous inputs (Triton specializes an integer equal to 1): the
# innermost of each tensor, and W's along d_model (nn.Linear's weight [d, d_model]).
UNIT_STRIDES = ("stride_w_in",)
POINTER_TYPES = {"Q": "*bf16", "D": "*bf16", "GradD": "*bf16", "Grad": "*fp32", "QInv": "*fp32",
                 "DInv": "*fp32", "Out": "*fp32", "Argmax": "*i16", "QMask": "*u8", "DMask": "*u8",
                 "Rows": "*i32", "Counts": "*i32", "GradQ": "*bf16", "H": "*bf16", "W": "*bf16",
                 "Bias": "*bf16", "GradH": "*bf16", "Tok": "*i32", "GradP": "*bf16"}


def compile_sm90(kernel, constants: dict, num_warps: int, num_stages: int, maxnreg=None,
                 pointers=None):
    """``kernel`` compiled for sm_90 as a launch on contiguous bf16 inputs specializes it;
    ``pointers`` replaces the pointer types of ``POINTER_TYPES`` by name."""
    pointer_types = {**POINTER_TYPES, **(pointers or {})}
    signature, attrs = {}, {}
    constants = dict(constants)
    for i, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        if name in UNIT_STRIDES or (name.endswith("_dim") and name.startswith("stride")):
            signature[name], constants[name] = "constexpr", 1
            continue
        param = kernel.params[i]
        if param.is_constexpr:
            raise ValueError(f"no value for constexpr {name}")
        if name in pointer_types:
            signature[name] = pointer_types[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name.startswith("smooth"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name in ALIGNED_INTS and not param.do_not_specialize:  # as a launch specializes
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, {(kernel.arg_names.index(k),): v for k, v in constants.items()},
                       attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def dump(compiled) -> tuple[str, str]:
    """(cuobjdump's resource usage, its SASS) of a kernel compiled offline."""
    path = Path("/tmp") / f"fusedmaxsim_compile_report_{os.getpid()}.cubin"
    path.write_bytes(compiled.asm["cubin"])
    try:
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", str(path)],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-sass", str(path)],
                              capture_output=True, text=True, check=True).stdout
    finally:
        path.unlink()
    return usage, sass


def resources(compiled) -> tuple[int, str, int, str]:
    """(registers, local-memory bytes a thread and shared-memory bytes a program, SASS
    instructions, its loops: ``loop_spills``)."""
    usage, sass = dump(compiled)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    code = [(int(m.group(1), 16), m.group(2)) for m in
            (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*)", ln) for ln in sass.splitlines()) if m]
    return regs, f"{stack} / {compiled.metadata.shared}", len(code), loop_spills(code)


def loop_spills(code: list[tuple[int, str]]) -> str:
    """Each SASS loop in address order as ``depth: instructions LDL/STL`` (its own body: its
    inner loops left out; LDL/STL: local-memory loads and stores, the spills): what a spill or
    an instruction costs depends on how often its loop runs (the head's tile loop runs its
    split-K loop ``d_model / HIDDEN_BLOCK`` times a tile). A loop is the span from a backward
    branch's target to the branch."""
    ends: dict[int, int] = {}
    for addr, text in code:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            ends[lo] = max(ends.get(lo, 0), addr)
    loops = sorted(ends.items())
    if not loops:
        return "no loop"

    def inside(a, b):  # loop a strictly inside loop b
        return a != b and b[0] <= a[0] and a[1] <= b[1]

    found = []
    for loop in loops:
        depth = 1 + sum(inside(loop, other) for other in loops)
        inner = [o for o in loops if inside(o, loop)]
        body = [t for a, t in code if loop[0] <= a <= loop[1]
                and not any(o[0] <= a <= o[1] for o in inner)]
        ld = sum(1 for t in body if re.match(r"(@!?U?P\w+\s+)?LDL\b", t))
        st = sum(1 for t in body if re.match(r"(@!?U?P\w+\s+)?STL\b", t))
        found.append(f"{depth}: {len(body)} {ld}/{st}")
    return "; ".join(found)


def forward_rows():
    base = dict(HAS_Q_MASK=False, HAS_D_MASK=False, NORMALIZE=False, NORM_FROM_TILES=False,
                SAVE_ARGMAX=False, SMOOTH=False, PER_QUERY_DOCS=False, BLOCK_K=128, EVEN_K=True,
                DOT_PRECISION="tf32", UPCAST=False)
    modes = {"argmax": dict(SAVE_ARGMAX=True), "inference": {},
             "normalize from tiles": dict(NORMALIZE=True, NORM_FROM_TILES=True)}
    tiles = [  # (query rows x queries, block_n, warps, stages, maxnreg, query tile in registers)
        ((128, 1), 64, 4, 3, None, False), ((32, 4), 64, 4, 2, None, False),
        ((128, 1), 32, 4, 3, None, False), ((128, 1), 32, 8, 4, 128, False),
        ((32, 4), 32, 8, 4, 128, False), ((128, 1), 64, 8, 4, None, False),
        ((32, 4), 64, 8, 4, None, False), ((128, 1), 64, 4, 3, None, True),
        ((128, 1), 32, 4, 3, None, True), ((32, 4), 32, 4, 3, None, True),
        ((128, 1), 32, 8, 4, 128, True), ((128, 1), 64, 8, 3, None, True),
    ]
    for mode, extra in modes.items():
        for (lq_tile, qpb), block_n, warps, stages, maxnreg, in_registers in tiles:
            constants = dict(base, **extra, LQ_TILE=lq_tile, QUERIES_PER_BLOCK=qpb, BLOCK_N=block_n,
                             QUERY_IN_REGISTERS=in_registers)
            compiled = compile_sm90(_maxsim_fwd_kernel, constants, warps, stages, maxnreg)
            label = f"{lq_tile}x{qpb} rows, {block_n}-token tiles, {warps} warps, {stages} stages"
            label += ", query in registers" if in_registers else ""
            yield "forward", mode, label, maxnreg, *resources(compiled)


def grad_d_rows():
    for per_query_docs, rows_in_one_block, winner_index, block_r in (
        (False, False, False, 128), (False, False, True, 128), (True, False, False, 32),
        (True, True, False, 32),
    ):
        constants = dict(PER_QUERY_DOCS=per_query_docs, ROWS_IN_ONE_BLOCK=rows_in_one_block,
                         WINNER_INDEX=winner_index, NORMALIZE=False, BLOCK_T=64, BLOCK_R=block_r,
                         BLOCK_K=128, DOT_PRECISION="tf32", UPCAST=False, INDEX_SCAN=1024)
        # As launched: a program that loads its rows once keeps its configuration's stages.
        stages = (bwd_heuristic(block_r, 128, 2, True).num_stages
                  if rows_in_one_block else MEASURED["DD_SCAN_STAGES"])
        compiled = compile_sm90(_maxsim_bwd_dd_kernel, constants, 4, stages)
        mode = ("candidates" if per_query_docs else "cross") + (", rows once" if rows_in_one_block else "")
        mode += ", winner index" if winner_index else ""
        yield "grad_D (lowmem)", mode, \
            f"64-token tiles, {block_r} rows a product, 4 warps, {stages} stage{'s' * (stages > 1)}", None, \
            *resources(compiled)


def gather_rows():
    """The gather of grad_Q (lowmem) at the columns a step and warps ``_plan.gather_step`` picks
    (benchmarks/NOTES.md section 44), at every head dimension the launcher pads to."""
    for block_k, block_s in ((64, 32), (128, 32), (128, 16), (256, 32), (512, 32)):
        for cols, warps in ((1, 4), (4, 8), (8, 8)):
            constants = dict(PER_QUERY_DOCS=False, NORMALIZE=False, COMPUTE_GRAD_Q=True,
                             ATOMIC_GRAD_Q=False, SCATTER_GRAD_D=False, BLOCK_S=block_s,
                             BLOCK_K=block_k, COLS_PER_STEP=cols)
            compiled = compile_sm90(_maxsim_bwd_gather_kernel, constants, warps, 2)
            yield "grad_Q gather (lowmem)", f"d = {block_k}", \
                f"{block_s} query tokens, {cols} columns a step, {warps} warps", None, *resources(compiled)


def index_rows():
    constants = dict(BLOCK_T=64, SCAN=1024, SCAN_Q=8, SCAN_S=128, TILES=4)
    for name, kernel in (("winner index counts", _tile_counts_kernel), ("winner index rows", _tile_rows_kernel)):
        compiled = compile_sm90(kernel, constants, 4, 1)
        yield name, "cross", "four 64-token tiles a scan, steps of 8 queries x 128 tokens, 4 warps", None, *resources(compiled)


# The head's fused forward as the probes' shapes launch it: one query of 32 tokens a block, d =
# 128, normalized, a bias, inference.
HEAD_FORWARD = dict(HAS_Q_MASK=False, HAS_D_MASK=False, NORMALIZE=True, SAVE_ARGMAX=False,
                    PER_QUERY_DOCS=False, LQ_TILE=32, QUERIES_PER_BLOCK=1, BLOCK_K=128,
                    EVEN_K=True, DOT_PRECISION="tf32", UPCAST=False, QUERY_IN_REGISTERS=False,
                    HIDDEN_BIAS=True)


def head_rows():
    """The projection head's fused forward (d_model 768 → 128, bias, normalized) at the plan's
    tiles and beside them: which part holds the registers (NOTES section 72), and the training
    variant at the short tiles too (HIDDEN_SHORT_TILES, section 80)."""
    block_n, hidden_block, warps, stages = MEASURED["HIDDEN_TILES"]
    variants = [("inference", {}), ("argmax", dict(SAVE_ARGMAX=True)),
                ("no bias", dict(HIDDEN_BIAS=False)), ("not normalized", dict(NORMALIZE=False)),
                ("2 queries a block", dict(QUERIES_PER_BLOCK=2))]
    tiles = [(block_n, hidden_block, warps, stages), (128, 64, 8, 3), (128, 32, 8, 4),
             (64, 64, 8, 4), (64, 64, 4, 4)]
    short = [tiles[0], MEASURED["HIDDEN_SHORT_TILES"]]  # the plan's long and short tiles
    for mode, extra in variants:
        for n, hb, w, st in tiles if mode == "inference" else short if "argmax" in mode \
                else tiles[:1]:
            constants = dict(HEAD_FORWARD, **extra, BLOCK_N=n, HIDDEN_BLOCK=hb)
            compiled = compile_sm90(_maxsim_hidden_fwd_kernel, constants, w, st)
            label = f"{n}-token tiles, {hb} of d_model a step, {w} warps, {st} stages"
            yield "head forward (fused)", mode, label, None, *resources(compiled)


def head_cap_rows():
    """The projection head's fused forward (inference, as ``head_rows``) at small tiles on 4
    warps under register caps: what a cap that lets three or four programs share an SM costs in
    spills, loop by loop (NOTES section 76)."""
    for n, hb, w, st in ((64, 64, 4, 4), (64, 32, 4, 3), (32, 64, 4, 2), (32, 32, 4, 3)):
        for cap in (None, 168, 128):
            constants = dict(HEAD_FORWARD, BLOCK_N=n, HIDDEN_BLOCK=hb)
            compiled = compile_sm90(_maxsim_hidden_fwd_kernel, constants, w, st, cap)
            label = f"{n}-token tiles, {hb} of d_model a step, {w} warps, {st} stages"
            yield "head forward (fused)", "inference", label, cap, *resources(compiled)


def head_backward_rows():
    """The projection head's entries backward at the plan's tiles (d_model 768 → 128, bias,
    normalized): the entries kernel with and without ``grad_H``'s rows (``NEED_H``) and the
    weight kernel: how much of an SM each holds (NOTES section 75)."""
    block_e, warps, stages = MEASURED["HIDDEN_ENTRY_TILES"]
    hidden_block = MEASURED["HIDDEN_TILES"][1]
    common = dict(BLOCK_K=128, DOT_PRECISION="tf32", UPCAST=False)
    for need_h in (True, False):
        constants = dict(common, PER_QUERY_DOCS=False, NORMALIZE=True, NEED_Q=True, NEED_H=need_h,
                         NEED_W=True, HIDDEN_BIAS=True, HIDDEN_BLOCK=hidden_block, BLOCK_E=block_e)
        compiled = compile_sm90(_hidden_bwd_entries_kernel, constants, warps, stages,
                                pointers={"GradQ": "*fp32"})
        yield "head backward: entries", "grad_H's rows" if need_h else "buffers only", \
            f"{block_e} entries, {warps} warps, {stages} stages", None, *resources(compiled)
    block_t, block_c, w_warps, w_stages = MEASURED["HIDDEN_WEIGHT_TILES"]
    constants = dict(common, HAS_BIAS=True, ACCUMULATE=False, BLOCK_T=block_t, BLOCK_C=block_c)
    compiled = compile_sm90(_hidden_bwd_weight_kernel, constants, w_warps, w_stages,
                            pointers={"PartW": "*fp32", "PartB": "*fp32"})
    yield "head backward: weight", "grad_W and grad_b", \
        f"{block_t} rows a step, {block_c} columns, {w_warps} warps, {w_stages} stages", None, \
        *resources(compiled)


SECTIONS = {"forward": forward_rows, "grad_d": grad_d_rows, "gather": gather_rows,
            "index": index_rows, "head": head_rows, "head_caps": head_cap_rows,
            "head_backward": head_backward_rows}


def main() -> None:
    sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False,
                         cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    names = sys.argv[1:] or list(SECTIONS)
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    print("# Offline compile report (sm_90)\n")
    print(f"- triton {triton.__version__}, target sm_90 (no GPU), git: {sha}")
    command = " ".join(["python benchmarks/compile_report.py", *sys.argv[1:]])
    print(f"- command: `{command}`; bf16 inputs, d = 128 unless a row says\n")
    print("| kernel | mode | tiles | register cap | registers | local B/thread / shared B "
          "| SASS instructions | loops (depth: instructions LDL/STL) |")
    print("|---|---|---|---|---|---|---|---|")
    for row in (row for name in names for row in SECTIONS[name]()):
        kernel, mode, label, maxnreg, regs, stack, instructions, spills = row
        print(f"| {kernel} | {mode} | {label} | {maxnreg or '–'} | {regs} | {stack} "
              f"| {instructions} | {spills} |", flush=True)


if __name__ == "__main__":
    main()
