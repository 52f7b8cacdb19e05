"""Every bad input gets a clear ValueError / TypeError naming the argument, before any launch."""

import pytest
import torch

from fusedmaxsim import maxsim, maxsim_pairs, settings

Q = torch.randn(2, 7, 32)
D = torch.randn(3, 13, 32)
DC = torch.randn(2, 4, 13, 32)


@pytest.mark.parametrize(
    "call,error,pattern",
    [
        (lambda: maxsim(Q, torch.randn(3, 13, 16)), ValueError, r"embedding dim d.*\(2, 7, 32\).*\(3, 13, 16\)"),
        (lambda: maxsim(Q, D.to("meta")), ValueError, "Q is on cpu but D is on meta"),
        (lambda: maxsim(Q, D, q_mask=torch.ones(2, 7, dtype=torch.bool, device="meta")), ValueError, "q_mask is on meta"),
        (lambda: maxsim(Q, D, d_mask=torch.ones(3, 13, device="meta")), ValueError, "d_mask is on meta"),
        (lambda: maxsim(torch.randn(1, 2, 7, 32), D), ValueError, r"Q must be \[Lq, d\] or \[Nq, Lq, d\]"),
        (lambda: maxsim(torch.randn(32), D), ValueError, r"Q must be"),
        (lambda: maxsim(Q, torch.randn(1, 1, 3, 13, 32)), ValueError, r"D must be \[Ld, d\]"),
        (lambda: maxsim(Q, D, q_mask=torch.ones(2, 6)), ValueError, r"q_mask must have shape \(2, 7\).*got \(2, 6\)"),
        (lambda: maxsim(Q, D, d_mask=torch.ones(13, 3)), ValueError, r"d_mask must have shape \(3, 13\)"),
        (lambda: maxsim(Q, DC, d_mask=torch.ones(2, 13)), ValueError, r"d_mask must have shape \(2, 4, 13\)"),
        (lambda: maxsim(Q[0], torch.randn(7, 32), q_mask=torch.ones(2, 7)), ValueError, r"q_mask must have shape \(7,\)"),
        (lambda: maxsim(Q, torch.randn(3, 4, 13, 32)), ValueError, r"D.shape\[0\] == Nq"),
        (lambda: maxsim(Q[0], DC), ValueError, r"candidate layout .* needs Q \[Nq, Lq, d\]"),
        (lambda: maxsim(Q.int(), D), TypeError, r"Q must be float16, bfloat16, float32 or float64, got torch.int32"),
        (lambda: maxsim(Q, D.to(torch.complex64)), TypeError, r"D must be float16.*complex64"),
        (lambda: maxsim(Q, D, d_mask=torch.ones(3, 13, dtype=torch.complex64)), TypeError, "d_mask must be bool or real"),
        (lambda: maxsim(Q.tolist(), D), TypeError, "Q must be a torch.Tensor, got list"),
        (lambda: maxsim(Q, D, q_mask=[[1] * 7] * 2), TypeError, "q_mask must be a torch.Tensor or None"),
        (lambda: maxsim(Q, D, backward="csr"), ValueError, r"backward= must be one of \('auto', 'unified', 'lowmem'\)"),
        (lambda: maxsim_pairs(Q, D), ValueError, "as many queries as documents"),
        (lambda: maxsim_pairs(Q[0], D[0]), ValueError, r"maxsim_pairs needs Q \[B, Lq, d\]"),
        (lambda: maxsim_pairs(Q, D[:2], d_mask=torch.ones(2, 12)), ValueError, r"d_mask must have shape \(2, 13\)"),
    ],
)
def test_bad_input_is_refused_with_a_clear_message(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_forcing_triton_where_it_cannot_run():
    with settings.use_backend("triton"), pytest.raises(RuntimeError, match="FUSEDMAXSIM_BACKEND=triton cannot run here"):
        maxsim(Q.to("meta"), D.to("meta"))


def test_unknown_settings_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="must be one of"):
        settings.set_backend("cuda")
    with pytest.raises(ValueError, match="tf32"):
        settings.set_fp32_precision("fp16")
    try:
        monkeypatch.setenv("FUSEDMAXSIM_BACKEND", "gpu")
        settings.reload()
        with pytest.raises(ValueError, match="FUSEDMAXSIM_BACKEND"):
            maxsim(Q, D)
        monkeypatch.delenv("FUSEDMAXSIM_BACKEND")
        monkeypatch.setenv("FUSEDMAXSIM_TORCH_BLOCK_MB", "lots")
        settings.reload()
        with pytest.raises(ValueError, match="FUSEDMAXSIM_TORCH_BLOCK_MB"):
            settings.torch_block_bytes()
    finally:
        monkeypatch.undo()
        settings.reload()


def test_settings_scopes_restore_the_previous_value():
    assert settings.fp32_precision() == "tf32"
    with settings.use_fp32_precision("ieee"):
        assert settings.fp32_precision() == "ieee"
        with settings.use_backend("torch"):
            assert settings.backend() == "torch"
        assert settings.backend() == "auto"
    assert settings.fp32_precision() == "tf32"


def test_settings_follow_setters_and_reload(monkeypatch):
    """The resolved settings are remembered between calls (a call reads two of them) and
    forgotten on every change: a setter, a scope's end, a reload of the environment."""
    assert settings.backend() == "auto"
    monkeypatch.setenv("FUSEDMAXSIM_BACKEND", "torch")
    assert settings.backend() == "auto"  # the environment is read at import and on reload
    settings.reload()
    try:
        assert settings.backend() == "torch"
        settings.set_backend("triton")
        assert settings.backend() == "triton"
        with settings.use_backend("auto"):
            assert settings.backend() == "auto"
        assert settings.backend() == "triton"
        settings.set_backend(None)
        assert settings.backend() == "torch"
    finally:
        monkeypatch.delenv("FUSEDMAXSIM_BACKEND")
        settings.reload()
    assert settings.backend() == "auto"
