"""The host libraries' own offline scoring and loss tests, run with fusedmaxsim patched in.

The test files ship in the hosts' source distributions, not their wheels. They are fetched once
with pip into ``FUSEDMAXSIM_HOST_SDISTS`` (default ``~/.cache/fusedmaxsim-host-sdists``) for the
exact installed version, so the tests always match the code they exercise.

Left out on purpose: PyLate's and colpali-engine's training and model tests (they download models
from the Hugging Face Hub) and PyLate's doctests, which ``test_pylate.py`` runs itself because a
patched module no longer owns the functions whose docstrings hold them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

import pytest
from _hosts import child_env, import_colpali

pytestmark = pytest.mark.integrations

SUITES = {
    "pylate": (
        "pylate",
        ["tests/test_colbert_scores.py", "tests/test_scores_lik.py", "tests/test_scores_flash.py"],
        [],
    ),
    "colpali": (
        "colpali-engine",
        [
            "tests/utils/test_maxsim.py",
            "tests/utils/test_processing_utils.py",
            "tests/loss/test_li_losses.py",
        ],
        # fp16 / bf16 against the host's own half-precision einsum with an absolute 2e-2 on scores
        # near 50, i.e. bit for bit; fusedmaxsim accumulates in fp32 and rounds once, so it can
        # land one ulp away (closer to the exact value: test_colpali checks that instead).
        [
            f"tests/utils/test_maxsim.py::test_maxsim_{kind}_matches_einsum_baseline[{dtype}]"
            for kind in ("inbatch", "kd")
            for dtype in ("dtype1", "dtype2")
        ],
    ),
}


def host_source(dist: str) -> Path:
    """The unpacked source distribution of the installed ``dist``, fetched with pip if needed."""
    try:
        version = metadata.version(dist)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{dist} is not installed")
    cache = Path(
        os.environ.get("FUSEDMAXSIM_HOST_SDISTS", Path.home() / ".cache/fusedmaxsim-host-sdists")
    )
    stem = f"{dist.replace('-', '_')}-{version}"
    if not (cache / stem).is_dir():
        archive = cache / f"{stem}.tar.gz"
        if not archive.exists():
            cache.mkdir(parents=True, exist_ok=True)
            fetch = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    f"{dist}=={version}",
                    "-d",
                    str(cache),
                ],
                check=False,
                capture_output=True,
                text=True,
            )
            assert fetch.returncode == 0 and archive.exists(), (
                f"could not fetch the {dist} {version} sources (offline? put them in "
                f"FUSEDMAXSIM_HOST_SDISTS): {fetch.stderr[-500:]}"
            )
        with tarfile.open(archive) as tar:
            tar.extractall(cache, filter="data")
    return cache / stem


@pytest.mark.parametrize("host", list(SUITES))
def test_host_suite_passes_on_fusedmaxsim(host, tmp_path):
    dist, files, deselected = SUITES[host]
    if host == "pylate":
        pytest.importorskip("pylate.scores")
    elif not import_colpali():
        pytest.skip("colpali-engine is not installed")
    source = host_source(dist)
    report = tmp_path / "calls.json"
    env = child_env(FUSEDMAXSIM_HOST_SUITE=host, FUSEDMAXSIM_HOST_SUITE_REPORT=str(report))
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *files,
            "-q",
            "-p",
            "_host_plugin",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "--rootdir",
            str(source),
            "-W",
            "ignore::DeprecationWarning",
            *(f"--deselect={test}" for test in deselected),
        ],
        check=False,
        cwd=source,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
    calls = json.loads(report.read_text())
    assert calls["maxsim"] > 0, calls
