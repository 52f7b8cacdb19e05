"""Cold start (``--cold-start``): the first call in a fresh process with an empty Triton cache.

:func:`run_cold_start` starts one child process per (case, contender) with its own empty
``TRITON_CACHE_DIR``; the child (:func:`cold_start_child`, imported there as
``harness.coldstart`` with this folder's parent on its ``PYTHONPATH``) builds the inputs, then
times the first call (compilation and autotuning included) and the second, and prints them as
one JSON line.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .providers import PROVIDERS_BY_KEY, provider_unavailable
from .records import environment
from .shapes import MODE_LABELS, SHAPES_BY_NAME, make_case
from .timing import run_once, sync_fn
from .util import Progress, json_safe

# First-call latency cases: a rerank forward and a training step, per device type.
COLD_START_CASES = {
    "cuda": (("rerank_colbert", "inference"), ("train_colbert", "training")),
    "cpu": (("quick_rerank", "inference"), ("quick_train", "training")),
}


_COLD_CHILD = ("import sys\n"
               "from harness.coldstart import cold_start_child\n"
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
            section["rows"].append(json_safe(row))
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
    benchmarks_dir = str(Path(__file__).resolve().parent.parent)  # holds the harness package
    with tempfile.TemporaryDirectory(prefix="fusedmaxsim-cold-") as cache_dir:
        env = dict(os.environ, TRITON_CACHE_DIR=cache_dir, LIK_SUPPRESS_NORM_WARN="1")
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [benchmarks_dir, package_root, env.get("PYTHONPATH")]))
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
    sync = sync_fn(device)
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
