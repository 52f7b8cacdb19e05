"""pytest plugin that runs a host library's own test files with fusedmaxsim patched in.

Loaded with ``-p _host_plugin`` by ``test_host_suites.py``. ``FUSEDMAXSIM_HOST_SUITE`` names the
integration (``pylate`` or ``colpali``); the number of calls that reached fusedmaxsim is written
to ``FUSEDMAXSIM_HOST_SUITE_REPORT``, so a suite that passed without touching fusedmaxsim is
caught.
"""

from __future__ import annotations

import importlib
import json
import os

from _hosts import CallCounter, import_colpali

_counter: CallCounter | None = None


def pytest_configure(config):
    global _counter
    host = os.environ["FUSEDMAXSIM_HOST_SUITE"]
    if host == "colpali":
        import_colpali()
    integration = importlib.import_module(f"fusedmaxsim.integrations.{host}")
    integration.patch()
    _counter = CallCounter(integration).__enter__()


def pytest_unconfigure(config):
    report = os.environ.get("FUSEDMAXSIM_HOST_SUITE_REPORT")
    if report and _counter is not None:
        counts = {name: _counter.count(name) for name in CallCounter.NAMES}
        with open(report, "w") as f:
            json.dump(counts, f)
