"""Records: what a run writes, and the environment that lets a reader trust or reproduce it.

:func:`environment` collects the date, device, GPU and driver, CUDA, Python, torch, Triton,
fusedmaxsim and peer versions, and the git sha of this checkout with a dirty flag
(:func:`git_state`, also used by ``benchmarks/bench_ragged.py``). A record file (schema
:data:`SCHEMA`) holds ``env`` and the ``suite``, ``memory_table`` and ``cold_start`` sections;
:func:`write_outputs` rewrites ``maxsim_bench.json`` and ``.md`` (and ``.png``) atomically.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import torch

from .report import render_markdown, write_plot
from .util import json_safe

SCHEMA = "fusedmaxsim.bench/1"
RECORD_STEM = "maxsim_bench"


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


def _fp32_precisions() -> dict:
    """PyTorch's fp32 matmul setting, and what fusedmaxsim's fp32 inputs use under it (``tf32``,
    ``tf32x3`` or ``ieee``), where fusedmaxsim is importable."""
    try:
        from fusedmaxsim import settings
    except ImportError:
        return {}
    return dict(fp32_matmul_precision=settings.torch_matmul_setting(),
                fusedmaxsim_fp32_precision=settings.fp32_precision())


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
                   **_fp32_precisions())
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
    _write_atomic(paths[0], json.dumps(json_safe(record), indent=1, allow_nan=False) + "\n")
    _write_atomic(paths[1], render_markdown(record))
    if plot:
        png = write_plot(record, out_dir / f"{RECORD_STEM}.png")
        if png is not None:
            paths.append(png)
    return paths
