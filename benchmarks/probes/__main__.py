"""Runs the probes named on the command line, each under a ``== SECTION`` line, in the order of
``SECTIONS`` below; GPU times by ``triton.testing.do_bench`` (median, ms) unless a probe says
otherwise.

    python3 benchmarks/probes SECTION...           (from the repository root)
    cd benchmarks && python3 -m probes SECTION...
    python3 benchmarks/probes --help               (the sections; needs no GPU)

Without a section it runs ``normalize kd smooth``. The package imported is this checkout's
``src``.
"""

from __future__ import annotations

import ast
import importlib
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
if not __package__:  # run as a directory, python3 benchmarks/probes: import it as a package
    sys.path[0] = str(HERE.parent)

# Section name: (module of this package, probe function), in the order they run.
SECTIONS = {
    "normalize": ("forward", "normalize_sweep"),
    "kd": ("backward", "kd_split"),
    "smooth": ("backward", "smooth_vs_naive"),
    "masked": ("forward", "masked"),
    "rerank": ("forward", "rerank_tiles"),
    "memory": ("backward", "memory"),
    "cold": ("host", "cold"),
    "small": ("forward", "small_tiles"),
    "stages": ("backward", "gather_stages"),
    "cold_profile": ("host", "cold_profile"),
    "steps": ("host", "training_steps"),
    "host": ("host", "host_costs"),
    "fwd_tiles": ("forward", "forward_tiles"),
    "launch": ("host", "launch_paths"),
    "chunks": ("forward", "query_chunks"),
    "query_registers": ("forward", "query_registers"),
    "graph_times": ("host", "graph_times"),
    "wide_rows": ("forward", "wide_rows"),
    "winner_index": ("backward", "winner_index"),
    "chunk_splits": ("forward", "chunk_splits_ab"),
    "occupancy": ("forward", "occupancy"),
    "hopper_forward": ("hopper", "hopper_forward"),
    "hopper_host": ("hopper", "hopper_host"),
    "hopper_variants": ("hopper", "hopper_variants"),
    "short_query": ("hopper", "short_query"),
    "three_programs": ("hopper", "three_programs"),
    "few_programs": ("hopper", "few_programs"),
    "half_blocks": ("hopper", "half_blocks"),
    "doc_passes": ("hopper", "doc_passes"),
    "doc_waves": ("hopper", "doc_waves"),
    "flush_writeback": ("host", "flush_writeback"),
    "step_timeline": ("host", "step_timeline"),
    "gather_steps": ("backward", "gather_steps"),
    "dd_rows": ("backward", "dd_rows"),
    "dd_steps": ("backward", "dd_steps"),
    "large_cross": ("backward", "large_cross"),
    "ragged_dd": ("backward", "ragged_dd"),
    "hopper_argmax": ("hopper", "hopper_argmax"),
    "backward_parts": ("backward", "backward_parts"),
    "backward_once": ("backward", "backward_once"),
    "mid_strategies": ("backward", "mid_strategies"),
    "host_floor": ("host", "host_floor"),
    "cpu_orientation": ("host", "cpu_orientation"),
    "hidden_tiles": ("hidden", "hidden_tiles"),
    "hidden_compiled": ("hidden", "hidden_compiled"),
    "hidden_step": ("hidden", "hidden_step_profile"),
    "hidden_caps": ("hidden", "hidden_caps"),
    "head_backward": ("hidden", "head_backward"),
    "head_host": ("hidden", "head_host"),
    "zero_fill": ("hidden", "zero_fill"),
    "hidden_route_short": ("hidden", "hidden_route_short"),
    "residual_tiles": ("plaid", "residual_tiles"),
    "residual_profile": ("plaid", "residual_profile"),
    "approx_tiles": ("plaid", "approx_tiles"),
    "search_steps": ("plaid", "search_steps"),
    "approx_hits": ("plaid", "approx_hits"),
}
DEFAULT = ("normalize", "kd", "smooth")


def _docstrings(module: str) -> tuple[str, dict]:
    """A module's docstring and its functions' docstrings, read from its source (no import, so
    neither torch nor a GPU is needed)."""
    tree = ast.parse((HERE / f"{module}.py").read_text())
    functions = {node.name: ast.get_docstring(node) or "" for node in tree.body
                 if isinstance(node, ast.FunctionDef)}
    return ast.get_docstring(tree) or "", functions


def usage() -> str:
    """The sections, grouped by module: each module's header, each section's first sentence."""
    lines = [textwrap.dedent(__doc__).strip(), "", "Sections:"]
    for module in dict.fromkeys(module for module, _ in SECTIONS.values()):
        header, functions = _docstrings(module)
        lines += ["", textwrap.fill(" ".join(header.split("\n\n")[0].split()), 96,
                                    initial_indent=f"{module}.py: ", subsequent_indent="  ")]
        for name, (owner, function) in SECTIONS.items():
            if owner == module:
                first = " ".join(functions[function].split("\n\n")[0].split())
                first = first.split(". ")[0].rstrip(".")
                lines.append(textwrap.fill(f"{name:16s} {first}", 96,
                                           initial_indent="  ", subsequent_indent=" " * 19))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print(usage())
        return 0
    wanted = set(argv) or set(DEFAULT)
    unknown = sorted(wanted - set(SECTIONS))
    if unknown:
        print(f"unknown section(s): {' '.join(unknown)} (--help lists them; the "
              "deleted ones are listed in probes/__init__.py)", file=sys.stderr)
        return 2
    for name, (module, function) in SECTIONS.items():
        if name in wanted:
            probe = getattr(importlib.import_module(f"probes.{module}"), function)
            print(f"== {name}", flush=True)
            probe()
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
