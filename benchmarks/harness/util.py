"""Small helpers every part of the harness shares.

A progress bar on stderr (:class:`Progress`: one redrawn line on a terminal, one line per
finished item in a log), the one-line text an exception is recorded as
(:func:`describe_error`), the release of freed device memory between items
(:func:`release_memory`), and the JSON-safe copy of a record, in which a non-finite float (a
number that was not measured) becomes null (:func:`json_safe`). Imports nothing of the harness.
"""

from __future__ import annotations

import gc
import math
import sys

import torch


class Progress:
    """A tiny progress bar on stderr.

    On a terminal it redraws one line; into a log file it writes one line per finished item,
    with its result, so the log doubles as a transcript.
    """

    def __init__(self, total: int, stream=None, width: int = 24, enabled: bool = True):
        self.total = max(1, total)
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.enabled = enabled
        self.count = 0
        self.label = ""
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def _bar(self) -> str:
        filled = self.width * self.count // self.total
        return f"[{'#' * filled}{'.' * (self.width - filled)}] {self.count}/{self.total}"

    def start(self, label: str) -> None:
        self.label = label
        if self.enabled and self.tty:
            self.stream.write(f"\r\033[K{self._bar()} {label}")
            self.stream.flush()

    def done(self, result: str = "") -> None:
        self.count += 1
        if not self.enabled:
            return
        if self.tty:
            self.stream.write(f"\r\033[K{self._bar()} {self.label}: {result}")
        else:
            self.stream.write(f"{self._bar()} {self.label}: {result}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def describe_error(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text[:300]


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def json_safe(value):
    """JSON-safe copy: non-finite floats become null, since they were not measured numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
