"""The full MaxSim benchmark: every anchor shape, the peers, a plot, records under results/.

Runs the harness of ``benchmarks/harness/`` with the defaults of a full run: peers on (when
importable), plot on, and records written to ``benchmarks/results/<device>/`` (``h200`` on an
NVIDIA H200). See ``benchmarks/README.md`` for every option.

    PYTHONPATH=src python benchmarks/bench_maxsim.py                 # the suite
    PYTHONPATH=src python benchmarks/bench_maxsim.py --memory-table --cold-start
"""

import argparse
import sys
from pathlib import Path

try:
    import fusedmaxsim  # noqa: F401
except ImportError:  # a source checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from harness.cli import add_bench_arguments, run_bench
from harness.records import device_slug


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_bench_arguments(parser)
    parser.set_defaults(peers=True, plot=True)
    args = parser.parse_args(argv)
    if args.out is None:
        results = Path(__file__).resolve().parent / "results"
        args.out = results / device_slug(args.device)
    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
