"""Offline sm_90 compile of the Gluon forward (``hopper_forward``) with the installed Triton, no
GPU needed: registers, spills, shared memory, and whether the SASS keeps one product in flight
while the previous tile's max runs (benchmarks/NOTES.md section 30). Run it under each Triton
release the package supports:

    python3 benchmarks/compile_hopper.py [argmax]

(``argmax``: only the variants of the argmax forward.)

Each line: the tiles, then `overlap` when the loop waits with one product outstanding
(`WARPGROUP.DEPBAR.LE gsb0, 0x1`) and `SERIALIZED` when every product is waited for right after
its issue, as ptxas does when it cannot keep an accumulator in flight.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from compile_report import dump  # noqa: E402

from fusedmaxsim._launch.forward import gluon_constexprs, gluon_layouts  # noqa: E402
from fusedmaxsim.kernels import hopper_forward  # noqa: E402

POINTERS = {"Q": "*bf16", "Out": "*fp32", "Argmax": "*i16"}


def _descriptor_type(desc) -> str:
    if hasattr(desc, "__mangle__"):  # triton 3.9
        return desc.__mangle__()
    from triton.runtime.jit import mangle_type

    return mangle_type(desc)


def compile_forward(lq_tile: int, queries_per_block: int, block_n: int, stages: int, dim: int = 128,
                    normalize: bool = False, warps: int = 4, tiles_first: bool = False,
                    max_registers: int | None = None, docs_per_program: int = 1,
                    save_argmax: bool = False):
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    d_layout = gluon_layouts(torch.bfloat16, lq_tile * queries_per_block, block_n, dim, warps)[1]
    documents = torch.empty(64 * 1024, dim, dtype=torch.bfloat16)
    desc = TensorDescriptor(documents, list(documents.shape), list(documents.stride()), [block_n, dim],
                            d_layout)
    kernel = hopper_forward._maxsim_fwd_overlap_kernel
    constants = gluon_constexprs(torch.bfloat16, lq_tile, queries_per_block, block_n, stages, dim,
                                 warps, normalize, tiles_first, docs_per_program, save_argmax)
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name == "d_desc":
            signature[name] = _descriptor_type(desc)
        elif name in POINTERS:
            signature[name] = POINTERS[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
    source = GluonASTSource(kernel, signature,
                            {(kernel.arg_names.index(k),): v for k, v in constants.items()}, attrs)
    options = dict(num_warps=warps)
    if max_registers is not None:
        options["maxnreg"] = max_registers
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def report(compiled) -> str:
    usage, sass = dump(compiled)
    registers = re.search(r"REG:(\d+)", usage).group(1)
    stack = re.search(r"STACK:(\d+)", usage).group(1)
    products = len(re.findall(r"HGMMA", sass))
    waits_each = len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0", sass))
    overlap = "overlap" if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass and waits_each < products // 2 \
        else "SERIALIZED"
    return (f"{registers} registers, {stack} B stack, {compiled.metadata.shared} B shared, "
            f"{products} HGMMA, {waits_each} full waits: {overlap}")


def main() -> None:
    print(f"triton {triton.__version__}, Gluon available: {hopper_forward.AVAILABLE}")
    # (normalize, query tile rows, queries a block, document tile, stages, warps, tiles first,
    # register cap[, documents a program])
    variants = []
    for normalize in (False, True):
        for lq_tile, qpb in ((128, 1), (32, 4)):
            for block_n, stages, warps in ((64, 4, 4), (32, 6, 4), (64, 4, 8)):
                variants.append((normalize, lq_tile, qpb, block_n, stages, warps, False, None))
            # Three programs an SM: 168 registers, at most 75 KB of shared memory (section 34).
            for block_n, stages in ((32, 5), (32, 4)):
                variants.append((normalize, lq_tile, qpb, block_n, stages, 4, False, 168))
            # Grids of at most one program an SM (section 34).
            variants.append((normalize, lq_tile, qpb, 64, 6, 8, False, None))
    variants.append((False, 64, 1, 64, 4, 4, False, None))
    # The reranking variants, documents from DRAM: the ring filled before the query chunk.
    variants += [(False, 128, 1, 64, 4, 4, True, None), (True, 128, 1, 64, 4, 4, True, None),
                 (False, 32, 2, 32, 6, 4, True, None), (False, 128, 1, 32, 5, 4, True, 168),
                 (True, 128, 1, 32, 5, 4, True, 168), (False, 32, 2, 32, 6, 4, True, 168)]
    variants = [(*variant, 1) for variant in variants]
    # Several documents a program (sections 38 and 41): the dispatched tile sets that take them,
    # at the counts section 41's rules pick for the suite's shapes and the reranks it measured.
    variants += [(False, 32, 4, 64, 3, 4, False, None, 8), (True, 32, 4, 32, 4, 4, False, 168, 4),
                 (False, 128, 1, 64, 4, 4, True, None, 4), (True, 128, 1, 64, 4, 4, True, None, 4),
                 (False, 32, 2, 32, 6, 4, True, None, 4), (False, 128, 1, 64, 6, 8, False, None, 2),
                 (False, 32, 4, 64, 3, 4, False, None, 16), (True, 32, 4, 32, 4, 4, False, 168, 8),
                 (False, 128, 1, 64, 4, 4, True, None, 2), (True, 128, 1, 64, 4, 4, True, None, 8),
                 (False, 32, 2, 32, 6, 4, True, None, 8), (True, 32, 2, 32, 4, 4, True, 168, 2)]
    variants = [(*variant, False) for variant in variants]
    # The argmax forward (section 42): the tile sets its training shapes dispatch.
    argmax = [(False, 128, 1, 64, 4, 4, False, None, 1, True),
              (False, 128, 1, 64, 6, 8, False, None, 1, True),
              (False, 32, 4, 64, 3, 4, False, None, 1, True),
              (False, 32, 4, 64, 3, 4, False, None, 8, True),
              (False, 32, 2, 32, 6, 4, True, None, 1, True),
              (False, 128, 1, 32, 5, 4, False, 168, 1, True)]
    variants = argmax if sys.argv[1:] == ["argmax"] else variants + argmax
    for normalize, lq_tile, qpb, block_n, stages, warps, tiles_first, cap, docs, save in variants:
        label = (f"{'normalize' if normalize else 'argmax' if save else 'scores'}, "
                 f"rows {lq_tile}x{qpb}, "
                 f"{block_n}-token tiles, {stages} stages, {warps} warps"
                 f"{', tiles first' if tiles_first else ''}"
                 f"{f', at most {cap} registers' if cap else ''}"
                 f"{f', {docs} documents a program' if docs > 1 else ''}")
        try:
            compiled = compile_forward(lq_tile, qpb, block_n, stages, normalize=normalize,
                                       warps=warps, tiles_first=tiles_first, max_registers=cap,
                                       docs_per_program=docs, save_argmax=save)
            print(f"  {label}: {report(compiled)}", flush=True)
        except Exception as exc:  # noqa: BLE001 (a release whose Gluon cannot build it: say so)
            print(f"  {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)


if __name__ == "__main__":
    main()
