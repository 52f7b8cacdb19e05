"""Every bad input gets a clear ValueError / TypeError naming the argument, before any launch."""

import pytest
import torch

from fusedmaxsim import (
    MaxSimScorer,
    maxsim,
    maxsim_padded,
    maxsim_pairs,
    maxsim_ragged,
    maxsim_varlen,
    pack_padded,
    retrieve,
    score_pairs_packed,
    settings,
)

Q = torch.randn(2, 7, 32)
D = torch.randn(3, 13, 32)
DC = torch.randn(2, 4, 13, 32)


@pytest.mark.parametrize(
    "call,error,pattern",
    [
        (lambda: maxsim(Q, torch.randn(3, 13, 16)), ValueError, r"embedding dim d.*\(2, 7, 32\).*\(3, 13, 16\)"),
        (lambda: maxsim(Q, D.to("meta")), ValueError, "Q is on cpu but D is on meta: Q and D must be on the same device"),
        (lambda: maxsim(Q, D, q_mask=torch.ones(2, 7, dtype=torch.bool, device="meta")), ValueError, "q_mask is on meta but Q is on cpu: q_mask must be on the same device as Q"),
        (lambda: maxsim(Q, D, d_mask=torch.ones(3, 13, device="meta")), ValueError, "d_mask is on meta"),
        (lambda: maxsim(torch.randn(1, 2, 7, 32), D), ValueError, r"Q must be \[Lq, d\] or \[Nq, Lq, d\]"),
        (lambda: maxsim(torch.randn(32), D), ValueError, r"Q must be"),
        (lambda: maxsim(Q, torch.randn(1, 1, 3, 13, 32)), ValueError, r"D must be \[Ld, d\]"),
        (lambda: maxsim(Q, D, q_mask=torch.ones(2, 6)), ValueError, r"q_mask must be \[Nq, Lq\] = \(2, 7\) \(the token axes of Q\), got \(2, 6\)"),
        (lambda: maxsim(Q, D, d_mask=torch.ones(13, 3)), ValueError, r"d_mask must be \[Nd, Ld\] = \(3, 13\)"),
        (lambda: maxsim(Q, DC, d_mask=torch.ones(2, 13)), ValueError, r"d_mask must be \[Nq, K, Ld\] = \(2, 4, 13\)"),
        (lambda: maxsim(Q, DC, q_mask=torch.ones(2, 8)), ValueError, r"q_mask must be \[Nq, Lq\] = \(2, 7\).*got \(2, 8\)"),
        (lambda: maxsim(Q[0], torch.randn(7, 32), q_mask=torch.ones(2, 7)), ValueError, r"q_mask must be \[Lq\] = \(7,\)"),
        (lambda: maxsim(Q[0], torch.randn(7, 32), d_mask=torch.ones(8)), ValueError, r"d_mask must be \[Ld\] = \(7,\)"),
        (lambda: maxsim(Q, torch.randn(3, 4, 13, 32)), ValueError, r"candidate layout \(D \[Nq, K, Ld, d\]\) needs D.shape\[0\] == Q.shape\[0\].*got D \(3, 4, 13, 32\) and Q \(2, 7, 32\)"),
        (lambda: maxsim(Q[0], DC), ValueError, r"candidate layout .* needs Q to be \[Nq, Lq, d\], got Q \(7, 32\)"),
        (lambda: maxsim(Q.int(), D), TypeError, r"Q must be float16, bfloat16, float32 or float64, got torch.int32"),
        (lambda: maxsim(Q, D.to(torch.complex64)), TypeError, r"D must be float16.*complex64"),
        (lambda: maxsim(Q, D, d_mask=torch.ones(3, 13, dtype=torch.complex64)), TypeError, "d_mask must be bool or real"),
        (lambda: maxsim(Q.tolist(), D), TypeError, "Q must be a torch.Tensor, got list"),
        (lambda: maxsim(Q, D, q_mask=[[1] * 7] * 2), TypeError, "q_mask must be a torch.Tensor or None"),
        (lambda: maxsim(Q, D, backward="csr"), ValueError, r"backward= must be one of \('auto', 'unified', 'lowmem'\)"),
        (lambda: maxsim_pairs(Q, D), ValueError, r"as many queries as documents \(Q.shape\[0\] == D.shape\[0\]\), got Q \(2, 7, 32\), D \(3, 13, 32\)"),
        (lambda: maxsim_pairs(Q[0], D[0]), ValueError, r"maxsim_pairs needs both Q and D to be \[B, L, d\] \(Q \[B, Lq, d\], D \[B, Ld, d\]\), got Q \(7, 32\), D \(13, 32\)"),
        (lambda: maxsim_pairs(Q, DC), ValueError, r"maxsim_pairs needs both Q and D to be \[B, L, d\].*D \(2, 4, 13, 32\)"),
        (lambda: maxsim_pairs(Q, D[:2], d_mask=torch.ones(2, 12)), ValueError, r"d_mask must be \[B, Ld\] = \(2, 13\)"),
    ],
)
def test_bad_input_is_refused_with_a_clear_message(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


QP, DP = Q.reshape(-1, 32), D.reshape(-1, 32)
CU_Q, CU_D = torch.tensor([0, 7, 14]), torch.tensor([0, 13, 26, 39])
LENGTHS_Q, LENGTHS_D = torch.tensor([7, 3]), torch.tensor([[13, 2, 5, 1], [4, 13, 0, 9]])

# Every boolean keyword of the public API, called with a value that is not a Python bool.
BOOLEAN_KEYWORDS = {
    "maxsim normalize": lambda v: maxsim(Q, D, normalize=v),
    "maxsim_pairs normalize": lambda v: maxsim_pairs(Q, D[:2], normalize=v),
    "maxsim_varlen normalize": lambda v: maxsim_varlen(QP, DP, CU_Q, CU_D, normalize=v),
    "maxsim_varlen validate": lambda v: maxsim_varlen(QP, DP, CU_Q, CU_D, validate=v),
    "score_pairs_packed normalize": lambda v: score_pairs_packed(
        QP, DP, CU_Q, CU_D, torch.tensor([0, 1]), torch.tensor([2, 0]), normalize=v),
    "maxsim_ragged normalize": lambda v: maxsim_ragged([Q[0]], [D[0]], normalize=v),
    "maxsim_padded normalize": lambda v: maxsim_padded(Q, DC, LENGTHS_Q, LENGTHS_D, normalize=v),
    "maxsim_padded validate": lambda v: maxsim_padded(Q, DC, LENGTHS_Q, LENGTHS_D, validate=v),
    "pack_padded validate": lambda v: pack_padded(Q, DC, LENGTHS_Q, LENGTHS_D, validate=v),
    "retrieve normalize": lambda v: retrieve(Q, D, 2, normalize=v),
    "retrieve largest": lambda v: retrieve(Q, D, 2, normalize=False, largest=v),
    "retrieve sorted": lambda v: retrieve(Q, D, 2, normalize=False, sorted=v),
    "retrieve progress": lambda v: retrieve(Q, D, 2, normalize=False, progress=v),
    "MaxSimScorer normalize": lambda v: MaxSimScorer(normalize=v),
}


@pytest.mark.parametrize("value", ["yes", 1, 0, torch.tensor(True)], ids=["str", "one", "zero", "tensor"])
@pytest.mark.parametrize("where", list(BOOLEAN_KEYWORDS))
def test_boolean_options_take_a_python_bool_only(where, value):
    name = where.split()[1]
    allowed = "True, False or None" if name == "validate" else r"True or False \(a Python bool\)"
    with pytest.raises(TypeError, match=rf"^{name} must be {allowed}, got "):
        BOOLEAN_KEYWORDS[where](value)


@pytest.mark.parametrize("where", list(BOOLEAN_KEYWORDS))
def test_boolean_options_accept_true_and_false(where):
    for value in (True, False):
        BOOLEAN_KEYWORDS[where](value)


def _leaves():
    return Q.clone().requires_grad_(True), D.clone().requires_grad_(True)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize(
    "score",
    [
        lambda q, d, n: maxsim(q, d, normalize=n),
        lambda q, d, n: maxsim(q, d, reduction="smoothmax", normalize=n),
        lambda q, d, n: maxsim_varlen(q.reshape(-1, 32), d.reshape(-1, 32), CU_Q, CU_D, normalize=n),
    ],
    ids=["maxsim", "maxsim-smoothmax", "maxsim_varlen"],
)
def test_double_backward_says_it_is_not_supported(backend, score, normalize):
    q, d = _leaves()
    first = torch.autograd.grad(score(q, d, normalize).sum(), q, create_graph=True)[0]
    plain = torch.autograd.grad(score(q, d, normalize).sum(), q)[0]
    assert torch.equal(first, plain)  # create_graph=True changes nothing in the first backward
    with pytest.raises(RuntimeError, match="fusedmaxsim: double backward is not supported"):
        first.sum().backward()
    # A gradient that only flows back into D, and a weight that itself requires grad.
    weight = torch.ones(2, 3, requires_grad=True)
    grad_d = torch.autograd.grad(score(q, d, normalize), d, weight, create_graph=True)[0]
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(grad_d.sum(), weight)


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
    before = settings.fp32_precision()
    other = "tf32" if before == "ieee" else "ieee"
    with settings.use_fp32_precision(other):
        assert settings.fp32_precision() == other
        with settings.use_backend("torch"):
            assert settings.backend() == "torch"
        assert settings.backend() == "auto"
    assert settings.fp32_precision() == before


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


@pytest.mark.parametrize(
    "call,error,pattern",
    [
        (lambda: maxsim_ragged([Q[0]], [D[0], D[1].to("meta")]), ValueError,
         r"every sequence must be on cpu; documents\[1\] is on meta"),
        (lambda: maxsim_ragged([Q[0], Q[1].to("meta")], [D[0]]), ValueError,
         r"every sequence must be on cpu; queries\[1\] is on meta"),
        (lambda: MaxSimScorer(normalize=False)(QP, DP, cu_seqlens_d=CU_D), ValueError,
         r"without cu_seqlens_q, Q must be \[Nq, Lq, d\], got shape \(14, 32\)"),
    ],
    ids=["ragged-documents-device", "ragged-queries-device", "scorer-packed-documents-2d-Q"],
)
def test_more_bad_inputs_are_refused_with_a_clear_message(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_forcing_an_unknown_decision_is_refused():
    from fusedmaxsim.planning import forced_plan

    with pytest.raises(ValueError, match=r"forced_plan: unknown decisions \['kernal'\]; known: "
                                         r"\[.*'kernel'.*\]"):
        with forced_plan(kernal="triton"):
            pass


def test_the_testing_helpers_say_what_differs():
    from fusedmaxsim.testing import assert_close_to_reference, relative_error

    with pytest.raises(AssertionError, match=r"shape \(2, 3\) != reference shape \(3, 2\)"):
        relative_error(torch.zeros(2, 3), torch.zeros(3, 2))
    out, ref = torch.zeros(2, 3), torch.ones(2, 3)
    out[1, 2] = -3.0
    with pytest.raises(AssertionError, match=r"^scores: relative error 4\.000e\+00 > 1\.0e-03; "
                                             r"worst at \(1, 2\): got -3\.0, expected 1\.0$"):
        assert_close_to_reference(out, ref, 1e-3, "scores")
    assert_close_to_reference(ref, ref, 0.0)
