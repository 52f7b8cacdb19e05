"""GPU probes behind the sections of benchmarks/NOTES.md, one module a topic:

- ``forward``: the Triton forward under forced tiles, masks and normalization;
- ``hopper``: the Gluon forward, its tiles and documents a program, and its launch's host side;
- ``backward``: the backward kernels, their tiles and strategies, and whole training steps;
- ``host``: the host's side of a call: first calls, issue times, launch paths, timed intervals;
- ``common``: the helpers they share, among them the library's launchers called under a plan
  made inside ``fusedmaxsim.forced_plan`` (every probe forces its variants there).

``python3 benchmarks/probes --help`` lists the sections (no GPU needed); ``__main__`` runs them.

Deleted probes, which A/B'd this tree against copies of older package modules written out by
``git show``:

- ``norms_ahead``: deleted; its results are in NOTES.md section 33
- ``norms_handoff``: deleted; its results are in NOTES.md section 35
- ``grad_d_ab``: deleted; its results are in NOTES.md section 47
- ``dd_variants``: deleted; its results are in NOTES.md sections 48 and 49
"""

import sys
from pathlib import Path

# The package from this checkout, and benchmarks/ (profile_host, harness), whatever the working
# directory.
BENCHMARKS = Path(__file__).resolve().parents[1]
SRC = BENCHMARKS.parent / "src"
sys.path[:0] = [str(SRC), str(BENCHMARKS)]
