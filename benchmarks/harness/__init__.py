"""Benchmark harness: fusedmaxsim against its peers and naive PyTorch, in one process.

This package backs ``benchmarks/bench_maxsim.py``; it is not part of the installed fusedmaxsim
(whose ``fusedmaxsim bench`` is a small fused-against-naive timing of its own). Every provider
is timed on the same inputs in the same process, so the numbers compare like with like.

* **Shapes.** ``all`` is the sixteen shapes whose peer numbers were recorded on an H200
  (their anchors travel with the records as the numbers to beat). ``quick`` is a set of small
  shapes that run in seconds on a CPU.
* **Parity gate.** Before a provider is timed on a (shape, mode), its scores and gradients are
  compared with the float64 oracle ``fusedmaxsim.reference.maxsim_ref`` on the same inputs
  (scores in the max norm, gradients in the Frobenius norm: see ``parity.GRAD_TOL``). A
  fast but wrong kernel is recorded as failed and is never timed, so it can never win. The
  naive baselines are timed even when bf16 rounding puts them outside the tolerance: they are
  the yardstick, not contenders.
* **Metrics.** Median, p20 and p80 of one call (``triton.testing.do_bench`` on CUDA,
  ``time.perf_counter`` on CPU), TFLOP/s, the share of a roofline floor whose two ceilings
  are measured in the same run, wall time per call including host overhead, and peak memory
  above the inputs.
* **Sections.** ``--memory-table`` records op-level memory of ColPali in-batch training.
  ``--cold-start`` times a first call in a fresh process with an empty Triton cache.

The modules, by concern: ``shapes`` (problems and inputs), ``providers`` (the implementations
under test), ``parity`` (the float64 gate), ``timing`` (timers, rounds, roofline), ``suite``
(gate then time every item), ``targets`` (the issue's targets and the summary), ``memory`` and
``coldstart`` (the two extra sections), ``records`` (environment, JSON files), ``report``
(markdown, plot), ``cli`` (options and the run), ``util`` (progress bar and small helpers).
They import each other relatively and use only fusedmaxsim's public API. Import them as
``harness.<module>`` with the ``benchmarks`` folder on ``sys.path`` (a script in that folder
has it there already; the tests and the cold-start child put it there).

Only torch is imported at module import. Triton, the peers and matplotlib are imported when
they are used, so the harness also runs on a machine that has none of them.
"""
