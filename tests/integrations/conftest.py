"""Shared set-up for the PyLate and colpali-engine integration tests.

Every test starts unpatched, with none of the variables that steer the hosts' scoring set, and
ends unpatched whatever it did.
"""

from __future__ import annotations

import pytest

ENV = ("FUSEDMAXSIM_DISABLE", "PYLATE_SCORES_BACKEND", "COLPALI_SCORES_BACKEND")


@pytest.fixture(autouse=True)
def _clean_host_state(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    yield
    from fusedmaxsim.integrations import colpali, pylate

    pylate.unpatch()
    colpali.unpatch()
