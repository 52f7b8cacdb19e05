"""Tile heuristics, forced configurations and the opt-in autotuning's selection."""

import pytest
import torch

from fusedmaxsim import _configs, maxsim, settings
from fusedmaxsim._configs import FwdConfig, forced_configs, fwd_candidates, tuned
from fusedmaxsim.reference import maxsim_ref


def test_tuned_picks_the_fastest_skips_failures_and_measures_once():
    calls = []

    def time_ms(cfg):
        calls.append(cfg)
        if cfg == "broken":
            raise RuntimeError("out of shared memory")
        return {"a": 3.0, "b": 1.0, "c": 2.0}[cfg]

    key = ("test", object())
    assert tuned(key, ["a", "broken", "b", "c"], time_ms) == "b"
    assert tuned(key, ["a", "broken", "b", "c"], time_ms) == "b"
    assert calls == ["a", "broken", "b", "c"]
    assert tuned(("test", object()), ["x", "broken"], lambda c: 1 / 0) == "x"  # all fail: default


def test_candidates_start_with_the_heuristic_and_are_unique():
    base = _configs.fwd_config(Lq=32, dim=128, Nq=64, per_query_docs=False, elem_bytes=2)
    candidates = fwd_candidates(base)
    assert candidates[0] == base and len(candidates) == len(set(candidates)) >= 2


def test_every_candidate_computes_the_same_scores(device):
    Q = torch.randn(5, 7, 32, device=device)
    D = torch.randn(4, 37, 32, device=device)
    ref = maxsim_ref(Q.double(), D.double()).float()
    base = FwdConfig(16, 4, 32, 32, 4, 1)
    with settings.use_backend("triton"):
        for cfg in fwd_candidates(base):
            with forced_configs(cfg):
                torch.testing.assert_close(maxsim(Q, D), ref, rtol=1e-5, atol=1e-5)


def test_autotune_setting(monkeypatch):
    assert settings.autotune() is False
    settings.set_autotune(True)
    assert settings.autotune() is True
    settings.set_autotune(None)
    monkeypatch.setenv("FUSEDMAXSIM_AUTOTUNE", "1")
    settings.reload()
    try:
        assert settings.autotune() is True
    finally:
        monkeypatch.delenv("FUSEDMAXSIM_AUTOTUNE")
        settings.reload()
    assert settings.autotune() is False


@pytest.mark.parametrize("Lq,bucket", [(1, 16), (7, 16), (32, 32), (33, 64), (100, 128), (1030, 2048)])
def test_query_tiles_bucket_lengths(Lq, bucket):
    """One compiled kernel per power-of-two bucket, capped at the tile height (32 rows in the
    interpreter, 128 on a GPU at this d): longer queries loop over chunks of the same kernel."""
    cap = 32 if _configs.INTERPRETER else 128
    cfg = _configs.fwd_config(Lq=Lq, dim=64, Nq=3, per_query_docs=False, elem_bytes=4)
    assert cfg.lq_tile == min(bucket, cap)
    assert cfg == _configs.fwd_config(Lq=bucket, dim=64, Nq=3, per_query_docs=False, elem_bytes=4)
